"""Host work per block: the engine's Python next to plain training's, with compute made negligible.

On a GPU the training and autograd threads launch every kernel; whatever Python the engine
runs per block is time they are not launching, and the GPU waits (the first H200 run was
host bound). This benchmark measures that work where it can be measured without a GPU: a
GPT-2 of tiny width (compute is negligible), at two depths, batch 1 x 16 tokens, one torch
thread. For each variant it takes the training thread's CPU time per step
(``time.thread_time``; on a CPU device autograd runs the backward on the calling thread, so
the hooks are in it) and fits it over depth: the slope is the host work per block per step.

Variants, interleaved in one process (rounds rotate the order; medians):

* ``plain``: the untouched model with fused AdamW and ``clip_grad_norm_`` (HF's default 1.0;
  ``--max_grad_norm 0`` for none);
* ``gpu_config``: the engine as it runs on a GPU: ``host_worker="thread"`` (folds and CPU
  Adam on the worker), ``speculative_step="on"``;
* ``gpu_default``: the engine as a GPU user gets it by default: the worker thread and
  ``speculative_step="auto"``, which does not speculate while steps clip (every step of this
  benchmark clips at 1.0, its norm 1.5-1.8 times the limit, so ``"on"`` too speculates only in
  the first steps, until a norm is known: a step that far over is followed by one that clips;
  ``--max_grad_norm 0`` measures speculation that hits, every block of every step);
* ``cpu_default``: the engine as it runs on a CPU device by default (host work inline).

``extra_us_per_block`` = the variant's slope - plain's; ``ratio`` = that over plain's slope
(the target is <= 0.30 in the GPU configuration), from the medians of all rounds;
``ratio_paired``: the median over rounds of the same ratio computed within each round, which
drift between rounds does not move. ``extra_ops_per_block``: top-level aten ops
per block the training thread dispatches beyond plain's (counted with a dispatch mode over
one step at each depth, fitted the same way). ``engine_calls_per_block``: the engine's Python
functions called per block on the training thread, and the C functions they call (counted
with ``sys.setprofile`` over one step at each depth, fitted the same way; on CUDA the
backward's hooks run on autograd's device thread and are not in it): unlike the times, the
same in every run, so a change to the hot path shows in it at once.

On CUDA (``--device cuda``) it also times the step on the GPU and reports
``gpu_idle_fraction``: the share of the step's wall time the GPU had nothing to run
(1 - the kernels' summed time over the step, from torch.profiler), and
``gpu_waited_on_host``: whether that share is above 0.2.

Run: ``python benchmarks/bench_host.py`` (about 2 minutes on 2 cores); ``--smoke`` for CI.
Prints one JSON object per variant, then a summary line.
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import os
import resource
import statistics
import sys
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

import transformers as T  # noqa: E402

import stronghold_hf  # noqa: E402
from stronghold_hf import StrongholdConfig, offload_model  # noqa: E402

VARIANTS = {
    "gpu_config": dict(host_worker="thread", speculative_step="on"),
    "gpu_default": dict(host_worker="thread"),
    "cpu_default": dict(),
}


def build_model(layers: int, width: int, seed: int = 0) -> torch.nn.Module:
    cfg = T.GPT2Config(n_embd=width, n_layer=layers, n_head=2, n_positions=64, vocab_size=128, bos_token_id=0, eos_token_id=0,
                       resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(seed)
    model = T.GPT2LMHeadModel(cfg)
    model.train()
    return model


class _OpCounter(TorchDispatchMode):
    """Counts the aten ops dispatched while active (the autograd engine carries the mode into
    the backward it runs on this thread)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


class Runner:
    """One variant at one depth: a model and its optimizer, ready to step."""

    def __init__(self, name: str, model: torch.nn.Module, device: torch.device, ids: torch.Tensor,
                 max_grad_norm: float | None = 1.0) -> None:
        self.name = name
        self.max_grad_norm = max_grad_norm
        self.ids = ids
        self.device = device
        self.engine = None
        self.kernel_s: list[float] = []  # per timed batch: the thread's system CPU time per step
        self.switches: list[float] = []  # per timed batch: its voluntary context switches per step
        if name == "plain":
            self.model = model.to(device)
            self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4, fused=True)
        else:
            self.model = model
            self.engine = offload_model(model, StrongholdConfig(window_size=2, resident=False, **VARIANTS[name]),
                                        device=device)
            self.opt = self.engine.build_optimizer(lr=1e-4)

    def step(self) -> None:
        loss = self.model(input_ids=self.ids, labels=self.ids).loss
        loss.backward()
        if self.max_grad_norm is not None and self.engine is None:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.max_grad_norm)
        elif self.max_grad_norm is not None:
            self.engine.clip_grad_norm_(self.max_grad_norm)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)

    def settle(self) -> None:
        if self.engine is not None:
            self.engine.synchronize()
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def timed_steps(self, n: int) -> list[float]:
        """Training-thread CPU time of each of ``n`` steps (s); the worker is drained untimed
        after them, so each counted step carries one step's CPU updates as in steady state."""
        out = []
        before = _thread_usage()
        for _ in range(n):
            t0 = time.thread_time()
            self.step()
            out.append(time.thread_time() - t0)
        after = _thread_usage()
        if before is not None:
            self.kernel_s.append((after.ru_stime - before.ru_stime) / n)
            self.switches.append((after.ru_nvcsw - before.ru_nvcsw) / n)
        self.settle()
        return out

    def ops_per_step(self) -> int:
        counter = _OpCounter()
        with counter:
            self.step()
        self.settle()
        return counter.count

    def engine_calls_per_step(self) -> int:
        """Python functions of the engine called on this thread over one step, and C functions
        they call (``sys.setprofile``): a count that, unlike time, does not move from run to run.
        On a CPU device the backward's hooks run on this thread too."""
        count = 0

        def profile(frame, event, arg) -> None:
            nonlocal count
            if (event == "call" or event == "c_call") and _ENGINE_DIR in frame.f_code.co_filename:
                count += 1

        sys.setprofile(profile)
        try:
            self.step()
        finally:
            sys.setprofile(None)
        self.settle()
        return count

    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()


def _thread_usage():
    """This thread's resource usage (Linux), or None where the OS does not give it per thread."""
    who = getattr(resource, "RUSAGE_THREAD", None)
    return None if who is None else resource.getrusage(who)


#: Where the engine's code lives: calls into (or made by) files under it are the engine's.
_ENGINE_DIR = os.path.dirname(os.path.abspath(stronghold_hf.__file__)) + os.sep


def slope(xs: list[int], ys: list[float]) -> float:
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)


def gpu_idle_fraction(runner: Runner, steps: int = 3) -> float:
    """CUDA: 1 - (summed kernel time / step wall time) over a few steps (torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile

    runner.settle()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            runner.step()
        runner.settle()
        wall = time.perf_counter() - t0
    # Self device time: each kernel (and copy) once, not again under the ops that launched it.
    busy = sum(e.self_device_time_total for e in prof.key_averages()) / 1e6 / steps
    return max(0.0, 1.0 - min(busy, wall / steps) / (wall / steps))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--depths", default="8,40", help="two or more block counts to fit over")
    p.add_argument("--width", type=int, default=32)
    p.add_argument("--seq", type=int, default=16)
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--steps", type=int, default=6, help="counted steps per variant per round")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--variants", default="gpu_config,gpu_default,cpu_default")
    p.add_argument("--max_grad_norm", type=float, default=1.0,
                   help="global clip of every variant (HF's default 1.0; <= 0: no clipping). At 1.0 this "
                        "model's gradient norm (about 2) clips every step, so a speculative update is "
                        "rolled back and redone: the worst case for speculative_step='on'")
    p.add_argument("--smoke", action="store_true", help="tiny and short (CI)")
    args = p.parse_args(argv)
    if args.smoke:
        args.depths, args.rounds, args.steps, args.warmup = "2,6", 1, 2, 1
    torch.set_num_threads(1)
    device = torch.device(args.device)
    depths = [int(d) for d in args.depths.split(",")]
    names = ["plain"] + [v for v in args.variants.split(",") if v]
    ids = torch.randint(0, 128, (1, args.seq), generator=torch.Generator().manual_seed(0)).to(device)

    runners = {}
    for depth in depths:
        base = build_model(depth, args.width)
        for name in names:
            r = Runner(name, copy.deepcopy(base), device, ids,
                       max_grad_norm=args.max_grad_norm if args.max_grad_norm > 0 else None)
            for _ in range(args.warmup):
                r.step()
            r.settle()
            runners[(name, depth)] = r
    times: dict[tuple[str, int], list[float]] = {k: [] for k in runners}
    round_medians: list[dict[tuple[str, int], float]] = []
    order = list(runners)
    for rnd in range(args.rounds):
        rot = order[rnd % len(order):] + order[: rnd % len(order)]
        this_round = {}
        for key in rot:
            gc.collect()
            steps = runners[key].timed_steps(args.steps)
            times[key] += steps
            this_round[key] = statistics.median(steps)
        round_medians.append(this_round)
    ops = {key: r.ops_per_step() for key, r in runners.items()}
    calls = {key: r.engine_calls_per_step() for key, r in runners.items() if key[0] != "plain"}

    med = {k: statistics.median(v) for k, v in times.items()}
    per_block = {n: slope(depths, [med[(n, d)] for d in depths]) * 1e6 for n in names}

    def paired_ratio(n: str) -> float:
        """Median over rounds of (the variant's slope - plain's) / plain's, each round on its own."""
        ratios = []
        for rm in round_medians:
            p = slope(depths, [rm[("plain", d)] for d in depths])
            ratios.append((slope(depths, [rm[(n, d)] for d in depths]) - p) / p)
        return statistics.median(ratios)
    ops_per_block = {n: slope(depths, [ops[(n, d)] for d in depths]) for n in names}

    def thread_waits(n: str) -> dict:
        """The training thread's system CPU time and voluntary context switches per block beyond
        plain's (fitted the same way): what handing work to and from the worker costs it in the
        kernel (the GIL's and the tickets' futexes), part of ``extra_us_per_block``."""
        if not runners[(n, depths[0])].kernel_s:
            return {}

        def per_block(name: str, attr: str) -> float:
            return slope(depths, [statistics.median(getattr(runners[(name, d)], attr)) for d in depths])
        return {"extra_kernel_us_per_block": round((per_block(n, "kernel_s") - per_block("plain", "kernel_s")) * 1e6, 1),
                "extra_switches_per_block": round(per_block(n, "switches") - per_block("plain", "switches"), 2)}
    plain = per_block["plain"]
    summary = {"bench": "host", "summary": True, "device": str(device), "width": args.width, "seq": args.seq, "depths": depths,
               "max_grad_norm": args.max_grad_norm,
               "torch_threads": 1, "plain_us_per_block": round(plain, 1),
               "plain_ops_per_block": round(ops_per_block["plain"], 1)}
    for n in names[1:]:
        extra = per_block[n] - plain
        row = {"variant": n, "us_per_block": round(per_block[n], 1), "extra_us_per_block": round(extra, 1),
               "ratio": round(extra / plain, 3), "ratio_paired": round(paired_ratio(n), 3),
               "extra_ops_per_block": round(ops_per_block[n] - ops_per_block["plain"], 1),
               "engine_calls_per_block": round(slope(depths, [calls[(n, d)] for d in depths]), 1),
               **thread_waits(n),
               "step_ms_by_depth": {d: round(med[(n, d)] * 1e3, 3) for d in depths}}
        if device.type == "cuda":
            idle = gpu_idle_fraction(runners[(n, depths[-1])])
            row["gpu_idle_fraction"] = round(idle, 3)
            row["gpu_waited_on_host"] = idle > 0.2
        print(json.dumps(row), flush=True)
        summary[f"{n}_extra_us_per_block"] = row["extra_us_per_block"]
        summary[f"{n}_ratio"] = row["ratio"]
        summary[f"{n}_ratio_paired"] = row["ratio_paired"]
        summary[f"{n}_extra_ops_per_block"] = row["extra_ops_per_block"]
        summary[f"{n}_engine_calls_per_block"] = row["engine_calls_per_block"]
    if device.type == "cuda":
        idle = gpu_idle_fraction(runners[("plain", depths[-1])])
        summary["plain_gpu_idle_fraction"] = round(idle, 3)
    summary["plain_step_ms_by_depth"] = {d: round(med[("plain", d)] * 1e3, 3) for d in depths}
    for r in runners.values():
        r.close()
    print(json.dumps(summary), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
