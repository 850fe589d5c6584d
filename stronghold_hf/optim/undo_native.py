"""The inverse of one CPUAdam step as a single native pass: the rollback of a missed speculation.

A speculative update that the step does not validate is undone by inverting AdamW from the
gradient it read (speculation.py, `undo_adamw_`). Written as torch ops that inverse is about
ten passes over the block, each streaming the fp32 moments and masters through memory; on
the H200 a miss cost ~0.5 s, the undo a good part of it (issue #34). This kernel reads
param, grad, exp_avg and exp_avg_sq once and writes param, exp_avg and exp_avg_sq once (28
B/param, as the forward step), on every core of the calling thread, in one OpenMP region
per call (``csrc/adam_undo.cpp``), compiled and loaded like CPUAdam's forward kernel
(native.py), whose math it mirrors (``csrc/cpu_adam.cpp``, ``adam_range``).

How it inverts (per element; ``g' = g * grad_mul`` in fp32, a bf16 gradient widened first,
exactly as the forward computed it):

* the parameter: the forward's step term ``s = (-lr/bc1) m1 / (sqrt(v1)/sqrt(bc2) + eps)``
  is recomputed bit for bit (same fp32 operands, same operation order) and subtracted in
  fp32, then the decay is divided out. Each result is rounded back onto the fp32 grid the
  forward's intermediate lay on, so about 98% of parameters come back bit for bit;
* ``v0 = max(0, fma(-a, g', v1) / beta2)`` with ``a`` the forward's fp32 ``(1 - beta2) g'``:
  the fma lands back on the forward's fp32 ``beta2 v0`` unless its rounding of ``v1`` was
  over half an ulp of it;
* ``m0 = (m1 - w g') / (1 - w)`` with ``w`` the forward's fp32 ``1 - beta1``, in double and
  rounded once: the forward rounded ``g' - m0``, which no inverse can recover, so the best is
  the exact inverse of its real-number map (the product of two fp32 values is exact in
  double). About 62% come back bit for bit at beta1 = 0.9, against 49% through the torch
  undo's three fp32 roundings; both are within an ulp or two of the operands;
* a moment whose old value the forward multiplied by 0 (``beta == 0``, or ``1 - beta``
  rounding to 1 in fp32), and both moments of a state whose step was its first, are set to
  0: the redo does not read them, and a fresh state's moments were exactly 0;
* the step count goes back by one.

Threads: the call splits the concatenated tensors into one contiguous slice per thread, as
the forward does, so results do not depend on the thread count.
"""

from __future__ import annotations

import array
import ctypes
import math
from typing import Any

import torch
from torch import Tensor

from .native import NativeLibrary

__all__ = ["native_undo_error", "native_undo_accepts", "redo_adamw_table_", "undo_adamw_native_", "undo_adamw_table_"]

_GRAD_BF16 = 16  # table flag: the gradient is bf16 (the forward kernel's kGradBf16)

# The kernel: csrc/adam_undo.cpp (sh_adamw_undo's table layout is documented there).
_NATIVE = NativeLibrary("adam_undo", "adam_undo.cpp", abi=("sh_adam_undo_abi", 2), signatures={
    "sh_adamw_undo": [ctypes.c_int64, ctypes.c_void_p] + [ctypes.c_double] * 6 + [ctypes.c_int32],
    "sh_adamw_redo": [ctypes.c_int64, ctypes.c_void_p] + [ctypes.c_double] * 12 + [ctypes.c_int32]},
    fallback="undo_adamw_(kernel='auto') undoes with torch ops instead (speculation._undo_adamw_torch, "
             "about ten passes over the block)")


def native_undo_error() -> str | None:
    """Why the native undo is unavailable (building it if needed), or ``None`` if it works."""
    return _NATIVE.error()


def native_undo_accepts(p: Tensor, g: Tensor, state: dict[str, Tensor]) -> bool:
    """Whether the kernel can undo this tensor's step: the layout CPUAdam's fp32 state has (a
    contiguous fp32 CPU master and moments, a contiguous fp32 or bf16 CPU gradient of as many
    elements, an fp32 0-d step)."""
    m, v, step = state.get("exp_avg"), state.get("exp_avg_sq"), state.get("step")
    if m is None or v is None or step is None:
        return False
    fp32 = (p, m, v)
    return (all(t.dtype == torch.float32 and t.device.type == "cpu" and t.is_contiguous() and t.numel() == p.numel()
                for t in fp32)
            and g.dtype in (torch.float32, torch.bfloat16) and g.device.type == "cpu" and g.is_contiguous()
            and g.numel() == p.numel() and step.dtype == torch.float32 and step.device.type == "cpu"
            and step.numel() == 1 and step.is_contiguous())


def undo_adamw_native_(params: list[Tensor], grads: list[Tensor], states: list[dict[str, Tensor]],
                       hyper: dict[str, Any], grad_mul: float) -> None:
    """`speculation.undo_adamw_`'s math in one pass per element, on ``torch.get_num_threads()``
    threads of the calling thread (the GIL is released). Every tensor must be accepted by
    `native_undo_accepts` and the library must load (`native_undo_error` is ``None``)."""
    lib = _NATIVE.load()
    assert lib is not None, _NATIVE.error()
    if not params:
        return
    table = array.array("q")  # int64 [n, 8], see sh_adamw_undo; the lists keep every tensor alive
    for p, g, st in zip(params, grads, states):
        table.extend((p.numel(), p.data_ptr(), g.data_ptr(), st["exp_avg"].data_ptr(), st["exp_avg_sq"].data_ptr(),
                      st["step"].data_ptr(), _GRAD_BF16 if g.dtype == torch.bfloat16 else 0, 0))
    undo_adamw_table_(table, hyper, grad_mul)


def _scalars(hyper: dict[str, Any]) -> tuple[float, float, float, float, float]:
    """(lr, beta1, beta2, weight_decay, eps) of a param group, as the kernels take them."""
    beta1, beta2 = (float(b) for b in hyper["betas"])
    return float(hyper["lr"]), beta1, beta2, float(hyper["weight_decay"]), float(hyper["eps"])


def undo_adamw_table_(table: array.array, hyper: dict[str, Any], grad_mul: float) -> None:
    """The kernel call of `undo_adamw_native_` on an address table made already (int64 [n, 8],
    see sh_adamw_undo); the caller keeps every tensor it names alive (CPUAdam.undo_table)."""
    lib = _NATIVE.load()
    assert lib is not None, _NATIVE.error()
    if not math.isfinite(grad_mul):
        raise ValueError(f"undo_adamw_native_: grad_mul={grad_mul} is not finite; no step applied it.")
    lib = _NATIVE.for_elements(sum(table[0::8]))  # a small undo keeps the GIL (native.py)
    lib.sh_adamw_undo(len(table) // 8, table.buffer_info()[0], *_scalars(hyper), float(grad_mul),
                      torch.get_num_threads())


def redo_adamw_table_(table: array.array, undo_hyper: dict[str, Any], undo_grad_mul: float,
                      hyper: dict[str, Any], grad_mul: float) -> None:
    """A missed speculation's rollback and redo in one pass (``sh_adamw_redo``): on the step
    table of the update being rolled back (CPUAdam's layout, int64 [n, 8]), the undo of that
    update (made with ``undo_hyper`` and ``undo_grad_mul``) then the step with ``hyper`` and
    ``grad_mul``, bit for bit what `undo_adamw_table_` and the step would leave, with the
    masters and moments streamed once instead of twice. The caller keeps the tensors alive."""
    if not (math.isfinite(undo_grad_mul) and math.isfinite(grad_mul)):
        raise ValueError(f"redo_adamw_table_: grad_mul={undo_grad_mul}/{grad_mul} is not finite.")
    _NATIVE.load()
    lib = _NATIVE.for_elements(sum(table[0::8]))  # a small call keeps the GIL (native.py)
    assert lib is not None, _NATIVE.error()
    lib.sh_adamw_redo(len(table) // 8, table.buffer_info()[0], *_scalars(undo_hyper), float(undo_grad_mul),
                      *_scalars(hyper), float(grad_mul), torch.get_num_threads())
