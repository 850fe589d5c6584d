"""Data parallel on CPU gloo: step time and host bytes per rank at world 1, 2, 3, against DDP.

Why: with sharded CPU state each rank keeps 1/world of every block's masters, gradients and
Adam state, so host memory per rank should fall as 1/world, at the cost of an all-gather per
block use and a reduce-scatter per flush. This launches ``torchrun`` once per world size; in
each job every rank trains, interleaved on the same batches, a plain ``DistributedDataParallel``
GPT-2 with ``torch.optim.AdamW`` and the same model under ``offload_model`` (sharded, and
replicated with ``--replicated``), and reports median step times and the engine's ledger.

Output: one JSON line per world size, then the summary (the last line) with
``host_bytes_per_rank`` by world, ``host_ratio_vs_world1`` and ``step_ratio_vs_ddp``.

    python benchmarks/bench_dp.py                 # CPU, 3 torchrun jobs, ~2 min on 2 cores
    python benchmarks/bench_dp.py --worlds 1,2 --n_layer 8 --n_embd 256
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import socket
import statistics
import subprocess
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # see bench_step.py, [Note: OpenMP wait policy]


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker(opts) -> None:
    import torch
    import torch.distributed as dist
    import transformers

    transformers.logging.set_verbosity_error()
    from stronghold_hf import StrongholdConfig, offload_model

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = transformers.GPT2Config(vocab_size=opts.vocab, n_embd=opts.n_embd, n_layer=opts.n_layer,
                                  n_head=max(1, opts.n_embd // 64), n_positions=max(64, opts.seq), bos_token_id=0,
                                  eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(0)
    base = transformers.GPT2LMHeadModel(cfg).train()
    ddp_model = torch.nn.parallel.DistributedDataParallel(copy.deepcopy(base))
    ddp_opt = torch.optim.AdamW(ddp_model.parameters(), lr=1e-4)
    variants = {"ddp": (ddp_model, ddp_opt, lambda: torch.nn.utils.clip_grad_norm_(ddp_model.parameters(), 1.0))}
    engines = {}
    for name, shard in (("stronghold_sharded", True), ("stronghold_replicated", False)):
        if name == "stronghold_replicated" and not opts.replicated:
            continue
        model = copy.deepcopy(base)
        engine = offload_model(model, StrongholdConfig(window_size=2, shard_cpu_state=shard), device="cpu")
        opt = engine.build_optimizer(lr=1e-4)
        engines[name] = engine
        variants[name] = (model, opt, lambda e=engine: e.clip_grad_norm_(1.0))
    g = torch.Generator().manual_seed(1 + rank)
    batches = [torch.randint(0, opts.vocab, (opts.batch, opts.seq), generator=g) for _ in range(4)]
    times = {k: [] for k in variants}
    for r in range(opts.rounds):
        for name in (list(variants) if r % 2 == 0 else list(reversed(variants))):
            model, opt, clip = variants[name]
            engine = engines.get(name)
            for i in range(opts.steps):
                dist.barrier()
                t0 = time.perf_counter()
                ids = batches[i % len(batches)]
                model(input_ids=ids, labels=ids).loss.backward()
                clip()
                opt.step()
                opt.zero_grad()
                if engine is not None:
                    engine.synchronize()  # a step's CPU work is charged to that step
                if i:
                    times[name].append(time.perf_counter() - t0)
    out = {"rank": rank, "world": world, "median_step_s": {k: statistics.median(v) for k, v in times.items()}}
    for name, engine in engines.items():
        stats = engine.memory_stats()
        staging = engine.grad_queue.staging_bytes * engine.config.grad_buffers
        out[f"{name}_host_bytes"] = stats["pinned_host_bytes"] + stats["pageable_host_bytes"]
        out[f"{name}_host_bytes_without_staging"] = out[f"{name}_host_bytes"] - staging
        out["offloaded_params"] = stats["offloaded_params"]
    with open(os.path.join(opts.out, f"rank{rank}.json"), "w", encoding="utf-8") as fh:
        json.dump(out, fh)
    # Leave without tearing down: torch's gloo ProcessGroup destructor, run from the DDP
    # Reducer's dealloc with the GIL held, joins a gloo thread that waits for the GIL to free a
    # finished work's tensors (seen hanging here once in ~20 runs). The results are on disk.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _run_world(opts, world: int, out: str) -> dict | None:
    """One world size under torchrun; the ranks write their JSON into ``out``. None: it failed
    (the error is printed)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={world}", f"--master_port={_port()}",
           os.path.abspath(__file__), "--_worker", "--out", out]
    for key in ("n_embd", "n_layer", "vocab", "seq", "batch", "rounds", "steps"):
        cmd += [f"--{key}", str(getattr(opts, key))]
    if opts.replicated:
        cmd.append("--replicated")
    env = dict(os.environ, OMP_NUM_THREADS=str(max(1, (os.cpu_count() or 2) // world)))
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
    if proc.returncode != 0:
        print(json.dumps({"world": world, "error": proc.stderr[-1500:]}), flush=True)
        return None
    ranks = [json.load(open(os.path.join(out, f"rank{r}.json"), encoding="utf-8")) for r in range(world)]
    med = {k: max(r["median_step_s"][k] for r in ranks) for k in ranks[0]["median_step_s"]}
    row = {"world": world, "median_step_s": {k: round(v, 4) for k, v in med.items()},
           "step_ratio_vs_ddp": {k: round(med["ddp"] / v, 3) for k, v in med.items() if k != "ddp"},
           "offloaded_params": ranks[0]["offloaded_params"]}
    for key in [k for k in ranks[0] if k.endswith("_host_bytes") or k.endswith("_without_staging")]:
        row[key + "_per_rank"] = max(r[key] for r in ranks)
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worlds", default="1,2,3")
    ap.add_argument("--n_embd", type=int, default=128)
    ap.add_argument("--n_layer", type=int, default=6)
    ap.add_argument("--vocab", type=int, default=1024)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--batch", type=int, default=2, help="per rank")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--replicated", action="store_true", help="also measure shard_cpu_state=False")
    ap.add_argument("--_worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None, help=argparse.SUPPRESS)
    opts = ap.parse_args(argv)
    if opts._worker:
        worker(opts)
        return 0
    import tempfile

    rows = []
    for world in [int(w) for w in opts.worlds.split(",")]:
        with tempfile.TemporaryDirectory(prefix=f"bench-dp-{world}-") as out:
            row = _run_world(opts, world, out)
        if row is None:
            return 1
        print(json.dumps(row), flush=True)
        rows.append(row)
    base = rows[0]
    key = "stronghold_sharded_host_bytes_without_staging_per_rank"
    summary = {
        "summary": True, "bench": "dp",
        "host_bytes_per_rank": {r["world"]: r["stronghold_sharded_host_bytes_per_rank"] for r in rows},
        "host_bytes_per_param_per_rank": {
            r["world"]: round(r["stronghold_sharded_host_bytes_per_rank"] / r["offloaded_params"], 2) for r in rows},
        "host_ratio_vs_world1": {r["world"]: round(r[key] / base[key], 3) for r in rows},
        "step_ratio_vs_ddp": {r["world"]: r["step_ratio_vs_ddp"] for r in rows},
    }
    print(json.dumps(summary), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
