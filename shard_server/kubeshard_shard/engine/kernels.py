"""A compiled CPU kernel for decode attention over the paged KV cache.

Why our own kernel: without it, decode attention gathers every sequence's context into
a padded batch (a copy of the whole KV context per layer per step) and then runs a
masked attention over it — on two cores that was 40% of a 64-sequence decode step.
The kernel reads K and V straight from the cache blocks: one work item per (sequence,
KV head), whose grouped query heads share each K/V row; a K row and the V accumulators
live in SIMD registers (the head size is a template constant), and the next block of
the table is prefetched by hand, since blocks lie anywhere in the pool. Decode attention
is bound by memory, and this runs at a good fraction of the machine's DRAM bandwidth.
It is built with torch's C++ extension loader on first use (g++ and ninja), cached
outside the clone, and keyed by its source and the CPU's flags; when it cannot be built,
or for a head size it does not handle, the torch fallback in ``attention.py`` serves
(slower, same results up to float rounding).

``load()`` returns the kernel, or None when the fallback serves; the model runner holds
what it returned.
"""

from __future__ import annotations

import functools
import hashlib
import logging
from pathlib import Path
from typing import Callable

import torch

from kubeshard_shard.hardware import CpuFeatures
from kubeshard_shard.paths import cache_root

log = logging.getLogger(__name__)

SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>
#ifdef __AVX512F__
#include <immintrin.h>
#endif

// Sixteen floats; GCC lowers the arithmetic to AVX-512, to pairs of AVX2 registers, or to
// SSE, whichever -march=native offers, so one source serves every x86 (and ARM) CPU.
typedef float f32x16 __attribute__((vector_size(64)));

static inline f32x16 load16(const float* p) { f32x16 v; std::memcpy(&v, p, sizeof(v)); return v; }
static inline void store16(float* p, f32x16 v) { std::memcpy(p, &v, sizeof(v)); }
static inline float hsum16(f32x16 v) {
#ifdef __AVX512F__
  return _mm512_reduce_add_ps(reinterpret_cast<__m512>(v));
#else
  float s = 0.f;
  for (int i = 0; i < 16; ++i) s += v[i];
  return s;
#endif
}

// exp(x) for x <= 0 (softmax after subtracting the max), written so the compiler
// vectorizes the loops that call it: 2^(x log2 e) = 2^n * 2^f, 2^f by a degree-6
// polynomial on [-0.5, 0.5] (relative error ~1e-7, as good as float32 gives).
static inline float fast_exp(float x) {
  x = std::max(x, -87.0f);
  const float t = x * 1.44269504088896341f;
  const float n = std::nearbyint(t);
  const float f = t - n;
  float p = 1.535336188319500e-4f;
  p = p * f + 1.339887440266574e-3f;
  p = p * f + 9.618437357674640e-3f;
  p = p * f + 5.550332471162809e-2f;
  p = p * f + 2.402264791363012e-1f;
  p = p * f + 6.931472028550421e-1f;
  p = p * f + 1.0f;
  int32_t bits;
  std::memcpy(&bits, &p, sizeof(bits));
  bits += static_cast<int32_t>(n) << 23;
  float r;
  std::memcpy(&r, &bits, sizeof(r));
  return r;
}

static void softmax_rows(float* s, int64_t rows, int64_t L) {
  for (int64_t r = 0; r < rows; ++r) {
    float* sg = s + r * L;
    float m = -std::numeric_limits<float>::infinity();
    for (int64_t t = 0; t < L; ++t) m = std::max(m, sg[t]);
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
    for (int64_t t = 0; t < L; ++t) {
      sg[t] = fast_exp(sg[t] - m);
      sum += sg[t];
    }
    const float inv = 1.f / sum;
#pragma omp simd
    for (int64_t t = 0; t < L; ++t) sg[t] *= inv;
  }
}

struct Args {
  const float *q, *k, *v;
  float* out;
  const int32_t *tables, *lens;
  int64_t Hq, Hkv, G, max_blocks, row, block_size;
  float scale;
};

// One (sequence, KV head) pair: the G query heads that share the head's K/V rows.
// C = head_dim / 16 is a compile-time constant so a K row and the V accumulators stay
// in registers: K is read once for all G heads; V once per pair of heads, from L2.
template <int C>
static void decode_head(const Args& a, int64_t b, int64_t h, std::vector<float>& scores, float* qs) {
  constexpr int64_t D = 16 * C;
  const int64_t G = a.G, L = a.lens[b], bs = a.block_size;
  const int32_t* table = a.tables + b * a.max_blocks;
  const float* qh = a.q + (b * a.Hq + h * G) * D;
  for (int64_t i = 0; i < G * D; ++i) qs[i] = qh[i] * a.scale;
  scores.resize(G * L);
  float* sc = scores.data();
  const int64_t head_off = h * D;

  for (int64_t t0 = 0; t0 < L; t0 += bs) {
    const int64_t n = std::min<int64_t>(bs, L - t0);
    const float* kb = a.k + static_cast<int64_t>(table[t0 / bs]) * bs * a.row + head_off;
    // The next block sits anywhere in the pool, where the hardware prefetcher cannot
    // guess it: ask for it while this one computes (after the last K block, the first V).
    const float* kn = t0 + bs < L ? a.k + static_cast<int64_t>(table[t0 / bs + 1]) * bs * a.row + head_off
                                  : a.v + static_cast<int64_t>(table[0]) * bs * a.row + head_off;
    for (int64_t j = 0; j < n; ++j) {
      const float* kt = kb + j * a.row;
      for (int c = 0; c < C; ++c) __builtin_prefetch(kn + j * a.row + 16 * c);
      f32x16 k[C];
      for (int c = 0; c < C; ++c) k[c] = load16(kt + 16 * c);
      for (int64_t g = 0; g < G; ++g) {
        const float* qg = qs + g * D;
        f32x16 acc0 = load16(qg) * k[0];
        f32x16 acc1 = {};
        for (int c = 1; c < C; ++c) {
          if (c & 1) acc1 += load16(qg + 16 * c) * k[c];
          else acc0 += load16(qg + 16 * c) * k[c];
        }
        sc[g * L + t0 + j] = hsum16(acc0 + acc1);
      }
    }
  }
  softmax_rows(sc, G, L);

  float* out = a.out + (b * a.Hq + h * G) * D;
  for (int64_t g = 0; g < G; g += 2) {
    const bool pair = g + 1 < G;
    const float* p0 = sc + g * L;
    const float* p1 = pair ? sc + (g + 1) * L : p0;
    f32x16 acc0[C] = {}, acc1[C] = {};
    for (int64_t t0 = 0; t0 < L; t0 += bs) {
      const int64_t n = std::min<int64_t>(bs, L - t0);
      const float* vb = a.v + static_cast<int64_t>(table[t0 / bs]) * bs * a.row + head_off;
      const float* vn = t0 + bs < L ? a.v + static_cast<int64_t>(table[t0 / bs + 1]) * bs * a.row + head_off : nullptr;
      for (int64_t j = 0; j < n; ++j) {
        const float* vt = vb + j * a.row;
        if (vn)
          for (int c = 0; c < C; ++c) __builtin_prefetch(vn + j * a.row + 16 * c);
        const float w0 = p0[t0 + j], w1 = p1[t0 + j];
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

template <int C>
static void decode_all(const Args& a, int64_t B) {
  at::parallel_for(0, B * a.Hkv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores, qs(a.G * 16 * C);
    for (int64_t i = begin; i < end; ++i) decode_head<C>(a, i / a.Hkv, i % a.Hkv, scores, qs.data());
  });
}

// out, q: [B, Hq, D]; k_cache, v_cache: [slots, Hkv, D] (slot = block * block_size + offset);
// block_tables: [B, max_blocks] int32; context_lens: [B] int32 (tokens to attend, new one included).
// D must be a multiple of 16, at most 256 (``supports`` tells the Python side).
void paged_decode(torch::Tensor out, torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                  torch::Tensor block_tables, torch::Tensor context_lens, int64_t block_size, double scale) {
  TORCH_CHECK(q.scalar_type() == torch::kFloat32 && k_cache.scalar_type() == torch::kFloat32 &&
              v_cache.scalar_type() == torch::kFloat32 && out.scalar_type() == torch::kFloat32,
              "paged_decode: float32 only");
  TORCH_CHECK(q.is_contiguous() && out.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous(),
              "paged_decode: contiguous tensors required");
  TORCH_CHECK(block_tables.scalar_type() == torch::kInt32 && context_lens.scalar_type() == torch::kInt32 &&
              block_tables.is_contiguous() && context_lens.is_contiguous(),
              "paged_decode: contiguous int32 block tables and lengths required");
  const int64_t B = q.size(0), Hq = q.size(1), D = q.size(2), Hkv = k_cache.size(1);
  TORCH_CHECK(D % 16 == 0 && D <= 256 && k_cache.size(2) == D, "paged_decode: head_dim must be a multiple of 16, "
              "at most 256, got ", D);
  TORCH_CHECK(Hkv > 0 && Hq % Hkv == 0, "paged_decode: query heads (", Hq, ") not a multiple of KV heads (", Hkv, ")");
  Args a{q.data_ptr<float>(), k_cache.data_ptr<float>(), v_cache.data_ptr<float>(), out.data_ptr<float>(),
         block_tables.data_ptr<int32_t>(), context_lens.data_ptr<int32_t>(), Hq, Hkv, Hq / Hkv,
         block_tables.size(1), Hkv * D, block_size, static_cast<float>(scale)};
  switch (D / 16) {
#define KUBESHARD_CASE(C) case C: decode_all<C>(a, B); break;
    KUBESHARD_CASE(1) KUBESHARD_CASE(2) KUBESHARD_CASE(3) KUBESHARD_CASE(4)
    KUBESHARD_CASE(5) KUBESHARD_CASE(6) KUBESHARD_CASE(7) KUBESHARD_CASE(8)
    KUBESHARD_CASE(9) KUBESHARD_CASE(10) KUBESHARD_CASE(11) KUBESHARD_CASE(12)
    KUBESHARD_CASE(13) KUBESHARD_CASE(14) KUBESHARD_CASE(15) KUBESHARD_CASE(16)
#undef KUBESHARD_CASE
  }
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode", &paged_decode, "decode attention over a paged KV cache (float32, CPU)");
}
"""


def supports(kernel: Callable | None, q: torch.Tensor) -> bool:
    """Whether ``kernel`` (what ``load`` returned) serves decode queries like ``q`` ([B, Hq, D])."""
    return (kernel is not None and q.device.type == "cpu" and q.dtype == torch.float32
            and q.shape[-1] % 16 == 0 and q.shape[-1] <= 256)


def _build_dir(flags: str) -> Path:
    key = hashlib.sha256((SOURCE + flags + torch.__version__).encode()).hexdigest()[:16]
    path = cache_root() / "kernels" / f"paged_decode_{key}"
    path.mkdir(parents=True, exist_ok=True)
    return path


@functools.cache
def load(cpu_flags: str = "") -> Callable | None:
    """Builds (once per machine: the build is cached on disk, keyed by the source and the
    CPU's flags) and loads the kernel; None means the torch fallback serves."""
    try:
        from torch.utils.cpp_extension import load_inline

        build_dir = _build_dir(cpu_flags or CpuFeatures.detect().line)
        module = load_inline(
            name=f"kubeshard_paged_decode_{build_dir.name.rsplit('_', 1)[-1]}",
            cpp_sources=[SOURCE],
            extra_cflags=["-O3", "-march=native", "-fopenmp", "-fopenmp-simd"],
            extra_ldflags=["-fopenmp"],
            build_directory=str(build_dir),
            verbose=False,
        )
    except Exception as exc:  # no compiler, no ninja, ...: serve with the torch fallback
        log.warning("paged decode kernel unavailable, using the torch fallback: %s", str(exc).splitlines()[0])
        return None
    return module.paged_decode


if __name__ == "__main__":  # `make install` builds the kernel once, ahead of the first server
    logging.basicConfig(level=logging.INFO)
    print("paged decode kernel:", "ready" if load() is not None else "unavailable (the torch fallback serves)")
