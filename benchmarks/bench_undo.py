"""The undo of a speculative CPU Adam update: torch ops against the native one-pass kernel.

Why: a missed speculation undoes every block's update and redoes it on the host worker, and
the forward waits for both (issue #34: ~0.5 s per miss on the H200, each block ~27 ms). The
torch undo (speculation.py, ``kernel="torch"``) makes about ten passes over the block's fp32
state; the native one (optim/undo_native.py) one, 28 B/param like the update itself.

Setup: one GPT-2-medium block (12.6M fp32 parameters, in its real tensor shapes), split into
the Trainer's decay / no-decay groups, undone one ``undo_adamw_`` call per group as
``HybridOptimizer.undo_speculation`` does, on every core. Each undo follows a CPUAdam update
with the same gradient and ``grad_mul`` (so it inverts a real step and the state stays that
of training), with fp32 and bf16 gradients. Variants run interleaved (the order rotates
each round) and the medians are reported, with the paired ratio (median over rounds of
torch / native, timed back to back), because these shared machines drift by +-30%.

A miss then redoes the update with the step's coefficient. With the native kernels that redo
runs fused with the undo when it reads the same gradients (``CPUAdam.redo_groups``, one pass
over the state): ``miss_apart`` times the undo then the update, ``miss_fused`` the fused pass,
each after a speculative update and followed (untimed) by the undo of the redo, so the state
stays that of training; ``miss_fused_speedup_paired`` is their paired ratio.

Output: one JSON object per line; the LAST line is the summary.

    python benchmarks/bench_undo.py             # ~1 min on 2 cores
    python benchmarks/bench_undo.py --smoke     # seconds, a small block
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

# [Note: OpenMP wait policy] in bench_step.py: PASSIVE, set before torch loads.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's package first

import torch  # noqa: E402

from stronghold_hf.optim import CPUAdam  # noqa: E402
from stronghold_hf.optim.cpu_adam import native_kernel_error  # noqa: E402
from stronghold_hf.optim.undo_native import native_undo_error  # noqa: E402
from stronghold_hf.speculation import undo_adamw_  # noqa: E402

LR, BETAS, EPS, WD, GRAD_MUL = 1e-3, (0.9, 0.999), 1e-8, 0.1, 0.37


def gpt2_block_shapes(d: int) -> tuple[list[tuple[int, ...]], list[tuple[int, ...]]]:
    """A GPT-2 block's parameters: (decayed weights, undecayed biases and LayerNorms)."""
    weights = [(d, 3 * d), (d, d), (d, 4 * d), (4 * d, d)]
    others = [(d,), (d,), (3 * d,), (d,), (4 * d,), (d,), (d,), (d,)]
    return weights, others


def emit(obj: dict) -> None:
    print(json.dumps(obj), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--d_model", type=int, default=1024, help="GPT-2 width (1024: medium, 12.6M per block)")
    ap.add_argument("--repeats", type=int, default=9, help="timed rounds per variant")
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)), help="intra-op threads (all cores)")
    ap.add_argument("--smoke", action="store_true", help="a d_model=128 block, 2 rounds")
    args = ap.parse_args()
    if args.smoke:
        args.d_model, args.repeats = 128, 2
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    weights, others = gpt2_block_shapes(args.d_model)
    groups = [[torch.randn(s) for s in weights], [torch.randn(s) for s in others]]  # fp32 masters
    numel = sum(p.numel() for g in groups for p in g)
    opt = CPUAdam([{"params": groups[0], "weight_decay": WD}, {"params": groups[1], "weight_decay": 0.0}],
                  lr=LR, betas=BETAS, eps=EPS)
    grads = {dt: [[torch.randn(p.shape).mul_(1e-2).to(dt) for p in g] for g in groups]
             for dt in (torch.float32, torch.bfloat16)}
    for g in groups:
        for p in g:
            p.grad_dtype = None  # bf16 host gradients on fp32 masters, as the engine keeps them
    kernels = ["native", "torch"] if native_undo_error() is None else ["torch"]
    emit({"config": True, "numel": numel, "d_model": args.d_model, "threads": args.threads, "repeats": args.repeats,
          "kernels": kernels, "native_undo_error": native_undo_error(), "cpu_adam_kernel": opt.kernel,
          "cpu_adam_native_error": native_kernel_error(), "torch": torch.__version__,
          "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY")})

    def update(dt: torch.dtype) -> float:
        for g, gs in zip(groups, grads[dt]):
            for p, gr in zip(g, gs):
                p.grad = gr
        t0 = time.perf_counter()
        opt.step_groups([0, 1], inv_loss_scale=GRAD_MUL)
        return time.perf_counter() - t0

    def undo(dt: torch.dtype, kernel: str) -> float:
        t0 = time.perf_counter()
        for gi, (g, gs) in enumerate(zip(groups, grads[dt])):
            hyper = {k: opt.param_groups[gi][k] for k in ("lr", "betas", "eps", "weight_decay")}
            undo_adamw_(g, gs, [opt.state[p] for p in g], hyper, GRAD_MUL, kernel=kernel)
        return time.perf_counter() - t0

    REDO_MUL = 0.5  # the step's coefficient (it clipped): not the speculative update's

    def hyper_of(gi: int) -> dict:
        return {k: opt.param_groups[gi][k] for k in ("lr", "betas", "eps", "weight_decay")}

    def miss(dt: torch.dtype, fused: bool) -> float:
        """A speculative update, then its rollback and redo (timed), then the redo undone."""
        update(dt)
        hypers = [hyper_of(0), hyper_of(1)]
        t0 = time.perf_counter()
        if not (fused and opt.redo_groups([0, 1], hypers, GRAD_MUL, clip_coef=REDO_MUL)):
            undo(dt, "native")
            opt.step_groups([0, 1], clip_coef=REDO_MUL)
        took = time.perf_counter() - t0
        for gi, (g, gs) in enumerate(zip(groups, grads[dt])):
            undo_adamw_(g, gs, [opt.state[p] for p in g], hypers[gi], REDO_MUL, kernel="native")
        return took

    for dt in grads:  # warm-up: builds the libraries, creates the state, faults the scratch in
        update(dt)
        update(dt)
        for k in kernels:
            undo(dt, k)
            update(dt)
    times: dict[str, list[float]] = {}
    ratios: dict[str, list[float]] = {}
    for r in range(args.repeats):
        for dt in grads:
            name = "bf16" if dt == torch.bfloat16 else "fp32"
            order = kernels[r % len(kernels):] + kernels[:r % len(kernels)]
            round_s = {}
            for k in order:
                times.setdefault(f"update_{name}_grad", []).append(update(dt))
                round_s[k] = undo(dt, k)  # inverts the update just made: the state stays stationary
                times.setdefault(f"undo_{k}_{name}_grad", []).append(round_s[k])
            if "native" in round_s:
                ratios.setdefault(f"{name}_grad", []).append(round_s["torch"] / round_s["native"])
                pair = {}
                for fused in ((False, True) if r % 2 == 0 else (True, False)):
                    pair[fused] = miss(dt, fused)
                    times.setdefault(f"miss_{'fused' if fused else 'apart'}_{name}_grad", []).append(pair[fused])
                ratios.setdefault(f"miss_{name}_grad", []).append(pair[False] / pair[True])
    med = {k: statistics.median(v) for k, v in times.items()}
    for k, v in times.items():
        emit({"variant": k, "median_ms": round(1e3 * med[k], 2), "min_ms": round(1e3 * min(v), 2),
              "runs_ms": [round(1e3 * x, 2) for x in v]})
    summary = {"summary": True, "numel": numel, "threads": args.threads}
    for name in ("fp32", "bf16"):
        grad_b = 4 if name == "fp32" else 2
        summary[f"update_{name}_grad_ms"] = round(1e3 * med[f"update_{name}_grad"], 2)
        for k in kernels:
            s = med[f"undo_{k}_{name}_grad"]
            summary[f"undo_{k}_{name}_grad_ms"] = round(1e3 * s, 2)
            # One pass reads p, g, m, v and writes p, m, v: what the native kernel moves.
            summary[f"undo_{k}_{name}_grad_one_pass_GBps"] = round((24 + grad_b) * numel / s / 1e9, 2)
        if name + "_grad" in ratios:
            summary[f"speedup_{name}_grad"] = round(med[f"undo_torch_{name}_grad"] / med[f"undo_native_{name}_grad"], 2)
            summary[f"speedup_{name}_grad_paired"] = round(statistics.median(ratios[f"{name}_grad"]), 2)
            summary[f"undo_native_over_update_{name}_grad"] = round(
                med[f"undo_native_{name}_grad"] / med[f"update_{name}_grad"], 2)
            summary[f"miss_apart_{name}_grad_ms"] = round(1e3 * med[f"miss_apart_{name}_grad"], 2)
            summary[f"miss_fused_{name}_grad_ms"] = round(1e3 * med[f"miss_fused_{name}_grad"], 2)
            summary[f"miss_fused_speedup_{name}_grad_paired"] = round(statistics.median(ratios[f"miss_{name}_grad"]), 2)
    emit(summary)


if __name__ == "__main__":
    main()
