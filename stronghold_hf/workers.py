"""CPU worker threads that run the per-block optimizer updates.

Updates are submitted in forward order, one ticket per block. The training thread waits on
a block's ticket only when it needs that block again (its next prefetch, its next gradient,
a ``state_dict``), so block ``i``'s update overlaps with the transfer and compute of the blocks
before it. The torch kernels release the GIL, so the workers run truly in parallel with the
training thread.

A worker's exception is stored on the ticket and re-raised in the training thread, with the
block's name, at the first wait. The threads are created lazily and `shutdown` joins them,
so nothing outlives training.
"""

from __future__ import annotations

import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable


def available_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


class UpdateTicket:
    """One block's pending update; `wait` returns when it has finished (or raises its error)."""

    __slots__ = ("block_index", "block_fqn", "future")

    def __init__(self, block_index: int, block_fqn: str, future: Future) -> None:
        self.block_index = block_index
        self.block_fqn = block_fqn
        self.future = future

    def done(self) -> bool:
        return self.future.done()

    def wait(self) -> float:
        """Blocks until done; returns the seconds spent blocked."""
        t0 = time.perf_counter()
        try:
            self.future.result()
        except BaseException as err:  # surface in the training thread, naming the block
            raise RuntimeError(f"stronghold: the CPU optimizer update of block {self.block_fqn} failed: {err!r}") from err
        return time.perf_counter() - t0


class CPUWorkers:
    """A lazily started thread pool sized from the available cores."""

    def __init__(self, num_threads: int, intra_op_threads: int | None = None) -> None:
        assert num_threads >= 1
        self.num_threads = num_threads
        cores = available_cores()
        self.intra_op_threads = intra_op_threads or max(1, cores // num_threads)
        self._pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()

    def _init_thread(self) -> None:
        import torch

        # OpenMP's thread count is a per-thread setting: cap each worker's team so several
        # workers do not oversubscribe the cores (see docs/performance.md, CPU Adam).
        torch.set_num_threads(self.intra_op_threads)

    def submit(self, block_index: int, block_fqn: str, fn: Callable[[], None]) -> UpdateTicket:
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(
                    max_workers=self.num_threads, thread_name_prefix="stronghold-cpu-adam", initializer=self._init_thread
                )
            future = self._pool.submit(fn)
        return UpdateTicket(block_index, block_fqn, future)

    def shutdown(self) -> None:
        """Joins the threads; a later `submit` starts fresh ones."""
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)

    @property
    def running(self) -> bool:
        return self._pool is not None
