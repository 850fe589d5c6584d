"""Scratch files on a local disk: an engine's own locked directory, and preallocated files
read and written in page-aligned chunks on a thread pool (the NVMe tier's, ``nvme.py``).

A directory is ``stronghold-<host>-<pid>-<token>`` under the configured root, created
exclusively (two engines never share one) and locked with ``flock`` while its engine lives; one
whose lock nobody holds was left by a killed run and is removed by the next engine on that root,
with a log line. A file is preallocated (``posix_fallocate``: a full disk is an error naming the
bytes needed and free, before anything is trained) and read and written with ``os.preadv`` /
``os.pwritev`` (which release the GIL) in chunks of `IO_CHUNK`, with ``O_DIRECT`` where the file
system takes it (the page cache does not quietly hold the data again) and otherwise buffered,
followed by ``posix_fadvise(DONTNEED)``.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import shutil
import socket
import threading
import uuid
import weakref
from concurrent.futures import Future, ThreadPoolExecutor

import torch
from torch import Tensor

logger = logging.getLogger("stronghold_hf")

PAGE = 4096
#: Bytes per I/O request: large enough to stream, small enough that a unit's read spreads
#: over the pool's threads (several requests in flight is what an NVMe drive wants).
IO_CHUNK = 8 << 20
SWAP_PREFIX = "stronghold-"
_LOCK_NAME = "lock"


def _page_up(n: int) -> int:
    return -(-n // PAGE) * PAGE


def _format_bytes(n: int) -> str:
    return f"{n / 1e9:.2f} GB"


# ---------------------------------------------------------------------------- the directory
def _try_lock(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except OSError as err:
        if err.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            return False
        raise


def _dir_bytes(path: str) -> int:
    total = 0
    for name in os.listdir(path):
        with contextlib.suppress(OSError):
            total += os.stat(os.path.join(path, name)).st_blocks * 512
    return total


def remove_stale_directories(root: str) -> list[str]:
    """Removes the swap directories under ``root`` whose lock no process holds (left by a
    killed run); returns their paths. Live ones (another engine's) are left alone."""
    removed = []
    for name in sorted(os.listdir(root)):
        path = os.path.join(root, name)
        if not name.startswith(SWAP_PREFIX) or not os.path.isdir(path):
            continue
        try:
            fd = os.open(os.path.join(path, _LOCK_NAME), os.O_RDWR)
        except FileNotFoundError:
            fd = None  # killed between mkdir and the lock: nobody owns it
        try:
            if fd is not None and not _try_lock(fd):
                continue
            size = _dir_bytes(path)
            shutil.rmtree(path, ignore_errors=True)
            logger.warning("stronghold: removed the stale NVMe swap directory %s (%s) left by a run that ended "
                           "without cleaning up.", path, _format_bytes(size))
            removed.append(path)
        finally:
            if fd is not None:
                os.close(fd)
    return removed


def _remove_directory(path: str, lock_fd: int) -> None:
    shutil.rmtree(path, ignore_errors=True)
    with contextlib.suppress(OSError):
        os.close(lock_fd)


class SwapDirectory:
    """This engine's own directory under ``root``: created exclusively, locked while it lives,
    removed by `remove` or at interpreter exit."""

    def __init__(self, root: str) -> None:
        root = os.path.abspath(os.path.expanduser(root))
        try:
            os.makedirs(root, exist_ok=True)
        except OSError as err:
            raise ValueError(f"StrongholdConfig.nvme_path={root!r} cannot be created ({err.strerror}); "
                             "point it at a writable directory on a fast local disk.") from None
        if not os.access(root, os.W_OK | os.X_OK):
            raise ValueError(f"StrongholdConfig.nvme_path={root!r} is not writable; "
                             "point it at a writable directory on a fast local disk.")
        remove_stale_directories(root)
        self.root = root
        self.path = os.path.join(root, f"{SWAP_PREFIX}{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}")
        os.mkdir(self.path)  # exclusive: two engines never share a directory
        lock_fd = os.open(os.path.join(self.path, _LOCK_NAME), os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        if not _try_lock(lock_fd):
            raise RuntimeError(f"stronghold: could not lock {self.path}")
        self._finalizer = weakref.finalize(self, _remove_directory, self.path, lock_fd)

    def file(self, name: str) -> str:
        return os.path.join(self.path, name)

    def remove(self) -> None:
        self._finalizer()

    @property
    def removed(self) -> bool:
        return not self._finalizer.alive


# ---------------------------------------------------------------------------- the file
def _close_fd(fd: int) -> None:
    with contextlib.suppress(OSError):
        os.close(fd)


class StateFile:
    """One preallocated file read and written in page-aligned chunks on an I/O thread pool."""

    def __init__(self, path: str, nbytes: int, *, io_threads: int, holds: str = "the Adam state") -> None:
        self.path = path
        self.nbytes = nbytes
        self.holds = holds
        free = shutil.disk_usage(os.path.dirname(path)).free
        if nbytes > free:
            raise ValueError(self._full_message(free))
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL
        self.direct = hasattr(os, "O_DIRECT")
        try:
            fd = os.open(path, flags | (os.O_DIRECT if self.direct else 0), 0o600)
        except OSError as err:
            if err.errno != errno.EINVAL:
                raise
            self.direct = False  # the file system does not take O_DIRECT (tmpfs)
            fd = os.open(path, flags, 0o600)
        self.fd = fd
        self._finalizer = weakref.finalize(self, _close_fd, fd)
        self._preallocate(nbytes)
        if self.direct and not self._direct_works():
            os.close(fd)
            self._finalizer.detach()
            self.direct = False
            self.fd = os.open(path, os.O_RDWR)
            self._finalizer = weakref.finalize(self, _close_fd, self.fd)
        self.io_threads = io_threads
        self._pool: ThreadPoolExecutor | None = None  # started by the first request
        self._pool_lock = threading.Lock()
        logger.info("stronghold: NVMe tier: %s (%s) in %s (%s)", self.holds, _format_bytes(nbytes), path,
                    "O_DIRECT" if self.direct else "buffered I/O, pages dropped after use")

    def _full_message(self, free: int, nbytes: int | None = None) -> str:
        nbytes = self.nbytes if nbytes is None else nbytes
        return (f"StrongholdConfig.nvme_path: storing {self.holds} needs {_format_bytes(nbytes)} "
                f"({nbytes} bytes) in {os.path.dirname(os.path.dirname(self.path))}, which has "
                f"{_format_bytes(free)} free. Free space there or point nvme_path at a larger disk.")

    def _preallocate(self, nbytes: int) -> None:
        if nbytes == 0:
            return
        try:
            os.posix_fallocate(self.fd, 0, nbytes)
        except OSError as err:
            if err.errno == errno.ENOSPC:
                free = shutil.disk_usage(os.path.dirname(self.path)).free
                raise ValueError(self._full_message(free, nbytes)) from None
            if err.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
                raise
            os.ftruncate(self.fd, nbytes)  # no preallocation here: a full disk shows at the first write
            logger.warning("stronghold: %s does not preallocate (%s); the swap file is sparse.",
                           os.path.dirname(self.path), err.strerror)

    def grow(self, nbytes: int) -> None:
        """Makes the file at least ``nbytes`` long (preallocated: a full disk is the same error
        as at creation, raised before anything is written there)."""
        if nbytes <= self.nbytes:
            return
        free = shutil.disk_usage(os.path.dirname(self.path)).free
        if nbytes - self.nbytes > free:
            raise ValueError(self._full_message(free, nbytes))
        self._preallocate(nbytes)
        self.nbytes = nbytes

    def _direct_works(self) -> bool:
        """Some file systems accept O_DIRECT at open and refuse it at the first request."""
        probe = _aligned_empty(PAGE)
        try:
            os.preadv(self.fd, [memoryview(probe.numpy())], 0)
            return True
        except OSError as err:
            if err.errno == errno.EINVAL:
                return False
            raise

    def submit(self, write: bool, buf: Tensor, offset: int) -> list[Future]:
        """Requests covering ``buf`` (uint8, page-aligned) at file ``offset``; one per chunk."""
        view = memoryview(buf.numpy())
        with self._pool_lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=self.io_threads, thread_name_prefix="stronghold-nvme")
            return [self._pool.submit(self._io, write, view[i: i + IO_CHUNK], offset + i)
                    for i in range(0, len(view), IO_CHUNK)]

    def _io(self, write: bool, view: memoryview, offset: int) -> None:
        done, n = 0, len(view)
        while done < n:
            if write:
                k = os.pwritev(self.fd, [view[done:]], offset + done)
            else:
                k = os.preadv(self.fd, [view[done:]], offset + done)
            if k <= 0:
                raise OSError(errno.EIO, f"short {'write' if write else 'read'} at byte {offset + done} of {self.path}")
            done += k
        if not self.direct and hasattr(os, "posix_fadvise"):
            # Reads: drop what was just read. Writes: start writing back (pages still dirty
            # are dropped by the next call over them).
            os.posix_fadvise(self.fd, offset, n, os.POSIX_FADV_DONTNEED)

    def run(self, write: bool, buf: Tensor, offset: int) -> None:
        """`submit`, then waits; an I/O error is raised naming the file."""
        futures = self.submit(write, buf, offset)
        errors = [f.exception() for f in futures]
        err = next((e for e in errors if e is not None), None)
        if err is not None:
            raise RuntimeError(f"stronghold: NVMe tier I/O on {self.path} failed: {err!r}") from err

    def map(self, offset: int, nbytes: int) -> Tensor:
        """uint8 ``[nbytes]`` mapping ``[offset, offset + nbytes)`` copy-on-write: reads see the
        file, writes stay private (never reach the file) and never fault on a read-only page."""
        import numpy as np

        if nbytes == 0:
            return torch.empty(0, dtype=torch.uint8)
        return torch.from_numpy(np.memmap(self.path, dtype=np.uint8, mode="c", offset=offset, shape=(nbytes,)))

    def stop_threads(self) -> None:
        """Finishes the requests in flight and joins the I/O threads; the next request starts
        them again (lifecycle.py: no engine thread outlives training). A request made while
        they stop (a read-ahead started from a completion) is refused with ``RuntimeError``
        rather than started on a new pool; the owner stops its read-ahead first."""
        with self._pool_lock:
            pool = self._pool
        if pool is None:
            return
        pool.shutdown(wait=True)
        with self._pool_lock:
            if self._pool is pool:
                self._pool = None

    def close(self) -> None:
        self.stop_threads()
        self._finalizer()


def _aligned_empty(nbytes: int) -> Tensor:
    raw = torch.empty(nbytes + PAGE, dtype=torch.uint8)
    start = (-raw.data_ptr()) % PAGE
    return raw[start: start + nbytes]
