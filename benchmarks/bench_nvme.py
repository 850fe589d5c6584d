"""The NVMe tier against the disk it streams from, and against keeping the moments in RAM.

Why: with ``StrongholdConfig(nvme_path=DIR)`` every step reads each unit's Adam moments from
disk before its update and writes them back after it (nvme.py). The best it can do is move
those bytes at the disk's bandwidth with the CPU Adam update hidden behind the stream. This
measures the disk first (sequential read and write through the tier's own I/O path: the
same thread pool, chunks, ``O_DIRECT`` where the file system takes it), then the engine.

Output, JSON lines:
  ``{"bench": "nvme", "part": "disk", "write_gb_per_s": ..., "read_gb_per_s": ..., "direct": ...}``
  ``{"part": "engine", "tier": "ram" | "nvme", "step_s": ..., "update_s": ...}``: median step of
  an offloaded Llama (CUDA, or the CPU device), and its update phase (``optimizer.step()``
  until every CPU update finished and, NVMe tier, its last write-back landed);
  a summary line: ``state_bytes_per_step`` (read + written), ``io_bound_s`` (those bytes at the
  disk's measured rates), ``ratio_of_disk_bound`` = ``io_bound_s / update_s`` of the NVMe tier
  (1.0: the update runs at the disk's bandwidth; target >= 0.8 when the disk is the
  bottleneck; above 1 when the next step's first units were read ahead during the forward
  and backward, outside the update phase), ``hidden_ratio`` = ``max(io_bound_s, ram update_s) / nvme update_s`` (1.0: the
  update hides fully behind the stream or the stream behind the update), and the paired
  ``step_ratio_nvme_vs_ram``. With ``nvme_masters`` (the third engine run, ``tier:
  "nvme_masters"``) the summary adds the same figures for it (``masters_*``): its update moves
  masters and moments (12 B/param exact), and every fetch reads the masters
  (``fetch_read_bytes_per_step``, ``masters_fetch_read_s``: those bytes at the disk's read rate).

    python benchmarks/bench_nvme.py --nvme_path /mnt/nvme          # a 12-block, 51 M-parameter Llama
    python benchmarks/bench_nvme.py --nvme_path /tmp --disk_mb 256 --layers 4 --steps 3   # quick

``--vocab 32000`` makes the embedding and head larger than a block: their state streams in
block-sized segments (``optim/segments.py``; ``cut_units`` in the engine lines), so the ring is
sized by a block; ``--whole_units`` turns segments off for comparison (one region per unit,
the ring sized by the head).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

import torch


def disk_rates(root: str, nbytes: int, io_threads: int) -> dict:
    from stronghold_hf import swap

    directory = swap.SwapDirectory(root)
    try:
        f = swap.StateFile(directory.file("bench.bin"), nbytes, io_threads=io_threads)
        buf = swap._aligned_empty(nbytes)
        buf.random_(0, 255)
        rates = {}
        for name, write in (("write", True), ("read", False)):
            best = float("inf")
            for _ in range(3):
                t0 = time.perf_counter()
                for fut in f.submit(write, buf, 0):
                    fut.result()
                if write and not f.direct:
                    os.fsync(f.fd)  # buffered writes count once they reach the disk (O_DIRECT ones have)
                best = min(best, time.perf_counter() - t0)
            rates[f"{name}_gb_per_s"] = nbytes / best / 1e9
        direct = f.direct
        f.close()
    finally:
        directory.remove()
    return {"bench": "nvme", "part": "disk", "bytes": nbytes, "direct": direct, "io_threads": io_threads, **rates}


def engine_run(tier: str, args, device: str) -> dict:
    from transformers import LlamaConfig, LlamaForCausalLM

    from stronghold_hf import StrongholdConfig, offload_model

    from stronghold_hf.optim.segments import StateSegments

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=4 * args.hidden,
                      num_hidden_layers=args.layers, num_attention_heads=8, num_key_value_heads=8,
                      tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg)
    extra = dict(nvme_path=args.nvme_path, nvme_io_threads=args.io_threads,
                 nvme_ring_buffers=args.ring) if tier != "ram" else {}
    if tier == "nvme_masters":
        extra["nvme_masters"] = True
    engine = offload_model(model, StrongholdConfig(resident=False, window_size=2, **extra), device=device)
    for_engine = StateSegments.for_engine
    if args.whole_units:  # for comparison only: one region per unit, as before segments
        StateSegments.for_engine = classmethod(lambda cls, engine: None)
    try:
        opt = engine.build_optimizer(lr=1e-4)
    finally:
        StateSegments.for_engine = for_engine
    ids = torch.randint(0, args.vocab, (1, args.seq), device=device)
    steps, updates = [], []
    for i in range(args.steps + 1):
        t0 = time.perf_counter()
        model(input_ids=ids, labels=ids).loss.backward()
        if i == 1:
            before = engine.memory_stats()
        t1 = time.perf_counter()
        opt.step()
        engine.synchronize()
        if opt.nvme is not None:
            opt.nvme.wait_for_writes()  # the update phase ends when its state is back on disk
        t2 = time.perf_counter()
        opt.zero_grad()
        if i:  # the first step allocates (RAM tier) or reads nothing (NVMe tier)
            steps.append(t2 - t0)
            updates.append(t2 - t1)
    stats = engine.memory_stats()
    moved = (stats["nvme_read_bytes"] - before["nvme_read_bytes"] + stats["nvme_written_bytes"]
             - before["nvme_written_bytes"]) / args.steps
    read = (stats["nvme_read_bytes"] - before["nvme_read_bytes"]) / args.steps
    fetched = (stats["nvme_masters_read_bytes"] - before["nvme_masters_read_bytes"]) / args.steps
    out = {"bench": "nvme", "part": "engine", "tier": tier, "device": device, "step_s": statistics.median(steps),
           "update_s": statistics.median(updates), "trainable_params": stats["offloaded_trainable_params"],
           "state_bytes_per_step": moved, "read_bytes_per_step": read, "fetch_read_bytes_per_step": fetched,
           "host_bytes": stats["pinned_host_bytes"]
           + stats["pageable_host_bytes"], "nvme_ring_bytes": stats["nvme_ring_bytes"],
           "cut_units": len(opt.segments.cut_units) if opt.segments is not None else 0}
    engine.close()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nvme_path", default=None, help="directory on the disk to measure (default: a temp dir)")
    p.add_argument("--disk_mb", type=int, default=1024, help="bytes written and read to measure the disk")
    p.add_argument("--io_threads", type=int, default=4)
    p.add_argument("--ring", type=int, default=3, help="StrongholdConfig.nvme_ring_buffers")
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--whole_units", action="store_true",
                   help="no segments: one NVMe region per unit, the ring sized by the largest unit (comparison)")
    args = p.parse_args()
    tmp = None
    if args.nvme_path is None:
        tmp = tempfile.TemporaryDirectory(dir=os.environ.get("TMPDIR"))
        args.nvme_path = tmp.name
    device = "cuda" if torch.cuda.is_available() else "cpu"
    disk = disk_rates(args.nvme_path, args.disk_mb << 20, args.io_threads)
    print(json.dumps(disk), flush=True)
    ram = engine_run("ram", args, device)
    print(json.dumps(ram), flush=True)
    nv = engine_run("nvme", args, device)
    print(json.dumps(nv), flush=True)
    masters = engine_run("nvme_masters", args, device)
    print(json.dumps(masters), flush=True)

    def bound(run: dict) -> float:
        read = run["read_bytes_per_step"]
        return read / (disk["read_gb_per_s"] * 1e9) + (run["state_bytes_per_step"] - read) / (
            disk["write_gb_per_s"] * 1e9)

    io_bound, masters_bound = bound(nv), bound(masters)
    print(json.dumps({
        "bench": "nvme", "part": "summary", "device": device, "direct": disk["direct"],
        "state_bytes_per_step": nv["state_bytes_per_step"], "io_bound_s": io_bound,
        "ratio_of_disk_bound": io_bound / nv["update_s"],
        "hidden_ratio": max(io_bound, ram["update_s"]) / nv["update_s"],
        "step_ratio_nvme_vs_ram": nv["step_s"] / ram["step_s"],
        "host_bytes_saved_per_param": (ram["host_bytes"] - nv["host_bytes"]) / nv["trainable_params"],
        "masters_state_bytes_per_step": masters["state_bytes_per_step"], "masters_io_bound_s": masters_bound,
        "masters_ratio_of_disk_bound": masters_bound / masters["update_s"],
        "masters_fetch_read_bytes_per_step": masters["fetch_read_bytes_per_step"],
        "masters_fetch_read_s": masters["fetch_read_bytes_per_step"] / (disk["read_gb_per_s"] * 1e9),
        "step_ratio_masters_vs_ram": masters["step_s"] / ram["step_s"],
        "masters_host_bytes_saved_per_param": (ram["host_bytes"] - masters["host_bytes"]) / masters["trainable_params"],
    }), flush=True)
    if tmp is not None:
        tmp.cleanup()


if __name__ == "__main__":
    main()
