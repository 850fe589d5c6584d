"""One offloaded block: its host buffers, its device slot, and its residency state machine.

Host side (``memory.py`` explains the bytes): the *image*, laid out like the device slot
(what one fetch copies); fp32 *masters* of the trainable parameters (views into the image
when the device computes in fp32, a separate flat buffer otherwise); fp32 *gradients* of the
trainable parameters. Device side: one flat *slot* whose storage is freed while the block is
on the host.

[Note: parameters always point at real memory] A block parameter's ``.data`` is a view into
the slot while the block is on the device, and a view into its host master (trainable) or
its stored bytes (frozen) while it is not. So between steps every parameter holds its
current value: reading it never touches freed memory, and writing it (in place, or through
``.data`` as PEFT's merge does) writes the master. Before the next fetch the block notices
writes it did not make (a ``.data`` that is no longer our view, or a bumped version
counter) and refreshes the compute-dtype image from the masters.

[Note: why the slot storage is resized] Autograd saves views of a block's weights during
forward (``weight.t()`` for a linear layer). Those views alias the slot's *storage object*.
Resizing that storage to zero frees the bytes while keeping the object; resizing it back and
refilling it before the block's backward makes every saved view valid again. A saved
parameter itself (a leaf) is unpacked as the parameter, which points at the slot again by
then (the pre-backward hook fetched the block). The refill writes the flat slot tensor, not
the parameters, so autograd's version checks stay quiet.

States and the only transitions (each method asserts where it starts)::

    ON_HOST --begin_fetch--> FETCHING --wait_resident--> ON_DEVICE --evict--> ON_HOST
    FETCHING --evict--> ON_HOST   (a prefetch that is no longer wanted; waits for the copy)
"""

from __future__ import annotations

import enum

import torch
from torch import nn
from torch.autograd.profiler import record_function

from .discovery import BlockSpec
from .grads import GradLane
from .ledger import MemoryLedger
from .memory import BlockLayout, DeviceSlotPool, HostAllocator, element_size, layout_block, typed_view
from .transfer import TransferContext


class Residency(enum.Enum):
    ON_HOST = "on_host"
    FETCHING = "fetching"
    ON_DEVICE = "on_device"


class OffloadedBlock:
    """Buffers and residency of one block; the schedule (`WindowEngine`) drives it."""

    def __init__(self, spec: BlockSpec, *, device: torch.device, param_dtype: torch.dtype | None,
                 host: HostAllocator, transfer: TransferContext, pool: DeviceSlotPool, ledger: MemoryLedger) -> None:
        self.index = spec.index
        self.fqn = spec.fqn
        self.module = spec.module
        self.names = [name for name, _ in spec.params]
        self.params: list[nn.Parameter] = [p for _, p in spec.params]
        self.device = device
        self.transfer = transfer
        self.pool = pool
        self.ledger = ledger
        self.layout: BlockLayout = layout_block(spec.fqn, list(spec.params), param_dtype)
        lay = self.layout

        # ---- host buffers
        # uint8 [slot_bytes], pinned when allowed: what one fetch copies to the slot.
        self.image = host.allocate(lay.slot_bytes, transfer=True)
        self.image_views = [typed_view(self.image, e.byte_offset, e.numel, e.device_dtype, e.shape) for e in lay.entries]
        n = lay.grad_numel
        if n and not lay.masters_in_image:
            # fp32 [grad_numel], gradient layout: masters when the device computes in bf16/fp16.
            self.master_flat = host.allocate(4 * n, transfer=False).view(torch.float32)
        else:
            self.master_flat = None
        # fp32 [grad_numel]: the gradient the optimizer reads.
        self.grad_flat = host.allocate(4 * n, transfer=False).view(torch.float32) if n else None
        self.masters: list[nn.Parameter | None] = []
        self.host_views: list[torch.Tensor] = []  # what each parameter's .data is while on the host
        self.grad_views: list[torch.Tensor | None] = []
        with torch.no_grad():
            for e, p, img in zip(lay.entries, self.params, self.image_views):
                if e.trainable:
                    if lay.masters_in_image:
                        master = img
                    else:
                        master = self.master_flat[e.grad_offset : e.grad_offset + e.numel].view(e.shape)
                    master.copy_(p.detach())
                    if master is not img:
                        img.copy_(master)
                    self.masters.append(nn.Parameter(master, requires_grad=True))
                    self.host_views.append(master)
                    self.grad_views.append(self.grad_flat[e.grad_offset : e.grad_offset + e.numel].view(e.shape))
                else:
                    img.copy_(p.detach())
                    self.masters.append(None)
                    self.host_views.append(img)
                    self.grad_views.append(None)

        # ---- device slot: one flat allocation, storage freed while on the host
        self.slot = torch.empty(lay.slot_bytes, dtype=torch.uint8, device=device)
        self.slot_views = [typed_view(self.slot, e.byte_offset, e.numel, e.device_dtype, e.shape) for e in lay.entries]
        self._storage = self.slot.untyped_storage()
        self.slot_bytes = self._storage.nbytes()
        self._storage.resize_(0)
        for p, view in zip(self.params, self.host_views):
            p.data = view
        self._record_host_state()
        self.master_index = {id(m): k for k, m in enumerate(self.masters) if m is not None}

        self.state = Residency.ON_HOST
        self._h2d_event = None
        self.image_stale = False  # the compute-dtype image lags the masters (refresh before a fetch)
        # ---- use counting (driven by the engine)
        self.forward_holds = 0  # forward calls of this block in progress (0 or 1, more when re-entered)
        self.backward_holds = 0  # uses whose backward started and is not done
        self.pending_backward = 0  # uses whose backward has not run yet
        # ---- gradients
        self.lane: GradLane | None = None
        self._lane_views: list[torch.Tensor | None] | None = None  # the .grad views while a lane is attached
        self.grad_touched = [False] * len(self.params)  # set by post-accumulate-grad hooks
        self.grad_valid = [False] * len(self.params)  # the host gradient holds a value (exposed as .grad)
        self.flushes = 0  # flushes folded into the host gradient since it was last empty
        self.device_sq_norm: torch.Tensor | None = None  # valid while the host grad is one untouched flush
        self._exposed_grad_versions: list[int] = []
        self.taken_grads = False  # this backward already took the exposed gradients from the user
        self.valid_at_pass_start = list(self.grad_valid)  # to roll back a backward that raised
        self.flushes_this_pass = 0
        self.grads_poisoned = False  # a failed backward added into accumulated gradients
        # ---- speculation (speculation.py), driven by the step coordinator
        self.spec = None  # SpecRecord of a speculative update no step has validated yet
        self.spec_blocked = False  # no speculation for this block until the next step

    # ------------------------------------------------------------------ queries
    @property
    def trainable(self) -> bool:
        return self.layout.grad_numel > 0

    @property
    def holds(self) -> int:
        return self.forward_holds + self.backward_holds

    @property
    def holds_device_storage(self) -> bool:
        return self._storage.nbytes() > 0

    def master_of(self, param: nn.Parameter) -> nn.Parameter | None:
        for p, m in zip(self.params, self.masters):
            if p is param:
                return m
        raise KeyError(param)

    # ------------------------------------------------------------------ host state
    def _record_host_state(self) -> None:
        self._host_versions = [p._version for p in self.params]

    def adopt_host_writes(self) -> bool:
        """Takes in writes made to the parameters while on the host; True if any trainable changed.

        See [Note: parameters always point at real memory]. A ``.data`` that was replaced
        (``p.data = t``) is copied into the master; an in-place write to our view shows as a
        bumped version counter (writes through a ``.data`` alias do not: with bf16/fp16
        compute call ``engine.mark_parameters_changed()`` after such writes)."""
        changed = False
        with torch.no_grad():
            for k, (p, view) in enumerate(zip(self.params, self.host_views)):
                if p.data.data_ptr() != view.data_ptr() or p.data.dtype != view.dtype or p.data.shape != view.shape:
                    if p.data.shape != view.shape:
                        raise ValueError(
                            f"stronghold: parameter {self.fqn}.{self.names[k]} was given shape {tuple(p.data.shape)}, "
                            f"its block was laid out for {tuple(view.shape)}. Change shapes before offload_model, or "
                            "close the engine first (engine.close())."
                        )
                    view.copy_(p.data)
                    p.data = view
                    changed |= self.layout.entries[k].trainable
                elif p._version != self._host_versions[k]:
                    changed |= self.layout.entries[k].trainable
        if changed and not self.layout.masters_in_image:
            self.image_stale = True
        return changed

    def refresh_image(self) -> None:
        """Re-derives the compute-dtype image of trainable parameters from the fp32 masters."""
        if not self.image_stale:
            return
        with torch.no_grad():
            for e, img, master in zip(self.layout.entries, self.image_views, self.masters):
                if e.trainable and master is not None and img.data_ptr() != master.data_ptr():
                    img.copy_(master)
        self.image_stale = False

    # ------------------------------------------------------------------ transitions
    def begin_fetch(self) -> None:
        assert self.state is Residency.ON_HOST, f"{self.fqn}: begin_fetch from {self.state}"
        with record_function(f"stronghold.fetch:{self.fqn}"):
            self.adopt_host_writes()
            self.refresh_image()
            self.pool.acquire(self.index)
            self._storage.resize_(self.slot_bytes)  # on the compute stream: [Note: allocation stream]
            self.ledger.device_alloc(self.slot_bytes)
            self._h2d_event = self.transfer.copy_h2d(self.slot, self.image, fetch=True)
            for p, view in zip(self.params, self.slot_views):
                p.data = view
        self.state = Residency.FETCHING

    def wait_resident(self) -> None:
        if self.state is Residency.FETCHING:
            self.transfer.device_wait(self._h2d_event)
            self._h2d_event = None
            self.state = Residency.ON_DEVICE
        assert self.state is Residency.ON_DEVICE, f"{self.fqn}: wait_resident from {self.state}"

    def evict(self) -> None:
        """Frees the slot; the parameters point at their host memory again."""
        assert self.state is not Residency.ON_HOST, f"{self.fqn}: evict from {self.state}"
        assert self.holds == 0, f"{self.fqn}: evict while held ({self.holds})"
        assert self.lane is None, f"{self.fqn}: evict with a gradient buffer still attached"
        if self.state is Residency.FETCHING:
            self.wait_resident()  # the copy must land before its destination is freed
        self._storage.resize_(0)
        self.ledger.device_free(self.slot_bytes)
        self.pool.release(self.index)
        for p, view in zip(self.params, self.host_views):
            p.data = view
        self._record_host_state()
        self.state = Residency.ON_HOST

    # ------------------------------------------------------------------ gradients
    def take_exposed_grads(self) -> None:
        """Reads what the user left in ``.grad`` between steps: the source of truth for accumulation.

        ``model.zero_grad()`` sets it to None (the next flush overwrites); our host view
        means "accumulate onto it"; any other tensor is copied in first."""
        if self.taken_grads:
            return
        self._check_not_poisoned()
        self.taken_grads = True
        with torch.no_grad():
            for k, (p, gv) in enumerate(zip(self.params, self.grad_views)):
                if gv is None:
                    continue
                g = p.grad
                if g is None:
                    self.grad_valid[k] = False
                elif g is gv:
                    self.grad_valid[k] = True
                else:
                    gv.copy_(g)
                    self.grad_valid[k] = True
                p.grad = None
        if not any(self.grad_valid):
            self.flushes = 0
            self.device_sq_norm = None
        elif not self._exposed_unchanged():
            self.device_sq_norm = None

    def _check_not_poisoned(self) -> None:
        if not self.grads_poisoned:
            return
        if all(p.grad is None for p, gv in zip(self.params, self.grad_views) if gv is not None):
            self.grads_poisoned = False  # the user zeroed them: nothing partial is left
            return
        raise RuntimeError(
            f"stronghold: a backward pass raised after adding part of its gradients into the accumulated gradients "
            f"of {self.fqn}; they can no longer be separated. Call optimizer.zero_grad() (or model.zero_grad()) and "
            "redo the gradient-accumulation window."
        )

    def _exposed_unchanged(self) -> bool:
        return bool(self._exposed_grad_versions) and all(
            gv is None or gv._version == v for gv, v in zip(self.grad_views, self._exposed_grad_versions)
        )

    def attach_lane(self, lane: GradLane) -> None:
        """Points the trainable parameters' ``.grad`` at the lane: autograd accumulates there."""
        assert self.lane is None and self.state is Residency.ON_DEVICE, f"{self.fqn}: attach_lane in {self.state}"
        self.lane = lane
        self._lane_views = [lane.device_view(e.grad_offset, e.numel, e.shape) if e.trainable else None
                            for e in self.layout.entries]
        for k, (p, view) in enumerate(zip(self.params, self._lane_views)):
            if view is not None:
                p.grad = view
                self.grad_touched[k] = False

    def collect_into_lane(self) -> list[int]:
        """Before a flush: moves gradients that autograd put elsewhere into the lane; returns
        the indices of the parameters that received a gradient since the lane was attached."""
        assert self.lane is not None
        touched = []
        views = self._lane_views or [None] * len(self.params)
        with torch.no_grad():
            for k, (e, p) in enumerate(zip(self.layout.entries, self.params)):
                if not e.trainable:
                    continue
                g = p.grad
                view = views[k] if views[k] is not None else self.lane.device_view(e.grad_offset, e.numel, e.shape)
                if g is not None and g is not view:  # create_graph=True accumulates out of place
                    view.add_(g.to(view.dtype))
                    self.grad_touched[k] = True
                p.grad = None
                if self.grad_touched[k]:
                    touched.append(k)
        self._lane_views = None
        return touched

    def fold(self, staged: torch.Tensor, touched: list[int], accumulate: list[bool]) -> None:
        """Worker thread: adds (or copies) the staged lane into the fp32 host gradient."""
        entries = self.layout.entries
        if len(touched) == sum(e.trainable for e in entries) and len(set(accumulate)) <= 1:
            # The usual case: one flat pass over the whole block.
            if accumulate and accumulate[0]:
                self.grad_flat.add_(staged)
            else:
                self.grad_flat.copy_(staged)
            return
        for k, acc in zip(touched, accumulate):
            e = entries[k]
            src = staged[e.grad_offset : e.grad_offset + e.numel]
            dst = self.grad_flat[e.grad_offset : e.grad_offset + e.numel]
            if acc:
                dst.add_(src)
            else:
                dst.copy_(src)

    def expose_grads(self) -> None:
        """After a backward: ``.grad`` of every trainable parameter is its host gradient (or None)."""
        versions = []
        for k, (p, m, gv) in enumerate(zip(self.params, self.masters, self.grad_views)):
            if gv is None:
                versions.append(0)
                continue
            g = gv if self.grad_valid[k] else None
            p.grad = g
            m.grad = g
            versions.append(gv._version)
        self._exposed_grad_versions = versions
        self.taken_grads = False

    def clear_grads(self) -> None:
        for k, (p, m, gv) in enumerate(zip(self.params, self.masters, self.grad_views)):
            if gv is not None:
                p.grad = None
                m.grad = None
                self.grad_valid[k] = False
        self.flushes = 0
        self.device_sq_norm = None
        self._exposed_grad_versions = []

    def host_grad_sq_norm(self) -> torch.Tensor:
        """Squared L2 norm of the exposed gradients, computed on the host (fp32 scalar)."""
        grads = [p.grad for p, gv in zip(self.params, self.grad_views) if gv is not None and p.grad is not None]
        if not grads:
            return torch.zeros((), dtype=torch.float32)
        norms = torch._foreach_norm([g.float() if g.dtype != torch.float32 else g for g in grads])
        return torch.stack([n.float() for n in norms]).square().sum()

    def device_norm_valid(self) -> bool:
        return self.device_sq_norm is not None and self.flushes == 1 and self._exposed_unchanged() and all(
            p.grad is gv for p, gv, valid in zip(self.params, self.grad_views, self.grad_valid) if gv is not None and valid
        )

    def step_grads(self) -> list[tuple[int, torch.Tensor | None]]:
        """At ``optimizer.step()`` (training thread): the gradient each trainable parameter steps
        with, from the exposed ``.grad`` (which ``zero_grad`` or the user may have changed).
        Reads only: the host worker applies it (`load_master_grads`), so nothing a running task
        reads is touched here."""
        self._check_not_poisoned()
        return [(k, p.grad) for k, (p, gv) in enumerate(zip(self.params, self.grad_views)) if gv is not None]

    def host_grads(self) -> list[tuple[int, torch.Tensor]]:
        """The host gradients folded so far (what a speculative update reads)."""
        return [(k, gv) for k, (gv, valid) in enumerate(zip(self.grad_views, self.grad_valid)) if gv is not None and valid]

    def grads_match(self, grads: list[tuple[int, torch.Tensor | None]], used: list[tuple[int, torch.Tensor]]) -> bool:
        """Whether ``grads`` (from `step_grads`) are exactly the host gradients a speculative
        update ``used``, untouched since the end of backward (version counters)."""
        present = [(k, g) for k, g in grads if g is not None]
        if [k for k, _ in present] != [k for k, _ in used]:
            return False
        return all(g is self.grad_views[k] for k, g in present) and self._exposed_unchanged()

    def grads_modified_in_place(self) -> bool:
        """Whether an exposed host gradient was written since the end of backward."""
        return bool(self._exposed_grad_versions) and not self._exposed_unchanged()

    def load_master_grads(self, grads: list[tuple[int, torch.Tensor | None]]) -> bool:
        """On the host worker: points the masters' ``.grad`` at the gradients to step with."""
        given = dict(grads)
        any_grad = False
        with torch.no_grad():
            for k, (master, gv) in enumerate(zip(self.masters, self.grad_views)):
                if gv is None:
                    continue
                g = given.get(k)
                if g is None:
                    master.grad = None
                    continue
                if g is not gv:
                    gv.copy_(g)
                master.grad = gv
                any_grad = True
        return any_grad

    # ------------------------------------------------------------------ teardown
    def restore_parameters(self, device: torch.device) -> None:
        """Gives each parameter an ordinary tensor of its stored dtype on ``device`` (engine.close)."""
        assert self.state is Residency.ON_HOST and self.lane is None
        with torch.no_grad():
            for e, p, view in zip(self.layout.entries, self.params, self.host_views):
                grad = p.grad
                p.grad = None
                p.data = view.to(device=device, dtype=e.stored_dtype, copy=True)
                if grad is not None:
                    p.grad = grad.to(device=device, dtype=e.stored_dtype, copy=True)
        self.masters = [None] * len(self.params)

    @property
    def image_nbytes(self) -> int:
        return self.image.numel()

    @property
    def grad_nbytes_device(self) -> int:
        return self.layout.grad_numel * (element_size(self.layout.grad_dtype) if self.layout.grad_dtype else 0)
