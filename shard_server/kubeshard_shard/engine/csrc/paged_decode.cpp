// Decode attention over the paged KV cache (kernels.py says why it exists), for caches of
// float32, bfloat16, float16 or int8 with one float scale per (token, head) -- the
// compressed cache of --kv-cache-dtype int8.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>
#ifdef __AVX512F__
#include <immintrin.h>
#endif

#include "simd.h"

// Sixteen floats; GCC lowers the arithmetic to AVX-512, to pairs of AVX2 registers, or to
// SSE, whichever -march=native offers, so one source serves every x86 (and ARM) CPU.
typedef float f32x16 __attribute__((vector_size(64)));
typedef uint16_t u16x16 __attribute__((vector_size(32)));
typedef uint32_t u32x16 __attribute__((vector_size(64)));
typedef int8_t i8x16 __attribute__((vector_size(16)));
typedef _Float16 f16x16 __attribute__((vector_size(32)));

// The cache's element types, each read as 16 floats at a time (and written back by the
// decode output, which has the query's type).
struct BF16 { uint16_t bits; };
struct F16 { uint16_t bits; };

static inline f32x16 load16(const float* p) { f32x16 v; std::memcpy(&v, p, sizeof(v)); return v; }
static inline f32x16 load16(const BF16* p) {
  u16x16 h;
  std::memcpy(&h, p, sizeof(h));
  const u32x16 w = __builtin_convertvector(h, u32x16) << 16;
  f32x16 v;
  std::memcpy(&v, &w, sizeof(v));
  return v;
}
static inline f32x16 load16(const F16* p) {
  f16x16 h;
  std::memcpy(&h, p, sizeof(h));
  return __builtin_convertvector(h, f32x16);
}
static inline f32x16 load16(const int8_t* p) {
  i8x16 q;
  std::memcpy(&q, p, sizeof(q));
  return __builtin_convertvector(q, f32x16);
}
static inline void store16(float* p, f32x16 v) { std::memcpy(p, &v, sizeof(v)); }
static inline void store16(BF16* p, f32x16 v) {
  for (int i = 0; i < 16; ++i) p[i].bits = ks::f32_to_bf16(v[i]);
}
static inline void store16(F16* p, f32x16 v) {
  const f16x16 h = __builtin_convertvector(v, f16x16);
  std::memcpy(p, &h, sizeof(h));
}
static inline float hsum16(f32x16 v) {
#ifdef __AVX512F__
  return _mm512_reduce_add_ps(reinterpret_cast<__m512>(v));
#else
  float s = 0.f;
  for (int i = 0; i < 16; ++i) s += v[i];
  return s;
#endif
}

static void softmax_rows(float* s, int64_t rows, int64_t L) {
  for (int64_t r = 0; r < rows; ++r) {
    float* sg = s + r * L;
    float m = -std::numeric_limits<float>::infinity();
    for (int64_t t = 0; t < L; ++t) m = std::max(m, sg[t]);
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
    for (int64_t t = 0; t < L; ++t) {
      sg[t] = ks::exp_f32(sg[t] - m);
      sum += sg[t];
    }
    const float inv = 1.f / sum;
#pragma omp simd
    for (int64_t t = 0; t < L; ++t) sg[t] *= inv;
  }
}

template <typename Q, typename KV>
struct Args {
  const Q* q;
  const KV *k, *v;
  const float *k_scale, *v_scale;  // int8 caches: [slots, Hkv]; otherwise null
  Q* out;
  const int32_t *tables, *lens;
  int64_t Hq, Hkv, G, max_blocks, row, block_size;
  float scale;
};

// One (sequence, KV head) pair: the G query heads that share the head's K/V rows.
// C = head_dim / 16 is a compile-time constant so a K row and the V accumulators stay
// in registers: K is read once for all G heads; V once per pair of heads, from L2.
// An int8 row is read as integers and its scale applied once per row: to the score for
// K, to the softmax weight for V.
template <int C, typename Q, typename KV>
static void decode_head(const Args<Q, KV>& a, int64_t b, int64_t h, std::vector<float>& scores, float* qs) {
  constexpr int64_t D = 16 * C;
  constexpr int kLine = 64 / (16 * sizeof(KV)) > 0 ? 64 / (16 * sizeof(KV)) : 1;  // 16-value chunks per cache line
  const int64_t G = a.G, L = a.lens[b], bs = a.block_size;
  const int32_t* table = a.tables + b * a.max_blocks;
  const Q* qh = a.q + (b * a.Hq + h * G) * D;
  for (int64_t g = 0; g < G; ++g)
    for (int c = 0; c < C; ++c) store16(qs + g * D + 16 * c, load16(qh + g * D + 16 * c) * a.scale);
  scores.resize(G * L);
  float* sc = scores.data();
  const int64_t head_off = h * D;
  const int64_t srow = a.Hkv;  // scales per slot

  for (int64_t t0 = 0; t0 < L; t0 += bs) {
    const int64_t n = std::min<int64_t>(bs, L - t0);
    const int64_t slot0 = static_cast<int64_t>(table[t0 / bs]) * bs;
    const KV* kb = a.k + slot0 * a.row + head_off;
    // The next block sits anywhere in the pool, where the hardware prefetcher cannot
    // guess it: ask for it while this one computes (after the last K block, the first V).
    const KV* kn = t0 + bs < L ? a.k + static_cast<int64_t>(table[t0 / bs + 1]) * bs * a.row + head_off
                               : a.v + static_cast<int64_t>(table[0]) * bs * a.row + head_off;
    for (int64_t j = 0; j < n; ++j) {
      const KV* kt = kb + j * a.row;
      for (int c = 0; c < C; c += kLine)
        __builtin_prefetch(kn + j * a.row + 16 * c);
      f32x16 k[C];
      for (int c = 0; c < C; ++c) k[c] = load16(kt + 16 * c);
      const float ks = a.k_scale ? a.k_scale[(slot0 + j) * srow + h] : 1.f;
      for (int64_t g = 0; g < G; ++g) {
        const float* qg = qs + g * D;
        f32x16 acc0 = load16(qg) * k[0];
        f32x16 acc1 = {};
        for (int c = 1; c < C; ++c) {
          if (c & 1) acc1 += load16(qg + 16 * c) * k[c];
          else acc0 += load16(qg + 16 * c) * k[c];
        }
        sc[g * L + t0 + j] = hsum16(acc0 + acc1) * ks;
      }
    }
  }
  softmax_rows(sc, G, L);

  Q* out = a.out + (b * a.Hq + h * G) * D;
  for (int64_t g = 0; g < G; g += 2) {
    const bool pair = g + 1 < G;
    const float* p0 = sc + g * L;
    const float* p1 = pair ? sc + (g + 1) * L : p0;
    f32x16 acc0[C] = {}, acc1[C] = {};
    for (int64_t t0 = 0; t0 < L; t0 += bs) {
      const int64_t n = std::min<int64_t>(bs, L - t0);
      const int64_t slot0 = static_cast<int64_t>(table[t0 / bs]) * bs;
      const KV* vb = a.v + slot0 * a.row + head_off;
      const KV* vn = t0 + bs < L ? a.v + static_cast<int64_t>(table[t0 / bs + 1]) * bs * a.row + head_off : nullptr;
      for (int64_t j = 0; j < n; ++j) {
        const KV* vt = vb + j * a.row;
        if (vn)
          for (int c = 0; c < C; c += kLine)
            __builtin_prefetch(vn + j * a.row + 16 * c);
        const float vs = a.v_scale ? a.v_scale[(slot0 + j) * srow + h] : 1.f;
        const float w0 = p0[t0 + j] * vs, w1 = p1[t0 + j] * vs;
        for (int c = 0; c < C; ++c) {
          const f32x16 x = load16(vt + 16 * c);
          acc0[c] += w0 * x;
          acc1[c] += w1 * x;
        }
      }
    }
    for (int c = 0; c < C; ++c) store16(out + g * D + 16 * c, acc0[c]);
    if (pair)
      for (int c = 0; c < C; ++c) store16(out + (g + 1) * D + 16 * c, acc1[c]);
  }
}

template <int C, typename Q, typename KV>
static void decode_all(const Args<Q, KV>& a, int64_t B) {
  at::parallel_for(0, B * a.Hkv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores, qs(a.G * 16 * C);
    for (int64_t i = begin; i < end; ++i) decode_head<C>(a, i / a.Hkv, i % a.Hkv, scores, qs.data());
  });
}

template <typename Q, typename KV>
static void dispatch(const Args<Q, KV>& a, int64_t B, int64_t D) {
  switch (D / 16) {
#define KUBESHARD_CASE(C) case C: decode_all<C>(a, B); break;
    KUBESHARD_CASE(1) KUBESHARD_CASE(2) KUBESHARD_CASE(3) KUBESHARD_CASE(4)
    KUBESHARD_CASE(5) KUBESHARD_CASE(6) KUBESHARD_CASE(7) KUBESHARD_CASE(8)
    KUBESHARD_CASE(9) KUBESHARD_CASE(10) KUBESHARD_CASE(11) KUBESHARD_CASE(12)
    KUBESHARD_CASE(13) KUBESHARD_CASE(14) KUBESHARD_CASE(15) KUBESHARD_CASE(16)
#undef KUBESHARD_CASE
  }
}

template <typename Q, typename KV>
static void run(at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                const float* ks, const float* vs, const at::Tensor& block_tables, const at::Tensor& context_lens,
                int64_t block_size, double scale) {
  const int64_t B = q.size(0), Hq = q.size(1), D = q.size(2), Hkv = k_cache.size(1);
  Args<Q, KV> a{reinterpret_cast<const Q*>(q.data_ptr()), reinterpret_cast<const KV*>(k_cache.data_ptr()),
                reinterpret_cast<const KV*>(v_cache.data_ptr()), ks, vs, reinterpret_cast<Q*>(out.data_ptr()),
                block_tables.data_ptr<int32_t>(), context_lens.data_ptr<int32_t>(), Hq, Hkv, Hq / Hkv,
                block_tables.size(1), Hkv * D, block_size, static_cast<float>(scale)};
  dispatch(a, B, D);
}

// out, q: [B, Hq, D]; k_cache, v_cache: [slots, Hkv, D] (slot = block * block_size + offset);
// block_tables: [B, max_blocks] int32; context_lens: [B] int32 (tokens to attend, new one included);
// for an int8 cache, k_scale / v_scale: [slots, Hkv] float32 (a row is q * scale).
// D must be a multiple of 16, at most 256 (``supports`` tells the Python side). q and out
// are float32, bfloat16 or float16; the cache is q's type, or int8 under float32 queries.
void paged_decode_scaled(at::Tensor out, at::Tensor q, at::Tensor k_cache, at::Tensor v_cache,
                         c10::optional<at::Tensor> k_scale, c10::optional<at::Tensor> v_scale,
                         at::Tensor block_tables, at::Tensor context_lens, int64_t block_size, double scale) {
  TORCH_CHECK(q.is_contiguous() && out.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous(),
              "paged_decode: contiguous tensors required");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && context_lens.scalar_type() == at::kInt &&
              block_tables.is_contiguous() && context_lens.is_contiguous(),
              "paged_decode: contiguous int32 block tables and lengths required");
  const int64_t D = q.size(2), Hq = q.size(1), Hkv = k_cache.size(1);
  TORCH_CHECK(D % 16 == 0 && D <= 256 && k_cache.size(2) == D, "paged_decode: head_dim must be a multiple of 16, "
              "at most 256, got ", D);
  TORCH_CHECK(Hkv > 0 && Hq % Hkv == 0, "paged_decode: query heads (", Hq, ") not a multiple of KV heads (", Hkv, ")");
  TORCH_CHECK(out.scalar_type() == q.scalar_type() && v_cache.scalar_type() == k_cache.scalar_type(),
              "paged_decode: out must have q's type, V the type of K");
  const auto qt = q.scalar_type(), ct = k_cache.scalar_type();
  if (ct == at::kChar) {
    TORCH_CHECK(qt == at::kFloat, "paged_decode: an int8 cache takes float32 queries");
    TORCH_CHECK(k_scale && v_scale && k_scale->scalar_type() == at::kFloat && v_scale->scalar_type() == at::kFloat &&
                k_scale->is_contiguous() && v_scale->is_contiguous() && k_scale->size(0) == k_cache.size(0) &&
                k_scale->size(1) == Hkv,
                "paged_decode: an int8 cache needs contiguous float32 scales [slots, kv heads]");
    run<float, int8_t>(out, q, k_cache, v_cache, k_scale->data_ptr<float>(), v_scale->data_ptr<float>(),
                       block_tables, context_lens, block_size, scale);
    return;
  }
  TORCH_CHECK(ct == qt || qt == at::kFloat, "paged_decode: the cache must have the queries' type, or float32 "
              "queries read a bfloat16, float16 or int8 cache");
  if (qt == at::kFloat && ct == at::kFloat)
    run<float, float>(out, q, k_cache, v_cache, nullptr, nullptr, block_tables, context_lens, block_size, scale);
  else if (qt == at::kFloat && ct == at::kBFloat16)
    run<float, BF16>(out, q, k_cache, v_cache, nullptr, nullptr, block_tables, context_lens, block_size, scale);
  else if (qt == at::kFloat && ct == at::kHalf)
    run<float, F16>(out, q, k_cache, v_cache, nullptr, nullptr, block_tables, context_lens, block_size, scale);
  else if (qt == at::kBFloat16)
    run<BF16, BF16>(out, q, k_cache, v_cache, nullptr, nullptr, block_tables, context_lens, block_size, scale);
  else if (qt == at::kHalf)
    run<F16, F16>(out, q, k_cache, v_cache, nullptr, nullptr, block_tables, context_lens, block_size, scale);
  else
    TORCH_CHECK(false, "paged_decode: float32, bfloat16, float16 or int8 caches only");
}

void paged_decode(at::Tensor out, at::Tensor q, at::Tensor k_cache, at::Tensor v_cache,
                  at::Tensor block_tables, at::Tensor context_lens, int64_t block_size, double scale) {
  paged_decode_scaled(out, q, k_cache, v_cache, c10::nullopt, c10::nullopt, block_tables, context_lens, block_size,
                      scale);
}
