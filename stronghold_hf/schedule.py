"""The schedule: the phase policy, what happens to which unit when.

This module owns what the window decides with: the units, the forward *sequence* they are
used in, the phase, the uses open in forward and the backward pass running. It is driven by
hooks (``hooks.py``) and calls down, never up: into the window's slots (``window_slots.py``:
how the window moves to a position, fetching ahead and evicting behind; it holds ``W``), the
gradient flush (``flush.py``: a unit's lane from its backward to the fold), the units
(``unit.py``), and the step coordinator (``stepping.py``) at the start of a backward pass.

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
* **after the backward** (an autograd engine callback, `backward_pass.BackwardPass`): late
  gradients are flushed, every unit is evicted, the folds are awaited, and each trainable
  parameter's ``.grad`` is its host gradient.

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

A backward that raises half-way is noticed at the next call into the engine and rolled back
(`BackwardPass.abort`): its device gradients are dropped, and gradients it already folded are
removed.
"""

from __future__ import annotations

import enum
import logging
import sys

import torch
from torch import nn

from .backward_pass import BackwardPass
from .discovery import UnitPlan
from .flush import GradientFlush
from .frozen import FrozenAtOffload
from .grads import GradientQueue
from .hooks import UnitUse, current_graph_task, in_backward, register_pre_backward, wrap_differentiable
from .memory import DeviceSlotPool
from .stats import EngineStats
from .stepping import StepCoordinator
from .transfer import TransferContext
from .unit import Residency, Unit
from .window_slots import WindowSlots
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


def _note_missing_autocast(u: Unit) -> None:
    """Inside the always-called hook of a block whose forward raised: when the block's device
    copies are in ``param_dtype`` (not the parameters' own dtype), autocast is off and the error
    is about dtypes (the first matmul got fp32 hidden states and bf16 weights), the error gets a
    note that names the setting and the fix. (A pre-check would refuse blocks that cast their
    input themselves, as Mamba's does.)"""
    err = sys.exc_info()[1]
    device_type = u.device.type
    if (not isinstance(err, RuntimeError) or "dtype" not in str(err) or torch.is_autocast_enabled(device_type)
            or getattr(err, "_stronghold_noted", False)):
        return
    err._stronghold_noted = True
    dtype = str(u.cast_dtype).removeprefix("torch.")
    err.add_note(f"stronghold: StrongholdConfig(param_dtype={dtype}) puts the blocks on the device in {dtype}, and "
                 f"{u.fqn} ran outside autocast. Run the forward under torch.autocast({device_type!r}, "
                 f"dtype=torch.{dtype}) (the Trainer does with --bf16/--fp16, accelerate with mixed_precision), or "
                 "leave param_dtype=None to compute in the model's dtype.")


def _raised() -> bool:
    """Inside an ``always_call`` forward hook: whether the forward raised (the hook then runs
    from the module's exception handler, so the exception is the one being handled)."""
    return sys.exc_info()[1] is not None


class WindowSchedule:
    """The phase policy over one model's units; see the module docstring."""

    def __init__(self, model: nn.Module, plan: UnitPlan, units: list[Unit], *, window_size: int,
                 pool: DeviceSlotPool, grad_queue: GradientQueue, resident_queue: GradientQueue | None,
                 coordinator: StepCoordinator, transfer: TransferContext, worker: HostWorker, stats: EngineStats,
                 dp, device: torch.device) -> None:
        self.model = model
        self.plan = plan
        self.units = units
        self.blocks = [u for u in units if u.kind == "block"]
        self.rest_units = [u for u in units if u.kind == "rest"]
        self.sequence = list(plan.sequence)  # unit index at each forward position
        self.positions_of: dict[int, list[int]] = {}
        for pos, u in enumerate(self.sequence):
            self.positions_of.setdefault(u, []).append(pos)
        self.coordinator = coordinator
        self.transfer = transfer
        self.worker = worker
        self.dp = dp
        # What the policy drives: the gradients' way to the host, and the window's slots.
        self.gradients = GradientFlush(grad_queue=grad_queue, resident_queue=resident_queue, coordinator=coordinator,
                                       worker=worker, stats=stats, dp=dp, device=device)
        self.slots = WindowSlots(units, self.sequence, self.positions_of, window_size=window_size, pool=pool,
                                 gradients=self.gradients, coordinator=coordinator, stats=stats)
        # What every unit goes through when a backward pass begins, ends or is rolled back.
        self.backward = BackwardPass(units, gradients=self.gradients, slots=self.slots, coordinator=coordinator,
                                     transfer=transfer)
        self.phase = Phase.IDLE
        self.probe = None  # auto_window.AutoWindowProbe during the first step of window_size="auto"
        self.window_choice = None  # planner.WindowChoice: why W is what it is
        self.activations = None  # activations.ActivationStore when checkpointed inputs are offloaded
        # Checkpointed inputs at the end of the forward that stay on the device for the turn
        # (StrongholdConfig.device_checkpoints; None: the window's W).
        self.checkpoint_tail: int | None = None
        self.checkpoint_watch = None  # checkpointing.CheckpointWatch: the model's checkpoint calls
        self.frozen = FrozenAtOffload(units)  # what was frozen at offload_model stays frozen (frozen.py)
        # Data parallel: called when a backward reaches the model's outputs, it averages the
        # gradients of the parameters left on the device at that backward's end (distributed.py).
        self.average_resident_grads = None
        self._stack: list[_Open] = []
        self._open_regions: set[int] = set()  # head units whose region (discovery.HeadRegion) is open
        self._cursor = -1  # forward position of the last use opened in this pass
        self._block_entries = 0  # block forwards entered (outside backward), for the check below
        self._entries_at_model_start = 0
        self._model_forwards = 0  # model forwards running (nested: a forward that calls the model)
        self._forward_grad = False  # the outermost one began with gradients on
        self._warned_no_block_ran = False

    # ------------------------------------------------------------------ queries
    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def window_size(self) -> int:
        return self.slots.window_size

    def release(self, u: Unit) -> None:
        """Ships ``u``'s gradients and evicts it now (load_state_dict on a rest unit)."""
        self.slots.release(u, backward=self.phase is Phase.BACKWARD)

    # ------------------------------------------------------------------ positions
    def _position(self, u: Unit, candidates: tuple[int, ...] | None) -> int:
        """The forward position of a new use of ``u``: its next position at or after the cursor."""
        if not u.streamed:
            return -1
        positions = candidates or tuple(self.positions_of.get(u.index, ()))
        if not positions:
            return self._cursor
        if len(positions) == 1:
            return positions[0]
        return next((p for p in positions if p >= self._cursor), positions[0])

    @property
    def vocab_pieces(self) -> list:
        """The device sides of the units read in pieces (vocab_pieces.py); the engine sets them."""
        return self.backward.vocab_pieces

    @vocab_pieces.setter
    def vocab_pieces(self, pieces: list) -> None:
        self.backward.vocab_pieces = pieces

    @property
    def resident_unit(self) -> Unit | None:
        """The first rest unit (there is one per dtype of the small parameters' gradients)."""
        return self.rest_units[0] if self.rest_units else None

    # ------------------------------------------------------------------ hooks: forward
    # The module hooks that call these are installed by hooks.install_module_hooks.
    @property
    def in_model_forward(self) -> bool:
        """The model's forward is running (outside backward): the span in which a vocabulary
        unit's other uses get it lent whole (vocab_pieces.py)."""
        return self._model_forwards > 0

    @property
    def forward_records_graph(self) -> bool:
        """The running model forward began with gradients on (a read inside it may still run
        with them off: a saved-tensor hook, a ``no_grad`` block of the model's)."""
        return self._forward_grad

    def on_model_forward_start(self, module, args, kwargs) -> None:
        if in_backward():
            return None
        if not self._model_forwards:
            self._forward_grad = torch.is_grad_enabled()
            if self._forward_grad:
                self.frozen.check()
        self._model_forwards += 1
        self._entries_at_model_start = self._block_entries
        self.settle()
        if not self._stack:
            self._cursor = -1  # a new pass over the sequence
        if self.checkpoint_watch is not None:
            # gradient_checkpointing_enable() may have set new checkpoint functions since the last forward.
            self.checkpoint_watch.install(self)
        changed = None
        for u in self.rest_units:
            self._open(u, None, None)
            wrapped = self._wrap_open_inputs(*(changed or (args, kwargs)))
            changed = wrapped or changed
        return changed

    def on_model_forward_end(self, module, args, kwargs, output):
        if in_backward():
            return None
        self._model_forwards = max(0, self._model_forwards - 1)
        if not self._model_forwards:
            for pieces in self.vocab_pieces:
                pieces.release_after_forward()  # a copy lent whole that no graph holds
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
        for u in reversed(self.rest_units):
            output = self._close(u, output)
        if self.average_resident_grads is not None and torch.is_grad_enabled() and not _raised():
            register_pre_backward(self.average_resident_grads, output)
        if not self._stack:
            # End of a pass over the sequence: only the tail a backward will need stays.
            self.slots.evict_to_turn(backward=self.phase is Phase.BACKWARD)
            if self.activations is not None:
                self.activations.end_forward()
            if self.checkpoint_watch is not None and not _raised() and torch.is_grad_enabled():
                self.checkpoint_watch.check_forward(self.activations)
        return output

    def on_pre_forward(self, u: Unit, positions, args, kwargs):
        if current_graph_task() != -1:  # in backward
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
        tail = self.slots.window_size if self.checkpoint_tail is None else self.checkpoint_tail
        keep = position >= len(self.sequence) - tail  # the tail the turn keeps stays
        record = self.checkpoint_watch.enter(u, position, not keep)
        saving = self.activations.begin_block(position, not keep, self.num_blocks)
        output = None
        try:
            output = checkpoint(record.counted(function), *args, **kwargs)
        finally:
            self.activations.end_block(saving)
            self.checkpoint_watch.leave(record, output)
        return output

    def on_post_forward(self, u: Unit, output):
        if current_graph_task() != -1:  # in backward
            return output
        if output is None and u.cast_dtype is not None and _raised():
            _note_missing_autocast(u)
        return self._close(u, output)

    def on_region_start(self, u: Unit, position: int, output):
        """The module before a head region (discovery.HeadRegion) returned: the head's use begins."""
        if in_backward() or u.index in self._open_regions:
            return None  # one use per model forward (a block applied again opens nothing)
        self._open_regions.add(u.index)
        self._open(u, (position,), None)
        entry = self._stack[-1]
        if entry.use is not None and not entry.nested:
            output, _ = wrap_differentiable(entry.use.post_backward, output)
        return output

    def on_region_end(self, u: Unit, output):
        """The model returned: the head's use ends."""
        if in_backward() or u.index not in self._open_regions:
            return None
        self._open_regions.discard(u.index)
        return self._close(u, output)

    def _wrap_open_inputs(self, args, kwargs):
        entry = self._stack[-1]
        if entry.use is None or entry.nested:
            return None
        (args, kwargs), _ = wrap_differentiable(entry.use.post_backward, (args, kwargs))
        return args, kwargs

    def _open(self, u: Unit, positions, _unused) -> None:
        """A forward use of ``u`` begins: make it resident and hold it (nothing if held already)."""
        if self.phase is Phase.BACKWARD:
            self.settle()
        if u.kind != "block" and u.forward_holds > 0:
            self._stack.append(_Open(u, None, -1, nested=True))
            return
        if self.phase is Phase.IDLE:
            self.phase = Phase.FORWARD
        pos = self._position(u, positions)
        if pos >= 0:
            self._cursor = pos
        self.slots.make_resident(u, +1, pos)
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
            self.slots.release(u, backward=self.phase is Phase.BACKWARD)  # no backward will need it: off the device now
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
        slots = self.slots
        if u.streamed:
            # Units later in the sequence whose post-backward never ran (their inputs needed no
            # gradient) are done by now: everything downstream of u's outputs has run.
            for j in sorted(slots.pool.in_use):
                later = self.units[j]
                if (j != u.index and later.backward_holds > 0 and later.forward_holds == 0
                        and later.backward_position > use.position):
                    later.backward_holds = 0
                    if later.pending_backward == 0:
                        slots.release(later, backward=True)
        slots.make_resident(u, -1, use.position)
        u.wait_resident()
        if u.trainable:
            self.gradients.attach(u)  # a lane (its parked one back, if any), unless it holds one
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
        if u.forward_holds + u.backward_holds == 0 and u.pending_backward == 0:  # (u.holds, inlined)
            self.slots.release(u, backward=self.phase is Phase.BACKWARD)

    def on_use_dropped(self, use: UnitUse) -> None:
        """A graph was freed before its backward ran: that use will never need the unit."""
        use.done = True
        u = self.units[use.unit_index]
        u.pending_backward = max(0, u.pending_backward - 1)

    def enter_backward(self) -> None:
        """A backward pass is running: the schedule's backward phase begins (once per pass)."""
        self._enter_backward()

    def _enter_backward(self) -> None:
        task = current_graph_task()
        if self.backward.task == task:
            return
        if self.phase is Phase.BACKWARD and self.backward.task is not None:
            self._abort_backward()  # an earlier backward raised and never finished
        self.phase = Phase.BACKWARD
        self.backward.begin(task, self._finish_backward)

    def _finish_backward(self) -> None:
        """Autograd's end-of-backward callback: every gradient reaches the host, every unit leaves."""
        self.backward.finish()
        if self.activations is not None:
            self.activations.end_backward()
        self.phase = Phase.IDLE if not self._stack else Phase.FORWARD
        if self.checkpoint_watch is not None:
            self.checkpoint_watch.check_backward()
            self.checkpoint_watch.begin_pass()  # what the next forwards checkpoint, up to the next backward
            self.activations.begin_pass()
        if self.probe is not None and self.probe.complete():
            self.apply_window_choice()

    def _abort_backward(self) -> None:
        """A backward raised half-way: drop its gradients, keep what earlier backwards left."""
        self.backward.abort(forwards_open=bool(self._stack))
        if self.activations is not None:
            self.activations.end_backward()
        self.phase = Phase.IDLE
        logger.warning("stronghold: a backward pass raised before it finished; its gradients were discarded.")

    def settle(self) -> None:
        """Called at every entry from outside backward: finishes a backward that raised."""
        if self.phase is Phase.BACKWARD and not in_backward():
            self._abort_backward()

    def evict_all(self) -> None:
        """Returns every idle unit to the host (before saving, between phases), a vocabulary
        unit lent whole included (the optimizer step calls this: the copy would go stale)."""
        self.settle()
        self.backward.reclaim_lent()
        backward = self.phase is Phase.BACKWARD
        for u in self.units:
            if u.state is not Residency.ON_HOST and u.holds == 0:
                self.slots.release(u, backward=backward)

    def reset_holds(self) -> None:
        """Forgets every hold and open use (engine.close)."""
        for u in self.units:
            u.forward_holds = u.backward_holds = 0
        self._stack.clear()
        self._open_regions.clear()
        self._model_forwards = 0

    # ------------------------------------------------------------------ the window size
    def apply_window_choice(self) -> None:
        """After the probed first step of ``window_size="auto"``: resize the window."""
        probe, self.probe = self.probe, None
        choice = probe.finish()
        self.window_choice = choice
        window_size = max(1, min(choice.window_size, len(self.sequence)))
        if self.dp is not None:  # every rank runs the same schedule: the smallest choice wins
            window_size = self.dp.min_int(window_size)
        self.slots.resize(window_size)
        (logger.info if choice.hidden else logger.warning)("stronghold: %s", choice.reason)
        return choice
