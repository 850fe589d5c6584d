"""What an offloaded run reports through the Trainer's log: its start line and its ``stronghold_*`` keys.

`RunLog` owns every line and key the engine adds to the Trainer's output, so that changing what
a run reports changes this module only:

* one line when the Trainer is built ("STRONGHOLD is on: ..."), through transformers' logger so
  that it shows at the Trainer's verbosity: the window, what is offloaded, the host memory and
  the device/host split;
* the ``stronghold_*`` keys added to each logging step that carries a ``loss``: transfer rates,
  waits and CPU Adam time per step, the memory ledger, speculation and promises. Rates and
  per-step figures cover the period since the previous logging step; the engine's counters are
  reset after each read.

The engine's counters (``stats.py``) and ledger (``memory_stats``) are read, never changed
beyond that reset.
"""

from __future__ import annotations

import logging
import time
from typing import Any

_hf_logger = logging.getLogger("transformers.trainer")


class RunLog:
    """The reports of one engine's run; a period starts when it is built and at each `step_metrics`."""

    def __init__(self, engine: Any):
        self._engine = engine
        self._t0 = time.perf_counter()
        self._steps = 0  # the global step at the start of the period

    def announce(self) -> None:
        """The start line."""
        engine = self._engine
        mem = engine.memory_stats()
        _hf_logger.info(
            f"STRONGHOLD is on: window_size={engine.window_size} of {engine.num_blocks} blocks, "
            f"{mem['offloaded_params'] / 1e6:.1f} M offloaded parameters ({mem['offloaded_trainable_params'] / 1e6:.1f} M "
            f"trainable), host_memory={engine.config.host_memory} ("
            f"{'8-bit' if engine.config.host_memory == 'lean' else 'fp32'} Adam moments), host {(mem['pinned_host_bytes'] + mem['pageable_host_bytes']) / 2**30:.2f} GiB before optimizer "
            f"state ({mem['pinned_host_bytes'] / 2**30:.2f} GiB pinned), CPU Adam threads={engine.worker.num_threads}, "
            f"device {engine.device}; device/host split: {engine.split.reason}"
        )

    def add_to(self, logs: dict[str, float], global_step: int) -> None:
        """Adds the ``stronghold_*`` keys to the Trainer's ``logs`` if they are a training step's
        (they carry a ``loss``; evaluation's do not)."""
        if "loss" in logs:
            logs.update(self.step_metrics(global_step))

    def step_metrics(self, global_step: int) -> dict[str, float]:
        """The ``stronghold_*`` keys for a logging step at ``global_step``; starts the next period."""
        engine = self._engine
        stats = engine.stats
        now = time.perf_counter()
        wall = max(now - self._t0, 1e-9)
        steps = max(1, global_step - self._steps)
        mem = engine.memory_stats()  # the ledger (and, on CUDA, the copy times measured by events)
        counters = stats.as_dict()
        out = {
            "stronghold_window_size": engine.window_size,
            "stronghold_h2d_GBps": round(counters["h2d_bytes"] / wall / 1e9, 3),
            "stronghold_d2h_GBps": round(counters["d2h_bytes"] / wall / 1e9, 3),
            "stronghold_blocked_ms": round(1e3 * counters["blocked_s"] / steps, 3),
            "stronghold_cpu_adam_ms": round(1e3 * counters["cpu_adam_s"] / steps, 3),
            "stronghold_forward_stall_ms": round(1e3 * counters["forward_stall_s"] / steps, 3),
            "stronghold_device_peak_MiB": round(mem["device_peak_bytes"] / 2**20, 3),
            "stronghold_pinned_host_GiB": round(mem["pinned_host_bytes"] / 2**30, 4),
            "stronghold_pageable_host_GiB": round(mem["pageable_host_bytes"] / 2**30, 4),
            "stronghold_host_bytes_per_param": round(mem["host_bytes_per_param"], 3),
            "stronghold_fetches": mem["fetches"],
            # Speculative updates during backward (speculation.py): how many blocks, how often the
            # guess missed since training began, the update time moved into backward and the
            # rollback time paid for misses, per step.
            "stronghold_speculated_blocks": round(counters["speculated_blocks"] / steps, 2),
            "stronghold_speculation_miss_rate": round(engine.coordinator.policy.miss_rate, 3),
            "stronghold_speculative_update_ms": round(1e3 * counters["speculative_update_s"] / steps, 3),
            "stronghold_rollback_ms": round(1e3 * counters["rollback_s"] / steps, 3),
            # Waits that blocked the training or autograd thread, per step (stats.py), and the
            # promises the first step found broken (promises.py; the warning names each).
            "stronghold_host_blocks": round(counters["host_blocks"] / steps, 2),
            "stronghold_promises_broken": mem["promises_broken"],
        }
        stats.reset()
        self._t0, self._steps = now, global_step
        return out
