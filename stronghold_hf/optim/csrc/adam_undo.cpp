// The inverse of one CPUAdam step (optim/undo_native.py): the rollback of a missed speculation
// in one pass per element, mirroring the forward kernel (adam_step.h, adam_range); and the
// rollback fused with the redo that follows it (sh_adamw_redo).
//
// -ffp-contract=off (native.py's flags) keeps the recomputed step term bitwise equal to the
// forward's in the vector body and the scalar tail alike.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "adam_step.h"
#include "common.h"

namespace {

struct Undo {
  float grad_mul, decay, lerp_w, one_minus_beta2, eps;  // the forward's fp32 constants
  // 1 / what the forward multiplied p0, m0 and v0 by (decay, 1 - lerp_w, fp32 beta2), in
  // double. [Note: divisions] x * (1/d) in double, rounded to fp32, is x / d correctly rounded
  // except within ~2^-52 of a tie between two floats (about one element in 2^28), and costs a
  // multiply instead of a divide: three fp32/double divides per element made the undo
  // compute bound, 1.5x the forward step's time on this 2-core box.
  double inv_decay, inv_keep_m, inv_keep_v;
};
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

extern "C" int sh_adam_undo_abi() { return 2; }

namespace {
// The undo's constants for a step made with these scalars (rounded as the forward rounded them).
struct UndoCall {
  Undo h;
  bool scale, dec, has_m, has_v;
};
UndoCall undo_call(double lr, double beta1, double beta2, double weight_decay, double eps, double grad_mul) {
  const float lerp_w = float(1.0 - beta1), b2 = float(beta2), decay = float(1.0 - lr * weight_decay);
  const double keep_m = 1.0 - double(lerp_w);  // exact
  const Undo h{float(grad_mul), decay, lerp_w, float(1.0 - beta2), float(eps),
               1.0 / double(decay), 1.0 / keep_m, 1.0 / double(b2)};
  // A factor of 0 lost the old value (and the redo does not read it): no division.
  return UndoCall{h, grad_mul != 1.0, weight_decay != 0.0 && decay != 0.0f, keep_m != 0.0, b2 != 0.0f};
}
// The undone step's coefficients (from the count before it goes back, as the forward derived
// them) into coefs[0..1], and the count back by one; true if that step was the state's first.
bool count_back(double lr, double beta1, double beta2, float* step, float* coefs) {
  bias_coefs(lr, beta1, beta2, *step, coefs);
  const bool fresh = *step <= 1.0f;
  *step = *step - 1.0f;
  return fresh;
}
RangeFn pick_undo(const UndoCall& c, bool fresh) {
  return c.scale ? pick1<true>(c.dec, fresh, c.has_m, c.has_v) : pick1<false>(c.dec, fresh, c.has_m, c.has_v);
}
}  // namespace

// table: int64 [nt, 8] = numel, then the addresses of param, grad, exp_avg, exp_avg_sq (fp32
// [numel]; the grad bf16 when flagged) and step (fp32 0-d), the flags (kGradBf16), and 0.
// Scalars arrive as doubles and are rounded to fp32 as the forward kernel rounds them.
extern "C" void sh_adamw_undo(int64_t nt, const int64_t* table, double lr, double beta1, double beta2,
                              double weight_decay, double eps, double grad_mul, int32_t nthreads) {
  const UndoCall c = undo_call(lr, beta1, beta2, weight_decay, eps, grad_mul);
  std::vector<float> coefs(2 * nt);  // -lr / bias_correction1, sqrt(bias_correction2)
  std::vector<char> fresh(nt);
  int64_t total = 0;
  for (int64_t t = 0; t < nt; ++t) {
    const int64_t* e = table + 8 * t;
    fresh[t] = count_back(lr, beta1, beta2, reinterpret_cast<float*>(e[5]), &coefs[2 * t]);
    total += e[0];
  }
  const int threads = threads_for(total, nthreads);
#pragma omp parallel num_threads(threads) if (threads > 1)
  for_each_in_slice(nt, table, 8, total, [&](int64_t t, int64_t off, int64_t n) {
    const int64_t* e = table + 8 * t;
    RangeFn fn = pick_undo(c, fresh[t]);
    float* p = reinterpret_cast<float*>(e[1]) + off;
    float* m = reinterpret_cast<float*>(e[3]) + off;
    float* v = reinterpret_cast<float*>(e[4]) + off;
    fp32_grad_pieces(e[2], e[6] & kGradBf16, off, n, [&](const float* g, int64_t i, int64_t k) {
      fn(p + i, g, m + i, v + i, k, c.h, coefs[2 * t], coefs[2 * t + 1]);
    });
  });
}

// A missed speculation's rollback and its redo in one pass: per cache-sized piece, the undo of
// the step made with (lr_u .. grad_mul_u), then the step with (lr .. grad_mul), the same two
// range functions sh_adamw_undo and sh_adamw_step run, so every element ends bit for bit where
// the two calls would leave it, with the masters and moments read and written once instead of
// twice. The step count goes back and forward again (unchanged, as after the two calls).
// table: sh_adamw_step's layout (numel, param, grad, exp_avg, exp_avg_sq, out, step, flags).
extern "C" void sh_adamw_redo(int64_t nt, const int64_t* table, double lr_u, double beta1_u, double beta2_u,
                              double weight_decay_u, double eps_u, double grad_mul_u, double lr, double beta1,
                              double beta2, double weight_decay, double eps, double grad_mul, int32_t nthreads) {
  const UndoCall c = undo_call(lr_u, beta1_u, beta2_u, weight_decay_u, eps_u, grad_mul_u);
  const Hyper h = step_hyper(lr, beta1, beta2, weight_decay, eps, grad_mul);
  std::vector<float> coefs(4 * nt);  // the undo's and the redo's -lr / bc1 and sqrt(bc2)
  std::vector<char> fresh(nt);
  int64_t total = 0;
  for (int64_t t = 0; t < nt; ++t) {
    const int64_t* e = table + 8 * t;
    float* step = reinterpret_cast<float*>(e[6]);
    fresh[t] = count_back(lr_u, beta1_u, beta2_u, step, &coefs[4 * t]);  // sh_adamw_undo
    *step = *step + 1.0f;                                                 // sh_adamw_step
    bias_coefs(lr, beta1, beta2, *step, &coefs[4 * t + 2]);
    total += e[0];
  }
  const int threads = threads_for(total, nthreads);
#pragma omp parallel num_threads(threads) if (threads > 1)
  for_each_in_slice(nt, table, 8, total, [&](int64_t t, int64_t off, int64_t n) {
    const int64_t* e = table + 8 * t;
    const RangeFn undo = pick_undo(c, fresh[t]);
    const StepRow r = step_row(e, off, h, grad_mul, weight_decay);
    fp32_grad_pieces(e[2], e[7] & kGradBf16, off, n, [&](const float* g, int64_t i, int64_t k) {
      for (int64_t j = 0; j < k; j += kWiden) {  // a piece stays in cache between the two
        const int64_t kk = std::min(kWiden, k - j), at = i + j;
        undo(r.p + at, g + j, r.m + at, r.v + at, kk, c.h, coefs[4 * t], coefs[4 * t + 1]);
        r.fn(r.p + at, g + j, r.m + at, r.v + at, r.out ? r.out + at : nullptr, kk, h, coefs[4 * t + 2],
             coefs[4 * t + 3]);
      }
    });
  });
}
