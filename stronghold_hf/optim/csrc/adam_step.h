// CPU Adam's per-element fp32 AdamW step, shared by the step kernel (cpu_adam.cpp) and the
// fused rollback-and-redo (adam_undo.cpp, sh_adamw_redo): one definition, so the redo applies
// exactly the arithmetic of the step it replaces.
//
// Every arithmetic step mirrors torch's fused kernel (aten/src/ATen/native/cpu/FusedAdamKernel.cpp)
// in order; -ffp-contract=off plus explicit fma keep the compiler from fusing differently in the
// vector body and the scalar tail, so every element gets the same rounding wherever chunk and
// thread boundaries fall.
#ifndef STRONGHOLD_HF_OPTIM_CSRC_ADAM_STEP_H_
#define STRONGHOLD_HF_OPTIM_CSRC_ADAM_STEP_H_

#include <cmath>
#include <cstdint>

#include "common.h"

namespace {

struct Hyper { float grad_mul, decay, lerp_w, beta2, one_minus_beta2, eps; };
using StepRangeFn = void (*)(float*, const float*, float*, float*, uint16_t*, int64_t, const Hyper&, float, float);

// The step's fp32 constants, rounded from doubles as FusedAdamKernel.cpp rounds them.
inline Hyper step_hyper(double lr, double beta1, double beta2, double weight_decay, double eps, double grad_mul) {
  return Hyper{float(grad_mul), float(1.0 - lr * weight_decay), float(1.0 - beta1),
               float(beta2), float(1.0 - beta2), float(eps)};
}

// p, g, m, v: fp32 [n]; out: bf16/fp16 bits [n] or unused. kOut: 0 none, 1 bf16, 2 fp16.
template <bool kScale, bool kDecay, bool kSmallW, int kOut>
void adam_range(float* __restrict p, const float* __restrict g, float* __restrict m, float* __restrict v,
                uint16_t* __restrict out, int64_t n, const Hyper& h, float neg_step, float bc2_sqrt) {
  const float w = kSmallW ? h.lerp_w : h.lerp_w - 1.0f;
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    const float gi = kScale ? g[i] * h.grad_mul : g[i];
    float pi = kDecay ? p[i] * h.decay : p[i];
    // exp_avg.lerp_(grad, 1 - beta1) in torch's two-sided form.
    const float mi = std::fma(w, gi - m[i], kSmallW ? m[i] : gi);
    const float vi = std::fma(h.one_minus_beta2 * gi, gi, v[i] * h.beta2);
    const float denom = std::sqrt(vi) / bc2_sqrt + h.eps;
    pi = pi + neg_step * mi / denom;
    p[i] = pi; m[i] = mi; v[i] = vi;
    if (kOut == 1) out[i] = to_bf16(pi);
    if (kOut == 2) out[i] = to_fp16(pi);
  }
}
template <bool S, bool D, bool W> StepRangeFn step_pick3(int k) {
  return k == 1 ? adam_range<S, D, W, 1> : k == 2 ? adam_range<S, D, W, 2> : adam_range<S, D, W, 0>;
}
template <bool S, bool D> StepRangeFn step_pick2(bool w, int k) {
  return w ? step_pick3<S, D, true>(k) : step_pick3<S, D, false>(k);
}
template <bool S> StepRangeFn step_pick1(bool d, bool w, int k) {
  return d ? step_pick2<S, true>(w, k) : step_pick2<S, false>(w, k);
}
// The range function for a call's constants and one tensor's copy-out kind (0/1/2).
inline StepRangeFn pick_step(const Hyper& h, double grad_mul, double weight_decay, int kind) {
  const bool scale = grad_mul != 1.0, dec = weight_decay != 0.0, small_w = std::fabs(h.lerp_w) < 0.5f;
  return scale ? step_pick1<true>(dec, small_w, kind) : step_pick1<false>(dec, small_w, kind);
}

// One row of a step table (numel, param, grad, exp_avg, exp_avg_sq, out, step, flags), from
// element `off` on: its range function and the pointers it writes.
struct StepRow {
  StepRangeFn fn;
  uint16_t* out;
  float *p, *m, *v;
};
inline StepRow step_row(const int64_t* e, int64_t off, const Hyper& h, double grad_mul, double weight_decay) {
  const int kind = int(e[7]) & 3;
  return StepRow{pick_step(h, grad_mul, weight_decay, kind), kind ? reinterpret_cast<uint16_t*>(e[5]) + off : nullptr,
                 reinterpret_cast<float*>(e[1]) + off, reinterpret_cast<float*>(e[3]) + off,
                 reinterpret_cast<float*>(e[4]) + off};
}

}  // namespace

#endif  // STRONGHOLD_HF_OPTIM_CSRC_ADAM_STEP_H_
