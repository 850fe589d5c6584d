"""The transfer context: copy streams, events, and the waits between them.

One object owns every copy between host and device. Each copy returns an *event*; nothing
may use the destination before waiting on it. There are three modes with one API:

* ``"cuda"``: a host-to-device and a device-to-host ``torch.cuda.Stream``; events are
  ``torch.cuda.Event``. The compute stream waits on a fetch's event without blocking the
  host; the host blocks on a gradient copy's event only when it reads the bytes.
* ``"sync"``: CPU only, copies happen at once and events are complete. The state machine is
  the same, so the schedule and the ledger are tested without a GPU.
* ``"delayed"``: CPU, *behaves like a GPU*. Each direction has a copy thread that plays the
  role of a stream: it runs copies in order, each after an injected delay, and sets the
  copy's event when it lands. The compute "stream" is the training thread, so waiting for a
  fetch blocks it. A missing wait then reads bytes that have not arrived, and a test sees
  wrong numbers (the FSDP2 test suite injects delays before copies for the same reason).
  `stronghold_hf.testing.simulated_device` turns it on.

[Note: allocation stream] A block's device storage is (re)allocated with ``resize_`` while
the *compute* stream is current, so the caching allocator orders its reuse after the block's
last kernel. The H2D stream therefore waits on an event recorded on the compute stream right
after the allocation, before it writes into the new bytes: the allocator may have handed
back memory that a compute kernel enqueued earlier is still reading.

[Note: D2H lifetime] A device-to-host copy reads a device buffer that was allocated on the
compute stream. Its owner (a gradient lane in ``grads.py``) keeps the buffer alive until the
copy's event has completed; dropping it earlier would let the allocator hand the bytes to a
compute kernel that runs before the copy. The host never reads the pinned destination before
`host_wait` returns: a non-blocking D2H copy returns at once and the bytes arrive later.
"""

from __future__ import annotations

import os
import queue
import threading
import time
import weakref
from typing import Literal

import torch

from .ledger import MemoryLedger
from .stats import EngineStats
from .swap import _aligned_empty

TransferMode = Literal["cuda", "sync", "delayed"]

#: Set by `stronghold_hf.testing.simulated_device`: the copy delay of the ``"delayed"`` mode.
#: The environment variable lets a whole test run use it (milliseconds).
_simulated_copy_delay_s: float | None = None
SIMULATE_ENV = "STRONGHOLD_SIMULATE_COPY_DELAY_MS"


def simulated_copy_delay() -> float | None:
    if _simulated_copy_delay_s is not None:
        return _simulated_copy_delay_s
    raw = os.environ.get(SIMULATE_ENV)
    if raw:
        try:
            return max(0.0, float(raw) / 1e3)
        except ValueError:
            raise ValueError(f"{SIMULATE_ENV}={raw!r} is not a number of milliseconds.") from None
    return None


class _CompletedEvent:
    """The ``"sync"`` mode's event: always complete."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None


_DONE = _CompletedEvent()


class _HostEvent:
    """The ``"delayed"`` mode's event: set by a copy thread when the copy landed (or failed)."""

    __slots__ = ("_flag", "error")

    def __init__(self) -> None:
        self._flag = threading.Event()
        self.error: BaseException | None = None

    def query(self) -> bool:
        return self._flag.is_set()

    def synchronize(self) -> None:
        self._flag.wait()
        if self.error is not None:
            raise RuntimeError(f"stronghold: a simulated device copy failed: {self.error!r}") from self.error


class _CopyThread:
    """One simulated stream: copies run in submission order, each after ``delay_s``. The
    thread starts at the first copy and `close` joins it; a later copy starts a new one."""

    def __init__(self, name: str, delay_s: float) -> None:
        self.name = name
        self.delay_s = delay_s
        self._jobs: queue.SimpleQueue | None = None
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()  # the fetch conversion thread issues copies too

    def submit(self, dst: torch.Tensor, src: torch.Tensor) -> _HostEvent:
        event = _HostEvent()
        with self._lock:
            if self._thread is None:
                self._jobs = queue.SimpleQueue()
                # The thread holds only its queue; a dropped context still stops it (finalizer).
                self._thread = threading.Thread(target=_run_copies, args=(self._jobs, self.delay_s), name=self.name,
                                                daemon=True)
                self._thread.start()
                self._finalizer = weakref.finalize(self, self._jobs.put, None)
            self._jobs.put((dst, src, event))
        return event

    def close(self) -> None:
        """Lands the copies already queued, then joins the thread."""
        with self._lock:
            thread, jobs = self._thread, self._jobs
            self._thread = self._jobs = None
        if thread is not None:
            self._finalizer.detach()
            jobs.put(None)
            thread.join()


def _run_copies(jobs: queue.SimpleQueue, delay_s: float) -> None:
    while True:
        job = jobs.get()
        if job is None:
            return
        dst, src, event = job
        try:
            time.sleep(delay_s)
            # A destination freed while its copy was in flight is a scheduling bug: say so
            # instead of writing through a dangling pointer.
            need = (dst.storage_offset() + dst.numel()) * dst.element_size()
            if dst.untyped_storage().nbytes() < need or src.untyped_storage().nbytes() == 0:
                raise RuntimeError("copy source or destination was freed while the copy was in flight")
            with torch.no_grad():
                dst.copy_(src)
        except BaseException as err:  # reported to whoever waits on the event
            event.error = err
        event._flag.set()
        del dst, src, event, job


#: Staging buffers of `FetchStaging`: one being filled while the copy from the other runs.
FETCH_STAGING_BUFFERS = 2


class PendingFetch:
    """A fetch whose conversion runs on the conversion thread: ``issued()`` blocks until the
    thread has started the copies and returns the last copy's event (or raises its error)."""

    __slots__ = ("_issued", "event", "error")

    def __init__(self) -> None:
        self._issued = threading.Event()
        self.event = None
        self.error: BaseException | None = None

    def issued(self):
        self._issued.wait()
        if self.error is not None:
            raise RuntimeError(f"stronghold: converting a fetch failed: {self.error!r}") from self.error
        return self.event

    def query(self) -> bool:
        return self._issued.is_set() and self.error is None and self.event.query()

    def synchronize(self) -> None:
        self.issued().synchronize()


def _run_conversions(jobs: queue.SimpleQueue) -> None:
    while True:
        job = jobs.get()
        if job is None:
            return
        fn, pending = job
        try:
            pending.event = fn()
        except BaseException as err:  # surfaced where the fetch is waited for
            pending.error = err
        pending._issued.set()
        del fn, pending, job


class FetchStaging:
    """Fetches without a host image (``host_image=False``): a ring of pinned staging buffers
    that the fp32 masters are converted into, in the compute dtype, right before the copy.

    Each buffer holds the largest trainable shard of a block; a larger unit (a vocabulary-sized
    embedding or head) goes through in pieces of that size, one buffer after the other, so
    Llama-3-8B's 1 GiB untied head does not set the ring's size. Before a buffer is refilled the
    host waits for the copy that last read it, so the ring bounds the host memory however far
    the window prefetches (a fetch past the ring waits for an older one to land). Copies run in
    order on one stream, so the last piece's event says the whole unit landed.

    The conversion runs on a thread of its own, not the training thread: a fetch is issued in
    the middle of the forward, and converting a block there would hold back the kernels the
    device is waiting for. The fetch returns a `PendingFetch` at once; waiting for it (when the
    unit is needed) first waits for the thread to have issued the copies. Conversions run in
    fetch order, and the copy of each waits for the compute queued when the fetch was issued
    ([Note: allocation stream]), recorded on the training thread. On a CPU device the
    conversion writes the destination directly, on the training thread, and no buffer is
    allocated: the "device" is host memory already. Buffers are allocated at the first fetch.
    """

    def __init__(self, transfer: "TransferContext", allocate, buffer_bytes: int,
                 buffers: int = FETCH_STAGING_BUFFERS) -> None:
        self.transfer = transfer
        self._allocate = allocate  # HostAllocator.allocate: pinned when allowed, booked in the ledger
        self.buffer_bytes = buffer_bytes
        self.num_buffers = buffers
        self._buffers: list[torch.Tensor] = []
        self._events: list = []
        self._next = 0
        self._jobs: queue.SimpleQueue | None = None
        self._thread: threading.Thread | None = None
        self._scratch: torch.Tensor | None = None  # masters read from disk, one piece (nvme_masters)

    def copy_converted(self, dst: torch.Tensor, master, dtype: torch.dtype, *, fetch: bool):
        """Starts filling device ``dst`` (uint8) with ``master`` (fp32) converted to ``dtype``;
        returns the copy's event (a `PendingFetch` while the conversion thread has not issued it).

        ``master``: a tensor, or masters on disk (``nvme_masters``): an object with ``numel()``
        and ``read(lo, hi, scratch)`` giving elements ``[lo, hi)`` (`nvme.DiskMasters`), read
        piece by piece into a scratch buffer of one piece."""
        if self.transfer.mode == "sync":
            t0 = time.perf_counter()
            nbytes = master.numel() * dtype.itemsize
            if isinstance(master, torch.Tensor):
                dst[:nbytes].view(dtype).copy_(master)
            else:
                piece = self._piece_numel(dtype)
                for start in range(0, master.numel(), piece):
                    part = self._part(master, start, piece)
                    dst[start * dtype.itemsize: (start + part.numel()) * dtype.itemsize].view(dtype).copy_(part)
            self.transfer.stats.add("convert_s", time.perf_counter() - t0)
            self.transfer.book_h2d(nbytes, fetch=fetch)
            return _DONE
        after = self.transfer.compute_event()
        pending = PendingFetch()
        if self._thread is None:
            self._jobs = queue.SimpleQueue()
            # The thread holds only its queue: an engine dropped without close() still stops it.
            self._thread = threading.Thread(target=_run_conversions, args=(self._jobs,),
                                            name="stronghold-fetch-convert", daemon=True)
            self._thread.start()
            self._finalizer = weakref.finalize(self, self._jobs.put, None)
        self._jobs.put((lambda: self._convert(dst, master, dtype, fetch, after), pending))
        return pending

    def _convert(self, dst: torch.Tensor, master: torch.Tensor, dtype: torch.dtype, fetch: bool, after):
        """Conversion thread: the ring, piece by piece; returns the last copy's event."""
        t0 = time.perf_counter()
        if not self._buffers:
            self._buffers = [self._allocate(self.buffer_bytes, transfer=True) for _ in range(self.num_buffers)]
            self._events = [_DONE] * self.num_buffers
        piece = self._piece_numel(dtype)
        event = _DONE
        for start in range(0, master.numel(), piece):
            part = self._part(master, start, piece)
            k = self._next
            self._next = (k + 1) % self.num_buffers
            self.transfer.host_wait(self._events[k])  # the copy that last read this buffer has landed
            staged = self._buffers[k][: part.numel() * dtype.itemsize]
            staged.view(dtype).copy_(part)
            first = start * dtype.itemsize
            # One fetch in the ledger, however many pieces.
            event = self._events[k] = self.transfer.copy_h2d(dst[first: first + staged.numel()], staged,
                                                             fetch=fetch and start == 0, after=after)
        self.transfer.stats.add("convert_s", time.perf_counter() - t0)
        return event

    def _piece_numel(self, dtype: torch.dtype) -> int:
        return max(self.buffer_bytes // dtype.itemsize, 1)  # elements per buffer

    def _part(self, master, start: int, piece: int) -> torch.Tensor:
        """Elements ``[start, start + piece)`` of ``master`` (fp32), read from disk if it is there."""
        stop = min(start + piece, master.numel())
        if isinstance(master, torch.Tensor):
            return master[start:stop]
        need = master.scratch_bytes(piece)
        if self._scratch is None or self._scratch.numel() < need:  # one piece, for the thread that converts
            self._release_scratch()
            self._scratch = _aligned_empty(need)  # page-aligned: O_DIRECT reads into it
            self.transfer.ledger.host_alloc(self._scratch.numel(), pinned=False)
        return master.read(start, stop, self._scratch)

    def _release_scratch(self) -> None:
        if self._scratch is not None:
            self.transfer.ledger.host_free(self._scratch.numel(), pinned=False)
            self._scratch = None

    def close(self) -> None:
        """Finishes the queued conversions and stops the thread (restarted by the next fetch)."""
        if self._thread is not None:
            self._finalizer.detach()
            self._jobs.put(None)
            self._thread.join()
            self._thread = self._jobs = None
        self._release_scratch()

    @property
    def allocated_bytes(self) -> int:
        return sum(b.numel() for b in self._buffers)

    @property
    def scratch_bytes(self) -> int:
        """The buffer masters on disk are read into before their conversion (``nvme_masters``)."""
        return self._scratch.numel() if self._scratch is not None else 0


class TransferContext:
    """Owns the copy streams (or their CPU stand-ins) and books traffic in the ledger."""

    def __init__(self, device: torch.device, ledger: MemoryLedger, stats: EngineStats) -> None:
        self.device = device
        self.ledger = ledger
        self.stats = stats
        self.mode: TransferMode
        self._timed: list[tuple[str, object, object]] = []  # CUDA: (counter, start event, end event)
        self._timed_lock = threading.RLock()  # collect_timings runs inside an append past 512
        if device.type == "cuda":
            self.mode = "cuda"
            self.h2d_stream = torch.cuda.Stream(device=device)
            self.d2h_stream = torch.cuda.Stream(device=device)
        else:
            delay = simulated_copy_delay()
            self.mode = "sync" if delay is None else "delayed"
            self.h2d_stream = self.d2h_stream = None
            if delay is not None:
                self._h2d_thread = _CopyThread("stronghold-sim-h2d", delay)
                self._d2h_thread = _CopyThread("stronghold-sim-d2h", delay)

    @property
    def is_cuda(self) -> bool:
        return self.mode == "cuda"

    @property
    def is_async(self) -> bool:
        """Whether copies complete later than they are issued (CUDA, or the delayed mode)."""
        return self.mode != "sync"

    def compute_event(self):
        """An event on the compute stream (CUDA); on the CPU compute is the host thread: done."""
        if self.mode != "cuda":
            return _DONE
        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream(self.device))
        return ev

    # ------------------------------------------------------------------ host -> device
    def copy_h2d(self, dst: torch.Tensor, src: torch.Tensor, *, fetch: bool, after=None):
        """Starts copying host ``src`` into device ``dst``; returns the event that says it landed.
        ``after``: the compute event the copy waits for, when the caller recorded it on the
        training thread earlier (a copy issued by another thread); by default the compute queued
        now."""
        self.ledger.count_h2d(src.numel() * src.element_size(), fetch=fetch)
        if self.mode == "sync":
            t0 = time.perf_counter()
            dst.copy_(src)
            self.stats.add("h2d_s", time.perf_counter() - t0)
            return _DONE
        if self.mode == "delayed":
            return self._h2d_thread.submit(dst, src)
        after = self.compute_event() if after is None else after  # see [Note: allocation stream]
        start, event = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(self.h2d_stream):
            self.h2d_stream.wait_event(after)
            start.record(self.h2d_stream)
            dst.copy_(src, non_blocking=True)
            event.record(self.h2d_stream)
        with self._timed_lock:  # the conversion thread issues copies too
            self._timed.append(("h2d_s", start, event))
        if len(self._timed) > 512:  # forward-only loops (eval, generate) never reach a backward's end
            self.collect_timings()
        return event

    def device_wait(self, event) -> None:
        """Orders compute after ``event``: the compute stream waits (CUDA) or the host does."""
        if isinstance(event, PendingFetch):
            event = event.issued()  # a stream cannot wait for an event not yet recorded
        if self.mode == "cuda":
            torch.cuda.current_stream(self.device).wait_event(event)
        elif not event.query():
            self._block_on(event, host_side=False)  # stands in for the stream's wait: not the host's
        elif isinstance(event, _HostEvent):
            event.synchronize()  # re-raises a failed simulated copy

    # ------------------------------------------------------------------ device -> host
    def copy_d2h(self, dst: torch.Tensor, src: torch.Tensor, *, continues: bool = False):
        """Starts copying device ``src`` into host ``dst`` after the compute work queued so far.

        The caller keeps ``src`` alive and ``dst`` unread until `host_wait` on the returned
        event (see [Note: D2H lifetime]). ``continues=True``: a later piece of a copy started
        before from the same source (any thread may issue it): it follows that copy on the copy
        stream, which already waited for the compute that wrote ``src``, and is not timed."""
        self.ledger.count_d2h(src.numel() * src.element_size())
        if self.mode == "sync":
            t0 = time.perf_counter()
            dst.copy_(src)
            self.stats.add("d2h_s", time.perf_counter() - t0)
            return _DONE
        if self.mode == "delayed":
            return self._d2h_thread.submit(dst, src)
        if continues:
            event = torch.cuda.Event()
            with torch.cuda.stream(self.d2h_stream):
                dst.copy_(src, non_blocking=True)
                event.record(self.d2h_stream)
            return event
        ready = self.compute_event()
        start, event = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(self.d2h_stream):
            self.d2h_stream.wait_event(ready)
            start.record(self.d2h_stream)
            dst.copy_(src, non_blocking=True)
            event.record(self.d2h_stream)
        with self._timed_lock:
            self._timed.append(("d2h_s", start, event))
        if len(self._timed) > 512:
            self.collect_timings()
        return event

    def collect_timings(self) -> None:
        """CUDA: adds the measured durations of the copies that have completed to the counters.

        Copy times come from events on the copy streams, not from the host clock (the host
        returns from a non-blocking copy at once). Only completed pairs are read, so this never
        waits; it runs at the end of each backward and when the counters are read."""
        with self._timed_lock:
            pending = []
            for counter, start, end in self._timed:
                if end.query():
                    self.stats.add(counter, start.elapsed_time(end) / 1e3)
                else:
                    pending.append((counter, start, end))
            self._timed = pending

    def book_h2d(self, nbytes: int, *, fetch: bool) -> None:
        """The ``"sync"`` mode's zero-copy fetch (unit.py, [Note: aliasing the host on a CPU
        device]): the bytes a fetch would copy are booked as crossed."""
        assert self.mode == "sync"
        self.ledger.count_h2d(nbytes, fetch=fetch)

    def book_d2h(self, nbytes: int):
        """The ``"sync"`` mode's zero-copy device-to-host transfer: the bytes are host memory
        already; they are booked as crossed, and the returned event is complete."""
        assert self.mode == "sync"
        self.ledger.count_d2h(nbytes)
        return _DONE

    def host_wait(self, event) -> None:
        """Blocks the host until ``event`` completed; afterwards the copy's bytes may be read."""
        if isinstance(event, PendingFetch):
            event = event.issued()
        if not event.query():
            self._block_on(event)
        elif isinstance(event, _HostEvent):
            event.synchronize()  # re-raises a failed simulated copy

    def _block_on(self, event, host_side: bool = True) -> None:
        t0 = time.perf_counter()
        event.synchronize()
        self.stats.add("blocked_s", time.perf_counter() - t0)
        if host_side:
            self.stats.count_host_block()

    def stop_threads(self) -> None:
        """Lands every queued copy and joins the simulated copy threads (``"delayed"`` mode);
        the next copy starts them again."""
        if self.mode == "delayed":
            self._h2d_thread.close()
            self._d2h_thread.close()

    def close(self) -> None:
        if self.mode == "delayed":
            self.stop_threads()
            self.mode = "sync"
