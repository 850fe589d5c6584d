"""Training-step throughput of the window engine against plain training, in a plain loop.

Why: `offload_model` adds work to every step: fetching each block into its slot (twice: for
forward and for backward), packing and shipping its gradients, and a CPU Adam update per
block that runs in worker threads, pipelined with the next forward. This benchmark measures
what that costs on the step, with no Trainer in between, on the same GPT-2 and the same
batches:

  plain       the model on ``--device``, ``torch.optim.AdamW(fused=True)``,
              ``torch.nn.utils.clip_grad_norm_(1.0)``
  offload_wN  a deepcopy under ``offload_model(copy, StrongholdConfig(window_size=N))``,
              ``engine.build_optimizer(...)``, ``engine.clip_grad_norm_(1.0)``; one variant per
              ``--windows`` entry
  offload_wN_nb_off  the same with ``offload_non_block=False`` (embeddings and head on the
              device with a device AdamW, the first version), with ``--non_block on,off``;
              the summary's ``ratio_non_block_on_vs_off_paired`` is tokens/s with everything
              outside the blocks offloaded over tokens/s without (target >= 0.95)

Method. All variants live in ONE process (these shared machines drift by about +-30% from
minute to minute, shared/NOTES.md), are warmed up, then run in interleaved blocks of
``--block_steps`` steps, with the order rotating every round. The first step of each block is
not counted: for the offloaded variants it has no previous step's updates to wait for, so it
would flatter them. After a block the engine is drained (``engine.synchronize()``, untimed):
the last step's updates overlap with the *next* step in steady state, and the first counted
step of the next block pays for the updates of the step before it, so each counted step
carries exactly one step of CPU Adam. Reported per variant: medians of the counted steps,
tokens/s from the median, per-phase medians (forward, backward, clip, step), and for the
offloaded variants the engine's counters per step (``engine.stats.as_dict()``) and

    cpu_adam_hidden_fraction = 1 - blocked_s / cpu_adam_s   (both per step)

where ``blocked_s`` is the time the training thread waited on unfinished CPU updates (and,
on CUDA, on gradient copies), ``cpu_adam_s`` the time the workers spent updating. A fraction
of 1 means the training thread never waited; it says nothing about how much the workers
slowed the training thread down by sharing its cores (compare the phase times for that).

Output: one JSON object per line; the LAST line is the summary, with
``ratio_offload_vs_plain`` (tokens/s of ``offload_w{--windows[0]}`` over plain; target on CPU
>= 0.85), ``ratios_by_window``, ``stats_per_step`` and ``cpu_adam_hidden_fraction``.

    python benchmarks/bench_step.py --quick          # CPU, < 3 min on 2 cores
    python benchmarks/bench_step.py --smoke          # seconds, tiny model (CI)
    python benchmarks/bench_step.py --device cuda --model gpt2-medium-like --seq 512 --batch 8 --windows 1,2,4
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Callable

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# [Note: OpenMP wait policy] On a CPU run, libgomp's default is to spin at every barrier while
# the process has no more threads than cores. With other processes on the cores, a spinning
# team waits out the scheduler's time slices of a descheduled partner at every parallel
# region: plain training measured ~4x slower here (median 4.7 s vs 1.3 s per step), while a
# process running STRONGHOLD's CPU Adam workers (more threads than cores, so libgomp likely
# throttles its spinning) escaped. PASSIVE (sleep at once) puts every variant under the same policy; it
# must be set before torch loads. Set OMP_WAIT_POLICY yourself to override it.
if "cuda" not in " ".join(sys.argv[1:]):
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

#: GPT-2 shapes. "bench-small" is the CPU default: wide enough that GEMMs dominate Python
#: overhead, small enough that a CPU step takes well under a second on 2 idle cores. The
#: vocabulary is cut to 8192 so that the resident head (identical in both variants) does not
#: dilute the ratio; the gpt2-* presets keep GPT-2's 50257.
PRESETS: dict[str, dict[str, int]] = {
    "smoke": dict(n_embd=64, n_layer=2, n_head=2, vocab_size=256, seq=32, batch=2),
    # examples/run_clm.py with no arguments: 4 x 128 GPT-2, the 8192-token embedded tokenizer,
    # block_size 128, batch 8.
    "embedded-default": dict(n_embd=128, n_layer=4, n_head=4, vocab_size=8192, seq=128, batch=8),
    "bench-small": dict(n_embd=384, n_layer=6, n_head=6, vocab_size=8192, seq=128, batch=4),
    "bench-medium": dict(n_embd=512, n_layer=8, n_head=8, vocab_size=8192, seq=128, batch=4),
    "gpt2-small-like": dict(n_embd=768, n_layer=12, n_head=12, vocab_size=50257, seq=512, batch=8),
    "gpt2-medium-like": dict(n_embd=1024, n_layer=24, n_head=16, vocab_size=50257, seq=512, batch=8),
    "gpt2-large-like": dict(n_embd=1280, n_layer=36, n_head=20, vocab_size=50257, seq=512, batch=8),
}

SUMMARY_KEYS = (
    "ratio_offload_vs_plain", "ratio_offload_vs_plain_paired", "ratios_by_window", "tokens_per_s", "stats_per_step",
    "cpu_adam_hidden_fraction", "first_block_ready_fraction", "forward_stall_fraction", "speculation",
    "target_ratio_cpu", "meets_target",
)


def emit(obj: dict) -> None:
    print(json.dumps(obj), flush=True)


# ---------------------------------------------------------------------------- model and data
def build_model(shape: dict[str, int], seed: int = 0):
    import transformers

    transformers.logging.set_verbosity_error()
    cfg = transformers.AutoConfig.for_model(
        "gpt2", n_embd=shape["n_embd"], n_layer=shape["n_layer"], n_head=shape["n_head"],
        n_positions=max(shape["seq"], 64), vocab_size=shape["vocab_size"], bos_token_id=0, eos_token_id=0,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    model.train()
    return model


def make_batches(shape: dict[str, int], n: int, device: torch.device, seed: int = 1) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(0, shape["vocab_size"], (shape["batch"], shape["seq"]), generator=g)  # int64 [b, s]
        out.append({"input_ids": ids.to(device), "labels": ids.to(device)})
    return out


# ---------------------------------------------------------------------------- variants
@dataclass
class Variant:
    name: str
    step: Callable[[dict], dict[str, float]]  # one training step -> phase seconds
    drain: Callable[[], None] = lambda: None  # finish asynchronous work (untimed)
    engine: object = None
    window_size: int | None = None
    steps: list[float] = field(default_factory=list)
    round_medians: list[float] = field(default_factory=list)  # median counted step per round
    phases: dict[str, list[float]] = field(default_factory=dict)
    counters: list[dict[str, float]] = field(default_factory=list)  # per block, per step
    losses: list[float] = field(default_factory=list)


def _sync_fn(device: torch.device) -> Callable[[], None]:
    if device.type == "cuda":
        return torch.cuda.synchronize
    return lambda: None


def _autocast(device: torch.device, precision: str):
    if precision == "bf16":
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    import contextlib

    return contextlib.nullcontext()


def plain_variant(base, device: torch.device, precision: str, lr: float, max_norm: float) -> Variant:
    model = copy.deepcopy(base).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01, fused=True)
    sync = _sync_fn(device)

    def step(b: dict) -> dict[str, float]:
        t0 = time.perf_counter()
        with _autocast(device, precision):
            loss = model(**b).loss
        sync()
        t1 = time.perf_counter()
        loss.backward()
        sync()
        t2 = time.perf_counter()
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        sync()
        t3 = time.perf_counter()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync()
        t4 = time.perf_counter()
        return {"forward": t1 - t0, "backward": t2 - t1, "clip": t3 - t2, "step": t4 - t3, "loss": float(loss.detach())}

    return Variant("plain", step)


def offload_variant(base, device: torch.device, precision: str, lr: float, window_size: int, cpu_threads: int | None,
                    speculative: str, max_norm: float, non_block: bool = True, host_worker: str = "auto") -> Variant:
    from stronghold_hf import StrongholdConfig, offload_model

    model = copy.deepcopy(base)
    cfg = StrongholdConfig(
        window_size=window_size, cpu_threads=cpu_threads, speculative_step=speculative,
        param_dtype=torch.bfloat16 if precision == "bf16" else None, offload_non_block=non_block,
        host_worker=host_worker,
    )
    engine = offload_model(model, cfg, device=device)
    opt = engine.build_optimizer(lr=lr, weight_decay=0.01)
    # This loop steps after every backward and clips only through the engine: what the Trainer
    # tells the engine, so "auto" may speculate.
    engine.coordinator.step_signal = lambda: True
    sync = _sync_fn(device)

    def step(b: dict) -> dict[str, float]:
        t0 = time.perf_counter()
        with _autocast(device, precision):
            loss = model(**b).loss
        sync()
        t1 = time.perf_counter()
        loss.backward()
        sync()
        t2 = time.perf_counter()
        engine.clip_grad_norm_(max_norm)
        sync()
        t3 = time.perf_counter()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync()
        t4 = time.perf_counter()
        return {"forward": t1 - t0, "backward": t2 - t1, "clip": t3 - t2, "step": t4 - t3, "loss": float(loss.detach())}

    suffix = ("" if speculative == "auto" else f"_spec_{speculative}") + ("" if non_block else "_nb_off")
    v = Variant(f"offload_w{window_size}{suffix}", step, drain=engine.synchronize, engine=engine, window_size=window_size)
    return v


def zero_offload_variant(base, device: torch.device, precision: str, lr: float, max_norm: float) -> Variant | None:
    """DeepSpeed ZeRO-2 with the optimizer on the CPU (ZeRO-Offload), when `deepspeed` imports.

    Never a dependency of this project: on a machine without it the variant is skipped."""
    import importlib.util
    import socket

    if device.type != "cuda" or importlib.util.find_spec("deepspeed") is None:
        return None
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    for key, value in dict(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                           MASTER_PORT=str(port)).items():
        os.environ.setdefault(key, value)
    try:
        import deepspeed

        model = copy.deepcopy(base)
        cfg = {
            "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "gradient_clipping": max_norm,
            "optimizer": {"type": "AdamW", "params": {"lr": lr, "weight_decay": 0.01}},
            "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": True}},
            "bf16": {"enabled": precision == "bf16"},
        }
        engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    except Exception as err:  # a broken DeepSpeed install must not cost the other variants their run
        emit({"bench": "step", "variant": "zero_offload", "error": f"{type(err).__name__}: {err}"[:300]})
        return None
    sync = _sync_fn(device)

    def step(b: dict) -> dict[str, float]:
        t0 = time.perf_counter()
        loss = engine(**b).loss
        sync()
        t1 = time.perf_counter()
        engine.backward(loss)
        sync()
        t2 = time.perf_counter()
        engine.step()
        sync()
        t3 = time.perf_counter()
        return {"forward": t1 - t0, "backward": t2 - t1, "clip": 0.0, "step": t3 - t2, "loss": float(loss.detach())}

    return Variant("zero_offload", step)


# ---------------------------------------------------------------------------- measurement
_COUNTERS = ("h2d_bytes", "d2h_bytes", "h2d_s", "d2h_s", "blocked_s", "cpu_adam_s", "fetches_on_demand",
             "forward_stall_s", "update_total_s", "first_block_ready_s", "speculative_update_s", "rollback_s",
             "speculated_blocks", "speculation_hits", "speculation_misses", "steps")


def run_block(v: Variant, batches: list[dict], start: int, n: int, record: bool) -> None:
    """``n`` steps of one variant; the first is not counted (see the module docstring)."""
    engine = v.engine
    if engine is not None:
        engine.stats.reset()
    blocked_counted = stall_counted = 0.0
    counted: list[float] = []
    for k in range(n):
        b = batches[(start + k) % len(batches)]
        if engine is not None and k == 1:
            s = engine.stats.as_dict()
            blocked_counted, stall_counted = -s["blocked_s"], -s["forward_stall_s"]  # waits from step 1 on
        t0 = time.perf_counter()
        ph = v.step(b)
        dt = time.perf_counter() - t0
        if record and k >= 1:
            counted.append(dt)
            v.steps.append(dt)
            v.losses.append(ph.pop("loss"))
            for key, val in ph.items():
                v.phases.setdefault(key, []).append(val)
    if counted:
        v.round_medians.append(statistics.median(counted))
    if engine is not None:
        s = engine.stats.as_dict()
        blocked_counted += s["blocked_s"]
        stall_counted += s["forward_stall_s"]
    v.drain()
    if engine is not None and record and n >= 2:
        # Updates of all n steps have finished now; copies were made by all n steps.
        s = engine.stats.as_dict()
        row = {k: s[k] / n for k in _COUNTERS if k not in ("blocked_s", "forward_stall_s")}
        row["blocked_s"] = blocked_counted / (n - 1)
        row["forward_stall_s"] = stall_counted / (n - 1)
        row["step_s"] = statistics.median(counted)
        v.counters.append(row)


def measure(variants: list[Variant], batches: list[dict], warmup: int, rounds: int, block_steps: int,
            deadline: float | None = None) -> int:
    """Warm-up, then interleaved rounds; stops early (after >= 1 round) past ``deadline``. Returns rounds run."""
    for v in variants:
        run_block(v, batches, 0, warmup, record=False)
    pos = warmup
    for r in range(rounds):
        if r > 0 and deadline is not None and time.monotonic() > deadline:
            return r
        order = variants[r % len(variants):] + variants[: r % len(variants)]
        for v in order:
            run_block(v, batches, pos, block_steps, record=True)
        pos += block_steps
    return rounds


def _median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def _paired(a: Variant, b: Variant | None) -> float | None:
    """Median over rounds of tokens/s of ``a`` over tokens/s of ``b`` (each round's medians)."""
    if b is None or not a.round_medians:
        return None
    return round(_median([tb / ta for ta, tb in zip(a.round_medians, b.round_medians)]), 3)


def report(v: Variant, tokens_per_step: int, device: torch.device, plain_v: Variant | None = None,
           plain: dict | None = None, params: int | None = None) -> dict:
    med = _median(v.steps)
    row = {
        "bench": "step", "variant": v.name, "device": str(device), "params": params, "window_size": v.window_size,
        "tokens_per_s": round(tokens_per_step / med, 1), "median_step_s": round(med, 4),
        "min_step_s": round(min(v.steps), 4), "steps_measured": len(v.steps),
        "phase_median_s": {k: round(_median(x), 4) for k, x in v.phases.items()},
        "final_loss": round(v.losses[-1], 4) if v.losses else None,
    }
    if plain is not None:
        row["ratio_vs_plain"] = round(row["tokens_per_s"] / plain["tokens_per_s"], 3)
        # The same comparison within each round (robust to drift between rounds).
        paired = [p / o for p, o in zip(plain_v.round_medians, v.round_medians)]
        row["ratio_vs_plain_paired"] = {
            "median": round(_median(paired), 3), "min": round(min(paired), 3), "max": round(max(paired), 3),
        }
    if v.counters:
        keys = v.counters[0].keys()
        per_step = {k: _median([c[k] for c in v.counters]) for k in keys}
        row["stats_per_step"] = {k: (int(x) if k.endswith("_bytes") else round(x, 4)) for k, x in per_step.items()}
        adam = per_step["cpu_adam_s"] + per_step["speculative_update_s"]
        row["cpu_adam_hidden_fraction"] = round(1.0 - per_step["blocked_s"] / adam, 3) if adam > 0 else None
        total = per_step["update_total_s"]
        # How soon the next forward can start: block 0's update over all of the step's CPU work.
        row["first_block_ready_fraction"] = round(per_step["first_block_ready_s"] / total, 3) if total > 0 else None
        row["forward_stall_fraction"] = round(per_step["forward_stall_s"] / per_step["step_s"], 3)
        spec_steps = sum(c["speculation_hits"] + c["speculation_misses"] for c in v.counters)
        misses = sum(c["speculation_misses"] for c in v.counters)
        row["speculation"] = {
            "speculated_blocks_per_step": round(per_step["speculated_blocks"], 2),
            "miss_rate": round(misses / spec_steps, 3) if spec_steps else None,
            # Update work moved into backward, minus what was undone and redone on misses.
            "net_time_saved_s_per_step": round(per_step["speculative_update_s"] - 2 * per_step["rollback_s"], 4),
        }
    return row


# ---------------------------------------------------------------------------- CLI
def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    p.add_argument("--model", default=None, choices=sorted(PRESETS), help="shape preset (default: bench-small, smoke with --smoke)")
    p.add_argument("--n_embd", type=int)
    p.add_argument("--n_layer", type=int)
    p.add_argument("--n_head", type=int)
    p.add_argument("--vocab_size", type=int)
    p.add_argument("--seq", type=int)
    p.add_argument("--batch", type=int)
    p.add_argument("--windows", default="2", help="comma-separated window sizes, one offloaded variant each (e.g. 1,2,4)")
    p.add_argument("--precision", choices=["fp32", "bf16"], default="fp32",
                   help="bf16: autocast for both variants and bf16 device copies of the offloaded blocks")
    p.add_argument("--cpu_threads", type=int, default=None, help="StrongholdConfig.cpu_threads (default: auto)")
    p.add_argument("--speculative", default="auto", help="StrongholdConfig.speculative_step of the offloaded variants; "
                   "a comma-separated list (auto,off) adds one variant per value for the first window")
    p.add_argument("--non_block", default="on", help="StrongholdConfig.offload_non_block of the offloaded variants: "
                   "on (default), or on,off to add a variant with the parameters outside the blocks on the device")
    p.add_argument("--host_worker", default="auto", choices=["auto", "thread", "inline"],
                   help="StrongholdConfig.host_worker of the offloaded variants (thread: overlap as on a GPU)")
    p.add_argument("--max_grad_norm", type=float, default=1.0, help="global clip (HF's default 1.0)")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads for the training thread")
    p.add_argument("--warmup", type=int, default=None, help="warm-up steps per variant")
    p.add_argument("--rounds", type=int, default=None, help="interleaved rounds")
    p.add_argument("--block_steps", type=int, default=None, help="steps per variant per round (first one not counted)")
    p.add_argument("--steps", type=int, default=None, help="counted steps per variant (sets --rounds from --block_steps)")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--time_budget_s", type=float, default=None,
                   help="start no new round after this many seconds (from start-up); the summary still comes")
    p.add_argument("--quick", action="store_true", help="the README's CPU numbers: bench-small, 6 rounds x 4 steps")
    p.add_argument("--smoke", action="store_true", help="tiny model, a few seconds (CI)")
    p.add_argument("--profile", default=None, metavar="DIR",
                   help="also write a torch.profiler table per variant (2 steps each) into DIR")
    args = p.parse_args(argv)
    args.device = torch.device(args.device)
    if args.precision == "bf16" and args.device.type == "cpu":
        # GPT-2's nn.LayerNorm gets bf16 weights (the offloaded blocks' bf16 device copies) and an
        # fp32 input: CUDA autocast runs layer_norm in fp32, CPU autocast does not, and the CPU
        # kernel refuses ("mixed dtype (CPU): expect parameter to have scalar type of Float").
        p.error("--precision bf16 needs --device cuda: on the CPU, bf16 block copies of GPT-2's LayerNorm "
                "fail under CPU autocast (mixed dtype)")
    if args.device.type == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: CUDA is not available on this machine")
    if args.device.type not in ("cpu", "cuda"):
        p.error(f"--device {args.device}: use cpu or cuda")
    try:
        args.windows = [int(w) for w in str(args.windows).split(",") if w.strip()]
    except ValueError:
        p.error(f"--windows {args.windows!r}: use comma-separated ints, e.g. 1,2,4")
    if not args.windows or min(args.windows) < 1:
        p.error("--windows needs at least one window size >= 1")
    preset = args.model or ("smoke" if args.smoke else "bench-small")
    shape = dict(PRESETS[preset])
    for k in ("n_embd", "n_layer", "n_head", "vocab_size", "seq", "batch"):
        if getattr(args, k) is not None:
            shape[k] = getattr(args, k)
    if shape["n_embd"] % shape["n_head"]:
        p.error(f"n_embd={shape['n_embd']} is not divisible by n_head={shape['n_head']}; pass --n_head")
    args.preset, args.shape = preset, shape
    mode = "smoke" if args.smoke else "quick" if args.quick else "default"
    warmup, rounds, block = {"smoke": (1, 2, 3), "quick": (2, 6, 4), "default": (3, 10, 4)}[mode]
    args.warmup = warmup if args.warmup is None else args.warmup
    args.block_steps = block if args.block_steps is None else args.block_steps
    if args.block_steps < 2:
        p.error("--block_steps must be >= 2 (the first step of each block is not counted)")
    if args.steps is not None:
        rounds = max(1, -(-args.steps // (args.block_steps - 1)))
    args.rounds = rounds if args.rounds is None else args.rounds
    args.mode = mode
    if args.smoke and args.threads is None:
        # Tiny GEMMs with a 2-thread OpenMP team on a busy 2-core box spend most of their time in
        # barriers waiting for a descheduled thread (about 40x slower here); one thread is stable.
        args.threads = 1
    return args


def profile_variants(variants: list[Variant], batches: list[dict], out_dir: str) -> None:
    from torch.profiler import ProfilerActivity, profile

    os.makedirs(out_dir, exist_ok=True)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    for v in variants:
        v.step(batches[0])
        with profile(activities=acts) as prof:
            for b in batches[:2]:
                v.step(b)
            v.drain()
        path = os.path.join(out_dir, f"profile_{v.name}.txt")
        with open(path, "w", encoding="utf-8") as fh:
            fh.write(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=40))
        emit({"bench": "step", "profile": v.name, "path": path})


def main(argv=None) -> int:
    t_start = time.monotonic()
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device, shape = args.device, args.shape
    base = build_model(shape)
    n_params = sum(p.numel() for p in base.parameters())
    batches = make_batches(shape, 4, device)
    tokens = shape["batch"] * shape["seq"]
    meta = {
        "bench": "step", "config": True, "device": str(device), "model": args.preset, **shape, "params": n_params,
        "precision": args.precision, "windows": args.windows, "warmup": args.warmup, "rounds": args.rounds,
        "block_steps": args.block_steps, "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"), "cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "python": platform.python_version(),
    }
    if device.type == "cuda":
        meta["gpu"] = torch.cuda.get_device_name(device)
    emit(meta)

    variants = [plain_variant(base, device, args.precision, args.lr, args.max_grad_norm)]
    modes = [m.strip() for m in args.speculative.split(",") if m.strip()]
    for w in args.windows:
        variants.append(offload_variant(base, device, args.precision, args.lr, w, args.cpu_threads, modes[0],
                                        args.max_grad_norm, host_worker=args.host_worker))
    for mode in modes[1:]:
        variants.append(offload_variant(base, device, args.precision, args.lr, args.windows[0], args.cpu_threads, mode,
                                        args.max_grad_norm))
    if "off" in [m.strip() for m in args.non_block.split(",")]:
        variants.append(offload_variant(base, device, args.precision, args.lr, args.windows[0], args.cpu_threads,
                                        modes[0], args.max_grad_norm, non_block=False))
    zero = zero_offload_variant(base, device, args.precision, args.lr, args.max_grad_norm)
    if zero is not None:
        variants.append(zero)
    del base
    if args.profile:
        profile_variants(variants, batches, args.profile)
    deadline = None if args.time_budget_s is None else t_start + args.time_budget_s
    rounds_run = measure(variants, batches, args.warmup, args.rounds, args.block_steps, deadline)

    plain = report(variants[0], tokens, device, params=n_params)
    emit(plain)
    rows = [report(v, tokens, device, variants[0], plain, params=n_params) for v in variants[1:]]
    for row in rows:
        emit(row)
    for v in variants[1:]:
        if v.engine is not None:
            v.engine.close()
    first = rows[0]
    summary = {
        "bench": "step", "summary": True, "device": str(device), "model": args.preset, "params": n_params,
        "mode": args.mode, "window_size": first["window_size"], "rounds_run": rounds_run,
        "ratio_offload_vs_plain": first["ratio_vs_plain"],
        "ratio_offload_vs_plain_paired": first["ratio_vs_plain_paired"]["median"],
        "ratios_by_window": {str(r["window_size"]): r["ratio_vs_plain"] for r in rows if "_spec_" not in r["variant"]},
        "ratios_by_variant": {r["variant"]: r["ratio_vs_plain_paired"]["median"] for r in rows},
        "tokens_per_s": {r["variant"]: r["tokens_per_s"] for r in [plain, *rows]},
        "median_step_s": {r["variant"]: r["median_step_s"] for r in [plain, *rows]},
        "stats_per_step": first.get("stats_per_step"),
        "cpu_adam_hidden_fraction": first.get("cpu_adam_hidden_fraction"),
        "first_block_ready_fraction": first.get("first_block_ready_fraction"),
        "forward_stall_fraction": first.get("forward_stall_fraction"),
        "speculation": {r["variant"]: r.get("speculation") for r in rows if "speculation" in r},
        "ratio_non_block_on_vs_off_paired": _paired(variants[1], next(
            (v for v in variants if v.name.endswith("_nb_off")), None)),
        "ratio_offload_vs_zero_offload": next(
            (round(first["tokens_per_s"] / r["tokens_per_s"], 3) for r in rows if r["variant"] == "zero_offload"), None),
        "target_ratio_cpu": 0.85,
        "meets_target": bool(first["ratio_vs_plain"] >= 0.85) if device.type == "cpu" else None,
    }
    emit(summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
