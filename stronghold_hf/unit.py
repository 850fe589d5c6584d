"""One unit: its host buffers, its device slot, and its residency state machine.

A *unit* is what moves between host and device together: a block (a transformer layer), a
large parameter group outside the blocks (an embedding, an LM head), or the resident unit
that gathers the small rest (``discovery.py``). All three have the same mechanics, below;
only the schedule (``schedule.py``) treats them differently, and a unit never calls it.

Host side (``memory.py`` explains the bytes and the layout): the *image*, what fetches copy
to the device slot: this rank's shard of the trainable region in the compute dtype, and the
frozen region; fp32 *masters* of this rank's shard of the trainable parameters (views into the
image when the device computes in fp32, a separate flat buffer otherwise); fp32 *gradients*
of the same shard. Without data parallelism (or with replicated CPU state) the shard is the
whole region. Device side: one flat *slot* whose storage is freed while the block is on the
host; with sharded state a fetch all-gathers its trainable region from the ranks' shards.

[Note: parameters always point at real memory] A block parameter's ``.data`` is a view into
the slot while the block is on the device, and a view into its host master (trainable) or
its stored bytes (frozen) while it is not. (With *sharded* CPU state no rank holds a whole
trainable parameter between steps: it is then a placeholder of the right shape whose every
element is one NaN (reads are visibly invalid, in-place writes raise, nothing touches freed
memory); ``engine.full_state_dict()`` gathers the values, see window.py.) So between steps every parameter holds its
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

import collections
import enum
import functools
import itertools
import logging
import operator

import torch
from torch import nn
from .discovery import UnitSpec
from .distributed import DataParallel
from .ledger import MemoryLedger
from . import nvme, read_guard
from .memory import (GRAD_ALIGN, BlockLayout, DeviceSlotPool, HostAllocator, element_size, is_placeholder, layout_block,
                     placeholder, typed_view)
from .fastpath import engine_access as _engine_access, engine_method, host_copy_, no_grad, profiled
from .transfer import FetchStaging, TransferContext

logger = logging.getLogger("stronghold_hf")


_data_ptr = operator.methodcaller("data_ptr")
_version = operator.attrgetter("_version")
_grad = operator.attrgetter("grad")
_second = operator.itemgetter(1)


def _set_grads(tensors, grads) -> None:
    """``t.grad = g`` for each pair, the loop in C (``grads``: a list, or ``repeat(None)``)."""
    collections.deque(map(setattr, tensors, itertools.repeat("grad"), grads), maxlen=0)


def _all_are(xs, ys) -> bool:
    return all(map(operator.is_, xs, ys))

_GEOMETRIES: dict[tuple, int] = {}


def _geometry_key(geometry: tuple) -> int:
    """Interns a gradient geometry: equal geometries get the same small integer."""
    return _GEOMETRIES.setdefault(geometry, len(_GEOMETRIES))


class Residency(enum.Enum):
    ON_HOST = "on_host"
    FETCHING = "fetching"
    ON_DEVICE = "on_device"


class Unit:
    """Buffers and residency of one unit; the schedule (`WindowSchedule`) drives it."""

    def __init__(self, spec: UnitSpec, *, device: torch.device, param_dtype: torch.dtype | None,
                 host: HostAllocator, transfer: TransferContext, pool: DeviceSlotPool | None, ledger: MemoryLedger,
                 dp: DataParallel | None = None, grad_align: int = GRAD_ALIGN,
                 fetch_staging: FetchStaging | None = None, compute_grads: bool = False, disk_masters=None) -> None:
        self.index = spec.index
        self.fqn = spec.fqn
        self.kind = spec.kind
        self.module = spec.module  # a block's module (None outside the blocks)
        self.owners = spec.owners  # modules registering the parameters, with their local names
        self.names = [name for name, _ in spec.params]
        self.params: list[nn.Parameter] = [p for _, p in spec.params]
        self.device = device
        self.transfer = transfer
        self.pool = pool
        self.ledger = ledger
        self.dp = dp
        shards, rank = (dp.shards, dp.shard_rank) if dp is not None else (1, 0)
        # Sharded even in a group of one: the same code path (all-gather, reduce-scatter) runs.
        self.sharded = dp is not None and dp.sharded
        self.layout: BlockLayout = layout_block(spec.fqn, list(spec.params), param_dtype, shards, grad_align)
        lay = self.layout
        S = lay.shard_numel
        self.shard_lo = rank * S  # this rank's shard of the trainable region: [shard_lo, shard_lo + S)

        # ---- host buffers (pinned when allowed: what fetches copy; pageable: the rest)
        c = element_size(lay.grad_dtype) if lay.grad_dtype is not None else 0
        # [Note: masters on disk] With nvme_masters the fp32 masters live in a file (nvme.py,
        # `DiskMasters`) from here on: no master_flat in RAM, no image; a fetch reads them and
        # converts them through the staging ring, an update binds them into the NVMe tier's ring
        # with its moments, and between updates a master (and a parameter on the host) is a
        # placeholder of the right shape. A read between steps maps the file (`materialize`).
        self.disk_masters = disk_masters if S else None
        self.masters_on_disk = self.disk_masters is not None
        # Without a host image (host_image=False) a fetch converts the masters through the
        # staging ring instead; with fp32 compute the masters are the image and it always
        # exists, unless they are on disk.
        self.fetch_staging = fetch_staging if S and (not lay.masters_in_image or self.masters_on_disk) else None
        keeps_image = S and self.fetch_staging is None
        self.image_trainable = host.allocate(S * c, transfer=True) if keeps_image else None  # uint8 [S * c]
        self.image_frozen = host.allocate(lay.frozen_bytes, transfer=True) if lay.frozen_bytes else None
        if self.masters_on_disk:
            self.master_flat = torch.empty(S, dtype=torch.float32)  # the initial values, written below, then dropped
        elif S and lay.masters_in_image:
            self.master_flat = self.image_trainable.view(torch.float32)  # fp32 [S]: the image is the master
        else:
            self.master_flat = host.allocate(4 * S, transfer=False).view(torch.float32) if S else None
        # [Note: host gradients in the compute dtype] With bf16 compute and host_grads allowing
        # it, the host gradient is bf16 [S]: what the device sends, exactly, at half the bytes.
        # The first write that bf16 cannot hold exactly (an accumulation, a gradient set by
        # hand) widens it to fp32 [S] for good (`_widen_grads`), so sums are fp32's.
        self._host = host
        grad_dtype = torch.bfloat16 if compute_grads and lay.grad_dtype == torch.bfloat16 else torch.float32
        self.grad_flat = host.allocate(element_size(grad_dtype) * S, transfer=False).view(grad_dtype) if S else None
        shard_image = self.image_trainable.view(lay.grad_dtype) if keeps_image else None  # [S] compute dtype
        # Per parameter: the piece of it this rank keeps, (offset in the parameter, offset in the
        # shard, length); the whole parameter unless the state is sharded.
        self.pieces: list[tuple[int, int, int] | None] = []
        self.masters: list[nn.Parameter | None] = []  # what CPU Adam steps (the piece, fp32)
        self.image_views: list[torch.Tensor | None] = []  # its compute-dtype image (copy-out target), if kept
        self.grad_views: list[torch.Tensor | None] = []  # its host gradient (fp32, or bf16: see above)
        self.host_views: list[torch.Tensor] = []  # what the parameter's .data is while on the host
        with torch.no_grad():
            for e, p in zip(lay.entries, self.params):
                if not e.trainable:
                    view = typed_view(self.image_frozen, e.byte_offset - lay.frozen_offset, e.numel, e.device_dtype,
                                      e.shape)
                    view.copy_(p.detach())
                    self.pieces.append(None)
                    self.masters.append(None)
                    self.image_views.append(view)
                    self.grad_views.append(None)
                    self.host_views.append(view)
                    continue
                lo = max(e.grad_offset, self.shard_lo)
                hi = min(e.grad_offset + e.numel, self.shard_lo + S)
                if hi <= lo:  # none of this parameter in this rank's shard
                    self.pieces.append(None)
                    self.masters.append(None)
                    self.image_views.append(None)
                    self.grad_views.append(None)
                else:
                    piece = (lo - e.grad_offset, lo - self.shard_lo, hi - lo)
                    shape = e.shape if not self.sharded else torch.Size([hi - lo])
                    master = self.master_flat[piece[1] : piece[1] + piece[2]].view(shape)
                    master.copy_(p.detach().reshape(-1)[piece[0] : piece[0] + piece[2]].view(shape))
                    image = shard_image[piece[1] : piece[1] + piece[2]].view(shape) if keeps_image else None
                    if image is not None and image.data_ptr() != master.data_ptr():
                        image.copy_(master)
                    self.pieces.append(piece)
                    if self.masters_on_disk:
                        master = placeholder(shape)
                    self.masters.append(nn.Parameter(master, requires_grad=True))
                    if grad_dtype != torch.float32:  # .grad is the bf16 host gradient on fp32 values
                        self.masters[-1].grad_dtype = None
                        p.grad_dtype = None
                    self.image_views.append(image)
                    self.grad_views.append(self.grad_flat[piece[1] : piece[1] + piece[2]].view(shape))
                if self.sharded or self.masters_on_disk:  # nothing in RAM holds the whole parameter
                    self.host_views.append(placeholder(e.shape))
                else:
                    self.host_views.append(self.masters[-1].data)
        if self.masters_on_disk:
            self.disk_masters.write_file(self.index, 0, self.master_flat)
            self.master_flat = None
            self.master_source = nvme.UnitMasters(self.disk_masters, self.index, S)
        self._materialized: dict[int, tuple[int, int]] = {}  # k -> (mapped value's address, version): materialize
        # ---- device slot: one flat allocation, storage freed while on the host
        self.slot = torch.empty(lay.slot_bytes, dtype=torch.uint8, device=device)
        self.slot_views = [typed_view(self.slot, e.byte_offset, e.numel, e.device_dtype, e.shape) for e in lay.entries]
        self.slot_trainable = self.slot[: lay.trainable_bytes]  # uint8: the region the ranks all-gather
        self.slot_local = self.slot_trainable[self.shard_lo * c : (self.shard_lo + S) * c]  # this rank's shard
        self._storage = self.slot.untyped_storage()
        self.slot_bytes = self._storage.nbytes()
        self._storage.resize_(0)
        # [Note: aliasing the host on a CPU device] When the compute device is the CPU itself
        # (synchronous copies) and this rank holds the whole unit, a fetch would copy host
        # memory into more host memory: the parameters then point at the image itself while
        # "resident" (the bytes a fetch would have copied, in the compute dtype). The state
        # machine, the pool and the ledger run as on a GPU (the ledger books the slot as device
        # memory and the fetch as traffic); only the memcpy and the allocation are skipped.
        # The simulated GPU-like mode and CUDA copy for real.
        # Without a host image there is no compute-dtype copy to alias: the slot is real memory.
        self.alias_host = transfer.mode == "sync" and not self.sharded and self.fetch_staging is None
        self._alias_views = self.image_views if self.alias_host else None
        with _engine_access():
            for p, view in zip(self.params, self.host_views):
                p.data = view
        self._host_ptrs = [v.data_ptr() for v in self.host_views]
        # fp32 compute on a CPU device: the image the parameters alias while "resident" is the
        # masters' own memory, so fetch and evict leave the parameters' .data as it is.
        self._alias_is_host = self.alias_host and all(
            a is not None and a.data_ptr() == h.data_ptr() and a.dtype == h.dtype and a.shape == h.shape
            for a, h in zip(self._alias_views, self.host_views))
        self._record_host_state()
        self.master_index = {id(m): k for k, m in enumerate(self.masters) if m is not None}
        # Whether `guard` may have switched the parameters' class (read_guard.py); the engine's
        # own reads turn the guard off only then (fastpath.engine_method).
        self.guarded = False
        self._has_frozen_pieces = any(gv is None for gv in self.grad_views)
        # The trainable pieces this rank keeps, as parallel lists: the per-step gradient
        # bookkeeping reads and writes them with loops in C (`_set_grads`, `_all_are`).
        self._local = [k for k, gv in enumerate(self.grad_views) if gv is not None]
        self._refresh_grad_lists()
        self._n_local = sum(piece is not None for piece in self.pieces)  # parameters this rank keeps a piece of
        self.trainable = self.layout.grad_numel > 0  # the layout is fixed
        self.streamed = self.kind != "resident"  # moves through the window (the resident unit visits)

        self.state = Residency.ON_HOST
        self._h2d_events: list = []
        self.image_stale = False  # the compute-dtype image lags the masters (refresh before a fetch)
        # ---- use counting (driven by the engine)
        self.forward_holds = 0  # forward calls of this block in progress (0 or 1, more when re-entered)
        self.backward_holds = 0  # uses whose backward started and is not done
        self.pending_backward = 0  # uses whose backward has not run yet
        self.backward_position = -1  # sequence position of the latest use whose backward started
        # ---- gradients
        # The device gradient buffer while the unit has one (a lane of the gradient queue, handed
        # down by the schedule as a plain tensor): [padded trainable numel] in the grad dtype.
        self.grad_buffer: torch.Tensor | None = None
        self._lane_views: list[torch.Tensor | None] | None = None  # each trainable parameter's part of it
        self._lane_accumulates = False
        self.grad_valid = [False] * len(self.params)  # the host gradient holds a value (exposed as .grad)
        self.flushes = 0  # flushes folded into the host gradient since it was last empty
        self.device_norm: torch.Tensor | None = None  # valid while the host grad is one untouched flush
        self._exposed_grad_versions: list[int] = []
        self.taken_grads = False  # this backward already took the exposed gradients from the user
        # With sharded state no rank holds whole gradients, so .grad is not exposed between
        # steps; the engine's own flags say what is accumulated (cleared by the step or zero_grad).
        self.exposes_grads = not self.sharded
        self.valid_at_pass_start = list(self.grad_valid)  # to roll back a backward that raised
        self.flushes_this_pass = 0
        self.grads_poisoned = False  # a failed backward added into accumulated gradients
        # ---- speculation (speculation.py), driven by the step coordinator
        self.spec = None  # SpecRecord of a speculative update no step has validated yet
        self.spec_blocked = False  # no speculation for this block until the next step
        self.loaded_keys: list[str] = []  # sharded load_state_dict: keys the pre-hook took (state_dict.py)

    # ------------------------------------------------------------------ queries
    @property
    def holds(self) -> int:
        return self.forward_holds + self.backward_holds

    @property
    def holds_device_storage(self) -> bool:
        if self.alias_host:
            return self.state is not Residency.ON_HOST
        return self._storage.nbytes() > 0

    def master_of(self, param: nn.Parameter) -> nn.Parameter | None:
        """The fp32 master (this rank's piece) of ``param``; None if frozen or kept by another rank."""
        for p, m in zip(self.params, self.masters):
            if p is param:
                return m
        raise KeyError(param)

    def is_trainable_param(self, param: nn.Parameter) -> bool:
        return any(p is param and e.trainable for p, e in zip(self.params, self.layout.entries))

    # ------------------------------------------------------------------ host state
    def _record_host_state(self) -> None:
        """What the parameters are as they go to the host: their versions (a later in-place
        write bumps one) next to the host memory they point at (``_host_ptrs``)."""
        self._host_versions = list(map(_version, self.params))

    def adopt_host_writes(self) -> bool:
        """Takes in writes made to the parameters while on the host; True if any trainable changed.

        See [Note: parameters always point at real memory]. A ``.data`` that was replaced
        (``p.data = t``) is copied into the master (this rank's piece of it, when sharded); an
        in-place write to our view shows as a bumped version counter (writes through a ``.data``
        alias do not: with bf16/fp16 compute call ``engine.mark_parameters_changed()``)."""
        with _engine_access():
            # The usual case, two reads per parameter in C: still pointing at its host view,
            # not written in place since the unit left the device. (A ``.data`` replaced by a
            # view of the same host memory in another shape is not seen here.)
            params = self.params
            if (not self._materialized and list(map(_data_ptr, params)) == self._host_ptrs
                    and list(map(_version, params)) == self._host_versions):
                return False
        return self._adopt_host_writes()

    def _adopt_host_writes(self) -> bool:
        changed = False
        with torch.no_grad(), _engine_access():
            for k, (p, view) in enumerate(zip(self.params, self.host_views)):
                data = p.data
                mapped = self._materialized.pop(k, None)
                if mapped is not None and data.data_ptr() == mapped[0] and p._version == mapped[1]:
                    p.data = view  # read between steps, not written: the file is current
                    continue
                if data.data_ptr() != view.data_ptr() or data.dtype != view.dtype or data.shape != view.shape or (
                        data.device != view.device):
                    if data.shape != view.shape:
                        raise ValueError(
                            f"stronghold: parameter {self.fqn}.{self.names[k]} was given shape {tuple(data.shape)}, "
                            f"its block was laid out for {tuple(view.shape)}. Change shapes before offload_model, or "
                            "close the engine first (engine.close())."
                        )
                    self._write_host_value(k, data)
                    p.data = view
                    changed |= self.layout.entries[k].trainable
                elif p._version != self._host_versions[k]:
                    changed |= self.layout.entries[k].trainable
        if changed and self.image_trainable is not None and not self.layout.masters_in_image:
            self.image_stale = True
        return changed

    def _write_host_value(self, k: int, value: torch.Tensor) -> None:
        """Writes a full value of parameter ``k`` into what this rank keeps of it."""
        view, piece = self.host_views[k], self.pieces[k]
        if self.masters_on_disk and piece is not None:
            self.disk_masters.write(self.index, piece[1], value.reshape(-1)[piece[0] : piece[0] + piece[2]])
        elif not is_placeholder(view):
            view.copy_(value)
        elif piece is not None:
            self.masters[k].data.copy_(value.reshape(-1)[piece[0] : piece[0] + piece[2]].view_as(self.masters[k]))

    def materialize(self) -> None:
        """Masters on disk, unsharded, on the host: each trainable parameter's ``.data`` becomes
        its current value, mapped copy-on-write from the file, so a read between steps sees it
        (no RAM of its own). A write to it (in place, or ``.data = t``) is taken into the file
        at the next fetch (`adopt_host_writes`); unwritten, the map is just dropped there."""
        assert self.masters_on_disk and not self.sharded and self.state is Residency.ON_HOST
        flat = self.disk_masters.map(self.index)
        with _engine_access():
            for k, (p, piece) in enumerate(zip(self.params, self.pieces)):
                if piece is None or p.data.data_ptr() != self.host_views[k].data_ptr():
                    continue  # frozen, or already given another value
                value = flat[piece[1] : piece[1] + piece[2]].view(self.host_views[k].shape)
                p.data = value
                self._materialized[k] = (value.data_ptr(), p._version)

    @property
    def image_stale(self) -> bool:
        """The compute-dtype image lags the masters: refresh it before a fetch reads it."""
        return self._image_stale

    @image_stale.setter
    def image_stale(self, stale: bool) -> None:
        self._image_stale = stale
        self.image_undone = None  # a lag of any other cause: only a refresh clears it

    def image_lags_undo(self, params) -> None:
        """An undone speculative update left the image of ``params`` (indices) behind the
        masters. Until anything else makes it stale, a step that writes those images through
        its copy-out clears the lag (`image_rewritten`), so a redo costs no refresh."""
        fresh = not self._image_stale
        self.image_stale = True
        self.image_undone = frozenset(params) if fresh else None

    def image_rewritten(self, params) -> None:
        """A CPU Adam step wrote the image of ``params`` (its copy-out) along with the masters."""
        if self._image_stale and self.image_undone is not None and self.image_undone <= set(params):
            self.image_stale = False

    def refresh_image(self) -> None:
        """Re-derives the compute-dtype image of trainable parameters from the fp32 masters."""
        if not self.image_stale:
            return
        self.transfer.stats.add("image_refreshes", 1)  # a conversion pass on the fetching thread
        with torch.no_grad():
            for e, img, master in zip(self.layout.entries, self.image_views, self.masters):
                if e.trainable and img is not None and master is not None and img.data_ptr() != master.data_ptr():
                    img.copy_(master)  # fp32 -> compute dtype
        self.image_stale = False

    # ------------------------------------------------------------------ reads between steps
    def guard(self) -> None:
        """Reads of the parameters run the unit's read barrier first (read_guard.py): its update
        is in flight, a speculative update is not validated, or this rank holds only a shard."""
        read_guard.guard(self.params)
        self.guarded = True

    def unguard(self) -> None:
        if self.guarded:
            read_guard.unguard(self.params)
            self.guarded = False

    # ------------------------------------------------------------------ transitions
    def begin_fetch(self) -> None:
        assert self.state is Residency.ON_HOST, f"{self.fqn}: begin_fetch from {self.state}"
        with profiled("stronghold.fetch:", self.fqn), _engine_access():
            self.unguard()  # the schedule waited for its update: the parameters are read freely now
            self.adopt_host_writes()
            self.refresh_image()
            if self.pool is not None:  # the resident unit is outside the window's pool
                self.pool.acquire(self.index)
            self.ledger.device_alloc(self.slot_bytes)
            if self.alias_host:  # [Note: aliasing the host on a CPU device]
                self.transfer.book_h2d(self.slot_bytes, fetch=True)
                if not self._alias_is_host:
                    for p, view in zip(self.params, self._alias_views):
                        p.data = view
                self.state = Residency.FETCHING
                return
            self._storage.resize_(self.slot_bytes)  # on the compute stream: [Note: allocation stream]
            events = []
            if self.image_trainable is not None:  # this rank's shard (everything, unsharded)
                events.append(self.transfer.copy_h2d(self.slot_local, self.image_trainable, fetch=True))
            elif self.fetch_staging is not None:  # no image: the masters, converted on the way
                source = self.master_source if self.masters_on_disk else self.master_flat
                events.append(self.fetch_staging.copy_converted(self.slot_local, source, self.layout.grad_dtype,
                                                                fetch=True))
            if self.image_frozen is not None:
                events.append(self.transfer.copy_h2d(self.slot[self.layout.frozen_offset :], self.image_frozen,
                                                     fetch=not events))
            self._h2d_events = events
            for p, view in zip(self.params, self.slot_views):
                p.data = view
        self.state = Residency.FETCHING

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
        assert self.grad_buffer is None, f"{self.fqn}: evict with a gradient buffer still attached"
        if self.state is Residency.FETCHING:
            self._wait_copies()  # the copies must land before their destination is freed (no gather)
        if not self.alias_host:
            self._storage.resize_(0)
        self.ledger.device_free(self.slot_bytes)
        if self.pool is not None:
            self.pool.release(self.index)
        with _engine_access():
            if not self._alias_is_host:
                for p, view in zip(self.params, self.host_views):
                    p.data = view
            self._record_host_state()
        self.state = Residency.ON_HOST
        if self.sharded or self.masters_on_disk:
            self.guard()  # a read must not see the placeholder: refused (a shard) or mapped (on disk)

    # ------------------------------------------------------------------ gradients
    def _refresh_grad_lists(self) -> None:
        local = self._local
        self._lp = [self.params[k] for k in local]
        self._lm = [self.masters[k] for k in local]
        self._lg = [self.grad_views[k] for k in local]

    def _all_valid(self) -> bool:
        return all(map(self.grad_valid.__getitem__, self._local))

    def _set_valid(self, value: bool) -> None:
        valid = self.grad_valid
        for k in self._local:
            valid[k] = value

    @engine_method
    def take_exposed_grads(self) -> None:
        """Reads what the user left in ``.grad`` between steps: the source of truth for accumulation.

        ``model.zero_grad()`` sets it to None (the next flush overwrites); our host view
        means "accumulate onto it"; any other tensor is copied in first. With sharded state
        nothing is exposed and the engine's own flags stand."""
        if self.taken_grads:
            return
        self._check_not_poisoned()
        self.taken_grads = True
        if self.exposes_grads:
            grads = list(map(_grad, self._lp))
            if _all_are(grads, self._lg):  # the exposed host gradients, untouched: accumulate onto them
                self._set_valid(True)
            elif _all_are(grads, itertools.repeat(None)):  # zeroed (set to None)
                self._set_valid(False)
            else:
                with no_grad():
                    for k, gv, g in zip(self._local, self._lg, grads):
                        if g is None:
                            self.grad_valid[k] = False
                        elif g is gv:
                            self.grad_valid[k] = True
                        else:
                            self._host_grad_for(k, g).copy_(g)
                            self.grad_valid[k] = True
            _set_grads(self._lp, itertools.repeat(None))
        if not any(self.grad_valid):
            self.flushes = 0
            self.device_norm = None
        elif not self._exposed_unchanged():
            self.device_norm = None
        self._exposed_grad_versions = []  # the engine owns the gradients until the next exposure

    def _check_not_poisoned(self) -> None:
        if not self.grads_poisoned:
            return
        if not any(self.grad_valid) or (self.exposes_grads and all(
                p.grad is None for p, gv in zip(self.params, self.grad_views) if gv is not None)):
            self.grads_poisoned = False  # the user zeroed them: nothing partial is left
            return
        raise RuntimeError(
            f"stronghold: a backward pass raised after adding part of its gradients into the accumulated gradients "
            f"of {self.fqn}; they can no longer be separated. Call optimizer.zero_grad() (or model.zero_grad()) and "
            "redo the gradient-accumulation window."
        )

    def _exposed_unchanged(self) -> bool:
        if not self.exposes_grads:
            return True  # nobody else holds the host gradients
        return bool(self._exposed_grad_versions) and self._grad_versions() == self._exposed_grad_versions

    def _grad_versions(self) -> list[int]:
        """The version of each trainable piece's host gradient (0 for the others)."""
        views = self.grad_views
        return [0 if gv is None else gv._version for gv in views] if self._has_frozen_pieces else list(
            map(_version, views))

    @property
    def has_grad_buffer(self) -> bool:
        return self.grad_buffer is not None

    @functools.cached_property
    def grad_geometry(self) -> tuple[tuple[torch.Size, tuple[int, ...], int] | None, ...]:
        """Per parameter, ``(shape, contiguous strides, element offset)`` of its gradient in the
        gradient layout (None: frozen). The layout is fixed, so it is worked out once; a lane
        keeps the views it makes from it (grads.py, `GradLane.views`)."""
        out = []
        for e in self.layout.entries:
            if not e.trainable:
                out.append(None)
                continue
            strides, step = [], 1
            for size in reversed(e.shape):
                strides.append(step)
                step *= size
            out.append((e.shape, tuple(reversed(strides)), e.grad_offset))
        return tuple(out)

    @functools.cached_property
    def grad_geometry_key(self) -> int:
        """A small integer naming `grad_geometry` (with the gradient dtype and length): units with
        the same one (every block of a uniform stack) share a lane's cached views."""
        return _geometry_key((self.layout.grad_dtype, self.layout.padded_grad_numel, self.grad_geometry))

    @functools.cached_property
    def _trainable_indices(self) -> tuple[int, ...]:
        return tuple(k for k, e in enumerate(self.layout.entries) if e.trainable)

    @functools.cached_property
    def _tparams(self) -> list[nn.Parameter]:
        return [self.params[k] for k in self._trainable_indices]

    def attach_grad_buffer(self, buffer: torch.Tensor, views: list[torch.Tensor | None], *,
                           accumulate: bool = False, late: bool = False) -> None:
        """Gives the unit a lane for this backward use: ``buffer`` (in the gradient layout) and
        ``views``, each trainable parameter's part of it. ``.grad`` stays None, so autograd
        *steals* each gradient as plain training does (no zeroed buffer to add into);
        `collect_into_buffer` moves them in when the use is done. ``accumulate``: the lane holds
        a partial sum already (a parked lane, schedule.py) and gradients add onto it. ``late``:
        the lane takes gradients that arrived after the unit left the device (`late_gradients`)."""
        assert self.grad_buffer is None and (late or self.state is Residency.ON_DEVICE), \
            f"{self.fqn}: attach in {self.state}"
        self.grad_buffer = buffer
        self._lane_views = views
        self._lane_accumulates = accumulate

    @engine_method
    def collect_into_buffer(self) -> list[int]:
        """Moves the gradients autograd produced since `attach_grad_buffer` into the lane, in one
        fused copy (an add onto a partial sum), and clears ``.grad``; returns the indices of the
        parameters that received one. Parameters that received none read as zeros in the lane
        (its padding stays zero: grads.py, [Note: a clean lane])."""
        assert self.grad_buffer is not None
        params, views = self.params, self._lane_views
        touched, srcs, dsts = [], [], []
        for k in self._trainable_indices:
            p = params[k]
            g = p.grad
            if g is not None:
                touched.append(k)
                srcs.append(g)
                dsts.append(views[k])
                p.grad = None
        with no_grad():
            if self._lane_accumulates:
                for dst, g in zip(dsts, srcs):  # rare (a unit used twice): devices and dtypes may differ
                    dst.add_(g.to(device=dst.device, dtype=dst.dtype))
            else:
                if len(touched) < len(self._trainable_indices):
                    missing = [views[k] for k in self._trainable_indices if k not in touched]
                    torch._foreach_zero_(missing)
                if dsts:
                    torch._foreach_copy_(dsts, srcs)
        self._lane_views = None
        return touched

    @engine_method
    def late_gradients(self) -> list[int]:
        """Trainable parameters with a gradient the engine has not taken in: autograd made it
        after the unit left the device (T5's relative bias, used by every later block)."""
        grads = list(map(_grad, self._tparams))
        if _all_are(grads, itertools.repeat(None)):
            return []
        return [k for k, g in zip(self._trainable_indices, grads) if g is not None and g is not self.grad_views[k]]

    @engine_method
    def drop_lane_gradients(self) -> None:
        """Forgets the gradients of this use (a backward that raised): ``.grad`` back to None."""
        for k in self._trainable_indices:
            self.params[k].grad = None
        self._lane_views = None

    def detach_grad_buffer(self) -> torch.Tensor:
        """Gives the buffer back (after `collect_into_buffer`); the schedule flushes or drops it."""
        buffer, self.grad_buffer = self.grad_buffer, None
        return buffer

    def local_params(self, touched: list[int]) -> list[int]:
        """Of ``touched``, the parameters this rank keeps a piece of."""
        return [k for k in touched if self.pieces[k] is not None]

    def fold(self, flush, touched: list[int], accumulate: list[bool]) -> None:
        """Worker thread: adds (or copies) the flushed shard of the gradient into the host
        gradient, piece by piece as ``flush.landed()`` (grads.py) yields them.

        The flush is this rank's shard of the gradient layout (the whole layout, unsharded)."""
        if self.grad_flat.dtype != torch.float32 and (any(accumulate) or flush.dtype != self.grad_flat.dtype):
            self._widen_grads("its gradient was accumulated")
        whole = len(touched) == self._n_local and len(set(accumulate)) <= 1  # the usual case: one flat pass
        grad_flat = self.grad_flat
        for lo, staged in flush.landed():
            hi = lo + staged.numel()
            if whole:
                # [Note: torch calls on the host worker] Each torch call lets go of the GIL, and
                # the training thread, which launches the kernels, then waits to get it back:
                # the whole flat gradient is written without slicing it first.
                dst = grad_flat if lo == 0 and hi == grad_flat.numel() else grad_flat[lo:hi]
                if accumulate and accumulate[0]:
                    dst.add_(staged)
                else:
                    host_copy_(dst, staged)
                continue
            for k, acc in zip(touched, accumulate):
                _, at, n = self.pieces[k]
                a, b = max(at, lo), min(at + n, hi)
                if a >= b:
                    continue
                src, dst = staged[a - lo: b - lo], self.grad_flat[a:b]
                if acc:
                    dst.add_(src)
                else:
                    dst.copy_(src)

    @engine_method
    def expose_grads(self) -> None:
        """After a backward: the masters' (and, unsharded, the parameters') ``.grad`` are the
        host gradients, or None."""
        valid = self.grad_valid
        grads = self._lg if self._all_valid() else [gv if valid[k] else None for k, gv in zip(self._local, self._lg)]
        if self.exposes_grads:
            _set_grads(self._lp, grads)
        _set_grads(self._lm, grads)
        self._exposed_grad_versions = self._grad_versions()
        self.taken_grads = False

    @engine_method
    def current_grads(self) -> list[torch.Tensor]:
        """The gradients the next step would apply (exposed ``.grad``, or the engine's own)."""
        if self.exposes_grads:
            return [g for g in map(_grad, self._lp) if g is not None]
        return [gv for k, gv in zip(self._local, self._lg) if self.grad_valid[k]]

    @engine_method
    def zero_grads(self, set_to_none: bool = True) -> None:
        """``optimizer.zero_grad()``: forget (or zero) the accumulated gradients of this block."""
        if self.exposes_grads and set_to_none:
            _set_grads(self._lp, itertools.repeat(None))
            return
        for k, (p, gv) in enumerate(zip(self.params, self.grad_views)):
            if gv is None:
                continue
            if self.exposes_grads:
                if p.grad is None:
                    continue
                if set_to_none:
                    p.grad = None
                else:
                    p.grad.zero_()
            elif set_to_none:
                self.grad_valid[k] = False
            elif self.grad_valid[k]:
                gv.zero_()

    @engine_method
    def consume_grads(self) -> None:
        """After the step took them: the next backward starts a new accumulation window."""
        if self.exposes_grads:
            _set_grads(self._lp, itertools.repeat(None))
        else:
            self._set_valid(False)

    def host_grad_sq_norm(self) -> torch.Tensor:
        """Squared L2 norm of this rank's gradients, computed on the host (fp32 scalar)."""
        grads = self.current_grads()
        if not grads:
            return torch.zeros((), dtype=torch.float32)
        norms = torch._foreach_norm([g.float() if g.dtype != torch.float32 else g for g in grads])
        return torch.stack([n.float() for n in norms]).square().sum()

    @engine_method
    def device_norm_valid(self) -> bool:
        if (self.device_norm is None or self.flushes != 1 or not any(self.grad_valid)
                or not self._exposed_unchanged()):
            return False  # no gradient left (consumed, zeroed): the norm of the last flush is stale
        if not self.exposes_grads:
            return True
        if self._all_valid():
            return _all_are(map(_grad, self._lp), self._lg)
        return all(p.grad is gv for k, p, gv in zip(self._local, self._lp, self._lg) if self.grad_valid[k])

    @engine_method
    def step_grads(self) -> list[tuple[int, torch.Tensor | None]]:
        """At ``optimizer.step()`` (training thread): the gradient each trainable piece steps with,
        from the exposed ``.grad`` (which ``zero_grad`` or the user may have changed). Reads
        only: the host worker applies it (`load_master_grads`), so nothing a running task reads
        is touched here."""
        self._check_not_poisoned()
        if self.exposes_grads:
            return list(zip(self._local, map(_grad, self._lp)))
        return [(k, gv if self.grad_valid[k] else None) for k, gv in zip(self._local, self._lg)]

    def host_grads(self) -> list[tuple[int, torch.Tensor]]:
        """The host gradients folded so far (what a speculative update reads)."""
        if self._all_valid():
            return list(zip(self._local, self._lg))
        return [(k, gv) for k, gv in zip(self._local, self._lg) if self.grad_valid[k]]

    @engine_method
    def grads_match(self, grads: list[tuple[int, torch.Tensor | None]], used: list[tuple[int, torch.Tensor]]) -> bool:
        """Whether ``grads`` (from `step_grads`) are exactly the host gradients a speculative
        update ``used``, untouched since the end of backward (version counters)."""
        present = [(k, g) for k, g in grads if g is not None]
        if len(present) != len(used) or any(k != j for (k, _), (j, _) in zip(present, used)):
            return False
        return all(g is self.grad_views[k] for k, g in present) and self._exposed_unchanged()

    @engine_method
    def grads_modified_in_place(self) -> bool:
        """Whether an exposed host gradient was written since the end of backward."""
        return bool(self._exposed_grad_versions) and not self._exposed_unchanged()

    @engine_method
    def load_master_grads(self, grads: list[tuple[int, torch.Tensor | None]]) -> bool:
        """On the host worker: points the masters' ``.grad`` at the gradients to step with."""
        if len(grads) == len(self._lg) and _all_are(map(_second, grads), self._lg):
            _set_grads(self._lm, self._lg)  # the usual step: every piece with its own host gradient
            return bool(grads)
        given = dict(grads)
        any_grad = False
        with no_grad():
            for k, (master, gv) in enumerate(zip(self.masters, self.grad_views)):
                if gv is None:
                    continue
                g = given.get(k)
                if g is None:
                    master.grad = None
                    continue
                if g is not gv:
                    gv = self._host_grad_for(k, g)
                    gv.copy_(g)
                master.grad = gv
                any_grad = True
        return any_grad

    def _host_grad_for(self, k: int, value: torch.Tensor) -> torch.Tensor:
        """The host gradient of parameter ``k``, able to hold ``value`` exactly: a bf16 host
        gradient given anything but bf16 widens first ([Note: host gradients in the compute dtype])."""
        if self.grad_flat.dtype != torch.float32 and value.dtype != self.grad_flat.dtype:
            self._widen_grads(f"a {value.dtype} gradient was set by hand")
        return self.grad_views[k]

    def _widen_grads(self, why: str) -> None:
        """From now on this unit keeps fp32 host gradients: the bf16 values move over exactly,
        and every ``.grad`` that pointed at the old buffer points at the new one."""
        old = self.grad_flat
        wide = self._host.allocate(4 * old.numel(), transfer=False).view(torch.float32)
        wide.copy_(old)
        self.grad_flat = wide
        with torch.no_grad(), _engine_access():
            for k, piece in enumerate(self.pieces):
                if piece is None:
                    continue
                before, after = self.grad_views[k], wide[piece[1] : piece[1] + piece[2]].view(self.masters[k].shape)
                if self.exposes_grads and self.params[k].grad is before:
                    self.params[k].grad = after
                if self.masters[k].grad is before:
                    self.masters[k].grad = after
                self.grad_views[k] = after
        self._refresh_grad_lists()
        self._exposed_grad_versions = self._grad_versions() if self._exposed_grad_versions else []
        self._host.free(old)
        logger.info("stronghold: %s keeps fp32 host gradients from now on (%s; host_grads=\"compute\" holds one "
                    "backward's gradient in bf16).", self.fqn, why)

    # ------------------------------------------------------------------ whole values (state dict)
    def full_values(self) -> list[torch.Tensor]:
        """Every parameter's whole host value (fp32 for trainable ones). With sharded state this
        all-gathers the masters: every rank must call it, in the same block order."""
        if not self.sharded and self.masters_on_disk:  # mapped from the file: no RAM of their own
            flat = self.disk_masters.map(self.index)
            return [flat[piece[1] : piece[1] + piece[2]].view(e.shape) if piece is not None else view.detach()
                    for e, piece, view in zip(self.layout.entries, self.pieces, self.host_views)]
        if not self.sharded:
            return [v.detach() for v in self.host_views]
        S = self.layout.shard_numel
        full = torch.empty(self.layout.padded_grad_numel, dtype=torch.float32)
        local = full[self.shard_lo : self.shard_lo + S]
        if S:
            local.copy_(self.master_source.read(0, S) if self.masters_on_disk else self.master_flat)
            self.dp.all_gather_host_(full, local)
        out = []
        for e, view in zip(self.layout.entries, self.host_views):
            out.append(full[e.grad_offset : e.grad_offset + e.numel].view(e.shape) if e.trainable else view.detach())
        return out

    # ------------------------------------------------------------------ teardown
    def restore_parameters(self, device: torch.device, values: list[torch.Tensor]) -> None:
        """Gives each parameter an ordinary tensor of its stored dtype on ``device`` (engine.close)."""
        assert self.state is Residency.ON_HOST and self.grad_buffer is None
        with torch.no_grad(), _engine_access():
            for e, p, value in zip(self.layout.entries, self.params, values):
                grad = p.grad if self.exposes_grads else None
                p.grad = None
                p.data = value.to(device=device, dtype=e.stored_dtype, copy=True)
                if grad is not None:
                    p.grad = grad.to(device=device, dtype=e.stored_dtype, copy=True)
        self.masters = [None] * len(self.params)

    @property
    def grad_nbytes_device(self) -> int:
        """Bytes of this unit's gradient buffer on the device (the padded trainable region)."""
        return self.layout.trainable_bytes


OffloadedBlock = Unit  # a block is a unit; the old name stays for readers of older notes
