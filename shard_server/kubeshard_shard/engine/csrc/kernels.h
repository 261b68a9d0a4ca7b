// The kernels one source calls from another (the fused decode step calls every one),
// declared once here; bindings.cpp exposes them to Python.
#pragma once
#include <ATen/core/Tensor.h>

#include <tuple>
#include <vector>

void paged_decode(at::Tensor out, at::Tensor q, at::Tensor k_cache, at::Tensor v_cache, at::Tensor block_tables,
                  at::Tensor context_lens, int64_t block_size, double scale);
void paged_decode_scaled(at::Tensor out, at::Tensor q, at::Tensor k_cache, at::Tensor v_cache,
                         c10::optional<at::Tensor> k_scale, c10::optional<at::Tensor> v_scale,
                         at::Tensor block_tables, at::Tensor context_lens, int64_t block_size, double scale);

namespace ks {
// The checks every GEMM makes of its arguments, naming the one that is wrong.
inline void check_2d(const at::Tensor& t, const char* what, at::ScalarType type) {
  TORCH_CHECK(t.dim() == 2 && t.is_contiguous() && t.scalar_type() == type && t.device().is_cpu(), what,
              ": expected a contiguous 2-d CPU tensor of ", c10::toString(type));
}
inline const float* bias_ptr(const c10::optional<at::Tensor>& bias, int64_t N, const char* what) {
  if (!bias || !bias->defined()) return nullptr;
  TORCH_CHECK(bias->numel() == N && bias->is_contiguous() && bias->scalar_type() == at::kFloat, what,
              ": bias must be ", N, " contiguous floats");
  return bias->data_ptr<float>();
}

// A quantized W's K and group size G (multiples of 32, G dividing K) and its `groups`
// scales a row, named as `what` when wrong.
inline void check_groups(int64_t K, int64_t G, int64_t groups, const char* what) {
  TORCH_CHECK(G > 0 && K % 32 == 0 && G % 32 == 0 && K % G == 0 && groups == K / G, what, ": K (", K,
              ") and the group size (", G, ") must be multiples of 32, G dividing K");
}

at::Tensor gemm_f32(at::Tensor x, at::Tensor w, c10::optional<at::Tensor> bias);
at::Tensor gemm_f32_packed(at::Tensor x, at::Tensor w, c10::optional<at::Tensor> bias);
at::Tensor gemm_q8(at::Tensor x, at::Tensor w, at::Tensor scales, int64_t G, c10::optional<at::Tensor> bias);
at::Tensor gemm_q4(at::Tensor x, at::Tensor w, at::Tensor scales, at::Tensor mins, int64_t G,
                   c10::optional<at::Tensor> bias);
at::Tensor dequant_rows(at::Tensor w, at::Tensor scales, c10::optional<at::Tensor> mins, int64_t G, at::Tensor ids);
std::tuple<at::Tensor, at::Tensor> rms_norm(at::Tensor x, c10::optional<at::Tensor> residual, at::Tensor weight,
                                            double eps);
void rope_(at::Tensor q, at::Tensor k, at::Tensor positions, at::Tensor cos_sin);
void kv_store(at::Tensor k, at::Tensor v, at::Tensor k_cache, at::Tensor v_cache, at::Tensor slots,
              c10::optional<at::Tensor> k_scale, c10::optional<at::Tensor> v_scale);
at::Tensor silu_mul(at::Tensor gate_up);
std::tuple<at::Tensor, at::Tensor> argmax_logsumexp(at::Tensor logits);
void apply_bitmask_(at::Tensor logits, at::Tensor mask, const std::vector<int64_t>& rows);

// Raw forms for the fused decode step (float32 activations in its own buffers): the
// arithmetic of the entry points above, bit for bit, without their argument checks and
// output allocations (the step checks once when built and once a step). y [M, N] = x [M, K]
// W^T (+ b); W's float16 scales (and int4's minimums) as their bits.
void gemm_f32_into(const float* x, int64_t M, int64_t K, const float* w, int64_t N, const float* b, float* y);
void gemm_q8_into(const float* x, int64_t M, int64_t K, const int8_t* w, const uint16_t* scales, int64_t N,
                  int64_t G, const float* b, float* y);
void gemm_q4_into(const float* x, int64_t M, int64_t K, const uint8_t* w, const uint16_t* scales,
                  const uint16_t* mins, int64_t N, int64_t G, const float* b, float* y);
// rout = x + residual and out = RMSNorm(rout) (rout may be residual itself); residual
// null: out = RMSNorm(x).
void rms_norm_into(const float* x, const float* residual, const float* weight, float* out, float* rout,
                   int64_t rows, int64_t H, double eps);
// heads of D values at x + t * stride_t + h * D, rotated in place
void rope_into(float* x, int64_t tokens, int64_t heads, int64_t D, int64_t stride_t, const int64_t* positions,
               const float* cos_sin, int64_t P);
void kv_store_into(const float* k, const float* v, int64_t tokens, int64_t H, int64_t D, int64_t stride_t,
                   const at::Tensor& k_cache, const at::Tensor& v_cache, float* k_scale, float* v_scale,
                   const int64_t* slots);
void silu_mul_into(const float* gate_up, float* out, int64_t rows, int64_t I);
// out [B, Hq, D] contiguous; sequence b's queries at q + b * q_row
void paged_decode_into(float* out, const float* q, int64_t B, int64_t Hq, int64_t D, int64_t q_row,
                       const at::Tensor& k_cache, const at::Tensor& v_cache, const float* k_scale,
                       const float* v_scale, const int32_t* tables, int64_t max_blocks, const int32_t* lens,
                       int64_t block_size, double scale);
}  // namespace ks
