// A candidate layout for the int4 GEMM on AVX-512 VNNI, measured by bench.quant_gemm_bench
// --prototype beside the engine's kernel (csrc/gemm.cpp, q4_rows512). Not served: the
// engine's int4 weights keep GGUF's row-major layout.
//
// The layout ("x16"): W's rows in groups of 16, each 32-value block of a group as 320
// bytes: 256 of packed weights, where the 64-byte vector k (0-3) holds, for each of the
// 16 rows in turn, that row's packed bytes 4k..4k+3 of the block (their low nibbles are
// values 4k..4k+3, their high ones 16+4k..16+4k+3), then the 16 rows' float16 scales and
// their 16 minimums. A byte dot product of vector k against four bytes of x broadcast
// to every lane then sums each row's products in that row's own 32-bit lane: the 16
// rows' block dots come out in one vector, scaled by one vector of scales, with no sum
// across lanes and no per-row work at all (q4_rows512 reduces each row's lanes and
// spends a scale, a minimum and a permute per block on each row on its own: at K = 576,
// 18 blocks a row, that fixed work costs more than the byte dot products).
//
// x is the engine's (QuantX in gemm.cpp): int16 per 32 values, split into its signed
// high byte h and unsigned low byte l, q = 256 h + l, so the integer dots are the same
// exact integers as the engine kernel's and only the float rounding differs.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/extension.h>

#include <cmath>
#include <cstring>
#include <vector>

namespace {

constexpr int64_t kRows = 16, kBlockBytes = 320;

uint16_t* half_ptr(at::Tensor t) { return reinterpret_cast<uint16_t*>(t.data_ptr<at::Half>()); }

// packed [N, K / 2] (GGUF's order), scales and minimums [N, K / 32] -> the x16 layout
at::Tensor repack(at::Tensor packed, at::Tensor scales, at::Tensor mins) {
  const int64_t N = packed.size(0), K = packed.size(1) * 2, nb = K / 32;
  TORCH_CHECK(N % kRows == 0, "q4_x16.repack: ", N, " rows is not a multiple of ", kRows);
  TORCH_CHECK(scales.size(1) == nb && mins.sizes() == scales.sizes(), "q4_x16.repack: a scale a block (group 32)");
  auto out = at::empty({N / kRows, nb, kBlockBytes}, packed.options());
  const uint8_t* w = packed.data_ptr<uint8_t>();
  const uint16_t *d = half_ptr(scales), *m = half_ptr(mins);
  uint8_t* o = out.data_ptr<uint8_t>();
  for (int64_t g = 0; g < N / kRows; ++g)
    for (int64_t b = 0; b < nb; ++b, o += kBlockBytes) {
      for (int k = 0; k < 4; ++k)
        for (int r = 0; r < kRows; ++r)
          std::memcpy(o + 64 * k + 4 * r, w + (g * kRows + r) * (K / 2) + 16 * b + 4 * k, 4);
      for (int r = 0; r < kRows; ++r) {
        std::memcpy(o + 256 + 2 * r, d + (g * kRows + r) * nb + b, 2);
        std::memcpy(o + 288 + 2 * r, m + (g * kRows + r) * nb + b, 2);
      }
    }
  return out;
}

// one row of x as the kernel reads it: per block its high and low bytes, its scale, its
// exact sum and 8 times (that sum less the quantized values' sum): the minimums' terms
struct X {
  std::vector<int8_t> hi;
  std::vector<uint8_t> lo;
  std::vector<float> d, sum, err8;
};

void quantize(const float* x, int64_t K, X& out) {
  const int64_t nb = K / 32;
  out.hi.resize(K);
  out.lo.resize(K);
  out.d.resize(nb);
  out.sum.resize(nb);
  out.err8.resize(nb);
  for (int64_t b = 0; b < nb; ++b) {
    const float* v = x + 32 * b;
    float amax = 0.f, sum = 0.f;
    for (int i = 0; i < 32; ++i) {
      amax = std::max(amax, std::fabs(v[i]));
      sum += v[i];
    }
    const float d = amax / 32767.f, id = d > 0.f ? 1.f / d : 0.f;
    int32_t qsum = 0;
    for (int i = 0; i < 32; ++i) {
      const int32_t q = static_cast<int32_t>(std::nearbyint(v[i] * id));
      out.hi[32 * b + i] = static_cast<int8_t>(q >> 8);
      out.lo[32 * b + i] = static_cast<uint8_t>(q & 0xFF);
      qsum += q;
    }
    out.d[b] = d;
    out.sum[b] = sum;
    out.err8[b] = 8.f * (sum - float(qsum) * d);
  }
}

int32_t four(const void* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// 16 rows of W (from p, nb blocks) against one row of x, into y[0..15]
void group(const uint8_t* p, int64_t nb, const X& x, float* y) {
  const __m512i low = _mm512_set1_epi8(0x0F);
  __m512 acc = _mm512_setzero_ps(), mins = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b, p += kBlockBytes) {
    // W asked for 1 KiB ahead (1,024 to 4,096 tried: within the noise, 4,096 the slowest)
    for (int line = 0; line < kBlockBytes; line += 64)
      _mm_prefetch(reinterpret_cast<const char*>(p) + 1024 + line, _MM_HINT_T0);
    const int8_t* h = x.hi.data() + 32 * b;
    const uint8_t* l = x.lo.data() + 32 * b;
    __m512i th[2] = {_mm512_setzero_si512(), _mm512_setzero_si512()};
    __m512i tl[2] = {_mm512_setzero_si512(), _mm512_setzero_si512()};
    for (int k = 0; k < 4; ++k) {
      const __m512i w = _mm512_loadu_si512(p + 64 * k);
      const __m512i wl = _mm512_and_si512(w, low), wh = _mm512_and_si512(_mm512_srli_epi16(w, 4), low);
      // weights (0..15) unsigned by x's signed high bytes; x's unsigned low bytes by the
      // weights as signed bytes (0..15 either way)
      th[k & 1] = _mm512_dpbusd_epi32(th[k & 1], wl, _mm512_set1_epi32(four(h + 4 * k)));
      th[k & 1] = _mm512_dpbusd_epi32(th[k & 1], wh, _mm512_set1_epi32(four(h + 16 + 4 * k)));
      tl[k & 1] = _mm512_dpbusd_epi32(tl[k & 1], _mm512_set1_epi32(four(l + 4 * k)), wl);
      tl[k & 1] = _mm512_dpbusd_epi32(tl[k & 1], _mm512_set1_epi32(four(l + 16 + 4 * k)), wh);
    }
    const __m512i dot = _mm512_add_epi32(_mm512_slli_epi32(_mm512_add_epi32(th[0], th[1]), 8),
                                         _mm512_add_epi32(tl[0], tl[1]));
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 256)));
    const __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 288)));
    acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(d, _mm512_set1_ps(x.d[b])), acc);
    mins = _mm512_fmadd_ps(m, _mm512_set1_ps(x.sum[b]), mins);
    mins = _mm512_fmadd_ps(d, _mm512_set1_ps(x.err8[b]), mins);
  }
  _mm512_storeu_ps(y, _mm512_add_ps(acc, mins));
}

// y = x W^T for W in the x16 layout ([N / 16, K / 32, 320]): groups of 16 rows split
// between the threads in equal shares
at::Tensor gemm(at::Tensor x, at::Tensor w) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kFloat, "q4_x16.gemm: float32 x");
  const int64_t M = x.size(0), K = x.size(1), nb = K / 32, groups = w.size(0);
  TORCH_CHECK(w.dim() == 3 && w.size(1) == nb && w.size(2) == kBlockBytes, "q4_x16.gemm: W is not x16 for K ", K);
  std::vector<X> xs(M);
  for (int64_t r = 0; r < M; ++r) quantize(x.data_ptr<float>() + r * K, K, xs[r]);
  auto y = at::empty({M, groups * kRows}, x.options());
  float* yp = y.data_ptr<float>();
  const uint8_t* wp = w.data_ptr<uint8_t>();
  at::parallel_for(0, groups, 1, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g)
      for (int64_t r = 0; r < M; ++r) group(wp + g * nb * kBlockBytes, nb, xs[r], yp + r * groups * kRows + g * kRows);
  });
  return y;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("repack", &repack, "packed int4 [N, K/2] with its scales and minimums (group 32) in the x16 layout");
  m.def("gemm", &gemm, "y = x W^T for W in the x16 layout");
}
