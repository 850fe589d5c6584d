"""The gradient queue: a bounded number of unit gradients on their way to the host.

During a unit's backward it holds a *lane*: a device buffer in the unit's gradient layout.
Autograd produces the unit's gradients as it does in plain training (``.grad`` is None, so
each is stolen, not added into a zeroed buffer); when the unit's backward is done they are
copied into the lane in one fused op (unit_grads.py, `collect_into_buffer`) and the lane is
*flushed* (flush.py): `send` starts one device-to-host copy of the whole buffer into the
lane's pinned staging buffer, then, on the host worker, `land` runs the *fold*, which copies
or adds the staged values into the unit's fp32 gradient, and frees the lane. The queue only
keeps the lanes; flush.py composes the flush.

There are ``K = StrongholdConfig.grad_buffers`` lanes. A unit that needs one while all are
busy waits for the oldest flush to land: gradients drain *during* backward, so device
memory holds at most ``K`` gradient buffers, whatever the depth (FSDP2's post-reduce event
bounds its reduce-scatter outputs the same way). The ``K`` device buffers are allocated at the
first use of a lane in a backward pass and freed when the pass ends
(`release_device_buffers`), so the pass holds exactly ``K`` buffers of the largest unit's
gradient, whatever the timing ([Note: a clean lane] says how their views outlive that); the
staging buffers live as long as the engine. The ledger
books both. A staging buffer holds the largest *block's* gradient: a larger unit (a
vocabulary-sized embedding or head) crosses in pieces of half of it, two in flight, each next
piece started by the fold once it has read the one before (`StagedGradient`), so Llama-3-8B's
1 GiB head does not size every lane's pinned buffer. (The rest unit has a queue of its
own with one lane of its size: it keeps its lane for the whole backward.)

[Note: vocabulary pieces through the lanes] A vocabulary unit read in pieces (vocab_pieces.py)
sends each piece's gradient, already on the device, through a lane's staging alone
(`acquire_staging`, `send_staged`): its backward is the head's, before any block's, so the
lanes are free then and their device buffers are not taken, and no pinned buffer of its own is
needed. The blocks that follow wait for those flushes as for any other. The embedding's rows'
gradient, the last of a backward, goes the same way in parts of whole rows.

States of a lane::

    FREE --acquire--> FILLING --send--> IN_FLIGHT --(worker, land: copy landed, folded; release)--> FREE

[Note: lane lifetime] The device buffer is read by the D2H stream after the compute stream
wrote it; the lane becomes FREE (and its buffer reusable) only in the fold task, after
``host_wait`` on the copy's event (see transfer.py, [Note: D2H lifetime]), and the buffers
are dropped only after `drain`. The staging buffer is read only by that fold, after the same
wait, and reused only after the lane is FREE.
"""

from __future__ import annotations

import enum
import threading

import torch

from .ledger import MemoryLedger
from .memory import HostAllocator
from .transfer import TransferContext
from .workers import Ticket


_NORM_BYTES = 64  # room for one fp32 norm at the end of each staging buffer, alignment kept


class LaneState(enum.Enum):
    FREE = "free"
    FILLING = "filling"
    IN_FLIGHT = "in_flight"


class GradLane:
    """One lane: a device buffer that lives for the engine, and its host staging buffer.

    [Note: a clean lane] A lane's device bytes are allocated once and their *storage* is freed
    at the end of every backward pass and allocated again at the next (``resize_``, as a unit's
    slot is: unit.py, [Note: why the slot storage is resized]). So the typed buffer and each
    parameter's view into it, made from a unit's geometry, stay valid from pass to pass and
    are made once (`views`), not per backward. A unit's gradients are *copied* into its views
    (unit_grads.py, `collect_into_buffer`); views of parameters without a gradient are zeroed then.
    The padding between parameters is never written, so once zeroed it stays zero for as long
    as the lane serves the same geometry (``clean_key``): `GradientQueue.acquire` zeroes a lane
    only when it was just allocated or last held another geometry, so the flush's norm and the
    host's flat sums see zeros there, and a uniform stack of blocks costs no ``zero_`` at all.
    """

    __slots__ = ("index", "state", "device_bytes", "device_buffer", "staging", "norm_host", "dtype", "numel",
                 "unit_index", "ticket", "clean_key", "_typed", "_views", "_norm_read")

    def __init__(self, index: int, staging: torch.Tensor) -> None:
        self.index = index
        self.state = LaneState.FREE
        self.device_bytes: torch.Tensor | None = None  # uint8 [max bytes] on the device; storage freed between passes
        self.device_buffer: torch.Tensor | None = None  # [numel] grad dtype: the used part, typed, while in use
        # uint8 [staging bytes + 64], pinned host: the gradient (typed per flush), then, in the
        # last 64 bytes, the flush's L2 norm (pinned too, so its copy stays asynchronous).
        self.staging = staging[:-_NORM_BYTES]
        self.norm_host = staging[-_NORM_BYTES:][:4].view(torch.float32)  # fp32 [1]
        self._norm_read = self.norm_host.numpy()  # the same memory, read without a torch call
        self.dtype: torch.dtype | None = None
        self.numel = 0
        self.unit_index = -1
        self.ticket: Ticket | None = None
        self.clean_key: int | None = None  # the geometry whose padding is zero in the lane (None: garbage)
        self._typed: dict[tuple[torch.dtype, int], torch.Tensor] = {}  # (dtype, numel) -> the typed buffer
        self._views: dict[int, list[torch.Tensor | None]] = {}  # geometry key -> each parameter's view

    def typed(self, dtype: torch.dtype, numel: int) -> torch.Tensor:
        """The lane's first ``numel`` elements as ``dtype`` (made once, valid across passes)."""
        buffer = self._typed.get((dtype, numel))
        if buffer is None:
            buffer = self._typed[(dtype, numel)] = self.device_bytes[: numel * dtype.itemsize].view(dtype)
        return buffer

    def views(self, key: int, geometry) -> list[torch.Tensor | None]:
        """Each trainable parameter's view into the typed buffer in use, from ``geometry``
        (memory.py, `BlockLayout.grad_geometry`, named by ``key``); made once per geometry."""
        views = self._views.get(key)
        if views is None:
            buffer = self.device_buffer
            base = buffer.storage_offset()
            views = self._views[key] = [None if g is None else buffer.as_strided(g[0], g[1], base + g[2])
                                        for g in geometry]
        return views

    def staged_norm(self) -> float:
        """The flush's L2 norm (read only after the copy landed). Read through numpy: on the
        host worker a torch call would hand the GIL to the training thread and wait to get it
        back (unit_grads.py, [Note: torch calls on the host worker])."""
        return float(self._norm_read[0])


class StagedGradient:
    """One flush on its way to the host: the gradient (or this rank's shard) as pieces that
    land in the lane's staging buffer, in order. Whole when it fits the staging buffer;
    otherwise pieces of half of it, alternating halves, the first two started by `send` and
    each next one by `landed` once the piece two before has been read."""

    def __init__(self, transfer: TransferContext, src: torch.Tensor, staging: torch.Tensor, align: int = 64) -> None:
        self.transfer = transfer
        self.src = src  # the device gradient (kept alive until every piece landed)
        self.numel = src.numel()
        size = src.dtype.itemsize
        whole = self.numel * size <= staging.numel()
        # ``align``: a piece is a multiple of it (64 elements; a row's width for rows of a matrix).
        self.piece = self.numel if whole else max((staging.numel() // 2) // size // align * align, align)
        self._halves = [staging[: self.piece * size].view(src.dtype)] if whole else [
            staging[h * self.piece * size: (h + 1) * self.piece * size].view(src.dtype) for h in range(2)]
        self._events: list = []
        for i in range(min(len(self._halves), self.num_pieces)):
            self._start(i)

    @property
    def num_pieces(self) -> int:
        return max(-(-self.numel // self.piece), 1)

    def _bounds(self, i: int) -> tuple[int, int]:
        return i * self.piece, min((i + 1) * self.piece, self.numel)

    def _start(self, i: int) -> None:
        lo, hi = self._bounds(i)
        dst = self._halves[i % len(self._halves)][: hi - lo]
        self._events.append(self.transfer.copy_d2h(dst, self.src[lo:hi], continues=i > 0))

    def landed(self):
        """Worker thread: ``(offset, host piece)`` of each piece once it landed, in order. The
        piece is valid until the loop asks for the next one."""
        for i in range(self.num_pieces):
            self.transfer.host_wait(self._events[i])
            lo, hi = self._bounds(i)
            yield lo, self._halves[i % len(self._halves)][: hi - lo]
            if i + 2 < self.num_pieces:
                self._start(i + 2)  # into the half just read

    @property
    def dtype(self) -> torch.dtype:
        return self.src.dtype


class _InPlace:
    """The CPU device's flush: the lane is host memory already, read where it is."""

    def __init__(self, transfer: TransferContext, src: torch.Tensor, norm_bytes: int = 0) -> None:
        self.src, self.dtype = src, src.dtype
        self._event = transfer.book_d2h(src.numel() * src.element_size() + norm_bytes)
        self._transfer = transfer

    def landed(self):
        self._transfer.host_wait(self._event)
        yield 0, self.src


class GradientQueue:
    """``K`` lanes shared by the units; see the module docstring."""

    def __init__(self, num_lanes: int, max_bytes: int, *, device: torch.device, host: HostAllocator,
                 transfer: TransferContext, ledger: MemoryLedger, staging_bytes: int | None = None) -> None:
        self.device = device
        self.transfer = transfer
        self.ledger = ledger
        self.max_bytes = max_bytes  # device buffer: the largest unit's whole gradient
        # Host staging: what one flush copies at once, the largest block's gradient shard (all
        # of it without sharded data parallelism); larger units cross in pieces.
        self.staging_bytes = max_bytes if staging_bytes is None else staging_bytes
        self._host = host
        self._lanes: list[GradLane] = []
        self._num_lanes = num_lanes
        self._free = threading.Lock()  # guards the lanes' states (a backward waits for a lane on its ticket)
        self._allocated = False  # the lanes' device storage holds bytes (during a backward pass)
        self._busy = 0  # lanes not FREE (changed under ``_free``)
        self.peak_in_flight = 0

    def _lane_pool(self) -> list[GradLane]:
        if not self._lanes and self.max_bytes > 0:  # staging is allocated at the first backward
            self._lanes = [GradLane(i, self._host.allocate(self.staging_bytes + _NORM_BYTES, transfer=True))
                           for i in range(self._num_lanes)]
        return self._lanes

    @property
    def staging_allocated_bytes(self) -> int:
        """Host bytes of the lanes' staging buffers (0 before the first backward)."""
        return sum(lane.staging.numel() + _NORM_BYTES for lane in self._lanes)

    @property
    def num_lanes(self) -> int:
        return self._num_lanes

    @property
    def busy(self) -> int:
        return self._busy

    def acquire(self, unit_index: int, numel: int, dtype: torch.dtype | None, key: int | None = None, *,
                device: bool = True) -> GradLane:
        """A lane of ``numel`` elements; waits for the oldest flush when all are busy. ``key``: the
        geometry the unit will copy its gradients in with ([Note: a clean lane]); the lane is
        zeroed unless its padding is already zero for that geometry (None: always zeroed).
        ``device=False``: its staging alone (`acquire_staging`)."""
        lanes = self._lanes or self._lane_pool()
        while True:
            with self._free:
                lane = None
                for candidate in lanes:
                    if candidate.state is LaneState.FREE:
                        lane = candidate
                        break
                if lane is not None:
                    lane.state = LaneState.FILLING
                    self._busy = busy = self._busy + 1
                    break
                oldest = next((l.ticket for l in lanes if l.state is LaneState.IN_FLIGHT), None)
            if oldest is None:
                raise RuntimeError(
                    f"stronghold: all {len(lanes)} gradient buffers are held by units whose backward has not "
                    "finished; raise StrongholdConfig.grad_buffers (this model keeps more units' gradients open "
                    "at once than the queue allows)."
                )
            self._wait(oldest)
        if busy > self.peak_in_flight:
            self.peak_in_flight = busy
        if not device:
            return lane
        if not self._allocated:
            self._allocate_device_buffers()
        lane.device_buffer = buffer = lane.typed(dtype, numel)
        if key is None or lane.clean_key != key:
            buffer.zero_()  # the padding between parameters must not add to norms or sums
            lane.clean_key = key
        lane.dtype, lane.numel, lane.unit_index = dtype, numel, unit_index
        return lane

    @property
    def carries_staged(self) -> bool:
        """Whether the lanes' staging can carry a gradient that is on the device already
        (`acquire_staging`): there are lanes, of a streamed block's gradient."""
        return self.max_bytes > 0 and self._num_lanes > 0

    def acquire_staging(self) -> GradLane:
        """A lane whose pinned staging alone carries a gradient already on the device (a
        vocabulary piece's, vocab_pieces.py), through `send_staged` and `land`: no device buffer
        is taken, since the head's backward that sends them comes before any block's, which
        takes the lanes' device buffers ([Note: vocabulary pieces through the lanes])."""
        return self.acquire(-1, 0, None, device=False)

    def send_staged(self, lane: GradLane, src: torch.Tensor, align: int = 64) -> StagedGradient | _InPlace:
        """Starts copying device ``src`` (flat) to the host through ``lane``'s staging (in parts
        of a multiple of ``align`` elements when it is larger); the lane is IN_FLIGHT until
        `land` releases it."""
        assert lane.state is LaneState.FILLING and lane.device_buffer is None
        flush = (_InPlace(self.transfer, src) if self.transfer.mode == "sync"
                 else StagedGradient(self.transfer, src, lane.staging, align=align))
        lane.state = LaneState.IN_FLIGHT
        return flush

    def _allocate_device_buffers(self) -> None:
        """All K at once, at a pass's first lane: the pass's device footprint does not depend on
        how fast copies land. The storage is kept from pass to pass, its bytes are not
        ([Note: a clean lane])."""
        for lane in self._lanes:
            if lane.device_bytes is None:
                lane.device_bytes = torch.empty(self.max_bytes, dtype=torch.uint8, device=self.device)
            else:
                lane.device_bytes.untyped_storage().resize_(self.max_bytes)
            lane.clean_key = None  # fresh bytes: zeroed at first use
            self.ledger.device_alloc(self.max_bytes)
        self._allocated = True

    def send(self, lane: GradLane, send: torch.Tensor | None = None, *,
             norm: torch.Tensor | None = None) -> StagedGradient | _InPlace:
        """Starts copying ``send`` (the lane, or this rank's shard of it) to the host; returns the
        flush, whose ``landed()`` the fold iterates. ``norm`` (a device scalar) travels too,
        first on the same stream, so the first piece's landing covers it. The lane is IN_FLIGHT
        until `release`, which the fold calls after the last piece ([Note: lane lifetime])."""
        assert lane.state is LaneState.FILLING
        send = lane.device_buffer if send is None else send
        if self.transfer.mode == "sync":
            # A CPU "device": the lane is host memory already and stays untouched until the
            # fold has read it (the lane is FREE only after), so the fold reads it in place;
            # the norm is host memory too, copied where the fold reads it and booked with the lane.
            if norm is not None:
                lane.norm_host.copy_(norm)
            flush = _InPlace(self.transfer, send, norm_bytes=0 if norm is None else 4)
        else:
            if norm is not None:
                self.transfer.copy_d2h(lane.norm_host, norm.reshape(1))
            flush = StagedGradient(self.transfer, send, lane.staging)
        lane.state = LaneState.IN_FLIGHT
        return flush

    def land(self, lane: GradLane, flush: StagedGradient | _InPlace, fold, partial_norm=None) -> None:
        """Worker thread, one flush's task: each piece of ``flush`` goes to ``fold(offset,
        piece)`` as it lands (the unit's gradients, unit_grads.py), ``partial_norm``
        (speculation.py) adds the flush's squared norm, and the lane is free again ([Note: lane
        lifetime])."""
        try:
            for lo, staged in flush.landed():
                fold(lo, staged)
            if partial_norm is not None:
                partial_norm.add(lane.staged_norm() ** 2)
        finally:
            self.release(lane)

    def release(self, lane: GradLane) -> None:
        """The fold has read the staged copy: the lane (and its device buffer) is free again."""
        with self._free:
            lane.device_buffer = None
            lane.state = LaneState.FREE
            lane.ticket = None
            self._busy -= 1

    def discard(self, lane: GradLane) -> None:
        """Gives a FILLING lane back without copying (its gradients are dropped)."""
        assert lane.state is LaneState.FILLING
        with self._free:
            lane.device_buffer = None
            lane.state = LaneState.FREE
            self._busy -= 1

    def _wait(self, ticket: Ticket) -> None:
        if not ticket.done():
            self.transfer.stats.count_host_block()
        ticket.wait()

    def drain(self) -> None:
        """Waits until every flush has landed and been folded (re-raising a failed one)."""
        for lane in list(self._lanes):
            ticket = lane.ticket
            if ticket is not None:
                self._wait(ticket)

    def release_device_buffers(self) -> None:
        """At the end of a backward pass: gives the lanes' device memory back (after `drain`);
        the lanes keep their storage objects, so their views stay made ([Note: a clean lane])."""
        if not self._allocated:
            return
        for lane in self._lanes:
            assert lane.state is LaneState.FREE, "release_device_buffers with a lane in use"
            lane.device_bytes.untyped_storage().resize_(0)
            lane.clean_key = None
            self.ledger.device_free(self.max_bytes)
        self._allocated = False


def gradient_queues(streamed: list, resident: list, sequence, *, grad_buffers: int, device: torch.device,
                    host: HostAllocator, transfer: TransferContext,
                    ledger: MemoryLedger) -> tuple[GradientQueue, GradientQueue | None]:
    """The lanes of the streamed units and those of the trainable resident (rest) units.

    The streamed units share ``grad_buffers`` lanes of the largest one's gradient, plus one
    for each trainable unit used at several positions of ``sequence`` (it keeps its lane
    between its backward uses, `WindowSlots.release`, and the blocks still have ``K``); their
    pinned staging holds the largest *block's* gradient shard, since larger units cross in
    pieces. A resident unit keeps its lane for the whole backward: one lane each, of their
    size, in a queue of their own (``None`` without any)."""
    uses = {i: sequence.count(i) for i in set(sequence)}
    parked = sum(1 for u in streamed if u.trainable and uses.get(u.index, 0) > 1)
    blocks = [u.layout.shard_bytes for u in streamed if u.kind == "block"]
    queue = GradientQueue(grad_buffers + parked, max((u.layout.trainable_bytes for u in streamed), default=0),
                          device=device, host=host, transfer=transfer, ledger=ledger,
                          staging_bytes=max(blocks or [u.layout.shard_bytes for u in streamed] or [0]))
    if not resident:
        return queue, None
    return queue, GradientQueue(len(resident), max(u.layout.trainable_bytes for u in resident), device=device,
                                host=host, transfer=transfer, ledger=ledger,
                                staging_bytes=max(u.layout.shard_bytes for u in resident))
