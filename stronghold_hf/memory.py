"""Host memory and block layouts: what each block owns on the host, and how it is pinned.

Host bytes per parameter set the largest model one machine can train (MegaTrain, 2026:
~12 B/param; ZeRO-Offload: 16). This module decides where every byte goes:

* A *trainable* parameter has an fp32 master (4 B), an fp32 gradient (4 B) and, in the CPU
  optimizer, two fp32 Adam moments (8 B): 16 B. When the device computes in bf16/fp16 a
  compute-dtype copy (2 B) is what crosses the link: 18 B. With fp32 compute the master
  itself crosses, so nothing is duplicated.
* A *frozen* parameter keeps only its stored bytes (4 B fp32, 2 B bf16): no master, no
  gradient, no optimizer state. It crosses the link in its stored dtype.

The bytes that cross the link form the block's *image*: one flat host buffer laid out
exactly like the block's device slot, so a fetch is one copy. Only transfer buffers want to
be page-locked (the image, and the gradient staging buffers in ``grads.py``); masters,
gradients and Adam state stay pageable.

[Note: pinning without rounding] ``torch.empty(..., pin_memory=True)`` goes through the CUDA
caching host allocator, which rounds every request up to a power of two: a 260 MiB block
would take 512 MiB. We allocate pageable memory of the exact size and page-lock it in place
with ``cudaHostRegister`` instead, up to ``StrongholdConfig.max_pinned_bytes``; past the
bound, or when the system refuses, the buffer stays pageable (correct, slower copies) and
the ledger says which is which.
"""

from __future__ import annotations

import ctypes
import math
import os
import threading
import warnings
import weakref
from dataclasses import dataclass

import torch

from .ledger import MemoryLedger

#: Every parameter starts on a 64-byte boundary inside a flat buffer, so vectorised kernels
#: (CPU Adam, copy kernels) see aligned rows, and byte views can be reinterpreted as any dtype.
ALIGN_BYTES = 64
_PAGE = 4096


def align_up(n: int, to: int = ALIGN_BYTES) -> int:
    return int(math.ceil(n / to) * to)


def element_size(dtype: torch.dtype) -> int:
    return dtype.itemsize


# ---------------------------------------------------------------------------- layouts
#: Trainable parameters start on a multiple of this many elements in the gradient layout: 64
#: bytes of bf16, 128 of fp32, so their byte offsets in the slot are 64-byte aligned too.
GRAD_ALIGN = 32


@dataclass(frozen=True, slots=True)
class ParamEntry:
    """Where one parameter of a block lives."""

    name: str
    shape: torch.Size
    numel: int
    device_dtype: torch.dtype
    stored_dtype: torch.dtype
    trainable: bool
    byte_offset: int  # in the device slot
    grad_offset: int  # element offset in the gradient layout (trainable only); -1 if frozen


@dataclass(frozen=True, slots=True)
class BlockLayout:
    """The flat layouts of one block.

    The slot holds the *trainable region* first: the trainable parameters in the compute dtype,
    at the same element offsets as in the gradient layout (``byte_offset = grad_offset * c``),
    padded to ``shards`` equal shards of ``shard_numel`` elements. Under data parallelism each
    rank keeps one shard of it (and of the masters, gradients and Adam state); a fetch
    all-gathers the region and a flush reduce-scatters the gradient in the same shards. The
    *frozen region* follows: frozen parameters in their stored dtype, the same on every rank.
    """

    entries: tuple[ParamEntry, ...]
    slot_bytes: int
    grad_numel: int  # trainable elements (unpadded end of the gradient layout)
    grad_dtype: torch.dtype | None  # device dtype of the trainable parameters (one per block)
    shards: int
    shard_numel: int  # elements of one shard of the trainable region (a multiple of GRAD_ALIGN)
    frozen_offset: int  # byte offset of the frozen region in the slot
    # Per parameter, ``(shape, contiguous strides, element offset)`` of its gradient in the
    # gradient layout (None: frozen), and a small integer naming it with the gradient dtype and
    # length: units with the same key (every block of a uniform stack) share a gradient lane's
    # views of it (grads.py, `GradLane.views`).
    grad_geometry: tuple[tuple[torch.Size, tuple[int, ...], int] | None, ...]
    grad_geometry_key: int

    @property
    def padded_grad_numel(self) -> int:
        return self.shards * self.shard_numel

    @property
    def trainable_bytes(self) -> int:
        return self.padded_grad_numel * (element_size(self.grad_dtype) if self.grad_dtype else 0)

    @property
    def shard_bytes(self) -> int:
        """One shard of the gradient region, in the gradient dtype: what a rank's staging holds."""
        return self.shard_numel * (element_size(self.grad_dtype) if self.grad_dtype else 0)

    @property
    def frozen_bytes(self) -> int:
        return self.slot_bytes - self.frozen_offset

    @property
    def masters_in_image(self) -> bool:
        """With fp32 compute the fp32 masters are the image itself (nothing duplicated)."""
        return self.grad_dtype == torch.float32

    @property
    def trainable(self) -> tuple[ParamEntry, ...]:
        return tuple(e for e in self.entries if e.trainable)


def layout_block(fqn: str, named: list[tuple[str, torch.nn.Parameter]], param_dtype: torch.dtype | None,
                 shards: int = 1, align: int = GRAD_ALIGN) -> BlockLayout:
    """Lays a block out: trainable parameters in ``param_dtype`` (default: their own dtype) in
    the trainable region, frozen ones in their stored dtype in the frozen region.

    Trainable parameters and shard boundaries fall on multiples of ``align`` elements (a
    multiple of `GRAD_ALIGN`). Lean host memory passes the 8-bit moments' block size: every
    piece a rank keeps then starts on a quantization block of its whole parameter, so the
    ranks' blocks are the whole parameter's blocks and the state re-cuts exactly."""
    assert align % GRAD_ALIGN == 0, align
    trainable_dtypes = {p.dtype for _, p in named if p.requires_grad}
    if param_dtype is None and len(trainable_dtypes) > 1:
        raise ValueError(
            f"Block {fqn} has trainable parameters of several dtypes {sorted(map(str, trainable_dtypes))}; set "
            "StrongholdConfig(param_dtype=...) so their device copies (and gradients) share one dtype."
        )
    grad_dtype = (param_dtype or next(iter(trainable_dtypes))) if trainable_dtypes else None
    c = element_size(grad_dtype) if grad_dtype is not None else 0
    grad_offsets: dict[int, int] = {}
    grad_off = 0
    for k, (_, p) in enumerate(named):
        if p.requires_grad:
            grad_offsets[k] = grad_off
            grad_off = align_up(grad_off + p.numel(), align)
    shard_numel = align_up(-(-grad_off // shards), align) if grad_off else 0
    frozen_offset = shards * shard_numel * c
    entries, byte_off = [], frozen_offset
    for k, (name, p) in enumerate(named):
        if k in grad_offsets:
            go = grad_offsets[k]
            entries.append(ParamEntry(name, p.shape, p.numel(), grad_dtype, p.dtype, True, go * c, go))
        else:
            entries.append(ParamEntry(name, p.shape, p.numel(), p.dtype, p.dtype, False, byte_off, -1))
            byte_off += align_up(p.numel() * element_size(p.dtype))
    geometry = tuple((e.shape, _contiguous_strides(e.shape), e.grad_offset) if e.trainable else None
                     for e in entries)
    key = _GEOMETRIES.setdefault((grad_dtype, shards * shard_numel, geometry), len(_GEOMETRIES))
    return BlockLayout(tuple(entries), max(byte_off, ALIGN_BYTES), grad_off, grad_dtype, shards, shard_numel,
                       frozen_offset, geometry, key)


_GEOMETRIES: dict[tuple, int] = {}  # interned gradient geometries: equal ones get the same small integer


def _contiguous_strides(shape) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= size
    return tuple(reversed(strides))


def available_host_bytes() -> int | None:
    """Host memory the system can still hand out: psutil if installed, else ``MemAvailable``
    of /proc/meminfo (Linux); None if unknown."""
    try:
        import psutil  # optional, not a dependency

        return int(psutil.virtual_memory().available)
    except ImportError:
        pass
    try:
        with open("/proc/meminfo", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def total_host_bytes() -> int | None:
    """The machine's physical memory (what ``cpu_reserve="auto"`` takes its share of); None if unknown."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def typed_view(flat_bytes: torch.Tensor, offset: int, numel: int, dtype: torch.dtype, shape) -> torch.Tensor:
    """``shape``-shaped ``dtype`` view of ``numel`` elements at byte ``offset`` of a uint8 buffer."""
    nbytes = numel * element_size(dtype)
    return flat_bytes[offset : offset + nbytes].view(dtype).view(shape)


# ---------------------------------------------------------------------------- pinning
_cuda_get_last_error = None


def placeholder(shape) -> torch.Tensor:
    """``shape``-shaped fp32 view of a single NaN (stride 0 everywhere), no memory of its own:
    what a parameter no host buffer holds whole points at (a shard of it, sharded CPU state;
    a master on disk, ``nvme_masters``). Reads are visibly invalid, in-place writes raise."""
    shape = tuple(shape)
    return torch.full((1,), float("nan")).as_strided(shape, (0,) * len(shape))


def is_placeholder(t: torch.Tensor) -> bool:
    """Whether ``t`` is a `placeholder` (or a view of one): more than one element, all at one
    address. A dimension of size 1 says nothing, whatever its stride (a depthwise convolution's
    ``[channels, 1, kernel]`` weight kept a stride of 1 there when expanded)."""
    return t.numel() > 1 and all(st == 0 for st, n in zip(t.stride(), t.shape) if n != 1)


def _clear_cuda_last_error() -> None:
    """Resets the CUDA runtime's last error after a refused ``cudaHostRegister``.

    torch's binding returns the error but leaves it pending, and torch's next kernel-launch
    check would report it as a failure of that unrelated kernel. torch loads the CUDA runtime
    into the global namespace, so the symbol is found there (or in the mapped library)."""
    global _cuda_get_last_error
    if _cuda_get_last_error is None:
        fn = None
        try:
            fn = ctypes.CDLL(None).cudaGetLastError
        except (OSError, AttributeError):
            try:
                with open("/proc/self/maps", encoding="ascii", errors="replace") as fh:
                    paths = sorted({line.split()[-1] for line in fh if "libcudart" in line})
                fn = ctypes.CDLL(paths[0]).cudaGetLastError if paths else None
            except (OSError, AttributeError, IndexError):
                fn = None
        _cuda_get_last_error = fn if fn is not None else (lambda: 0)
    _cuda_get_last_error()


class CudaHostRegister:
    """Page-locks existing host memory in place (see [Note: pinning without rounding])."""

    def pin(self, t: torch.Tensor) -> bool:
        cudart = torch.cuda.cudart()
        err = cudart.cudaHostRegister(t.data_ptr(), t.numel() * t.element_size(), 0)
        if int(getattr(err, "value", err)) != 0:
            _clear_cuda_last_error()
            return False
        return True

    def unpin(self, t: torch.Tensor) -> None:
        torch.cuda.cudart().cudaHostUnregister(t.data_ptr())


class NoPinning:
    """A CPU-only machine: nothing can be pinned (and nothing needs to be)."""

    def pin(self, t: torch.Tensor) -> bool:
        return False

    def unpin(self, t: torch.Tensor) -> None:
        return None


class SimulatedPinning:
    """The CPU test mode's pinning: books buffers as pinned without locking pages.

    ``fail_after_bytes`` makes it refuse once that many bytes are pinned, to exercise the
    pageable fallback on a machine without CUDA.
    """

    def __init__(self, fail_after_bytes: int | None = None) -> None:
        self.fail_after_bytes = fail_after_bytes
        self.pinned = 0

    def pin(self, t: torch.Tensor) -> bool:
        nbytes = t.numel() * t.element_size()
        if self.fail_after_bytes is not None and self.pinned + nbytes > self.fail_after_bytes:
            return False
        self.pinned += nbytes
        return True

    def unpin(self, t: torch.Tensor) -> None:
        self.pinned -= t.numel() * t.element_size()


def default_pinning():
    return CudaHostRegister() if torch.cuda.is_available() else NoPinning()


class HostAllocator:
    """Exact-size host buffers, page-locked while the budget allows, each booked in the ledger."""

    def __init__(self, ledger: MemoryLedger, *, pin: bool, pinning=None, max_pinned_bytes: int | None = None) -> None:
        self.ledger = ledger
        self.pin = pin
        self.pinning = pinning if pinning is not None else default_pinning()
        self.max_pinned_bytes = max_pinned_bytes
        self._pinned_total = 0
        self._buffers: list[tuple[torch.Tensor, int, bool]] = []  # (tensor, booked bytes, pinned)
        self._lock = threading.Lock()
        self._warned = False
        # An engine dropped without close() still unregisters its pinned pages.
        weakref.finalize(self, _unpin_all, self.pinning, self._buffers)

    def allocate(self, nbytes: int, *, transfer: bool) -> torch.Tensor:
        """A zeroed uint8 buffer of ``nbytes`` (64-byte aligned start). ``transfer=True``:
        it is read or written by device copies, so pin it if allowed."""
        nbytes = align_up(max(nbytes, 1))
        want_pin = transfer and self.pin and not isinstance(self.pinning, NoPinning)
        if want_pin:
            # Page-aligned start and length: what page-locking works in.
            raw = torch.zeros(nbytes + 2 * _PAGE, dtype=torch.uint8)
            start = (-raw.data_ptr()) % _PAGE
            buf = raw[start : start + align_up(nbytes, _PAGE)]
            pinned = self._try_pin(buf)
            out, booked, keep = buf[:nbytes], raw.numel(), buf
        else:
            raw = torch.zeros(nbytes + ALIGN_BYTES, dtype=torch.uint8)
            start = (-raw.data_ptr()) % ALIGN_BYTES
            out = raw[start : start + nbytes]
            pinned, booked, keep = False, raw.numel(), raw
        with self._lock:
            self._buffers.append((keep, booked, pinned))
        self.ledger.host_alloc(booked, pinned=pinned)
        return out

    def free(self, buf: torch.Tensor) -> None:
        """Gives back one pageable buffer from `allocate` (its bytes go once nothing views it)."""
        ptr = buf.untyped_storage().data_ptr()
        with self._lock:
            for i, (keep, booked, pinned) in enumerate(self._buffers):
                if keep.untyped_storage().data_ptr() == ptr:
                    assert not pinned, "free() is for pageable buffers"
                    del self._buffers[i]
                    break
            else:
                raise KeyError("HostAllocator.free: not a buffer of this allocator")
        self.ledger.host_free(booked, pinned=False)

    def _try_pin(self, buf: torch.Tensor) -> bool:
        nbytes = buf.numel()
        with self._lock:
            if self.max_pinned_bytes is not None and self._pinned_total + nbytes > self.max_pinned_bytes:
                return False
            self._pinned_total += nbytes
        ok = False
        try:
            ok = bool(self.pinning.pin(buf))
        except (RuntimeError, OSError):
            ok = False
        if not ok:
            with self._lock:
                self._pinned_total -= nbytes
            if not self._warned:
                self._warned = True
                warnings.warn(
                    "stronghold: page-locking host memory failed; transfer buffers fall back to pageable memory "
                    "(same results, slower host-to-device copies). Lower StrongholdConfig.max_pinned_bytes or "
                    "raise the memlock limit (ulimit -l) to pin.",
                    stacklevel=4,
                )
        return ok

    @property
    def pinned_bytes(self) -> int:
        return self._pinned_total

    def release_all(self) -> None:
        """Unpins and forgets every buffer (the tensors are freed once nothing views them)."""
        with self._lock:
            buffers = list(self._buffers)
            self._buffers.clear()  # in place: the finalizer holds this list
            self._pinned_total = 0
        _unpin_all(self.pinning, buffers)
        for _, booked, pinned in buffers:
            self.ledger.host_free(booked, pinned=pinned)


def _unpin_all(pinning, buffers: list[tuple[torch.Tensor, int, bool]]) -> None:
    for t, _, pinned in buffers:
        if pinned:
            try:
                pinning.unpin(t)
            except (RuntimeError, OSError):  # pragma: no cover - nothing left to do at teardown
                pass


class DeviceSlotPool:
    """Counts device slots in use and enforces the resident bound.

    ``capacity`` is ``W + 1``: the working window plus the block being prefetched. `acquire`
    raises if a caller would exceed it, turning a scheduling bug into an immediate, named
    failure instead of an out-of-memory an hour into a run.
    """

    def __init__(self, capacity: int) -> None:
        assert capacity >= 1
        self.capacity = capacity
        self._in_use: set[int] = set()
        self.peak_in_use = 0
        self.full = False  # every slot is in use (kept with the set: read per block)

    def acquire(self, block_index: int) -> None:
        assert block_index not in self._in_use, f"block {block_index} already holds a slot"
        if len(self._in_use) >= self.capacity:
            raise RuntimeError(
                f"stronghold: slot pool exhausted ({self.capacity} slots, in use by blocks "
                f"{sorted(self._in_use)}), asked for block {block_index}. This is a scheduling bug; "
                "please report it with the model class."
            )
        self._in_use.add(block_index)
        n = len(self._in_use)
        if n > self.peak_in_use:
            self.peak_in_use = n
        self.full = n >= self.capacity

    def release(self, block_index: int) -> None:
        assert block_index in self._in_use, f"block {block_index} holds no slot"
        self._in_use.discard(block_index)
        self.full = False

    @property
    def in_use(self) -> frozenset[int]:
        return frozenset(self._in_use)

    def sorted_in_use(self) -> list[int]:
        """The units holding a slot, in index order (a copy: the caller may release them)."""
        return sorted(self._in_use)

    def resize(self, capacity: int) -> None:
        """Changes the capacity (after the auto window size is chosen); only while idle."""
        assert not self._in_use, "resize the slot pool only while no block is resident"
        self.capacity = capacity
        self.full = False
