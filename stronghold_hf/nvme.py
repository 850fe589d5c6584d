"""The NVMe tier: Adam moments on disk, streamed through a ring of host buffers in update order.

Once the device holds only the window, host RAM is the wall: the CPU optimizer's two Adam
moments are 8 of the 16 host bytes per parameter (2 of about 10 in lean mode). With
``StrongholdConfig(nvme_path=DIR)`` they live in one file under ``DIR`` instead, one region
per unit, and host RAM keeps a *ring* of ``nvme_ring_buffers`` buffers, each the size of the
largest unit's state. It is the window again, one level down (host over disk): the schedule
already knows the order the updates run in (``engine.update_order``), so when
``optimizer.step()`` plans the updates it hands that order to `NvmeTier.expect`; the tier
reads the next units' state ahead into free buffers while the host worker updates the
current one, and writes each one back behind it. Every unit's update is bracketed by
`NvmeTier.bound` (``optim/hybrid.py``), which waits for its read (or reads it then, when the
unit was not expected: a speculative update, an undo), points the CPU optimizer's state
tensors at the buffer, and starts the write-back when the update is done.

States of a ring buffer, and the only transitions::

    FREE --prefetch/acquire--> READING --read done--> READY --acquire--> BOUND
    BOUND --release--> WRITING --write done--> FREE
    READY --drop/steal--> FREE   (a unit expected but not updated, or one a late acquire needs)

Between updates a parameter's moments in ``optimizer.state`` are empty tensors of the right
dtype (the bytes are on disk); ``optimizer.state_dict()`` maps them copy-on-write from the file
(`NvmeTier.materialized`), so a checkpoint is written without holding the state in RAM.

With ``nvme_masters=True`` the fp32 masters go to disk too (`DiskMasters`, a second file made
by ``offload_model``): a unit's region then starts with its masters, read into the same ring
buffer and written back with the moments, and the masters' ``.data`` point into the buffer for
the update only. Fetches read the masters themselves (`DiskMasters.read`), after waiting for
the unit's write-back (`NvmeTier.settle`); writes from outside the step go through the ring
(`NvmeTier.write_masters`) so no read-ahead holds stale masters.

I/O: `os.preadv` / `os.pwritev` (they release the GIL) on a small thread pool, in chunks
of `IO_CHUNK`, at page-aligned offsets into page-aligned buffers, with ``O_DIRECT`` where
the file system takes it, so the page cache does not quietly hold the state again; where it
does not (tmpfs), buffered I/O followed by ``posix_fadvise(DONTNEED)``. No ``mmap`` while
training: it would page the state back into resident memory. The ring is not page-locked:
only the CPU reads it (``O_DIRECT`` pins the pages of each request itself).

The file is scratch, never a checkpoint: it is preallocated (a full disk is an error before
the first step, naming the bytes needed and free), lives in a directory of this engine's own
(``stronghold-<host>-<pid>-<token>``, locked with ``flock`` while the engine lives; a
directory whose lock nobody holds was left by a killed run and is removed, with a log line),
and is deleted by ``engine.close()`` or at interpreter exit.
"""

from __future__ import annotations

import collections
import contextlib
import enum
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

import torch
from torch import Tensor

from .ledger import MemoryLedger
from .memory import placeholder
from .optim import quant8
from .swap import PAGE, StateFile, SwapDirectory, _aligned_empty, _page_up


_FILE_NAME = "adam_state.bin"
_MASTERS_NAME = "masters.bin"


# ---------------------------------------------------------------------------- layout
@dataclass(frozen=True, slots=True)
class StatePiece:
    """One moment tensor of one parameter: where it lies in its unit's region."""

    param: Tensor  # the fp32 master the CPU optimizer steps
    key: str  # its key in ``optimizer.state[param]``
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int  # from the region's start, page-aligned (the same in the file and in a ring buffer)
    nbytes: int
    fill: int  # the byte a fresh (never stepped) state holds: the code of 0.0, or 0


@dataclass(frozen=True, slots=True)
class MasterPiece:
    """One fp32 master (``nvme_masters``): elements ``[at, at + numel)`` of its unit's flat masters."""

    param: Tensor
    at: int
    shape: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Region:
    """One unit's state: its moments in the state file, ``[start, start + nbytes)``, and with
    ``nvme_masters`` its masters in the masters file, ``[master_start, master_start + head)``.
    A ring buffer holds the masters first (``head`` bytes, page-aligned), then the moments.
    ``unit``: the unit's index, or ``(unit index, param group)`` for one segment of a unit whose
    state is cut into block-sized segments (``optim/segments.py``)."""

    unit: int | tuple[int, int]
    fqn: str
    start: int
    nbytes: int
    pieces: tuple[StatePiece, ...]
    head: int = 0
    master_start: int = 0
    masters: tuple[MasterPiece, ...] = ()

    @property
    def buffer_bytes(self) -> int:
        return self.head + self.nbytes


def moment_tensors(param: Tensor, eight_bit: bool) -> list[tuple[str, torch.dtype, tuple[int, ...], int]]:
    """``(key, dtype, shape, fill byte)`` of the moments CPU Adam keeps for ``param``."""
    if not eight_bit:
        return [("exp_avg", torch.float32, tuple(param.shape), 0), ("exp_avg_sq", torch.float32, tuple(param.shape), 0)]
    fresh = quant8.new_state(torch.empty(1))  # what a never-stepped 8-bit state holds, per key
    n, nb = param.numel(), quant8.num_blocks(param.numel())
    out = []
    for codes, absmax in zip(quant8.CODE_KEYS, quant8.ABSMAX_KEYS):
        out.append((codes, torch.uint8, (n,), int(fresh[codes][0])))
        out.append((absmax, torch.float32, (nb,), 0))
    return out


def lay_out_regions(units: list[tuple[int | tuple[int, int], str, list[Tensor]]], eight_bit,
                    masters: "DiskMasters | None" = None,
                    master_pieces: dict[int | tuple[int, int], list[MasterPiece]] | None = None) -> list[Region]:
    """Regions for ``(region key, fqn, masters)`` in that order; ``eight_bit(param)`` says
    which moments a parameter has. With ``masters`` (``nvme_masters``), a unit whose masters
    are on disk also reads and writes them (``master_pieces[key]``: where each one lies in its
    unit's extent). A segment's key is ``(unit index, group)``: its masters are its one range
    of the unit's extent, page-aligned (``optim/segments.py``)."""
    regions, start = [], 0
    for index, fqn, params in units:
        pieces, offset = [], 0
        for p in params:
            for key, dtype, shape, fill in moment_tensors(p, eight_bit(p)):
                nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
                pieces.append(StatePiece(p, key, dtype, shape, offset, nbytes, fill))
                offset += _page_up(nbytes)
        head, master_start = 0, 0
        mine = tuple((master_pieces or {}).get(index, ()))
        unit = index[0] if isinstance(index, tuple) else index
        if masters is not None and unit in masters.extents:
            master_start, master_bytes = masters.extents[unit]
            if isinstance(index, tuple):  # a segment: [at, at + count) of its unit's extent
                first = mine[0].at
                master_start += 4 * first
                master_bytes = 4 * sum(torch.Size(m.shape).numel() for m in mine)
                assert master_start % PAGE == 0, f"{fqn}: a segment's masters must start on a page"
                mine = tuple(MasterPiece(m.param, m.at - first, m.shape) for m in mine)
            head = _page_up(master_bytes)
        if pieces or head:
            regions.append(Region(index, fqn, start, offset, tuple(pieces), head, master_start, mine))
            start += offset
    return regions


def state_file_bytes(regions: list[Region]) -> int:
    return sum(r.nbytes for r in regions)


# ---------------------------------------------------------------------------- masters on disk
class DiskMasters:
    """The fp32 masters of the offloaded units on disk (``nvme_masters=True``), from
    ``offload_model`` on: one page-aligned extent per unit holding what ``UnitHost.master_flat``
    would hold in RAM (this rank's flat shard, fp32 ``[S]``).

    Three kinds of access, and who makes them:

    * a unit's update reads and writes its extent through the NVMe tier's ring, with its
      moments (`NvmeTier`, once ``build_optimizer`` made one; it attaches itself here);
    * a fetch reads it piece by piece into a scratch buffer and converts the piece on its way
      to the device (`read`, on the fetch conversion thread); a full value is mapped
      copy-on-write (`map`: a checkpoint, a read between steps);
    * a write from outside the step (``load_state_dict``, ``p.data = t``, a write to a mapped
      value) goes through the tier when it holds the unit, so a read-ahead in its ring never goes
      stale, and straight to the file otherwise (`write`).

    Reads and maps first wait until no update holds or writes the unit back (`NvmeTier.settle`).
    """

    def __init__(self, directory: SwapDirectory, numels: dict[int, int], *, io_threads: int) -> None:
        self.directory = directory
        self.extents: dict[int, tuple[int, int]] = {}  # unit -> (file offset, bytes)
        start = 0
        for unit, numel in numels.items():
            self.extents[unit] = (start, 4 * numel)
            start += _page_up(4 * numel)
        self.file = StateFile(directory.file(_MASTERS_NAME), start, io_threads=io_threads, holds="the fp32 masters")
        self.tier: NvmeTier | None = None
        self.read_bytes = 0
        self.written_bytes = 0

    @property
    def file_bytes(self) -> int:
        return self.file.nbytes

    def _span(self, unit: int, lo: int, hi: int) -> tuple[int, int, int]:
        """The page-aligned file span ``(offset, bytes)`` covering elements ``[lo, hi)`` of
        ``unit``'s masters, and where element ``lo`` starts in it."""
        start, _ = self.extents[unit]
        a, b = start + 4 * lo, start + 4 * hi
        a0 = a - a % PAGE
        return a0, _page_up(b) - a0, a - a0

    @staticmethod
    def scratch_bytes(numel: int) -> int:
        """Bytes of a scratch buffer that `read` can fill with any ``numel`` elements."""
        return _page_up(4 * numel) + 2 * PAGE

    def read(self, unit: int, lo: int, hi: int, scratch: Tensor | None = None) -> Tensor:
        """fp32 ``[hi - lo]``: elements ``[lo, hi)`` of ``unit``'s masters, read into ``scratch``
        (uint8, page-aligned, `scratch_bytes` long) or a new buffer; valid until the next read
        into the same scratch."""
        if hi <= lo:
            return torch.empty(0, dtype=torch.float32)
        self.settle(unit)
        offset, nbytes, skip = self._span(unit, lo, hi)
        buf = scratch[:nbytes] if scratch is not None and scratch.numel() >= nbytes else _aligned_empty(nbytes)
        self.file.run(False, buf, offset)
        self.read_bytes += nbytes
        return buf[skip: skip + 4 * (hi - lo)].view(torch.float32)

    def map(self, unit: int) -> Tensor:
        """fp32 ``[S]``: ``unit``'s masters mapped copy-on-write (no RAM of its own: the pages
        are the file's, dropped under memory pressure)."""
        self.settle(unit)
        start, nbytes = self.extents[unit]
        return self.file.map(start, nbytes).view(torch.float32)

    def write(self, unit: int, lo: int, values: Tensor) -> None:
        """Elements ``[lo, lo + len(values))`` of ``unit``'s masters become ``values`` (fp32, 1-D)."""
        values = values.detach().reshape(-1).to(torch.float32)
        if values.numel() == 0:
            return
        if self.tier is not None and self.tier.holds_region(unit):
            self.tier.write_masters(unit, lo, values)
            return
        self.write_file(unit, lo, values)

    def write_file(self, unit: int, lo: int, values: Tensor) -> None:
        """`write` straight to the file (read-modify-write of the pages at the edges)."""
        hi = lo + values.numel()
        offset, nbytes, skip = self._span(unit, lo, hi)
        buf = _aligned_empty(nbytes)
        if lo != 0 or 4 * hi != self.extents[unit][1]:  # not the whole extent: keep its neighbours
            self.file.run(False, buf, offset)
        buf[skip: skip + 4 * values.numel()].view(torch.float32).copy_(values)
        self.file.run(True, buf, offset)
        self.written_bytes += nbytes

    def settle(self, unit: int) -> None:
        if self.tier is not None:
            self.tier.settle(unit)

    def close(self) -> None:
        self.file.close()


@dataclass(frozen=True, slots=True)
class UnitMasters:
    """One unit's masters on disk as a fetch reads them (`transfer.FetchStaging.copy_converted`)."""

    disk: DiskMasters
    unit: int
    count: int

    def numel(self) -> int:
        return self.count

    @staticmethod
    def scratch_bytes(numel: int) -> int:
        return DiskMasters.scratch_bytes(numel)

    def read(self, lo: int, hi: int, scratch: Tensor | None = None) -> Tensor:
        return self.disk.read(self.unit, lo, hi, scratch)


# ---------------------------------------------------------------------------- the ring
class BufferState(enum.Enum):
    FREE = "free"
    READING = "reading"
    READY = "ready"
    BOUND = "bound"
    WRITING = "writing"


class RingBuffer:
    __slots__ = ("data", "state", "region", "io", "dropped")

    def __init__(self, nbytes: int) -> None:
        self.data = _aligned_empty(nbytes)
        self.state = BufferState.FREE
        self.region: Region | None = None
        self.io: list[Future] = []
        self.dropped = False  # freed when its read lands (a prefetch nobody wants any more)


class NvmeTier:
    """The Adam moments of a CPU optimizer's parameters, on disk, streamed through a ring."""

    def __init__(self, root: str, optimizer, units: list[tuple[int, str, list[Tensor]]], *, ring_buffers: int,
                 io_threads: int, ledger: MemoryLedger, stats=None, masters: DiskMasters | None = None,
                 master_pieces: dict[int, list[MasterPiece]] | None = None) -> None:
        if ring_buffers < 2:
            raise ValueError(f"StrongholdConfig.nvme_ring_buffers={ring_buffers}; use at least 2.")
        self.optimizer = optimizer
        self.stats = stats
        self.masters = masters  # nvme_masters: the units' masters come and go with their moments
        self.regions = {r.unit: r for r in lay_out_regions(units, optimizer.wants_8bit, masters, master_pieces)}
        self._segments_of: dict[int, list] = {}  # unit -> the keys of its segments' regions
        for key in self.regions:
            if isinstance(key, tuple):
                self._segments_of.setdefault(key[0], []).append(key)
        # With masters on disk the engine made the directory at offload_model and removes it.
        self._own_directory = masters is None
        self.directory = SwapDirectory(root) if masters is None else masters.directory
        self.file = StateFile(self.directory.file(_FILE_NAME), state_file_bytes(list(self.regions.values())),
                              io_threads=io_threads)
        largest = max((r.buffer_bytes for r in self.regions.values()), default=PAGE)
        self.ring = [RingBuffer(largest) for _ in range(min(ring_buffers, max(len(self.regions), 1)))]
        self.ring_bytes = sum(b.data.numel() for b in self.ring)
        self.ledger = ledger
        ledger.host_alloc(self.ring_bytes, pinned=False)
        self.read_bytes = 0
        self.written_bytes = 0
        self._cond = threading.Condition()
        self._expected: collections.deque[int] = collections.deque()
        # [Note: reading ahead across steps] Once every read of a step is issued, the same
        # order is queued again: the next step's first units come in during the forward and
        # backward in between, so its first update does not wait for the disk. Nothing else
        # writes the state between steps (load_state_dict and state_dict flush first), and
        # `expect` gives back what the next step turns out not to update.
        self._standing: list[int] = []
        self._refilled = True
        self._holder: dict[int, RingBuffer] = {}  # unit -> the buffer holding (or filling) its state
        self._error: BaseException | None = None
        self._fresh = {id(p.param) for r in self.regions.values() for p in r.pieces}  # never written: fill, not read
        self._closed = False
        for region in self.regions.values():
            self._unbind(region)
        if masters is not None:
            masters.tier = self

    # ------------------------------------------------------------------ the stream
    def expect(self, units: list[int]) -> None:
        """The units the host worker will update next, in order: their reads start now, as
        far ahead as the ring allows."""
        with self._cond:
            wanted = list(dict.fromkeys(u for u in units if u in self.regions))
            for b in self.ring:  # read ahead for a step that did not come (an exception in between)
                if b.state is BufferState.READY and b.region.unit not in wanted:
                    self._free(b)
            self._expected = collections.deque(u for u in wanted if u not in self._holder)
            self._standing, self._refilled = wanted, False
            self._pump()

    @contextlib.contextmanager
    def bound(self, unit: int):
        """``optimizer.state`` of ``unit``'s parameters points at its state in a ring buffer
        inside the block; the state is written back after it."""
        if unit not in self.regions:
            yield
            return
        buf = self._acquire(unit)
        try:
            yield
        finally:
            self._release(unit, buf)

    def drop(self, unit: int) -> None:
        """``unit`` was expected but will not be updated: its read-ahead gives its buffer back."""
        with self._cond:
            with contextlib.suppress(ValueError):
                self._expected.remove(unit)
            buf = self._holder.get(unit)
            if buf is not None and buf.state is BufferState.READY:
                self._free(buf)
            elif buf is not None and buf.state is BufferState.READING:
                buf.dropped = True
            self._pump()

    def flush(self) -> None:
        """Waits for every read and write in flight and gives back read-ahead nobody used; raises
        an I/O error any of them met. Nothing may be bound (the updates have finished)."""
        with self._cond:
            self._expected.clear()
            self._refilled = True
            while any(b.state in (BufferState.READING, BufferState.WRITING) for b in self.ring):
                for b in self.ring:
                    if b.state is BufferState.READING:
                        b.dropped = True
                self._cond.wait()
            for b in self.ring:
                assert b.state is not BufferState.BOUND, "NvmeTier.flush while an update holds its state"
                if b.state is BufferState.READY:
                    self._free(b)
            self._raise_error()

    def wait_for_writes(self) -> None:
        """Returns once every write-back in flight has reached the file (read-ahead keeps going)."""
        with self._cond:
            while any(b.state is BufferState.WRITING for b in self.ring):
                self._cond.wait()
            self._raise_error()

    def _acquire(self, unit: int) -> RingBuffer:
        t0 = time.perf_counter()
        region = self.regions[unit]
        with self._cond:
            with contextlib.suppress(ValueError):
                self._expected.remove(unit)
            while True:
                self._raise_error()
                buf = self._holder.get(unit)
                if buf is None:
                    buf = self._free_buffer()
                    if buf is not None:
                        self._start_read(buf, region)
                    else:
                        self._cond.wait()
                    continue
                if buf.state is BufferState.READY:
                    buf.state = BufferState.BOUND
                    break
                if buf.state is BufferState.BOUND:
                    raise RuntimeError(f"stronghold: the Adam state of {region.fqn} is already in use by another update.")
                buf.dropped = False
                self._cond.wait()  # READING, or WRITING (the previous update of this unit)
        self._bind(region, buf)
        if self.stats is not None:
            self.stats.add("nvme_wait_s", time.perf_counter() - t0)
        return buf

    def _release(self, unit: int, buf: RingBuffer) -> None:
        region = self.regions[unit]
        self._unbind(region)
        with self._cond:
            for piece in region.pieces:
                self._fresh.discard(id(piece.param))
            buf.state = BufferState.WRITING
            buf.io = self._transfer(True, buf, region, moments=True)
            self._watch(buf)

    # ------------------------------------------------------------------ buffers (under the lock)
    def _pump(self) -> None:
        """Starts reads ahead for expected units while keeping one buffer for a unit nobody
        expected (a speculative update, an undo)."""
        if not self._expected and not self._refilled:
            self._refilled = True
            self._expected = collections.deque(self._standing)
        while self._expected:
            ahead = sum(b.state in (BufferState.READING, BufferState.READY) for b in self.ring)
            buf = next((b for b in self.ring if b.state is BufferState.FREE), None)
            if buf is None or ahead >= len(self.ring) - 1:
                return
            unit = self._expected.popleft()
            if unit not in self._holder:
                try:
                    self._start_read(buf, self.regions[unit])  # may land at once (fresh) and pump again
                except RuntimeError:  # the I/O pool is shut down (interpreter exit): read-ahead ends
                    self._free(buf)
                    self._expected.clear()
                    return

    def _free_buffer(self) -> RingBuffer | None:
        buf = next((b for b in self.ring if b.state is BufferState.FREE), None)
        if buf is None:  # take a read-ahead back; its unit goes back to the front of the queue
            buf = next((b for b in reversed(self.ring) if b.state is BufferState.READY), None)
            if buf is not None:
                self._expected.appendleft(buf.region.unit)
                self._free(buf)
        return buf

    def _start_read(self, buf: RingBuffer, region: Region) -> None:
        buf.region, buf.dropped = region, False
        self._holder[region.unit] = buf
        buf.state = BufferState.READING
        # Moments never written are not read (_bind fills them); masters always are.
        buf.io = self._transfer(False, buf, region, moments=not all(id(p.param) in self._fresh for p in region.pieces))
        self._watch(buf)

    def _transfer(self, write: bool, buf: RingBuffer, region: Region, *, moments: bool) -> list[Future]:
        """Reads or writes ``region`` between ``buf`` and the files: its masters (if on disk) and,
        if ``moments``, its moments."""
        io = []
        if region.head:
            io += self.masters.file.submit(write, buf.data[: region.head], region.master_start)
        if moments and region.nbytes:
            io += self.file.submit(write, buf.data[region.head: region.buffer_bytes], region.start)
        moved = (region.head + region.nbytes) if moments else region.head
        if write:
            self.written_bytes += moved
        else:
            self.read_bytes += moved
        return io

    def _watch(self, buf: RingBuffer) -> None:
        pending = list(buf.io)
        if not pending:
            self._landed(buf, None)
            return
        remaining = [len(pending)]

        def done(future: Future) -> None:
            with self._cond:
                remaining[0] -= 1
                if future.exception() is not None and self._error is None:
                    self._error = future.exception()
                if remaining[0] == 0:
                    self._landed(buf, self._error)
                    self._cond.notify_all()

        for f in pending:
            f.add_done_callback(done)

    def _landed(self, buf: RingBuffer, error) -> None:
        buf.io = []
        if buf.state is BufferState.WRITING or buf.dropped or error is not None:
            self._free(buf)
        else:
            buf.state = BufferState.READY
        self._pump()

    def _free(self, buf: RingBuffer) -> None:
        if buf.region is not None and self._holder.get(buf.region.unit) is buf:
            del self._holder[buf.region.unit]
        buf.region, buf.state, buf.dropped = None, BufferState.FREE, False
        self._cond.notify_all()

    def _raise_error(self) -> None:
        if self._error is not None:
            err = self._error
            raise RuntimeError(f"stronghold: NVMe tier I/O on {self.file.path} failed: {err!r}") from err

    # ------------------------------------------------------------------ optimizer.state
    def _set(self, param: Tensor, values: dict[str, Tensor]) -> None:
        # A new dict each time: a state_dict() taken earlier keeps the dicts it was given.
        state = self.optimizer.state.get(param) or {"step": torch.tensor(0.0, dtype=torch.float32)}
        self.optimizer.state[param] = {**state, **values}

    def _bind(self, region: Region, buf: RingBuffer) -> None:
        if region.head:  # the masters' .data point into the buffer for the update
            flat = buf.data[: region.head].view(torch.float32)
            for m in region.masters:
                m.param.data = flat[m.at: m.at + torch.Size(m.shape).numel()].view(m.shape)
        by_param: dict[int, dict[str, Tensor]] = {}
        for piece in region.pieces:
            raw = self._moment_bytes(buf, region, piece)
            if id(piece.param) in self._fresh:
                raw.fill_(piece.fill)
            by_param.setdefault(id(piece.param), {})[piece.key] = raw.view(piece.dtype).view(piece.shape)
        for piece in region.pieces:
            if id(piece.param) in by_param:
                self._set(piece.param, by_param.pop(id(piece.param)))
        self.optimizer.state_moved()

    def _unbind(self, region: Region) -> None:
        for m in region.masters:
            m.param.data = placeholder(m.shape)  # between updates a master on disk holds nothing
        by_param: dict[int, dict[str, Tensor]] = {}
        for piece in region.pieces:
            by_param.setdefault(id(piece.param), {})[piece.key] = torch.empty(0, dtype=piece.dtype)
        for piece in region.pieces:
            if id(piece.param) in by_param:
                self._set(piece.param, by_param.pop(id(piece.param)))
        self.optimizer.state_moved()

    @contextlib.contextmanager
    def materialized(self):
        """Inside: ``optimizer.state`` holds every moment as a copy-on-write map of the file (what
        ``state_dict()`` saves); parameters never stepped have no state, as in plain AdamW."""
        self.flush()
        saved = {}
        for region in self.regions.values():
            for piece in region.pieces:
                p = piece.param
                if p not in saved:
                    saved[p] = self.optimizer.state.get(p)
                if id(p) in self._fresh:
                    self.optimizer.state.pop(p, None)
                    continue
                mapped = self.file.map(region.start + piece.offset, piece.nbytes)
                self._set(p, {piece.key: mapped.view(piece.dtype).view(piece.shape)})
        try:
            yield
        finally:
            for p, state in saved.items():
                if state is not None:
                    self.optimizer.state[p] = state
            self.optimizer.state_moved()

    def absorb(self, release_source: Callable[[Tensor], None] | None = None) -> None:
        """After ``optimizer.load_state_dict``: writes the loaded moments (RAM tensors, or maps
        of a checkpoint file) to their regions, one unit at a time through the ring, and gives
        their memory back (a map's pages through ``release_source``, after its unit)."""
        self.flush()
        for region in self.regions.values():
            loaded = [p for p in region.pieces if self._loaded(p)]
            if not loaded:
                for piece in region.pieces:  # not in the checkpoint: starts fresh
                    self._fresh.add(id(piece.param))
                self._unbind(region)
                continue
            values = {(id(p.param), p.key): self.optimizer.state[p.param][p.key] for p in loaded}
            with self._cond:
                for piece in region.pieces:
                    self._fresh.add(id(piece.param))  # no moment is read: every one is filled here
            buf = self._acquire(region.unit)  # reads the masters, if on disk
            for piece in region.pieces:
                raw = self._moment_bytes(buf, region, piece)
                value = values.get((id(piece.param), piece.key))
                if value is None:
                    raw.fill_(piece.fill)
                else:
                    raw.view(piece.dtype).view(piece.shape).copy_(value)
            self._release(region.unit, buf)
            if release_source is not None:
                for value in values.values():
                    release_source(value)
        self.flush()

    def _loaded(self, piece: StatePiece) -> bool:
        value = (self.optimizer.state.get(piece.param) or {}).get(piece.key)
        if value is None or value.numel() == 0:
            return False
        if value.dtype != piece.dtype or tuple(value.shape) != piece.shape:
            raise ValueError(f"stronghold: the loaded optimizer state {piece.key} of a parameter is {value.dtype} "
                             f"{tuple(value.shape)}, the NVMe tier expects {piece.dtype} {piece.shape}.")
        return True

    @staticmethod
    def _moment_bytes(buf: RingBuffer, region: Region, piece: StatePiece) -> Tensor:
        at = region.head + piece.offset
        return buf.data[at: at + piece.nbytes]

    # ------------------------------------------------------------------ masters on disk
    def _keys_of(self, unit: int) -> list:
        """The regions holding ``unit``'s state: its own, or its segments'."""
        if unit in self.regions:
            return [unit]
        return self._segments_of.get(unit, [])

    def holds_region(self, unit: int) -> bool:
        return not self._closed and any(self.regions[k].head for k in self._keys_of(unit))

    def settle(self, unit: int) -> None:
        """Returns once no update holds ``unit``'s state (any segment of it) and no write-back
        of it is in flight: its masters in the file are current."""
        keys = self._keys_of(unit) or [unit]
        with self._cond:
            while True:
                self._raise_error()
                busy = [b for b in map(self._holder.get, keys)
                        if b is not None and b.state in (BufferState.BOUND, BufferState.WRITING)]
                if not busy:
                    return
                self._cond.wait()

    def write_masters(self, unit: int, lo: int, values: Tensor) -> None:
        """Elements ``[lo, lo + len(values))`` of ``unit``'s masters become ``values``: written
        into its state in the ring (read first unless there) and back to the file, a region
        (the unit's, or each segment's it covers) at a time."""
        hi = lo + values.numel()
        extent_start, extent_bytes = self.masters.extents[unit]
        for key in self._keys_of(unit):
            region = self.regions[key]
            # The elements of the unit's masters this region holds: all, or a segment's range.
            first = (region.master_start - extent_start) // 4
            count = extent_bytes // 4 if not isinstance(key, tuple) else sum(
                torch.Size(m.shape).numel() for m in region.masters)
            a, b = max(lo, first), min(hi, first + count)
            if a >= b:
                continue
            buf = self._acquire(key)
            try:
                buf.data[: region.head].view(torch.float32)[a - first: b - first].copy_(values[a - lo: b - lo])
            finally:
                self._release(key, buf)

    # ------------------------------------------------------------------ lifecycle
    @property
    def file_bytes(self) -> int:
        return self.file.nbytes

    def close(self) -> None:
        """Waits for I/O, deletes the file and its directory, gives the ring back. Idempotent."""
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(Exception):
            self.flush()
        self.file.close()
        if self._own_directory:
            self.directory.remove()
        else:
            with contextlib.suppress(OSError):
                os.remove(self.file.path)
        if self.masters is not None and self.masters.tier is self:
            self.masters.tier = None
        self.ledger.host_free(self.ring_bytes, pinned=False)
        self.ring = []
