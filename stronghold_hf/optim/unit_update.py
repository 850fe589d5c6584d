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

    def __init__(self, cpu_optimizer, nvme=None) -> None:
        self.cpu_optimizer = cpu_optimizer  # CPUAdam, or a torch AdamW (offload_optimizer without the kernels)
        self.nvme = nvme  # nvme.NvmeTier holding the moments, or None: in RAM

    def _state_of(self, block):
        """Inside: the CPU optimizer's state of ``block`` is in memory (always, without a tier)."""
        return self.nvme.bound(block.index) if self.nvme is not None else contextlib.nullcontext()

    def _not_updating(self, block) -> None:
        if self.nvme is not None:
            self.nvme.drop(block.index)

    def update(self, block, groups: list[int], grads, grad_mul: float) -> None:
        """One unit's update with ``grad * grad_mul`` (clip coefficient x 1/scale)."""
        if not block.grads.load_master_grads(grads):
            self._not_updating(block)
            return
        if isinstance(self.cpu_optimizer, CPUAdam):
            with self._state_of(block):
                self.cpu_optimizer.step_groups(groups, inv_loss_scale=grad_mul)
            if not block.layout.masters_in_image:
                block.host.image_rewritten(k for k, g in grads if g is not None)  # a redo after an undo: nothing to refresh
            return
        if grad_mul != 1.0:
            for m in block.host.masters:
                if m is not None and m.grad is not None:
                    m.grad.mul_(grad_mul)
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
            self._not_updating(block)
            return
        grads = dict(record.grads)
        master_index = block.host.master_index
        native = isinstance(self.cpu_optimizer, CPUAdam) and undo_native.native_undo_error() is None
        with self._state_of(block):
            for gi, hyper in zip(record.groups, record.hyper):
                table = self.cpu_optimizer.undo_table(gi, lambda m: grads.get(master_index[id(m)])) if native else None
                if table is not None:  # the step's own addresses: no Python per parameter
                    undo_native.undo_adamw_table_(table, hyper, record.grad_mul)
                    continue
                params, used, states = [], [], []
                for m in self.cpu_optimizer.param_groups[gi]["params"]:
                    k = block.host.master_index[id(m)]
                    if k in grads:
                        params.append(m.data)
                        used.append(grads[k])
                        states.append(self.cpu_optimizer.state.get(m, {}))
                undo_adamw_(params, used, states, hyper, record.grad_mul)
        if not block.layout.masters_in_image:
            block.host.image_lags_undo(grads)  # the copy-out holds the undone values until a redo rewrites them
