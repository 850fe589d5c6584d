"""Host arenas and the device slot pool.

Why arenas: the CUDA host allocator rounds every pinned allocation up to a power of two, so
pinning thousands of per-parameter tensors can nearly double host RAM. We pin a few large
arenas and hand out aligned slices. On a machine without CUDA pinning is impossible, so the
arenas are ordinary (pageable) memory and copies are synchronous; the layout is the same.

Why a slot pool: each block's device copy is one flat allocation ("slot") that its
parameters view. Evicting a block resizes that allocation's storage to zero bytes, so the
parameters keep their identity (and autograd's saved views of them stay valid for the
refill before backward); fetching resizes it back. On CUDA the bytes come from torch's
caching allocator, which after the first step hands the same ``W + 1`` segments back
round-robin, so steady state performs no ``cudaMalloc``. `DeviceSlotPool` is the accounting
that makes the ``W + 1`` bound explicit and checked.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass

import torch

#: Elements of each parameter start on a 64-byte boundary inside a flat buffer, so
#: vectorised kernels (CPU Adam, the copy kernels) see aligned rows.
ALIGN_BYTES = 64


def aligned_numel(numel: int, dtype: torch.dtype) -> int:
    per = max(1, ALIGN_BYTES // torch.empty((), dtype=dtype).element_size())
    return int(math.ceil(numel / per) * per)


@dataclass(frozen=True, slots=True)
class ParamSlice:
    """Where one parameter lives inside its block's flat buffers."""

    name: str
    offset: int  # in elements
    numel: int
    shape: torch.Size


def layout_params(named_shapes: list[tuple[str, torch.Size]], dtype: torch.dtype) -> tuple[list[ParamSlice], int]:
    """Packs parameters back to back with 64-byte alignment; returns slices and total elements."""
    slices: list[ParamSlice] = []
    offset = 0
    for name, shape in named_shapes:
        numel = int(math.prod(shape)) if len(shape) else 1
        slices.append(ParamSlice(name, offset, numel, torch.Size(shape)))
        offset += aligned_numel(numel, dtype)
    return slices, max(offset, 1)


def can_pin() -> bool:
    return torch.cuda.is_available()


class HostArena:
    """A few big host allocations sliced into flat per-block buffers.

    One arena per dtype. An arena grows in chunks of at least ``chunk_bytes``; each chunk is
    pinned once (when ``pin`` and CUDA is available). Slices are never freed individually:
    the engine's buffers live as long as the engine.
    """

    def __init__(self, *, pin: bool, chunk_bytes: int = 256 << 20) -> None:
        self.pin = bool(pin and can_pin())
        self.chunk_bytes = int(chunk_bytes)
        self._chunks: dict[torch.dtype, list[torch.Tensor]] = {}
        self._cursor: dict[torch.dtype, int] = {}
        self._lock = threading.Lock()
        self.bytes_reserved = 0

    def allocate(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """Returns a zeroed 1-D tensor of ``numel`` elements (64-byte aligned start)."""
        numel = aligned_numel(numel, dtype)
        with self._lock:
            chunks = self._chunks.setdefault(dtype, [])
            cursor = self._cursor.get(dtype, 0)
            if not chunks or cursor + numel > chunks[-1].numel():
                itemsize = torch.empty((), dtype=dtype).element_size()
                chunk_numel = max(numel, self.chunk_bytes // itemsize)
                chunk = torch.zeros(chunk_numel, dtype=dtype, pin_memory=self.pin)
                chunks.append(chunk)
                self.bytes_reserved += chunk_numel * itemsize
                cursor = 0
            out = chunks[-1][cursor : cursor + numel]
            self._cursor[dtype] = cursor + numel
            return out


class DeviceSlotPool:
    """Counts device slots in use and enforces the resident bound.

    ``capacity`` is ``W + 1``: the working window plus the one block being prefetched.
    `acquire` raises if a caller would exceed it, which turns a scheduling bug into an
    immediate, named failure instead of a silent out-of-memory an hour into a run.
    """

    def __init__(self, capacity: int, slot_bytes: int) -> None:
        assert capacity >= 1
        self.capacity = capacity
        self.slot_bytes = slot_bytes
        self._in_use: set[int] = set()
        self.peak_in_use = 0

    def acquire(self, block_index: int) -> None:
        assert block_index not in self._in_use, f"block {block_index} already holds a slot"
        if len(self._in_use) >= self.capacity:
            raise RuntimeError(
                f"stronghold: slot pool exhausted ({self.capacity} slots, in use by blocks "
                f"{sorted(self._in_use)}), asked for block {block_index}. This is a scheduling bug; "
                "please report it with the model class."
            )
        self._in_use.add(block_index)
        self.peak_in_use = max(self.peak_in_use, len(self._in_use))

    def release(self, block_index: int) -> None:
        assert block_index in self._in_use, f"block {block_index} holds no slot"
        self._in_use.discard(block_index)

    @property
    def in_use(self) -> frozenset[int]:
        return frozenset(self._in_use)

    def resize(self, capacity: int) -> None:
        """Changes the capacity (after the auto window size is chosen); only while idle."""
        assert not self._in_use, "resize the slot pool only while no block is resident"
        self.capacity = capacity
