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

#include "kernels.h"
#include "simd.h"

// kW floats, the CPU's vector width: 16 with AVX-512, 8 otherwise. GCC lowers the
// arithmetic to AVX-512, AVX2 or SSE registers (or ARM's), so one source serves every CPU.
// Why not 16 everywhere: without AVX-512 GCC emulates a 64-byte vector through the stack
// (its halves stored and reloaded around every operation), which made this kernel about
// 5x slower on an AVX2 CPU than its arithmetic needs.
#ifdef __AVX512F__
constexpr int kW = 16;
#else
constexpr int kW = 8;
#endif
typedef float fvec __attribute__((vector_size(kW * 4)));
typedef uint16_t u16vec __attribute__((vector_size(kW * 2)));
typedef uint32_t u32vec __attribute__((vector_size(kW * 4)));
typedef int8_t i8vec __attribute__((vector_size(kW)));
typedef _Float16 f16vec __attribute__((vector_size(kW * 2)));

// The cache's element types, each read as kW floats at a time (and written back by the
// decode output, which has the query's type).
struct BF16 { uint16_t bits; };
struct F16 { uint16_t bits; };

static inline fvec loadv(const float* p) { fvec v; std::memcpy(&v, p, sizeof(v)); return v; }
static inline fvec loadv(const BF16* p) {
  u16vec h;
  std::memcpy(&h, p, sizeof(h));
  const u32vec w = __builtin_convertvector(h, u32vec) << 16;
  fvec v;
  std::memcpy(&v, &w, sizeof(v));
  return v;
}
static inline fvec loadv(const F16* p) {
  f16vec h;
  std::memcpy(&h, p, sizeof(h));
  return __builtin_convertvector(h, fvec);
}
static inline fvec loadv(const int8_t* p) {
  i8vec q;
  std::memcpy(&q, p, sizeof(q));
  return __builtin_convertvector(q, fvec);
}
static inline void storev(float* p, fvec v) { std::memcpy(p, &v, sizeof(v)); }
static inline void storev(BF16* p, fvec v) {
  for (int i = 0; i < kW; ++i) p[i].bits = ks::f32_to_bf16(v[i]);
}
static inline void storev(F16* p, fvec v) {
  const f16vec h = __builtin_convertvector(v, f16vec);
  std::memcpy(p, &h, sizeof(h));
}
static inline float hsumv(fvec v) {
#ifdef __AVX512F__
  return _mm512_reduce_add_ps(reinterpret_cast<__m512>(v));
#elif defined(KS_AVX2)
  return ks::hsum256(reinterpret_cast<__m256>(v));
#else
  float s = 0.f;
  for (int i = 0; i < kW; ++i) s += v[i];
  return s;
#endif
}

// Each row of s [rows, L] made its softmax; its maximum and its sum of exponentials
// (before the division) go to m[r] and sum[r].
static void softmax_rows(float* s, int64_t rows, int64_t L, float* m_out, float* sum_out) {
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
    m_out[r] = m;
    sum_out[r] = sum;
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
  int64_t q_row;  // values from one sequence's queries to the next's (Hq * D when contiguous)
};

// One (sequence, KV head) pair over the tokens lo..hi of its context (lo a multiple of the
// block size): the G query heads that share the head's K/V rows, their attention over
// those tokens alone written to out (G rows of D), each row's score maximum and sum of
// exponentials to m and sum (what combine_splits needs when the context was split).
// C = head_dim / kW is a compile-time constant so a K row and the V accumulators stay
// in registers: K is read once for all G heads; V once per pair of heads, from L2 (once a
// head where a pair's accumulators would not fit in the registers: AVX2 at head_dim 64).
// An int8 row is read as integers and its scale applied once per row: to the score for
// K, to the softmax weight for V.
template <int C, typename Q, typename KV, typename O>
static void decode_range(const Args<Q, KV>& a, int64_t b, int64_t h, int64_t lo, int64_t hi, O* out, float* m,
                         float* sum, std::vector<float>& scores, float* qs) {
  constexpr int64_t D = kW * C;
  constexpr int kLine = 64 / (kW * sizeof(KV)) > 0 ? 64 / (kW * sizeof(KV)) : 1;  // kW-value chunks per cache line
  const int64_t G = a.G, L = hi - lo, bs = a.block_size;
  const int32_t* table = a.tables + b * a.max_blocks;
  const Q* qh = a.q + b * a.q_row + h * G * D;
  for (int64_t g = 0; g < G; ++g)
    for (int c = 0; c < C; ++c) storev(qs + g * D + kW * c, loadv(qh + g * D + kW * c) * a.scale);
  scores.resize(G * L);
  float* sc = scores.data();
  const int64_t head_off = h * D;
  const int64_t srow = a.Hkv;  // scales per slot

  for (int64_t t0 = lo; t0 < hi; t0 += bs) {
    const int64_t n = std::min<int64_t>(bs, hi - t0);
    const int64_t slot0 = static_cast<int64_t>(table[t0 / bs]) * bs;
    const KV* kb = a.k + slot0 * a.row + head_off;
    // The next block sits anywhere in the pool, where the hardware prefetcher cannot
    // guess it: ask for it while this one computes (after the last K block, the first V).
    const KV* kn = t0 + bs < hi ? a.k + static_cast<int64_t>(table[t0 / bs + 1]) * bs * a.row + head_off
                                : a.v + static_cast<int64_t>(table[lo / bs]) * bs * a.row + head_off;
    for (int64_t j = 0; j < n; ++j) {
      const KV* kt = kb + j * a.row;
      for (int c = 0; c < C; c += kLine)
        __builtin_prefetch(kn + j * a.row + kW * c);
      fvec k[C];
      for (int c = 0; c < C; ++c) k[c] = loadv(kt + kW * c);
      const float ks = a.k_scale ? a.k_scale[(slot0 + j) * srow + h] : 1.f;
      for (int64_t g = 0; g < G; ++g) {
        const float* qg = qs + g * D;
        fvec acc0 = loadv(qg) * k[0];
        fvec acc1 = {};
        for (int c = 1; c < C; ++c) {
          if (c & 1) acc1 += loadv(qg + kW * c) * k[c];
          else acc0 += loadv(qg + kW * c) * k[c];
        }
        sc[g * L + t0 - lo + j] = hsumv(acc0 + acc1) * ks;
      }
    }
  }
  softmax_rows(sc, G, L, m, sum);

  // 16 vector registers without AVX-512: a pair's 2 C accumulators fit only up to C = 6
  constexpr bool kPairs = kW == 16 || 2 * C <= 12;
  for (int64_t g = 0; g < G; g += kPairs ? 2 : 1) {
    const bool pair = kPairs && g + 1 < G;
    const float* p0 = sc + g * L;
    const float* p1 = pair ? sc + (g + 1) * L : p0;
    fvec acc0[C] = {}, acc1[C] = {};
    for (int64_t t0 = lo; t0 < hi; t0 += bs) {
      const int64_t n = std::min<int64_t>(bs, hi - t0);
      const int64_t slot0 = static_cast<int64_t>(table[t0 / bs]) * bs;
      const KV* vb = a.v + slot0 * a.row + head_off;
      const KV* vn = t0 + bs < hi ? a.v + static_cast<int64_t>(table[t0 / bs + 1]) * bs * a.row + head_off : nullptr;
      for (int64_t j = 0; j < n; ++j) {
        const KV* vt = vb + j * a.row;
        if (vn)
          for (int c = 0; c < C; c += kLine)
            __builtin_prefetch(vn + j * a.row + kW * c);
        const float vs = a.v_scale ? a.v_scale[(slot0 + j) * srow + h] : 1.f;
        const float w0 = p0[t0 - lo + j] * vs, w1 = p1[t0 - lo + j] * vs;
        for (int c = 0; c < C; ++c) {
          const fvec x = loadv(vt + kW * c);
          acc0[c] += w0 * x;
          if constexpr (kPairs) acc1[c] += w1 * x;
        }
      }
    }
    for (int c = 0; c < C; ++c) storev(out + g * D + kW * c, acc0[c]);
    if (pair)
      for (int c = 0; c < C; ++c) storev(out + (g + 1) * D + kW * c, acc1[c]);
  }
}

// A context longer than this is cut into near-equal parts of whole blocks, each its own
// work item, and the parts' results combined (split-K, "flash decoding"). Why: the work
// items are (sequence, KV head) pairs, so at batch 1 a model with few KV heads had fewer
// items than threads (the default model's 3 on 2 cores: one thread did two, the other one;
// on 16 cores 13 idled), however long the context. The cut depends on the context length
// alone, so a sequence's attention has the same bits whatever else is in the batch; a
// context this short or shorter is computed as one part, as before.
constexpr int64_t kSplitTokens = 512;

// One work item: tokens lo..hi of sequence b's context under KV head h; part: its slot in
// the parts' buffer, or -1 when it is the whole context (its result goes straight out).
struct Item {
  int64_t b, h, lo, hi, part;
};

// A (sequence, KV head) whose context was cut: its n parts are slots part .. part + n - 1.
struct Split {
  int64_t b, h, part, n;
};

// Each split (sequence, KV head)'s parts into its output. A part's slot in ``parts``
// holds G rows of D, then G maximums and G sums; part s, normalized over its own tokens
// with maximum m_s and sum l_s, weighs l_s exp(m_s - M) over all parts' total (M: the
// largest m_s), which is its share of the whole softmax.
template <typename Q, typename KV>
static void combine_splits(const Args<Q, KV>& a, const std::vector<Split>& splits, const float* parts, int64_t D) {
  const int64_t G = a.G, stride = G * (D + 2);
  at::parallel_for(0, static_cast<int64_t>(splits.size()), 1, [&](int64_t begin, int64_t end) {
    std::vector<float> w, acc(D);
    for (int64_t f = begin; f < end; ++f) {
      const Split& sp = splits[f];
      const float* first = parts + sp.part * stride;
      w.resize(sp.n);
      Q* out = a.out + (sp.b * a.Hq + sp.h * G) * D;
      for (int64_t g = 0; g < G; ++g) {
        float M = -std::numeric_limits<float>::infinity();
        for (int64_t s = 0; s < sp.n; ++s) M = std::max(M, first[s * stride + G * D + g]);
        float total = 0.f;
        for (int64_t s = 0; s < sp.n; ++s) {
          const float* stats = first + s * stride + G * D;
          w[s] = stats[G + g] * ks::exp_f32(stats[g] - M);
          total += w[s];
        }
        std::fill(acc.begin(), acc.end(), 0.f);
        for (int64_t s = 0; s < sp.n; ++s) {
          const float ws = w[s] / total;
          const float* part = first + s * stride + g * D;
#pragma omp simd
          for (int64_t d = 0; d < D; ++d) acc[d] += ws * part[d];
        }
        for (int64_t d = 0; d < D; d += kW) storev(out + g * D + d, loadv(acc.data() + d));
      }
    }
  });
}

template <int C16, typename Q, typename KV>
static void decode_all(const Args<Q, KV>& a, int64_t B) {
  constexpr int C = C16 * 16 / kW;
  constexpr int64_t D = kW * C;
  const int64_t G = a.G, bs = a.block_size;
  std::vector<Item> items;
  std::vector<Split> splits;
  items.reserve(B * a.Hkv);
  int64_t parts = 0;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t L = a.lens[b], blocks = (L + bs - 1) / bs;
    const int64_t n = std::max<int64_t>(1, std::min(blocks, (L + kSplitTokens - 1) / kSplitTokens));
    const int64_t per = n > 1 ? (blocks + n - 1) / n * bs : L;  // tokens a part, whole blocks
    for (int64_t h = 0; h < a.Hkv; ++h) {
      if (n == 1) {
        items.push_back({b, h, 0, L, -1});
        continue;
      }
      const int64_t first = parts;
      for (int64_t lo = 0; lo < L; lo += per) items.push_back({b, h, lo, std::min(L, lo + per), parts++});
      splits.push_back({b, h, first, parts - first});
    }
  }
  // per part: G rows of D, then G maximums and G sums (combine_splits reads them)
  std::vector<float> part_buf(parts * G * (D + 2));
  at::parallel_for(0, static_cast<int64_t>(items.size()), 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores, qs(G * D), stats(2 * G);
    for (int64_t i = begin; i < end; ++i) {
      const Item& it = items[i];
      if (it.part < 0) {
        decode_range<C>(a, it.b, it.h, it.lo, it.hi, a.out + (it.b * a.Hq + it.h * G) * D, stats.data(),
                        stats.data() + G, scores, qs.data());
      } else {
        float* part = part_buf.data() + it.part * G * (D + 2);
        decode_range<C>(a, it.b, it.h, it.lo, it.hi, part, part + G * D, part + G * D + G, scores, qs.data());
      }
    }
  });
  if (!splits.empty()) combine_splits(a, splits, part_buf.data(), D);
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
static void run(Q* out, const Q* q, int64_t B, int64_t Hq, int64_t D, int64_t q_row, const at::Tensor& k_cache,
                const at::Tensor& v_cache, const float* ks, const float* vs, const int32_t* tables,
                int64_t max_blocks, const int32_t* lens, int64_t block_size, double scale) {
  const int64_t Hkv = k_cache.size(1);
  Args<Q, KV> a{q, reinterpret_cast<const KV*>(k_cache.data_ptr()), reinterpret_cast<const KV*>(v_cache.data_ptr()),
                ks, vs, out, tables, lens, Hq, Hkv, Hq / Hkv, max_blocks, Hkv * D, block_size,
                static_cast<float>(scale), q_row};
  dispatch(a, B, D);
}

template <typename Q, typename KV>
static void run(at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                const float* ks, const float* vs, const at::Tensor& block_tables, const at::Tensor& context_lens,
                int64_t block_size, double scale) {
  const int64_t Hq = q.size(1), D = q.size(2);
  run<Q, KV>(reinterpret_cast<Q*>(out.data_ptr()), reinterpret_cast<const Q*>(q.data_ptr()), q.size(0), Hq, D,
             Hq * D, k_cache, v_cache, ks, vs, block_tables.data_ptr<int32_t>(), block_tables.size(1),
             context_lens.data_ptr<int32_t>(), block_size, scale);
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

namespace ks {
void paged_decode_into(float* out, const float* q, int64_t B, int64_t Hq, int64_t D, int64_t q_row,
                       const at::Tensor& k_cache, const at::Tensor& v_cache, const float* ks, const float* vs,
                       const int32_t* tables, int64_t max_blocks, const int32_t* lens, int64_t block_size,
                       double scale) {
#define KS_RUN(KV) run<float, KV>(out, q, B, Hq, D, q_row, k_cache, v_cache, ks, vs, tables, max_blocks, lens, \
                                  block_size, scale)
  switch (k_cache.scalar_type()) {
    case at::kFloat: KS_RUN(float); break;
    case at::kBFloat16: KS_RUN(BF16); break;
    case at::kHalf: KS_RUN(F16); break;
    case at::kChar: KS_RUN(int8_t); break;
    default: TORCH_CHECK(false, "paged_decode: float32, bfloat16, float16 or int8 caches only");
  }
#undef KS_RUN
}
}  // namespace ks
