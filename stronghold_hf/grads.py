"""The gradient queue: a bounded number of unit gradients on their way to the host.

During a unit's backward its trainable parameters' ``.grad`` are views into a *lane*: a
device buffer in the unit's gradient layout (autograd accumulates into it in place). When
the unit's backward is done the schedule *flushes* the lane: `send` starts one device-to-host
copy of the whole buffer into the lane's pinned staging buffer, then, on the host worker, a
*fold* copies or adds the staged values into the unit's fp32 gradient and `release` frees
the lane. The queue only keeps the lanes; the schedule composes the flush.

There are ``K = StrongholdConfig.grad_buffers`` lanes. A unit that needs one while all are
busy waits for the oldest flush to land: gradients drain *during* backward, so device
memory holds at most ``K`` gradient buffers, whatever the depth (FSDP2's post-reduce event
bounds its reduce-scatter outputs the same way). The ``K`` device buffers are allocated at the
first use of a lane in a backward pass and kept until the pass ends
(`release_device_buffers`), so the pass holds exactly ``K`` buffers of the largest unit's
gradient, whatever the timing; its staging buffer lives as long as the engine. The ledger
books both. A staging buffer holds the largest *block's* gradient: a larger unit (a
vocabulary-sized embedding or head) crosses in pieces of half of it, two in flight, each next
piece started by the fold once it has read the one before (`StagedGradient`), so Llama-3-8B's
1 GiB head does not size every lane's pinned buffer. (The resident unit has a queue of its
own with one lane of its size: it keeps its lane for the whole backward.)

States of a lane::

    FREE --acquire--> FILLING --send--> IN_FLIGHT --(worker: copy landed, folded; release)--> FREE

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
from .memory import HostAllocator, element_size
from .transfer import TransferContext
from .workers import Ticket


_NORM_BYTES = 64  # room for one fp32 norm at the end of each staging buffer, alignment kept


class LaneState(enum.Enum):
    FREE = "free"
    FILLING = "filling"
    IN_FLIGHT = "in_flight"


class GradLane:
    __slots__ = ("index", "state", "device_bytes", "device_buffer", "staging", "norm_host", "dtype", "numel",
                 "unit_index", "ticket")

    def __init__(self, index: int, staging: torch.Tensor) -> None:
        self.index = index
        self.state = LaneState.FREE
        self.device_bytes: torch.Tensor | None = None  # uint8 [max bytes] on the device, for one backward pass
        self.device_buffer: torch.Tensor | None = None  # [numel] grad dtype: the used part, typed, while in use
        # uint8 [staging bytes + 64], pinned host: the gradient (typed per flush), then, in the
        # last 64 bytes, the flush's squared norm (pinned too, so its copy stays asynchronous).
        self.staging = staging[:-_NORM_BYTES]
        self.norm_host = staging[-_NORM_BYTES:][:4].view(torch.float32)  # fp32 [1]
        self.dtype: torch.dtype | None = None
        self.numel = 0
        self.unit_index = -1
        self.ticket: Ticket | None = None

    def device_view(self, offset: int, numel: int, shape) -> torch.Tensor:
        assert self.device_buffer is not None
        return self.device_buffer[offset : offset + numel].view(shape)

    def staged_norm(self) -> float:
        """The flush's squared norm (read only after the copy landed)."""
        return float(self.norm_host[0])


class StagedGradient:
    """One flush on its way to the host: the gradient (or this rank's shard) as pieces that
    land in the lane's staging buffer, in order. Whole when it fits the staging buffer;
    otherwise pieces of half of it, alternating halves, the first two started by `send` and
    each next one by `landed` once the piece two before has been read."""

    def __init__(self, transfer: TransferContext, src: torch.Tensor, staging: torch.Tensor) -> None:
        self.transfer = transfer
        self.src = src  # the device gradient (kept alive until every piece landed)
        self.numel = src.numel()
        size = element_size(src.dtype)
        whole = self.numel * size <= staging.numel()
        self.piece = self.numel if whole else max((staging.numel() // 2) // size // 64 * 64, 64)
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

    def __init__(self, transfer: TransferContext, src: torch.Tensor) -> None:
        self.src, self.dtype = src, src.dtype
        self._event = transfer.book_d2h(src)
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
        self._free = threading.Condition()
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
        return sum(lane.state is not LaneState.FREE for lane in self._lanes)

    def acquire(self, unit_index: int, numel: int, dtype: torch.dtype) -> GradLane:
        """A zeroed lane of ``numel`` elements; waits for the oldest flush when all are busy."""
        lanes = self._lane_pool()
        while True:
            with self._free:
                lane = next((l for l in lanes if l.state is LaneState.FREE), None)
                if lane is not None:
                    lane.state = LaneState.FILLING
                    break
                oldest = next((l.ticket for l in lanes if l.state is LaneState.IN_FLIGHT), None)
            if oldest is None:
                raise RuntimeError(
                    f"stronghold: all {len(lanes)} gradient buffers are held by units whose backward has not "
                    "finished; raise StrongholdConfig.grad_buffers (this model keeps more units' gradients open "
                    "at once than the queue allows)."
                )
            self._wait(oldest)
        if lane.device_bytes is None:
            # All K at once: the pass's device footprint does not depend on how fast copies land.
            for other in lanes:
                if other.device_bytes is None:
                    other.device_bytes = torch.empty(self.max_bytes, dtype=torch.uint8, device=self.device)
                    self.ledger.device_alloc(self.max_bytes)
        lane.device_buffer = lane.device_bytes[: numel * element_size(dtype)].view(dtype)
        # Zeros: autograd accumulates into it, and the alignment padding between parameters
        # must not add to norms or sums.
        lane.device_buffer.zero_()
        lane.dtype, lane.numel, lane.unit_index = dtype, numel, unit_index
        self.peak_in_flight = max(self.peak_in_flight, self.busy)
        return lane

    def send(self, lane: GradLane, send: torch.Tensor | None = None, *,
             sq_norm: torch.Tensor | None = None) -> StagedGradient | _InPlace:
        """Starts copying ``send`` (the lane, or this rank's shard of it) to the host; returns the
        flush, whose ``landed()`` the fold iterates. ``sq_norm`` (a device scalar) travels too,
        first on the same stream, so the first piece's landing covers it. The lane is IN_FLIGHT
        until `release`, which the fold calls after the last piece ([Note: lane lifetime])."""
        assert lane.state is LaneState.FILLING
        send = lane.device_buffer if send is None else send
        if sq_norm is not None:
            self.transfer.copy_d2h(lane.norm_host, sq_norm.reshape(1))
        if self.transfer.mode == "sync":
            # A CPU "device": the lane is host memory already and stays untouched until the
            # fold has read it (the lane is FREE only after), so the fold reads it in place.
            flush = _InPlace(self.transfer, send)
        else:
            flush = StagedGradient(self.transfer, send, lane.staging)
        lane.state = LaneState.IN_FLIGHT
        return flush

    def release(self, lane: GradLane) -> None:
        """The fold has read the staged copy: the lane (and its device buffer) is free again."""
        with self._free:
            lane.device_buffer = None
            lane.state = LaneState.FREE
            lane.ticket = None
            self._free.notify_all()

    def discard(self, lane: GradLane) -> None:
        """Gives a FILLING lane back without copying (its gradients are dropped)."""
        assert lane.state is LaneState.FILLING
        with self._free:
            lane.device_buffer = None
            lane.state = LaneState.FREE
            self._free.notify_all()

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
        """At the end of a backward pass: gives the lanes' device memory back (after `drain`)."""
        for lane in self._lanes:
            assert lane.state is LaneState.FREE, "release_device_buffers with a lane in use"
            if lane.device_bytes is not None:
                lane.device_bytes = None
                self.ledger.device_free(self.max_bytes)
