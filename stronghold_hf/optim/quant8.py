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
built like CPUAdam's) quantizes and dequantizes 8 lanes at a time with AVX2 permutes instead
of gathers (gathers made it 3x slower). Decoding is ``fma(k, step_d, first_d)`` in fp32, and
the maps are *defined* as that value, so the torch reference (`step_reference`: the fallback,
and what the tests hold the kernel to) and the kernel agree bit for bit.
"""

from __future__ import annotations

import ctypes
import functools
import math

import torch
from torch import Tensor

from .native import ROUNDING_HELPERS, NativeLibrary

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


@torch.no_grad()
def step_reference(param: Tensor, grad: Tensor, state: dict[str, Tensor], *, lr: float, beta1: float, beta2: float,
                   eps: float, weight_decay: float, grad_mul: float = 1.0, out: Tensor | None = None) -> None:
    """One 8-bit AdamW step of one tensor in plain torch (the fallback, and the tests' reference).

    Same math and order as the fp32 kernels: decay, moments from the dequantized ones, the
    update from the new fp32 moments, then re-quantization with each block's new absmax."""
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
    p.addcdiv_(m, v.sqrt().div_(bc2_sqrt).add_(eps), value=-lr / bc1)
    for moment, signed, q_key, a_key in ((m, True, "exp_avg_q", "exp_avg_absmax"), (v, False, "exp_avg_sq_q",
                                                                                    "exp_avg_sq_absmax")):
        codes, absmax = _quantize_blocks(moment, signed)
        state[q_key].copy_(codes)
        state[a_key].copy_(absmax)
    if out is not None:
        out.copy_(param)


# ---------------------------------------------------------------------------- the native kernel
_SOURCE_TAIL = r"""
constexpr int64_t kBlock = 256;
constexpr int kDecades = 7;

// map_constants' rows (8 lanes each) and scalars.
enum : int { kFirst = 0, kStep = 8, kLower = 16, kPerUnit = 24, kStart = 32, kLastK = 40, kFrom = 48, kZero = 56,
             kOne = 57 };

// The code nearest to xn (normalized, in [-1, 1], or [0, 1] unsigned): see quant8.quantize.
template <bool Signed>
inline uint8_t encode(float xn, const float* c) {
  const float ax = std::fabs(xn);
  int d = 0;
  for (int e = 1; e < kDecades; ++e) d += ax >= c[kFrom + e];
  const float k = std::min(std::max(std::floor((ax - c[kLower + d]) * c[kPerUnit + d]), 0.0f), c[kLastK + d]);
  const int j = int(c[kStart + d]) + int(k);
  int code = Signed ? (xn < 0.0f ? 126 - j : 128 + j) : 1 + j;
  if (ax < c[kZero]) code = Signed ? 127 : 0;
  if (xn >= c[kOne]) code = 255;
  return uint8_t(code);
}

// The value of a code: fma(k, step_d, first_d), signed, or 0 or 1 (see quant8.signed_map).
template <bool Signed>
inline float decode(uint32_t code, const float* c) {
  if (code == 255u) return 1.0f;
  if (code == (Signed ? 127u : 0u)) return 0.0f;
  const bool negative = Signed && code < 127u;
  const int j = Signed ? (negative ? 126 - int(code) : int(code) - 128) : int(code) - 1;
  int d = 0;
  while (d + 1 < kDecades && j >= int(c[kStart + d + 1])) ++d;
  const float mag = std::fma(float(j - int(c[kStart + d])), c[kStep + d], c[kFirst + d]);
  return negative ? -mag : mag;
}

// q[i] = encode(x[i] * inv) for the block.
template <bool Signed>
void quantize(const float* x, int64_t n, float inv, const float* c, uint8_t* q) {
  int64_t i = 0;
#if defined(__AVX2__) && defined(__FMA__)
  const __m256 vinv = _mm256_set1_ps(inv), vone = _mm256_set1_ps(1.0f), vlo = _mm256_set1_ps(Signed ? -1.0f : 0.0f);
  const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF)), zero = _mm256_setzero_ps();
  const __m256 lower = _mm256_loadu_ps(c + kLower), per_unit = _mm256_loadu_ps(c + kPerUnit);
  const __m256 last_k = _mm256_loadu_ps(c + kLastK);
  const __m256i start = _mm256_cvttps_epi32(_mm256_loadu_ps(c + kStart));
  const __m256 t_zero = _mm256_set1_ps(c[kZero]), t_one = _mm256_set1_ps(c[kOne]);
  __m256 from[kDecades];
  for (int e = 1; e < kDecades; ++e) from[e] = _mm256_set1_ps(c[kFrom + e]);
  const __m256i low_bytes = _mm256_setr_epi8(0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1,
                                             0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1);
  for (; i + 8 <= n; i += 8) {
    const __m256 xn = _mm256_min_ps(vone, _mm256_max_ps(vlo, _mm256_mul_ps(_mm256_loadu_ps(x + i), vinv)));
    const __m256 ax = _mm256_and_ps(xn, absmask);
    __m256i d = _mm256_setzero_si256();
    for (int e = 1; e < kDecades; ++e)  // all-ones lanes are -1: subtracting them counts
      d = _mm256_sub_epi32(d, _mm256_castps_si256(_mm256_cmp_ps(ax, from[e], _CMP_GE_OQ)));
    const __m256 lo = _mm256_permutevar8x32_ps(lower, d), pu = _mm256_permutevar8x32_ps(per_unit, d);
    __m256 k = _mm256_floor_ps(_mm256_mul_ps(_mm256_sub_ps(ax, lo), pu));
    k = _mm256_min_ps(_mm256_max_ps(k, zero), _mm256_permutevar8x32_ps(last_k, d));
    const __m256i j = _mm256_add_epi32(_mm256_permutevar8x32_epi32(start, d), _mm256_cvttps_epi32(k));
    __m256i code;
    if (Signed) {
      const __m256i neg = _mm256_castps_si256(_mm256_cmp_ps(xn, zero, _CMP_LT_OQ));
      code = _mm256_blendv_epi8(_mm256_add_epi32(_mm256_set1_epi32(128), j),
                                _mm256_sub_epi32(_mm256_set1_epi32(126), j), neg);
    } else {
      code = _mm256_add_epi32(_mm256_set1_epi32(1), j);
    }
    code = _mm256_blendv_epi8(code, _mm256_set1_epi32(Signed ? 127 : 0),
                              _mm256_castps_si256(_mm256_cmp_ps(ax, t_zero, _CMP_LT_OQ)));
    code = _mm256_blendv_epi8(code, _mm256_set1_epi32(255), _mm256_castps_si256(_mm256_cmp_ps(xn, t_one, _CMP_GE_OQ)));
    const __m256i packed = _mm256_shuffle_epi8(code, low_bytes);
    const uint32_t lo4 = uint32_t(_mm256_extract_epi32(packed, 0)), hi4 = uint32_t(_mm256_extract_epi32(packed, 4));
    std::memcpy(q + i, &lo4, 4);
    std::memcpy(q + i + 4, &hi4, 4);
  }
#endif
  for (; i < n; ++i) q[i] = encode<Signed>(std::min(1.0f, std::max(Signed ? -1.0f : 0.0f, x[i] * inv)), c);
}

// x[i] = decode(q[i]) * scale for the block.
template <bool Signed>
void dequantize(const uint8_t* q, int64_t n, float scale, const float* c, float* x) {
  int64_t i = 0;
#if defined(__AVX2__) && defined(__FMA__)
  const __m256 vscale = _mm256_set1_ps(scale), first = _mm256_loadu_ps(c + kFirst), step = _mm256_loadu_ps(c + kStep);
  const __m256i start = _mm256_cvttps_epi32(_mm256_loadu_ps(c + kStart));
  __m256i from_j[kDecades];
  for (int e = 1; e < kDecades; ++e) from_j[e] = _mm256_set1_epi32(int(c[kStart + e]) - 1);
  const __m256i zero_code = _mm256_set1_epi32(Signed ? 127 : 0), one_code = _mm256_set1_epi32(255);
  const __m256 sign = _mm256_castsi256_ps(_mm256_set1_epi32(int(0x80000000u)));
  for (; i + 8 <= n; i += 8) {
    int64_t raw;
    std::memcpy(&raw, q + i, 8);
    const __m256i code = _mm256_cvtepu8_epi32(_mm_cvtsi64_si128(raw));
    __m256i j;
    __m256 neg = _mm256_setzero_ps();
    if (Signed) {
      const __m256i below = _mm256_cmpgt_epi32(_mm256_set1_epi32(127), code);
      j = _mm256_blendv_epi8(_mm256_sub_epi32(code, _mm256_set1_epi32(128)),
                             _mm256_sub_epi32(_mm256_set1_epi32(126), code), below);
      neg = _mm256_and_ps(_mm256_castsi256_ps(below), sign);
    } else {
      j = _mm256_sub_epi32(code, _mm256_set1_epi32(1));
    }
    __m256i d = _mm256_setzero_si256();
    for (int e = 1; e < kDecades; ++e) d = _mm256_sub_epi32(d, _mm256_cmpgt_epi32(j, from_j[e]));
    const __m256 k = _mm256_cvtepi32_ps(_mm256_sub_epi32(j, _mm256_permutevar8x32_epi32(start, d)));
    __m256 v = _mm256_fmadd_ps(k, _mm256_permutevar8x32_ps(step, d), _mm256_permutevar8x32_ps(first, d));
    v = _mm256_or_ps(v, neg);
    v = _mm256_blendv_ps(v, _mm256_setzero_ps(), _mm256_castsi256_ps(_mm256_cmpeq_epi32(code, zero_code)));
    v = _mm256_blendv_ps(v, _mm256_set1_ps(1.0f), _mm256_castsi256_ps(_mm256_cmpeq_epi32(code, one_code)));
    _mm256_storeu_ps(x + i, _mm256_mul_ps(v, vscale));
  }
#endif
  for (; i < n; ++i) x[i] = decode<Signed>(q[i], c) * scale;
}
}  // namespace

extern "C" int sh_adamw8_abi() { return 4; }

// table: int64 [nt, 10] = numel, then the addresses of param and grad (fp32 [numel]), the
// first moment's codes (uint8 [numel]) and absmax (fp32 [blocks]), the second's, out
// (bf16/fp16 [numel] or 0), step (fp32 0-d), and the flags: the out kind (0/1/2), plus 16
// when the gradient is bf16 (widened exactly, block by block). map_m, map_v: the
// signed and the unsigned map's constants (quant8.map_constants, fp32 [64]).
extern "C" void sh_adamw8_step(int64_t nt, const int64_t* table, double lr, double beta1, double beta2,
                               double weight_decay, double eps, double grad_mul, const float* map_m,
                               const float* map_v, int32_t nthreads) {
  std::vector<float> neg_step(nt), bc2(nt);
  std::vector<int64_t> first(nt + 1, 0);
  for (int64_t t = 0; t < nt; ++t) {
    const int64_t* e = table + 10 * t;
    float* step = reinterpret_cast<float*>(e[8]);
    *step = *step + 1.0f;
    neg_step[t] = float(-(lr / (1.0 - std::pow(beta1, double(*step)))));
    bc2[t] = float(std::sqrt(1.0 - std::pow(beta2, double(*step))));
    first[t + 1] = first[t] + (e[0] + kBlock - 1) / kBlock;
  }
  // Multiplying by 1.0f is exact, so the loop multiplies unconditionally and stays branch-free.
  const float gmul = float(grad_mul), decay = float(1.0 - lr * weight_decay), w = float(1.0 - beta1);
  const float b2 = float(beta2), omb2 = float(1.0 - beta2), feps = float(eps);
  const int64_t blocks = first[nt];
  const int threads = blocks >= 64 ? std::max(1, int(nthreads)) : 1;
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
  for (int64_t blk = 0; blk < blocks; ++blk) {
    const int64_t t = int64_t(std::upper_bound(first.begin(), first.end(), blk) - first.begin()) - 1;
    const int64_t* e = table + 10 * t;
    const int64_t b = blk - first[t], lo = b * kBlock, n = std::min(kBlock, e[0] - lo);
    float* p = reinterpret_cast<float*>(e[1]) + lo;
    const float* g = reinterpret_cast<const float*>(e[2]) + lo;
    float g_wide[kBlock];
    if (e[9] & 16) {
      widen_bf16(reinterpret_cast<const uint16_t*>(e[2]) + lo, n, g_wide);
      g = g_wide;
    }
    uint8_t* mq = reinterpret_cast<uint8_t*>(e[3]) + lo;
    float* ma = reinterpret_cast<float*>(e[4]) + b;
    uint8_t* vq = reinterpret_cast<uint8_t*>(e[5]) + lo;
    float* va = reinterpret_cast<float*>(e[6]) + b;
    const int kind = int(e[9]) & 3;
    uint16_t* out = kind ? reinterpret_cast<uint16_t*>(e[7]) + lo : nullptr;
    const float ns = neg_step[t], bc = bc2[t];
    float m[kBlock], v[kBlock];
    dequantize<true>(mq, n, *ma, map_m, m);
    dequantize<false>(vq, n, *va, map_v, v);
    for (int64_t i = 0; i < n; ++i) {  // AdamW in fp32, the fp32 kernel's order; vectorizes
      const float gi = g[i] * gmul, m0 = m[i];
      const float mi = std::fma(w, gi - m0, m0);
      const float vi = std::fma(omb2 * gi, gi, v[i] * b2);
      p[i] = p[i] * decay + ns * mi / (std::sqrt(vi) / bc + feps);
      m[i] = mi;
      v[i] = vi;
    }
    if (kind == 1) for (int64_t i = 0; i < n; ++i) out[i] = to_bf16(p[i]);
    if (kind == 2) for (int64_t i = 0; i < n; ++i) out[i] = to_fp16(p[i]);
    // The new absmax on the float bits: for magnitudes integer order is float order, and an
    // integer max vectorizes where a float one (signed zeros, NaN) does not.
    uint32_t am_bits = 0, av_bits = 0;
    for (int64_t i = 0; i < n; ++i) {
      am_bits = std::max(am_bits, bits(m[i]) & 0x7FFFFFFFu);
      av_bits = std::max(av_bits, bits(v[i]) & 0x7FFFFFFFu);
    }
    const float new_am = from_bits(am_bits), new_av = from_bits(av_bits);
    quantize<true>(m, n, new_am > 0.0f ? 1.0f / new_am : 0.0f, map_m, mq);
    quantize<false>(v, n, new_av > 0.0f ? 1.0f / new_av : 0.0f, map_v, vq);
    *ma = new_am;
    *va = new_av;
  }
}
"""

_NATIVE = NativeLibrary(
    "cpu_adam8",
    "#include <algorithm>\n#include <cmath>\n#include <cstdint>\n#include <cstring>\n#include <omp.h>\n#include <vector>\n"
    "#if defined(__AVX2__)\n#include <immintrin.h>\n#endif\nnamespace {\n" + ROUNDING_HELPERS + _SOURCE_TAIL,
    abi=("sh_adamw8_abi", 4),
    signatures={"sh_adamw8_step": [ctypes.c_int64, ctypes.c_void_p] + [ctypes.c_double] * 6 + [ctypes.c_void_p] * 2
                + [ctypes.c_int32]})


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
