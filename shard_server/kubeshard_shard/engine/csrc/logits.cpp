// What a step needs from each row of logits, in one call: its argmax (the greedy token)
// and its log-sum-exp (a token's log-probability is its logit less it), in double: a
// float log-sum-exp near 20 would be off by up to 2e-6, more than a log_softmax's error.
//
// Why our own: every step asked torch for `argmax` and a `log_softmax` over the whole
// vocabulary, and on the default model's 49,152 logits those took 58 and 52 us a row on
// this project's AMD EPYC (2 cores, AVX2), where reading the row once takes a few: torch's
// argmax reduction is not vectorized there, and the log_softmax writes a vocabulary's
// worth of values of which a step reads one (or a few, for top-n alternatives). A
// speculative verification did both over every one of its k + 1 rows. Here each row is
// read three times at most, in registers: its max (and whether it holds a NaN), the first
// index holding it, and the sum of exp(x - max).
//
// The semantics are torch's: the argmax is the first index of the largest value, a NaN
// counts as larger than everything (the first NaN's index, and a NaN log-sum-exp), a row
// of -inf has argmax 0 and log-sum-exp -inf, and a +inf makes the log-sum-exp +inf.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <limits>
#include <tuple>

#include "simd.h"

namespace ks {

namespace {

// The largest value of x[0, n) and whether a NaN is among them.
inline float row_max(const float* x, int64_t n, bool& nan) {
  float m = -std::numeric_limits<float>::infinity();
  int64_t i = 0;
  nan = false;
#if defined(KS_AVX2)
  __m256 vm = _mm256_set1_ps(m), unordered = _mm256_setzero_ps();
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    vm = _mm256_max_ps(vm, v);
    unordered = _mm256_or_ps(unordered, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  }
  m = hmax256(vm);
  nan = _mm256_movemask_ps(unordered) != 0;
#endif
  for (; i < n; ++i) {
    if (std::isnan(x[i])) nan = true;
    else m = std::max(m, x[i]);
  }
  return m;
}

// The first index of x[0, n) holding `value` (compared with ==), or of a NaN when `value`
// is one; n when none does.
inline int64_t first_index(const float* x, int64_t n, float value) {
  const bool nan = std::isnan(value);
  int64_t i = 0;
#if defined(KS_AVX2)
  const __m256 target = _mm256_set1_ps(value);
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    const int mask = _mm256_movemask_ps(nan ? _mm256_cmp_ps(v, v, _CMP_UNORD_Q) : _mm256_cmp_ps(v, target, _CMP_EQ_OQ));
    if (mask) return i + __builtin_ctz(static_cast<unsigned>(mask));
  }
#endif
  for (; i < n; ++i)
    if (nan ? std::isnan(x[i]) : x[i] == value) return i;
  return n;
}

// sum of exp(x - m) over x[0, n), added in double (float lanes drifted by 1.4e-6 over
// 49,152 terms).
inline double sum_exp(const float* x, int64_t n, float m) {
  int64_t i = 0;
  double total = 0.0;
#if defined(KS_AVX2)
  const __m256 vm = _mm256_set1_ps(m);
  __m256d a0 = _mm256_setzero_pd(), a1 = _mm256_setzero_pd();
  for (; i + 8 <= n; i += 8) {
    const __m256 e = exp_f32x8(_mm256_sub_ps(_mm256_loadu_ps(x + i), vm));
    a0 = _mm256_add_pd(a0, _mm256_cvtps_pd(_mm256_castps256_ps128(e)));
    a1 = _mm256_add_pd(a1, _mm256_cvtps_pd(_mm256_extractf128_ps(e, 1)));
  }
  alignas(32) double lanes[4];
  _mm256_store_pd(lanes, _mm256_add_pd(a0, a1));
  for (double v : lanes) total += v;
#endif
  for (; i < n; ++i) total += exp_f32(x[i] - m);
  return total;
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> argmax_logsumexp(at::Tensor logits) {
  TORCH_CHECK(logits.dim() == 2 && logits.is_contiguous() && logits.scalar_type() == at::kFloat &&
                  logits.device().is_cpu(),
              "argmax_logsumexp: expected contiguous 2-d float32 CPU logits");
  const int64_t rows = logits.size(0), n = logits.size(1);
  TORCH_CHECK(n > 0, "argmax_logsumexp: the rows are empty");
  auto best = at::empty({rows}, logits.options().dtype(at::kLong));
  auto lse = at::empty({rows}, logits.options().dtype(at::kDouble));
  const float* x = logits.data_ptr<float>();
  int64_t* bp = best.data_ptr<int64_t>();
  double* lp = lse.data_ptr<double>();
  constexpr float inf = std::numeric_limits<float>::infinity();
  at::parallel_for(0, rows, 4, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float* row = x + r * n;
      bool nan = false;
      const float m = row_max(row, n, nan);
      if (nan) {
        bp[r] = first_index(row, n, std::numeric_limits<float>::quiet_NaN());
        lp[r] = std::numeric_limits<double>::quiet_NaN();
      } else if (m == -inf) {
        bp[r] = 0;
        lp[r] = -inf;
      } else {
        bp[r] = first_index(row, n, m);
        lp[r] = m == inf ? inf : double(m) + std::log(sum_exp(row, n, m));
      }
    }
  });
  return {best, lse};
}

}  // namespace ks
