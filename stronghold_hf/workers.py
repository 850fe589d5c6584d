"""The host worker: one thread that runs the engine's CPU work.

Two kinds of task go through it:

* gradient folds, during backward: wait for a block's device-to-host copy, then copy or add
  the staged gradient into the block's fp32 gradient (``grads.py``);
* optimizer updates: CPU Adam on one block's masters, during backward when the step is
  speculated (``speculation.py``), and after ``optimizer.step()`` in the order the next
  forward needs the blocks (block 0 first); with them the undos of speculative updates.

One thread, not a pool: each task runs with every CPU thread inside its kernel, so block 0
is ready after about 1/N of the update work instead of when the first ``cores`` blocks all
are (a pool of one-thread workers updates blocks side by side, each at a fraction of the
memory bandwidth). The kernels release the GIL, so the training thread keeps launching
device work meanwhile.

[Note: urgent tasks] A fold is short, and the backward may be waiting for it: the fold frees
a gradient lane (``grads.py``), and with all ``K`` lanes in flight the next block's backward
cannot start until one is free. An update is long (a whole block's CPU Adam). Run in
submission order, a speculating backward queues each fold behind the updates of the blocks
before it, and the autograd thread waits for those updates, not for the copy. So a task is
submitted *urgent* (the folds) or not: once the task in hand finishes, the worker runs the
oldest urgent task that may go, and an ordinary one only when none may.

What may go is decided by the task's *unit* (the block index it reads and writes; ``None``:
anything). Two tasks *conflict* when they name the same unit or either names none, and
conflicting tasks always run in submission order; only a task that conflicts with nothing
queued before it may pass those tasks. That is every ordering the engine relies on, and it is
per unit: a unit's speculative update reads the gradient its fold wrote (the fold is
submitted first, ``flush.py``); a fold that adds more gradient into a speculated unit is
submitted after that unit's undo, which must read the gradient the update read; a second
fold of a unit adds onto what the first copied. Ordinary tasks never pass each other (the
step's updates stay in the order the next forward needs them), and urgent tasks of other
units may pass a fold held back by its own unit's update.

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
import threading
import time
import weakref
from typing import Callable

_allocate_lock = threading.Lock


def available_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


class Ticket:
    """One submitted task; `wait` returns when it has finished (or raises its error).

    A lock held from submission to completion, not a ``threading.Event`` (a condition and a
    lock, about 1.5 us to make): one is made per fold and per update, on the autograd and
    training threads. A task run inline is finished when its ticket is made: no lock at all."""

    __slots__ = ("label", "_lock", "_finished", "_error", "finished_at")

    def __init__(self, label: str | tuple[str, ...], *, finished: bool = False) -> None:
        self.label = label  # a string, or its pieces (joined only when the task fails)
        self._finished = finished
        self._lock = None if finished else _allocate_lock()
        if self._lock is not None:
            self._lock.acquire()
        self._error: BaseException | None = None
        self.finished_at: float | None = None

    def done(self) -> bool:
        return self._finished

    def wait(self) -> float:
        """Blocks until done; returns the seconds spent blocked. Re-raises the task's error."""
        waited = 0.0
        if not self._finished:
            t0 = time.perf_counter()
            self._lock.acquire()
            self._lock.release()
            waited = time.perf_counter() - t0
        if self._error is not None:
            label = self.label if isinstance(self.label, str) else "".join(self.label)
            raise RuntimeError(f"stronghold: {label} failed: {self._error!r}") from self._error
        return waited

    def _finish(self) -> None:
        self.finished_at = time.perf_counter()
        self._finished = True
        if self._lock is not None:
            self._lock.release()


class _Task:
    __slots__ = ("fn", "ticket", "unit", "urgent")

    def __init__(self, fn: Callable[[], None] | None, ticket: Ticket | None, unit: int | None, urgent: bool) -> None:
        self.fn = fn  # None: the stop marker
        self.ticket = ticket
        self.unit = unit
        self.urgent = urgent

    def conflicts(self, other: _Task) -> bool:
        return self.unit is None or other.unit is None or self.unit == other.unit


class _TaskQueue:
    """The tasks not started yet, in submission order; `take` picks the next one to run
    ([Note: urgent tasks])."""

    def __init__(self) -> None:
        self._lock = threading.Lock()  # held through the condition, or directly (no Python call)
        self._cond = threading.Condition(self._lock)
        self._tasks: list[_Task] = []
        self._urgent = 0  # urgent tasks among them

    def put(self, task: _Task, wake: bool = True) -> None:
        """Queues ``task``; ``wake=False`` leaves an idle worker asleep until the next `wake`."""
        with self._lock:
            self._tasks.append(task)
            self._urgent += task.urgent
            if wake:
                self._cond.notify()

    def wake(self) -> None:
        with self._lock:
            self._cond.notify()

    def stop(self) -> None:
        """The stop marker: conflicts with everything, so it runs after all submitted before."""
        self.put(_Task(None, None, None, False))

    def take(self) -> _Task:
        with self._cond:
            while not self._tasks:
                self._cond.wait()
            tasks = self._tasks
            pick = 0  # the oldest task conflicts with nothing before it
            if self._urgent:
                pick = _first_free_urgent(tasks)
            task = tasks.pop(pick)
            self._urgent -= task.urgent
            return task


class _DeferredWake:
    """``with worker.deferred_wake:`` tasks submitted inside wake an idle worker once, at the end.

    Waking a sleeping thread is a system call (about 5 us on the training thread in a VM);
    a unit's fold and its speculative update are submitted together, so they share one."""

    __slots__ = ("_worker",)

    def __init__(self, worker: "HostWorker") -> None:
        self._worker = worker

    def __enter__(self) -> None:
        self._worker._deferred += 1

    def __exit__(self, *exc) -> None:
        w = self._worker
        w._deferred -= 1
        if not w._deferred and w._wake_pending:
            w._wake_pending = False
            queue = w._queue
            if queue is not None:
                queue.wake()


def _first_free_urgent(tasks: list[_Task]) -> int:
    """The index of the oldest urgent task that conflicts with no task before it (0 if none):
    one pass, keeping the units seen so far (a task naming no unit conflicts with all)."""
    seen: set[int] = set()
    for i, t in enumerate(tasks):
        if t.unit is None:
            return 0  # it conflicts with every task: none after it may pass it, nor it any before
        if t.urgent and t.unit not in seen:
            return i
        seen.add(t.unit)
    return 0


class HostWorker:
    """A lazily started thread that runs submitted callables one at a time, urgent ones first
    where their unit allows ([Note: urgent tasks]); or, ``inline``, the submitting thread
    running each at once."""

    def __init__(self, num_threads: int, *, inline: bool = False) -> None:
        assert num_threads >= 1
        self.num_threads = num_threads
        self.inline = inline
        self._queue: _TaskQueue | None = None
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._deferred = 0  # depth of `deferred_wake` blocks
        self._wake_pending = False
        self.deferred_wake = _DeferredWake(self)

    def submit(self, label: str | tuple[str, ...], fn: Callable[[], None], *, unit: int | None = None,
               urgent: bool = False) -> Ticket:
        """Queues ``fn``; ``unit``: the unit whose state it reads and writes (``None``: any),
        ``urgent``: it may run before earlier tasks of other units (a fold)."""
        if self.inline:
            ticket = Ticket(label, finished=True)
            _run_one(fn, ticket, finish=False)
            ticket.finished_at = time.perf_counter()
            return ticket
        ticket = Ticket(label)
        queue = self._queue
        if queue is None:
            queue = self._start()
        deferred = self._deferred
        queue.put(_Task(fn, ticket, unit, urgent), wake=not deferred)
        if deferred:
            self._wake_pending = True
        return ticket

    def _start(self) -> _TaskQueue:
        """Starts the thread (at the first task, or the first after `shutdown`); returns its queue."""
        with self._lock:
            if self._thread is None:
                self._queue = _TaskQueue()
                # The thread holds only its queue, so an engine that is dropped without close()
                # still lets it end (the finalizer posts the stop marker).
                self._thread = threading.Thread(target=_run, args=(self._queue, self.num_threads),
                                                name="stronghold-host-worker", daemon=True)
                self._thread.start()
                self._finalizer = weakref.finalize(self, self._queue.stop)
            return self._queue

    def shutdown(self) -> None:
        """Runs what was submitted, then joins the thread; a later `submit` starts a new one."""
        with self._lock:
            thread, jobs = self._thread, self._queue
            self._thread = self._queue = None
        if thread is not None:
            self._finalizer.detach()
            jobs.stop()
            thread.join()

    @property
    def running(self) -> bool:
        return self._thread is not None


def _run(jobs: _TaskQueue, num_threads: int) -> None:
    import torch

    # OpenMP's team size is a per-thread setting: this thread uses all the cores it was given.
    from .transfer import simulated_copy_delay

    torch.set_num_threads(num_threads)
    while True:
        task = jobs.take()
        if task.fn is None:
            return
        delay = simulated_copy_delay()  # testing.simulated_device: host work is slow, as on a large model,
        if delay:                       # so a read that does not wait for it sees old values
            time.sleep(delay)
        _run_one(task.fn, task.ticket)
        del task  # do not keep the last task (and what it references) alive while idle


def _run_one(fn: Callable[[], None], ticket: Ticket, finish: bool = True) -> None:
    try:
        fn()
    except BaseException as err:  # surfaced in the training thread by Ticket.wait
        ticket._error = err
    if finish:
        ticket._finish()
