"""Per-period counters of the engine: traffic, waits and CPU optimizer time.

The Trainer logs them every ``logging_steps`` and resets them; the benchmarks read them per
step. They are written from the training thread and from the CPU worker, so every update
goes through one lock (a float ``+=`` from two threads can lose an update). Byte totals
since the engine started live in the memory ledger; these are the resettable view: the traffic
counters (``h2d_bytes``, ``d2h_bytes``) are read from the ledger given as ``traffic``, less
what it held at the last `reset`, so a fetch or a flush books its bytes once, in the ledger.
"""

from __future__ import annotations

import threading

_FIELDS = (
    "h2d_bytes",
    "d2h_bytes",
    "h2d_s",
    "d2h_s",
    "convert_s",  # fetches without a host image: fp32 masters converted to the compute dtype
    "blocked_s",
    "cpu_adam_s",
    "fetches_on_demand",
    "forward_stall_s",
    "update_total_s",
    "first_block_ready_s",
    "speculative_update_s",
    "rollback_s",
    "nvme_wait_s",  # updates waiting for their Adam state to arrive from the NVMe tier
    "speculated_blocks",
    "speculation_hits",
    "speculation_misses",
    "late_gradients",  # parameters whose gradient arrived after their unit left the device
    "image_refreshes",  # compute-dtype images re-derived from the masters at a fetch (training thread)
    "host_blocks",  # waits that blocked the training or autograd thread (not the engine's own threads)
    "steps",
)

#: The engine's own threads (host worker, copy and conversion threads, NVMe I/O): their waits
#: are their work, not the training thread's.
ENGINE_THREAD_PREFIX = "stronghold-"


class EngineStats:
    __slots__ = ("_lock", "_traffic", "_traffic_base", *_FIELDS)

    def __init__(self, traffic) -> None:
        self._lock = threading.Lock()
        self._traffic = traffic  # the engine's MemoryLedger: its h2d_bytes and d2h_bytes
        self.reset()

    def reset(self) -> None:
        with self._lock:
            for name in _FIELDS:
                setattr(self, name, 0.0 if name.endswith("_s") else 0)
            self._traffic_base = (self._traffic.h2d_bytes, self._traffic.d2h_bytes)

    def add(self, name: str, value: float) -> None:
        with self._lock:
            setattr(self, name, getattr(self, name) + value)

    def count_host_block(self) -> None:
        """A wait that blocked its thread; counted when that thread trains (see ``host_blocks``).
        A CPU proxy of the GPU's real-time budget: on the training and autograd threads this
        count per step must not grow with depth."""
        if not threading.current_thread().name.startswith(ENGINE_THREAD_PREFIX):
            self.add("host_blocks", 1)

    def as_dict(self) -> dict[str, float]:
        with self._lock:
            out = {name: getattr(self, name) for name in _FIELDS}
            out["h2d_bytes"] = self._traffic.h2d_bytes - self._traffic_base[0]
            out["d2h_bytes"] = self._traffic.d2h_bytes - self._traffic_base[1]
            return out
