"""Lean host memory against exact: the loss curves and eval losses of the embedded default.

Why: 8-bit Adam moments are a trade (6 B/param of host RAM for rounded moments); the quality
side of it is measured here, not assumed. Runs ``examples/run_clm.py --stronghold`` twice on
the same seed and data, ``--optim adamw_torch`` (exact: fp32 moments) and ``--optim
adamw_8bit`` (host_memory="lean"), each in its own process, and reads back their
``trainer_state.json`` and ``eval_results.json``.

Output: one JSON line per run (``bench: "lean"``, the train-loss curve, eval_loss, runtime and
the host bytes per parameter the Trainer logged), then a summary line with
``eval_loss_ratio_lean_vs_exact``. ``plot_results.py`` draws the curves (lean_loss_curves.png).

    python benchmarks/bench_lean.py                      # 150 steps, lr 1e-3 (about 2 min on 2 cores)
    python benchmarks/bench_lean.py --max_steps 1000     # the longer run
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODES = {"exact": "adamw_torch", "lean": "adamw_8bit"}


def run(mode: str, out: str, args: argparse.Namespace) -> dict:
    cmd = [sys.executable, os.path.join(ROOT, "examples", "run_clm.py"), "--stronghold", "--optim", MODES[mode],
           "--do_train", "--do_eval", "--output_dir", out, "--max_steps", str(args.max_steps),
           "--learning_rate", str(args.learning_rate), "--logging_steps", str(args.logging_steps), "--seed", "0",
           "--report_to", "none", "--disable_tqdm", "true"]
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    started = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
    if proc.returncode != 0:
        sys.exit(f"{mode}: run_clm failed:\n{proc.stderr[-4000:]}")
    with open(os.path.join(out, "trainer_state.json")) as f:
        history = json.load(f)["log_history"]
    with open(os.path.join(out, "eval_results.json")) as f:
        evaluated = json.load(f)
    train = [(h["step"], h["loss"]) for h in history if "loss" in h]
    host = [h["stronghold_host_bytes_per_param"] for h in history if "stronghold_host_bytes_per_param" in h]
    return {"bench": "lean", "mode": mode, "optim": MODES[mode], "max_steps": args.max_steps,
            "learning_rate": args.learning_rate, "steps": [s for s, _ in train], "train_loss": [x for _, x in train],
            "eval_loss": evaluated["eval_loss"], "host_bytes_per_param": host[-1] if host else None,
            "wall_s": round(time.perf_counter() - started, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--max_steps", type=int, default=150)
    ap.add_argument("--learning_rate", type=float, default=1e-3)
    ap.add_argument("--logging_steps", type=int, default=5)
    args = ap.parse_args()
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        for mode in MODES:
            rows[mode] = run(mode, os.path.join(tmp, mode), args)
            print(json.dumps(rows[mode]), flush=True)
    exact, lean = rows["exact"]["eval_loss"], rows["lean"]["eval_loss"]
    print(json.dumps({"bench": "lean", "summary": True, "max_steps": args.max_steps, "eval_loss_exact": exact,
                      "eval_loss_lean": lean, "eval_loss_ratio_lean_vs_exact": round(lean / exact, 4),
                      "target_within_2_percent": abs(lean / exact - 1) <= 0.02,
                      "host_bytes_per_param": {m: r["host_bytes_per_param"] for m, r in rows.items()}}))


if __name__ == "__main__":
    main()
