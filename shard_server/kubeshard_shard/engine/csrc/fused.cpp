// Fused elementwise steps of a decoder layer: RMSNorm with its residual add, rotary
// embedding in place, the K/V write into the paged cache (quantizing for an int8 cache),
// and SwiGLU.
//
// Why: at decode-sized batches a layer's arithmetic is small and torch's cost is per
// call -- F.rms_norm alone dispatched 25 aten ops, the rotary embedding 20, a layer about
// 136 -- which at 30 layers was milliseconds per token. One call each here.
//
// Rounding: the rotary embedding and the K/V copy round exactly as the torch ops they
// replace (each product and sum rounded to the tensor's type, no fused multiply-add), so
// they change no bit in any dtype. RMSNorm's mean of squares and SwiGLU's exp are
// computed in float32 in a different order than torch's (a few ulps apart); float32
// output still equals transformers' token for token (the identity tests run with them).
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <tuple>
#include <type_traits>
#include <vector>

#include "simd.h"

#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")

namespace ks {

// A value of the tensor's type, to and from float; round() is a cast to that type.
// Always inlined: they are defined under this file's fp-contract=off, and GCC inlines
// nothing across differing optimize options on its own, so SwiGLU's loop (after the
// region) called them one element at a time instead of vectorizing (10 us a call).
#define KS_ELEM __attribute__((always_inline)) inline
template <typename T> struct Elem;
template <> struct Elem<float> {
  using raw = float;
  KS_ELEM static float get(float v) { return v; }
  KS_ELEM static float put(float v) { return v; }
};
template <> struct Elem<at::BFloat16> {
  using raw = uint16_t;
  KS_ELEM static float get(uint16_t v) { return bf16_to_f32(v); }
  KS_ELEM static uint16_t put(float v) { return f32_to_bf16(v); }
};
template <> struct Elem<at::Half> {
  using raw = uint16_t;
  KS_ELEM static float get(uint16_t v) { return fp16_to_f32(v); }
  KS_ELEM static uint16_t put(float v) {
    _Float16 h = static_cast<_Float16>(v);  // round to nearest even
    uint16_t bits;
    std::memcpy(&bits, &h, 2);
    return bits;
  }
};
template <typename T> KS_ELEM static float round_to(float v) { return Elem<T>::get(Elem<T>::put(v)); }

#define KS_DISPATCH_FLOATS(type, NAME, ...)                                         \
  switch (type) {                                                                    \
    case at::kFloat: { using scalar_t = float; __VA_ARGS__; break; }                 \
    case at::kBFloat16: { using scalar_t = at::BFloat16; __VA_ARGS__; break; }       \
    case at::kHalf: { using scalar_t = at::Half; __VA_ARGS__; break; }               \
    default: TORCH_CHECK(false, NAME ": float32, bfloat16 or float16 tensors only"); \
  }

// ------------------------------------------------------------------------ RMSNorm
// residual given: r = x + residual (in x's type), out = norm(r); else r = x. Returns
// (out, r). As the reference: h = r in float32 * rsqrt(mean(r^2) + eps), rounded to the
// type, times the weight.
template <typename T>
static void rms_rows(const T* x, const T* res, const T* w, T* out, T* rout, int64_t rows, int64_t H, double eps) {
  using R = typename Elem<T>::raw;
  const R* xp = reinterpret_cast<const R*>(x);
  const R* rp = reinterpret_cast<const R*>(res);
  const R* wp = reinterpret_cast<const R*>(w);
  R* op = reinterpret_cast<R*>(out);
  R* sp = reinterpret_cast<R*>(rout);
  at::parallel_for(0, rows, 16, [&](int64_t r0, int64_t r1) {
    std::vector<float> h(H);
    for (int64_t r = r0; r < r1; ++r) {
      const R* xr = xp + r * H;
      float ss = 0.f;
      for (int64_t i = 0; i < H; ++i) {
        float v = Elem<T>::get(xr[i]);
        if (rp) {
          v = round_to<T>(v + Elem<T>::get(rp[r * H + i]));
          sp[r * H + i] = Elem<T>::put(v);
        }
        h[i] = v;
        ss += v * v;
      }
      const float inv = 1.f / std::sqrt(ss / float(H) + float(eps));
      for (int64_t i = 0; i < H; ++i) {
        const float n = round_to<T>(h[i] * inv);
        op[r * H + i] = Elem<T>::put(Elem<T>::get(wp[i]) * n);
      }
    }
  });
}

std::tuple<at::Tensor, at::Tensor> rms_norm(at::Tensor x, c10::optional<at::Tensor> residual, at::Tensor weight,
                                            double eps) {
  TORCH_CHECK(x.is_contiguous() && weight.is_contiguous() && weight.scalar_type() == x.scalar_type() &&
              weight.numel() == x.size(-1), "rms_norm: contiguous x and a weight of its type and last size");
  const int64_t H = x.size(-1), rows = x.numel() / std::max<int64_t>(H, 1);
  auto out = at::empty_like(x);
  at::Tensor r = x;
  const bool has_res = residual && residual->defined();
  if (has_res) {
    TORCH_CHECK(residual->is_contiguous() && residual->sizes() == x.sizes() &&
                residual->scalar_type() == x.scalar_type(), "rms_norm: the residual must match x");
    r = at::empty_like(x);
  }
  KS_DISPATCH_FLOATS(x.scalar_type(), "rms_norm",
    rms_rows<scalar_t>(x.data_ptr<scalar_t>(), has_res ? residual->data_ptr<scalar_t>() : nullptr,
                       weight.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(),
                       has_res ? r.data_ptr<scalar_t>() : nullptr, rows, H, eps));
  return {out, r};
}

// --------------------------------------------------------------------- rotary, in place
// x: [T, heads, D] with any row stride (a view into the fused q|k|v output); rows of
// cos_sin [2, positions, D]: out = x * cos + rotate_half(x) * sin, each product and the sum
// rounded to the type -- torch's arithmetic on these tensors, bit for bit.
template <typename T>
static void rope_rows(T* x, int64_t T_, int64_t heads, int64_t D, int64_t stride_t, int64_t stride_h,
                      const int64_t* pos, const T* cs, int64_t P) {
  using R = typename Elem<T>::raw;
  const int64_t half = D / 2;
  R* xp = reinterpret_cast<R*>(x);
  const R* cp = reinterpret_cast<const R*>(cs);
  at::parallel_for(0, T_ * heads, 64, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t t = i / heads, hh = i % heads;
      R* v = xp + t * stride_t + hh * stride_h;
      const R* c = cp + pos[t] * D;
      const R* s = cp + (P + pos[t]) * D;
      for (int64_t j = 0; j < half; ++j) {
        const float a = Elem<T>::get(v[j]), b = Elem<T>::get(v[j + half]);
        const float lo = round_to<T>(round_to<T>(a * Elem<T>::get(c[j])) +
                                     round_to<T>(-b * Elem<T>::get(s[j])));
        const float hi = round_to<T>(round_to<T>(b * Elem<T>::get(c[j + half])) +
                                     round_to<T>(a * Elem<T>::get(s[j + half])));
        v[j] = Elem<T>::put(lo);
        v[j + half] = Elem<T>::put(hi);
      }
    }
  });
}

static void check_heads(const at::Tensor& x, const char* what) {
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1, what, ": expected [tokens, heads, head_dim] with unit stride rows");
}

void rope_(at::Tensor q, at::Tensor k, at::Tensor positions, at::Tensor cos_sin) {
  check_heads(q, "rope q");
  check_heads(k, "rope k");
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.is_contiguous() && positions.numel() == q.size(0) &&
              k.size(0) == q.size(0), "rope: int64 positions, one per token");
  TORCH_CHECK(cos_sin.is_contiguous() && cos_sin.dim() == 3 && cos_sin.size(0) == 2 && cos_sin.size(2) == q.size(2) &&
              k.size(2) == q.size(2) && cos_sin.scalar_type() == q.scalar_type() && k.scalar_type() == q.scalar_type(),
              "rope: cos_sin [2, positions, head_dim] of the queries' type");
  TORCH_CHECK(q.size(2) % 2 == 0, "rope: even head_dim");
  const int64_t P = cos_sin.size(1);
  const int64_t* pos = positions.data_ptr<int64_t>();
  for (int64_t t = 0; t < positions.numel(); ++t) TORCH_CHECK(pos[t] >= 0 && pos[t] < P, "rope: position out of range");
  KS_DISPATCH_FLOATS(q.scalar_type(), "rope",
    rope_rows<scalar_t>(q.data_ptr<scalar_t>(), q.size(0), q.size(1), q.size(2), q.stride(0), q.stride(1), pos,
                        cos_sin.data_ptr<scalar_t>(), P);
    rope_rows<scalar_t>(k.data_ptr<scalar_t>(), k.size(0), k.size(1), k.size(2), k.stride(0), k.stride(1), pos,
                        cos_sin.data_ptr<scalar_t>(), P));
}

// --------------------------------------------------------------------- the K/V write
// cache[slots[t]] = x[t] for x [T, Hkv, D] (any token and head strides), converted to the
// cache's type like torch's copy; an int8 cache takes q = round(x / s), s = max|x| / 127
// per (token, head), its scale in scale[slot, head].
template <typename S, typename C>
static void store_rows(const S* x, int64_t T_, int64_t H, int64_t D, int64_t st, int64_t sh,
                       const at::Tensor& cache, float* scale, const int64_t* slots) {
  using RS = typename Elem<S>::raw;
  const RS* xp = reinterpret_cast<const RS*>(x);
  at::parallel_for(0, T_ * H, 64, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t t = i / H, h = i % H;
      const RS* src = xp + t * st + h * sh;
      const int64_t slot = slots[t];
      if constexpr (std::is_same_v<C, int8_t>) {
        int8_t* dst = cache.data_ptr<int8_t>() + (slot * H + h) * D;
        float amax = 0.f;
        for (int64_t j = 0; j < D; ++j) amax = std::max(amax, std::fabs(Elem<S>::get(src[j])));
        const float s = amax / 127.f, inv = s > 0.f ? 1.f / s : 0.f;
        for (int64_t j = 0; j < D; ++j) dst[j] = static_cast<int8_t>(std::nearbyint(Elem<S>::get(src[j]) * inv));
        scale[slot * H + h] = s;
      } else {
        using RC = typename Elem<C>::raw;
        RC* dst = reinterpret_cast<RC*>(cache.data_ptr()) + (slot * H + h) * D;
        for (int64_t j = 0; j < D; ++j) dst[j] = Elem<C>::put(Elem<S>::get(src[j]));
      }
    }
  });
}

template <typename S>
static void store_any(const S* x, int64_t T_, int64_t H, int64_t D, int64_t st, int64_t sh,
                      const at::Tensor& cache, float* scale, const int64_t* slots) {
  switch (cache.scalar_type()) {
    case at::kFloat: store_rows<S, float>(x, T_, H, D, st, sh, cache, scale, slots); break;
    case at::kBFloat16: store_rows<S, at::BFloat16>(x, T_, H, D, st, sh, cache, scale, slots); break;
    case at::kHalf: store_rows<S, at::Half>(x, T_, H, D, st, sh, cache, scale, slots); break;
    case at::kChar: store_rows<S, int8_t>(x, T_, H, D, st, sh, cache, scale, slots); break;
    default: TORCH_CHECK(false, "kv_store: the cache must be float32, bfloat16, float16 or int8");
  }
}

template <typename S>
static void store_tensor(const at::Tensor& x, const at::Tensor& cache, float* scale, const int64_t* slots) {
  store_any<S>(x.data_ptr<S>(), x.size(0), x.size(1), x.size(2), x.stride(0), x.stride(1), cache, scale, slots);
}

void kv_store(at::Tensor k, at::Tensor v, at::Tensor k_cache, at::Tensor v_cache, at::Tensor slots,
              c10::optional<at::Tensor> k_scale, c10::optional<at::Tensor> v_scale) {
  check_heads(k, "kv_store k");
  check_heads(v, "kv_store v");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.dim() == 3 &&
              k_cache.sizes() == v_cache.sizes() && k_cache.size(1) == k.size(1) && k_cache.size(2) == k.size(2) &&
              v.sizes() == k.sizes() && v.scalar_type() == k.scalar_type(),
              "kv_store: caches [slots, kv heads, head_dim] matching k and v");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.is_contiguous() && slots.numel() == k.size(0),
              "kv_store: one int64 slot per token");
  const int64_t S = k_cache.size(0);
  const int64_t* sp = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < slots.numel(); ++t) TORCH_CHECK(sp[t] >= 0 && sp[t] < S, "kv_store: slot out of range");
  float *ks = nullptr, *vs = nullptr;
  if (k_cache.scalar_type() == at::kChar) {
    TORCH_CHECK(k_scale && v_scale && k_scale->scalar_type() == at::kFloat && v_scale->scalar_type() == at::kFloat &&
                k_scale->is_contiguous() && v_scale->is_contiguous() && k_scale->numel() == S * k.size(1) &&
                v_scale->numel() == S * k.size(1), "kv_store: an int8 cache needs float32 scales [slots, kv heads]");
    ks = k_scale->data_ptr<float>();
    vs = v_scale->data_ptr<float>();
  }
  KS_DISPATCH_FLOATS(k.scalar_type(), "kv_store",
    store_tensor<scalar_t>(k, k_cache, ks, sp);
    store_tensor<scalar_t>(v, v_cache, vs, sp));
}

// ------------------------------------------------- raw forms (the fused decode step)
// float32 through pointers into the step's own buffers: the same arithmetic as the
// tensor entry points above (so the same bits; SwiGLU's is below), without their checks
// and allocations, which the fused step makes once when it is built and once a step.
void rms_norm_into(const float* x, const float* residual, const float* weight, float* out, float* rout,
                   int64_t rows, int64_t H, double eps) {
  rms_rows<float>(x, residual, weight, out, rout, rows, H, eps);
}

void rope_into(float* x, int64_t tokens, int64_t heads, int64_t D, int64_t stride_t, const int64_t* positions,
               const float* cos_sin, int64_t P) {
  rope_rows<float>(x, tokens, heads, D, stride_t, D, positions, cos_sin, P);
}

void kv_store_into(const float* k, const float* v, int64_t tokens, int64_t H, int64_t D, int64_t stride_t,
                   const at::Tensor& k_cache, const at::Tensor& v_cache, float* k_scale, float* v_scale,
                   const int64_t* slots) {
  store_any<float>(k, tokens, H, D, stride_t, D, k_cache, k_scale, slots);
  store_any<float>(v, tokens, H, D, stride_t, D, v_cache, v_scale, slots);
}

#pragma GCC pop_options

// ------------------------------------------------------------------------ SwiGLU
// gate_up [T, 2I] -> silu(gate) * up [T, I]; silu rounded to the type before the product,
// as torch's two ops are.
template <typename T>
static void swiglu_rows(const T* gu, T* out, int64_t rows, int64_t I) {
  using R = typename Elem<T>::raw;
  const R* gp = reinterpret_cast<const R*>(gu);
  R* op = reinterpret_cast<R*>(out);
  at::parallel_for(0, rows, 4, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const R* g = gp + r * 2 * I;
      const R* u = g + I;
      R* o = op + r * I;
#pragma omp simd
      for (int64_t i = 0; i < I; ++i) {
        const float x = Elem<T>::get(g[i]);
        const float s = round_to<T>(x / (1.f + exp_f32(-x)));
        o[i] = Elem<T>::put(s * Elem<T>::get(u[i]));
      }
    }
  });
}

at::Tensor silu_mul(at::Tensor gate_up) {
  TORCH_CHECK(gate_up.is_contiguous() && gate_up.dim() == 2 && gate_up.size(1) % 2 == 0,
              "silu_mul: contiguous [tokens, 2 * intermediate]");
  const int64_t rows = gate_up.size(0), I = gate_up.size(1) / 2;
  auto out = at::empty({rows, I}, gate_up.options());
  KS_DISPATCH_FLOATS(gate_up.scalar_type(), "silu_mul",
    swiglu_rows<scalar_t>(gate_up.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), rows, I));
  return out;
}


// SwiGLU's raw form (see the raw forms above)
void silu_mul_into(const float* gate_up, float* out, int64_t rows, int64_t I) {
  swiglu_rows<float>(gate_up, out, rows, I);
}

}  // namespace ks
