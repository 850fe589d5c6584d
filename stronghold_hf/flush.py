"""The gradient flush: each unit's lane from the moment its backward takes one to the fold.

The gradient queue (``grads.py``) only keeps lanes; a unit's gradients (``unit_grads.py``) only
know the buffer they are handed. This module is what joins them during backward, for the
schedule (``schedule.py``, ``window_slots.py``), which decides *when*:

* `attach`: a unit starting a backward use gets a lane (or its parked one back);
* `flush`: its lane is sent to the host; on the host worker the queue lands it and the unit's
  gradients `fold` it into the host gradient ([Note: lane lifetime] in grads.py). Under data
  parallelism the lane is reduced across ranks first. The unit's device norm is taken here,
  and the step coordinator (``stepping.py``) is told what it needs for speculation;
* `park`: a unit with another backward use to come keeps its lane on the device instead;
* `flush_late`: gradients that arrived after their unit left the device get one more flush;
* `discard`, `drain`: a backward that raised drops its lanes; the end of a pass waits for every
  fold and gives the lanes' device memory back.

It holds which unit has which lane (``_lanes``) and which lanes are parked (``_parked``); it
calls down only (the units' gradients, the queues, the coordinator, the worker).
"""

from __future__ import annotations

import functools

import torch

from .grads import GradLane, GradientQueue
from .stats import EngineStats
from .stepping import StepCoordinator
from .unit import Residency, Unit
from .workers import HostWorker


class GradientFlush:
    """The lanes of the units in backward, and their way to the host; see the module docstring."""

    def __init__(self, *, grad_queue: GradientQueue, resident_queue: GradientQueue | None,
                 coordinator: StepCoordinator, worker: HostWorker, stats: EngineStats, dp,
                 device: torch.device) -> None:
        self.grad_queue = grad_queue  # the streamed units' K lanes (and one per unit used at several positions)
        self.resident_queue = resident_queue  # one lane per rest unit, for the whole backward
        self.coordinator = coordinator
        self.worker = worker
        self.stats = stats
        self.dp = dp
        self.device = device
        self._lanes: dict[int, GradLane] = {}  # unit index -> its lane while it has one
        # Units evicted between two backward uses with their lane kept on the device (`park`):
        # unit index -> the parameters the lane holds a gradient for.
        self._parked: dict[int, list[int]] = {}

    def _queue(self, u: Unit) -> GradientQueue:
        return self.grad_queue if u.streamed else self.resident_queue  # inlined where it runs per block

    def has_lane(self, u: Unit) -> bool:
        return u.grads.grad_buffer is not None or u.index in self._parked

    # ------------------------------------------------------------------ during a use
    def attach(self, u: Unit) -> None:
        """A backward use of the resident trainable unit ``u`` begins: it gets a lane, or the one
        it parked, which comes back holding the partial sum (what this use, or a gradient that
        arrived while it was parked, produces adds onto it). Nothing if it holds one already."""
        g = u.grads
        if g.grad_buffer is not None:
            return
        assert u.state is Residency.ON_DEVICE, f"{u.fqn}: a lane for a unit in {u.state}"
        lay = u.layout
        if u.index in self._parked:
            lane = self._lanes[u.index]
            g.attach_grad_buffer(lane.device_buffer, lane.views(lay.grad_geometry_key, lay.grad_geometry),
                                 accumulate=True)
            return
        queue = self.grad_queue if u.streamed else self.resident_queue
        lane = queue.acquire(u.index, lay.padded_grad_numel, lay.grad_dtype, lay.grad_geometry_key)
        self._lanes[u.index] = lane
        g.attach_grad_buffer(lane.device_buffer, lane.views(lay.grad_geometry_key, lay.grad_geometry))

    def park(self, u: Unit) -> None:
        """``u`` leaves the device with another backward use to come: its lane stays there,
        holding what this use produced, detached from the freed parameters (see
        `WindowSlots.release` for why)."""
        self._parked[u.index] = sorted(set(self._parked.get(u.index, ())) | set(u.grads.collect_into_buffer()))
        u.grads.detach_grad_buffer()

    # ------------------------------------------------------------------ to the host
    def flush(self, u: Unit) -> None:
        """Sends ``u``'s lane to the host; a fold on the host worker adds (or copies) it into
        the fp32 gradient.

        Under data parallelism the lane is reduced across ranks first, on the device (a
        reduce-scatter with sharded CPU state, so only this rank's shard crosses the link), and
        every trainable parameter counts as touched: another rank may have produced a gradient
        this one did not, and every rank must issue the same collectives ([Note: collective
        order] in distributed.py)."""
        g = u.grads
        lane = self._lanes.pop(u.index)
        touched = self._parked.pop(u.index, [])
        if g.grad_buffer is not None:
            touched = sorted(set(touched) | set(g.collect_into_buffer())) if touched else g.collect_into_buffer()
            g.detach_grad_buffer()
        queue = self.grad_queue if u.streamed else self.resident_queue
        if self.dp is not None:
            touched = [k for k, e in enumerate(u.layout.entries) if e.trainable]
        elif not touched:
            queue.discard(lane)
            return
        coordinator = self.coordinator
        if g.spec is not None:
            # More gradient for a unit already updated speculatively (a late gradient, another
            # micro-batch): undo that update before the fold changes what it read.
            coordinator.undo_speculation(u)
        local = g.local_params(touched) if u.sharded else touched
        valid = g.grad_valid
        any_valid = any(valid)
        accumulate = [valid[k] for k in local] if any_valid else [False] * len(local)
        fresh = g.flushes == 0 and not any_valid
        send = lane.device_buffer
        if self.dp is not None:
            send = self.dp.reduce_gradient_(lane.device_buffer, u.layout.shard_numel)
        # L2 norm (fp32) of a gradient that is the unit's whole gradient for this step (this
        # rank's shard of it), on the device while the buffer is read anyway (global clipping
        # needs it; stepping.py squares them all in one op).
        g.device_norm = torch.linalg.vector_norm(send, dtype=torch.float32) if fresh else None
        partial_norm = coordinator.partial_norm if coordinator.speculating else None
        flush = queue.send(lane, send, norm=g.device_norm if partial_norm is not None else None)
        # The fold reads the pieces as they land; the lane is free after it (grads.py). Urgent:
        # it frees a lane the backward may be waiting for (workers.py, [Note: urgent tasks]).
        task = functools.partial(queue.land, lane, flush, functools.partial(g.fold, local, accumulate), partial_norm)
        lane.ticket = self.worker.submit(("gradient copy of ", u.fqn), task, unit=u.index, urgent=True)
        for k in local:
            valid[k] = True
        g.flushes += 1
        g.flushes_this_pass += 1
        if coordinator.speculating and u.pending_backward == 0 and not g.spec_blocked:
            coordinator.speculate(u)

    def flush_late(self, units: list[Unit]) -> None:
        """At the end of backward: gradients autograd produced after their unit left the device
        (T5's relative bias, whose gradient arrives through every later block), one more flush
        each, which accumulates. Under data parallelism it runs on every rank where any rank
        has one (a flush is a collective)."""
        late = [u for u in units if u.trainable and u.grads.late_gradients()]
        for u in late:
            if u.vocab_pieces is not None:
                # A use of the weight outside the model's forward (a penalty, a head on a base
                # model's output): added into the host gradient whole, with no vocabulary-sized lane.
                self.stats.add("late_gradients", u.vocab_pieces.add_late_grads(u.grads.late_gradients()))
        late = [u for u in late if u.vocab_pieces is None]
        if self.dp is not None:  # which units have late gradients is the ranks' union
            flags = torch.zeros(len(units), dtype=torch.int32, device=self.device)
            for u in late:
                flags[u.index] = 1
            late = [units[i] for i in self.dp.max_(flags).nonzero().flatten().tolist()]
        for u in late:
            g, lay = u.grads, u.layout
            self.stats.add("late_gradients", len(g.late_gradients()))
            lane = self._queue(u).acquire(u.index, lay.padded_grad_numel, lay.grad_dtype, lay.grad_geometry_key)
            self._lanes[u.index] = lane
            # The late gradients are in .grad, wherever autograd made them: the unit need not be
            # resident for its lane to take them in (collect_into_buffer copies across devices).
            g.attach_grad_buffer(lane.device_buffer, lane.views(lay.grad_geometry_key, lay.grad_geometry))
            self.flush(u)

    # ------------------------------------------------------------------ a backward that raised
    def discard(self, u: Unit) -> None:
        """Drops ``u``'s lane and what this pass put in it."""
        lane = self._lanes.pop(u.index)
        self._parked.pop(u.index, None)
        if u.grads.grad_buffer is not None:
            u.grads.drop_lane_gradients()
            u.grads.detach_grad_buffer()
        self._queue(u).discard(lane)

    def drain(self) -> None:
        """Waits for every fold, then gives the lanes' device memory back (end of a pass)."""
        for queue in (self.grad_queue, self.resident_queue):
            if queue is not None:
                queue.drain()
                queue.release_device_buffers()
