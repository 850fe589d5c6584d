// CPUAdam's fp32 AdamW step (optim/cpu_adam.py, kernel="native"): scale, AdamW and the
// bf16/fp16 copy-out of every tensor of one call in one pass, in one OpenMP region. The
// per-element arithmetic is adam_step.h's (adam_range), shared with the fused redo.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "adam_step.h"
#include "common.h"

extern "C" int sh_cpu_adam_abi() { return 3; }

// table: int64 [nt, 8] = numel, then the addresses of param, grad, exp_avg, exp_avg_sq (fp32
// [numel]; the grad bf16 when flagged), out (bf16/fp16 [numel] or 0) and step (fp32 0-d),
// then the flags: the out kind (0/1/2) plus kGradBf16.
// Scalars arrive as doubles and are rounded to fp32 here, as FusedAdamKernel.cpp does.
extern "C" void sh_adamw_step(int64_t nt, const int64_t* table, double lr, double beta1, double beta2,
                              double weight_decay, double eps, double grad_mul, int32_t nthreads) {
  const Hyper h = step_hyper(lr, beta1, beta2, weight_decay, eps, grad_mul);
  // As torch's _fused_adam: bump each step (in fp32), then derive the bias corrections in double.
  std::vector<float> coefs(2 * nt);  // -lr / bias_correction1, sqrt(bias_correction2)
  int64_t total = 0;
  for (int64_t t = 0; t < nt; ++t) {
    const int64_t* e = table + 8 * t;
    float* step = reinterpret_cast<float*>(e[6]);
    *step = *step + 1.0f;
    bias_coefs(lr, beta1, beta2, *step, &coefs[2 * t]);
    total += e[0];
  }
  const int threads = threads_for(total, nthreads);
#pragma omp parallel num_threads(threads) if (threads > 1)
  for_each_in_slice(nt, table, 8, total, [&](int64_t t, int64_t off, int64_t n) {
    const int64_t* e = table + 8 * t;
    const StepRow r = step_row(e, off, h, grad_mul, weight_decay);
    // A bf16 gradient is widened (exactly) a cache-sized piece at a time, then stepped as fp32.
    fp32_grad_pieces(e[2], e[7] & kGradBf16, off, n, [&](const float* g, int64_t i, int64_t k) {
      r.fn(r.p + i, g, r.m + i, r.v + i, r.out ? r.out + i : nullptr, k, h, coefs[2 * t], coefs[2 * t + 1]);
    });
  });
}
