"""State segments: the CPU Adam state of a unit larger than a block, in block-sized pieces for
the NVMe tier.

The NVMe tier (``nvme.py``) streams each unit's Adam state through a ring of host buffers, each
as large as one region. A region was a unit, so the largest unit sized the ring, and the largest
unit is the vocabulary, not a block: Llama-3's untied head is 525 M parameters against 218 M in
its largest block, and its ring of three held 12.6 GB of fp32 moments where three blocks' take
5.2 GB.

CPU Adam steps whole parameters with their whole state bound, so the pieces are made where it
can see them: with ``nvme_path`` set, `build_optimizer` gives CPU Adam, for a unit whose masters
outgrow the largest block's, *segment* parameters instead of its masters: 1-D views of element
ranges ``[lo, hi)`` of a master, at most the largest block's element count each and starting at
a multiple of `ALIGN` elements (so 8-bit moments are quantized in the same 256-element blocks
as the whole parameter's, bit for bit). Each segment is a CPU param group and an NVMe region of
its own (key ``(unit index, group index)``); an update binds and steps one segment after
another. Its gradient is the same range of the master's (`StateSegments.point_grads`), its
copy-out the same range of the image. A checkpoint names a segment as the CPU piece
``(unit, parameter, first element, count)``, which loads under any other layout through the
optimizer's ``recut``. Units no larger than the largest block keep one region, as before, and
without the NVMe tier nothing is cut.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..memory import placeholder

#: Segments start at multiples of this many elements: 8-bit moments are quantized in blocks of
#: 256 (``quant8.BLOCK``), and an fp32 range starting here starts on a 4 KiB page.
ALIGN = 1024


@dataclass(frozen=True, slots=True)
class Slice:
    """One segment parameter: elements ``[lo, hi)`` of ``master``, parameter ``k`` of unit ``unit``."""

    param: nn.Parameter
    master: nn.Parameter
    unit: int
    k: int
    lo: int
    hi: int


class StateSegments:
    """Which units are cut, and their slices; built by `build_optimizer`, read by the updates."""

    def __init__(self, cap: int) -> None:
        self.cap = cap  # elements per segment at most: the largest block's, rounded down to ALIGN
        self.slices: dict[int, Slice] = {}  # id(segment parameter) -> its slice
        self._by_unit: dict[int, list[Slice]] = {}
        self.cut_units: set[int] = set()

    @classmethod
    def for_engine(cls, engine) -> StateSegments | None:
        """The segments of ``engine``'s units, or None where nothing would be cut (no block, or
        the largest unit no larger than the largest block).

        With the masters on disk too (``nvme_masters``), a segment's masters are a page-aligned
        range of its unit's extent in the masters file, written back whole: only a unit whose
        one trainable parameter starts its extent is cut (a vocabulary embedding or head; a
        unit of several large parameters keeps one region)."""
        def trainable(unit) -> int:
            return sum(m.numel() for m in unit.host.masters if m is not None)

        def cuttable(unit) -> bool:
            if not unit.host.masters_on_disk:
                return True
            pieces = [piece for m, piece in zip(unit.host.masters, unit.host.pieces) if m is not None]
            return len(pieces) == 1 and pieces[0][1] == 0

        blocks = [trainable(u) for u in engine.units if u.kind == "block"]
        if not blocks:
            return None
        cap = max(ALIGN, max(blocks) // ALIGN * ALIGN)
        segments = cls(cap)
        segments.cut_units = {u.index for u in engine.units
                              if u.kind != "block" and trainable(u) > cap and cuttable(u)}
        return segments if segments.cut_units else None

    def pack(self, unit, masters: list[nn.Parameter]) -> list[list[nn.Parameter]]:
        """``masters`` (of ``unit``, one param group's) as the parameter lists of its segments:
        whole masters packed up to `cap` elements, and a master larger than that cut into
        ranges of `cap`."""
        index = {id(m): k for k, m in enumerate(unit.host.masters) if m is not None}
        out: list[list[nn.Parameter]] = []
        pack: list[nn.Parameter] = []
        size = 0
        for m in masters:
            n = m.numel()
            if n > self.cap:
                on_disk = unit.host.masters_on_disk  # no values in RAM: the tier binds each segment's
                flat = None if on_disk else m.data.view(-1)
                for lo in range(0, n, self.cap):
                    hi = min(lo + self.cap, n)
                    piece = nn.Parameter(placeholder((hi - lo,)) if on_disk else flat[lo:hi], requires_grad=True)
                    piece.grad_dtype = m.grad_dtype  # None where the master's .grad is a bf16 host gradient
                    s = Slice(piece, m, unit.index, index[id(m)], lo, hi)
                    self.slices[id(piece)] = s
                    self._by_unit.setdefault(unit.index, []).append(s)
                    out.append([piece])
                continue
            if pack and size + n > self.cap:
                out.append(pack)
                pack, size = [], 0
            pack.append(m)
            size += n
        if pack:
            out.append(pack)
        return out

    def point_grads(self, unit_index: int) -> None:
        """Each segment of the unit takes the same range of its master's ``.grad`` (None where
        the master has none): what `load_master_grads` just set."""
        for s in self._by_unit.get(unit_index, ()):
            g = s.master.grad
            s.param.grad = None if g is None else g.view(-1)[s.lo:s.hi]

    def grad_of(self, param: torch.Tensor, grads: dict[int, torch.Tensor]) -> torch.Tensor | None:
        """The gradient ``param`` (a master or a segment) was stepped with, given the unit's
        gradients by parameter index; None if it had none."""
        s = self.slices.get(id(param))
        if s is None:
            return None
        g = grads.get(s.k)
        return None if g is None else g.reshape(-1)[s.lo:s.hi]


__all__ = ["ALIGN", "Slice", "StateSegments"]
