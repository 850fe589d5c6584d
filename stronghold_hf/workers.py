"""The host worker: one thread that runs the engine's CPU work in order.

Two kinds of task go through it, in submission order:

* gradient folds, during backward: wait for a block's device-to-host copy, then copy or add
  the staged gradient into the block's fp32 gradient (``grads.py``);
* optimizer updates, after ``optimizer.step()``: CPU Adam on one block's masters, in the
  order the next forward needs the blocks (block 0 first).

One thread, not a pool: each task runs with every CPU thread inside its kernel, so block 0
is ready after about 1/N of the update work instead of when the first ``cores`` blocks all
are (a pool of one-thread workers updates blocks side by side, each at a fraction of the
memory bandwidth). The kernels release the GIL, so the training thread keeps launching
device work meanwhile.

A task's exception is stored on its ticket and re-raised in the training thread, naming the
block, at the first wait. The thread starts lazily and `shutdown` joins it, so nothing
outlives training.

*Inline* mode runs each task at once on the submitting thread, with the same tickets. It is
what ``StrongholdConfig(host_worker="auto")`` picks when the compute device is the CPU itself:
there is no device work to overlap the host work with, and a worker thread would only compete
with the training thread for the same cores (measured: the embedded default at 0.86-0.91x of
plain training with a worker thread and speculation, docs/performance.md).
"""

from __future__ import annotations

import os
import queue
import threading
import time
import weakref
from typing import Callable


def available_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


class Ticket:
    """One submitted task; `wait` returns when it has finished (or raises its error)."""

    __slots__ = ("label", "_done", "_error", "finished_at")

    def __init__(self, label: str) -> None:
        self.label = label
        self._done = threading.Event()
        self._error: BaseException | None = None
        self.finished_at: float | None = None

    def done(self) -> bool:
        return self._done.is_set()

    def wait(self) -> float:
        """Blocks until done; returns the seconds spent blocked. Re-raises the task's error."""
        t0 = time.perf_counter()
        self._done.wait()
        if self._error is not None:
            raise RuntimeError(f"stronghold: {self.label} failed: {self._error!r}") from self._error
        return time.perf_counter() - t0


class HostWorker:
    """A lazily started thread that runs submitted callables one after another (or, ``inline``,
    the submitting thread running each at once)."""

    def __init__(self, num_threads: int, *, inline: bool = False) -> None:
        assert num_threads >= 1
        self.num_threads = num_threads
        self.inline = inline
        self._queue: queue.SimpleQueue | None = None
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def submit(self, label: str, fn: Callable[[], None]) -> Ticket:
        ticket = Ticket(label)
        if self.inline:
            _run_one(fn, ticket)
            return ticket
        with self._lock:
            if self._thread is None:
                self._queue = queue.SimpleQueue()
                # The thread holds only its queue, so an engine that is dropped without close()
                # still lets it end (the finalizer posts the stop marker).
                self._thread = threading.Thread(target=_run, args=(self._queue, self.num_threads),
                                                name="stronghold-host-worker", daemon=True)
                self._thread.start()
                self._finalizer = weakref.finalize(self, self._queue.put, None)
            self._queue.put((fn, ticket))
        return ticket

    def shutdown(self) -> None:
        """Runs what was submitted, then joins the thread; a later `submit` starts a new one."""
        with self._lock:
            thread, jobs = self._thread, self._queue
            self._thread = self._queue = None
        if thread is not None:
            self._finalizer.detach()
            jobs.put(None)
            thread.join()

    @property
    def running(self) -> bool:
        return self._thread is not None


def _run(jobs: queue.SimpleQueue, num_threads: int) -> None:
    import torch

    # OpenMP's team size is a per-thread setting: this thread uses all the cores it was given.
    from .transfer import simulated_copy_delay

    torch.set_num_threads(num_threads)
    while True:
        job = jobs.get()
        if job is None:
            return
        fn, ticket = job
        delay = simulated_copy_delay()  # testing.simulated_device: host work is slow, as on a large model,
        if delay:                       # so a read that does not wait for it sees old values
            time.sleep(delay)
        _run_one(fn, ticket)
        del fn, ticket, job  # do not keep the last task (and what it references) alive while idle


def _run_one(fn: Callable[[], None], ticket: Ticket) -> None:
    try:
        fn()
    except BaseException as err:  # surfaced in the training thread by Ticket.wait
        ticket._error = err
    ticket.finished_at = time.perf_counter()
    ticket._done.set()
