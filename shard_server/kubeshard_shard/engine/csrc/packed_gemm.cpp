// The float32 GEMM of many rows (a prompt's prefill, a large batch): y[M, N] = x[M, K]
// W[N, K]^T (+ bias), W in its checkpoint layout.
//
// Why our own, and why not gemm.cpp's kernel: with dozens of rows the product is bound by
// arithmetic, not by memory. gemm.cpp's sweeps keep W in its [N, K] layout and sum each
// (x row, W row) pair along K in one register, which costs a horizontal sum per output and
// a load of x per W row. oneDNN's linear over a plain weight ran 10-15% slower than over
// one prepacked for it (`_reorder_linear_weight`, measured at 64-128 rows), but a prepacked
// weight is a second copy of every weight, in a layout our decode kernels cannot read. Here
// each thread copies a tile of NB = 16 rows of W into a small K-major buffer (in cache:
// K x 16 floats) once per call, then runs every row of x over it with an outer-product
// micro-kernel, BLIS's shape: 6 rows of x by 16 outputs in 12 accumulators, one broadcast
// of x and two loads of the tile per 12 FMAs, no horizontal sums. Over the default model's
// layers (AVX2 EPYC, 2 cores, bench/results/cpu-kernels-avx2.md, 2026-12-06) it runs 1.4x
// oneDNN's linear at 64-128 rows and 1.1x at 256; it also beats gemm.cpp's sweeps from about
// 24 rows (1.3x at 48), but those keep the products of up to 48 rows (compute.small_rows)
// so that a row gets the same bits alone or batched with others up to there.
//
// Each output sums its K products in order k = 0, 1, ..., one FMA each, whatever the rows
// beside it: a row gets the same bits alone or in any batch on this path.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdlib>
#include <memory>

#include "kernels.h"
#include "simd.h"

namespace ks {

namespace {

constexpr int64_t NB = 16;  // outputs per tile: two 8-lane vectors
constexpr int64_t MR = 6;   // rows of x per micro-kernel call: 12 accumulators, 15 of 16 registers

#if defined(KS_AVX2)
// dst[k][j] = src[j][k] for an 8 x 8 block (src rows lds apart, dst rows ldd apart)
inline void transpose8(const float* src, int64_t lds, float* dst, int64_t ldd) {
  __m256 r[8], t[8], u[8];
  for (int i = 0; i < 8; ++i) r[i] = _mm256_loadu_ps(src + i * lds);
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 8; i += 4) {
    u[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);
    u[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xEE);
    u[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);
    u[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
  }
  for (int i = 0; i < 4; ++i) {
    _mm256_storeu_ps(dst + i * ldd, _mm256_permute2f128_ps(u[i], u[i + 4], 0x20));
    _mm256_storeu_ps(dst + (i + 4) * ldd, _mm256_permute2f128_ps(u[i], u[i + 4], 0x31));
  }
}
#endif

// tile[k][j] = w[j][k] for the tile's `rows` rows of W (zeros for j >= rows)
void pack_tile(const float* w, int64_t K, int64_t rows, float* tile) {
  int64_t k = 0;
#if defined(KS_AVX2)
  if (rows == NB)
    for (; k + 8 <= K; k += 8) {
      transpose8(w + k, K, tile + k * NB, NB);
      transpose8(w + 8 * K + k, K, tile + k * NB + 8, NB);
    }
#endif
  for (; k < K; ++k)
    for (int64_t j = 0; j < NB; ++j) tile[k * NB + j] = j < rows ? w[j * K + k] : 0.f;
}

// out[m][0:16] = sum over k of x[m][k] * tile[k][0:16], for R rows of x (K >= 1)
template <int R>
void micro(const float* x, int64_t K, const float* tile, float* out, int64_t ldo) {
#if defined(KS_AVX2)
  __m256 acc[R][2];
  for (int m = 0; m < R; ++m) acc[m][0] = acc[m][1] = _mm256_setzero_ps();
  // do-while, not for: with a loop that may run zero times GCC kept the accumulators in
  // memory, storing them every iteration (a third of the speed)
  int64_t k = 0;
  do {
    const __m256 w0 = _mm256_loadu_ps(tile + k * NB), w1 = _mm256_loadu_ps(tile + k * NB + 8);
    for (int m = 0; m < R; ++m) {
      const __m256 xb = _mm256_broadcast_ss(x + m * K + k);
      acc[m][0] = _mm256_fmadd_ps(xb, w0, acc[m][0]);
      acc[m][1] = _mm256_fmadd_ps(xb, w1, acc[m][1]);
    }
  } while (++k < K);
  for (int m = 0; m < R; ++m) {
    _mm256_storeu_ps(out + m * ldo, acc[m][0]);
    _mm256_storeu_ps(out + m * ldo + 8, acc[m][1]);
  }
#else
  for (int m = 0; m < R; ++m)
    for (int64_t j = 0; j < NB; ++j) {
      float s = 0.f;
      for (int64_t k = 0; k < K; ++k) s = std::fma(x[m * K + k], tile[k * NB + j], s);
      out[m * ldo + j] = s;
    }
#endif
}

// rows [m, m + R) of y's columns [n0, n0 + cols): straight into y when the tile is whole
// and there is no bias, else through a buffer
template <int R>
void rows_of_tile(const float* x, int64_t K, const float* tile, float* y, int64_t N, int64_t n0, int64_t cols,
                  const float* bias) {
  if (cols == NB && bias == nullptr) {
    micro<R>(x, K, tile, y + n0, N);
    return;
  }
  alignas(32) float out[R * NB];
  micro<R>(x, K, tile, out, NB);
  for (int m = 0; m < R; ++m)
    for (int64_t j = 0; j < cols; ++j) y[m * N + n0 + j] = out[m * NB + j] + (bias ? bias[n0 + j] : 0.f);
}

}  // namespace

at::Tensor gemm_f32_packed(at::Tensor x, at::Tensor w, c10::optional<at::Tensor> bias) {
  check_2d(x, "gemm_f32_packed x", at::kFloat);
  check_2d(w, "gemm_f32_packed weight", at::kFloat);
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  TORCH_CHECK(w.size(1) == K, "gemm_f32_packed: x has ", K, " columns, the weight ", w.size(1));
  const float* b = bias_ptr(bias, N, "gemm_f32_packed");
  auto y = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  if (K == 0) return b ? bias->unsqueeze(0).expand({M, N}).contiguous() : y.zero_();
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t tiles = (N + NB - 1) / NB;
  at::parallel_for(0, tiles, 1, [&](int64_t t0, int64_t t1) {
    const size_t bytes = (K * NB * sizeof(float) + 63) / 64 * 64;
    std::unique_ptr<float, decltype(&std::free)> tile(static_cast<float*>(std::aligned_alloc(64, bytes)), &std::free);
    TORCH_CHECK(tile != nullptr, "gemm_f32_packed: out of memory for a ", bytes, "-byte tile");
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t n0 = t * NB, cols = std::min(NB, N - n0);
      pack_tile(wp + n0 * K, K, cols, tile.get());
      int64_t m = 0;
      for (; m + MR <= M; m += MR) rows_of_tile<MR>(xp + m * K, K, tile.get(), yp + m * N, N, n0, cols, b);
      const float* xm = xp + m * K;
      float* ym = yp + m * N;
      switch (M - m) {
        case 5: rows_of_tile<5>(xm, K, tile.get(), ym, N, n0, cols, b); break;
        case 4: rows_of_tile<4>(xm, K, tile.get(), ym, N, n0, cols, b); break;
        case 3: rows_of_tile<3>(xm, K, tile.get(), ym, N, n0, cols, b); break;
        case 2: rows_of_tile<2>(xm, K, tile.get(), ym, N, n0, cols, b); break;
        case 1: rows_of_tile<1>(xm, K, tile.get(), ym, N, n0, cols, b); break;
        default: break;
      }
    }
  });
  return y;
}

}  // namespace ks
