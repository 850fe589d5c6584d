"""The memory ledger at several depths: device peak, host bytes per parameter, fetches per step.

Why: the product's promise is that device memory does not grow with depth and that the host
pays a known number of bytes per parameter. This trains a GPT-2 of a fixed width at several
depths for a few steps and prints, per depth, what the engine's ledger booked
(``engine.memory_stats()``): the device peak, the host bytes per offloaded parameter (and
without the bounded staging), and the blocks fetched per step (``2 N - W`` when the turn is
free). On CUDA it also records ``torch.cuda.max_memory_allocated`` over the same steps, and
optionally trains the deepest model under a per-process memory cap of a third of its blocks.

Output: one JSON line per depth, then a summary line (the last line) with
``device_peak_ratio_deep_vs_shallow`` and, on CUDA, ``ledger_vs_cuda_peak_max_rel_diff``.

    python benchmarks/bench_memory.py                      # CPU: 4, 16, 64 blocks, width 64
    python benchmarks/bench_memory.py --device cuda --width 1024 --depths 4,16,64 --cap_third
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402
import transformers  # noqa: E402

from stronghold_hf import StrongholdConfig, offload_model  # noqa: E402

transformers.logging.set_verbosity_error()

VOCAB = 128


def build(depth: int, width: int) -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=VOCAB, n_embd=width, n_layer=depth, n_head=max(1, width // 64),
                                  n_positions=256, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                  bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(cfg).train()


def run_depth(depth: int, args) -> dict:
    device = torch.device(args.device)
    model = build(depth, args.width)
    engine = offload_model(model, StrongholdConfig(window_size=args.window, grad_buffers=args.grad_buffers),
                           device=device)
    opt = engine.build_optimizer(lr=1e-4)
    g = torch.Generator().manual_seed(0)
    fetches = []
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    losses = []
    for _ in range(args.steps):
        ids = torch.randint(0, VOCAB, (args.batch, args.seq), generator=g).to(device)
        before = engine.memory_stats()["fetches"]
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        engine.clip_grad_norm_(1.0)
        opt.step()
        opt.zero_grad()
        fetches.append(engine.memory_stats()["fetches"] - before)
        losses.append(loss.item())
    engine.synchronize()
    stats = engine.memory_stats()
    staging = args.grad_buffers * engine.grad_queue.max_bytes
    host = stats["pinned_host_bytes"] + stats["pageable_host_bytes"]
    row = {
        "depth": depth, "width": args.width, "window_size": engine.window_size, "grad_buffers": args.grad_buffers,
        "offloaded_params": stats["offloaded_params"],
        "device_peak_bytes": stats["device_peak_bytes"],
        "device_bound_bytes": (engine.window_size + 1) * stats["slot_bytes"] + args.grad_buffers * stats["grad_buffer_bytes"],
        "host_bytes": host, "host_bytes_per_param": host / stats["offloaded_params"],
        "host_bytes_per_param_without_staging": (host - staging) / stats["offloaded_params"],
        "pinned_host_bytes": stats["pinned_host_bytes"], "staging_bytes": staging,
        "fetches_per_step": fetches, "expected_fetches_per_step": 2 * depth - engine.window_size,
        "losses_finite": all(math.isfinite(x) for x in losses),
    }
    if cuda:
        torch.cuda.synchronize()
        row["cuda_max_allocated_bytes"] = torch.cuda.max_memory_allocated() - base
        row["ledger_vs_cuda_rel_diff"] = abs(row["cuda_max_allocated_bytes"] - row["device_peak_bytes"]) / max(
            row["device_peak_bytes"], 1)
    engine.close()
    return row


def run_capped(depth: int, args) -> dict:
    """Trains a model whose blocks total 3x the memory the process may allocate on the GPU."""
    model = build(depth, args.width)
    blocks = sum(p.numel() * p.element_size() for p in model.transformer.h.parameters())
    engine = offload_model(model, StrongholdConfig(window_size=args.window), device=args.device)
    torch.cuda.synchronize()
    cap = blocks // 3 + torch.cuda.memory_allocated()
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(cap / total)
    out = {"capped": True, "depth": depth, "block_bytes": blocks, "cap_bytes": cap}
    try:
        opt = engine.build_optimizer(lr=1e-4)
        ids = torch.randint(0, VOCAB, (args.batch, args.seq)).cuda()
        losses = []
        for _ in range(3):
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            engine.clip_grad_norm_(1.0)
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        out.update(trained=True, losses=losses, blocks_over_cap=blocks / cap,
                   device_peak_bytes=engine.memory_stats()["device_peak_bytes"])
    except torch.cuda.OutOfMemoryError as err:
        out.update(trained=False, error=str(err)[:300])
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
        engine.close()
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--depths", default="4,16,64")
    ap.add_argument("--width", type=int, default=64)
    ap.add_argument("--window", type=int, default=2)
    ap.add_argument("--grad_buffers", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--cap_third", action="store_true", help="CUDA: also train the deepest model under a cap of 1/3")
    args = ap.parse_args(argv)
    rows = []
    for depth in [int(x) for x in args.depths.split(",")]:
        row = run_depth(depth, args)
        rows.append(row)
        print(json.dumps(row), flush=True)
    summary = {
        "summary": True, "device": args.device, "width": args.width,
        "device_peak_bytes_by_depth": {r["depth"]: r["device_peak_bytes"] for r in rows},
        "device_peak_ratio_deep_vs_shallow": rows[-1]["device_peak_bytes"] / rows[0]["device_peak_bytes"],
        "host_bytes_per_param_by_depth": {r["depth"]: round(r["host_bytes_per_param"], 3) for r in rows},
        "host_bytes_per_param_without_staging_by_depth": {
            r["depth"]: round(r["host_bytes_per_param_without_staging"], 3) for r in rows},
        "fetches_per_step_by_depth": {r["depth"]: r["fetches_per_step"][-1] for r in rows},
        "turn_is_free": all(r["fetches_per_step"][-1] == r["expected_fetches_per_step"] for r in rows),
        "peak_within_bound": all(r["device_peak_bytes"] <= r["device_bound_bytes"] for r in rows),
    }
    if args.device.startswith("cuda"):
        summary["ledger_vs_cuda_peak_max_rel_diff"] = max(r["ledger_vs_cuda_rel_diff"] for r in rows)
        if args.cap_third:
            capped = run_capped(max(int(x) for x in args.depths.split(",")), args)
            print(json.dumps(capped), flush=True)
            summary["capped_run"] = {k: capped.get(k) for k in ("trained", "blocks_over_cap", "device_peak_bytes")}
    print(json.dumps(summary), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
