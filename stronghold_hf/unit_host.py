"""One unit's host memory: the image fetches copy, the fp32 masters, and what each parameter
is between steps.

A unit (``unit.py``) moves between host and device; this is everything it keeps on the host
side, laid out once (``memory.py`` explains the bytes and the layout): the *image*, what a
fetch copies to the device slot (this rank's shard of the trainable region in the compute
dtype, and the frozen region); the fp32 *masters* of this rank's shard of the trainable
parameters (views into the image when the device computes in fp32, a separate flat buffer
otherwise, or a file: [Note: masters on disk]); and each parameter's *host view*, what its
``.data`` is while the unit is on the host. Without data parallelism (or with replicated CPU
state) the shard is the whole region. It also takes in what others write there: the user
between steps (`adopt_host_writes`), CPU Adam (`image_rewritten`), a load or a gather
(`write_value`). The unit's residency (``unit.py``) decides when; the gradients have their own
state (``unit_grads.py``).

[Note: parameters always point at real memory] A block parameter's ``.data`` is a view into
the slot while the block is on the device, and a view into its host master (trainable) or
its stored bytes (frozen) while it is not. (With *sharded* CPU state no rank holds a whole
trainable parameter between steps: it is then a placeholder of the right shape whose every
element is one NaN (reads are visibly invalid, in-place writes raise, nothing touches freed
memory); ``engine.full_state_dict()`` gathers the values, see host_reads.py.) So between
steps every parameter holds its current value: reading it never touches freed memory, and
writing it (in place, or through ``.data`` as PEFT's merge does) writes the master. Before the
next fetch the unit notices writes it did not make (a ``.data`` that is no longer our view, or
a bumped version counter) and refreshes the compute-dtype image from the masters.

[Note: masters on disk] With nvme_masters the fp32 masters live in a file (nvme.py,
`DiskMasters`) from construction on: no ``master_flat`` in RAM, no image; a fetch reads them
and converts them through the staging ring (``convert_from``), an update binds them into the
NVMe tier's ring with its moments, and between updates a master (and a parameter on the host)
is a placeholder of the right shape. A read between steps maps the file (`materialize`).
"""

from __future__ import annotations

import operator

import torch
from torch import nn

from . import nvme
from .distributed import DataParallel
from .fastpath import engine_access as _engine_access
from .memory import BlockLayout, HostAllocator, element_size, is_placeholder, placeholder, typed_view
from .transfer import FetchStaging, TransferContext

_data_ptr = torch.Tensor.data_ptr  # unbound: half the cost of a methodcaller
_version = operator.attrgetter("_version")


class UnitHost:
    """The host buffers of one unit and its parameters' values between steps; see the module
    docstring. Built once; `Unit` calls it at each fetch and eviction."""

    def __init__(self, index: int, fqn: str, names: list[str], params: list[nn.Parameter], layout: BlockLayout, *,
                 host: HostAllocator, transfer: TransferContext, dp: DataParallel | None,
                 fetch_staging: FetchStaging | None, disk_masters) -> None:
        self.index = index
        self.fqn = fqn
        self.names = names
        self.params = params
        self.layout = layout
        self.transfer = transfer
        self.dp = dp
        shards, rank = (dp.shards, dp.shard_rank) if dp is not None else (1, 0)
        # Sharded even in a group of one: the same code path (all-gather, reduce-scatter) runs.
        self.sharded = dp is not None and dp.sharded
        lay = layout
        S = lay.shard_numel
        self.shard_lo = rank * S  # this rank's shard of the trainable region: [shard_lo, shard_lo + S)

        # ---- buffers (pinned when allowed: what fetches copy; pageable: the rest)
        c = element_size(lay.grad_dtype) if lay.grad_dtype is not None else 0
        self.disk_masters = disk_masters if S else None  # [Note: masters on disk]
        self.masters_on_disk = self.disk_masters is not None
        # Without a host image (host_image=False) a fetch converts the masters through the
        # staging ring instead; with fp32 compute the masters are the image and it always
        # exists, unless they are on disk.
        self.fetch_staging = fetch_staging if S and (not lay.masters_in_image or self.masters_on_disk) else None
        keeps_image = S and self.fetch_staging is None
        self.image_trainable = host.allocate(S * c, transfer=True) if keeps_image else None  # uint8 [S * c]
        self.image_frozen = host.allocate(lay.frozen_bytes, transfer=True) if lay.frozen_bytes else None
        if self.masters_on_disk:
            self.master_flat = torch.empty(S, dtype=torch.float32)  # the initial values, written below, then dropped
        elif S and lay.masters_in_image:
            self.master_flat = self.image_trainable.view(torch.float32)  # fp32 [S]: the image is the master
        else:
            self.master_flat = host.allocate(4 * S, transfer=False).view(torch.float32) if S else None
        shard_image = self.image_trainable.view(lay.grad_dtype) if keeps_image else None  # [S] compute dtype
        # Per parameter: the piece of it this rank keeps, (offset in the parameter, offset in the
        # shard, length); the whole parameter unless the state is sharded.
        self.pieces: list[tuple[int, int, int] | None] = []
        self.masters: list[nn.Parameter | None] = []  # what CPU Adam steps (the piece, fp32)
        self.image_views: list[torch.Tensor | None] = []  # its compute-dtype image (copy-out target), if kept
        self.param_views: list[torch.Tensor] = []  # what the parameter's .data is while on the host
        with torch.no_grad():
            for e, p in zip(lay.entries, params):
                if not e.trainable:
                    view = typed_view(self.image_frozen, e.byte_offset - lay.frozen_offset, e.numel, e.device_dtype,
                                      e.shape)
                    view.copy_(p.detach())
                    self.pieces.append(None)
                    self.masters.append(None)
                    self.image_views.append(view)
                    self.param_views.append(view)
                    continue
                lo = max(e.grad_offset, self.shard_lo)
                hi = min(e.grad_offset + e.numel, self.shard_lo + S)
                if hi <= lo:  # none of this parameter in this rank's shard
                    self.pieces.append(None)
                    self.masters.append(None)
                    self.image_views.append(None)
                else:
                    piece = (lo - e.grad_offset, lo - self.shard_lo, hi - lo)
                    shape = e.shape if not self.sharded else torch.Size([hi - lo])
                    master = self.master_flat[piece[1] : piece[1] + piece[2]].view(shape)
                    master.copy_(p.detach().reshape(-1)[piece[0] : piece[0] + piece[2]].view(shape))
                    image = shard_image[piece[1] : piece[1] + piece[2]].view(shape) if keeps_image else None
                    if image is not None and image.data_ptr() != master.data_ptr():
                        image.copy_(master)
                    self.pieces.append(piece)
                    if self.masters_on_disk:
                        master = placeholder(shape)
                    self.masters.append(nn.Parameter(master, requires_grad=True))
                    self.image_views.append(image)
                if self.sharded or self.masters_on_disk:  # nothing in RAM holds the whole parameter
                    self.param_views.append(placeholder(e.shape))
                else:
                    self.param_views.append(self.masters[-1].data)
        # What a fetch without the image converts: the masters, in RAM or in their file.
        self.convert_from = None
        if self.masters_on_disk:
            self.disk_masters.write_file(index, 0, self.master_flat)
            self.master_flat = None
            self.master_source = self.convert_from = nvme.UnitMasters(self.disk_masters, index, S)
        elif self.fetch_staging is not None:
            self.convert_from = self.master_flat
        self._materialized: dict[int, tuple[int, int]] = {}  # k -> (mapped value's address, version): materialize
        self.master_index = {id(m): k for k, m in enumerate(self.masters) if m is not None}
        self._image_stale = False  # the compute-dtype image lags the masters (refresh before a fetch)
        self.image_undone = None
        # From here on the parameters point at their host views (the unit starts on the host).
        with _engine_access():
            for p, view in zip(params, self.param_views):
                p.data = view
        self._host_ptrs = [v.data_ptr() for v in self.param_views]
        self.record_versions()

    # ------------------------------------------------------------------ queries
    def master_of(self, param: nn.Parameter) -> nn.Parameter | None:
        """The fp32 master (this rank's piece) of ``param``; None if frozen or kept by another rank."""
        for p, m in zip(self.params, self.masters):
            if p is param:
                return m
        raise KeyError(param)

    def is_trainable_param(self, param: nn.Parameter) -> bool:
        return any(p is param and e.trainable for p, e in zip(self.params, self.layout.entries))

    # ------------------------------------------------------------------ writes made on the host
    def record_versions(self) -> None:
        """What the parameters are as they go to the host: their versions (a later in-place
        write bumps one) next to the host memory they point at (``_host_ptrs``)."""
        self._host_versions = list(map(_version, self.params))

    def adopt_host_writes(self) -> bool:
        """Takes in writes made to the parameters while on the host; True if any trainable changed.

        See [Note: parameters always point at real memory]. A ``.data`` that was replaced
        (``p.data = t``) is copied into the master (this rank's piece of it, when sharded); an
        in-place write to our view shows as a bumped version counter (writes through a ``.data``
        alias do not: with bf16/fp16 compute call ``engine.mark_parameters_changed()``)."""
        with _engine_access():
            # The usual case, two reads per parameter in C: still pointing at its host view,
            # not written in place since the unit left the device. (A ``.data`` replaced by a
            # view of the same host memory in another shape is not seen here.)
            params = self.params
            if (not self._materialized and list(map(_data_ptr, params)) == self._host_ptrs
                    and list(map(_version, params)) == self._host_versions):
                return False
        return self._adopt_host_writes()

    def _adopt_host_writes(self) -> bool:
        changed = False
        with torch.no_grad(), _engine_access():
            for k, (p, view) in enumerate(zip(self.params, self.param_views)):
                data = p.data
                mapped = self._materialized.pop(k, None)
                if mapped is not None and data.data_ptr() == mapped[0] and p._version == mapped[1]:
                    p.data = view  # read between steps, not written: the file is current
                    continue
                if data.data_ptr() != view.data_ptr() or data.dtype != view.dtype or data.shape != view.shape or (
                        data.device != view.device):
                    if data.shape != view.shape:
                        raise ValueError(
                            f"stronghold: parameter {self.names[k]} was given shape {tuple(data.shape)}, "
                            f"its unit was laid out for {tuple(view.shape)}. Change shapes before offload_model, or "
                            "close the engine first (engine.close())."
                        )
                    self.write_value(k, data)
                    p.data = view
                    changed |= self.layout.entries[k].trainable
                elif p._version != self._host_versions[k]:
                    changed |= self.layout.entries[k].trainable
        if changed and self.image_trainable is not None and not self.layout.masters_in_image:
            self.image_stale = True
        return changed

    def read_value(self, k: int) -> torch.Tensor:
        """Parameter ``k``'s current value to read from, in its stored dtype: its host view, or
        with the masters on disk its fp32 master mapped from the file (unsharded)."""
        piece = self.pieces[k]
        if self.masters_on_disk and piece is not None:
            flat = self.disk_masters.map(self.index)
            return flat[piece[1] : piece[1] + piece[2]].view(self.param_views[k].shape)
        return self.param_views[k]

    def write_value(self, k: int, value: torch.Tensor) -> None:
        """Writes a full value of parameter ``k`` into what this rank keeps of it (the file,
        with the masters on disk)."""
        view, piece = self.param_views[k], self.pieces[k]
        if self.masters_on_disk and piece is not None:
            self.disk_masters.write(self.index, piece[1], value.reshape(-1)[piece[0] : piece[0] + piece[2]])
        elif not is_placeholder(view):
            view.copy_(value)
        elif piece is not None:
            self.masters[k].data.copy_(value.reshape(-1)[piece[0] : piece[0] + piece[2]].view_as(self.masters[k]))

    def materialize(self) -> None:
        """Masters on disk, unsharded, the unit on the host: each trainable parameter's ``.data``
        becomes its current value, mapped copy-on-write from the file, so a read between steps
        sees it (no RAM of its own). A write to it (in place, or ``.data = t``) is taken into the
        file at the next fetch (`adopt_host_writes`); unwritten, the map is just dropped there."""
        assert self.masters_on_disk and not self.sharded
        flat = self.disk_masters.map(self.index)
        with _engine_access():
            for k, (p, piece) in enumerate(zip(self.params, self.pieces)):
                if piece is None or p.data.data_ptr() != self.param_views[k].data_ptr():
                    continue  # frozen, or already given another value
                value = flat[piece[1] : piece[1] + piece[2]].view(self.param_views[k].shape)
                p.data = value
                self._materialized[k] = (value.data_ptr(), p._version)

    # ------------------------------------------------------------------ the compute-dtype image
    @property
    def image_stale(self) -> bool:
        """The compute-dtype image lags the masters: refresh it before a fetch reads it."""
        return self._image_stale

    @image_stale.setter
    def image_stale(self, stale: bool) -> None:
        self._image_stale = stale
        self.image_undone = None  # a lag of any other cause: only a refresh clears it

    def image_lags_undo(self, params) -> None:
        """An undone speculative update left the image of ``params`` (indices) behind the
        masters. Until anything else makes it stale, a step that writes those images through
        its copy-out clears the lag (`image_rewritten`), so a redo costs no refresh."""
        fresh = not self._image_stale
        self.image_stale = True
        self.image_undone = frozenset(params) if fresh else None

    def image_rewritten(self, params) -> None:
        """A CPU Adam step wrote the image of ``params`` (its copy-out) along with the masters."""
        if self._image_stale and self.image_undone is not None and self.image_undone <= set(params):
            self.image_stale = False

    def refresh_image(self) -> None:
        """Re-derives the compute-dtype image of trainable parameters from the fp32 masters."""
        if not self._image_stale:
            return
        self.transfer.stats.add("image_refreshes", 1)  # a conversion pass on the fetching thread
        with torch.no_grad():
            for e, img, master in zip(self.layout.entries, self.image_views, self.masters):
                if e.trainable and img is not None and master is not None and img.data_ptr() != master.data_ptr():
                    img.copy_(master)  # fp32 -> compute dtype
        self.image_stale = False

    # ------------------------------------------------------------------ whole values
    def full_values(self) -> list[torch.Tensor]:
        """Every parameter's whole host value (fp32 for trainable ones). With sharded state this
        all-gathers the masters: every rank must call it, in the same unit order."""
        if not self.sharded and self.masters_on_disk:  # mapped from the file: no RAM of their own
            flat = self.disk_masters.map(self.index)
            return [flat[piece[1] : piece[1] + piece[2]].view(e.shape) if piece is not None else view.detach()
                    for e, piece, view in zip(self.layout.entries, self.pieces, self.param_views)]
        if not self.sharded:
            return [v.detach() for v in self.param_views]
        S = self.layout.shard_numel
        full = torch.empty(self.layout.padded_grad_numel, dtype=torch.float32)
        local = full[self.shard_lo : self.shard_lo + S]
        if S:
            local.copy_(self.master_source.read(0, S) if self.masters_on_disk else self.master_flat)
            self.dp.all_gather_host_(full, local)
        out = []
        for e, view in zip(self.layout.entries, self.param_views):
            out.append(full[e.grad_offset : e.grad_offset + e.numel].view(e.shape) if e.trainable else view.detach())
        return out

    def restore(self, device: torch.device, values: list[torch.Tensor], grads: list[torch.Tensor | None]) -> None:
        """Gives each parameter an ordinary tensor of its stored dtype on ``device`` holding
        ``values``, and ``grads`` as its ``.grad`` (engine.close); the masters are gone."""
        with torch.no_grad(), _engine_access():
            for e, p, value, grad in zip(self.layout.entries, self.params, values, grads):
                p.grad = None
                p.data = value.to(device=device, dtype=e.stored_dtype, copy=True)
                if grad is not None:
                    p.grad = grad.to(device=device, dtype=e.stored_dtype, copy=True)
        self.masters = [None] * len(self.params)
