// The Python module of the CPU kernels (kernels.py builds it from every .cpp here).
#include <torch/extension.h>

void paged_decode(torch::Tensor out, torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                  torch::Tensor block_tables, torch::Tensor context_lens, int64_t block_size, double scale);
void paged_decode_scaled(torch::Tensor out, torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                         c10::optional<torch::Tensor> k_scale, c10::optional<torch::Tensor> v_scale,
                         torch::Tensor block_tables, torch::Tensor context_lens, int64_t block_size, double scale);

namespace ks {
torch::Tensor gemm_f32(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias);
torch::Tensor gemm_q8(torch::Tensor x, torch::Tensor w, torch::Tensor scales, int64_t G,
                      c10::optional<torch::Tensor> bias);
torch::Tensor gemm_q4(torch::Tensor x, torch::Tensor w, torch::Tensor scales, torch::Tensor mins, int64_t G,
                      c10::optional<torch::Tensor> bias);
torch::Tensor dequant_rows(torch::Tensor w, torch::Tensor scales, c10::optional<torch::Tensor> mins, int64_t G,
                           torch::Tensor ids);
std::tuple<torch::Tensor, torch::Tensor> rms_norm(torch::Tensor x, c10::optional<torch::Tensor> residual,
                                                  torch::Tensor weight, double eps);
void rope_(torch::Tensor q, torch::Tensor k, torch::Tensor positions, torch::Tensor cos_sin);
void kv_store(torch::Tensor k, torch::Tensor v, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor slots,
              c10::optional<torch::Tensor> k_scale, c10::optional<torch::Tensor> v_scale);
torch::Tensor silu_mul(torch::Tensor gate_up);
}  // namespace ks

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode", &paged_decode, "decode attention over a paged KV cache (float32, bfloat16, float16)");
  m.def("paged_decode_scaled", &paged_decode_scaled, "decode attention over a paged KV cache, int8 with scales too");
  m.def("gemm_f32", &ks::gemm_f32, "y = x W^T (+ b) for a few rows of x, float32 W");
  m.def("gemm_q8", &ks::gemm_q8, "y = x W^T (+ b), int8 W with float16 scales per group");
  m.def("gemm_q4", &ks::gemm_q4, "y = x W^T (+ b), packed int4 W with float16 scales and minimums per group");
  m.def("dequant_rows", &ks::dequant_rows, "rows of an int8 or packed int4 matrix as float32");
  m.def("rms_norm", &ks::rms_norm, "(RMSNorm(x + residual), x + residual), or (RMSNorm(x), x)");
  m.def("rope_", &ks::rope_, "rotary embedding of q and k, in place");
  m.def("kv_store", &ks::kv_store, "write K/V rows into the paged cache (quantizing for int8)");
  m.def("silu_mul", &ks::silu_mul, "silu(gate) * up of a fused gate|up projection");
}
