"""The schedule: which unit is fetched, held, flushed and evicted, and when.

This module owns what the window decides with: the units, the forward *sequence* they are
used in, the window size ``W``, the phase, and the bounded pools (device slots, gradient
lanes). It is driven by hooks (``hooks.py``) and calls down, never up: into the units
(``unit.py``, their buffers and state machines), the gradient queue (``grads.py``), and the
step coordinator (``stepping.py``) for the CPU updates a fetch must wait for.

The sequence (``discovery.plan_units``) is the order in which a forward uses the *streamed*
units: the blocks, and the large parameter groups outside them (an embedding before the
blocks, an LM head after; a tied embedding appears at both ends, T5's shared embedding also
between the stacks). The window slides over positions of that sequence:

* **forward** use at position ``p``: the unit's CPU update (if any) must be done; make it
  resident, prefetch the units at ``p+1..p+W``; units passed are evicted when a slot is
  needed. The units of the last ``W`` positions stay resident at the end of a differentiable
  pass: backward needs them first, so nothing moves at the turn.
* **backward** of a use at ``p`` (pre-backward node on its outputs): make the unit resident,
  give its trainable parameters a gradient lane, prefetch ``p-1..p-W``. When the unit's last
  pending use is done (post-backward node on its inputs), its lane is flushed to the host and
  the unit is evicted: gradients drain during backward.
* **after the backward** (an autograd engine callback): late gradients are flushed, every unit
  is evicted, the folds are awaited, and each trainable parameter's ``.grad`` is its host
  gradient.

The *resident* unit (norms, position embeddings, heads too small to stream) is outside the
window: the model's forward makes it resident, it stays until the end of that forward's
backward, and its gradient goes through a lane of its own.

Where a use begins and ends: a block's is its module's forward. A streamed unit's is the
forward of a module that registers it; for an LM head it begins when the model's backbone
returns and ends when the model returns (`discovery.HeadRegion`), so code that reads
``lm_head.weight`` directly (Liger, TRL's fused head) finds it resident. A module that uses a
unit already held by an enclosing use opens nothing.

Residency is counted per use (``hooks.UnitUse``): a unit may run several times in one step
(two forwards, ALBERT's shared group, a tied embedding), or be recomputed by gradient
checkpointing inside backward. At most ``W + 1`` streamed units hold device storage (the
`DeviceSlotPool` enforces it) and at most ``K`` lanes exist, so device memory does not grow
with depth; `memory_stats()` shows it on CPU as well as on CUDA.

A backward that raises half-way is noticed at the next call into the engine and rolled back:
its device gradients are dropped, and gradients it already folded are removed.
"""

from __future__ import annotations

import enum
import logging
import sys
from typing import Any

import torch
from torch import nn

from .discovery import UnitPlan
from .grads import GradLane, GradientQueue
from .hooks import UnitUse, current_graph_task, in_backward, register_pre_backward, wrap_differentiable
from .memory import DeviceSlotPool
from .stats import EngineStats
from .stepping import StepCoordinator
from .transfer import TransferContext
from .unit import Residency, Unit
from .workers import HostWorker

logger = logging.getLogger("stronghold_hf")


class Phase(enum.Enum):
    IDLE = "idle"
    FORWARD = "forward"
    BACKWARD = "backward"


class _Open:
    """One entry of the forward stack: a use opened by a hook and not closed yet."""

    __slots__ = ("unit", "use", "position", "nested")

    def __init__(self, unit: Unit | None, use: UnitUse | None, position: int, nested: bool) -> None:
        self.unit = unit
        self.use = use
        self.position = position
        self.nested = nested  # the unit was held already: this call opened nothing


def _raised() -> bool:
    """Inside an ``always_call`` forward hook: whether the forward raised (the hook then runs
    from the module's exception handler, so the exception is the one being handled)."""
    return sys.exc_info()[1] is not None


class WindowSchedule:
    """The window over one model's units; see the module docstring."""

    def __init__(self, model: nn.Module, plan: UnitPlan, units: list[Unit], *, window_size: int,
                 pool: DeviceSlotPool, grad_queue: GradientQueue, resident_queue: GradientQueue | None,
                 coordinator: StepCoordinator, transfer: TransferContext, worker: HostWorker, stats: EngineStats,
                 dp, device: torch.device) -> None:
        self.model = model
        self.plan = plan
        self.units = units
        self.blocks = [u for u in units if u.kind == "block"]
        self.resident_units = [u for u in units if u.kind == "resident"]
        self.sequence = list(plan.sequence)  # unit index at each forward position
        self.positions_of: dict[int, list[int]] = {}
        for pos, u in enumerate(self.sequence):
            self.positions_of.setdefault(u, []).append(pos)
        self.window_size = window_size
        self.pool = pool
        self.grad_queue = grad_queue
        self.resident_queue = resident_queue
        self.coordinator = coordinator
        self.transfer = transfer
        self.worker = worker
        self.stats = stats
        self.dp = dp
        self.device = device
        self.phase = Phase.IDLE
        self.probe = None  # auto_window.AutoWindowProbe during the first step of window_size="auto"
        self.window_choice = None  # planner.WindowChoice: why W is what it is
        self.activations = None  # activations.ActivationStore when checkpointed inputs are offloaded
        self.checkpoint_watch = None  # checkpointing.CheckpointWatch: the model's checkpoint calls
        # Data parallel: called when a backward reaches the model's outputs, it averages the
        # gradients of the parameters left on the device at that backward's end (distributed.py).
        self.average_resident_grads = None
        self._lanes: dict[int, GradLane] = {}  # unit index -> its lane while it has one
        # Units evicted between two backward uses with their lane kept on the device (see
        # `release`): unit index -> the parameters the lane holds a gradient for.
        self._parked: dict[int, list[int]] = {}
        self._backward_task: int | None = None  # graph task whose end-of-backward callback is queued
        self._stack: list[_Open] = []
        self._open_regions: set[int] = set()  # head units whose region (discovery.HeadRegion) is open
        self._cursor = -1  # forward position of the last use opened in this pass
        self._prefetched: set[int] = set()  # fetched ahead of need (a fetch at need counts as on demand)
        self._ahead_cache: dict[tuple[int, int, int], tuple[int, ...]] = {}
        self._block_entries = 0  # block forwards entered (outside backward), for the check below
        self._entries_at_model_start = 0
        self._warned_no_block_ran = False
        self.gathering = False  # inside full_state_dict(): every rank is gathering

    # ------------------------------------------------------------------ queries
    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @staticmethod
    def streamed(u: Unit) -> bool:
        return u.streamed

    def _unit_at(self, pos: int) -> Unit:
        return self.units[self.sequence[pos]]

    def lane_of(self, u: Unit) -> GradLane | None:
        return self._lanes.get(u.index)

    # ------------------------------------------------------------------ residency
    def _fetch(self, u: Unit) -> None:
        self.coordinator.wait_update(u, forward=self.phase is not Phase.BACKWARD)  # it writes what the fetch reads
        u.begin_fetch()

    def release(self, u: Unit) -> None:
        """Ships a unit's gradients (if it has a lane) and evicts it.

        A unit with another use still to come in this backward (a tied embedding, whose head
        use is done long before its input use; ALBERT's shared layer) keeps its lane instead:
        the lane is *parked* on the device and the next use accumulates into it, so the
        gradient crosses once, whole, with its norm taken on the device. Flushed after each use,
        a tied GPT-2 embedding crossed twice per step and its norm was taken on the host at clip
        (about 65 ms of a 292 ms step on the H200). Only a unit at several positions of the
        sequence parks: the queue has one lane more for each, so the blocks keep their K (a
        block used again by a second forward flushes as before)."""
        if u.grads.grad_buffer is not None:
            if self.phase is Phase.BACKWARD and u.pending_backward > 0 and len(self.positions_of.get(u.index, ())) > 1:
                self._park(u)
            else:
                self.flush(u)
        if u.state is not Residency.ON_HOST:
            u.evict()

    def _park(self, u: Unit) -> None:
        self._parked[u.index] = sorted(set(self._parked.get(u.index, ())) | set(u.grads.collect_into_buffer()))
        u.grads.detach_grad_buffer()

    def _unpark(self, u: Unit, lane: GradLane) -> None:
        """The next use of a parked unit: its lane comes back holding the partial sum; what this
        use (or a gradient that arrived while it was parked) produces adds onto it."""
        self._attach_lane(u, lane, accumulate=True)

    def _attach_lane(self, u: Unit, lane: GradLane, *, accumulate: bool = False) -> None:
        assert u.state is Residency.ON_DEVICE, f"{u.fqn}: a lane for a unit in {u.state}"
        u.grads.attach_grad_buffer(lane.device_buffer, lane.views(u.layout.grad_geometry_key, u.layout.grad_geometry),
                                   accumulate=accumulate)

    def _has_lane(self, u: Unit) -> bool:
        return u.grads.grad_buffer is not None or u.index in self._parked

    def _evict_idle(self, keep) -> None:
        """Releases every unit in the pool that is neither in ``keep`` nor held, in index order."""
        for idx in self.pool.sorted_in_use():
            u = self.units[idx]
            if idx not in keep and u.holds == 0:
                self.release(u)  # a lane goes with it: a collective, at the same point on every rank

    def _turn_kept(self, pos: int) -> set[int]:
        """Units of the tail this differentiable pass already ran: backward needs them first."""
        n = len(self.sequence)
        return {self.sequence[j] for j in range(max(0, n - self.window_size), min(pos, n))
                if self.units[self.sequence[j]].pending_backward > 0}

    def _ahead(self, pos: int, direction: int) -> list[int]:
        """The units to prefetch from ``pos`` in ``direction``: the next ``W`` positions' units,
        once each, not ``pos``'s own. Fixed for a window size, so worked out once per position."""
        key = (pos, direction, self.window_size)
        ahead = self._ahead_cache.get(key)
        if ahead is None:
            ahead = self._ahead_cache[key] = tuple(self._work_out_ahead(pos, direction))
        return ahead

    def _work_out_ahead(self, pos: int, direction: int) -> list[int]:
        n, w = len(self.sequence), self.window_size
        span = range(pos + 1, min(n, pos + w + 1)) if direction > 0 else range(pos - 1, max(-1, pos - w - 1), -1)
        out: list[int] = []
        for j in span:
            u = self.sequence[j]
            if u != self.sequence[pos] and u not in out:
                out.append(u)
        return out

    def _make_resident(self, u: Unit, direction: int, pos: int) -> None:
        """Slides the window to position ``pos`` (unit ``u``): evicts what is not wanted,
        fetches ``u``, prefetches ahead. The resident unit only needs fetching."""
        if not u.streamed:
            if u.state is Residency.ON_HOST:
                self._fetch(u)
            return
        ahead = self._ahead(pos, direction)
        keep = {u.index, *ahead}
        if direction > 0 and pos > len(self.sequence) - self.window_size:
            keep |= self._turn_kept(pos)
        self._evict_idle(keep)  # held units stay whatever keep says
        if u.state is Residency.ON_HOST:
            if self.pool.full:  # everything left is held or wanted: free the farthest wanted one
                self._make_room(u, pos)
            if u.index not in self._prefetched:
                self.stats.add("fetches_on_demand", 1)
            self._fetch(u)
        self._prefetched.discard(u.index)
        for j in ahead:
            if self.pool.full:
                break
            nu = self.units[j]
            if nu.state is Residency.ON_HOST and not self.coordinator.update_pending(nu):
                self._fetch(nu)
                self._prefetched.add(j)

    def _distance(self, j: int, pos: int) -> int:
        return min((abs(p - pos) for p in self.positions_of.get(j, ())), default=len(self.sequence))

    def _make_room(self, u: Unit, pos: int) -> None:
        # Only units without a gradient lane, prefetches first: whether the pool is full depends
        # on how far this rank prefetched, and under data parallelism flushing a lane is a
        # collective, and a gathered unit evicted on one rank only would be gathered again by
        # that rank alone. Without prefetches in the pool, the residents are the same everywhere.
        idle = [j for j in self.pool.in_use if self.units[j].holds == 0 and self.units[j].grad_buffer is None]
        fetching = [j for j in idle if self.units[j].state is Residency.FETCHING]
        candidates = fetching or idle
        if not candidates:
            raise RuntimeError(
                f"stronghold: no device slot for {u.fqn}: all {self.pool.capacity} slots are held by units "
                f"{sorted(self.pool.in_use)} whose forward or backward is still running. Raise window_size."
            )
        self.release(self.units[max(candidates, key=lambda j: self._distance(j, pos))])

    def _position(self, u: Unit, candidates: tuple[int, ...] | None) -> int:
        """The forward position of a new use of ``u``: its next position at or after the cursor."""
        if not u.streamed:
            return -1
        positions = candidates or tuple(self.positions_of.get(u.index, ()))
        if not positions:
            return self._cursor
        return next((p for p in positions if p >= self._cursor), positions[0])

    # ------------------------------------------------------------------ hooks: installation
    def install(self) -> list[Any]:
        """Registers every hook the schedule is driven by; returns their handles."""
        handles = []
        model = self.model
        handles.append(model.register_forward_pre_hook(self._on_model_forward_start, with_kwargs=True))
        handles.append(model.register_forward_hook(self._on_model_forward_end, with_kwargs=True, always_call=True))
        entry = self.plan.entry_positions
        for u in self.units:
            if u.kind == "block":
                m = u.module
                pos = entry.get(id(m))
                handles.append(m.register_forward_pre_hook(self._make_pre_forward(u, pos), with_kwargs=True))
                handles.append(m.register_forward_hook(self._make_post_forward(u), with_kwargs=True, always_call=True))
            else:
                for m, _ in u.owners:
                    if m is model:
                        continue  # the model's own forward already holds the resident unit
                    pos = entry.get(id(m))
                    handles.append(m.register_forward_pre_hook(self._make_pre_forward(u, pos), with_kwargs=True))
                    handles.append(m.register_forward_hook(self._make_post_forward(u), with_kwargs=True,
                                                           always_call=True))
        for region in self.plan.head_regions:
            u = self.units[region.unit]
            handles.append(region.start.register_forward_hook(self._make_region_start(u, region.position)))
            # Before the model's own end hook (which closes the resident unit, opened earlier).
            handles.append(region.model.register_forward_hook(self._make_region_end(u), prepend=True,
                                                              always_call=True))
        return handles

    def _make_pre_forward(self, u: Unit, positions):
        def hook(module, args, kwargs):
            return self._pre_forward(u, positions, args, kwargs)

        return hook

    def _make_post_forward(self, u: Unit):
        def hook(module, args, kwargs, output):
            return self._post_forward(u, output)

        return hook

    def _make_region_start(self, u: Unit, position: int):
        def hook(module, args, output):
            if in_backward() or u.index in self._open_regions:
                return None  # one use per model forward (a block applied again opens nothing)
            self._open_regions.add(u.index)
            self._open(u, (position,), None)
            entry = self._stack[-1]
            if entry.use is not None and not entry.nested:
                output, _ = wrap_differentiable(entry.use.post_backward, output)
            return output

        return hook

    def _make_region_end(self, u: Unit):
        def hook(module, args, output):
            if in_backward() or u.index not in self._open_regions:
                return None
            self._open_regions.discard(u.index)
            return self._close(u, output)

        return hook

    # ------------------------------------------------------------------ hooks: forward
    @property
    def resident_unit(self) -> Unit | None:
        """The first resident unit (there is one per dtype of the small parameters' gradients)."""
        return self.resident_units[0] if self.resident_units else None

    def _on_model_forward_start(self, module, args, kwargs) -> None:
        if in_backward():
            return None
        self._entries_at_model_start = self._block_entries
        self.settle()
        if not self._stack:
            self._cursor = -1  # a new pass over the sequence
        if self.checkpoint_watch is not None:
            # gradient_checkpointing_enable() may have set new checkpoint functions since the last forward.
            self.checkpoint_watch.install(self)
        changed = None
        for u in self.resident_units:
            self._open(u, None, None)
            wrapped = self._wrap_open_inputs(*(changed or (args, kwargs)))
            changed = wrapped or changed
        return changed

    def _on_model_forward_end(self, module, args, kwargs, output):
        if in_backward():
            return None
        # A training forward that entered no block used the block weights some other way (a
        # container's contents called directly, `block.forward(...)` bypassing hooks): nothing
        # was streamed, and on a GPU those weights are host memory. Said once, plainly.
        if (not _raised() and self._block_entries == self._entries_at_model_start and torch.is_grad_enabled()
                and module.training and not self._warned_no_block_ran and self.blocks):
            self._warned_no_block_ran = True
            logger.warning(
                "stronghold: a training forward of %s ran none of its %d offloaded blocks (%s ... %s) through their "
                "forward, so their weights were not streamed (on a GPU they are host memory). If the model calls "
                "its layers some other way, pass StrongholdConfig(block_classes=[...]) naming the layer class the "
                "forward calls.", type(module).__name__, self.num_blocks, self.blocks[0].fqn, self.blocks[-1].fqn)
        for u in reversed(self.resident_units):
            output = self._close(u, output)
        if self.average_resident_grads is not None and torch.is_grad_enabled() and not _raised():
            register_pre_backward(self.average_resident_grads, output)
        if not self._stack:
            # End of a pass over the sequence: only the tail a backward will need stays.
            self._evict_idle(self._turn_kept(len(self.sequence)))
            if self.activations is not None:
                self.activations.end_forward()
            if self.checkpoint_watch is not None and not _raised() and torch.is_grad_enabled():
                self.checkpoint_watch.check_forward(self.activations)
        return output

    def _pre_forward(self, u: Unit, positions, args, kwargs):
        if in_backward():
            return self._pre_forward_in_backward(u, args, kwargs)
        if u.kind == "block":
            self._block_entries += 1
            if self.checkpoint_watch is not None:
                self.checkpoint_watch.install(self, [u.module])
                self.checkpoint_watch.block_forward(u, u.module)
        self._open(u, positions, None)
        return self._wrap_open_inputs(args, kwargs)

    def run_checkpointed(self, u: Unit, checkpoint, function, args, kwargs):
        """A block's checkpoint call (``checkpointing.CheckpointCall``), entered outside the
        checkpoint: what it saves for backward (the block's inputs) goes through the
        activation store, and its function counts its runs, so the recompute is seen."""
        top = self._stack[-1] if self._stack else None
        if top is not None and top.unit is u and not top.nested:
            position = top.position  # the block's hooks run outside the checkpoint: its use is open
        else:
            position = self._position(u, self.plan.entry_positions.get(id(u.module)))
        keep = position >= len(self.sequence) - self.window_size  # the tail the turn keeps stays
        record = self.checkpoint_watch.enter(u, position, not keep)
        saving = self.activations.begin_block(position, not keep, self.num_blocks)
        output = None
        try:
            output = checkpoint(record.counted(function), *args, **kwargs)
        finally:
            self.activations.end_block(saving)
            self.checkpoint_watch.leave(record, output)
        return output

    def _post_forward(self, u: Unit, output):
        if in_backward():
            return output
        return self._close(u, output)

    def _wrap_open_inputs(self, args, kwargs):
        entry = self._stack[-1]
        if entry.use is None or entry.nested:
            return None
        (args, kwargs), _ = wrap_differentiable(entry.use.post_backward, (args, kwargs))
        return args, kwargs

    def _open(self, u: Unit, positions, _unused) -> None:
        """A forward use of ``u`` begins: make it resident and hold it (nothing if held already)."""
        self.settle()
        if u.kind != "block" and u.forward_holds > 0:
            self._stack.append(_Open(u, None, -1, nested=True))
            return
        if self.phase is Phase.IDLE:
            self.phase = Phase.FORWARD
        pos = self._position(u, positions)
        if pos >= 0:
            self._cursor = pos
        self._make_resident(u, direction=+1, pos=pos)
        u.forward_holds += 1
        u.wait_resident()
        if self.probe is not None and u.kind == "block":
            self.probe.pre_forward(u.index)
        use = UnitUse(self, u.index, pos) if torch.is_grad_enabled() else None
        self._stack.append(_Open(u, use, pos, nested=False))

    def _close(self, u: Unit, output):
        """The forward use opened last for ``u`` ends: release its hold; route the outputs through
        the use's pre-backward node (a pending backward) when they need gradients."""
        entry = None
        while self._stack:
            top = self._stack.pop()
            if top.unit is u:
                entry = top
                break
            self._drop_entry(top)  # a use whose closing hook never ran (an exception in between)
        if entry is None or entry.nested:
            return output
        u.forward_holds = max(0, u.forward_holds - 1)
        if self.probe is not None and u.kind == "block":
            self.probe.post_forward(u.index)
        use = entry.use
        if use is not None:
            if _raised() or output is None:
                use.done = True
            elif register_pre_backward(use.pre_backward, output):
                u.pending_backward += 1
            else:
                use.done = True  # nothing downstream differentiates through this call
        if not u.streamed and u.holds == 0 and u.pending_backward == 0:
            self.release(u)  # no backward will need it (a forward without gradients): off the device now
        return output

    def _drop_entry(self, entry: _Open) -> None:
        if entry.nested or entry.unit is None:
            return
        entry.unit.forward_holds = max(0, entry.unit.forward_holds - 1)
        if entry.use is not None:
            entry.use.done = True

    def _pre_forward_in_backward(self, u: Unit, args, kwargs):
        """A forward inside backward: gradient checkpointing recomputing the unit.

        No forward hold is taken: the unit's backward hold already keeps it resident, and a
        non-reentrant checkpoint may stop the recompute early (an internal exception once the
        last saved tensor is repacked), so the post-hook that would release it may never run."""
        if u.kind == "block" and self.checkpoint_watch is not None:
            self.checkpoint_watch.block_recomputed()
        if u.kind != "block":
            if u.state is not Residency.ON_HOST:
                u.wait_resident()
                return None
            # A module outside the blocks recomputed in backward (a checkpointed wrapper): the
            # unit left the device after its forward; this use starts its backward.
        if u.backward_holds == 0:
            # Reentrant checkpointing: the original forward ran under no_grad, so this
            # recompute starts the unit's backward; its post-backward node goes on the
            # recomputed inputs.
            use = UnitUse(self, u.index, u.backward_position if u.backward_position >= 0 else self._position(u, None))
            use.done = True  # never pending: it is created inside its own backward
            self._begin_backward_use(u, use)
            if torch.is_grad_enabled():
                (args, kwargs), _ = wrap_differentiable(use.post_backward, (args, kwargs))
        else:
            u.wait_resident()
        return args, kwargs

    # ------------------------------------------------------------------ hooks: backward
    def on_pre_backward(self, use: UnitUse) -> None:
        self._begin_backward_use(self.units[use.unit_index], use)

    def _begin_backward_use(self, u: Unit, use: UnitUse) -> None:
        self._enter_backward()
        use.backward_started = True
        u.backward_holds += 1
        u.backward_position = use.position
        if u.streamed:
            # Units later in the sequence whose post-backward never ran (their inputs needed no
            # gradient) are done by now: everything downstream of u's outputs has run.
            for j in sorted(self.pool.in_use):
                later = self.units[j]
                if (j != u.index and later.backward_holds > 0 and later.forward_holds == 0
                        and later.backward_position > use.position):
                    later.backward_holds = 0
                    if later.pending_backward == 0:
                        self.release(later)
        self._make_resident(u, direction=-1, pos=use.position)
        u.wait_resident()
        if u.trainable and u.index in self._parked and u.grads.grad_buffer is None:
            self._unpark(u, self._lanes[u.index])
        elif u.trainable and u.grads.grad_buffer is None:
            queue = self.grad_queue if u.streamed else self.resident_queue
            lane = queue.acquire(u.index, u.layout.padded_grad_numel, u.layout.grad_dtype, u.layout.grad_geometry_key)
            self._lanes[u.index] = lane
            self._attach_lane(u, lane)
        if self.probe is not None and u.kind == "block":
            self.probe.pre_backward(u.index)
        if self.activations is not None and u.kind == "block":
            self.activations.prefetch_before(use.position)

    def on_post_backward(self, use: UnitUse) -> None:
        with self.worker.deferred_wake:  # the fold and a speculative update: one wake-up
            self._post_backward(use)

    def _post_backward(self, use: UnitUse) -> None:
        u = self.units[use.unit_index]
        if self.probe is not None and u.kind == "block":
            self.probe.post_backward(u.index)
        if use.backward_started:
            use.backward_started = False
            u.backward_holds = max(0, u.backward_holds - 1)
        if not use.done:
            use.done = True
            u.pending_backward = max(0, u.pending_backward - 1)
        if u.holds == 0 and u.pending_backward == 0:
            self.release(u)

    def on_use_dropped(self, use: UnitUse) -> None:
        """A graph was freed before its backward ran: that use will never need the unit."""
        use.done = True
        u = self.units[use.unit_index]
        u.pending_backward = max(0, u.pending_backward - 1)

    def _enter_backward(self) -> None:
        task = current_graph_task()
        if self._backward_task == task:
            return
        if self.phase is Phase.BACKWARD and self._backward_task is not None:
            self._abort_backward()  # an earlier backward raised and never finished
        self.phase = Phase.BACKWARD
        self._backward_task = task
        torch.autograd.Variable._execution_engine.queue_callback(self._finish_backward)
        for u in self.units:
            if u.trainable:
                u.grads.begin_pass()  # autograd owns .grad from here on
        self.coordinator.begin_backward_pass()

    def flush(self, u: Unit) -> None:
        """Sends ``u``'s lane to the host; a fold on the host worker adds (or copies) it into
        the fp32 gradient.

        Under data parallelism the lane is reduced across ranks first, on the device (a
        reduce-scatter with sharded CPU state, so only this rank's shard crosses the link), and
        every trainable parameter counts as touched: another rank may have produced a gradient
        this one did not, and every rank must issue the same collectives ([Note: collective
        order] in distributed.py)."""
        lane = self._lanes.pop(u.index)
        touched = self._parked.pop(u.index, [])
        if u.grads.grad_buffer is not None:
            touched = sorted(set(touched) | set(u.grads.collect_into_buffer())) if touched else u.grads.collect_into_buffer()
            u.grads.detach_grad_buffer()
        queue = self.grad_queue if u.streamed else self.resident_queue
        if self.dp is not None:
            touched = [k for k, e in enumerate(u.layout.entries) if e.trainable]
        elif not touched:
            queue.discard(lane)
            return
        if u.grads.spec is not None:
            # More gradient for a unit already updated speculatively (a late gradient, another
            # micro-batch): undo that update before the fold changes what it read.
            self.coordinator.undo_speculation(u)
        local = u.grads.local_params(touched) if u.sharded else touched
        any_valid = any(u.grads.grad_valid)
        accumulate = [u.grads.grad_valid[k] for k in local] if any_valid else [False] * len(local)
        fresh = u.grads.flushes == 0 and not any_valid
        send = lane.device_buffer
        if self.dp is not None:
            send = self.dp.reduce_gradient_(lane.device_buffer, u.layout.shard_numel)
        # L2 norm (fp32) of a gradient that is the unit's whole gradient for this step (this
        # rank's shard of it), on the device while the buffer is read anyway (global clipping
        # needs it; stepping.py squares them all in one op).
        u.grads.device_norm = torch.linalg.vector_norm(send, dtype=torch.float32) if fresh else None
        partial_norm = self.coordinator.partial_norm if self.coordinator.speculating else None
        flush = queue.send(lane, send, norm=u.grads.device_norm if partial_norm is not None else None)

        def land_and_fold(u=u, lane=lane, flush=flush, t=local, a=accumulate) -> None:
            try:
                for lo, staged in flush.landed():  # piece by piece as they land; the device buffer is reusable after
                    u.grads.fold(t, a, lo, staged)
                if partial_norm is not None:
                    partial_norm.add(lane.staged_norm() ** 2)
            finally:
                queue.release(lane)

        # Urgent: it frees a lane the backward may be waiting for (workers.py, [Note: urgent tasks]).
        lane.ticket = self.worker.submit(("gradient copy of ", u.fqn), land_and_fold, unit=u.index, urgent=True)
        for k in local:
            u.grads.grad_valid[k] = True
        u.grads.flushes += 1
        u.grads.flushes_this_pass += 1
        if self.coordinator.speculating and u.pending_backward == 0 and not u.grads.spec_blocked:
            self.coordinator.speculate(u)

    def _discard_lane(self, u: Unit) -> None:
        lane = self._lanes.pop(u.index)
        self._parked.pop(u.index, None)
        if u.grads.grad_buffer is not None:
            u.grads.drop_lane_gradients()
            u.grads.detach_grad_buffer()
        (self.grad_queue if u.streamed else self.resident_queue).discard(lane)

    def _flush_late_grads(self, u: Unit) -> None:
        """Gradients autograd produced after ``u`` left the device (T5's relative bias, whose
        gradient arrives through every later block): one more flush that accumulates. Under
        data parallelism it runs on every rank where any rank has one (a flush is a collective)."""
        late = u.grads.late_gradients()
        self.stats.add("late_gradients", len(late))
        queue = self.grad_queue if u.streamed else self.resident_queue
        lane = queue.acquire(u.index, u.layout.padded_grad_numel, u.layout.grad_dtype, u.layout.grad_geometry_key)
        self._lanes[u.index] = lane
        # The late gradients are in .grad, wherever autograd made them: the unit need not be
        # resident for its lane to take them in (collect_into_buffer copies across devices).
        u.grads.attach_grad_buffer(lane.device_buffer, lane.views(u.layout.grad_geometry_key, u.layout.grad_geometry))
        self.flush(u)

    def _finish_backward(self) -> None:
        """Autograd's end-of-backward callback: every gradient reaches the host, every unit leaves."""
        self._backward_task = None
        for u in self.units:
            u.backward_holds = 0
            if self._has_lane(u):
                self.flush(u)
        late = [u for u in self.units if u.trainable and u.grads.late_gradients()]
        if self.dp is not None:  # which units have late gradients is the ranks' union
            flags = torch.zeros(len(self.units), dtype=torch.int32, device=self.device)
            for u in late:
                flags[u.index] = 1
            late = [self.units[i] for i in self.dp.max_(flags).nonzero().flatten().tolist()]
        for u in late:
            self._flush_late_grads(u)
        for u in self.units:
            if u.state is not Residency.ON_HOST and u.holds == 0:
                self.release(u)
        self.drain_gradients()
        self.coordinator.speculating = False
        self.transfer.collect_timings()
        if self.activations is not None:
            self.activations.end_backward()
        for u in self.units:
            if u.trainable:
                u.grads.expose_grads()
        self.phase = Phase.IDLE if not self._stack else Phase.FORWARD
        if self.checkpoint_watch is not None:
            self.checkpoint_watch.check_backward()
            self.checkpoint_watch.begin_pass()  # what the next forwards checkpoint, up to the next backward
            self.activations.begin_pass()
        if self.probe is not None and self.probe.complete():
            self.apply_window_choice()

    def drain_gradients(self) -> None:
        for queue in (self.grad_queue, self.resident_queue):
            if queue is not None:
                queue.drain()
                queue.release_device_buffers()

    def _abort_backward(self) -> None:
        """A backward raised half-way: drop its gradients, keep what earlier backwards left."""
        self._backward_task = None
        for u in self.units:
            u.backward_holds = 0
            if not self._stack:
                u.forward_holds = 0
            if self._has_lane(u):
                self._discard_lane(u)
            u.grads.drop_stray_grads()  # late gradients of the failed pass
        self.drain_gradients()
        self.coordinator.speculating = False
        if self.activations is not None:
            self.activations.end_backward()
        for u in self.units:
            if u.grads.spec is not None:
                self.coordinator.undo_speculation(u)  # the step it guessed will not come
            u.grads.spec_blocked = False
            if u.state is not Residency.ON_HOST and u.holds == 0:
                u.evict()
            if u.trainable:
                u.grads.roll_back_pass()  # what earlier backwards left stays
        for u in self.units:
            if u.trainable:
                u.grads.expose_grads()
        self.phase = Phase.IDLE
        logger.warning("stronghold: a backward pass raised before it finished; its gradients were discarded.")

    def settle(self) -> None:
        """Called at every entry from outside backward: finishes a backward that raised."""
        if self.phase is Phase.BACKWARD and not in_backward():
            self._abort_backward()

    def evict_all(self) -> None:
        """Returns every idle unit to the host (before saving, between phases)."""
        self.settle()
        for u in self.units:
            if u.state is not Residency.ON_HOST and u.holds == 0:
                self.release(u)

    def reset_holds(self) -> None:
        """Forgets every hold and open use (engine.close)."""
        for u in self.units:
            u.forward_holds = u.backward_holds = 0
        self._stack.clear()
        self._open_regions.clear()

    # ------------------------------------------------------------------ the window size
    def apply_window_choice(self) -> None:
        """After the probed first step of ``window_size="auto"``: resize the window."""
        probe, self.probe = self.probe, None
        choice = probe.finish()
        self.window_choice = choice
        self.window_size = max(1, min(choice.window_size, len(self.sequence)))
        if self.dp is not None:  # every rank runs the same schedule: the smallest choice wins
            self.window_size = self.dp.min_int(self.window_size)
        self.pool.resize(self.window_size + 1)
        (logger.info if choice.hidden else logger.warning)("stronghold: %s", choice.reason)
        return choice
