"""What an offloaded run reports through the Trainer's log: one start line, a few keys per
logging step, one end-of-run summary.

`RunLog` owns every line and key the engine adds to the Trainer's output, so that changing what
a run reports changes this module only. Read as a newcomer would (README command (a), HF's own
``run_clm.py`` under the launcher):

* one line when the Trainer is built ("STRONGHOLD is on: ..."), through transformers' logger so
  that it shows at the Trainer's verbosity: the model's blocks and the window, where the state
  lives (the device named, host GiB and bytes per parameter), the device/host split;
* the ``stronghold_*`` keys of each logging step that carries a ``loss``: by default four (the
  window, the engine's device peak, host bytes per offloaded parameter, waits per step),
  every counter with ``StrongholdConfig(log_metrics="all")``; rates and per-step figures cover
  the period since the previous logging step, and the engine's counters are reset after each
  read;
* one summary when training ends: device peak, host (the engine's state and the process's peak
  RSS), bytes per parameter, fetches per step, speculation.

Sizes are binary throughout (GiB, GiB/s), as ``engine.memory_stats()`` and the estimator print
them. The engine's counters (``stats.py``) and ledger (``memory_stats``) are read, never
changed beyond that reset.
"""

from __future__ import annotations

import logging
import resource
import sys
import time
from typing import Any

_hf_logger = logging.getLogger("transformers.trainer")
GiB = 2**30


def _device_name(engine: Any) -> str:
    device = engine.device
    if device.type == "cpu":
        return "cpu (no GPU: the 'device' is host memory)"
    import torch

    return f"{device} ({torch.cuda.get_device_name(device)})"


def _gib(nbytes: float) -> str:
    """``nbytes`` in GiB, two decimals, or two significant digits below 0.1 GiB (a tiny model's
    device peak reads 0.0039 GiB, not 0.00)."""
    value = nbytes / GiB
    return f"{value:.2f} GiB" if value >= 0.1 or value == 0 else f"{value:.2g} GiB"


def _allocator_peak(mem: dict[str, float]) -> str:
    peak = mem["device_allocator_peak_bytes"]
    return f", allocator peak {_gib(peak)} with activations" if peak else ""


_MOMENTS = {"exact": "fp32 Adam moments", "lean": "8-bit Adam moments"}


def _host_bytes(mem: dict) -> int:
    return mem["pinned_host_bytes"] + mem["pageable_host_bytes"]


class RunLog:
    """The reports of one engine's run; a period starts when it is built and at each `step_metrics`."""

    def __init__(self, engine: Any):
        self._engine = engine
        self._t0 = time.perf_counter()
        self._steps = 0  # the global step at the start of the period
        self._fetches = 0  # cumulative fetches at the start of the run
        self._speculated = {"hits": 0, "misses": 0}

    def announce(self) -> None:
        """The start line."""
        engine = self._engine
        mem = engine.memory_stats()
        self._fetches = mem["fetches"]
        _hf_logger.info(
            f"STRONGHOLD is on: {engine.num_blocks} blocks, window of {engine.window_size}, on "
            f"{_device_name(engine)}; {mem['offloaded_params'] / 1e6:.1f} M parameters offloaded "
            f"({mem['offloaded_trainable_params'] / 1e6:.1f} M trainable), {_gib(_host_bytes(mem))} of host "
            f"memory before the optimizer's state ({mem['host_bytes_per_param']:.1f} B per parameter; "
            f"host_memory={engine.config.host_memory} ({_MOMENTS[engine.config.host_memory]})); {engine.split.reason}"
            + "".join(f"; {u.fqn} in {len(u.vocab_pieces.bounds)} pieces of {u.vocab_pieces.rows_per_piece} rows"
                      for u in engine.units if u.vocab_pieces is not None)
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
        self._speculated["hits"] += counters["speculation_hits"]
        self._speculated["misses"] += counters["speculation_misses"]
        out = {
            "stronghold_window_size": engine.window_size,
            "stronghold_device_peak_GiB": round(mem["device_total_peak_bytes"] / GiB, 4),
            "stronghold_host_bytes_per_param": round(mem["host_bytes_per_param"], 2),
            # Waits that blocked the training or autograd thread, per step: 0 when the host keeps pace.
            "stronghold_waits_ms": round(1e3 * counters["blocked_s"] / steps, 3),
        }
        if engine.config.log_metrics == "all":
            out.update({
                "stronghold_h2d_GiBps": round(counters["h2d_bytes"] / wall / GiB, 3),
                "stronghold_d2h_GiBps": round(counters["d2h_bytes"] / wall / GiB, 3),
                "stronghold_cpu_adam_ms": round(1e3 * counters["cpu_adam_s"] / steps, 3),
                "stronghold_forward_stall_ms": round(1e3 * counters["forward_stall_s"] / steps, 3),
                "stronghold_pinned_host_GiB": round(mem["pinned_host_bytes"] / GiB, 4),
                "stronghold_pageable_host_GiB": round(mem["pageable_host_bytes"] / GiB, 4),
                "stronghold_fetches": mem["fetches"],
                # Speculative updates during backward (speculation.py): how many blocks, how often
                # the guess missed since training began, the update time moved into backward and
                # the rollback time paid for misses, per step.
                "stronghold_speculated_blocks": round(counters["speculated_blocks"] / steps, 2),
                "stronghold_speculation_miss_rate": round(engine.coordinator.policy.miss_rate, 3),
                "stronghold_speculative_update_ms": round(1e3 * counters["speculative_update_s"] / steps, 3),
                "stronghold_rollback_ms": round(1e3 * counters["rollback_s"] / steps, 3),
                # Waits per step by count (stats.py), and the promises the first step found broken
                # (promises.py; the warning names each).
                "stronghold_host_blocks": round(counters["host_blocks"] / steps, 2),
                "stronghold_promises_broken": mem["promises_broken"],
            })
        stats.reset()
        self._t0, self._steps = now, global_step
        return out

    def summary(self, global_step: int) -> str:
        """The end-of-run line: the device peak, the host, bytes per parameter, fetches, speculation."""
        engine = self._engine
        mem = engine.memory_stats()
        counters = engine.stats.as_dict()
        hits = self._speculated["hits"] + counters["speculation_hits"]
        misses = self._speculated["misses"] + counters["speculation_misses"]
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)
        steps = max(1, global_step)
        return (
            f"STRONGHOLD done after {global_step} steps: device peak {_gib(mem['device_total_peak_bytes'])} on "
            f"{_device_name(engine)} (what the engine holds there: window, lanes, rest and resident units, "
            f"their state){_allocator_peak(mem)}; host "
            f"{_gib(_host_bytes(mem))} of engine state, {mem['host_bytes_per_param']:.1f} B per offloaded "
            f"parameter (docs/user_guide.md, 'Where the bytes go'), process peak RSS {_gib(rss)}; "
            f"{(mem['fetches'] - self._fetches) / steps:.1f} fetches per step; speculation: {hits} steps hit, "
            f"{misses} missed"
        )

    def finish(self, global_step: int) -> None:
        _hf_logger.info(self.summary(global_step))
