// The kernels one source calls from another (the fused decode step calls every one),
// declared once here; bindings.cpp exposes them to Python.
#pragma once
#include <ATen/core/Tensor.h>

#include <tuple>

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
}  // namespace ks
