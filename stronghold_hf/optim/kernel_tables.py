"""The native kernels' address tables: what each CPU Adam call reads and writes, by address.

A native step (``csrc/cpu_adam.cpp``, ``csrc/cpu_adam8.cpp``) and its undo
(``csrc/adam_undo.cpp``) read one int64 row per tensor: its size and the addresses of the
master, the gradient, the moments, the step count and the copy-out target. Building a row is
Python per tensor (tens of microseconds per parameter: the whole update of a small block), so
the rows of each param group are made once and kept.

[Note: cached tables] A group whose parameters hold the same gradient tensors as at its last
step reuses that step's tables: the engine steps each block with the same gradient buffers
every step. State tensors and copy-out targets only change through ``load_state_dict``,
``register_copy_out`` and ``state_moved`` (the NVMe tier rebinds a unit's moments for each
update), and each of those clears the tables. A missed speculation's undo reads the same
tensors as the step it undoes, so its table is derived from the step's (`undo`), once.

[Note: raw addresses] A table holds addresses only; every tensor it names is kept alive by its
items (grads made contiguous included) for as long as the table is used.
"""

from __future__ import annotations

import array
import operator
import threading
from collections.abc import Callable

import torch
from torch import Tensor

_grad_of = operator.attrgetter("grad")

OUT_KIND = {torch.bfloat16: 1, torch.float16: 2}  # table flag: the copy-out target's dtype
GRAD_BF16 = 16  # table flag of both kernels: the gradient is bf16 (kGradBf16)

#: (param, grad, state, copy-out target or None): one tensor a step updates.
Item = tuple[Tensor, Tensor, dict[str, Tensor], "Tensor | None"]


def _flags(d: Tensor | None, g: Tensor) -> int:
    return (0 if d is None else OUT_KIND[d.dtype]) | (GRAD_BF16 if g.dtype == torch.bfloat16 else 0)


def fp32_table(items: list[Item]) -> array.array:
    """int64 [n, 8] rows for sh_adamw_step: (n, param, grad, exp_avg, exp_avg_sq, dest, step, flags)."""
    table = array.array("q")
    for p, g, st, d in items:
        table.extend((p.numel(), p.data_ptr(), g.data_ptr(), st["exp_avg"].data_ptr(), st["exp_avg_sq"].data_ptr(),
                      0 if d is None else d.data_ptr(), st["step"].data_ptr(), _flags(d, g)))
    return table


def lean_table(items: list[Item]) -> array.array:
    """int64 [n, 10] rows for sh_adamw8_step (blockwise 8-bit moments and their absmax)."""
    table = array.array("q")
    for p, g, st, d in items:
        table.extend((p.numel(), p.data_ptr(), g.data_ptr(), st["exp_avg_q"].data_ptr(),
                      st["exp_avg_absmax"].data_ptr(), st["exp_avg_sq_q"].data_ptr(),
                      st["exp_avg_sq_absmax"].data_ptr(), 0 if d is None else d.data_ptr(),
                      st["step"].data_ptr(), _flags(d, g)))
    return table


class GroupTables:
    """Each param group's cached step tables, and the undo tables made from them."""

    def __init__(self) -> None:
        self._lock = threading.Lock()  # steps of several groups run on the host worker and in step()
        self._steps: dict[int, tuple] = {}  # group -> (grad ids, params list, table, items, table8, items8)
        self._undos: dict[int, tuple[array.array, array.array]] = {}  # group -> (its step table, undo table)

    def clear(self) -> None:
        with self._lock:
            self._steps.clear()

    def cached(self, gi: int, params: list[Tensor]) -> tuple | None:
        """``(table, items, table8, items8)`` of group ``gi``'s last step, if its parameters hold the
        same gradient tensors now ([Note: cached tables])."""
        cached = self._steps.get(gi)
        if cached is None or cached[1] is not params or cached[0] != tuple(map(id, map(_grad_of, params))):
            return None
        return cached[2:]

    def keep(self, gi: int, params: list[Tensor], table: array.array, items: list[Item], table8: array.array,
             items8: list[Item]) -> None:
        """Keeps a step's tables, when they name the parameters' own gradients (no contiguous copy)."""
        if all(g is p.grad for p, g, _, _ in items + items8):
            with self._lock:
                self._steps[gi] = (tuple(map(id, map(_grad_of, params))), params, table, items, table8, items8)

    def undo(self, gi: int, params: list[Tensor], grad_of: Callable[[Tensor], Tensor | None]) -> array.array | None:
        """The table (sh_adamw_undo's layout) that undoes group ``gi``'s last native step, when the
        undo reads exactly its tensors: ``grad_of(param)`` (the gradient the undo uses, or None) is
        the step's gradient for each parameter it stepped, and None for every other. None
        otherwise (no cached step, 8-bit state, other gradients): the caller builds its own."""
        cached = self._steps.get(gi)
        if cached is None or cached[5] or cached[1] is not params:
            return None
        table, items = cached[2], cached[3]
        if sum(grad_of(p) is not None for p in params) != len(items) or not all(
                grad_of(p) is g for p, g, _, _ in items):
            return None
        made = self._undos.get(gi)
        if made is None or made[0] is not table:
            undo = array.array("q")  # step row (n, p, g, m, v, dest, step, flags) -> (n, p, g, m, v, step, bf16, 0)
            for r in range(0, len(table), 8):
                undo.extend((*table[r: r + 5], table[r + 6], table[r + 7] & GRAD_BF16, 0))
            made = self._undos[gi] = (table, undo)
        return made[1]


__all__ = ["GRAD_BF16", "OUT_KIND", "GroupTables", "Item", "fp32_table", "lean_table"]
