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

[Note: checkpoints beyond RAM] With ``nvme_activations`` (and ``nvme_path``) an offloaded input
goes on to a scratch file once its copy to the host has landed, and its host buffer is reused:
the host holds a ring of a few inputs (`DISK_RING` being written, two being read back) instead
of all of them, and the file grows with depth and sequence. The backward reads them back in
the order it needs them, one position further ahead than the device fetch: when the block at
``p`` starts its backward, the inputs of ``p - 2`` are read from the file on the I/O threads
(which let go of the GIL) while those of ``p - 1``, read during the block before, are copied to
the device. At 1M tokens an 8B model's checkpoints are 256 GiB (Llama-3-8B: 32 x 8 GiB in bf16);
the device still holds ``O(W)`` of them, the host a handful, the disk the rest. The file is
written once and read once per step, in order (the drive's best case); its regions are
reused from the start once no input of an earlier pass lives.

The ledger counts the device bytes of the inputs the engine holds (``activation_device_bytes``,
``activation_device_peak_bytes``) and the host buffers (``activation_host_bytes``), with
offload on and off alike, so a CPU test sees the device peak stay flat with depth when it is
on and grow when it is off; with the file, the host bytes stay flat too and the file's
(``activation_disk_bytes``, ``activation_disk_peak_bytes``) grow.

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
from .memory import HostAllocator, available_host_bytes
from .swap import PAGE, StateFile, SwapDirectory, _page_up
from .transfer import TransferContext

logger = logging.getLogger("stronghold_hf")

OffloadActivations = bool | Literal["auto"]

#: ``offload_activations="auto"`` on a GPU: offload when the checkpointed inputs of every block
#: would take more than this fraction of the device memory free at the first checkpointed block.
AUTO_FREE_FRACTION = 0.25
#: Inputs smaller than this stay on the device: not worth a copy each way.
MIN_OFFLOAD_BYTES = 4096
#: ``nvme_activations``: inputs whose write to the file may be in flight at once (their host
#: buffers, with the two being read back, are what the host holds).
DISK_RING = 2


class _HostBuffers:
    """Reusable host buffers for saved inputs (pinned while the allocator's budget allows)."""

    def __init__(self, host: HostAllocator, ledger: MemoryLedger, transfer: TransferContext) -> None:
        self.host = host
        self.ledger = ledger
        self.transfer = transfer
        self._free: list[tuple[torch.Tensor, Any]] = []  # (uint8 buffer, event of the last copy reading it)
        self._lock = threading.Lock()  # a SavedInput may be collected on autograd's device thread
        self.total_bytes = 0
        #: Page-aligned starts and lengths, what a file opened with O_DIRECT reads and writes
        #: (set before the first buffer when the inputs go on to a file).
        self.page_aligned = False

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
        if self.page_aligned:
            raw = self.host.allocate(_page_up(nbytes) + PAGE, transfer=True)
            start = (-raw.data_ptr()) % PAGE
            buf = raw[start: start + _page_up(nbytes)]
            booked = raw.numel()
        else:
            buf = self.host.allocate(nbytes, transfer=True)
            booked = buf.numel()
        with self._lock:
            self.total_bytes += booked
            total = self.total_bytes
        self.ledger.set_activation_host_bytes(total)
        return buf

    def release(self, buf: torch.Tensor, event: Any) -> None:
        with self._lock:
            self._free.append((buf, event))


class SavedInput:
    """One checkpointed input of one block use: on the device, on its way, or on the host."""

    __slots__ = ("store", "position", "shape", "dtype", "nbytes", "device_tensor", "d2h_event", "host",
                 "h2d_event", "disk_offset", "io", "__weakref__")

    def __init__(self, store: "ActivationStore", tensor: torch.Tensor, position: int) -> None:
        self.store = store
        self.position = position
        self.shape, self.dtype = tensor.shape, tensor.dtype
        self.nbytes = tensor.numel() * tensor.element_size()
        self.device_tensor: torch.Tensor | None = tensor  # held while on the device or being copied out
        self.d2h_event = None
        self.host: torch.Tensor | None = None  # uint8 [>= nbytes] host copy
        self.h2d_event = None  # the last copy back to the device
        self.disk_offset = -1  # its region of the checkpoint file, once written there
        self.io: list = []  # the file requests in flight on ``host`` (a write, or a read back)

    def __del__(self) -> None:
        store = self.store
        if self.device_tensor is not None:
            store.ledger.activation_free(self.nbytes)
        if self.host is not None:
            for request in self.io:  # the buffer goes back to the pool only once no request uses it
                request.exception()
            store.buffers.release(self.host, self.h2d_event)
        if self.disk_offset >= 0:
            store.disk.forget()


class CheckpointFile:
    """The scratch file of inputs beyond RAM ([Note: checkpoints beyond RAM]): page-aligned regions
    handed out in order, reused from the start once no input written in an earlier pass lives.
    Made (its directory under ``nvme_path``, then the file) at the first input it takes."""

    def __init__(self, root: str, ledger: MemoryLedger, io_threads: int) -> None:
        self.root = root
        self.ledger = ledger
        self.io_threads = io_threads
        self._directory: SwapDirectory | None = None
        self._file: StateFile | None = None
        self._end = 0  # bytes handed out
        self._live = 0  # inputs with a region (their SavedInput not collected yet)
        self._lock = threading.Lock()  # a SavedInput may be collected on autograd's device thread

    def region(self, nbytes: int) -> int:
        """The offset of a new region of ``nbytes`` (a page multiple); the file grows to hold it."""
        with self._lock:
            if self._live == 0:
                self._end = 0  # nothing written before lives: start over
            offset, self._end = self._end, self._end + nbytes
            self._live += 1
            end = self._end
        if self._file is None:
            self._directory = SwapDirectory(self.root)
            self._file = StateFile(self._directory.file("checkpoints"), 0, io_threads=self.io_threads,
                                   holds="the checkpointed activations")
        if end > self._file.nbytes:
            self._file.grow(max(end, 2 * self._file.nbytes))  # doubling: a pass grows it O(log) times
        self.ledger.set_activation_disk_bytes(end)
        return offset

    def forget(self) -> None:
        """An input with a region was collected."""
        with self._lock:
            self._live -= 1

    def submit(self, write: bool, buf: torch.Tensor, offset: int) -> list:
        return self._file.submit(write, buf, offset)

    def stop_threads(self) -> None:
        if self._file is not None:
            self._file.stop_threads()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._directory is not None:
            self._directory.remove()
            self._directory = None


def _wait(requests: list, what: str) -> None:
    for request in requests:
        err = request.exception()
        if err is not None:
            raise RuntimeError(f"stronghold: {what} of a checkpointed activation failed: {err!r}") from err


class ActivationStore:
    """The saved inputs of checkpointed blocks (see the module docstring)."""

    def __init__(self, *, transfer: TransferContext, ledger: MemoryLedger, host: HostAllocator, device: torch.device,
                 offload: OffloadActivations, on_disk: bool | Literal["auto"] = False, nvme_path: str | None = None,
                 io_threads: int = 4, host_reserve: int = 0) -> None:
        self.transfer = transfer
        self.ledger = ledger
        self.device = device
        self.requested = offload  # what the config asked for
        self.offload = offload  # True, False, or "auto" until the first checkpointed input decides
        self.buffers = _HostBuffers(host, ledger, transfer)
        # [Note: checkpoints beyond RAM]: True, False, or "auto" until the first offloaded input decides.
        self.on_disk = on_disk if nvme_path is not None else False
        self.host_reserve = host_reserve  # RAM "auto" leaves to the rest of the machine
        self.disk = CheckpointFile(nvme_path, ledger, io_threads) if nvme_path is not None else None
        self.buffers.page_aligned = self.on_disk is True
        if self.on_disk is True and offload == "auto":
            self.offload = True  # the file takes what is offloaded: offloading is asked for
        self._writing: list[SavedInput] = []  # inputs whose write to the file is in flight, oldest first
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
        # [Note: a saved tensor that is not contiguous] stays on the device and is not counted as
        # one that should have left: such an input is usually a view of a tensor every block is
        # handed (T5's and LongT5's position bias, a permuted [1, heads, s, s]), and a copy per
        # block on the host would hold it once per block instead of once.
        eligible = (self.offload and self._offload_here and saved.nbytes >= MIN_OFFLOAD_BYTES
                    and tensor.is_contiguous())
        self.eligible_this_pass += bool(eligible)
        if eligible:
            self.offloaded_this_pass += 1
            if self.on_disk == "auto":
                self.on_disk = self._decide_disk(saved.nbytes)
                self.buffers.page_aligned = self.on_disk
            saved.host = self.buffers.acquire(saved.nbytes)
            flat = tensor.detach().reshape(-1).view(torch.uint8)
            saved.d2h_event = self.transfer.copy_d2h(saved.host[: saved.nbytes], flat)
            self._leaving.append(saved)
            if not self.transfer.is_async:
                self._reap()
        return saved

    def send_to_disk(self) -> None:
        """The fit check's ``nvme_activations="auto"`` said the host cannot hold them (before the
        first forward: no buffer is made yet)."""
        if self.disk is not None:
            self.on_disk = True
            self.buffers.page_aligned = True

    def _decide_disk(self, nbytes: int) -> bool:
        available = available_host_bytes()
        projected = nbytes * self._num_blocks
        on = available is not None and projected > available - self.host_reserve
        logger.info("stronghold: nvme_activations=auto -> %s: checkpointed inputs %.2f GiB (%d blocks x %.1f MiB), "
                    "%s available to them on the host", on, projected / 2**30, self._num_blocks, nbytes / 2**20,
                    "unknown" if available is None else f"{(available - self.host_reserve) / 2**30:.2f} GiB")
        return on

    def _reap(self, wait: bool = False) -> None:
        """Lets go of device tensors whose copy to the host has landed (and, with the file, starts
        writing them there)."""
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
            if self.on_disk is True:
                self._write(saved)
        self._leaving = still

    # ------------------------------------------------------------------ the file
    def _write(self, saved: SavedInput) -> None:
        """Starts writing a landed input to the file; its host buffer is reused once the write is
        done (at most `DISK_RING` in flight: the oldest is waited for beyond that)."""
        size = _page_up(saved.nbytes)
        saved.disk_offset = self.disk.region(size)
        saved.io = self.disk.submit(True, saved.host[:size], saved.disk_offset)
        self._writing.append(saved)
        self._retire_writes(DISK_RING)

    def _retire_writes(self, keep: int) -> None:
        """Gives back the host buffers of finished writes; waits for the oldest ones beyond ``keep``."""
        still = []
        for k, saved in enumerate(self._writing):
            if saved.host is None or not saved.io:  # read back since, or collected
                continue
            if len(self._writing) - k > keep or all(r.done() for r in saved.io):
                _wait(saved.io, "writing")
                saved.io = []
                self.buffers.release(saved.host, None)
                saved.host = None
            else:
                still.append(saved)
        self._writing = still

    def _read(self, saved: SavedInput) -> None:
        """Starts reading an input back from the file into a host buffer (nothing if it is there)."""
        if saved.host is not None or saved.disk_offset < 0:
            return
        size = _page_up(saved.nbytes)
        saved.host = self.buffers.acquire(size)
        saved.io = self.disk.submit(False, saved.host[:size], saved.disk_offset)

    def _drop_device(self, saved: SavedInput) -> None:
        if saved.device_tensor is not None:
            saved.device_tensor = None
            self.ledger.activation_free(saved.nbytes)

    def end_forward(self) -> None:
        """The model's forward is over: every copy to the host lands before backward needs it."""
        self._reap(wait=True)

    # ------------------------------------------------------------------ backward
    def prefetch_before(self, position: int) -> None:
        """The block at ``position`` starts its backward: bring back the inputs of the one before
        (and, from the file, start reading those of the one before that)."""
        self._reap(wait=True)
        for ref in self._pass.get(position - 1, ()):
            saved = ref()
            if saved is not None and saved.device_tensor is None and (saved.host is not None or saved.disk_offset >= 0):
                self._fetch(saved)
        if self.on_disk is True:
            self._retire_writes(0)
            for ref in self._pass.get(position - 2, ()):
                saved = ref()
                if saved is not None and saved.device_tensor is None:
                    self._read(saved)

    def _fetch(self, saved: SavedInput) -> None:
        if saved.disk_offset >= 0:
            self._read(saved)
            _wait(saved.io, "reading back")
            saved.io = []
        flat = torch.empty(saved.nbytes, dtype=torch.uint8, device=self.device)
        saved.h2d_event = self.transfer.copy_h2d(flat, saved.host[: saved.nbytes], fetch=False)
        saved.device_tensor = flat.view(saved.dtype).view(saved.shape)
        self.ledger.activation_alloc(saved.nbytes)
        if saved.disk_offset >= 0:  # the file keeps it (a retained graph reads it again): the buffer is free
            self.buffers.release(saved.host, saved.h2d_event)
            saved.host = None

    def _unpack(self, saved):
        if not isinstance(saved, SavedInput):
            return saved
        if saved.device_tensor is None:  # not fetched ahead (out of order, or a second backward)
            self._reap(wait=True)
            self._fetch(saved)
        tensor = saved.device_tensor
        if saved.host is not None or saved.disk_offset >= 0:
            if saved.h2d_event is not None:
                self.transfer.device_wait(saved.h2d_event)
            # The recompute holds it from here; a second backward (retained graph) fetches again.
            self._drop_device(saved)
        return tensor

    def end_backward(self) -> None:
        self._pass.clear()

    def stop_threads(self) -> None:
        """Lets every write land and joins the file's I/O threads (a later request restarts them)."""
        self._retire_writes(0)
        if self.disk is not None:
            self.disk.stop_threads()

    def close(self) -> None:
        """Waits for the file's requests and removes it (engine.close)."""
        self._reap(wait=True)
        self._retire_writes(0)
        if self.disk is not None:
            self.disk.close()
