"""What the CUDA caching allocator holds at its peak, by who allocated it, next to the ledger.

Why: the engine's memory ledger (stronghold_hf/ledger.py) books the engine's own device
buffers (slots, gradient lanes, resident units); ``torch.cuda.max_memory_allocated`` counts
every allocation. On the H200 run of 2026-12-04 (shared/gpu/h200-2026-12-04) the allocator's
peak was 12.4 % above the ledger in ``test_ledger_agrees_with_the_cuda_allocator`` and 1.6-3x
in ``bench_memory.py``, and nothing recorded what the difference was. This records the
allocator's history (``torch.cuda.memory._record_memory_history``, Python stacks) over a
measured window, replays it to the moment of the peak, and sums the allocations alive then
by the innermost frame outside torch that made them:

* ``engine``: a frame in ``stronghold_hf/`` (the ledger's buffers, and any temporary the
  engine makes, e.g. a norm, that the ledger does not book);
* ``model``: a frame in ``transformers/`` (activations that autograd saves, forward temporaries);
* ``no_python_frame``: C++ work with no Python on the stack: the autograd engine's backward
  thread (weight gradients before AccumulateGrad adds them into a lane, activation
  gradients), and library workspaces allocated there (cuBLAS keeps one per handle and
  stream, 32 MiB each on Hopper by default);
* ``other``: the test or benchmark itself.

Used by tests/test_gpu.py and benchmarks/bench_memory.py; the summary is a small JSON-able
dict (no stacks beyond the top entries), written next to their other output.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterable, Iterator

#: cuBLAS/cuBLASLt workspace sizes of torch's defaults (CUBLAS_WORKSPACE_CONFIG ":4096:8" on
#: Hopper, ":4096:2:16:8" before it; CUBLASLT_WORKSPACE_SIZE 1 MiB): an allocation of exactly
#: one of these sizes with no Python frame, or in a matmul, is most likely one of them.
WORKSPACE_SIZES = {32 << 20: "cuBLAS workspace (Hopper default, 32 MiB)",
                   (2 * 4096 + 8 * 16) << 10: "cuBLAS workspace (pre-Hopper default)",
                   1 << 20: "cuBLASLt workspace (1 MiB default)"}


def _where(frames: list[dict]) -> tuple[str, str]:
    """(category, "file:line function") of the innermost frame outside torch itself."""
    for f in frames:  # innermost first, as the allocator records them
        name = f.get("filename", "")
        if not name or name.startswith("<") or "/torch/" in name or name.endswith(".c") or "cuda_memory.py" in name:
            continue
        short = name
        for root in ("stronghold_hf/", "transformers/", "benchmarks/", "tests/"):
            if root in name:
                short = root + name.split(root, 1)[1]
                break
        category = ("engine" if "stronghold_hf/" in name else "model" if "transformers/" in name else "other")
        return category, f"{short}:{f.get('line')} {f.get('name')}"
    return "no_python_frame", "(no Python frame: autograd's backward thread or another C++ caller)"


def summarize_trace(trace: Iterable[dict], *, top: int = 20) -> dict:
    """Replays one device's allocator trace (``_snapshot()["device_traces"][i]``) and describes
    the moment when the most bytes were allocated, counted from where the trace starts (the
    same quantity as ``max_memory_allocated() - memory_allocated()`` at the start, after a
    ``reset_peak_memory_stats``). A block counts as allocated from ``alloc`` to
    ``free_requested`` (when ``allocated_bytes`` drops), as in the allocator's statistics.
    Blocks allocated before the trace started and freed in it lower the count."""
    events = [e for e in trace if e.get("action") in ("alloc", "free_requested", "free_completed")]

    def replay(stop: int | None) -> tuple[dict[int, dict], int, int, int]:
        live: dict[int, dict] = {}
        current = peak = peak_at = 0
        freed_requested: set[int] = set()
        for i, e in enumerate(events):
            if stop is not None and i > stop:
                break
            addr, size, action = e["addr"], e["size"], e["action"]
            if action == "alloc":
                live[addr] = e
                freed_requested.discard(addr)
                current += size
            elif action == "free_requested":
                live.pop(addr, None)  # a block allocated before the trace leaves the count all the same
                current -= size
                freed_requested.add(addr)
            elif addr in live:  # free_completed without a free_requested (older traces)
                live.pop(addr)
                current -= size
            elif addr not in freed_requested:
                current -= size  # an earlier block, completed without a request in the trace
            if current > peak:
                peak, peak_at = current, i
        return live, current, peak, peak_at

    _, end, peak, peak_at = replay(None)
    live, _, _, _ = replay(peak_at) if events else ({}, 0, 0, 0)
    groups: dict[str, dict] = {}
    by_category: dict[str, int] = {"engine": 0, "model": 0, "no_python_frame": 0, "other": 0}
    for e in live.values():
        category, where = _where(e.get("frames") or [])
        by_category[category] += e["size"]
        g = groups.setdefault(where, {"where": where, "category": category, "bytes": 0, "count": 0, "sizes": []})
        g["bytes"] += e["size"]
        g["count"] += 1
        g["sizes"].append(e["size"])
    rows = sorted(groups.values(), key=lambda g: -g["bytes"])[:top]
    for g in rows:
        sizes = sorted(g.pop("sizes"), reverse=True)
        g["largest"] = sizes[0]
        notes = sorted({WORKSPACE_SIZES[s] for s in sizes if s in WORKSPACE_SIZES})
        if notes:
            g["note"] = "; ".join(notes)
    return {
        "events": len(events), "peak_bytes_over_start": peak, "bytes_over_start_at_end": end,
        "peak_event_index": peak_at, "live_at_peak_bytes": sum(by_category.values()),
        "live_at_peak_by_category": by_category, "live_at_peak_top": rows,
    }


@contextlib.contextmanager
def record_allocations(device_index: int = 0, max_entries: int = 500_000) -> Iterator[dict]:
    """Records the allocator's history (Python stacks only: cheap, and C++ symbolisation of a
    long trace takes minutes) for the block; on exit the yielded dict holds ``summary``, the
    `summarize_trace` of the device's trace, and ``reserved_peak_bytes``."""
    import torch

    out: dict = {}
    torch.cuda.synchronize()
    torch.cuda.memory._record_memory_history(enabled="all", context="all", stacks="python", max_entries=max_entries)
    try:
        yield out
        torch.cuda.synchronize()
        snapshot = torch.cuda.memory._snapshot()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    traces = snapshot.get("device_traces") or []
    out["summary"] = summarize_trace(traces[device_index] if device_index < len(traces) else [])
    out["reserved_peak_bytes"] = torch.cuda.max_memory_reserved(device_index)


def diagnostics_dir() -> str:
    """Where GPU diagnostics go: ``$STRONGHOLD_DIAG_DIR`` (scripts/gpu_check.sh sets it to its
    output), else ``$OUT``, else the working directory's ``out/``."""
    path = os.environ.get("STRONGHOLD_DIAG_DIR") or os.environ.get("OUT") or "out"
    os.makedirs(path, exist_ok=True)
    return path


def write_json(name: str, data: dict) -> str:
    path = os.path.join(diagnostics_dir(), name)
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(data, fh, indent=1, default=str)
    return path
