// GEMMs for the few rows of a decode step: y[M, N] = x[M, K] W[N, K]^T (+ bias), with W
// in float32, int8 (per-row or per-group scales) or packed int4 (per-group scales and
// minimums).
//
// Why our own: at one to a few rows a GEMM is a matrix-vector product bound by how fast
// W streams from memory, and the library paths either do not stream at that speed
// (oneDNN's float32 linear at M = 1 on this project's AMD machines) or are slow outright:
// torch 2.15's CPU `_weight_int8pack_mm` took 9.9 ms and a bfloat16 matmul 13 ms for a
// 1x576 by 576x1536 product that float32 does in 0.16 ms, and there is no int4 CPU path
// for these layouts at all. So each kernel reads every weight byte once, with the rows
// of x kept in registers/L1 while a tile of W rows streams past them.
//
// The quantized kernels work much as llama.cpp's do: x is quantized per 32 values (to
// int16 here, see QuantX), and each 32-value block of a row is an integer dot product
// scaled once in float. Layouts:
// - q8: int8 [N, K], float16 scales [N, K / G] (G = K: per output channel; G = 32: GGUF Q8_0)
// - q4: uint8 [N, K / 2], each 32 values in 16 bytes as GGUF packs them (byte j holds
//   value j in its low nibble and value j + 16 in its high one), float16 scales d and
//   minimums m [N, K / G]: w = d * q + m (GGUF Q4_1; Q4_0 is m = -8 d).
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <type_traits>
#include <vector>

#include "kernels.h"
#include "parallel.h"
#include "simd.h"

namespace ks {

// ---------------------------------------------------------------------------- float32
// A tile: MR rows of x by NR rows of W, each accumulator one (x row, W row) pair. Wide
// tiles (NR = 12) keep a dozen W rows streaming at once, which is what brings one row of
// x near the memory's read speed; with AVX-512's 32 registers two rows of x share each
// W load (bench/results/cpu-kernels.md, `--against 043dba8`: 1.2x at one row and 1.3x at
// six to eight against the four-row tiles of three x rows this replaced).
//
// `ahead`: with more than one row of x, the first chunk of rows asks for the next tile's
// W rows (into L2) while it streams its own, so that the next tile's memory reads overlap
// this tile's later chunks, which compute from cache. AVX-512 only: on a pass over the
// default model's layers (bench/results/cpu-kernels.md, `--against 653ac76`, 2026-12-05,
// Xeon, 2 cores) 1.01x at 2 rows to 1.13x at 8, its LM head 1.1x to 1.2x; the AVX2 build
// measured no faster with it. At one row the hardware prefetcher keeps up alone.
#if defined(KS_AVX512)
constexpr int64_t F32_NR = 12, F32_MR = 2;
template <int MR, int NR>
static void f32_tile(const float* x, int64_t K, const float* w, float* y, int64_t ldy, const float* bias,
                     bool ahead) {
  __m512 acc[MR][NR];
  for (int m = 0; m < MR; ++m)
    for (int n = 0; n < NR; ++n) acc[m][n] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 16 <= K; k += 16) {
    __m512 wv[NR];
    if (ahead)
      for (int n = 0; n < NR; ++n) _mm_prefetch(reinterpret_cast<const char*>(w + (NR + n) * K + k), _MM_HINT_T1);
    for (int n = 0; n < NR; ++n) wv[n] = _mm512_loadu_ps(w + n * K + k);
    for (int m = 0; m < MR; ++m) {
      const __m512 xv = _mm512_loadu_ps(x + m * K + k);
      for (int n = 0; n < NR; ++n) acc[m][n] = _mm512_fmadd_ps(xv, wv[n], acc[m][n]);
    }
  }
  if (k < K) {  // the last K % 16 values, by masked loads
    const __mmask16 mask = __mmask16((1u << (K - k)) - 1);
    __m512 wv[NR];
    for (int n = 0; n < NR; ++n) wv[n] = _mm512_maskz_loadu_ps(mask, w + n * K + k);
    for (int m = 0; m < MR; ++m) {
      const __m512 xv = _mm512_maskz_loadu_ps(mask, x + m * K + k);
      for (int n = 0; n < NR; ++n) acc[m][n] = _mm512_fmadd_ps(xv, wv[n], acc[m][n]);
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int n = 0; n < NR; ++n) y[m * ldy + n] = _mm512_reduce_add_ps(acc[m][n]) + (bias ? bias[n] : 0.f);
}
#elif defined(KS_AVX2)
// 16 registers. All the rows of a chunk (up to seven: a verification of six proposals
// and its last token) go over the tile in one sweep, NP W rows at a time, so each W
// value read from memory feeds every row of the chunk. NP shrinks as the chunk grows, to
// keep MR x NP accumulators in registers; so that a sweep over two or three W rows still
// keeps the memory busy while it computes, each pass asks for the next pass's W rows (one
// line each per two loads of its own; a prefetch past the end of W is harmless, it never
// faults). That overlaps the later rows' arithmetic with the reads, which the first-row-
// alone-then-pairs tiles this replaced (7956ea0) did one after the other: over the
// default model's layers (bench/results/cpu-kernels-avx2.md, `--against e67435e`,
// 2026-12-05, EPYC) 1.23x at 7 rows, 1.20x at 8 (1.15x and 1.12x in a run before it),
// 1.05-1.12x at 2-4, its LM head 1.2x at 7; seven rows now cost 1.33 one-row passes (1.62
// before). One row takes the same pass as before; at 48-64 rows, from cache, 0.93-0.96x.
// Without the prefetch the narrow sweeps were slower than the tiles (0.85x at 7 rows,
// random weights of the same shapes). Each accumulator sums its (x row, W row) pair in
// the same order whatever the chunk, so a row gets the same bits alone or in any batch.
constexpr int64_t F32_NR = 12, F32_MR = 7;
template <int MR, int NP>
static void f32_pass(const float* x, int64_t K, const float* w, float* y, int64_t ldy, const float* bias) {
  __m256 acc[MR][NP];
  for (int m = 0; m < MR; ++m)
    for (int n = 0; n < NP; ++n) acc[m][n] = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 8 <= K; k += 8) {
    __m256 wv[NP];
    if constexpr (MR > 1)  // one row: the hardware prefetcher keeps up with its 12 streams alone
      if (k % 16 == 0)
        for (int n = 0; n < NP; ++n) _mm_prefetch(reinterpret_cast<const char*>(w + (NP + n) * K + k), _MM_HINT_T0);
    for (int n = 0; n < NP; ++n) wv[n] = _mm256_loadu_ps(w + n * K + k);
    for (int m = 0; m < MR; ++m) {
      const __m256 xv = _mm256_loadu_ps(x + m * K + k);
      for (int n = 0; n < NP; ++n) acc[m][n] = _mm256_fmadd_ps(xv, wv[n], acc[m][n]);
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int n = 0; n < NP; ++n) {
      float s = hsum256(acc[m][n]);
      for (int64_t t = k; t < K; ++t) s += x[m * K + t] * w[n * K + t];
      y[m * ldy + n] = s + (bias ? bias[n] : 0.f);
    }
}
template <int MR, int NR>
static void f32_tile(const float* x, int64_t K, const float* w, float* y, int64_t ldy, const float* bias,
                     bool /*ahead: no faster on the AVX2 build*/) {
  constexpr int WIDE = MR == 1 ? 12 : MR == 2 ? 6 : MR == 3 ? 4 : MR == 4 ? 3 : 2;
  constexpr int NP = NR % WIDE == 0 ? WIDE : 1;  // NR = 1: the last, partial tile
  for (int n = 0; n < NR; n += NP) f32_pass<MR, NP>(x, K, w + n * K, y + n, ldy, bias ? bias + n : nullptr);
}
#else
constexpr int64_t F32_NR = 4, F32_MR = 1;
template <int MR, int NR>
static void f32_tile(const float* x, int64_t K, const float* w, float* y, int64_t ldy, const float* bias,
                     bool /*ahead*/) {
  for (int m = 0; m < MR; ++m)
    for (int n = 0; n < NR; ++n) {
      float s = 0.f;
      for (int64_t t = 0; t < K; ++t) s += x[m * K + t] * w[n * K + t];
      y[m * ldy + n] = s + (bias ? bias[n] : 0.f);
    }
}
#endif

// Runs `tile<MR, NR>` over rows [n0, n1) of W for every row of x, in chunks of MR rows
// of x (a tile of W stays in cache while the chunks pass over it).
#define KS_FOR_TILES(NR, MR_MAX, CALL)                                               \
  for (int64_t n0_ = n0; n0_ < n1; n0_ += NR) {                                      \
    if (n0_ + NR > n1) { /* the last, partial tile: one row of W at a time */        \
      for (int64_t n = n0_; n < n1; ++n)                                             \
        for (int64_t m = 0; m < M; ++m) CALL(1, 1);                                  \
      continue;                                                                      \
    }                                                                                \
    const int64_t n = n0_;                                                           \
    int64_t m = 0;                                                                   \
    /* each chunk the widest the rows left fill, up to MR_MAX rows */                \
    while (m < M) {                                                                  \
      const int64_t left = M - m;                                                    \
      if constexpr (MR_MAX >= 7) if (left >= 7) { CALL(7, NR); m += 7; continue; }   \
      if constexpr (MR_MAX >= 6) if (left >= 6) { CALL(6, NR); m += 6; continue; }   \
      if constexpr (MR_MAX >= 5) if (left >= 5) { CALL(5, NR); m += 5; continue; }   \
      if constexpr (MR_MAX >= 4) if (left >= 4) { CALL(4, NR); m += 4; continue; }   \
      if constexpr (MR_MAX >= 3) if (left >= 3) { CALL(3, NR); m += 3; continue; }   \
      if constexpr (MR_MAX >= 2) if (left >= 2) { CALL(2, NR); m += 2; continue; }   \
      CALL(1, NR);                                                                   \
      m += 1;                                                                        \
    }                                                                                \
  }

void gemm_f32_into(const float* xp, int64_t M, int64_t K, const float* wp, int64_t N, const float* b, float* yp) {
  constexpr int64_t NR = F32_NR;
  const int64_t tiles = (N + NR - 1) / NR;
  at::parallel_for(0, tiles, 16, [&](int64_t t0, int64_t t1) {
    const int64_t n0 = t0 * NR, n1 = std::min(N, t1 * NR);
#define KS_CALL(mr, nr) f32_tile<mr, nr>(xp + m * K, K, wp + n * K, yp + m * N + n, N, b ? b + n : nullptr, \
                                          m == 0 && M > 1)
    KS_FOR_TILES(NR, F32_MR, KS_CALL)
#undef KS_CALL
  });
}

at::Tensor gemm_f32(at::Tensor x, at::Tensor w, c10::optional<at::Tensor> bias) {
  check_2d(x, "gemm_f32 x", at::kFloat);
  check_2d(w, "gemm_f32 weight", at::kFloat);
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  TORCH_CHECK(w.size(1) == K, "gemm_f32: x has ", K, " columns, the weight ", w.size(1));
  const float* b = bias_ptr(bias, N, "gemm_f32");
  auto y = at::empty({M, N}, x.options());
  gemm_f32_into(x.data_ptr<float>(), M, K, w.data_ptr<float>(), N, b, y.data_ptr<float>());
  return y;
}

// ------------------------------------------------------------- x quantized per 32 values
// x becomes int16 per 32 values (d = max |x| / 32767): a relative error of 1.5e-5 at most,
// so what a quantized model computes differs from the float product of its weights by
// far less than the weights' own rounding (int8 activations, llama.cpp's choice, moved
// the default model's first answer token on one question in eight). The products are
// 16 x 16-bit pairs summed to 32 bits (madd; dpwssd with VNNI): exact integers.
struct QuantX {
  std::vector<int16_t> q;  // [M, K]
  std::vector<float> d;    // [M, K / 32] scale of each block
  std::vector<float> sum;  // [M, K / 32] exact float sum of each block (int4 minimums)
  std::vector<float> err;  // [M, K / 32] that sum less the sum of the quantized values
  std::vector<float> gsum, gerr;  // the same two per group of G values (int4)
  std::vector<int8_t> split;      // [M, chunks of four blocks, 256] (XLayout::kSplit)

  void group(int64_t M, int64_t K, int64_t G) {
    const int64_t nb = K / 32, ng = K / G, bpg = G / 32;
    gsum.assign(M * ng, 0.f);
    gerr.assign(M * ng, 0.f);
    for (int64_t r = 0; r < M; ++r)
      for (int64_t b = 0; b < nb; ++b) {
        gsum[r * ng + b / bpg] += sum[r * nb + b];
        gerr[r * ng + b / bpg] += err[r * nb + b];
      }
  }
};

// Where each of the 64 values of a pair of blocks (2p, 2p + 1) of x comes from in a layout:
// position i takes value from[i] (0-31: block 2p's, 32-63: block 2p+1's).
struct PairOrder {
  uint8_t from[64];
};

// The quad layout (int4 on AVX2 without AVX-512, see q4_row): four vectors of 16,
// [2p: 0 2 .. 14 | 2p+1: 0 2 .. 14], [16 18 .. 30 | ...], [1 3 .. 15 | ...],
// [17 19 .. 31 | ...], the order in which the four nibbles of each 16-bit word of one
// 256-bit read of the two blocks' packed weights come out (q4_pair_weights).
static constexpr PairOrder kQuadFrom = [] {
  PairOrder o{};
  for (int h = 0; h < 2; ++h)
    for (int k = 0; k < 8; ++k) {
      o.from[h * 8 + k] = h * 32 + 2 * k;
      o.from[16 + h * 8 + k] = h * 32 + 16 + 2 * k;
      o.from[32 + h * 8 + k] = h * 32 + 2 * k + 1;
      o.from[48 + h * 8 + k] = h * 32 + 17 + 2 * k;
    }
  return o;
}();

// Each row's blocks of x, in pairs, put in `order`; a last odd block stays as it is.
static void reorder_pairs(int16_t* q, int64_t M, int64_t K, const PairOrder& order) {
  int16_t two[64];
  for (int64_t r = 0; r < M; ++r)
    for (int64_t b = 0; b + 2 <= K / 32; b += 2) {
      int16_t* at = q + r * K + b * 32;
      std::memcpy(two, at, sizeof(two));
      for (int i = 0; i < 64; ++i) at[i] = two[order.from[i]];
    }
}

// The split layout (int4 on AVX-512, see q4_rows512): each quantized value as its high
// byte h (signed) and low byte l (unsigned), q = 256 h + l, so that a byte dot product
// (vpdpbusd: unsigned by signed bytes) multiplies the int4 weights, bytes of 0..15
// straight from their nibbles, by each without widening them. Per chunk of four blocks,
// four vectors of 64 bytes: h of values 0-15 of the four blocks (16 bytes a block, in
// order), h of values 16-31, l of values 0-15, l of values 16-31: the order of the low
// and the high nibbles of the chunk's 64 packed bytes. A last chunk of fewer blocks is
// padded with zeros.
constexpr int64_t kSplitChunk = 256;  // bytes of x a chunk

static void split_bytes(QuantX& qx, int64_t M, int64_t K) {
  const int64_t nb = K / 32, chunks = (nb + 3) / 4;
  qx.split.assign(M * chunks * kSplitChunk, 0);
  for (int64_t r = 0; r < M; ++r)
    for (int64_t b = 0; b < nb; ++b) {
      const int16_t* q = qx.q.data() + r * K + b * 32;
      int8_t* out = qx.split.data() + (r * chunks + b / 4) * kSplitChunk + (b % 4) * 16;
      for (int i = 0; i < 16; ++i) {
        out[i] = static_cast<int8_t>(q[i] >> 8);
        out[64 + i] = static_cast<int8_t>(q[16 + i] >> 8);
        out[128 + i] = static_cast<int8_t>(q[i] & 0xFF);
        out[192 + i] = static_cast<int8_t>(q[16 + i] & 0xFF);
      }
    }
}

enum class XLayout { kInOrder, kSplit, kQuad };

// Into `out`, whose vectors keep their capacity from call to call (each GEMM's caller
// passes its thread's, see scratch_x).
static void quantize_x(QuantX& out, const float* x, int64_t M, int64_t K, XLayout layout = XLayout::kInOrder) {
  const int64_t nb = K / 32;
  out.q.resize(M * K);
  out.d.resize(M * nb);
  out.sum.resize(M * nb);
  out.err.resize(M * nb);
  for (int64_t r = 0; r < M * nb; ++r) {
    const float* v = x + r * 32;
    int16_t* q = out.q.data() + r * 32;
#if defined(KS_AVX2)
    // the same steps on eight lanes (the compiler leaves the scalar loops' max and sum
    // serial: float reductions are not reassociated without -ffast-math); the rounding
    // is cvtps's, to nearest even, as nearbyint's
    const __m256 sign = _mm256_set1_ps(-0.f);
    __m256 xv[4], amax = _mm256_setzero_ps(), sv = _mm256_setzero_ps();
    for (int i = 0; i < 4; ++i) {
      xv[i] = _mm256_loadu_ps(v + 8 * i);
      amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, xv[i]));
      sv = _mm256_add_ps(sv, xv[i]);
    }
    const float d = hmax256(amax) / 32767.f, s = hsum256(sv);
    const __m256 id = _mm256_set1_ps(d > 0.f ? 1.f / d : 0.f);
    __m256i qsum = _mm256_setzero_si256();
    for (int i = 0; i < 4; i += 2) {
      const __m256i a = _mm256_cvtps_epi32(_mm256_mul_ps(xv[i], id));
      const __m256i b = _mm256_cvtps_epi32(_mm256_mul_ps(xv[i + 1], id));
      qsum = _mm256_add_epi32(qsum, _mm256_add_epi32(a, b));
      // packs works per 128-bit half: [a0-3 b0-3 | a4-7 b4-7] -> in order
      const __m256i ab = _mm256_permute4x64_epi64(_mm256_packs_epi32(a, b), 0xD8);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + 8 * i), ab);
    }
    const __m128i q4 = _mm_add_epi32(_mm256_castsi256_si128(qsum), _mm256_extracti128_si256(qsum, 1));
    const __m128i q2 = _mm_add_epi32(q4, _mm_unpackhi_epi64(q4, q4));
    const int32_t qs = _mm_cvtsi128_si32(_mm_add_epi32(q2, _mm_shuffle_epi32(q2, 1)));
#else
    float amax = 0.f, s = 0.f;
    for (int i = 0; i < 32; ++i) {
      amax = std::max(amax, std::fabs(v[i]));
      s += v[i];
    }
    const float d = amax / 32767.f, id = d > 0.f ? 1.f / d : 0.f;
    int32_t qs = 0;
    for (int i = 0; i < 32; ++i) {
      q[i] = static_cast<int16_t>(std::nearbyint(v[i] * id));
      qs += q[i];
    }
#endif
    out.d[r] = d;
    out.sum[r] = s;
    out.err[r] = s - d * float(qs);
  }
  if (layout == XLayout::kSplit) split_bytes(out, M, K);
  if (layout == XLayout::kQuad) reorder_pairs(out.q.data(), M, K, kQuadFrom);
}

// The calling thread's QuantX: a decode step makes about a hundred GEMM calls, each of
// which allocated six vectors before it reused one.
static QuantX& scratch_x() {
  static thread_local QuantX x;
  return x;
}

#if defined(KS_AVX2)
// sum of w[i] * x[i] over 32 values: w as two vectors of 16 int16, x 32 int16 in memory.
static inline __m256i dot32(__m256i wa, __m256i wb, const int16_t* x) {
  const __m256i xa = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
  const __m256i xb = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + 16));
#if defined(KS_VNNI256)
#if defined(__AVXVNNI__)
  return _mm256_dpwssd_avx_epi32(_mm256_dpwssd_avx_epi32(_mm256_setzero_si256(), wa, xa), wb, xb);
#else
  return _mm256_dpwssd_epi32(_mm256_dpwssd_epi32(_mm256_setzero_si256(), wa, xa), wb, xb);
#endif
#else
  return _mm256_add_epi32(_mm256_madd_epi16(wa, xa), _mm256_madd_epi16(wb, xb));
#endif
}
#endif

// ------------------------------------------------------------------ int8 and int4 rows
// Rows of W a thread takes at a time in the row-by-row kernels (parallel_chunks): even,
// so that the int4 kernel's pairs of rows stay pairs.
constexpr int64_t kRowChunk = 32;

// How a quantized format's weight rows are read, from a tile's first row: each block of
// 32 weights as two vectors of 16 int16 (AVX2) or one integer dot (scalar), each group's
// float16 scale, and what an output adds beyond the blocks' dots (int4's minimums).
struct Int8Rows {
  const int8_t* w;         // [rows, K]
  const uint16_t* scales;  // [rows, K / G]
  int64_t K, ng;
  static constexpr int64_t kPrefetchMask = 1;  // 32 bytes a block: prefetch every 2nd
  // bytes of W asked for ahead of the block read (read_block): a pass over the default
  // model's int8 layers with 8192 took 0.85-0.88x the time it took with 2048, four runs
  // interleaved (2026-12-06, Xeon, 2 cores; 16384 0.88-0.90x, 32768 0.95x); int4 (below)
  // measured no difference
  static constexpr int64_t kAhead = 8192;
  static constexpr bool kMinTerms = false;

  const int8_t* block(int n, int64_t b) const { return w + n * K + b * 32; }
  int64_t row_bytes() const { return K; }
  float scale(int n, int64_t g) const { return fp16_to_f32(scales[n * ng + g]); }
#if defined(KS_AVX2)
  static void load(const int8_t* p, __m256i& a, __m256i& b) {
    a = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    b = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16)));
  }
#endif
  static int32_t dot(const int8_t* p, const int16_t* x) {
    int32_t s = 0;
    for (int i = 0; i < 32; ++i) s += int32_t(x[i]) * p[i];
    return s;
  }
};

// sum_i (d q_i + m) x_i with x_i ~ xq_i dx: the integer dots give d dx sum q_i xq_i; this
// adds, per group, m times the exact sum of x and 8 d times (that sum less the sum of the
// quantized x), which makes the error that of the centred d (q_i - 8).
static inline float q4_min_terms(const uint16_t* d, const uint16_t* m, const float* gsum, const float* gerr,
                                 int64_t ng) {
  int64_t g = 0;
  float t = 0.f;
#if defined(KS_AVX2) && defined(__F16C__)
  __m256 acc = _mm256_setzero_ps();
  for (; g + 8 <= ng; g += 8) {
    const __m256 dv = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(d + g)));
    const __m256 mv = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(m + g)));
    acc = _mm256_fmadd_ps(mv, _mm256_loadu_ps(gsum + g), acc);
    acc = _mm256_fmadd_ps(_mm256_mul_ps(dv, _mm256_set1_ps(8.f)), _mm256_loadu_ps(gerr + g), acc);
  }
  t = hsum256(acc);
#endif
  for (; g < ng; ++g) t += fp16_to_f32(m[g]) * gsum[g] + 8.f * fp16_to_f32(d[g]) * gerr[g];
  return t;
}

struct Int4Rows {
  const uint8_t* w;        // [rows, K / 2]
  const uint16_t* scales;  // [rows, K / G]
  const uint16_t* mins;    // [rows, K / G]
  int64_t K, ng;
  static constexpr int64_t kPrefetchMask = 3;  // 16 bytes a block: prefetch every 4th
  static constexpr int64_t kAhead = 2048;
  static constexpr bool kMinTerms = true;

  const uint8_t* block(int n, int64_t b) const { return w + n * (K / 2) + b * 16; }
  int64_t row_bytes() const { return K / 2; }
  float scale(int n, int64_t g) const { return fp16_to_f32(scales[n * ng + g]); }
#if defined(KS_AVX2)
  static void load(const uint8_t* p, __m256i& a, __m256i& b) {
    // 16 bytes widened to 16 bits: the low nibbles are values 0..15, the high ones 16..31
    const __m256i raw = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    a = _mm256_and_si256(raw, _mm256_set1_epi16(0x0F));
    b = _mm256_srli_epi16(raw, 4);
  }
#endif
  static int32_t dot(const uint8_t* p, const int16_t* x) {
    int32_t s = 0;
    for (int i = 0; i < 16; ++i) {
      s += int32_t(p[i] & 0x0F) * x[i];
      s += int32_t(p[i] >> 4) * x[16 + i];
    }
    return s;
  }
  float min_terms(int n, const QuantX& qx, int64_t row) const {
    return q4_min_terms(scales + n * ng, mins + n * ng, qx.gsum.data() + row * ng, qx.gerr.data() + row * ng, ng);
  }
};

// One tile: MR rows of x (from row m0) against NR rows of a quantized W.
template <int MR, int NR, typename Rows>
static void quant_tile(const QuantX& qx, int64_t m0, int64_t K, const Rows& rows, int64_t G, float* y,
                       int64_t ldy, const float* bias) {
  const int64_t nb = K / 32, ng = K / G, bpg = G / 32;
  const int16_t* xq = qx.q.data() + m0 * K;
  const float* dx = qx.d.data() + m0 * nb;
#if defined(KS_AVX2)
  // W's rows stream from memory, once. A row is short (576 bytes of int8 in the default
  // model), so the hardware prefetcher, which follows each row, stops at its end; the
  // next tile's rows (this thread's next work: W's rows lie one after another) are asked
  // for at the same place, into L1, and the tile after into L2. Measured on a pass over
  // the default model's layers (2026-12-05, Xeon, 2 cores, interleaved): int8 1.5x at one
  // row and 1.7x at four against a fixed 512 bytes ahead in the row, int4 1.3x and 1.1x.
  const int64_t ahead = NR * rows.row_bytes();
  __m256 acc[MR][NR];
  for (int m = 0; m < MR; ++m)
    for (int n = 0; n < NR; ++n) acc[m][n] = _mm256_setzero_ps();
  for (int64_t g = 0; g < ng; ++g) {
    float wsc[NR];
    for (int n = 0; n < NR; ++n) wsc[n] = rows.scale(n, g);
    for (int64_t b = g * bpg; b < (g + 1) * bpg; ++b) {
      __m256i wa[NR], wb[NR];
      for (int n = 0; n < NR; ++n) {
        const auto* p = rows.block(n, b);
        if ((b & Rows::kPrefetchMask) == 0) {
          _mm_prefetch(reinterpret_cast<const char*>(p + ahead), _MM_HINT_T0);
          _mm_prefetch(reinterpret_cast<const char*>(p + 2 * ahead), _MM_HINT_T1);
        }
        Rows::load(p, wa[n], wb[n]);
      }
      for (int m = 0; m < MR; ++m) {
        const float d = dx[m * nb + b];
        for (int n = 0; n < NR; ++n) {
          const __m256i dot = dot32(wa[n], wb[n], xq + m * K + b * 32);
          acc[m][n] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(d * wsc[n]), acc[m][n]);
        }
      }
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int n = 0; n < NR; ++n) {
      float s = hsum256(acc[m][n]);
#else
  for (int m = 0; m < MR; ++m)
    for (int n = 0; n < NR; ++n) {
      float s = 0.f;
      for (int64_t b = 0; b < nb; ++b)
        s += float(Rows::dot(rows.block(n, b), xq + m * K + b * 32)) * dx[m * nb + b] * rows.scale(n, b / bpg);
#endif
      if constexpr (Rows::kMinTerms) s += rows.min_terms(n, qx, m0 + m);
      y[m * ldy + n] = s + (bias ? bias[n] : 0.f);
    }
}

#if defined(KS_AVX2)
// Eight blocks' values from their groups' (lane g: group g), groups 1 << shift blocks each.
static inline __m256 group_per_block(__m256 s, int shift) {
  if (shift == 0) return s;
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  return _mm256_permutevar8x32_ps(s, _mm256_srli_epi32(lane, std::min(shift, 3)));
}

// The float16 scales of blocks b0 .. b0 + 7 of a row as float32, b0 a multiple of 8 and
// the row's groups 1 << shift blocks each: eight groups when shift is 0, four when 1, ...
// Reads just the groups the eight blocks lie in (never past the row's last).
static inline __m256 block_scales(const uint16_t* scales, int64_t b0, int shift) {
  const uint16_t* g = scales + (b0 >> shift);
  __m128i h;
  if (shift == 0) {
    h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(g));
  } else if (shift == 1) {
    h = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(g));
  } else if (shift == 2) {
    int32_t two;
    std::memcpy(&two, g, sizeof(two));
    h = _mm_cvtsi32_si128(two);
  } else {
    h = _mm_cvtsi32_si128(g[0]);
  }
  return group_per_block(_mm256_cvtph_ps(h), shift);
}

#if defined(KS_AVX512)
// The same for the first `count` (1-8) of the eight blocks, the rest of a row: reads the
// groups those lie in with a masked load; the lanes past them are the last group's or 0.
static inline __m256 block_scales(const uint16_t* scales, int64_t b0, int64_t count, int shift) {
  if (count == 8) return block_scales(scales, b0, shift);
  const int64_t groups = ((b0 + count - 1) >> shift) - (b0 >> shift) + 1;
  return group_per_block(_mm256_cvtph_ps(_mm_maskz_loadu_epi16(__mmask8(0xFF >> (8 - groups)), scales + (b0 >> shift))),
                         shift);
}
#endif

// One row of W against MR rows of x (from row m0), its blocks read in order.
//
// Why one W row at a time on AVX2, not a tile: the integer dot of a block costs about as
// much time as reading the block from memory, and the two overlap only when each thread's
// W streams as one sequence that the hardware prefetcher follows; a tile reads its NR
// rows side by side, NR short streams that end every row (the software prefetch above
// did not make up for it).
//
// Block by block, each block's integer dot is converted and scaled alone (a conversion,
// a broadcast scale and a multiply-add a block), which int8 (32 bytes a block) hides
// behind its memory reads and int4 (16 bytes) does not: int4 rows go to q4_row. Summing
// eight blocks' dots to eight exact totals first (as q4_row does) measured 0.96-1.02x for
// int8: int8 stays block by block.
//
// The sums depend on the row alone, so a row of x gets the same bits whatever MR it is
// computed in (a verification row's logits are a decode's). kOneGroup: W has one scale a
// row (int8 per channel), applied once at the end; else group g of blocks [g << shift,
// (g + 1) << shift) has its own.

// Block b of a W row widened to two vectors of 16 int16, asking for W Rows::kAhead bytes on.
template <typename Rows>
static inline void read_block(const Rows& rows, int64_t b, __m256i& wa, __m256i& wb) {
  const auto* p = rows.block(0, b);
  if ((b & Rows::kPrefetchMask) == 0) _mm_prefetch(reinterpret_cast<const char*>(p) + Rows::kAhead, _MM_HINT_T0);
  Rows::load(p, wa, wb);
}

// The four vectors of 16 weights in one 256-bit read of two int4 blocks (b, b + 1), the
// four nibbles of each 16-bit word: [b: 0 2 .. 14 | b+1: 0 2 .. 14], [16 18 .. 30 | ...],
// [1 3 .. 15 | ...], [17 19 .. 31 | ...] (kQuadFrom puts x in the same order).
static inline void q4_pair_weights(const uint8_t* w, __m256i (&s)[4]) {
  const __m256i low = _mm256_set1_epi16(0x0F);
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w));
  s[0] = _mm256_and_si256(raw, low);
  s[1] = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low);
  s[2] = _mm256_and_si256(_mm256_srli_epi16(raw, 8), low);
  s[3] = _mm256_srli_epi16(raw, 12);
}

// The dot of a pair of blocks with x in the quad layout: [b: four partial sums | b+1: four].
static inline __m256i q4_pair_dot(const __m256i (&s)[4], const int16_t* x) {
  return _mm256_add_epi32(dot32(s[0], s[1], x), dot32(s[2], s[3], x + 32));
}

// One int4 row of W against MR rows of x (from row m0) in the quad layout (kQuadFrom).
//
// Why not block by block (quant_row): the widening of a block's 16 bytes (vpmovzxbw) and
// the horizontal sums of its dot's eight lanes all ran on the one shuffle port (Intel's
// port 5), and after the blocks, each output added its minimums' terms group by group
// (q4_min_terms) and summed its lanes: rows are short (18 blocks in the default model),
// so that tail cost as much as a third of the blocks. Here one 256-bit read holds two
// blocks, whose 16-bit words give four vectors of weights with masks and shifts alone
// (q4_pair_weights); each 128-bit half of a pair's dot belongs to one block, so three
// hadds per eight blocks leave one exact total a block, lanes [b0 b0+2 b0+4 b0+6 | b0+1
// b0+3 b0+5 b0+7], converted and scaled by the eight blocks' x and W scales in one
// multiply-add; the minimums' terms are added per block in the same pass, from x's
// block sums (QuantX::sum, err) and the blocks' W minimums and scales (block_scales),
// eight at a time. Against the block by block row (2026-12-06, Xeon, AVX2 build,
// interleaved): one thread over a layer in cache 1.14-1.17x (K 576) and 1.08x (K 1536) at one
// row of x; a pass over the default model's int4 layers 1.03x and 1.11x at one row in two
// runs, 1.05x at two (the small model 1.13x; bench/results/quant-kernels-x86-64-v3.md).
// What is left is the multiply-adds themselves: x in int16 takes a vpmaddwd for every 16
// weights, which without VNNI also needs an add.
//
// The sums depend on the row alone, so a row of x gets the same bits whatever MR it is
// computed in. kOneGroup: one scale and minimum for the whole row, applied at the end.
template <int MR, bool kOneGroup>
static void q4_row(const QuantX& qx, int64_t m0, int64_t K, const Int4Rows& rows, int shift, float* y,
                   int64_t ldy, const float* bias) {
  const int64_t nb = K / 32;
  const int16_t* xq = qx.q.data() + m0 * K;
  const float* dx = qx.d.data() + m0 * nb;
  const float* xs = qx.sum.data() + m0 * nb;
  const float* xe = qx.err.data() + m0 * nb;
  const __m256i order = _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7);
  const __m256 eight = _mm256_set1_ps(8.f);
  // per row of x: the scaled dots (lanes as above; after the chunks, the pairs' [b ×4 | b+1 ×4]),
  // and the minimums' terms (lane i: blocks i, i + 8, ...)
  __m256 acc[MR], mins[MR];
  for (int m = 0; m < MR; ++m) acc[m] = mins[m] = _mm256_setzero_ps();
  int64_t b = 0;
  for (; b + 8 <= nb; b += 8) {
    const __m256 wd = kOneGroup ? _mm256_set1_ps(1.f) : block_scales(rows.scales, b, shift);
    const __m256 wm = kOneGroup ? _mm256_setzero_ps() : block_scales(rows.mins, b, shift);
    const __m256 ws = _mm256_permutevar8x32_ps(wd, order);
    __m256i first[MR], four[MR];  // per row of x: pair 0's (or 2's) dot, pairs 0 and 1 summed
#pragma GCC unroll 4
    for (int p = 0; p < 4; ++p) {
      const uint8_t* w = rows.block(0, b + 2 * p);
      if (p % 2 == 0) _mm_prefetch(reinterpret_cast<const char*>(w) + Int4Rows::kAhead, _MM_HINT_T0);
      __m256i s[4];
      q4_pair_weights(w, s);
      for (int m = 0; m < MR; ++m) {
        const __m256i dot = q4_pair_dot(s, xq + m * K + (b + 2 * p) * 32);
        if (p % 2 == 0) {
          first[m] = dot;
          continue;
        }
        const __m256i sum4 = _mm256_hadd_epi32(first[m], dot);  // [b b b+2 b+2 | b+1 b+1 b+3 b+3]
        if (p == 1) {
          four[m] = sum4;
          continue;
        }
        const __m256i total = _mm256_hadd_epi32(four[m], sum4);
        const __m256 xd = _mm256_permutevar8x32_ps(_mm256_loadu_ps(dx + m * nb + b), order);
        acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(total), _mm256_mul_ps(xd, ws), acc[m]);
        if constexpr (!kOneGroup) {
          mins[m] = _mm256_fmadd_ps(wm, _mm256_loadu_ps(xs + m * nb + b), mins[m]);
          mins[m] = _mm256_fmadd_ps(_mm256_mul_ps(wd, eight), _mm256_loadu_ps(xe + m * nb + b), mins[m]);
        }
      }
    }
  }
  // whole pairs left: each dot's halves scaled by their block's scales; the minimums'
  // terms of these blocks in lanes 0 and 1 (written as vector operations, so that a row
  // gets the same bits whatever MR: a compiler free to contract scalar ones differs
  // between the loop over rows it vectorizes and the one it does not)
  __m128 tail[MR];
  for (int m = 0; m < MR; ++m) tail[m] = _mm_setzero_ps();
  auto block_scale = [&](int64_t at) { return kOneGroup ? 1.f : rows.scale(0, at >> shift); };
  auto block_min = [&](int64_t at) { return kOneGroup ? 0.f : fp16_to_f32(rows.mins[at >> shift]); };
  auto add_min_terms = [&](int m, int64_t at, __m128 wm, __m128 wd8, bool two) {
    const float* sp = xs + m * nb + at;
    const float* ep = xe + m * nb + at;
    const __m128 sv = two ? _mm_setr_ps(sp[0], sp[1], 0.f, 0.f) : _mm_set_ss(sp[0]);
    const __m128 ev = two ? _mm_setr_ps(ep[0], ep[1], 0.f, 0.f) : _mm_set_ss(ep[0]);
    tail[m] = _mm_fmadd_ps(wm, sv, _mm_fmadd_ps(wd8, ev, tail[m]));
  };
  for (; b + 2 <= nb; b += 2) {
    __m256i s[4];
    q4_pair_weights(rows.block(0, b), s);
    const float w0 = block_scale(b), w1 = block_scale(b + 1);
    const __m128 wm = _mm_setr_ps(block_min(b), block_min(b + 1), 0.f, 0.f);
    const __m128 wd8 = _mm_setr_ps(8.f * w0, 8.f * w1, 0.f, 0.f);
    for (int m = 0; m < MR; ++m) {
      const __m256i dot = q4_pair_dot(s, xq + m * K + b * 32);
      const __m256 scale = _mm256_set_m128(_mm_set1_ps(dx[m * nb + b + 1] * w1), _mm_set1_ps(dx[m * nb + b] * w0));
      acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), scale, acc[m]);
      if constexpr (!kOneGroup) add_min_terms(m, b, wm, wd8, true);
    }
  }
  if (b < nb) {  // a last odd block, x in order
    __m256i wa, wb;
    Int4Rows::load(rows.block(0, b), wa, wb);
    const float ws = block_scale(b);
    const __m128 wm = _mm_set_ss(block_min(b)), wd8 = _mm_set_ss(8.f * ws);
    for (int m = 0; m < MR; ++m) {
      const __m256i dot = dot32(wa, wb, xq + m * K + b * 32);
      acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(dx[m * nb + b] * ws), acc[m]);
      if constexpr (!kOneGroup) add_min_terms(m, b, wm, wd8, false);
    }
  }
  for (int m = 0; m < MR; ++m) {
    float s = hsum256(acc[m]);
    if constexpr (kOneGroup) {
      s = std::fma(s, rows.scale(0, 0), rows.min_terms(0, qx, m0 + m));
    } else {
      s += hsum256(_mm256_add_ps(mins[m], _mm256_insertf128_ps(_mm256_setzero_ps(), tail[m], 0)));
    }
    y[m * ldy] = s + (bias ? bias[0] : 0.f);
  }
}

template <int MR, bool kOneGroup, typename Rows>
static void quant_row(const QuantX& qx, int64_t m0, int64_t K, const Rows& rows, int shift, float* y,
                      int64_t ldy, const float* bias) {
  if constexpr (std::is_same_v<Rows, Int4Rows>) {
    q4_row<MR, kOneGroup>(qx, m0, K, rows, shift, y, ldy, bias);
    return;
  }
  const int64_t nb = K / 32;
  const int16_t* xq = qx.q.data() + m0 * K;
  const float* dx = qx.d.data() + m0 * nb;
  __m256 one[MR], two[MR];
  for (int m = 0; m < MR; ++m) one[m] = two[m] = _mm256_setzero_ps();
  int64_t b = 0;
  // the blocks one at a time, alternating between two accumulators so that their
  // multiply-adds do not wait on each other (which one depends on the block alone)
  auto add_block = [&](int64_t b, __m256 (&into)[MR]) {
    __m256i wa, wb;
    read_block(rows, b, wa, wb);
    const float ws = kOneGroup ? 1.f : rows.scale(0, b >> shift);
    for (int m = 0; m < MR; ++m) {
      const __m256i dot = dot32(wa, wb, xq + m * K + b * 32);
      into[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(dx[m * nb + b] * ws), into[m]);
    }
  };
  for (; b + 2 <= nb; b += 2) {
    add_block(b, one);
    add_block(b + 1, two);
  }
  if (b < nb) add_block(b, one);
  for (int m = 0; m < MR; ++m) {
    float s = hsum256(_mm256_add_ps(one[m], two[m]));
    if constexpr (kOneGroup) s *= rows.scale(0, 0);
    y[m * ldy] = s + (bias ? bias[0] : 0.f);
  }
}

// log2 of the blocks in a group when that is a power of two, else -1
static int group_shift(int64_t G) {
  const int64_t bpg = G / 32;
  return (bpg & (bpg - 1)) == 0 ? __builtin_ctzll(bpg) : -1;
}
#endif

#if defined(KS_AVX512)
// The dot of a chunk's four int4 blocks (their low nibbles `lo`, values 0-15 of each
// block, and high nibbles `hi`, values 16-31, as bytes) with one row of x in the split
// layout: 16 int32 lanes, four a block (128-bit lane j: block j), each the exact sum of
// eight products w q = w (256 h + l). Without VNNI the byte products go through
// vpmaddubsw, whose 16-bit sums cannot saturate here (at most 4 * 255 * 15 in magnitude),
// and come out the same integers.
static inline __m512i q4_chunk_dot(__m512i lo, __m512i hi, const int8_t* x) {
  const __m512i ha = _mm512_loadu_si512(x), hb = _mm512_loadu_si512(x + 64);
  const __m512i la = _mm512_loadu_si512(x + 128), lb = _mm512_loadu_si512(x + 192);
#if defined(__AVX512VNNI__)
  __m512i t = _mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, ha);
  t = _mm512_slli_epi32(_mm512_dpbusd_epi32(t, hi, hb), 8);
  return _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(t, la, lo), lb, hi);
#else
  const __m512i h = _mm512_add_epi16(_mm512_maddubs_epi16(lo, ha), _mm512_maddubs_epi16(hi, hb));
  const __m512i l = _mm512_add_epi16(_mm512_maddubs_epi16(la, lo), _mm512_maddubs_epi16(lb, hi));
  return _mm512_add_epi32(_mm512_madd_epi16(h, _mm512_set1_epi16(256)), _mm512_madd_epi16(l, _mm512_set1_epi16(1)));
#endif
}

// The sums of two rows' 16 lanes, each in the same order whatever the other row is:
// lanes j and j + 8, then adjacent pairs, pairs of those, and the two halves.
static inline void reduce_two(__m512 a, __m512 b, float& sa, float& sb) {
  auto half = [](__m512 v) {
    return _mm256_add_ps(_mm512_castps512_ps256(v),
                         _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
  };
  const __m256 h = _mm256_hadd_ps(half(a), half(b));  // [a01 a23 b01 b23 | a45 a67 b45 b67]
  const __m128 q = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
  const __m128 t = _mm_hadd_ps(q, q);  // [a, b, a, b]
  sa = _mm_cvtss_f32(t);
  sb = _mm_cvtss_f32(_mm_shuffle_ps(t, t, 1));
}

// NR (1 or 2) int4 rows of W against MR rows of x (from row m0) in 512-bit vectors, four
// blocks (a chunk, 64 packed bytes) at a time: the bytes masked give the four blocks'
// values 0-15, shifted and masked their values 16-31, and x in the split layout
// (kSplitChunk) multiplies them as bytes (q4_chunk_dot): 16 lanes, four a block, which
// are converted and scaled (each 128-bit lane by its block's x and W scales) into one
// float accumulator. The minimums' terms (q4_min_terms) are summed eight blocks at a
// time beside them, and a row's lanes are summed once, at its end, two rows in one tree
// (reduce_two). Two W rows at a time (one after the other in memory, so still one
// stream) give each step two independent chains and halve the horizontal sums. A last
// chunk of fewer than four blocks is read with a byte mask (x is zero there). A row's
// bits depend on the row alone, whatever MR, NR or its partner.
//
// Why bytes, not x in int16 as the other integer kernels take it: widening the packed
// weights to int16 (vpmovzxbw, a shuffle across the register's halves) and two int16
// products a lane made the int4 kernel bound by its arithmetic on AMD Zen 4, which runs
// a 512-bit instruction as two 256-bit halves (2026-12-07, EPYC, AVX-512 VNNI, 2 cores: a
// pass over the default model's int4 layers at one row ran at 18 GB/s of weights, the
// int8 kernel at 31, copy 45-54). Here a chunk of 128 weights costs three mask and shift
// instructions and four byte dot products (with a shift) a row of x, where the paired
// int16 layout this replaced took two widenings, two masks, two shifts, four int16 dot
// products and twice the conversions and scalings. The integer sums are the same exact
// values; only which lanes they fall in, and so the float rounding, changed. With the
// lambdas below inlined (KS_INLINE: out of line, they kept the accumulators in memory)
// and the rest of a row in vectors (the last chunk masked, its minimums' terms with the
// others): a pass over the default model's int4 layers against the kernel before, side
// by side (bench/results/quant-kernels-amd-avx512.md, 2026-12-07, EPYC Zen 4, 2 cores):
// 1.12x at one row of x, 1.31x at two, 1.26x at four, 1.22x at eight (the unchanged int8
// kernel read 0.98-1.23x in the same run: this machine's noise). Not measured on Intel.
template <int MR, int NR, bool kOneGroup>
static void q4_rows512(const QuantX& qx, int64_t m0, int64_t K, const Int4Rows (&rows)[NR], int shift,
                       float* const (&y)[NR], int64_t ldy, const float* const (&bias)[NR]) {
  const int64_t nb = K / 32, chunks = (nb + 3) / 4;
  const int8_t* xs8 = qx.split.data() + m0 * chunks * kSplitChunk;
  const float* dx = qx.d.data() + m0 * nb;
  const float* xsum = qx.sum.data() + m0 * nb;
  const float* xerr = qx.err.data() + m0 * nb;
  const __m512i low = _mm512_set1_epi8(0x0F);
  __m512 acc[NR][MR];
  __m256 mins[NR][MR];  // per block of x: m times its exact sum, 8 d times that less the quantized sum's
  for (int r = 0; r < NR; ++r)
    for (int m = 0; m < MR; ++m) {
      acc[r][m] = _mm512_setzero_ps();
      mins[r][m] = _mm256_setzero_ps();
    }
  // the chunk of blocks b .. b + 3 of row r (`count` of them, 1-4) against every row of
  // x; scale(m): its 16 lanes' scales
  auto add_chunk = [&](int r, int64_t b, int64_t count, auto scale) KS_INLINE {
    const uint8_t* w = rows[r].block(0, b);
    _mm_prefetch(reinterpret_cast<const char*>(w) + Int4Rows::kAhead, _MM_HINT_T0);
    const __m512i raw = count == 4 ? _mm512_loadu_si512(w)
                                   : _mm512_maskz_loadu_epi8(~0ULL >> (64 - 16 * count), w);
    const __m512i lo = _mm512_and_si512(raw, low), hi = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low);
    for (int m = 0; m < MR; ++m) {
      const __m512i dot = q4_chunk_dot(lo, hi, xs8 + (m * chunks + b / 4) * kSplitChunk);
      acc[r][m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), scale(m), acc[r][m]);
    }
  };
  // eight blocks at a time (the last time `count`, 1-8, the rest of the row): their scales
  // computed once (x's times W's), each chunk's sixteen picked from them by one permute;
  // past the row's end the masked loads read zeros
  const __m512i first4 = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
  const __m512i last4 = _mm512_add_epi32(first4, _mm512_set1_epi32(4));
  auto add_eight = [&](int64_t b, int64_t count) KS_INLINE {
    const __mmask8 in = __mmask8(0xFF >> (8 - count));
    auto blocks = [&](const float* v) { return count == 8 ? _mm256_loadu_ps(v) : _mm256_maskz_loadu_ps(in, v); };
    __m512 s8[NR][MR];
    for (int r = 0; r < NR; ++r) {
      const __m256 ws = kOneGroup ? _mm256_set1_ps(1.f) : block_scales(rows[r].scales, b, count, shift);
      for (int m = 0; m < MR; ++m) s8[r][m] = _mm512_castps256_ps512(_mm256_mul_ps(blocks(dx + m * nb + b), ws));
      if constexpr (!kOneGroup) {
        const __m256 wm = block_scales(rows[r].mins, b, count, shift), d8 = _mm256_mul_ps(ws, _mm256_set1_ps(8.f));
        for (int m = 0; m < MR; ++m) {
          mins[r][m] = _mm256_fmadd_ps(wm, blocks(xsum + m * nb + b), mins[r][m]);
          mins[r][m] = _mm256_fmadd_ps(d8, blocks(xerr + m * nb + b), mins[r][m]);
        }
      }
    }
    for (int r = 0; r < NR; ++r) {
      add_chunk(r, b, std::min<int64_t>(count, 4), [&](int m) { return _mm512_permutexvar_ps(first4, s8[r][m]); });
      if (count > 4) add_chunk(r, b + 4, count - 4, [&](int m) { return _mm512_permutexvar_ps(last4, s8[r][m]); });
    }
  };
  int64_t b = 0;
  for (; b + 8 <= nb; b += 8) add_eight(b, 8);
  if (b < nb) add_eight(b, nb - b);
  float sums[NR][MR];
  for (int m = 0; m < MR; ++m) {
    __m512 v[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};
    for (int r = 0; r < NR; ++r)
      v[r] = kOneGroup ? acc[r][m] : _mm512_add_ps(acc[r][m], _mm512_zextps256_ps512(mins[r][m]));
    float unused;
    reduce_two(v[0], v[1], sums[0][m], NR == 2 ? sums[NR - 1][m] : unused);
  }
  for (int r = 0; r < NR; ++r) {
    const Int4Rows& row = rows[r];
    for (int m = 0; m < MR; ++m) {
      float s = sums[r][m];
      if constexpr (kOneGroup) s = std::fma(s, row.scale(0, 0), row.min_terms(0, qx, m0 + m));
      y[r][m * ldy] = s + (bias[r] ? *bias[r] : 0.f);
    }
  }
}
#endif

#if defined(KS_AVX512)
// Rows m and m + 1 of x (m alone when it is the last) against NR rows of W. Two rows of x
// at most: four by two W rows keep 16 vectors of accumulators and scales live, more than
// the registers hold (it ran slower than the kernel before); four rows of x by one W row
// timed the same as two by two within the noise (a pass over the default model's int4
// layers at four and eight rows of x, 2026-12-07, EPYC Zen 4, 2 cores).
template <int NR>
static int64_t q4_step512(const QuantX& qx, int64_t m, int64_t M, int64_t K, const Int4Rows (&rows)[NR], int shift,
                          bool one_group, float* const (&y)[NR], int64_t ldy, const float* const (&bias)[NR]) {
  if (M - m >= 2) {
    one_group ? q4_rows512<2, NR, true>(qx, m, K, rows, shift, y, ldy, bias)
              : q4_rows512<2, NR, false>(qx, m, K, rows, shift, y, ldy, bias);
    return 2;
  }
  one_group ? q4_rows512<1, NR, true>(qx, m, K, rows, shift, y, ldy, bias)
            : q4_rows512<1, NR, false>(qx, m, K, rows, shift, y, ldy, bias);
  return 1;
}

// The int4 GEMM on AVX-512: W's rows in chunks (parallel_chunks), two at a time
// (q4_rows512), an odd last row (W's, the chunks being even) alone.
template <typename RowsAt>
static void q4_gemm512(const QuantX& qx, int64_t M, int64_t N, int64_t K, RowsAt rows, int shift, bool one_group,
                       float* yp, const float* b) {
  parallel_chunks(N, kRowChunk, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; n += 2)
      for (int64_t m = 0; m < M;) {
        if (n + 1 < n1) {
          const Int4Rows two[2] = {rows(n), rows(n + 1)};
          float* const out[2] = {yp + m * N + n, yp + m * N + n + 1};
          const float* const bias[2] = {b ? b + n : nullptr, b ? b + n + 1 : nullptr};
          m += q4_step512<2>(qx, m, M, K, two, shift, one_group, out, N, bias);
        } else {
          const Int4Rows one[1] = {rows(n)};
          float* const out[1] = {yp + m * N + n};
          const float* const bias[1] = {b ? b + n : nullptr};
          m += q4_step512<1>(qx, m, M, K, one, shift, one_group, out, N, bias);
        }
      }
  });
}
#endif

// y = x W^T (+ bias) over W's rows: `rows(n)` reads W from its row n.
template <typename RowsAt>
static void quant_gemm(int64_t M, int64_t K, int64_t N, int64_t G, const float* b, const QuantX& qx, RowsAt rows,
                       float* yp) {
#if defined(KS_AVX2)
  const bool one_group = G == K;
  const int shift = group_shift(G);
  if (one_group || shift >= 0) {
#if defined(KS_AVX512)
    if constexpr (std::is_same_v<decltype(rows(0)), Int4Rows>) {
      q4_gemm512(qx, M, N, K, rows, shift, one_group, yp, b);
      return;
    }
#endif
    parallel_chunks(N, kRowChunk, [&](int64_t n0, int64_t n1) {
      for (int64_t n = n0; n < n1; ++n)
        for (int64_t m = 0; m < M;) {
          const int64_t left = M - m;
          float* out = yp + m * N + n;
          const float* bn = b ? b + n : nullptr;
#define KS_ROW(mr)                                                                   \
  (one_group ? quant_row<mr, true>(qx, m, K, rows(n), shift, out, N, bn)             \
             : quant_row<mr, false>(qx, m, K, rows(n), shift, out, N, bn)), m += mr
          if (left >= 4) {
            KS_ROW(4);
          } else if (left == 3) {
            KS_ROW(3);
          } else if (left == 2) {
            KS_ROW(2);
          } else {
            KS_ROW(1);
          }
#undef KS_ROW
        }
    });
    return;
  }
#endif
  constexpr int64_t NR = 4;
  at::parallel_for(0, (N + NR - 1) / NR, 16, [&](int64_t t0, int64_t t1) {
    const int64_t n0 = t0 * NR, n1 = std::min(N, t1 * NR);
#define KS_CALL(mr, nr) quant_tile<mr, nr>(qx, m, K, rows(n), G, yp + m * N + n, N, b ? b + n : nullptr)
    KS_FOR_TILES(NR, 2, KS_CALL)
#undef KS_CALL
  });
}

void gemm_q8_into(const float* x, int64_t M, int64_t K, const int8_t* w, const uint16_t* scales, int64_t N,
                  int64_t G, const float* b, float* y) {
  QuantX& qx = scratch_x();
  quantize_x(qx, x, M, K);
  const int64_t ng = K / G;
  quant_gemm(M, K, N, G, b, qx, [&](int64_t n) { return Int8Rows{w + n * K, scales + n * ng, K, ng}; }, y);
}

at::Tensor gemm_q8(at::Tensor x, at::Tensor w, at::Tensor scales, int64_t G,
                      c10::optional<at::Tensor> bias) {
  check_2d(x, "gemm_q8 x", at::kFloat);
  check_2d(w, "gemm_q8 weight", at::kChar);
  check_2d(scales, "gemm_q8 scales", at::kHalf);
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  TORCH_CHECK(w.size(1) == K && scales.size(0) == N, "gemm_q8: shapes do not match");
  check_groups(K, G, scales.size(1), "gemm_q8");
  const float* b = bias_ptr(bias, N, "gemm_q8");
  auto y = at::empty({M, N}, x.options());
  gemm_q8_into(x.data_ptr<float>(), M, K, w.data_ptr<int8_t>(),
               reinterpret_cast<const uint16_t*>(scales.data_ptr<at::Half>()), N, G, b, y.data_ptr<float>());
  return y;
}

void gemm_q4_into(const float* x, int64_t M, int64_t K, const uint8_t* w, const uint16_t* scales,
                  const uint16_t* mins, int64_t N, int64_t G, const float* b, float* y) {
#if defined(KS_AVX512)
  const bool split = G == K || group_shift(G) >= 0;  // q4_rows512 serves (quant_gemm)
  const XLayout layout = split ? XLayout::kSplit : XLayout::kInOrder;
#elif defined(KS_AVX2)
  // q4_row serves; else quant_tile, which reads x in order
  const XLayout layout = G == K || group_shift(G) >= 0 ? XLayout::kQuad : XLayout::kInOrder;
#else
  const XLayout layout = XLayout::kInOrder;
#endif
  QuantX& qx = scratch_x();
  quantize_x(qx, x, M, K, layout);
  // the per-group sums: quant_tile's minimums, and one-group weights' (q4_rows512 and
  // q4_row take the others per block)
  if (layout == XLayout::kInOrder || G == K) qx.group(M, K, G);
  const int64_t ng = K / G;
  quant_gemm(M, K, N, G, b, qx,
             [&](int64_t n) { return Int4Rows{w + n * (K / 2), scales + n * ng, mins + n * ng, K, ng}; }, y);
}

at::Tensor gemm_q4(at::Tensor x, at::Tensor w, at::Tensor scales, at::Tensor mins, int64_t G,
                      c10::optional<at::Tensor> bias) {
  check_2d(x, "gemm_q4 x", at::kFloat);
  check_2d(w, "gemm_q4 weight", at::kByte);
  check_2d(scales, "gemm_q4 scales", at::kHalf);
  check_2d(mins, "gemm_q4 minimums", at::kHalf);
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  TORCH_CHECK(w.size(1) * 2 == K && scales.size(0) == N && mins.sizes() == scales.sizes(),
              "gemm_q4: shapes do not match");
  check_groups(K, G, scales.size(1), "gemm_q4");
  const float* b = bias_ptr(bias, N, "gemm_q4");
  auto y = at::empty({M, N}, x.options());
  gemm_q4_into(x.data_ptr<float>(), M, K, w.data_ptr<uint8_t>(),
               reinterpret_cast<const uint16_t*>(scales.data_ptr<at::Half>()),
               reinterpret_cast<const uint16_t*>(mins.data_ptr<at::Half>()), N, G, b, y.data_ptr<float>());
  return y;
}

// -------------------------------------------------------------------- dequantization
// Rows `ids` of a quantized matrix as float32 [len(ids), K]: the embedding lookup of a
// quantized (tied) table, and whole matrices for prefill-sized GEMMs. Computed as GGUF's
// reference does (d * q, then + m, each rounded: no fused multiply-add), so a dequantized
// table equals the one a GGUF conversion writes, bit for bit.
#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")
at::Tensor dequant_rows(at::Tensor w, at::Tensor scales, c10::optional<at::Tensor> mins, int64_t G,
                           at::Tensor ids) {
  TORCH_CHECK(ids.scalar_type() == at::kLong && ids.dim() == 1 && ids.is_contiguous(),
              "dequant_rows: ids must be a contiguous int64 vector");
  check_2d(scales, "dequant_rows scales", at::kHalf);
  const bool q4 = w.scalar_type() == at::kByte;
  TORCH_CHECK(q4 || w.scalar_type() == at::kChar, "dequant_rows: int8 or packed uint8 weights");
  TORCH_CHECK(!q4 || (mins && mins->defined()), "dequant_rows: packed int4 needs its minimums");
  const int64_t N = w.size(0), K = q4 ? w.size(1) * 2 : w.size(1), R = ids.size(0), ng = K / G;
  check_groups(K, G, scales.size(1), "dequant_rows");
  auto out = at::empty({R, K}, at::TensorOptions().dtype(at::kFloat));
  const int64_t* idp = ids.data_ptr<int64_t>();
  const uint16_t* sp = reinterpret_cast<const uint16_t*>(scales.data_ptr<at::Half>());
  const uint16_t* mp = q4 ? reinterpret_cast<const uint16_t*>(mins->data_ptr<at::Half>()) : nullptr;
  float* op = out.data_ptr<float>();
  for (int64_t r = 0; r < R; ++r) TORCH_CHECK(idp[r] >= 0 && idp[r] < N, "dequant_rows: row ", idp[r], " out of range");
  at::parallel_for(0, R, 64, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t n = idp[r];
      float* o = op + r * K;
      for (int64_t g = 0; g < ng; ++g) {
        const float d = fp16_to_f32(sp[n * ng + g]);
        if (q4) {
          const float mn = fp16_to_f32(mp[n * ng + g]);
          const uint8_t* p = w.data_ptr<uint8_t>() + n * (K / 2) + g * (G / 2);
          for (int64_t b = 0; b < G / 32; ++b)
            for (int i = 0; i < 16; ++i) {
              o[g * G + b * 32 + i] = d * float(p[b * 16 + i] & 0x0F) + mn;
              o[g * G + b * 32 + 16 + i] = d * float(p[b * 16 + i] >> 4) + mn;
            }
        } else {
          const int8_t* p = w.data_ptr<int8_t>() + n * K + g * G;
          for (int64_t i = 0; i < G; ++i) o[g * G + i] = d * float(p[i]);
        }
      }
    }
  });
  return out;
}
#pragma GCC pop_options

}  // namespace ks
