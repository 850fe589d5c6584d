// The 8-bit AdamW step (optim/quant8.py): blockwise dynamic 8-bit moments, dequantized, stepped
// in fp32 as cpu_adam.cpp steps them, and quantized again, one block of 256 at a time. quant8.py's
// docstring explains the maps and the codec; quant8.step_reference is the same math in torch.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>
#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include "common.h"

namespace {

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
  // max(0, NaN) is 0: a NaN xn (0 * inf, where absmax is so small that 1 / absmax is inf) gets
  // k = 0, code 128 / 1, as the reference's float -> int64 conversion makes it.
  const float k = std::min(std::max(0.0f, std::floor((ax - c[kLower + d]) * c[kPerUnit + d])), c[kLastK + d]);
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

// AdamW in fp32, the fp32 kernel's operations in its order, in two halves: the moments (m, v:
// the old ones in, the new ones out), then the parameter from the new moments. The new v is
// then held to at least (m * inv_k)^2, a bound exact Adam never crosses (quant8.moment_floor:
// it raises a v the codec rounded below it, as one rounded to 0 under a first moment that
// survived). "Unless (m * inv_k)^2 > v" keeps v where either is NaN, as in the reference.
struct Adam { float gmul, decay, w, b2, omb2, eps, neg_step, bc2, inv_k; };
inline void adam_moments(const Adam& h, float g, float& m, float& v) {
  const float gi = g * h.gmul, m0 = m;
  m = std::fma(h.w, gi - m0, m0);
  v = std::fma(h.omb2 * gi, gi, v * h.b2);
  const float mk = m * h.inv_k, floor = mk * mk;
  v = floor > v ? floor : v;
}
inline float adam_param(const Adam& h, float p, float m, float v) {
  return p * h.decay + h.neg_step * m / (std::sqrt(v) / h.bc2 + h.eps);
}

#if defined(__AVX2__) && defined(__FMA__)
// Forced: GCC otherwise calls some of the 8-lane helpers out of line, passing ymm registers.
#define SH_INLINE inline __attribute__((always_inline))

// ---- The vectorized codec. Same fp32 operations as encode/decode on the values that matter,
// with the decade found without a compare per decade.
//
// Decoding: a magnitude's code counts u = 1, 2, ... up from the zero code (signed: |code - 127|;
// unsigned: code + 1, the zero code being u = 1), and decade d holds u in [2^e, 2^(e+1)) with
// e = d (signed) or d + 1 (unsigned). So e is the exponent of float(u), and k = u - 2^e its
// interval: first/step are permuted by the exponent bits (whose low 3 bits are (e + 7) & 7)
// with no compares. Lane e = 7 (signed) holds 1; lane e = 0 (unsigned) holds 0 and, through
// k = 256 - 128 with step 1/128, the one code 255 (u = 256).
struct DecodeLanes { __m256 first, step; };

inline int decode_lane(int e) { return (e + 7) & 7; }

template <bool Signed>
DecodeLanes decode_lanes(const float* c) {
  alignas(32) float first[8], step[8];
  for (int e = 0; e < 8; ++e) {
    const int d = Signed ? e : e - 1, lane = decode_lane(e);
    const bool mag = d >= 0 && d < kDecades;
    first[lane] = mag ? c[kFirst + d] : (Signed ? 1.0f : 0.0f);
    step[lane] = mag ? c[kStep + d] : (Signed ? 0.0f : 1.0f / 128.0f);
  }
  return {_mm256_load_ps(first), _mm256_load_ps(step)};
}

// 8 codes -> their values times scale.
template <bool Signed>
SH_INLINE __m256 decode8(const uint8_t* q, const DecodeLanes& t, __m256 scale) {
  // Widened in-lane (a broadcast load and a byte shuffle): a cross-lane vpmovzxbd runs on one
  // pipe only, which the kernel's permutes already keep busy.
  int64_t eight;
  std::memcpy(&eight, q, 8);
  const __m256i code = _mm256_shuffle_epi8(_mm256_set1_epi64x(eight),
                                           _mm256_setr_epi8(0, -1, -1, -1, 1, -1, -1, -1, 2, -1, -1, -1, 3, -1, -1, -1,
                                                            4, -1, -1, -1, 5, -1, -1, -1, 6, -1, -1, -1, 7, -1, -1, -1));
  const __m256i s = _mm256_sub_epi32(code, _mm256_set1_epi32(Signed ? 127 : -1));  // unsigned: u = code + 1
  const __m256 u = _mm256_cvtepi32_ps(Signed ? _mm256_abs_epi32(s) : s);
  const __m256i lane = _mm256_srli_epi32(_mm256_castps_si256(u), 23);
  __m256 pow2 = _mm256_and_ps(u, _mm256_castsi256_ps(_mm256_set1_epi32(int(0xFF800000u))));
  if (!Signed) pow2 = _mm256_min_ps(pow2, _mm256_set1_ps(128.0f));  // the one code: k = 128
  const __m256 k = _mm256_sub_ps(u, pow2);
  const __m256 mag = _mm256_fmadd_ps(k, _mm256_permutevar8x32_ps(t.step, lane), _mm256_permutevar8x32_ps(t.first, lane));
  if (!Signed) return _mm256_mul_ps(mag, scale);
  // sign(code - 127) * scale: negative codes negate, the zero code (whose u = 0 lands in a
  // decade's lane) zeroes. mag * -scale is -(mag * scale) exactly.
  const __m256 sign = _mm256_cvtepi32_ps(_mm256_sign_epi32(_mm256_set1_epi32(1), s));
  return _mm256_mul_ps(mag, _mm256_mul_ps(sign, scale));
}

// Encoding: one lane per class of |xn|: lane 0 is 0 and decade 0 (a value below the zero
// threshold is decade 0's k = -1, so code 127 / 0), lanes 1..6 decades 1..6, lane 7 the one code
// (signed negative: -1, which the unsigned-saturating pack turns into code 0, as clamping does).
// The lane is estimated from the float's exponent and top mantissa bits, then corrected by one
// compare with the lane's threshold (`from`); the interval is floor((|xn| - lower) * per_unit) as
// in encode, clamped to the lane's last. The exhaustive check: every float in [-1 - 8 ulp,
// 1 + 8 ulp] encodes as encode does.
struct EncodeLanes {
  __m256 from, lower, per_unit;
  // Per lane, as bytes for vpshufb (the same 16 in both 128-bit halves; lanes 8..15 unused): what
  // min(k, last_k) is added to, and last_k. encode32 finishes 32 codes at a time on bytes.
  __m256i start, last_k;
};

// The lane estimate from h = float bits >> 16 (an approximate log2 in 1/128ths):
// (h - kEstBase) * kEstSlope >> 16, saturated at 0, is one lane per decade (kEstSlope = 65536 /
// (128 log2(10))) with its boundaries 10^-0.36 below the decades' edges. Every class's
// threshold lies 0 to 0.28 decades above its edge, so the estimate is the lane or one above.
constexpr int kEstBase = 13126, kEstSlope = 154;

// The smallest float x in [lo, hi] with floor((x - lower) * per_unit) >= 1 (monotone in x).
inline float first_at_one(float lower, float per_unit, float lo, float hi) {
  uint32_t a = bits(lo), b = bits(hi);
  while (a < b) {
    const uint32_t mid = a + (b - a) / 2;
    if (std::floor((from_bits(mid) - lower) * per_unit) >= 1.0f) b = mid; else a = mid + 1;
  }
  return from_bits(a);
}

template <bool Signed>
EncodeLanes encode_lanes(const float* c) {
  alignas(32) float from[8], lower[8], per_unit[8];
  for (int d = 0; d < kDecades; ++d) {
    from[d] = d ? c[kFrom + d] : 0.0f;
    lower[d] = c[kLower + d];
    per_unit[d] = c[kPerUnit + d];
  }
  from[7] = c[kOne], lower[7] = 0.0f, per_unit[7] = 0.0f;  // k = 0
  // Lane 0 from the zero threshold: k = -1 below it (exact: x - zero < 0 there), and decade 0's
  // intervals above. Signed, decade 0 is one interval (any scale up to 1 / zero keeps k in
  // [-1, 0]); unsigned, two, and per_unit is the float that puts k = 1 at decade 0's own split.
  const float zero = c[kZero];
  lower[0] = zero;
  if (Signed) {
    per_unit[0] = 1.0f / c[kFrom + 1];
  } else {
    const float split = first_at_one(c[kLower], c[kPerUnit], zero, c[kFrom + 1]);
    float pu = 1.0f / (split - zero);
    while (std::floor((split - zero) * pu) < 1.0f) pu = std::nextafter(pu, INFINITY);
    while (std::floor((std::nextafter(split, 0.0f) - zero) * pu) >= 1.0f) pu = std::nextafter(pu, 0.0f);
    per_unit[0] = pu;
  }
  // Signed: the index j = start_d + k = 2^d - 1 + min(k, 2^d - 1) (lane 0: j = -1 is the zero
  // code; lane 7, k = 0: j = 127, the one code). Unsigned: the code 1 + j = 2^(d+1) - 1 + min(k,
  // 2^(d+1) - 1) (lane 0: code 0 at k = -1; lane 7, k = 0: code 255, its last_k 0 to stay in int8).
  alignas(32) int8_t start[32], last_k[32];
  for (int h = 0; h < 32; ++h) {
    const int lane = h & 15;
    const int pow2 = lane < 8 ? (Signed ? 1 : 2) << lane : 0;
    start[h] = int8_t(uint8_t(lane < 8 ? pow2 - 1 : 0));
    last_k[h] = int8_t(lane < 7 ? pow2 - 1 : 0);
  }
  return {_mm256_load_ps(from), _mm256_load_ps(lower), _mm256_load_ps(per_unit),
          _mm256_load_si256(reinterpret_cast<const __m256i*>(start)),
          _mm256_load_si256(reinterpret_cast<const __m256i*>(last_k))};
}

// x[0..8) * inv: the lane of each (see EncodeLanes) and its interval k, as int32 (k from -1, the
// zero code, up; unclamped); xn itself, whose sign the signed code takes.
template <bool Signed>
SH_INLINE void encode8(const float* x, const EncodeLanes& t, __m256 inv, __m256i& lane, __m256i& k, __m256& xn) {
  xn = _mm256_mul_ps(_mm256_loadu_ps(x), inv);
  // Unsigned: the second moment is never negative, so xn is its own magnitude.
  const __m256 ax = Signed ? _mm256_and_ps(xn, _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF))) : xn;
  const __m256i h = _mm256_srli_epi32(_mm256_castps_si256(ax), 16);
  lane = _mm256_mulhi_epu16(_mm256_subs_epu16(h, _mm256_set1_epi32(kEstBase)), _mm256_set1_epi32(kEstSlope));
  lane = _mm256_add_epi32(lane, _mm256_castps_si256(_mm256_cmp_ps(ax, _mm256_permutevar8x32_ps(t.from, lane), _CMP_LT_OQ)));
  const __m256 r = _mm256_floor_ps(_mm256_mul_ps(_mm256_sub_ps(ax, _mm256_permutevar8x32_ps(t.lower, lane)),
                                                 _mm256_permutevar8x32_ps(t.per_unit, lane)));
  k = _mm256_cvttps_epi32(r);
}

// Four int32 vectors -> 32 int8s with signed saturation, in the packs' interleaved order (dwords
// 0..7 hold elements 0:4, 8:12, 16:20, 24:28, 4:8, ...), which encode32 undoes once at the end.
SH_INLINE __m256i pack32(__m256i a, __m256i b, __m256i c, __m256i d) {
  return _mm256_packs_epi16(_mm256_packs_epi32(a, b), _mm256_packs_epi32(c, d));
}

// q[0..32) = the codes of x[0..32) * inv. The tail on bytes: k saturates to int8 (it never
// exceeds 128, and its clamp is at most 127), j (signed) or the code (unsigned) is start +
// min(k, last_k) by the lane. Signed, the code is 128 + j for xn >= 0 and 126 - j below, with
// j = -1 the zero code (127 either way) and j = 127 the one code (255; -1 saturates to code
// 0): in int8, code - 128 = j, or ~j - 1 = ~j + (-1) saturated.
template <bool Signed>
SH_INLINE void encode32(const float* x, const EncodeLanes& t, __m256 inv, uint8_t* q) {
  __m256i lane[4], k[4];
  __m256 xn[4];
  for (int u = 0; u < 4; ++u) encode8<Signed>(x + 8 * u, t, inv, lane[u], k[u], xn[u]);
  const __m256i lanes = pack32(lane[0], lane[1], lane[2], lane[3]), ks = pack32(k[0], k[1], k[2], k[3]);
  __m256i code = _mm256_add_epi8(_mm256_shuffle_epi8(t.start, lanes),
                                 _mm256_min_epi8(ks, _mm256_shuffle_epi8(t.last_k, lanes)));
  if (Signed) {
    const __m256i sign = pack32(_mm256_castps_si256(xn[0]), _mm256_castps_si256(xn[1]), _mm256_castps_si256(xn[2]),
                                _mm256_castps_si256(xn[3]));
    const __m256i negative = _mm256_cmpgt_epi8(_mm256_setzero_si256(), sign);
    code = _mm256_xor_si256(_mm256_adds_epi8(_mm256_xor_si256(code, negative), negative), _mm256_set1_epi8(-128));
  }
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), _mm256_permutevar8x32_epi32(code, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
}
#endif

// The codec's tables for both maps, built once per call.
struct Codec {
  const float* map_m;
  const float* map_v;
#if defined(__AVX2__) && defined(__FMA__)
  DecodeLanes decode_m, decode_v;
  EncodeLanes encode_m, encode_v;
#endif
};

// 1 / absmax, or 0 for an absmax of 0, as quant8._quantize_blocks computes it.
inline float inverse(float absmax) { return absmax > 0.0f ? 1.0f / absmax : 0.0f; }

// Whether the vector codec may quantize x / absmax: it is exact where |x * inverse(absmax)| <= 1
// + 8 ulp, as it is for a finite absmax with a finite inverse. Otherwise (an absmax of inf or NaN,
// or so small that 1 / absmax is inf, making NaNs of 0 * inf) the scalar path, which keeps the
// reference's codes for those.
inline bool vector_quantizable(float absmax) { return absmax < INFINITY && inverse(absmax) < INFINITY; }

// q[i] = the code of x[i] / absmax: x[i] * inverse(absmax) in fp32, clamped to the map's range (NaN
// kept), as quant8._quantize_blocks computes it.
template <bool Signed>
void quantize(const float* x, int64_t n, float absmax, const Codec& cd, uint8_t* q) {
  const float* c = Signed ? cd.map_m : cd.map_v;
  const float inv = inverse(absmax);
  int64_t i = 0;
#if defined(__AVX2__) && defined(__FMA__)
  if (vector_quantizable(absmax)) {
    const EncodeLanes& t = Signed ? cd.encode_m : cd.encode_v;
    for (; i + 32 <= n; i += 32) encode32<Signed>(x + i, t, _mm256_set1_ps(inv), q + i);
  }
#endif
  for (; i < n; ++i) q[i] = encode<Signed>(std::min(std::max(x[i] * inv, Signed ? -1.0f : 0.0f), 1.0f), c);
}

#if defined(__AVX2__) && defined(__FMA__)
// adam_moments and adam_param on 8 lanes.
struct AdamVec {
  __m256 gmul, decay, w, b2, omb2, eps, neg_step, bc2, inv_k;
  explicit AdamVec(const Adam& h)
      : gmul(_mm256_set1_ps(h.gmul)), decay(_mm256_set1_ps(h.decay)), w(_mm256_set1_ps(h.w)), b2(_mm256_set1_ps(h.b2)),
        omb2(_mm256_set1_ps(h.omb2)), eps(_mm256_set1_ps(h.eps)), neg_step(_mm256_set1_ps(h.neg_step)),
        bc2(_mm256_set1_ps(h.bc2)), inv_k(_mm256_set1_ps(h.inv_k)) {}
};
SH_INLINE void adam_moments8(const AdamVec& h, __m256 g, __m256& m, __m256& v) {
  const __m256 gi = _mm256_mul_ps(g, h.gmul);
  m = _mm256_fmadd_ps(h.w, _mm256_sub_ps(gi, m), m);
  v = _mm256_fmadd_ps(_mm256_mul_ps(h.omb2, gi), gi, _mm256_mul_ps(v, h.b2));
  const __m256 mk = _mm256_mul_ps(m, h.inv_k);
  v = _mm256_max_ps(_mm256_mul_ps(mk, mk), v);  // (floor > v) ? floor : v, lane by lane
}
SH_INLINE void adam_param8(const AdamVec& h, float* p, const float* m, const float* v) {
  const __m256 denom = _mm256_add_ps(_mm256_div_ps(_mm256_sqrt_ps(_mm256_load_ps(v)), h.bc2), h.eps);
  _mm256_storeu_ps(p, _mm256_add_ps(_mm256_mul_ps(_mm256_loadu_ps(p), h.decay),
                                    _mm256_div_ps(_mm256_mul_ps(h.neg_step, _mm256_load_ps(m)), denom)));
}
#endif

// One block (n <= kBlock elements) of one tensor, in two passes over it. The first updates the
// moments (into m/v, in L1) and finds their new absmax; the second updates the parameters and
// quantizes the moments, in the same loop: the parameter's sqrt and divisions (long latency,
// on the divider) overlap the codec's shuffles.
template <bool GradBf16>
void step_block(const Adam& h, const Codec& cd, int64_t n, float* p, const void* grad, uint8_t* mq, float* ma,
                uint8_t* vq, float* va, int out_kind, uint16_t* out) {
  alignas(32) float m[kBlock], v[kBlock];
  const uint16_t* g16 = static_cast<const uint16_t*>(grad);
  const float* g32 = static_cast<const float*>(grad);
  // The new absmax on the float bits: for magnitudes integer order is float order, and an
  // integer max vectorizes where a float one (signed zeros, NaN) does not.
  uint32_t am_bits = 0, av_bits = 0;
  int64_t i = 0;
#if defined(__AVX2__) && defined(__FMA__)
  const AdamVec hv(h);
  {
    const __m256 m_scale = _mm256_set1_ps(*ma), v_scale = _mm256_set1_ps(*va);
    const __m256i magnitude = _mm256_set1_epi32(0x7FFFFFFF);
    __m256i am = _mm256_setzero_si256(), av = _mm256_setzero_si256();
    for (; i + 8 <= n; i += 8) {
      __m256 mi = decode8<true>(mq + i, cd.decode_m, m_scale), vi = decode8<false>(vq + i, cd.decode_v, v_scale);
      const __m256 g = GradBf16 ? _mm256_castsi256_ps(_mm256_slli_epi32(
                                      _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(g16 + i))), 16))
                                : _mm256_loadu_ps(g32 + i);
      adam_moments8(hv, g, mi, vi);
      _mm256_store_ps(m + i, mi);
      _mm256_store_ps(v + i, vi);
      am = _mm256_max_epu32(am, _mm256_and_si256(_mm256_castps_si256(mi), magnitude));
      av = _mm256_max_epu32(av, _mm256_and_si256(_mm256_castps_si256(vi), magnitude));
    }
    alignas(32) uint32_t am_lanes[8], av_lanes[8];
    _mm256_store_si256(reinterpret_cast<__m256i*>(am_lanes), am);
    _mm256_store_si256(reinterpret_cast<__m256i*>(av_lanes), av);
    for (int l = 0; l < 8; ++l) am_bits = std::max(am_bits, am_lanes[l]), av_bits = std::max(av_bits, av_lanes[l]);
  }
#endif
  for (; i < n; ++i) {
    m[i] = decode<true>(mq[i], cd.map_m) * *ma;
    v[i] = decode<false>(vq[i], cd.map_v) * *va;
    adam_moments(h, GradBf16 ? from_bf16(g16[i]) : g32[i], m[i], v[i]);
    am_bits = std::max(am_bits, bits(m[i]) & 0x7FFFFFFFu);
    av_bits = std::max(av_bits, bits(v[i]) & 0x7FFFFFFFu);
  }
  const float new_am = from_bits(am_bits), new_av = from_bits(av_bits);
  *ma = new_am;
  *va = new_av;
  i = 0;
#if defined(__AVX2__) && defined(__FMA__)
  if (vector_quantizable(new_am) && vector_quantizable(new_av)) {
    const __m256 inv_m = _mm256_set1_ps(inverse(new_am)), inv_v = _mm256_set1_ps(inverse(new_av));
    for (; i + 32 <= n; i += 32) {
      for (int j = 0; j < 32; j += 8) adam_param8(hv, p + i + j, m + i + j, v + i + j);
      encode32<true>(m + i, cd.encode_m, inv_m, mq + i);
      encode32<false>(v + i, cd.encode_v, inv_v, vq + i);
    }
  }
  for (int64_t j = i; j + 8 <= n; j += 8) adam_param8(hv, p + j, m + j, v + j);
  for (int64_t j = i + (n - i) / 8 * 8; j < n; ++j) p[j] = adam_param(h, p[j], m[j], v[j]);
#else
  for (int64_t j = 0; j < n; ++j) p[j] = adam_param(h, p[j], m[j], v[j]);
#endif
  quantize<true>(m + i, n - i, new_am, cd, mq + i);
  quantize<false>(v + i, n - i, new_av, cd, vq + i);
  if (out_kind == 1) for (i = 0; i < n; ++i) out[i] = to_bf16(p[i]);
  if (out_kind == 2) for (i = 0; i < n; ++i) out[i] = to_fp16(p[i]);
}
}  // namespace

extern "C" int sh_adamw8_abi() { return 6; }

// table: int64 [nt, 10] = numel, then the addresses of param and grad (fp32 [numel]), the
// first moment's codes (uint8 [numel]) and absmax (fp32 [blocks]), the second's, out
// (bf16/fp16 [numel] or 0), step (fp32 0-d), and the flags: the out kind (0/1/2), plus 16
// when the gradient is bf16 (widened exactly). map_m, map_v: the signed and the unsigned
// map's constants (quant8.map_constants, fp32 [64]). inv_k: quant8.moment_floor(beta1, beta2).
extern "C" void sh_adamw8_step(int64_t nt, const int64_t* table, double lr, double beta1, double beta2,
                               double weight_decay, double eps, double grad_mul, double inv_k,
                               const float* map_m, const float* map_v, int32_t nthreads) {
  std::vector<float> neg_step(nt), bc2(nt);
  std::vector<int64_t> first(nt + 1, 0);
  for (int64_t t = 0; t < nt; ++t) {
    const int64_t* e = table + 10 * t;
    float* step = reinterpret_cast<float*>(e[8]);
    *step = *step + 1.0f;
    neg_step[t] = neg_step_size(lr, beta1, *step);
    bc2[t] = bias_correction2_sqrt(beta2, *step);
    first[t + 1] = first[t] + (e[0] + kBlock - 1) / kBlock;
  }
#if defined(__AVX2__) && defined(__FMA__)
  const Codec codec{map_m, map_v, decode_lanes<true>(map_m), decode_lanes<false>(map_v), encode_lanes<true>(map_m),
                    encode_lanes<false>(map_v)};
#else
  const Codec codec{map_m, map_v};
#endif
  // Multiplying by 1.0f is exact, so the loop multiplies unconditionally and stays branch-free.
  const Adam hyper{float(grad_mul), float(1.0 - lr * weight_decay), float(1.0 - beta1), float(beta2),
                   float(1.0 - beta2), float(eps), 0.0f, 0.0f, float(inv_k)};
  const int64_t blocks = first[nt];
  const int threads = blocks >= 64 ? std::max(1, int(nthreads)) : 1;
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
  for (int64_t blk = 0; blk < blocks; ++blk) {
    const int64_t t = int64_t(std::upper_bound(first.begin(), first.end(), blk) - first.begin()) - 1;
    const int64_t* e = table + 10 * t;
    const int64_t b = blk - first[t], lo = b * kBlock, n = std::min(kBlock, e[0] - lo);
    Adam h = hyper;
    h.neg_step = neg_step[t];
    h.bc2 = bc2[t];
    float* p = reinterpret_cast<float*>(e[1]) + lo;
    uint8_t* mq = reinterpret_cast<uint8_t*>(e[3]) + lo;
    float* ma = reinterpret_cast<float*>(e[4]) + b;
    uint8_t* vq = reinterpret_cast<uint8_t*>(e[5]) + lo;
    float* va = reinterpret_cast<float*>(e[6]) + b;
    const int kind = int(e[9]) & 3;
    uint16_t* out = kind ? reinterpret_cast<uint16_t*>(e[7]) + lo : nullptr;
    if (e[9] & kGradBf16)
      step_block<true>(h, codec, n, p, reinterpret_cast<const uint16_t*>(e[2]) + lo, mq, ma, vq, va, kind, out);
    else
      step_block<false>(h, codec, n, p, reinterpret_cast<const float*>(e[2]) + lo, mq, ma, vq, va, kind, out);
  }
}
