"""A checkpoint file read through a memory map, whose pages are given back as they are used.

Resuming must not hold the optimizer's state twice (transformers #17258: a full ``torch.load``
holds the saved state while the optimizer holds its own). ``torch.load(mmap=True)`` reads
nothing up front: a saved tensor is a read-only, copy-on-write view of the file, paged in when
it is read. The pages it read would stay in the process (its RSS) until the last view dies.
`MappedCheckpoint.release` drops them as soon as the tensor has been copied where it belongs
(``madvise(MADV_DONTNEED)`` on a private file mapping only forgets clean pages: a later read
pages them in again from the file), so a load that copies tensor by tensor, or unit by unit
(the NVMe tier), holds one tensor's pages of the file at a time.

Only tensors inside this file's mapping are released: a tensor in anonymous memory would
lose its contents, so anything else is left alone.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import mmap
import os
import sys
from typing import Any

import torch

_MADV_DONTNEED = 4
_log = logging.getLogger(__name__)


class MappedCheckpoint:
    """``torch.load(path, mmap=True)`` and the address ranges of that mapping."""

    def __init__(self, path: str) -> None:
        self.path = os.path.realpath(path)
        try:
            self.state: Any = torch.load(self.path, map_location="cpu", weights_only=True, mmap=True)
        except (RuntimeError, OSError) as err:
            # A file torch cannot map (the legacy format, a file system without mmap): read it
            # whole, as torch.load does; nothing is then released.
            _log.info(f"{self.path} is read whole, not mapped ({err})")
            self.state = torch.load(self.path, map_location="cpu", weights_only=True)
            self._ranges, self._madvise, self.released_bytes = [], None, 0
            return
        self._ranges = _mapped_ranges(self.path)
        self._madvise = _libc_madvise() if self._ranges else None
        self.released_bytes = 0

    def release(self, tensor: torch.Tensor) -> None:
        """Gives back the pages of the file that ``tensor`` read (it must not be read again
        through this view without paging them in anew; its values stay correct)."""
        if self._madvise is None or tensor.numel() == 0:
            return
        start = tensor.data_ptr()
        end = start + tensor.numel() * tensor.element_size()
        if not any(lo <= start and end <= hi for lo, hi in self._ranges):
            return
        page = mmap.PAGESIZE
        first, last = -(-start // page) * page, end // page * page  # whole pages inside the tensor only
        if last > first:
            self._madvise(ctypes.c_void_p(first), ctypes.c_size_t(last - first), _MADV_DONTNEED)
            self.released_bytes += last - first


def _mapped_ranges(path: str) -> list[tuple[int, int]]:
    """The address ranges where this process maps ``path`` (Linux; empty elsewhere)."""
    if not sys.platform.startswith("linux"):
        return []
    ranges = []
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            if len(fields) == 6 and fields[5].strip() == path:
                lo, hi = fields[0].split("-")
                ranges.append((int(lo, 16), int(hi, 16)))
    return ranges


def _libc_madvise():
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    madvise = libc.madvise
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    madvise.restype = ctypes.c_int
    return madvise
