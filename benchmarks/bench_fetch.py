"""What a fetch without a host image costs: fp32 -> bf16 conversion against the copy it feeds.

Why: ``host_image=False`` saves 2 B/param of host RAM by converting the fp32 masters into a
pinned staging buffer at each fetch instead of keeping a bf16 image (transfer.py,
`FetchStaging`). The fetch then runs at the slower of the conversion and the host-to-device
copy. This measures both on one unit-sized tensor, and the whole fetch path of the engine on
the same model with the image kept and dropped.

Output, JSON lines:
  ``{"bench": "fetch", "part": "convert", "threads": T, "gb_per_s": ...}``: bf16 bytes
  written per second by ``torch.Tensor.copy_`` (fp32 -> bf16), at 1 thread and at all of them;
  ``{"part": "h2d", ...}`` (CUDA only): pinned bf16 bytes copied to the device per second;
  ``{"part": "engine", "host_image": ..., "step_s": ..., "convert_s": ...}``: median step of an
  offloaded bf16 Llama (CUDA, or the CPU device where the "copy" is the conversion itself);
  a summary line with ``convert_vs_h2d`` (>= 1: the conversion hides behind the copy) and the
  paired ``step_ratio_no_image_vs_image``.

    python benchmarks/bench_fetch.py                 # 64 M-element unit; bf16 steps at seq 64 (bf16 matmuls are slow on CPUs)
    python benchmarks/bench_fetch.py --numel 218e6   # a Llama-3-8B block
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch


def _timed(fn, repeats: int) -> float:
    fn()  # warm-up (page faults, thread pool)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def convert_rate(numel: int, threads: int, repeats: int) -> float:
    src = torch.randn(numel)
    dst = torch.empty(numel, dtype=torch.bfloat16, pin_memory=torch.cuda.is_available())
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        seconds = _timed(lambda: dst.copy_(src), repeats)
    finally:
        torch.set_num_threads(before)
    return 2 * numel / seconds / 1e9


def h2d_rate(numel: int, repeats: int) -> float:
    src = torch.empty(numel, dtype=torch.bfloat16, pin_memory=True)
    dst = torch.empty(numel, dtype=torch.bfloat16, device="cuda")
    return 2 * numel / _timed(lambda: dst.copy_(src, non_blocking=True), repeats) / 1e9


def engine_steps(host_image: bool, args: argparse.Namespace) -> dict:
    from transformers import LlamaConfig, LlamaForCausalLM

    from stronghold_hf import StrongholdConfig, offload_model

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=8192, hidden_size=args.hidden, intermediate_size=4 * args.hidden,
                      num_hidden_layers=args.layers, num_attention_heads=8, num_key_value_heads=8)
    model = LlamaForCausalLM(cfg)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    engine = offload_model(model, StrongholdConfig(resident=False, window_size=2, param_dtype=torch.bfloat16, host_image=host_image),
                           device=device)
    opt = engine.build_optimizer(lr=1e-4)
    ids = torch.randint(0, 8192, (1, args.seq), device=device)
    times, converts = [], []
    for step in range(args.steps + 1):
        engine.stats.reset()
        t0 = time.perf_counter()
        with torch.autocast(device, dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        engine.synchronize()
        if step:  # the first step builds the kernel and the staging ring
            times.append(time.perf_counter() - t0)
            converts.append(engine.stats.convert_s)
    stats = engine.memory_stats()
    engine.close()
    return {"bench": "fetch", "part": "engine", "device": device, "host_image": host_image,
            "step_s": round(statistics.median(times), 4), "convert_s": round(statistics.median(converts), 4),
            "host_bytes_per_param": round(stats["host_bytes_per_param"], 2),
            "host_image_bytes": stats["host_image_bytes"], "fetch_staging_bytes": stats["fetch_staging_bytes"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--numel", type=float, default=64e6, help="elements of the converted unit")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--steps", type=int, default=6)
    args = ap.parse_args()
    numel = int(args.numel)
    rates = {}
    for threads in sorted({1, torch.get_num_threads()}):
        rates[threads] = convert_rate(numel, threads, args.repeats)
        print(json.dumps({"bench": "fetch", "part": "convert", "numel": numel, "threads": threads,
                          "gb_per_s": round(rates[threads], 2)}), flush=True)
    h2d = None
    if torch.cuda.is_available():
        h2d = h2d_rate(numel, args.repeats)
        print(json.dumps({"bench": "fetch", "part": "h2d", "numel": numel, "gb_per_s": round(h2d, 2)}), flush=True)
    rows = {}
    for host_image in (True, False):
        rows[host_image] = engine_steps(host_image, args)
        print(json.dumps(rows[host_image]), flush=True)
    best = max(rates.values())
    print(json.dumps({"bench": "fetch", "summary": True, "convert_gb_per_s": round(best, 2),
                      "h2d_gb_per_s": round(h2d, 2) if h2d else None,
                      "convert_vs_h2d": round(best / h2d, 2) if h2d else None,
                      "step_ratio_no_image_vs_image": round(rows[True]["step_s"] / rows[False]["step_s"], 3),
                      "host_bytes_per_param": {"image": rows[True]["host_bytes_per_param"],
                                               "no_image": rows[False]["host_bytes_per_param"]}}))


if __name__ == "__main__":
    main()
