"""One offloaded block: its buffers and its residency state machine.

A block owns, on the host, a flat fp32 master (the values the optimizer updates), a flat fp32
gradient buffer that the optimizer reads, and a flat compute-dtype copy that is sent to the
device in one copy (for fp32 compute the master *is* that copy, so nothing is duplicated).
On the device it owns one flat allocation, its slot; every parameter of the block is a view
into the slot, so the ``nn.Parameter`` objects never change.

States and the only transitions (each method asserts where it starts)::

    ON_CPU --begin_fetch--> H2D_IN_FLIGHT --wait_resident--> ON_DEVICE
    ON_DEVICE --evict--> ON_CPU
    ON_DEVICE --offload_grads_and_evict--> D2H_IN_FLIGHT --finish_grads--> ON_CPU

[Note: why resize_ and not .data swaps] Autograd saves views of a block's weights during
forward (``weight.t()`` for a linear layer, for example). Those views alias the slot's
*storage object*. Resizing that storage to zero frees the bytes while keeping the object;
resizing it back and refilling it before the block's backward makes every saved view valid
again. Swapping ``p.data`` instead would leave the saved views on the old bytes. The refill
goes through ``Tensor.copy_`` on the flat slot tensor (not on the parameters), which does not
bump the parameters' version counters, so autograd's in-place checks stay quiet.
"""

from __future__ import annotations

import enum

import torch
from torch import nn
from torch.autograd.profiler import record_function

from .discovery import BlockSpec
from .memory import DeviceSlotPool, HostArena, ParamSlice, layout_params
from .transfer import InFlightD2H, InFlightH2D, TransferContext


class BlockState(enum.Enum):
    ON_CPU = "on_cpu"
    H2D_IN_FLIGHT = "h2d_in_flight"
    ON_DEVICE = "on_device"
    D2H_IN_FLIGHT = "d2h_in_flight"


class OffloadedBlock:
    """Buffers and residency of one block; driven by `WindowEngine`."""

    def __init__(
        self,
        spec: BlockSpec,
        *,
        device: torch.device,
        param_dtype: torch.dtype | None,
        arena: HostArena,
        transfer: TransferContext,
        pool: DeviceSlotPool,
    ) -> None:
        self.index = spec.index
        self.fqn = spec.fqn
        self.module = spec.module
        self.names = [name for name, _ in spec.params]
        self.params: list[nn.Parameter] = [p for _, p in spec.params]
        self.device = device
        self.transfer = transfer
        self.pool = pool
        dtypes = {p.dtype for p in self.params}
        if param_dtype is None and len(dtypes) > 1:
            raise ValueError(
                f"Block {self.fqn} mixes parameter dtypes {sorted(map(str, dtypes))}; set "
                "StrongholdConfig(param_dtype=...) so its device copy has one dtype."
            )
        self.param_dtype = param_dtype or next(iter(dtypes), torch.float32)
        self.slices: list[ParamSlice]
        self.slices, self.numel = layout_params([(n, p.shape) for n, p in spec.params], torch.float32)

        # Host side. [numel] fp32 each; masters/grads are per-parameter views into them.
        self.master_flat = arena.allocate(self.numel, torch.float32)[: self.numel]
        self.grad_flat = arena.allocate(self.numel, torch.float32)[: self.numel]
        with torch.no_grad():
            for s, p in zip(self.slices, self.params):
                self.master_flat[s.offset : s.offset + s.numel].copy_(p.detach().reshape(-1).float())
        self.masters: list[nn.Parameter] = [
            nn.Parameter(self._view(self.master_flat, s), requires_grad=p.requires_grad)
            for s, p in zip(self.slices, self.params)
        ]
        if self.param_dtype == torch.float32:
            self.host_copy = self.master_flat  # [numel] fp32: the master is what travels
        else:
            self.host_copy = arena.allocate(self.numel, self.param_dtype)[: self.numel]
            self.host_copy.copy_(self.master_flat)
        self._synced_version = self.master_flat._version
        # Staging for gradients that must be *added* to existing master grads (accumulation) or
        # that arrive in a low-precision dtype. Allocated on first need.
        self._arena = arena
        self._grad_staging: torch.Tensor | None = None

        # Device side: one slot; parameters become views into it, storage freed until fetched.
        self.device_flat = torch.empty(self.numel, dtype=self.param_dtype, device=device)
        for s, p in zip(self.slices, self.params):
            p.data = self._view(self.device_flat, s)
        self._storage = self.device_flat.untyped_storage()
        self.slot_bytes = self._storage.nbytes()
        self._storage.resize_(0)

        self.state = BlockState.ON_CPU
        self._h2d: InFlightH2D | None = None
        self._d2h: InFlightD2H | None = None
        self._d2h_into_master = False
        self._d2h_param_ids: list[int] = []
        # Filled by the engine: squared L2 norm of the gradient that left in the last flush
        # (a device scalar), or None when the host must recompute it (accumulated grads).
        self.device_grad_sq_norm: torch.Tensor | None = None
        # Set by the engine under data parallelism: averages a flat device gradient in place.
        self.grad_reducer = None

    @staticmethod
    def _view(flat: torch.Tensor, s: ParamSlice) -> torch.Tensor:
        return flat[s.offset : s.offset + s.numel].view(s.shape)

    # ------------------------------------------------------------------ queries
    @property
    def holds_device_storage(self) -> bool:
        return self._storage.nbytes() > 0

    @property
    def nbytes_device(self) -> int:
        return self.slot_bytes

    def has_device_grads(self) -> bool:
        return any(p.grad is not None for p in self.params)

    def master_of(self, param: nn.Parameter) -> nn.Parameter:
        for p, m in zip(self.params, self.masters):
            if p is param:
                return m
        raise KeyError(param)

    # ------------------------------------------------------------------ host copy refresh
    def refresh_host_copy(self) -> None:
        """Re-derives the compute-dtype host copy after the masters changed (optimizer step)."""
        if self.host_copy is self.master_flat:
            return
        if self.master_flat._version != self._synced_version:
            self.host_copy.copy_(self.master_flat)
            self._synced_version = self.master_flat._version

    def mark_host_copy_synced(self) -> None:
        """Called after CPU Adam wrote the compute-dtype copy itself (copy-out)."""
        self._synced_version = self.master_flat._version

    # ------------------------------------------------------------------ transitions
    def begin_fetch(self) -> None:
        assert self.state is BlockState.ON_CPU, f"{self.fqn}: begin_fetch from {self.state}"
        with record_function(f"stronghold.fetch:{self.fqn}"):
            self.refresh_host_copy()
            self.pool.acquire(self.index)
            self._storage.resize_(self.slot_bytes)  # on the compute stream, see transfer.py notes
            after = self.transfer.compute_event()
            self._h2d = self.transfer.copy_h2d(self.index, self.device_flat, self.host_copy, after)
        self.state = BlockState.H2D_IN_FLIGHT

    def wait_resident(self) -> None:
        if self.state is BlockState.H2D_IN_FLIGHT:
            assert self._h2d is not None
            self.transfer.wait_h2d(self._h2d)
            self._h2d = None
            self.state = BlockState.ON_DEVICE
        assert self.state is BlockState.ON_DEVICE, f"{self.fqn}: wait_resident from {self.state}"

    def evict(self) -> None:
        assert self.state is BlockState.ON_DEVICE, f"{self.fqn}: evict from {self.state}"
        assert not self.has_device_grads(), f"{self.fqn}: evict with gradients still on the device"
        self._storage.resize_(0)
        self.pool.release(self.index)
        self.state = BlockState.ON_CPU

    def offload_grads_and_evict(self, *, want_norm: bool) -> None:
        """Packs device grads into one flat buffer, starts its D2H copy, and frees the slot."""
        assert self.state is BlockState.ON_DEVICE, f"{self.fqn}: offload_grads from {self.state}"
        self._start_grad_d2h(want_norm=want_norm)
        self._storage.resize_(0)
        self.pool.release(self.index)
        self.state = BlockState.D2H_IN_FLIGHT

    def offload_late_grads(self, *, want_norm: bool) -> None:
        """Gradients that autograd produced after the block was already evicted (rare)."""
        assert self.state is BlockState.ON_CPU, f"{self.fqn}: late grads from {self.state}"
        self._start_grad_d2h(want_norm=want_norm)
        self.state = BlockState.D2H_IN_FLIGHT

    def _start_grad_d2h(self, *, want_norm: bool) -> None:
        with record_function(f"stronghold.grads_out:{self.fqn}"):
            self._pack_and_send_grads(want_norm=want_norm)

    def _pack_and_send_grads(self, *, want_norm: bool) -> None:
        ids = [k for k, p in enumerate(self.params) if p.grad is not None]
        self._d2h_param_ids = ids
        if not ids:
            self._d2h = None
            self.device_grad_sq_norm = None
            return
        grad_dtype = self.params[ids[0]].grad.dtype
        # [numel] param dtype on the device: every gradient in the block's flat layout. Zeros,
        # not empty: the alignment padding between parameters must not add to the norm.
        dev = torch.zeros(self.numel, dtype=grad_dtype, device=self.device)
        dst = [self._view(dev, self.slices[k]) for k in ids]
        src = [self.params[k].grad for k in ids]
        torch._foreach_copy_(dst, src)
        for k in ids:
            self.params[k].grad = None
        if self.grad_reducer is not None:
            self.grad_reducer(dev)  # data parallel: average while still on the device
        fresh = all(self.masters[k].grad is None for k in ids)
        if want_norm:
            # Only meaningful when this gradient is the whole accumulated gradient.
            # vector_norm(dtype=fp32) reduces in fp32 without a full-size fp32 temporary.
            self.device_grad_sq_norm = torch.linalg.vector_norm(dev, dtype=torch.float32).square() if fresh else None
        self._d2h_into_master = fresh and grad_dtype == torch.float32
        if self._d2h_into_master:
            target = self.grad_flat
        else:
            if self._grad_staging is None or self._grad_staging.dtype != grad_dtype:
                self._grad_staging = self._arena.allocate(self.numel, grad_dtype)[: self.numel]
            target = self._grad_staging
        self._d2h = self.transfer.copy_d2h(self.index, target, dev)

    def finish_grads(self) -> None:
        """Waits for the gradient copy and folds it into the masters' ``.grad`` (copy or add)."""
        assert self.state is BlockState.D2H_IN_FLIGHT, f"{self.fqn}: finish_grads from {self.state}"
        if self._d2h is not None:
            host = self.transfer.wait_d2h(self._d2h)
            self._d2h = None  # drops the device buffer only now, see [Note: D2H lifetime]
            for k in self._d2h_param_ids:
                master = self.masters[k]
                view = self._view(self.grad_flat, self.slices[k])
                if self._d2h_into_master:
                    master.grad = view
                elif master.grad is None:
                    view.copy_(self._view(host, self.slices[k]))
                    master.grad = view
                else:
                    master.grad.add_(self._view(host, self.slices[k]))
        self._d2h_param_ids = []
        self.state = BlockState.ON_CPU
