"""CPU AdamW step throughput: CPUAdam against torch, DeepSpeed and the memory-traffic bound.

Why: the offloaded optimizer step runs on the CPU every iteration and is memory bound, so
what matters is how close it gets to what the memory system can stream. All variants run
in ONE process, interleaved round-robin (the starting variant rotates each repetition), and
medians are reported, because these shared machines drift by +-30% minute to minute. The
summary's ratios are medians of per-repetition ratios (both variants timed back to back).

Variants (all over the same fp32 params and grads):
  cpu_adam                      CPUAdam.step(), default kernel ("native" where it builds)
  cpu_adam_torch_kernel         CPUAdam(kernel="torch"): torch._fused_adamw_ underneath
  torch_fused / torch_foreach   torch.optim.AdamW(fused=True) / (foreach=True)
  bound_torch_3pass             three streaming torch passes p += 1e-3*g, m *= 0.9, v *= 0.999
                                (torch._foreach_*_): reads p, g, m, v and writes p, m, v once
                                each, 28 B/param of DRAM traffic, minimal arithmetic
  bound_native_1pass            the same arithmetic as ONE OpenMP loop (same build as CPUAdam's
                                native kernel): Adam's exact access pattern, in one pass
  *_bf16_copy                   with a bf16 copy-out of every param (+2 B/param written); the
                                torch kernel does it as a separate fp32->bf16 pass
  *_scaled                      step(clip_coef=0.5): the in-kernel gradient scaling path
  (full mode) chunk sweeps of the torch kernel's scaled path, and of a hand-chunked
  "fused step on a chunk, then copy that chunk out while it is in cache" variant
  deepspeed[_bf16_copy]         DeepSpeedCPUAdam, only if `deepspeed` is importable
  cpu_adam_8bit                 CPUAdam(state_bits=8): blockwise 8-bit moments (host_memory="lean")
  bnb_adamw8bit                 bitsandbytes.optim.AdamW8bit (its CPU backend), only if importable
  torchao_adamw8bit             torchao.optim.AdamW8bit, only if importable
                                (pip install ".[compare]"; neither is a dependency of this project)
ratio_vs_bound uses the faster of the two bounds. Then a thread study (two big groups
stepped sequentially vs from two Python threads) and a GIL check.

Output: one JSON object per line; the LAST line is the summary.

    python benchmarks/bench_cpu_adam.py --quick     # < 2 min on a 2-core box
    python benchmarks/bench_cpu_adam.py --smoke     # seconds, tiny sizes (CI)
"""

from __future__ import annotations

import argparse
import ctypes
import importlib.util
import inspect
import json
import os
import statistics
import threading
import time
from collections.abc import Callable

import torch

from stronghold_hf.optim import DEFAULT_CHUNK_NUMEL, CPUAdam
from stronghold_hf.optim.cpu_adam import native_kernel_error
from stronghold_hf.optim.native import build_native_library

LR, BETAS, EPS, WD = 1e-3, (0.9, 0.999), 1e-8, 1e-2

_BOUND_SOURCE = r"""
#include <algorithm>
#include <cstdint>
#include <omp.h>
// table: int64 [nt, 5] = numel, p, g, m, v. Same thread partition as CPUAdam's kernel.
extern "C" void bound_step(int64_t nt, const int64_t* table, int32_t nthreads) {
  int64_t total = 0;
  for (int64_t t = 0; t < nt; ++t) total += table[5 * t];
#pragma omp parallel num_threads(nthreads)
  {
    const int64_t T = omp_get_num_threads(), id = omp_get_thread_num(), units = (total + 15) / 16;
    const int64_t lo = std::min(total, units * id / T * 16), hi = std::min(total, units * (id + 1) / T * 16);
    int64_t base = 0;
    for (int64_t t = 0; t < nt && base < hi; base += table[5 * t], ++t) {
      const int64_t* e = table + 5 * t;
      const int64_t s = std::max(lo, base), end = std::min(hi, base + e[0]), off = s - base;
      float* __restrict p = reinterpret_cast<float*>(e[1]) + off;
      const float* __restrict g = reinterpret_cast<const float*>(e[2]) + off;
      float* __restrict m = reinterpret_cast<float*>(e[3]) + off;
      float* __restrict v = reinterpret_cast<float*>(e[4]) + off;
#pragma omp simd
      for (int64_t i = 0; i < end - s; ++i) { p[i] += 1e-3f * g[i]; m[i] *= 0.9f; v[i] *= 0.999f; }
    }
  }
}
"""


def emit(obj: dict) -> None:
    print(json.dumps(obj), flush=True)


def split_sizes(total: int, parts: int) -> list[int]:
    base, extra = divmod(total, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]


def time_interleaved(variants: dict[str, Callable[[], object]], repeats: int) -> dict[str, list[float]]:
    """Runs every variant once per repetition, rotating the start; returns seconds per call."""
    names = list(variants)
    for name in names:  # warm-up: lazy state allocation, page faults, thread pools
        variants[name]()
    times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(repeats):
        for name in names[r % len(names):] + names[: r % len(names)]:
            t0 = time.perf_counter()
            variants[name]()
            times[name].append(time.perf_counter() - t0)
    return times


def native_bound(params, grads, ms, vs) -> Callable[[], None] | None:
    try:
        lib = build_native_library(_BOUND_SOURCE, "bench_bound")
    except RuntimeError as e:
        emit({"variant": "bound_native_1pass", "error": str(e)})
        return None
    lib.bound_step.argtypes = [ctypes.c_int64, ctypes.c_void_p, ctypes.c_int32]
    table = torch.tensor([[p.numel(), p.data_ptr(), g.data_ptr(), m.data_ptr(), v.data_ptr()]
                          for p, g, m, v in zip(params, grads, ms, vs)], dtype=torch.int64)  # int64 [nt, 5]
    return lambda: lib.bound_step(len(params), table.data_ptr(), torch.get_num_threads())


def chunked_hot_copy(opt: CPUAdam, dests: list[torch.Tensor], chunk: int) -> None:
    """The copy-out alternative CPUAdam's torch kernel does NOT use: ``_fused_adamw_`` on a
    chunk, then copy that chunk to bf16 while it is still in cache (kept to re-measure)."""
    group = opt.param_groups[0]
    hyper = dict(lr=group["lr"], beta1=group["betas"][0], beta2=group["betas"][1], weight_decay=group["weight_decay"],
                 eps=group["eps"], amsgrad=False, maximize=False, grad_scale=None, found_inf=None)
    states = [opt.state[p] for p in group["params"]]
    torch._foreach_add_([st["step"] for st in states], 1.0)
    for p, st, d in zip(group["params"], states, dests):
        views = (t.view(-1).split(chunk) for t in (p, p.grad, st["exp_avg"], st["exp_avg_sq"], d))
        for pc, gc, mc, vc, dc in zip(*views):
            torch._fused_adamw_([pc], [gc], [mc], [vc], [], [st["step"]], **hyper)
            dc.copy_(pc)


def deepspeed_variants(params, dests) -> dict[str, Callable[[], None]]:
    """DeepSpeedCPUAdam, only if importable (never a dependency of this project)."""
    if importlib.util.find_spec("deepspeed") is None:
        return {}
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        ds = DeepSpeedCPUAdam(params, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, adamw_mode=True)
        ds_copy = DeepSpeedCPUAdam(params, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, adamw_mode=True)
    except Exception as e:  # a failed JIT build must not sink the rest of the benchmark
        emit({"variant": "deepspeed", "error": f"{type(e).__name__}: {e}"})
        return {}
    if "fp16_param_groups" in inspect.signature(ds_copy.step).parameters:
        def ds_bf16() -> None:  # older DeepSpeed copies into the low-precision params itself
            ds_copy.step(fp16_param_groups=[dests])
    else:
        def ds_bf16() -> None:  # 0.19 dropped that; ZeRO-Offload copies in a separate pass
            ds_copy.step()
            torch._foreach_copy_(dests, params)
    return {"deepspeed": ds.step, "deepspeed_bf16_copy": ds_bf16}


def eight_bit_variants(params) -> dict[str, Callable[[], None]]:
    """8-bit AdamW: ours, and bitsandbytes' and torchao's where they import (each its own state)."""
    variants: dict[str, Callable[[], None]] = {
        "cpu_adam_8bit": CPUAdam(params, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, state_bits=8).step}
    for name, module, cls in (("bnb_adamw8bit", "bitsandbytes", "optim.AdamW8bit"),
                              ("torchao_adamw8bit", "torchao", "optim.AdamW8bit")):
        if importlib.util.find_spec(module) is None:
            continue
        try:
            factory = importlib.import_module(module)
            for part in cls.split("."):
                factory = getattr(factory, part) if hasattr(factory, part) else importlib.import_module(
                    f"{factory.__name__}.{part}")
            opt = factory(params, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)
            opt.step()  # creates its state (and compiles, for torchao) outside the timing
            variants[name] = opt.step
        except Exception as e:  # a library that does not run here must not sink the benchmark
            emit({"variant": name, "error": f"{type(e).__name__}: {e}"[:500]})
    return variants


def thread_study(params: list[torch.Tensor], threads: int, repeats: int, kernels: list[str]) -> None:
    """Two big groups: sequential vs two Python threads (default OpenMP teams, or capped so
    that threads x team = cores); then whether the GIL is free while a kernel runs."""
    half, n = len(params) // 2, sum(p.numel() for p in params)
    variants: dict[str, Callable[[], object]] = {}
    for kernel in kernels:
        opt = CPUAdam([{"params": params[:half]}, {"params": params[half:]}], kernel=kernel)

        def run_threads(opt: CPUAdam, team: int | None) -> Callable[[], None]:
            def work(gi: int) -> None:
                if team is not None:
                    torch.set_num_threads(team)
                opt.step_groups([gi])

            def go() -> None:
                ts = [threading.Thread(target=work, args=(gi,)) for gi in (0, 1)]
                for t in ts:
                    t.start()
                for t in ts:
                    t.join()
                # A worker's set_num_threads also moves torch's process-wide default (what new
                # threads start with); record what the main thread sees, then restore it.
                go.main_after = torch.get_num_threads()
                torch.set_num_threads(threads)

            return go

        variants[f"{kernel}:sequential"] = lambda opt=opt: (opt.step_groups([0]), opt.step_groups([1]))
        variants[f"{kernel}:two_threads_default_team"] = run_threads(opt, None)
        variants[f"{kernel}:two_threads_team_{max(1, threads // 2)}"] = run_threads(opt, max(1, threads // 2))
    for name, ts in time_interleaved(variants, repeats).items():
        med = statistics.median(ts)
        row = {"study": "threads", "variant": name, "median_ms": round(med * 1e3, 2), "min_ms": round(min(ts) * 1e3, 2),
               "mparams_per_s": round(n / med / 1e6, 1), "intra_op_threads": threads}
        if hasattr(variants[name], "main_after"):
            row["main_thread_num_threads_after"] = variants[name].main_after
        emit(row)

    # GIL: pure-Python loop iterations in the main thread while a worker (team of 1, leaving
    # a core free) steps a group, relative to the same loop with nothing else running.
    for kernel in kernels:
        opt = CPUAdam([{"params": params[:half]}], kernel=kernel)
        ratios = []
        for _ in range(max(2, repeats // 2)):
            stop, count = threading.Event(), 0
            t0 = time.perf_counter()
            threading.Timer(0.2, stop.set).start()
            while not stop.is_set():
                count += 1
            idle = count / (time.perf_counter() - t0)

            def work() -> None:
                torch.set_num_threads(1)
                opt.step_groups([0])
                stop.set()

            stop, count = threading.Event(), 0
            w = threading.Thread(target=work)
            t0 = time.perf_counter()
            w.start()
            while not stop.is_set():
                count += 1
            ratios.append(count / (time.perf_counter() - t0) / idle)
            w.join()
        torch.set_num_threads(threads)
        emit({"study": "gil", "kernel": kernel, "python_loop_rate_while_stepping_vs_idle": round(statistics.median(ratios), 3),
              "note": "~1: the GIL is released during the kernel; ~0: it is held"})


def main() -> None:
    started = time.perf_counter()
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer repetitions, no chunk sweep (< 2 min on 2 cores)")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes, seconds; for CI")
    ap.add_argument("--params", type=float, default=100e6, help="total fp32 parameters (default 100e6)")
    ap.add_argument("--tensors", type=int, default=50, help="number of parameter tensors (default 50)")
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)), help="intra-op threads (default: all cores)")
    ap.add_argument("--repeats", type=int, default=None, help="timed repetitions per variant")
    ap.add_argument("--chunk-numel", type=int, default=DEFAULT_CHUNK_NUMEL, help="CPUAdam(kernel='torch') chunk size")
    ap.add_argument("--no-foreach", action="store_true", help="skip torch_foreach (slow)")
    args = ap.parse_args()
    if args.smoke:
        args.params, args.tensors = min(args.params, 200_000), min(args.tensors, 5)
    repeats = args.repeats or (2 if args.smoke else 9 if args.quick else 21)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    native_error = native_kernel_error()
    kernels = ["native", "torch"] if native_error is None else ["torch"]

    sizes = split_sizes(int(args.params), args.tensors)
    n = sum(sizes)
    params = [torch.randn(s) for s in sizes]  # fp32 [s] each, shared by every variant
    for p in params:
        p.grad = torch.randn_like(p)
    grads = [p.grad for p in params]
    dests = list(torch.empty(n, dtype=torch.bfloat16).split(sizes))  # bf16 [n]: the staging buffer a GPU copy reads
    emit({"config": True, "params": n, "tensors": args.tensors, "threads": args.threads, "repeats": repeats,
          "chunk_numel": args.chunk_numel, "torch": torch.__version__, "native_kernel_error": native_error,
          "cpu_capability": torch.backends.cpu.get_cpu_capability(),
          "mode": "smoke" if args.smoke else "quick" if args.quick else "full"})

    shared_state: dict = {}

    def cpu_adam(kernel: str = "auto", copy_out: bool = False, chunk_numel: int = args.chunk_numel) -> CPUAdam:
        opt = CPUAdam(params, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, kernel=kernel, chunk_numel=chunk_numel)
        # All CPUAdam variants share one state (0.8 GB at 100M params): nothing survives in
        # cache between calls at these sizes, and the step count does not change the timing.
        opt.state = shared_state.setdefault("state", opt.state)
        if copy_out:
            for p, d in zip(params, dests):
                opt.register_copy_out(p, d)
        return opt

    fused = torch.optim.AdamW(params, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, fused=True)
    bound_m = [torch.zeros(s) for s in sizes]  # fp32 [s]: the bounds' own "exp_avg"
    bound_v = [torch.zeros(s) for s in sizes]  # fp32 [s]: the bounds' own "exp_avg_sq"

    def bound_torch() -> None:
        torch._foreach_add_(params, grads, alpha=1e-3)
        torch._foreach_mul_(bound_m, 0.9)
        torch._foreach_mul_(bound_v, 0.999)

    variants: dict[str, Callable[[], object]] = {
        "cpu_adam": cpu_adam().step,
        "torch_fused": fused.step,
        "bound_torch_3pass": bound_torch,
        "cpu_adam_bf16_copy": cpu_adam(copy_out=True).step,
        "cpu_adam_scaled": lambda o=cpu_adam(): o.step(clip_coef=0.5),
    }
    if "native" in kernels:
        variants["bound_native_1pass"] = native_bound(params, grads, bound_m, bound_v) or bound_torch
        variants["cpu_adam_torch_kernel"] = cpu_adam("torch").step
        variants["cpu_adam_torch_kernel_bf16_copy"] = cpu_adam("torch", copy_out=True).step
        variants["cpu_adam_torch_kernel_scaled"] = lambda o=cpu_adam("torch"): o.step(clip_coef=0.5)
    if not args.no_foreach:
        variants["torch_foreach"] = torch.optim.AdamW(params, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, foreach=True).step
    variants.update(deepspeed_variants(params, dests))
    variants.update(eight_bit_variants(params))
    if not (args.quick or args.smoke):  # chunk size of the torch kernel's copy-out / scaled paths
        hot = cpu_adam("torch")
        hot.step()  # creates the (shared) state chunked_hot_copy reads
        for log2 in (16, 17, 18, 19, 20):
            variants[f"torch_chunked_hot_copy@chunk=2^{log2}"] = lambda c=1 << log2: chunked_hot_copy(hot, dests, c)
            scaled = cpu_adam("torch", False, 1 << log2)
            variants[f"cpu_adam_torch_kernel_scaled@chunk=2^{log2}"] = lambda o=scaled: o.step(clip_coef=0.5)

    mps: dict[str, float] = {}
    times = time_interleaved(variants, repeats)
    for name, ts in times.items():
        med = statistics.median(ts)
        mps[name] = n / med / 1e6
        emit({"variant": name, "median_ms": round(med * 1e3, 2), "min_ms": round(min(ts) * 1e3, 2),
              "mparams_per_s": round(mps[name], 1), "gb_per_s_at_28B": round(28 * n / med / 1e9, 2)})

    # Free the optimizer states before the thread study allocates its own (the closures above
    # still name these containers, so they are emptied rather than deleted).
    del variants, fused
    for container in (bound_m, bound_v, shared_state):
        container.clear()
    thread_study(params, args.threads, max(3, repeats // 2 + 1), kernels)

    def ratio(a: str, b: str) -> float | None:
        """Throughput of a over b: the median over repetitions of t_b / t_a from the SAME
        repetition (run back to back), so that minute-to-minute drift cancels."""
        if a not in times or b not in times:
            return None
        return round(statistics.median(tb / ta for ta, tb in zip(times[a], times[b])), 3)

    bound = max((k for k in mps if k.startswith("bound_")), key=mps.get)
    emit({
        "summary": True,
        "ratio_vs_torch_fused": ratio("cpu_adam", "torch_fused"),
        "ratio_vs_bound": ratio("cpu_adam", bound),
        "ratio_vs_deepspeed": ratio("cpu_adam", "deepspeed"),
        "ratio_bf16_copy_vs_deepspeed_bf16": ratio("cpu_adam_bf16_copy", "deepspeed_bf16_copy"),
        "ratio_bf16_copy_vs_plain": ratio("cpu_adam_bf16_copy", "cpu_adam"),
        "ratio_bf16_copy_vs_torch_kernel_separate_pass": ratio("cpu_adam_bf16_copy", "cpu_adam_torch_kernel_bf16_copy"),
        "ratio_scaled_vs_plain": ratio("cpu_adam_scaled", "cpu_adam"),
        "ratio_8bit_vs_fp32": ratio("cpu_adam_8bit", "cpu_adam"),
        "ratio_8bit_vs_bnb_8bit": ratio("cpu_adam_8bit", "bnb_adamw8bit"),
        "ratio_8bit_vs_torchao_8bit": ratio("cpu_adam_8bit", "torchao_adamw8bit"),
        "bound_used": bound,
        "kernel": kernels[0],
        "targets_met": {
            "ratio_vs_torch_fused>=0.95": ratio("cpu_adam", "torch_fused") >= 0.95,
            "ratio_vs_bound>=0.75": ratio("cpu_adam", bound) >= 0.75,
        },
        "mparams_per_s": {k: round(v, 1) for k, v in mps.items()},
        "params": n, "tensors": args.tensors, "threads": args.threads, "repeats": repeats,
        "elapsed_s": round(time.perf_counter() - started, 1),  # after imports
    })


if __name__ == "__main__":
    main()
