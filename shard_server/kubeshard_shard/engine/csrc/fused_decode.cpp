// A decode-only step through every layer of a Llama-family model in one call.
//
// Why: at batch 1 a decoder layer makes about a dozen kernel calls, and each costs a
// Python module call, a few tensor views and the binding's argument checks on top of its
// arithmetic: tens of microseconds a call, milliseconds a step at 30 layers, against a
// step of 5-25 ms. Here the loop over layers runs in C++ and calls the very kernels the
// modules call, in the modules' order, with the same arguments, so the logits and the
// K/V it writes are the modules' bit for bit (tests/shard_server/test_fused_decode.py
// compares them). engine/fused_decode.py decides when a model and a step qualify.
#include "fused_decode.h"

#include <ATen/ops/empty.h>

#include <tuple>
#include <utility>

namespace ks {

at::Tensor FusedDecode::Gemm::operator()(const at::Tensor& x) const {
  switch (kind) {
    case kF32: return gemm_f32(x.contiguous(), w, bias);
    case kQ8: return gemm_q8(x.contiguous(), w, *scales, group, bias);
    default: return gemm_q4(x.contiguous(), w, *scales, *mins, group, bias);
  }
}

FusedDecode::FusedDecode(at::Tensor cos_sin, at::Tensor final_norm, double final_eps, int64_t heads,
                         int64_t kv_heads, int64_t head_dim, int64_t block_size, double scale)
    : cos_sin_(std::move(cos_sin)), final_norm_(std::move(final_norm)), final_eps_(final_eps), heads_(heads),
      kv_heads_(kv_heads), head_dim_(head_dim), block_size_(block_size), scale_(scale) {}

int64_t FusedDecode::add_gemm(int64_t kind, at::Tensor w, c10::optional<at::Tensor> scales,
                              c10::optional<at::Tensor> mins, int64_t group, c10::optional<at::Tensor> bias) {
  TORCH_CHECK(kind == kF32 || kind == kQ8 || kind == kQ4, "FusedDecode.add_gemm: kind 0 (float32), 1 (int8) or "
              "2 (int4), got ", kind);
  TORCH_CHECK(kind == kF32 || scales.has_value(), "FusedDecode.add_gemm: a quantized weight needs its scales");
  TORCH_CHECK(kind != kQ4 || mins.has_value(), "FusedDecode.add_gemm: an int4 weight needs its minimums");
  gemms_.push_back(Gemm{kind, std::move(w), std::move(scales), std::move(mins), group, std::move(bias)});
  return static_cast<int64_t>(gemms_.size()) - 1;
}

void FusedDecode::add_layer(at::Tensor input_norm, double input_eps, at::Tensor post_norm, double post_eps,
                            int64_t qkv, int64_t o, int64_t gate_up, int64_t down, at::Tensor k_cache,
                            at::Tensor v_cache, c10::optional<at::Tensor> k_scale,
                            c10::optional<at::Tensor> v_scale) {
  const int64_t n = static_cast<int64_t>(gemms_.size());
  for (int64_t g : {qkv, o, gate_up, down})
    TORCH_CHECK(g >= 0 && g < n, "FusedDecode.add_layer: no GEMM ", g, " (add_gemm gives the indices)");
  layers_.push_back(Layer{std::move(input_norm), input_eps, std::move(post_norm), post_eps, qkv, o, gate_up, down,
                          std::move(k_cache), std::move(v_cache), std::move(k_scale), std::move(v_scale)});
}

at::Tensor FusedDecode::run(at::Tensor hidden, at::Tensor positions, at::Tensor slots, at::Tensor block_tables,
                            at::Tensor context_lens) const {
  TORCH_CHECK(hidden.dim() == 2 && hidden.size(0) == positions.numel() && hidden.size(0) == slots.numel() &&
              hidden.size(0) == context_lens.numel(), "FusedDecode.run: one position, slot and context length "
              "per row of hidden");
  const int64_t rows = hidden.size(0), q_size = heads_ * head_dim_, kv_size = kv_heads_ * head_dim_;
  const at::Tensor pos = positions.contiguous();
  at::Tensor residual;
  for (size_t i = 0; i < layers_.size(); ++i) {
    const Layer& l = layers_[i];
    // LlamaDecoderLayer.forward: the first layer's residual is its input
    if (i == 0) {
      residual = hidden;
      hidden = std::get<0>(rms_norm(hidden, c10::nullopt, l.input_norm, l.input_eps));
    } else {
      std::tie(hidden, residual) = rms_norm(hidden, residual, l.input_norm, l.input_eps);
    }
    // LlamaAttention.forward: q, k and v are views of the projection's output
    const at::Tensor qkv = gemms_[l.qkv](hidden);
    const at::Tensor q = qkv.narrow(1, 0, q_size).view({rows, heads_, head_dim_});
    const at::Tensor k = qkv.narrow(1, q_size, kv_size).view({rows, kv_heads_, head_dim_});
    const at::Tensor v = qkv.narrow(1, q_size + kv_size, kv_size).view({rows, kv_heads_, head_dim_});
    rope_(q, k, pos, cos_sin_);
    // PagedAttention.forward, a decode-only step: the K/V write, then the decode kernel
    kv_store(k, v, l.k_cache, l.v_cache, slots, l.k_scale, l.v_scale);
    at::Tensor attn = at::empty({rows, heads_, head_dim_}, q.options());
    paged_decode_scaled(attn, q.contiguous(), l.k_cache, l.v_cache, l.k_scale, l.v_scale, block_tables,
                        context_lens, block_size_, scale_);
    hidden = gemms_[l.o](attn.reshape({rows, q_size}));
    std::tie(hidden, residual) = rms_norm(hidden, residual, l.post_norm, l.post_eps);
    // LlamaMLP.forward
    hidden = gemms_[l.down](silu_mul(gemms_[l.gate_up](hidden)));
  }
  return std::get<0>(rms_norm(hidden, residual, final_norm_, final_eps_));
}

}  // namespace ks
