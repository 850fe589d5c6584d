"""Long context: memory per token with and without sequence tiling, and what tiling costs.

A Llama of tiny width but a realistic MLP (``ffn / h = 3.5``, gated), gradient checkpointing
on, trained one step at each length of a sweep, four ways:

* ``plain``: the untouched model and AdamW;
* ``untiled``: offloaded (window 1), ``sequence_tiling=False``;
* ``tiled``: offloaded, ``sequence_tiling=True``, ``tile_tokens=1024`` (``--tile_tokens``);
* ``attention``: ``tiled``, and ``attention_tiling=True`` (each block in query tiles of the same size).

Each (variant, length) runs in a child process of its own, which warms up at 256 tokens,
resets its peak and reports the growth of that one step: the peak RSS (VmHWM, KiB; on the CPU
device every activation is host memory) and, on CUDA, ``max_memory_allocated`` and the
engine's ledger (``device_peak_bytes``). The summary fits bytes per token over the sweep for
each variant (with one length, as ``--smoke`` runs, the growth over that length). Then, in one process, the step time at ``--time_tokens`` (4096) tiled against
untiled, interleaved (the paired ratio: tiling's cost where it is not needed), and whether
``sequence_tiling="auto"`` tiled anything at that length (it must not).

    python benchmarks/bench_long.py                   # CPU: 2k..16k
    python benchmarks/bench_long.py --device cuda     # 2k..64k
    python benchmarks/bench_long.py --smoke           # seconds (CI)
    python benchmarks/bench_long.py --device cuda --longest --hidden 2048 --ffn 8192 --layers 16 \
        --heads 32 --vocab 128256                     # the longest a Llama-3.2-1B shape trains here
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

CHILD = r"""
import ctypes, json, sys
import torch
import transformers as T

args = json.loads(sys.argv[1])
torch.manual_seed(0)
torch.set_num_threads(1)
device = torch.device(args["device"])
cfg = T.LlamaConfig(vocab_size=args["vocab"], hidden_size=args["hidden"], intermediate_size=args["ffn"],
                    num_hidden_layers=args["layers"], num_attention_heads=args["heads"],
                    num_key_value_heads=max(1, args["heads"] // 4),
                    max_position_embeddings=max(args["length"], 256), tie_word_embeddings=False)
model = T.LlamaForCausalLM(cfg)
model.train()
model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
engine = None
if args["variant"] == "plain":
    model.to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
else:
    from stronghold_hf import StrongholdConfig, offload_model

    tiling = args["variant"] in ("tiled", "attention")
    engine = offload_model(model, StrongholdConfig(window_size=1, resident=False, sequence_tiling=tiling,
                                                   attention_tiling=args["variant"] == "attention",
                                                   tile_tokens=args["tile_tokens"],
                                                   param_dtype=torch.bfloat16 if args["bf16"] else None),
                           device=device)
    opt = engine.build_optimizer(lr=1e-4)


def step(n):
    ids = torch.randint(0, args["vocab"], (1, n), device=device)
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=args["bf16"]):
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    if engine is not None:
        engine.synchronize()


def status_kib(field):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


step(256)
ctypes.CDLL("libc.so.6").malloc_trim(0)
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")
rss0 = status_kib("VmRSS")
out = {}
if device.type == "cuda":
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    cuda0 = torch.cuda.memory_allocated()
if engine is not None:
    engine.reset_peak_memory_stats()
step(args["length"])
out["rss_growth_bytes"] = (status_kib("VmHWM") - rss0) * 1024
if device.type == "cuda":
    out["cuda_peak_growth_bytes"] = torch.cuda.max_memory_allocated() - cuda0
if engine is not None:
    out["ledger_device_peak_bytes"] = engine.memory_stats()["device_peak_bytes"]
print(json.dumps(out))
"""


def child(variant: str, length: int, args) -> dict:
    spec = dict(variant=variant, length=length, device=args.device, hidden=args.hidden, ffn=args.ffn,
                layers=args.layers, heads=args.heads, vocab=args.vocab, tile_tokens=args.tile_tokens,
                bf16=args.device == "cuda")
    env = dict(os.environ, OMP_NUM_THREADS="1", MALLOC_MMAP_THRESHOLD_="65536")
    proc = subprocess.run([sys.executable, "-c", CHILD, json.dumps(spec)], capture_output=True, text=True,
                          timeout=args.child_timeout, env=env)
    if proc.returncode != 0:
        return {"error": proc.stderr.strip().splitlines()[-1][:300] if proc.stderr.strip() else f"exit {proc.returncode}"}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def slope(xs: list[int], ys: list[float]) -> float | None:
    if len(xs) < 2:
        return None
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)


def timing(args) -> dict:
    """Step time at ``args.time_tokens``, tiled (and with attention tiling too) against untiled,
    interleaved; and whether "auto" tiled anything there."""
    import torch
    import transformers as T

    from stronghold_hf import StrongholdConfig, offload_model
    from stronghold_hf.tiling import tiled_modules

    torch.set_num_threads(1)
    device = torch.device(args.device)
    cfg = T.LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.ffn,
                        num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=1,
                        max_position_embeddings=args.time_tokens, tie_word_embeddings=False)
    runs = {}
    for name, tiling in (("untiled", False), ("tiled", True), ("attention", True), ("auto", "auto")):
        torch.manual_seed(0)
        model = T.LlamaForCausalLM(cfg)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        engine = offload_model(model, StrongholdConfig(window_size=1, resident=False, sequence_tiling=tiling,
                                                       attention_tiling=name == "attention",
                                                       tile_tokens=args.tile_tokens), device=device)
        runs[name] = (model, engine, engine.build_optimizer(lr=1e-4), [])
    ids = torch.randint(0, args.vocab, (1, args.time_tokens), device=device)

    def step(model, engine, opt) -> float:
        t0 = time.perf_counter()
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        engine.synchronize()
        if device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - t0

    for model, engine, opt, _ in runs.values():
        step(model, engine, opt)  # warm-up (and the probe, for the tiled engine)
    ratios, attention_ratios = [], []
    for rnd in range(args.rounds):
        order = ["untiled", "tiled", "attention"] if rnd % 2 == 0 else ["attention", "tiled", "untiled"]
        this = {}
        for name in order:
            model, engine, opt, times = runs[name]
            this[name] = statistics.median(step(model, engine, opt) for _ in range(args.steps))
            times.append(this[name])
        ratios.append(this["tiled"] / this["untiled"])
        attention_ratios.append(this["attention"] / this["untiled"])
    model, engine, opt, _ = runs["auto"]
    step(model, engine, opt)
    auto_calls = sum(site.calls for site in tiled_modules(model).values())
    tiled_calls = sum(site.calls for site in tiled_modules(runs["tiled"][0]).values())
    for _, engine, _, _ in runs.values():
        engine.close()
    return {"time_tokens": args.time_tokens, "untiled_step_s": round(statistics.median(runs["untiled"][3]), 4),
            "tiled_step_s": round(statistics.median(runs["tiled"][3]), 4),
            "tiled_over_untiled_paired": round(statistics.median(ratios), 3),
            "attention_over_untiled_paired": round(statistics.median(attention_ratios), 3),
            "tiled_calls": tiled_calls, "auto_tiled_calls": auto_calls}


def longest_run(args) -> dict:
    """``--longest``: the longest sequence the estimator says fits this device for the shape
    given (tiled, checkpointing, the model in bf16 on CUDA; ``--longest_variant attention``:
    with attention tiling too), then one training step at it in a child process: its
    allocator peak against the estimate."""
    import torch
    import transformers as T

    from stronghold_hf.estimate import estimate

    cfg = T.LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.ffn,
                        num_hidden_layers=args.layers, num_attention_heads=args.heads,
                        num_key_value_heads=max(1, args.heads // 4), tie_word_embeddings=args.vocab < 200000,
                        max_position_embeddings=1 << 22)
    device_bytes = torch.cuda.mem_get_info()[1] if args.device == "cuda" else 4 << 30  # CPU: a plumbing run

    def fits(n: int):
        e = estimate(cfg, seq_len=n, batch_size=1, dtype="bf16" if args.device == "cuda" else "fp32",
                     gpu_memory_bytes=device_bytes, cpu_memory_bytes=1 << 50, gradient_checkpointing=True,
                     sequence_tiling=True, tile_tokens=args.tile_tokens, auto_class="causal_lm",
                     attention_tiling=args.longest_variant == "attention", device=args.device)
        return e.gpu_fits, e

    lo, hi = 1024, args.max_tokens or ((1 << 22) if args.device == "cuda" else 16384)
    while hi - lo > 1024:
        mid = (lo + hi) // 2 // 1024 * 1024
        lo, hi = (mid, hi) if fits(mid)[0] else (lo, mid)
    _, e = fits(lo)
    run = child(args.longest_variant, lo, args)
    return {"variant": args.longest_variant, "longest_tokens": lo, "estimated_gpu_bytes": e.gpu_bytes_needed, "device_bytes": device_bytes,
            "bounded_by": e.gpu_bounded_by, **run}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--lengths", default=None, help="comma-separated token counts (default: 2k..16k on CPU, ..64k on CUDA)")
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--ffn", type=int, default=224, help="MLP width (224 = 3.5 x 64, Llama-3's ratio)")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=2)
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--tile_tokens", default=1024, type=lambda v: v if v == "auto" else int(v),
                   help="tokens per tile (default 1024: \"auto\" sizes tiles to about 256 MiB of saved "
                   "intermediates, so a model of this width would run in one tile below 16k tokens)")
    p.add_argument("--time_tokens", type=int, default=4096)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--child_timeout", type=int, default=900)
    p.add_argument("--variants", default="plain,untiled,tiled,attention",
                   help="which of plain, untiled, tiled, attention (sequence and attention tiling) to sweep")
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--longest", action="store_true",
                   help="instead of the sweep: one tiled step at the longest length the estimator says fits")
    p.add_argument("--longest_variant", choices=("tiled", "attention"), default="tiled",
                   help="--longest: sequence tiling (the default), or attention tiling as well")
    p.add_argument("--max_tokens", type=int, default=None,
                   help="--longest: search no further than this (a step's attention grows with the square "
                        "of the length; default 4M tokens on CUDA, 16k on the CPU)")
    args = p.parse_args(argv)
    if args.longest:
        print(json.dumps({"bench": "long", "mode": "longest", "device": args.device, "hidden": args.hidden,
                          "layers": args.layers, **longest_run(args)}), flush=True)
        return 0
    if args.smoke:
        # One length: a child per variant (they run one after another, never side by side), the plumbing
        # of every variant; the fit over lengths is the full run's.
        args.lengths, args.time_tokens, args.rounds, args.steps, args.tile_tokens = "1024", 512, 1, 1, 128
    default = "2048,4096,8192,16384,32768,65536" if args.device == "cuda" else "2048,4096,8192,16384"
    lengths = [int(x) for x in (args.lengths or default).split(",")]
    per_token = {}
    for variant in args.variants.split(","):
        rows = []
        for n in lengths:
            r = child(variant, n, args)
            print(json.dumps({"variant": variant, "tokens": n, **r}), flush=True)
            if "error" not in r:
                rows.append((n, r))
        key = "cuda_peak_growth_bytes" if args.device == "cuda" else "rss_growth_bytes"
        if len(rows) == 1:
            fitted = rows[0][1][key] / rows[0][0]
        else:
            fitted = slope([n for n, _ in rows], [r[key] for _, r in rows])
        per_token[variant] = None if fitted is None else round(fitted, 1)
    summary = {"bench": "long", "device": args.device, "lengths": lengths, "hidden": args.hidden, "ffn": args.ffn,
               "layers": args.layers, "tile_tokens": args.tile_tokens, "bytes_per_token": per_token,
               "tiled_over_untiled_bytes_per_token": (round(per_token["tiled"] / per_token["untiled"], 3)
                                                      if per_token.get("tiled") and per_token.get("untiled") else None)}
    summary.update(timing(args))
    print(json.dumps(summary), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
