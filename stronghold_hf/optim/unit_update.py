"""One unit's CPU work on the host worker: its update, a speculative update, their undo, and
a missed speculation's undo and redo fused.

The optimizer's step (``hybrid.py``) decides which unit gets which work, with which gradients
and coefficient, and queues it through the step coordinator (``stepping.py``), which runs it on
the host worker (the unit the next forward needs first on the training thread). This is the
work itself: point the masters' ``.grad`` at the gradients to step with (``unit_grads.py``),
run the CPU optimizer over the unit's param groups with its NVMe state bound (``nvme.py``), and
keep the compute-dtype image in step (CPU Adam's copy-out, or the stale flag). A speculative
update is the same work started during backward; its undo inverts AdamW exactly from what it
applied (``speculation.py``). It holds no state of its own besides the optimizer and the tier.
"""

from __future__ import annotations

import contextlib

from ..speculation import SpecRecord, undo_adamw_
from . import undo_native
from .cpu_adam import CPUAdam


class UnitUpdates:
    """The CPU work of one unit at a time; see the module docstring."""

    def __init__(self, cpu_optimizer, nvme=None, segments=None) -> None:
        self.cpu_optimizer = cpu_optimizer  # CPUAdam, or a torch AdamW (offload_optimizer without the kernels)
        self.nvme = nvme  # nvme.NvmeTier holding the moments, or None: in RAM
        self.segments = segments  # segments.StateSegments: units stepped and streamed in segments, or None

    def regions(self, block, groups: list[int]) -> list:
        """The NVMe regions of ``block``'s state, in the order its work binds them: the unit's
        own, or one per segment, each a param group of ``groups`` (segments.py)."""
        return [key for key, _ in self._parts(block, groups)]

    def _parts(self, block, groups: list[int]) -> list[tuple[object, list[int]]]:
        """``(region, its groups)``: the work of ``block`` one region at a time (one part, the
        unit's, unless it is cut into segments)."""
        if self.segments is None or block.index not in self.segments.cut_units:
            return [(block.index, groups)]
        return [((block.index, gi), [gi]) for gi in groups]

    def _state_of(self, key):
        """Inside: the CPU optimizer's state of region ``key`` is in memory (always, without a tier)."""
        return self.nvme.bound(key) if self.nvme is not None else contextlib.nullcontext()

    def _not_updating(self, block, groups: list[int]) -> None:
        if self.nvme is not None:
            for key in self.regions(block, groups):
                self.nvme.drop(key)

    def update(self, block, groups: list[int], grads, grad_mul: float) -> None:
        """One unit's update with ``grad * grad_mul`` (clip coefficient x 1/scale)."""
        if not block.grads.load_master_grads(grads):
            self._not_updating(block, groups)
            return
        if self.segments is not None:
            self.segments.point_grads(block.index)
        if isinstance(self.cpu_optimizer, CPUAdam):
            for key, part in self._parts(block, groups):
                with self._state_of(key):
                    self.cpu_optimizer.step_groups(part, inv_loss_scale=grad_mul)
            if not block.layout.masters_in_image:
                block.host.image_rewritten(k for k, g in grads if g is not None)  # a redo after an undo: nothing to refresh
            return
        if grad_mul != 1.0:  # into a copy: the host gradient stays on show as .grad (unit_grads.py)
            for m in block.host.masters:
                if m is not None and m.grad is not None:
                    m.grad = m.grad * grad_mul
        saved = [self.cpu_optimizer.param_groups[i] for i in groups]
        all_groups = self.cpu_optimizer.param_groups
        self.cpu_optimizer.param_groups = saved
        try:
            self.cpu_optimizer.step()
        finally:
            self.cpu_optimizer.param_groups = all_groups
        block.host.image_stale = not block.layout.masters_in_image  # no copy-out on this path

    def apply_speculation(self, block, record: SpecRecord, partial_norm) -> None:
        """The speculative update, unless the pass already knows it will clip."""
        if partial_norm.exceeded:
            return
        self.update(block, record.groups, record.grads, record.grad_mul)
        record.applied = True

    def complete_speculation(self, block, record: SpecRecord) -> None:
        """After a validated speculation: nothing if it ran, else the update it skipped."""
        if not record.applied:
            self.update(block, record.groups, record.grads, record.grad_mul)

    @property
    def fuses_redo(self) -> bool:
        """Whether a missed speculation's rollback and redo can run as one pass (`redo`): CPU
        Adam's native kernels, and the state in RAM (the NVMe tier rebinds the moments for each
        update, so the step's address table is not there to reuse)."""
        return isinstance(self.cpu_optimizer, CPUAdam) and self.nvme is None and undo_native.native_undo_error() is None

    def redo(self, block, record: SpecRecord, groups: list[int], grads, grad_mul: float) -> None:
        """A missed speculation: its rollback and the update with ``grad_mul``, in one native pass
        over the block when the update reads the very gradients the speculative one did
        (CPUAdam.redo_groups; bit for bit the two apart, with the state streamed once); the two
        apart otherwise. Planned only where `fuses_redo`."""
        if not record.applied:  # the pass stopped speculating before this block: nothing to undo
            self.update(block, groups, grads, grad_mul)
            return
        if list(record.groups) == list(groups) and block.grads.load_master_grads(grads) and \
                self.cpu_optimizer.redo_groups(groups, record.hyper, record.grad_mul, clip_coef=grad_mul):
            if not block.layout.masters_in_image:
                block.host.image_rewritten(k for k, g in grads if g is not None)
            return
        self.undo(block, record)
        self.update(block, groups, grads, grad_mul)

    def undo(self, block, record: SpecRecord) -> None:
        """Inverts a speculative update exactly from what it applied."""
        if not record.applied:
            self._not_updating(block, record.groups)
            return
        grads = dict(record.grads)
        master_index = block.host.master_index
        segments = self.segments

        def grad_of(m):  # the gradient ``m`` (a master, or a segment of one) was stepped with
            k = master_index.get(id(m))
            if k is not None:
                return grads.get(k)
            return segments.grad_of(m, grads) if segments is not None else None

        native = isinstance(self.cpu_optimizer, CPUAdam) and undo_native.native_undo_error() is None
        hyper_of = dict(zip(record.groups, record.hyper))
        for key, part in self._parts(block, list(record.groups)):
            with self._state_of(key):
                for gi in part:
                    hyper = hyper_of[gi]
                    table = self.cpu_optimizer.undo_table(gi, grad_of) if native else None
                    if table is not None:  # the step's own addresses: no Python per parameter
                        undo_native.undo_adamw_table_(table, hyper, record.grad_mul)
                        continue
                    params, used, states = [], [], []
                    for m in self.cpu_optimizer.param_groups[gi]["params"]:
                        g = grad_of(m)
                        if g is not None:
                            params.append(m.data)
                            used.append(g)
                            states.append(self.cpu_optimizer.state.get(m, {}))
                    undo_adamw_(params, used, states, hyper, record.grad_mul)
        if not block.layout.masters_in_image:
            block.host.image_lags_undo(grads)  # the copy-out holds the undone values until a redo rewrites them
