// CPUAdam's fp32 AdamW step (optim/cpu_adam.py, kernel="native"): scale, AdamW and the
// bf16/fp16 copy-out of every tensor of one call in one pass, in one OpenMP region.
//
// Every arithmetic step mirrors torch's fused kernel (aten/src/ATen/native/cpu/FusedAdamKernel.cpp)
// in order; -ffp-contract=off plus explicit fma keep the compiler from fusing differently in the
// vector body and the scalar tail, so every element gets the same rounding wherever chunk and
// thread boundaries fall.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "common.h"

namespace {

struct Hyper { float grad_mul, decay, lerp_w, beta2, one_minus_beta2, eps; };
using RangeFn = void (*)(float*, const float*, float*, float*, uint16_t*, int64_t, const Hyper&, float, float);

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
template <bool S, bool D, bool W> RangeFn pick3(int k) {
  return k == 1 ? adam_range<S, D, W, 1> : k == 2 ? adam_range<S, D, W, 2> : adam_range<S, D, W, 0>;
}
template <bool S, bool D> RangeFn pick2(bool w, int k) { return w ? pick3<S, D, true>(k) : pick3<S, D, false>(k); }
template <bool S> RangeFn pick1(bool d, bool w, int k) { return d ? pick2<S, true>(w, k) : pick2<S, false>(w, k); }
}  // namespace

extern "C" int sh_cpu_adam_abi() { return 3; }

// table: int64 [nt, 8] = numel, then the addresses of param, grad, exp_avg, exp_avg_sq (fp32
// [numel]; the grad bf16 when flagged), out (bf16/fp16 [numel] or 0) and step (fp32 0-d),
// then the flags: the out kind (0/1/2) plus kGradBf16.
// Scalars arrive as doubles and are rounded to fp32 here, as FusedAdamKernel.cpp does.
extern "C" void sh_adamw_step(int64_t nt, const int64_t* table, double lr, double beta1, double beta2,
                              double weight_decay, double eps, double grad_mul, int32_t nthreads) {
  const Hyper h{float(grad_mul), float(1.0 - lr * weight_decay), float(1.0 - beta1),
                float(beta2), float(1.0 - beta2), float(eps)};
  const bool scale = grad_mul != 1.0, dec = weight_decay != 0.0, small_w = std::fabs(h.lerp_w) < 0.5f;
  // As torch's _fused_adam: bump each step (in fp32), then derive the bias corrections in double.
  std::vector<float> coefs(2 * nt);  // -lr / bias_correction1, sqrt(bias_correction2)
  int64_t total = 0;
  for (int64_t t = 0; t < nt; ++t) {
    const int64_t* e = table + 8 * t;
    float* step = reinterpret_cast<float*>(e[6]);
    *step = *step + 1.0f;
    coefs[2 * t] = neg_step_size(lr, beta1, *step);
    coefs[2 * t + 1] = bias_correction2_sqrt(beta2, *step);
    total += e[0];
  }
  const int threads = threads_for(total, nthreads);
#pragma omp parallel num_threads(threads) if (threads > 1)
  for_each_in_slice(nt, table, 8, total, [&](int64_t t, int64_t off, int64_t n) {
    const int64_t* e = table + 8 * t;
    const int kind = int(e[7]) & 3;
    RangeFn fn = scale ? pick1<true>(dec, small_w, kind) : pick1<false>(dec, small_w, kind);
    uint16_t* out = kind ? reinterpret_cast<uint16_t*>(e[5]) + off : nullptr;
    float* p = reinterpret_cast<float*>(e[1]) + off;
    float* m = reinterpret_cast<float*>(e[3]) + off;
    float* v = reinterpret_cast<float*>(e[4]) + off;
    // A bf16 gradient is widened (exactly) a cache-sized piece at a time, then stepped as fp32.
    fp32_grad_pieces(e[2], e[7] & kGradBf16, off, n, [&](const float* g, int64_t i, int64_t k) {
      fn(p + i, g, m + i, v + i, out ? out + i : nullptr, k, h, coefs[2 * t], coefs[2 * t + 1]);
    });
  });
}
