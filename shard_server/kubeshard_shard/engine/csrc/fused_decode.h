// The fused decode step (fused_decode.cpp): built once per model runner from the
// model's weights and KV pool, then run on each qualifying step.
#pragma once
#include <ATen/core/Tensor.h>

#include <vector>

#include "kernels.h"
#include "lora.h"

namespace ks {

class FusedDecode {
 public:
  static constexpr int64_t kF32 = 0, kQ8 = 1, kQ4 = 2;

  FusedDecode(at::Tensor cos_sin, at::Tensor final_norm, double final_eps, int64_t heads, int64_t kv_heads,
              int64_t head_dim, int64_t block_size, double scale);
  // A linear layer's GEMM: float32 W, or int8 (scales) or packed int4 (scales, minimums)
  // in groups of `group`; returns its index for add_layer.
  int64_t add_gemm(int64_t kind, at::Tensor w, c10::optional<at::Tensor> scales, c10::optional<at::Tensor> mins,
                   int64_t group, c10::optional<at::Tensor> bias);
  void add_layer(at::Tensor input_norm, double input_eps, at::Tensor post_norm, double post_eps, int64_t qkv,
                 int64_t o, int64_t gate_up, int64_t down, at::Tensor k_cache, at::Tensor v_cache,
                 c10::optional<at::Tensor> k_scale, c10::optional<at::Tensor> v_scale);
  // The adapters of a GEMM's layer (with LoRA on), until clear_lora: a step's runs add
  // their deltas to that GEMM's output as LoraLinear does after its base layer.
  void set_lora(int64_t gemm, const LoraPack& pack);
  void clear_lora();
  // The final norm's output [rows, hidden] for the embedded tokens `hidden`, one decoding
  // sequence per row; writes each row's K/V at its slot in every layer's pool. `runs`: the
  // rows that use adapters (lora.h), none when absent.
  at::Tensor run(at::Tensor hidden, at::Tensor positions, at::Tensor slots, at::Tensor block_tables,
                 at::Tensor context_lens, c10::optional<at::Tensor> runs) const;

 private:
  struct Gemm {
    int64_t kind;
    at::Tensor w;
    c10::optional<at::Tensor> scales, mins;
    int64_t group;
    c10::optional<at::Tensor> bias;
    int64_t N, K;
    // y [M, N] = x [M, K] W^T (+ bias)
    void operator()(const float* x, int64_t M, float* y) const;
  };
  struct Layer {
    at::Tensor input_norm;
    double input_eps;
    at::Tensor post_norm;
    double post_eps;
    int64_t qkv, o, gate_up, down;
    at::Tensor k_cache, v_cache;
    c10::optional<at::Tensor> k_scale, v_scale;
  };
  at::Tensor cos_sin_, final_norm_;
  double final_eps_;
  int64_t heads_, kv_heads_, head_dim_, block_size_;
  double scale_;
  int64_t hidden_, intermediate_ = 0;  // the model's widths (the MLP's from the first layer)
  std::vector<Gemm> gemms_;
  std::vector<c10::optional<LoraPack>> lora_;  // by GEMM, as set_lora left them
  int64_t lora_width_ = 0;                     // the most columns of xa a pack needs (n_sub · R)
  std::vector<Layer> layers_;
};

}  // namespace ks
