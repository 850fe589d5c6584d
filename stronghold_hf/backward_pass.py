"""A backward pass's boundaries over every unit: where it begins, how it ends, how it is undone.

The schedule (``schedule.py``) decides what happens to one unit at one use; this module owns
what happens to *all* of them at once, when autograd starts a backward pass and when it is
over. `BackwardPass` holds the graph task whose end it waits for, and:

* **begins** a pass once per graph task: autograd owns each trainable parameter's ``.grad``
  from here on (`UnitGrads.begin_pass`), the step coordinator learns that a backward runs, and
  the end is queued as an autograd engine callback;
* **finishes** it in that callback: every lane is flushed, a vocabulary unit lent whole goes
  back to its pieces, late gradients (written outside any unit's backward) are flushed, every
  idle unit leaves the device, the folds are awaited, and each ``.grad`` is its host gradient;
* **rolls it back** when it raised half-way (noticed at the next call into the engine): its
  device gradients are dropped, the gradients it already folded are removed, a speculative
  update that guessed its step is undone, and what earlier backwards left stays.

The phase, the open forward uses and what the activations and checkpoints do at a pass's end
stay the schedule's, which calls these three and owns the order around them.
"""

from __future__ import annotations

import torch

from .flush import GradientFlush
from .stepping import StepCoordinator
from .transfer import TransferContext
from .unit import Residency, Unit
from .window_slots import WindowSlots


class BackwardPass:
    """The boundaries of the backward passes over ``units``; see the module docstring."""

    def __init__(self, units: list[Unit], *, gradients: GradientFlush, slots: WindowSlots,
                 coordinator: StepCoordinator, transfer: TransferContext) -> None:
        self.units = units
        self.gradients = gradients
        self.slots = slots
        self.coordinator = coordinator
        self.transfer = transfer
        self.vocab_pieces: list = []  # the device sides of the units read in pieces (vocab_pieces.py)
        self.task: int | None = None  # the graph task whose end-of-backward callback is queued

    def begin(self, task: int, on_end) -> None:
        """A backward pass of graph task ``task`` starts: ``on_end`` runs when autograd is done."""
        self.task = task
        torch.autograd.Variable._execution_engine.queue_callback(on_end)
        for u in self.units:
            if u.trainable:
                u.grads.begin_pass()  # autograd owns .grad from here on
        self.coordinator.begin_backward_pass()

    def finish(self) -> None:
        """The pass is over: every gradient reaches the host, every idle unit leaves the device."""
        self.task = None
        gradients, slots = self.gradients, self.slots
        for u in self.units:
            u.backward_holds = 0
            if gradients.has_lane(u):
                gradients.flush(u)
        self.reclaim_lent()  # before late gradients are looked for: a lent copy's .grad is folded
        gradients.flush_late(self.units)
        for u in self.units:
            if u.state is not Residency.ON_HOST and u.holds == 0:
                slots.release(u, backward=True)
        gradients.drain()
        self._drain_pieces()
        self.coordinator.speculating = False
        self.transfer.collect_timings()
        for u in self.units:
            if u.trainable:
                u.grads.expose_grads()

    def abort(self, *, forwards_open: bool) -> None:
        """The pass raised half-way: drop its gradients, keep what earlier backwards left.
        ``forwards_open``: a forward use is still open (its holds stay)."""
        self.task = None
        gradients = self.gradients
        for u in self.units:
            u.backward_holds = 0
            if not forwards_open:
                u.forward_holds = 0
            if gradients.has_lane(u):
                gradients.discard(u)
        self.reclaim_lent()
        for u in self.units:
            u.grads.drop_stray_grads()  # late gradients of the failed pass
        gradients.drain()
        self._drain_pieces()
        self.coordinator.speculating = False
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

    def reclaim_lent(self) -> None:
        """A vocabulary unit lent whole to a forward (`VocabularyPieces.lend_whole`) goes back to
        its pieces: the backward that read the copy is over (or the step is next)."""
        for pieces in self.vocab_pieces:
            pieces.reclaim_whole()

    def _drain_pieces(self) -> None:
        """The gradients of units read in vocabulary pieces are in their host gradient, like the
        lanes' after `GradientFlush.drain`."""
        for pieces in self.vocab_pieces:
            pieces.drain()
