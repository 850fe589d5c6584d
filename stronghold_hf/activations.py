"""Checkpointed activations on the host: each block's saved input leaves the device in forward
and comes back one block ahead of its backward.

With gradient checkpointing a block keeps only its input for backward, where it recomputes
the rest. Those inputs still add up with depth: for Llama-3-8B at 4096 tokens, 32 x 32 MiB in
bf16, and for a 70B model at 8k tokens several GiB. torchtune's ``OffloadActivations`` and
DeepSpeed's CPU activation checkpointing move them to pinned host memory on a side stream;
torch's ``save_on_cpu`` moves every saved tensor, weights included, synchronously. This
module moves only the checkpointed inputs, in the order the window already knows:

* In forward, while a checkpointed block runs, a saved-tensor hook (pushed by the schedule
  around the block's checkpoint call, outside the checkpoint whatever transformers wraps
  (``checkpointing.py``), so it sees exactly what ``torch.utils.checkpoint`` saves: the
  block's inputs, reentrant or not) packs each input into a `SavedInput`. Unless the block is
  among the last ``W`` positions of the sequence (backward needs those first, as at the turn),
  the input is copied to a pinned host buffer on the device-to-host stream, and the device
  tensor is let go once the copy has landed.
* In backward, when the block at position ``p`` starts (its pre-backward), the saved inputs of
  position ``p - 1`` are copied back on the host-to-device stream, so they are on the device
  when that block's recompute unpacks them. An input not fetched ahead is fetched at unpack.

The ledger counts the device bytes of the inputs the engine holds (``activation_device_bytes``,
``activation_device_peak_bytes``) and the host buffers (``activation_host_bytes``), with
offload on and off alike, so a CPU test sees the device peak stay flat with depth when it is
on and grow when it is off.

[Note: saved input lifetime] A device tensor being copied to the host must stay alive until
the copy's event has completed (transfer.py, [Note: D2H lifetime]): a `SavedInput` keeps it
until then (checked without blocking at each later block, waited for before backward). Its
host buffer returns to the pool only when autograd frees the saved tensor, since a retained
graph may unpack it again, and travels with the event of the last copy that read it, which
the next user of the buffer waits for.
"""

from __future__ import annotations

import logging
import threading
import weakref
from typing import Any, Literal

import torch

from .ledger import MemoryLedger
from .memory import HostAllocator
from .transfer import TransferContext

logger = logging.getLogger("stronghold_hf")

OffloadActivations = bool | Literal["auto"]

#: ``offload_activations="auto"`` on a GPU: offload when the checkpointed inputs of every block
#: would take more than this fraction of the device memory free at the first checkpointed block.
AUTO_FREE_FRACTION = 0.25
#: Inputs smaller than this stay on the device: not worth a copy each way.
MIN_OFFLOAD_BYTES = 4096


class _HostBuffers:
    """Reusable host buffers for saved inputs (pinned while the allocator's budget allows)."""

    def __init__(self, host: HostAllocator, ledger: MemoryLedger, transfer: TransferContext) -> None:
        self.host = host
        self.ledger = ledger
        self.transfer = transfer
        self._free: list[tuple[torch.Tensor, Any]] = []  # (uint8 buffer, event of the last copy reading it)
        self._lock = threading.Lock()  # a SavedInput may be collected on autograd's device thread
        self.total_bytes = 0

    def acquire(self, nbytes: int) -> torch.Tensor:
        with self._lock:
            # The smallest free buffer that fits, taken out by position: entries hold tensors,
            # which must never be compared (``==`` on tensors of two sizes raises).
            fits = [k for k, (buf, _) in enumerate(self._free) if buf.numel() >= nbytes]
            best = self._free.pop(min(fits, key=lambda k: self._free[k][0].numel())) if fits else None
        if best is not None:
            if best[1] is not None:
                self.transfer.host_wait(best[1])  # its last copy to the device has read it
            return best[0]
        buf = self.host.allocate(nbytes, transfer=True)
        with self._lock:
            self.total_bytes += buf.numel()
            total = self.total_bytes
        self.ledger.set_activation_host_bytes(total)
        return buf

    def release(self, buf: torch.Tensor, event: Any) -> None:
        with self._lock:
            self._free.append((buf, event))


class SavedInput:
    """One checkpointed input of one block use: on the device, on its way, or on the host."""

    __slots__ = ("store", "position", "shape", "dtype", "nbytes", "device_tensor", "d2h_event", "host",
                 "h2d_event", "__weakref__")

    def __init__(self, store: "ActivationStore", tensor: torch.Tensor, position: int) -> None:
        self.store = store
        self.position = position
        self.shape, self.dtype = tensor.shape, tensor.dtype
        self.nbytes = tensor.numel() * tensor.element_size()
        self.device_tensor: torch.Tensor | None = tensor  # held while on the device or being copied out
        self.d2h_event = None
        self.host: torch.Tensor | None = None  # uint8 [>= nbytes] host copy
        self.h2d_event = None  # the last copy back to the device

    def __del__(self) -> None:
        store = self.store
        if self.device_tensor is not None:
            store.ledger.activation_free(self.nbytes)
        if self.host is not None:
            store.buffers.release(self.host, self.h2d_event)


class ActivationStore:
    """The saved inputs of checkpointed blocks (see the module docstring)."""

    def __init__(self, *, transfer: TransferContext, ledger: MemoryLedger, host: HostAllocator, device: torch.device,
                 offload: OffloadActivations) -> None:
        self.transfer = transfer
        self.ledger = ledger
        self.device = device
        self.requested = offload  # what the config asked for
        self.offload = offload  # True, False, or "auto" until the first checkpointed input decides
        self.buffers = _HostBuffers(host, ledger, transfer)
        self._position = -1  # of the block whose call is packing now
        self._offload_here = False
        self._num_blocks = 0
        self._pass: dict[int, list[weakref.ref]] = {}  # position -> saved inputs of this pass
        self._leaving: list[SavedInput] = []  # copies to the host in flight
        self.begin_pass()

    def begin_pass(self) -> None:
        """Counts of one forward pass, for the first step's check (checkpointing.py)."""
        self.packed_positions: dict[int, int] = {}  # position -> inputs the checkpoint saved through us
        self.eligible_this_pass = 0  # inputs large enough to leave the device, outside the kept tail
        self.offloaded_this_pass = 0

    # ------------------------------------------------------------------ forward
    def begin_block(self, position: int, offload_here: bool, num_blocks: int) -> Any:
        """Around a checkpointed block's call: packs what the checkpoint saves. ``offload_here``
        is False for the blocks at the tail the turn keeps. Returns the context for `end_block`."""
        self._reap()
        outer = (self._position, self._offload_here)  # a checkpoint inside a checkpointed call
        self._position, self._offload_here, self._num_blocks = position, offload_here, num_blocks
        ctx = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        ctx.__enter__()
        return ctx, outer

    def end_block(self, opened: Any) -> None:
        ctx, (self._position, self._offload_here) = opened
        ctx.__exit__(None, None, None)

    def _decide(self, nbytes: int) -> bool:
        if self.device.type != "cuda":
            return False  # the "device" is host memory: nothing to gain
        free = torch.cuda.mem_get_info(self.device)[0]
        projected = nbytes * self._num_blocks
        on = projected > AUTO_FREE_FRACTION * free
        logger.info("stronghold: offload_activations=auto -> %s: checkpointed inputs %.2f GiB (%d blocks x %.1f MiB), "
                    "%.2f GiB free on %s", on, projected / 2**30, self._num_blocks, nbytes / 2**20, free / 2**30,
                    self.device)
        return on

    def _pack(self, tensor: torch.Tensor):
        if not tensor.is_floating_point() or tensor.numel() == 0 or tensor.device != self.device:
            return tensor
        saved = SavedInput(self, tensor, self._position)
        self.ledger.activation_alloc(saved.nbytes)
        self._pass.setdefault(self._position, []).append(weakref.ref(saved))
        self.packed_positions[self._position] = self.packed_positions.get(self._position, 0) + 1
        if self.offload == "auto":
            self.offload = self._decide(saved.nbytes)
        eligible = self.offload and self._offload_here and saved.nbytes >= MIN_OFFLOAD_BYTES
        self.eligible_this_pass += bool(eligible)
        if eligible and tensor.is_contiguous():
            self.offloaded_this_pass += 1
            saved.host = self.buffers.acquire(saved.nbytes)
            flat = tensor.detach().reshape(-1).view(torch.uint8)
            saved.d2h_event = self.transfer.copy_d2h(saved.host[: saved.nbytes], flat)
            self._leaving.append(saved)
            if not self.transfer.is_async:
                self._reap()
        return saved

    def _reap(self, wait: bool = False) -> None:
        """Lets go of device tensors whose copy to the host has landed."""
        still = []
        for saved in self._leaving:
            if saved.device_tensor is None:
                continue
            if wait:
                self.transfer.host_wait(saved.d2h_event)
            elif not saved.d2h_event.query():
                still.append(saved)
                continue
            self._drop_device(saved)
        self._leaving = still

    def _drop_device(self, saved: SavedInput) -> None:
        if saved.device_tensor is not None:
            saved.device_tensor = None
            self.ledger.activation_free(saved.nbytes)

    def end_forward(self) -> None:
        """The model's forward is over: every copy to the host lands before backward needs it."""
        self._reap(wait=True)

    # ------------------------------------------------------------------ backward
    def prefetch_before(self, position: int) -> None:
        """The block at ``position`` starts its backward: bring back the inputs of the one before."""
        self._reap(wait=True)
        for ref in self._pass.get(position - 1, ()):
            saved = ref()
            if saved is not None and saved.device_tensor is None and saved.host is not None:
                self._fetch(saved)

    def _fetch(self, saved: SavedInput) -> None:
        flat = torch.empty(saved.nbytes, dtype=torch.uint8, device=self.device)
        saved.h2d_event = self.transfer.copy_h2d(flat, saved.host[: saved.nbytes], fetch=False)
        saved.device_tensor = flat.view(saved.dtype).view(saved.shape)
        self.ledger.activation_alloc(saved.nbytes)

    def _unpack(self, saved):
        if not isinstance(saved, SavedInput):
            return saved
        if saved.device_tensor is None:  # not fetched ahead (out of order, or a second backward)
            self._reap(wait=True)
            self._fetch(saved)
        tensor = saved.device_tensor
        if saved.host is not None:
            if saved.h2d_event is not None:
                self.transfer.device_wait(saved.h2d_event)
            # The recompute holds it from here; a second backward (retained graph) fetches again.
            self._drop_device(saved)
        return tensor

    def end_backward(self) -> None:
        self._pass.clear()
