"""One unit: what it is, and its residency state machine with its device slot.

A *unit* is what moves between host and device together: a block (a transformer layer), a
large parameter group outside the blocks (an embedding, an LM head), or the rest unit
that gathers the small rest (``discovery.py``). All three have the same mechanics, below;
only the schedule (``schedule.py``) treats them differently, and a unit never calls it.

`Unit` owns the unit's identity (its parameters and their layout), its residency, with the
device *slot* it fills (one flat allocation whose storage is freed while the unit is on the
host; with sharded state a fetch all-gathers its trainable region from the ranks' shards), and
the use counts the schedule keeps on it. It composes two parts it drives but does not hold the
state of: its host memory (``unit_host.py``: the image a fetch copies, the masters, the
parameters' values between steps) and its gradients (``unit_grads.py``: the lane during
backward, the host gradient, what the step reads).

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
import operator

import torch
from .discovery import UnitSpec
from .distributed import DataParallel
from .ledger import MemoryLedger
from .memory import GRAD_ALIGN, BlockLayout, DeviceSlotPool, HostAllocator, element_size, layout_block, typed_view
from .fastpath import engine_access as _engine_access, profiled
from .read_guard import ReadGuard
from .transfer import FetchStaging, TransferContext
from .unit_grads import UnitGrads
from .unit_host import UnitHost

_grad = operator.attrgetter("grad")


class Residency(enum.Enum):
    ON_HOST = "on_host"
    FETCHING = "fetching"
    ON_DEVICE = "on_device"


class Unit:
    """One unit's identity and residency; the schedule (`WindowSchedule`) drives it."""

    def __init__(self, spec: UnitSpec, *, device: torch.device, param_dtype: torch.dtype | None,
                 host: HostAllocator, transfer: TransferContext, pool: DeviceSlotPool | None, ledger: MemoryLedger,
                 dp: DataParallel | None = None, grad_align: int = GRAD_ALIGN,
                 fetch_staging: FetchStaging | None = None, compute_grads: bool = False, disk_masters=None) -> None:
        self.index = spec.index
        self.fqn = spec.fqn
        self.kind = spec.kind
        self.module = spec.module  # a block's module (None outside the blocks)
        self.owners = spec.owners  # modules registering the parameters, with their local names
        # Each parameter's name in the model (a block's spec names them within the block).
        self.names = [f"{spec.fqn}.{name}" if spec.kind == "block" else name for name, _ in spec.params]
        self.params = [p for _, p in spec.params]
        self.device = device
        self.transfer = transfer
        self.pool = pool
        self.ledger = ledger
        self.dp = dp
        shards = dp.shards if dp is not None else 1
        # Sharded even in a group of one: the same code path (all-gather, reduce-scatter) runs.
        self.sharded = dp is not None and dp.sharded
        self.layout: BlockLayout = layout_block(spec.fqn, list(spec.params), param_dtype, shards, grad_align)
        lay = self.layout
        self.trainable = lay.grad_numel > 0  # the layout is fixed
        # The device dtype when it is not the parameters' own (param_dtype): the unit computes
        # under autocast only (the schedule checks it at each forward use).
        self.cast_dtype = next((e.device_dtype for e in lay.entries if e.device_dtype != e.stored_dtype), None)
        self.streamed = self.kind != "rest"  # moves through the window (the rest unit visits)
        self.read_guard = ReadGuard(self.params)  # reads between steps (read_guard.py)
        self.host = UnitHost(self.index, self.fqn, self.names, self.params, lay, host=host, transfer=transfer, dp=dp,
                             fetch_staging=fetch_staging, disk_masters=disk_masters)
        self.grads = UnitGrads(self.fqn, self.params, lay, pieces=self.host.pieces, masters=self.host.masters,
                               host=host, sharded=self.sharded, compute_grads=compute_grads,
                               read_guard=self.read_guard)
        # A read on the host must not see a placeholder: refused (a shard) or mapped (on disk).
        self.guard_on_host = self.sharded or self.host.masters_on_disk

        # ---- device slot: one flat allocation, storage freed while on the host. Allocated at
        # the first fetch that copies (`_allocate_slot`), not here: a unit read in vocabulary
        # pieces or aliasing the host never takes one, and a device never holds, even for a
        # moment, a unit larger than a block that will not cross whole.
        self._device = device
        self.slot_bytes = lay.slot_bytes
        self.slot = self.slot_trainable = self.slot_local = self._storage = None
        self.slot_views: list[torch.Tensor] = []
        # [Note: aliasing the host on a CPU device] When the compute device is the CPU itself
        # (synchronous copies) and this rank holds the whole unit, a fetch would copy host
        # memory into more host memory: the parameters then point at the image itself while
        # on the device (the bytes a fetch would have copied, in the compute dtype). The state
        # machine, the pool and the ledger run as on a GPU (the ledger books the slot as device
        # memory and the fetch as traffic); only the memcpy and the allocation are skipped.
        # The simulated GPU-like mode and CUDA copy for real.
        # Without a host image there is no compute-dtype copy to alias: the slot is real memory.
        self.alias_host = transfer.mode == "sync" and not self.sharded and self.host.fetch_staging is None
        self._alias_views = self.host.image_views if self.alias_host else None
        # fp32 compute on a CPU device: the image the parameters alias while on the device is the
        # masters' own memory, so fetch and evict leave the parameters' .data as it is.
        self._alias_is_host = self.alias_host and all(
            a is not None and a.data_ptr() == h.data_ptr() and a.dtype == h.dtype and a.shape == h.shape
            for a, h in zip(self._alias_views, self.host.param_views))

        self.state = Residency.ON_HOST
        self._h2d_events: list = []
        # A vocabulary-sized unit read in row pieces outside the window (vocab_pieces.py): it
        # stays ON_HOST, and that object is its device side.
        self.vocab_pieces = None
        # ---- use counting (driven by the schedule)
        self.forward_holds = 0  # forward calls of this block in progress (0 or 1, more when re-entered)
        self.backward_holds = 0  # uses whose backward started and is not done
        self.pending_backward = 0  # uses whose backward has not run yet
        self.backward_position = -1  # sequence position of the latest use whose backward started

    # ------------------------------------------------------------------ queries
    @property
    def holds(self) -> int:
        return self.forward_holds + self.backward_holds

    @property
    def holds_device_storage(self) -> bool:
        if self.alias_host:
            return self.state is not Residency.ON_HOST
        return self._storage is not None and self._storage.nbytes() > 0

    # ------------------------------------------------------------------ transitions
    def begin_fetch(self) -> None:
        assert self.state is Residency.ON_HOST, f"{self.fqn}: begin_fetch from {self.state}"
        with profiled("stronghold.fetch:", self.fqn), _engine_access():
            if self.read_guard.guarded:  # the schedule waited for its update: the parameters are read freely now
                self.read_guard.unguard()
            host = self.host
            host.adopt_host_writes()
            host.refresh_image()
            if self.pool is not None:  # the rest unit is outside the window's pool
                self.pool.acquire(self.index)
            self.ledger.device_alloc(self.slot_bytes)
            if self.alias_host:  # [Note: aliasing the host on a CPU device]
                self.transfer.book_h2d(self.slot_bytes, fetch=True)
                if not self._alias_is_host:
                    for p, view in zip(self.params, self._alias_views):
                        p.data = view
                self.state = Residency.FETCHING
                return
            if self._storage is None:
                self._allocate_slot()  # on the compute stream, like the resize: [Note: allocation stream]
            else:
                self._storage.resize_(self.slot_bytes)  # on the compute stream: [Note: allocation stream]
            events = []
            if host.image_trainable is not None:  # this rank's shard (everything, unsharded)
                events.append(self.transfer.copy_h2d(self.slot_local, host.image_trainable, fetch=True))
            elif host.fetch_staging is not None:  # no image: the masters (RAM or file), converted on the way
                events.append(host.fetch_staging.copy_converted(self.slot_local, host.convert_from,
                                                                self.layout.grad_dtype, fetch=True))
            if host.image_frozen is not None:
                events.append(self.transfer.copy_h2d(self.slot[self.layout.frozen_offset :], host.image_frozen,
                                                     fetch=not events))
            self._h2d_events = events
            for p, view in zip(self.params, self.slot_views):
                p.data = view
        self.state = Residency.FETCHING

    def _allocate_slot(self) -> None:
        """The slot and its views, at the first fetch that copies; later fetches resize its storage."""
        lay = self.layout
        S, lo = lay.shard_numel, self.host.shard_lo
        c = element_size(lay.grad_dtype) if lay.grad_dtype is not None else 0
        self.slot = torch.empty(self.slot_bytes, dtype=torch.uint8, device=self._device)
        self.slot_views = [typed_view(self.slot, e.byte_offset, e.numel, e.device_dtype, e.shape) for e in lay.entries]
        self.slot_trainable = self.slot[: lay.trainable_bytes]  # uint8: the region the ranks all-gather
        self.slot_local = self.slot_trainable[lo * c : (lo + S) * c]  # this rank's shard
        self._storage = self.slot.untyped_storage()

    def _wait_copies(self) -> None:
        for event in self._h2d_events:
            self.transfer.device_wait(event)
        self._h2d_events = []

    def wait_resident(self) -> None:
        """The block is needed now: its copies landed and, with sharded state, the ranks' shards
        are all-gathered. Called only where every rank uses the block ([Note: collective order])."""
        if self.state is Residency.FETCHING:
            self._wait_copies()
            if self.sharded and self.layout.shard_numel:
                with profiled("stronghold.all_gather:", self.fqn):
                    self.dp.all_gather_(self.slot_trainable, self.slot_local)
            self.state = Residency.ON_DEVICE
        assert self.state is Residency.ON_DEVICE, f"{self.fqn}: wait_resident from {self.state}"

    def evict(self) -> None:
        """Frees the slot; the parameters point at their host memory again."""
        assert self.state is not Residency.ON_HOST, f"{self.fqn}: evict from {self.state}"
        assert self.holds == 0, f"{self.fqn}: evict while held ({self.holds})"
        assert self.grads.grad_buffer is None, f"{self.fqn}: evict with a gradient buffer still attached"
        if self.state is Residency.FETCHING:
            self._wait_copies()  # the copies must land before their destination is freed (no gather)
        if not self.alias_host:
            self._storage.resize_(0)
        self.ledger.device_free(self.slot_bytes)
        if self.pool is not None:
            self.pool.release(self.index)
        with _engine_access():
            if not self._alias_is_host:
                for p, view in zip(self.params, self.host.param_views):
                    p.data = view
            self.host.record_versions()
        self.state = Residency.ON_HOST
        if self.guard_on_host:
            self.read_guard.guard()  # a read must not see the placeholder: refused (a shard) or mapped (on disk)

    # ------------------------------------------------------------------ teardown
    def restore_parameters(self, device: torch.device, values: list[torch.Tensor]) -> None:
        """Gives each parameter an ordinary tensor of its stored dtype on ``device`` (engine.close),
        keeping its exposed ``.grad``."""
        assert self.state is Residency.ON_HOST and self.grads.grad_buffer is None
        with _engine_access():
            grads = list(map(_grad, self.params)) if self.grads.exposes_grads else [None] * len(self.params)
        self.host.restore(device, values, grads)


OffloadedBlock = Unit  # a block is a unit; the old name stays for readers of older notes
