"""The transfer context: streams, events and in-flight copies.

One object owns every copy between host and device. On CUDA it has a host-to-device stream
and a device-to-host stream, and every buffer that crosses streams travels in a small
NamedTuple together with the CUDA event that says when it is safe to touch (the FSDP2
``AllGatherState`` pattern). On a CPU-only machine the same API runs with synchronous
copies and events that are complete at once, so the engine's state machine is identical and
testable without a GPU.

[Note: allocation stream] A block's device storage is (re)allocated with ``resize_`` while
the *compute* stream is current, so the caching allocator associates it with the compute
stream and frees on that stream are ordered after the block's last kernel. The H2D stream
therefore waits on an event recorded on the compute stream right after the allocation,
before it writes into the new bytes: the allocator may have handed back memory that a
compute kernel enqueued earlier is still reading.

[Note: D2H lifetime] A device-to-host gradient copy reads a device buffer that was
allocated on the compute stream. That buffer is kept alive inside `InFlightD2H` until its
event has completed, and only then dropped; dropping it earlier would let the allocator
reuse the bytes for a compute kernel that can run before the copy. The host never reads the
pinned destination before ``event.synchronize()`` (or a true ``query()``): a non-blocking
D2H copy returns immediately and the bytes arrive later.
"""

from __future__ import annotations

import time
from typing import NamedTuple

import torch


class _CompletedEvent:
    """Stand-in for ``torch.cuda.Event`` on the CPU path: always complete."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None

    def wait(self, stream=None) -> None:  # noqa: ARG002 - same signature as torch.cuda.Event.wait
        return None


_DONE = _CompletedEvent()


class InFlightH2D(NamedTuple):
    """A host-to-device block fetch: the destination stays unusable until ``event``."""

    block_index: int
    event: object  # torch.cuda.Event | _CompletedEvent


class InFlightD2H(NamedTuple):
    """A device-to-host gradient copy and everything that must live until ``event``."""

    block_index: int
    device_buffer: torch.Tensor | None  # kept alive until the copy completes (see [Note: D2H lifetime])
    host_buffer: torch.Tensor  # pinned destination; read only after event.synchronize()
    event: object


class TransferStats:
    """Counters for one optimizer step; the Trainer logs and resets them."""

    __slots__ = ("h2d_bytes", "d2h_bytes", "h2d_s", "d2h_s", "blocked_s", "cpu_adam_s", "fetches_on_demand")

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.h2d_bytes = 0
        self.d2h_bytes = 0
        self.h2d_s = 0.0
        self.d2h_s = 0.0
        self.blocked_s = 0.0
        self.cpu_adam_s = 0.0
        self.fetches_on_demand = 0

    def as_dict(self) -> dict[str, float]:
        return {k: getattr(self, k) for k in self.__slots__}


class TransferContext:
    """Owns the copy streams (CUDA) or performs synchronous copies (CPU)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.is_cuda = device.type == "cuda"
        self.stats = TransferStats()
        if self.is_cuda:
            self.h2d_stream = torch.cuda.Stream(device=device)
            self.d2h_stream = torch.cuda.Stream(device=device)
        else:
            self.h2d_stream = None
            self.d2h_stream = None

    # ------------------------------------------------------------------ helpers
    def _new_event(self):
        return torch.cuda.Event() if self.is_cuda else _DONE

    def compute_event(self):
        """An event recorded on the current (compute) stream, or a completed stand-in."""
        if not self.is_cuda:
            return _DONE
        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream(self.device))
        return ev

    # ------------------------------------------------------------------ host -> device
    def copy_h2d(self, block_index: int, dst: torch.Tensor, src: torch.Tensor, after) -> InFlightH2D:
        """Copies ``src`` (host) into ``dst`` (device) once ``after`` (an event) has fired."""
        nbytes = src.numel() * src.element_size()
        self.stats.h2d_bytes += nbytes
        if not self.is_cuda:
            t0 = time.perf_counter()
            dst.copy_(src)
            self.stats.h2d_s += time.perf_counter() - t0
            return InFlightH2D(block_index, _DONE)
        event = torch.cuda.Event()
        with torch.cuda.stream(self.h2d_stream):
            self.h2d_stream.wait_event(after)  # see [Note: allocation stream]
            dst.copy_(src, non_blocking=True)
            event.record(self.h2d_stream)
        return InFlightH2D(block_index, event)

    def wait_h2d(self, inflight: InFlightH2D) -> None:
        """Makes the compute stream wait for a fetch; the host does not block."""
        if self.is_cuda:
            torch.cuda.current_stream(self.device).wait_event(inflight.event)

    # ------------------------------------------------------------------ device -> host
    def copy_d2h(self, block_index: int, host_dst: torch.Tensor, device_src: torch.Tensor) -> InFlightD2H:
        """Starts copying ``device_src`` into ``host_dst`` after the compute stream's current work."""
        self.stats.d2h_bytes += device_src.numel() * device_src.element_size()
        if not self.is_cuda:
            t0 = time.perf_counter()
            host_dst.copy_(device_src)
            self.stats.d2h_s += time.perf_counter() - t0
            return InFlightD2H(block_index, None, host_dst, _DONE)
        ready = self.compute_event()
        event = torch.cuda.Event()
        with torch.cuda.stream(self.d2h_stream):
            self.d2h_stream.wait_event(ready)
            host_dst.copy_(device_src, non_blocking=True)
            event.record(self.d2h_stream)
        return InFlightD2H(block_index, device_src, host_dst, event)

    def wait_d2h(self, inflight: InFlightD2H) -> torch.Tensor:
        """Blocks the host until the copy landed; returns the host buffer, now safe to read."""
        if self.is_cuda and not inflight.event.query():
            t0 = time.perf_counter()
            inflight.event.synchronize()
            self.stats.blocked_s += time.perf_counter() - t0
        return inflight.host_buffer
