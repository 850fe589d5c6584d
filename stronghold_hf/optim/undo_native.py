"""The inverse of one CPUAdam step as a single native pass: the rollback of a missed speculation.

A speculative update that the step does not validate is undone by inverting AdamW from the
gradient it read (speculation.py, `undo_adamw_`). Written as torch ops that inverse is about
ten passes over the block, each streaming the fp32 moments and masters through memory; on
the H200 a miss cost ~0.5 s, the undo a good part of it (issue #34). This kernel reads
param, grad, exp_avg and exp_avg_sq once and writes param, exp_avg and exp_avg_sq once (28
B/param, as the forward step), on every core of the calling thread, in one OpenMP region
per call, compiled and loaded like CPUAdam's forward kernel (native.py), whose math it
mirrors (optim/cpu_adam.py, ``adam_range``).

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

from .native import ROUNDING_HELPERS, THREADING_HELPERS, NativeLibrary

__all__ = ["native_undo_error", "native_undo_accepts", "undo_adamw_native_"]

_GRAD_BF16 = 16  # table flag: the gradient is bf16 (the forward kernel's kGradBf16)

# -ffp-contract=off (native.py's flags) keeps the recomputed step term bitwise equal to the
# forward's in the vector body and the scalar tail alike.
_SOURCE = r"""
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <omp.h>
#include <vector>

namespace {
""" + ROUNDING_HELPERS + THREADING_HELPERS + r"""
struct Undo {
  float grad_mul, decay, lerp_w, one_minus_beta2, eps;  // the forward's fp32 constants
  // 1 / what the forward multiplied p0, m0 and v0 by (decay, 1 - lerp_w, fp32 beta2), in
  // double. [Note: divisions] x * (1/d) in double, rounded to fp32, is x / d correctly rounded
  // except within ~2^-52 of a tie between two floats (about one element in 2^28), and costs a
  // multiply instead of a divide: three fp32/double divides per element made the undo
  // compute bound, 1.5x the forward step's time on this 2-core box.
  double inv_decay, inv_keep_m, inv_keep_v;
};
constexpr int64_t kGradBf16 = 16;  // table flag: the gradient is bf16
constexpr int64_t kWiden = 2048;  // elements of a bf16 gradient widened at a time
using RangeFn = void (*)(float*, const float*, float*, float*, int64_t, const Undo&, float, float);

// p, g, m, v: fp32 [n]. kFresh: the step undone was the state's first (moments back to 0).
// kM / kV: the old moment mattered to the forward (else it is set to 0).
template <bool kScale, bool kDecay, bool kFresh, bool kM, bool kV>
void undo_range(float* __restrict p, const float* __restrict g, float* __restrict m, float* __restrict v,
                int64_t n, const Undo& h, float neg_step, float bc2_sqrt) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    const float gi = kScale ? g[i] * h.grad_mul : g[i];
    const float mi = m[i], vi = v[i];
    const float denom = std::sqrt(vi) / bc2_sqrt + h.eps;  // the forward's, bit for bit
    float pi = p[i] - neg_step * mi / denom;
    if (kDecay) pi = float(double(pi) * h.inv_decay);  // pi landed on the forward's p0 * decay
    p[i] = pi;
    if (kFresh) {
      m[i] = 0.0f;
      v[i] = 0.0f;
    } else {
      // m1 = round(m0 + w round(g' - m0)) has no intermediate on the fp32 grid to recover:
      // the inverse in double (the product of two fp32 values is exact), rounded once.
      m[i] = kM ? float((double(mi) - double(h.lerp_w) * double(gi)) * h.inv_keep_m) : 0.0f;
      // v1 = fma(a, g', b), with a = round((1-b2) g') and b = round(b2 v0) on the fp32 grid:
      // fma(-a, g', v1) is round(b + the forward's rounding), which lands back on b unless
      // that rounding exceeds half an ulp of b; then one correctly rounded division, v0.
      const float a = h.one_minus_beta2 * gi;
      v[i] = kV ? std::max(0.0f, float(double(std::fma(-a, gi, vi)) * h.inv_keep_v)) : 0.0f;
    }
  }
}
template <bool S, bool D, bool F, bool M> RangeFn pick4(bool v) {
  return v ? undo_range<S, D, F, M, true> : undo_range<S, D, F, M, false>;
}
template <bool S, bool D, bool F> RangeFn pick3(bool m, bool v) { return m ? pick4<S, D, F, true>(v) : pick4<S, D, F, false>(v); }
template <bool S, bool D> RangeFn pick2(bool f, bool m, bool v) {
  return f ? pick3<S, D, true>(m, v) : pick3<S, D, false>(m, v);
}
template <bool S> RangeFn pick1(bool d, bool f, bool m, bool v) {
  return d ? pick2<S, true>(f, m, v) : pick2<S, false>(f, m, v);
}
}  // namespace

extern "C" int sh_adam_undo_abi() { return 1; }

// table: int64 [nt, 8] = numel, then the addresses of param, grad, exp_avg, exp_avg_sq (fp32
// [numel]; the grad bf16 when flagged) and step (fp32 0-d), the flags (kGradBf16), and 0.
// Scalars arrive as doubles and are rounded to fp32 as the forward kernel rounds them.
extern "C" void sh_adamw_undo(int64_t nt, const int64_t* table, double lr, double beta1, double beta2,
                              double weight_decay, double eps, double grad_mul, int32_t nthreads) {
  const float lerp_w = float(1.0 - beta1), b2 = float(beta2), decay = float(1.0 - lr * weight_decay);
  const double keep_m = 1.0 - double(lerp_w);  // exact
  const Undo h{float(grad_mul), decay, lerp_w, float(1.0 - beta2), float(eps),
               1.0 / double(decay), 1.0 / keep_m, 1.0 / double(b2)};
  // A factor of 0 lost the old value (and the redo does not read it): no division.
  const bool scale = grad_mul != 1.0, dec = weight_decay != 0.0 && decay != 0.0f;
  const bool has_m = keep_m != 0.0, has_v = b2 != 0.0f;
  // The bias corrections of the step being undone (the step count before it goes back),
  // derived as the forward derives them; then the count goes back by one.
  std::vector<float> coefs(2 * nt);  // -lr / bias_correction1, sqrt(bias_correction2)
  std::vector<char> fresh(nt);
  int64_t total = 0;
  for (int64_t t = 0; t < nt; ++t) {
    const int64_t* e = table + 8 * t;
    float* step = reinterpret_cast<float*>(e[5]);
    coefs[2 * t] = float(-(lr / (1.0 - std::pow(beta1, double(*step)))));
    coefs[2 * t + 1] = float(std::sqrt(1.0 - std::pow(beta2, double(*step))));
    fresh[t] = *step <= 1.0f;
    *step = *step - 1.0f;
    total += e[0];
  }
  const int threads = threads_for(total, nthreads);
#pragma omp parallel num_threads(threads) if (threads > 1)
  {
    int64_t lo, hi;
    thread_slice(total, lo, hi);
    int64_t base = 0;
    for (int64_t t = 0; t < nt && base < hi; base += table[8 * t], ++t) {
      const int64_t* e = table + 8 * t;
      const int64_t s = std::max(lo, base), end = std::min(hi, base + e[0]), off = s - base;
      if (s >= end) continue;
      RangeFn fn = scale ? pick1<true>(dec, fresh[t], has_m, has_v) : pick1<false>(dec, fresh[t], has_m, has_v);
      float* p = reinterpret_cast<float*>(e[1]) + off;
      float* m = reinterpret_cast<float*>(e[3]) + off;
      float* v = reinterpret_cast<float*>(e[4]) + off;
      if (!(e[6] & kGradBf16)) {
        fn(p, reinterpret_cast<const float*>(e[2]) + off, m, v, end - s, h, coefs[2 * t], coefs[2 * t + 1]);
        continue;
      }
      const uint16_t* g16 = reinterpret_cast<const uint16_t*>(e[2]) + off;
      alignas(64) float g[kWiden];
      for (int64_t i = 0; i < end - s; i += kWiden) {
        const int64_t n = std::min(kWiden, end - s - i);
        widen_bf16(g16 + i, n, g);
        fn(p + i, g, m + i, v + i, n, h, coefs[2 * t], coefs[2 * t + 1]);
      }
    }
  }
}
"""

_NATIVE = NativeLibrary("adam_undo", _SOURCE, abi=("sh_adam_undo_abi", 1), signatures={
    "sh_adamw_undo": [ctypes.c_int64, ctypes.c_void_p] + [ctypes.c_double] * 6 + [ctypes.c_int32]})


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
    lr, wd, eps = float(hyper["lr"]), float(hyper["weight_decay"]), float(hyper["eps"])
    beta1, beta2 = (float(b) for b in hyper["betas"])
    if not math.isfinite(grad_mul):
        raise ValueError(f"undo_adamw_native_: grad_mul={grad_mul} is not finite; no step applied it.")
    table = array.array("q")  # int64 [n, 8], see sh_adamw_undo; the lists keep every tensor alive
    for p, g, st in zip(params, grads, states):
        table.extend((p.numel(), p.data_ptr(), g.data_ptr(), st["exp_avg"].data_ptr(), st["exp_avg_sq"].data_ptr(),
                      st["step"].data_ptr(), _GRAD_BF16 if g.dtype == torch.bfloat16 else 0, 0))
    lib.sh_adamw_undo(len(params), table.buffer_info()[0], lr, beta1, beta2, wd, eps, float(grad_mul),
                      torch.get_num_threads())
