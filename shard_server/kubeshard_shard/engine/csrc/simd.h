// Shared helpers of the CPU kernels: float16 <-> float32, exp, horizontal sums, and which
// instruction set the build targets. Every kernel has a portable scalar path; the
// AVX2 + FMA (+ F16C) paths are what make them fast on x86-64, and the AVX-512 BW / VNNI
// variants, where the compiler targets them (-march=native), replace the 256-bit dot
// products with wider or fused ones that give the same integer results.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define KS_AVX2 1
#endif
#if defined(KS_AVX2) && defined(__AVX512F__) && defined(__AVX512BW__)
#define KS_AVX512 1
#endif
#if defined(KS_AVX2) && (defined(__AVXVNNI__) || (defined(__AVX512VNNI__) && defined(__AVX512VL__)))
#define KS_VNNI256 1
#endif
// A lambda (or function) the compiler must inline: one it leaves out of line, called from
// two places, keeps the accumulator arrays it captures by reference in memory, so that
// every multiply-add goes through a store and a load.
#define KS_INLINE __attribute__((always_inline))

namespace ks {

// exp(x) in float32, written so the compiler vectorizes the loops that call it (softmax
// after subtracting the max, SiLU): 2^(x log2 e) = 2^n * 2^f, 2^f by a degree-6
// polynomial on [-0.5, 0.5] (relative error ~1e-7, as good as float32 gives); x is
// clamped to [-87, 88], where float32's exp neither underflows nor overflows.
// exp_f32x8 below is the same on eight lanes.
constexpr float kLog2e = 1.44269504088896341f;
constexpr float kExp2Poly[7] = {1.535336188319500e-4f, 1.339887440266574e-3f, 9.618437357674640e-3f,
                                5.550332471162809e-2f, 2.402264791363012e-1f, 6.931472028550421e-1f, 1.0f};
static inline float exp_f32(float x) {
  x = std::min(std::max(x, -87.f), 88.f);
  const float t = x * kLog2e;
  const float n = std::nearbyint(t);
  const float f = t - n;
  float p = kExp2Poly[0];
  p = p * f + kExp2Poly[1];
  p = p * f + kExp2Poly[2];
  p = p * f + kExp2Poly[3];
  p = p * f + kExp2Poly[4];
  p = p * f + kExp2Poly[5];
  p = p * f + kExp2Poly[6];
  int32_t bits;
  std::memcpy(&bits, &p, sizeof(bits));
  bits += static_cast<int32_t>(n) << 23;
  float r;
  std::memcpy(&r, &bits, sizeof(r));
  return r;
}

static inline float fp16_to_f32(uint16_t h) {
#if defined(__F16C__)
  return _cvtsh_ss(h);
#else
  const uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1Fu, man = h & 0x3FFu, bits;
  if (exp == 0) {
    if (man == 0) {
      bits = sign;
    } else {  // subnormal: normalize
      exp = 127 - 15 + 1;
      while (!(man & 0x400u)) { man <<= 1; --exp; }
      bits = sign | (exp << 23) | ((man & 0x3FFu) << 13);
    }
  } else if (exp == 31) {
    bits = sign | 0x7F800000u | (man << 13);
  } else {
    bits = sign | ((exp + 127 - 15) << 23) | (man << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
#endif
}

static inline float bf16_to_f32(uint16_t h) {
  const uint32_t bits = (uint32_t)h << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// Round to nearest even, as torch's float -> bfloat16 conversion does (NaN stays NaN).
static inline uint16_t f32_to_bf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  if ((bits & 0x7FFFFFFFu) > 0x7F800000u) return (uint16_t)((bits >> 16) | 0x40u);
  bits += 0x7FFFu + ((bits >> 16) & 1u);
  return (uint16_t)(bits >> 16);
}

#if defined(KS_AVX2)
// exp_f32 on eight lanes: the same steps, the same polynomial.
static inline __m256 exp_f32x8(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.f)), _mm256_set1_ps(88.f));
  const __m256 t = _mm256_mul_ps(x, _mm256_set1_ps(kLog2e));
  const __m256 n = _mm256_round_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 f = _mm256_sub_ps(t, n);
  __m256 p = _mm256_set1_ps(kExp2Poly[0]);
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(kExp2Poly[1]));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(kExp2Poly[2]));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(kExp2Poly[3]));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(kExp2Poly[4]));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(kExp2Poly[5]));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(kExp2Poly[6]));
  const __m256i bits = _mm256_add_epi32(_mm256_castps_si256(p), _mm256_slli_epi32(_mm256_cvtps_epi32(n), 23));
  return _mm256_castsi256_ps(bits);
}

static inline float hmax256(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  return _mm_cvtss_f32(m);
}

static inline float hsum256(__m256 v) {
  __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
  lo = _mm_add_ps(lo, hi);
  __m128 sh = _mm_movehdup_ps(lo);
  lo = _mm_add_ps(lo, sh);
  sh = _mm_movehl_ps(sh, lo);
  return _mm_cvtss_f32(_mm_add_ss(lo, sh));
}

// Sum of the products of 32 unsigned bytes (a) and 32 signed bytes (b), as 8 int32 lanes.
// maddubs saturates its 16-bit pair sums: callers keep |a*b + a'*b'| below 32768.
static inline __m256i dot_u8s8(__m256i a, __m256i b) {
#if defined(KS_VNNI256)
#if defined(__AVXVNNI__)
  return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), a, b);
#else
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), a, b);
#endif
#else
  return _mm256_madd_epi16(_mm256_maddubs_epi16(a, b), _mm256_set1_epi16(1));
#endif
}
#endif

}  // namespace ks
