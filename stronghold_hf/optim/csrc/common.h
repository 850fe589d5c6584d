// Helpers shared by the kernel libraries in this directory (cpu_adam.cpp, cpu_adam8.cpp,
// adam_undo.cpp): fp32 <-> bf16/fp16 bits exactly as torch rounds them, how a call's
// concatenated tensors are split over OpenMP threads, and how a bf16 gradient is read as fp32.
//
// Each .cpp is compiled on its own into one shared library (optim/native.py), so the helpers
// sit in an unnamed namespace: internal linkage, nothing here is exported from a library.
#ifndef STRONGHOLD_HF_OPTIM_CSRC_COMMON_H_
#define STRONGHOLD_HF_OPTIM_CSRC_COMMON_H_

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace {

// ---- Rounding: fp32 -> bf16/fp16 bits exactly as torch rounds, and bf16 -> fp32.

inline uint32_t bits(float f) { uint32_t u; std::memcpy(&u, &f, 4); return u; }
inline float from_bits(uint32_t u) { float f; std::memcpy(&f, &u, 4); return f; }

// bf16 bits -> fp32, exact (a gradient kept in bf16 on the host is read through this).
inline float from_bf16(uint16_t h) { return from_bits(uint32_t(h) << 16); }
inline void widen_bf16(const uint16_t* __restrict src, int64_t n, float* __restrict dst) {
  for (int64_t i = 0; i < n; ++i) dst[i] = from_bf16(src[i]);
}

// c10 round_to_nearest_even: what param.to(torch.bfloat16) computes.
inline uint16_t to_bf16(float f) {
  const uint32_t u = bits(f);
  const uint32_t r = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  return (u & 0x7FFFFFFFu) > 0x7F800000u ? uint16_t(0x7FC0) : uint16_t(r);
}
// c10 fp16_ieee_from_fp32_value: round to nearest even, NaN -> 0x7E00, written to vectorize.
inline uint16_t to_fp16(float f) {
  float base = (std::fabs(f) * 0x1.0p+112f) * 0x1.0p-110f;
  const uint32_t w = bits(f), shl1_w = w + w, sign = w & 0x80000000u;
  const uint32_t bias = std::max(shl1_w & 0xFF000000u, 0x71000000u);
  base = from_bits((bias >> 1) + 0x07800000u) + base;
  const uint32_t b = bits(base);
  const uint32_t nonsign = ((b >> 13) & 0x00007C00u) + (b & 0x00000FFFu);
  // Selects by mask, not ?:, which GCC 12 turns into a branch that stops vectorization.
  const uint32_t nan = 0u - uint32_t(shl1_w > 0xFF000000u);
  return uint16_t((sign >> 16) | (nan & 0x7E00u) | (~nan & nonsign));
}

// ---- Bias correction, derived as torch's _fused_adam derives it: from the fp32 step count, in
// double, each coefficient rounded to fp32 once. The undo must derive exactly the forward's.

// -lr / bias_correction1: the step term's coefficient.
inline float neg_step_size(double lr, double beta1, float step) {
  return float(-(lr / (1.0 - std::pow(beta1, double(step)))));
}
// sqrt(bias_correction2).
inline float bias_correction2_sqrt(double beta2, float step) {
  return float(std::sqrt(1.0 - std::pow(beta2, double(step))));
}
// Both of a step's coefficients, into out[0] and out[1].
inline void bias_coefs(double lr, double beta1, double beta2, float step, float* out) {
  out[0] = neg_step_size(lr, beta1, step);
  out[1] = bias_correction2_sqrt(beta2, step);
}

// ---- Threading: how the table-driven kernels (CPU Adam's update, the speculation undo) split
// one call's concatenated tensors over OpenMP threads.

// Small calls run on the calling thread: below ~64K elements (~2 GRAIN_SIZEs of torch's
// parallel_for) a fork/join costs about what a second core saves, and risks a stall.
inline int threads_for(int64_t total, int64_t nthreads) { return total >= 65536 ? std::max(1, int(nthreads)) : 1; }

// The calling thread's slice [lo, hi) of `total` concatenated elements: one contiguous slice per
// thread, starting on a 16-element (64-byte) boundary, so no two threads share a cache line.
inline void thread_slice(int64_t total, int64_t& lo, int64_t& hi) {
  const int64_t T = omp_get_num_threads(), id = omp_get_thread_num(), units = (total + 15) / 16;
  lo = std::min(total, units * id / T * 16);
  hi = std::min(total, units * (id + 1) / T * 16);
}

// Walks the calling thread's slice of a table-driven call: `table` holds one row of `row` int64s
// per tensor, its numel first, and for every tensor t that overlaps the slice visit(t, off, n)
// gets the n elements from element `off` of it.
template <typename Visit>
inline void for_each_in_slice(int64_t nt, const int64_t* table, int64_t row, int64_t total, Visit&& visit) {
  int64_t lo, hi;
  thread_slice(total, lo, hi);
  int64_t base = 0;
  for (int64_t t = 0; t < nt && base < hi; base += table[row * t], ++t) {
    const int64_t s = std::max(lo, base), end = std::min(hi, base + table[row * t]);
    if (s < end) visit(t, s - base, end - s);
  }
}

// ---- Gradients: fp32, or bf16 (a host gradient kept in the compute dtype), read as fp32.

constexpr int64_t kGradBf16 = 16;  // table flag: the gradient is bf16
constexpr int64_t kWiden = 2048;  // elements of a bf16 gradient widened at a time

// Calls range(g, i, k) over the n gradient elements from element `off` of `grad`, g being fp32
// elements i .. i + k of them: an fp32 gradient in one call (i = 0), a bf16 one widened
// (exactly) a cache-sized piece at a time into a buffer on the calling thread's stack.
template <typename Range>
inline void fp32_grad_pieces(int64_t grad, bool bf16, int64_t off, int64_t n, Range&& range) {
  if (!bf16) {
    range(reinterpret_cast<const float*>(grad) + off, int64_t(0), n);
    return;
  }
  const uint16_t* g16 = reinterpret_cast<const uint16_t*>(grad) + off;
  alignas(64) float g[kWiden];
  for (int64_t i = 0; i < n; i += kWiden) {
    const int64_t k = std::min(kWiden, n - i);
    widen_bf16(g16 + i, k, g);
    range(static_cast<const float*>(g), i, k);
  }
}

}  // namespace

#endif  // STRONGHOLD_HF_OPTIM_CSRC_COMMON_H_
