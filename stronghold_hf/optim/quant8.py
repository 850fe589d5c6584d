"""Blockwise dynamic 8-bit quantization of Adam's moments, and the 8-bit AdamW step on the CPU.

Lean host memory (``StrongholdConfig(host_memory="lean")``) keeps both Adam moments in 8 bits
instead of 32: about 2 B/param for the two together instead of 8. The method is Dettmers et
al., "8-bit Optimizers via Block-wise Quantization" (ICLR 2022), the algorithm behind
bitsandbytes' ``adamw_bnb_8bit``:

* **Blocks.** A tensor is cut into blocks of `BLOCK` = 256 consecutive elements; each block
  keeps one fp32 *absmax* (the largest magnitude in it) and one uint8 code per element. An
  outlier only costs the precision of its own block.
* **Dynamic map.** A code stands for one of 256 values in [-1, 1] (`signed_map`, for the first
  moment) or [0, 1] (`unsigned_map`, for the second): 0, 1, and magnitudes over 7 decades
  below 1. Decade ``d`` (``10**(d-7)`` to ``10**(d-6)``) is split into ``n_d`` equal intervals,
  1, 2, 4, ... 64 of them (signed) or 2, 4, ... 128 (unsigned), more towards 1 (the "dynamic
  tree"), and each interval's code is its midpoint. So relative precision is about the same
  for large and tiny values. ``x / absmax`` is stored as the nearest code: the midpoint of the
  interval it falls in, or across a decade's edge the nearer of the two decades' codes (a
  threshold per decade decides). A code reads back as ``value * absmax``.
* **One pass.** The step dequantizes a block's moments, applies AdamW in fp32 (exactly as the
  fp32 kernel does, the parameter update uses the new moments before they are re-quantized),
  finds the new absmax, and quantizes again: each moment is read and written once per step.

Tensors smaller than `MIN_8BIT_NUMEL` (norms, biases) keep fp32 moments: they are a rounding
error of the memory and where precision matters most.

No tables in the kernel: both directions are arithmetic on per-decade constants
(`map_constants`), which fit in one 8-lane register each, so the native kernel (C++/OpenMP,
``csrc/cpu_adam8.cpp``, built like CPUAdam's) quantizes and dequantizes 8 lanes at a time with
AVX2 permutes instead of gathers (gathers made it 3x slower). Decoding is
``fma(k, step_d, first_d)`` in fp32, and the maps are *defined* as that value, so the torch
reference (`step_reference`: the fallback, and what the tests hold the kernel to) and the
kernel agree bit for bit. The vector codec finds a code's decade from the exponent of
``float(|code - 127|)`` (or ``code + 1``), and a value's from an estimate off its float bits
plus one compare, instead of a compare per decade; it was checked equal to the scalar one for
every float in [-1, 1] (a block whose 1 / absmax is not finite takes the scalar path).
"""

from __future__ import annotations

import ctypes
import functools
import math

import torch
from torch import Tensor

from .native import NativeLibrary

BLOCK = 256
MIN_8BIT_NUMEL = 4096
DECADES = 7


def _counts(signed: bool) -> list[int]:
    """Intervals per decade, from the smallest decade up: 127 magnitudes signed, 254 unsigned."""
    return [2 ** (d + (0 if signed else 1)) for d in range(DECADES)]


@functools.cache
def map_constants(signed: bool) -> Tensor:
    """fp32 [64], per decade ``d`` (8 lanes, the last repeating decade 6): the first magnitude,
    the step between magnitudes, the decade's lower edge, intervals per unit of magnitude, the
    index of its first magnitude, ``n_d - 1``, and where it starts: the midpoint between its
    first magnitude and the last of the decade below; then the thresholds of 0 and of 1."""
    counts = _counts(signed)
    first, step, lower, per_unit, start, last_k = [], [], [], [], [], []
    j = 0
    for d, n in enumerate(counts):
        scale = 10.0 ** (d - (DECADES - 1))  # 1e-6 ... 1: the decade's upper edge
        first.append(scale * (0.1 + 0.45 / n))  # the midpoint of its first interval
        step.append(scale * 0.9 / n)
        lower.append(scale * 0.1)
        per_unit.append(n / (0.9 * scale))
        start.append(j)
        last_k.append(n - 1)
        j += n
    lanes = [first, step, lower, per_unit, start, last_k]
    out = torch.zeros(64, dtype=torch.float32)
    for row, values in enumerate(lanes):
        out[8 * row: 8 * row + 8] = torch.tensor(values + values[-1:], dtype=torch.float64).float()
    mags = _magnitudes(signed, out).double()
    for d in range(1, DECADES):
        j = int(out[32 + d])
        out[48 + d] = float(((mags[j - 1] + mags[j]) / 2).float())
    out[55] = out[54]
    out[56] = float((mags[0] / 2).float())  # below: 0
    out[57] = float(((mags[-1] + 1.0) / 2).float())  # from here: 1
    return out


def _magnitudes(signed: bool, consts: Tensor) -> Tensor:
    """fp32: ``fma(k, step_d, first_d)`` of every interval, ascending (exact in float64, one rounding)."""
    values = []
    for d, n in enumerate(_counts(signed)):
        k = torch.arange(n, dtype=torch.float64)
        values.append((k * consts[8 + d].double() + consts[d].double()).float())
    return torch.cat(values)


@functools.cache
def signed_map() -> Tensor:
    """fp32 [256], ascending: -magnitudes (127), 0 (code 127), +magnitudes (128..254), 1 (255)."""
    mags = _magnitudes(True, map_constants(True))
    return torch.cat([-mags.flip(0), torch.zeros(1), mags, torch.ones(1)])


@functools.cache
def unsigned_map() -> Tensor:
    """fp32 [256], ascending: 0 (code 0), magnitudes (1..254), 1 (255)."""
    mags = _magnitudes(False, map_constants(False))
    return torch.cat([torch.zeros(1), mags, torch.ones(1)])


def quantize(xn: Tensor, signed: bool) -> Tensor:
    """uint8 codes nearest to normalized fp32 ``xn`` (values in [-1, 1], or [0, 1] unsigned), by
    the same fp32 operations as the native kernel's: the decade by its threshold, then the
    interval in it (clamped to the decade, which is the nearest code at its edges)."""
    c = map_constants(signed)
    xn = xn.clamp(-1.0 if signed else 0.0, 1.0).contiguous()
    ax = xn.abs()
    d = torch.zeros(xn.shape, dtype=torch.int64)
    for e in range(1, DECADES):
        d += (ax >= c[48 + e]).to(torch.int64)
    k = torch.floor((ax - c[16:24][d]) * c[24:32][d])
    k = torch.minimum(torch.clamp_min(k, 0.0), c[40:48][d]).to(torch.int64)
    j = c[32:40][d].to(torch.int64) + k
    code = torch.where(xn < 0, 126 - j, 128 + j) if signed else 1 + j
    code = torch.where(ax < c[56], torch.full_like(code, 127 if signed else 0), code)
    code = torch.where(xn >= c[57], torch.full_like(code, 255), code)
    return code.to(torch.uint8)


def dequantize(codes: Tensor, signed: bool) -> Tensor:
    return (signed_map() if signed else unsigned_map())[codes.to(torch.int64)]


def num_blocks(numel: int) -> int:
    return -(-numel // BLOCK)


def new_state(param: Tensor) -> dict[str, Tensor]:
    """Zero 8-bit moments for ``param`` (codes of 0.0 and absmax 0)."""
    n, nb = param.numel(), num_blocks(param.numel())
    return {"step": torch.tensor(0.0, dtype=torch.float32),
            "exp_avg_q": torch.full((n,), 127, dtype=torch.uint8), "exp_avg_absmax": torch.zeros(nb),  # 127: 0.0
            "exp_avg_sq_q": torch.zeros(n, dtype=torch.uint8), "exp_avg_sq_absmax": torch.zeros(nb)}


def _blocks(t: Tensor, fill: float = 0.0) -> Tensor:
    n = t.numel()
    pad = num_blocks(n) * BLOCK - n
    flat = t.reshape(-1)
    if pad:
        flat = torch.cat([flat, flat.new_full((pad,), fill)])
    return flat.view(-1, BLOCK)


#: The state's per-element keys (uint8 codes) and per-block keys (fp32 absmax).
CODE_KEYS = ("exp_avg_q", "exp_avg_sq_q")
ABSMAX_KEYS = ("exp_avg_absmax", "exp_avg_sq_absmax")


def is_8bit(state: dict) -> bool:
    return "exp_avg_q" in state


def _quantize_blocks(x: Tensor, signed: bool) -> tuple[Tensor, Tensor]:
    n = x.numel()
    xb = _blocks(x.float().reshape(-1))
    absmax = xb.abs().amax(dim=1)
    inv = torch.where(absmax > 0, 1.0 / absmax, torch.zeros_like(absmax))
    return quantize(xb * inv[:, None], signed).reshape(-1)[:n].clone(), absmax


def _dequantize_blocks(codes: Tensor, absmax: Tensor, signed: bool, n: int) -> Tensor:
    return (dequantize(_blocks(codes, 0), signed) * absmax[:, None]).reshape(-1)[:n]


def state_to_8bit(state: dict[str, Tensor]) -> dict[str, Tensor]:
    """fp32 moments (``torch.optim.AdamW``'s state) quantized, e.g. an exact checkpoint resumed lean."""
    m_q, m_a = _quantize_blocks(state["exp_avg"], True)
    v_q, v_a = _quantize_blocks(state["exp_avg_sq"], False)
    return {"step": state["step"], "exp_avg_q": m_q, "exp_avg_absmax": m_a, "exp_avg_sq_q": v_q, "exp_avg_sq_absmax": v_a}


def state_to_fp32(state: dict[str, Tensor], shape: torch.Size) -> dict[str, Tensor]:
    """8-bit moments read back as fp32 ``exp_avg``/``exp_avg_sq`` of ``shape`` (a lean checkpoint resumed exact)."""
    n = state["exp_avg_q"].numel()
    return {"step": state["step"],
            "exp_avg": _dequantize_blocks(state["exp_avg_q"], state["exp_avg_absmax"], True, n).view(shape).clone(),
            "exp_avg_sq": _dequantize_blocks(state["exp_avg_sq_q"], state["exp_avg_sq_absmax"], False, n)
            .view(shape).clone()}


# [Note: the second moment's floor] The second moment spans twice the decades of the first
# (v ~ g^2, m ~ g), and the unsigned map reaches 1e-7 of a block's absmax: an element whose
# gradient is 1e-4 of its block's largest keeps a first moment (1e-4 is a code) while its second
# rounds to 0. When its next gradient is 0 or much smaller (an embedding row whose token is not in
# the batch; a head row whose logit went to sleep), the update is m / (0 + eps): thousands of
# times lr. Measured on a Llama of vocabulary 2048 at lr 1e-2 (six steps, against fp32 AdamW):
# the head 7.2 away, single updates of 3.0. Exact Adam never lets the first moment outgrow the
# second: by Cauchy-Schwarz over the two decaying sums, |m| <= K sqrt(v) with
# K = (1 - beta1) / sqrt((1 - beta2) (1 - beta1^2 / beta2)) (7.27 at 0.9 / 0.999). So the step
# holds the new v to at least (m / K)^2: a v exact arithmetic gives is never raised (to fp32's
# rounding; the codec's rounding near the bound may be), and a v it lost reads as the smallest
# the first moment allows, an update of at most K lr sqrt(1 - beta2^t) / (1 - beta1^t) (at most
# K lr for 0.9 / 0.999; then decaying as in exact Adam) instead of m / eps. The bound assumes
# betas fixed over the run. After the fix the same run ended with the
# head 0.033 and the embedding 0.040 from fp32 AdamW's (six steps of at most 0.01), the MLP 0.008
# (0.06 before: its quiet elements blew up too). HF's Trainer keeps embeddings' state 32-bit
# with bitsandbytes; that was tried here on top of the floor and moved none of these figures, so
# embeddings keep 8-bit moments (and the memory figures). tests/test_lean_host_memory.py.


def moment_floor(beta1: float, beta2: float) -> float:
    """``1 / K``, where exact Adam keeps ``|m| <= K sqrt(v)`` ([Note: the second moment's floor]);
    0 (no floor) for betas where no such bound holds (``beta1^2 >= beta2``)."""
    if not (0.0 <= beta1 < 1.0 and beta1 * beta1 < beta2 < 1.0):
        return 0.0
    return math.sqrt((1.0 - beta2) * (1.0 - beta1 * beta1 / beta2)) / (1.0 - beta1)


@torch.no_grad()
def step_reference(param: Tensor, grad: Tensor, state: dict[str, Tensor], *, lr: float, beta1: float, beta2: float,
                   eps: float, weight_decay: float, grad_mul: float = 1.0, out: Tensor | None = None) -> None:
    """One 8-bit AdamW step of one tensor in plain torch (the fallback, and the tests' reference).

    Same math and order as the fp32 kernels: decay, moments from the dequantized ones (the
    second held to `moment_floor`), the update from the new fp32 moments, then re-quantization
    with each block's new absmax."""
    n = param.numel()
    state["step"].add_(1.0)
    t = float(state["step"])
    bc1, bc2_sqrt = 1.0 - beta1**t, math.sqrt(1.0 - beta2**t)
    m = _dequantize_blocks(state["exp_avg_q"], state["exp_avg_absmax"], True, n)
    v = _dequantize_blocks(state["exp_avg_sq_q"], state["exp_avg_sq_absmax"], False, n)
    g = grad.reshape(-1).float()
    if grad_mul != 1.0:
        g = g * grad_mul
    p = param.view(-1)
    if weight_decay != 0.0:
        p.mul_(1.0 - lr * weight_decay)
    m = m.lerp(g, 1.0 - beta1)
    v = v.mul(beta2).addcmul_(g, g, value=1.0 - beta2)
    floor = (m * torch.tensor(moment_floor(beta1, beta2), dtype=torch.float32)).square()
    v = torch.where(floor > v, floor, v)  # the kernel's rule: v kept where either is NaN
    p.addcdiv_(m, v.sqrt().div_(bc2_sqrt).add_(eps), value=-lr / bc1)
    for moment, signed, q_key, a_key in ((m, True, "exp_avg_q", "exp_avg_absmax"), (v, False, "exp_avg_sq_q",
                                                                                    "exp_avg_sq_absmax")):
        codes, absmax = _quantize_blocks(moment, signed)
        state[q_key].copy_(codes)
        state[a_key].copy_(absmax)
    if out is not None:
        out.copy_(param)


# ---------------------------------------------------------------------------- the native kernel
# csrc/cpu_adam8.cpp (sh_adamw8_step's table layout is documented there).
_NATIVE = NativeLibrary(
    "cpu_adam8", "cpu_adam8.cpp", abi=("sh_adamw8_abi", 6),
    signatures={"sh_adamw8_step": [ctypes.c_int64, ctypes.c_void_p] + [ctypes.c_double] * 7 + [ctypes.c_void_p] * 2
                + [ctypes.c_int32]},
    fallback="CPUAdam steps 8-bit moments with quant8.step_reference (torch ops, the same math, slower) instead")


def native_kernel():
    """The compiled 8-bit step (built once, like CPUAdam's), or None when `native_error` says why not."""
    return _NATIVE.load()


def native_error() -> str | None:
    return _NATIVE.error()


@functools.cache
def _map_pointers() -> tuple[tuple[Tensor, ...], tuple[int, ...]]:
    tensors = (map_constants(True), map_constants(False))
    return tensors, tuple(t.data_ptr() for t in tensors)


__all__ = ["BLOCK", "MIN_8BIT_NUMEL", "CODE_KEYS", "ABSMAX_KEYS", "is_8bit", "state_to_8bit", "state_to_fp32", "signed_map", "unsigned_map", "map_constants", "quantize",
           "dequantize", "new_state", "step_reference", "num_blocks", "native_kernel", "native_error"]
