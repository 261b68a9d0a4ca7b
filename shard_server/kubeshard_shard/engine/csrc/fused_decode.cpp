// A decode-only step through every layer of a Llama-family model in one call.
//
// Why: at batch 1 a decoder layer makes about a dozen kernel calls, and each costs a
// Python module call, a few tensor views and the binding's argument checks on top of its
// arithmetic: tens of microseconds a call, milliseconds a step at 30 layers, against a
// step of 5-25 ms. Here the loop over layers runs in C++ and calls the raw forms of the
// kernels the modules call (kernels.h: their arithmetic, without the checks and output
// allocations each call made), in the modules' order, on one buffer of activations a
// step, so the logits and the K/V it writes are the modules' bit for bit
// (tests/shard_server/test_fused_decode.py compares them). Calling the tensor entry
// points instead, with a tensor view for each of q, k and v, cost about 1.2 ms a step of
// the default model's 8-10 (int8, 2 cores): views, allocations and checks, not arithmetic.
// The arguments are checked once when a GEMM or layer is added and once a step.
// engine/fused_decode.py decides when a model and a step qualify.
#include "fused_decode.h"

#include <ATen/ops/empty.h>

#include <algorithm>
#include <cstring>
#include <utility>

namespace ks {

void FusedDecode::Gemm::operator()(const float* x, int64_t M, float* y) const {
  const float* b = bias ? bias->data_ptr<float>() : nullptr;
  switch (kind) {
    case kF32: gemm_f32_into(x, M, K, w.data_ptr<float>(), N, b, y); break;
    case kQ8:
      gemm_q8_into(x, M, K, w.data_ptr<int8_t>(), reinterpret_cast<const uint16_t*>(scales->data_ptr<at::Half>()), N,
                   group, b, y);
      break;
    default:
      gemm_q4_into(x, M, K, w.data_ptr<uint8_t>(), reinterpret_cast<const uint16_t*>(scales->data_ptr<at::Half>()),
                   reinterpret_cast<const uint16_t*>(mins->data_ptr<at::Half>()), N, group, b, y);
  }
}

FusedDecode::FusedDecode(at::Tensor cos_sin, at::Tensor final_norm, double final_eps, int64_t heads,
                         int64_t kv_heads, int64_t head_dim, int64_t block_size, double scale)
    : cos_sin_(std::move(cos_sin)), final_norm_(std::move(final_norm)), final_eps_(final_eps), heads_(heads),
      kv_heads_(kv_heads), head_dim_(head_dim), block_size_(block_size), scale_(scale),
      hidden_(final_norm_.numel()) {
  TORCH_CHECK(cos_sin_.scalar_type() == at::kFloat && cos_sin_.is_contiguous() && cos_sin_.dim() == 3 &&
              cos_sin_.size(0) == 2 && cos_sin_.size(2) == head_dim, "FusedDecode: cos_sin must be contiguous "
              "float32 [2, positions, head_dim]");
  TORCH_CHECK(final_norm_.scalar_type() == at::kFloat && final_norm_.is_contiguous(), "FusedDecode: the final norm's "
              "weight must be contiguous float32");
  TORCH_CHECK(heads > 0 && kv_heads > 0 && heads % kv_heads == 0 && head_dim % 16 == 0 && head_dim <= 256 &&
              block_size > 0, "FusedDecode: heads a multiple of the KV heads, head_dim a multiple of 16 up to 256");
}

int64_t FusedDecode::add_gemm(int64_t kind, at::Tensor w, c10::optional<at::Tensor> scales,
                              c10::optional<at::Tensor> mins, int64_t group, c10::optional<at::Tensor> bias) {
  TORCH_CHECK(kind == kF32 || kind == kQ8 || kind == kQ4, "FusedDecode.add_gemm: kind 0 (float32), 1 (int8) or "
              "2 (int4), got ", kind);
  check_2d(w, "FusedDecode.add_gemm weight", kind == kF32 ? at::kFloat : kind == kQ8 ? at::kChar : at::kByte);
  const int64_t N = w.size(0), K = kind == kQ4 ? 2 * w.size(1) : w.size(1);
  if (kind != kF32) {
    TORCH_CHECK(scales.has_value(), "FusedDecode.add_gemm: a quantized weight needs its scales");
    TORCH_CHECK(kind != kQ4 || mins.has_value(), "FusedDecode.add_gemm: an int4 weight needs its minimums");
    check_2d(*scales, "FusedDecode.add_gemm scales", at::kHalf);
    TORCH_CHECK(scales->size(0) == N, "FusedDecode.add_gemm: a row of scales per row of the weight");
    check_groups(K, group, scales->size(1), "FusedDecode.add_gemm");
    if (kind == kQ4) {
      check_2d(*mins, "FusedDecode.add_gemm minimums", at::kHalf);
      TORCH_CHECK(mins->sizes() == scales->sizes(), "FusedDecode.add_gemm: a minimum per scale");
    }
  }
  if (bias && bias->defined()) bias_ptr(bias, N, "FusedDecode.add_gemm");
  else bias = c10::nullopt;
  gemms_.push_back(Gemm{kind, std::move(w), std::move(scales), std::move(mins), group, std::move(bias), N, K});
  return static_cast<int64_t>(gemms_.size()) - 1;
}

void FusedDecode::add_layer(at::Tensor input_norm, double input_eps, at::Tensor post_norm, double post_eps,
                            int64_t qkv, int64_t o, int64_t gate_up, int64_t down, at::Tensor k_cache,
                            at::Tensor v_cache, c10::optional<at::Tensor> k_scale,
                            c10::optional<at::Tensor> v_scale) {
  const int64_t n = static_cast<int64_t>(gemms_.size());
  for (int64_t g : {qkv, o, gate_up, down})
    TORCH_CHECK(g >= 0 && g < n, "FusedDecode.add_layer: no GEMM ", g, " (add_gemm gives the indices)");
  for (const at::Tensor* norm : {&input_norm, &post_norm})
    TORCH_CHECK(norm->scalar_type() == at::kFloat && norm->is_contiguous() && norm->numel() == hidden_,
                "FusedDecode.add_layer: norm weights must be ", hidden_, " contiguous floats");
  const int64_t q_size = heads_ * head_dim_, kv_size = kv_heads_ * head_dim_;
  if (layers_.empty()) intermediate_ = gemms_[gate_up].N / 2;
  const Gemm &g_qkv = gemms_[qkv], &g_o = gemms_[o], &g_gu = gemms_[gate_up], &g_down = gemms_[down];
  TORCH_CHECK(g_qkv.K == hidden_ && g_qkv.N == q_size + 2 * kv_size && g_o.K == q_size && g_o.N == hidden_ &&
              g_gu.K == hidden_ && g_gu.N == 2 * intermediate_ && g_down.K == intermediate_ && g_down.N == hidden_,
              "FusedDecode.add_layer: the GEMMs' shapes do not fit the model's widths (hidden ", hidden_,
              ", queries ", q_size, ", keys ", kv_size, ", MLP ", intermediate_, ")");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.dim() == 3 &&
              k_cache.sizes() == v_cache.sizes() && k_cache.size(1) == kv_heads_ && k_cache.size(2) == head_dim_ &&
              k_cache.scalar_type() == v_cache.scalar_type(),
              "FusedDecode.add_layer: caches [slots, kv heads, head_dim] of one type");
  const auto ct = k_cache.scalar_type();
  TORCH_CHECK(ct == at::kFloat || ct == at::kBFloat16 || ct == at::kHalf || ct == at::kChar,
              "FusedDecode.add_layer: the cache must be float32, bfloat16, float16 or int8");
  if (ct == at::kChar) {
    TORCH_CHECK(k_scale && v_scale && k_scale->scalar_type() == at::kFloat && v_scale->scalar_type() == at::kFloat &&
                k_scale->is_contiguous() && v_scale->is_contiguous() &&
                k_scale->numel() == k_cache.size(0) * kv_heads_ && v_scale->numel() == k_cache.size(0) * kv_heads_,
                "FusedDecode.add_layer: an int8 cache needs float32 scales [slots, kv heads]");
  }
  if (!layers_.empty())
    TORCH_CHECK(k_cache.sizes() == layers_[0].k_cache.sizes() && ct == layers_[0].k_cache.scalar_type(),
                "FusedDecode.add_layer: every layer's cache has the first's shape and type");
  layers_.push_back(Layer{std::move(input_norm), input_eps, std::move(post_norm), post_eps, qkv, o, gate_up, down,
                          std::move(k_cache), std::move(v_cache), std::move(k_scale), std::move(v_scale)});
}

void FusedDecode::set_lora(int64_t gemm, const LoraPack& pack) {
  TORCH_CHECK(gemm >= 0 && gemm < static_cast<int64_t>(gemms_.size()), "FusedDecode.set_lora: no GEMM ", gemm);
  pack.check(gemms_[gemm].K, gemms_[gemm].N, "FusedDecode.set_lora");
  lora_.resize(gemms_.size());
  lora_[gemm] = pack;
  const LoraPackView& p = pack.view();
  lora_width_ = std::max<int64_t>(lora_width_, p.rank * static_cast<int64_t>(p.bt.size()));
}

void FusedDecode::clear_lora() {
  lora_.clear();
  lora_width_ = 0;
}

at::Tensor FusedDecode::run(at::Tensor hidden, at::Tensor positions, at::Tensor slots, at::Tensor block_tables,
                            at::Tensor context_lens, c10::optional<at::Tensor> runs) const {
  TORCH_CHECK(!layers_.empty(), "FusedDecode.run: no layers (add_layer adds them)");
  TORCH_CHECK(hidden.dim() == 2 && hidden.size(0) == positions.numel() && hidden.size(0) == slots.numel() &&
              hidden.size(0) == context_lens.numel(), "FusedDecode.run: one position, slot and context length "
              "per row of hidden");
  check_2d(hidden, "FusedDecode.run hidden", at::kFloat);
  TORCH_CHECK(hidden.size(1) == hidden_, "FusedDecode.run: hidden has ", hidden.size(1), " columns, the model ",
              hidden_);
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.is_contiguous() && slots.scalar_type() == at::kLong &&
              slots.is_contiguous(), "FusedDecode.run: int64 positions and slots");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && context_lens.scalar_type() == at::kInt &&
              block_tables.is_contiguous() && context_lens.is_contiguous() && block_tables.dim() == 2 &&
              block_tables.size(0) >= hidden.size(0), "FusedDecode.run: contiguous int32 block tables (a row a "
              "sequence) and lengths");
  const int64_t rows = hidden.size(0), H = hidden_, I = intermediate_, D = head_dim_;
  const int64_t q_size = heads_ * D, kv_size = kv_heads_ * D, qkv_n = q_size + 2 * kv_size;
  const int64_t P = cos_sin_.size(1), S = layers_[0].k_cache.size(0);
  const int64_t* pos = positions.data_ptr<int64_t>();
  const int64_t* sl = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < rows; ++t) {
    TORCH_CHECK(pos[t] >= 0 && pos[t] < P, "FusedDecode.run: position ", pos[t], " out of range");
    TORCH_CHECK(sl[t] >= 0 && sl[t] < S, "FusedDecode.run: slot ", sl[t], " out of range");
  }
  std::vector<LoraRun> lora_runs_;
  if (runs && runs->defined()) lora_runs_ = lora_runs(*runs, rows, "FusedDecode.run");
  const bool lora = !lora_runs_.empty() && !lora_.empty();
  // the step's activations, one buffer reused by every layer: the residual stream, the
  // norm's output, a GEMM's [rows, hidden] output, q|k|v, attention's output, gate|up,
  // SwiGLU's output and (with adapter rows) x·Aᵀ of the adapters' runs
  at::Tensor buffer = at::empty({rows * (3 * H + qkv_n + q_size + 3 * I + (lora ? lora_width_ : 0))},
                                hidden.options());
  float* res = buffer.data_ptr<float>();
  float* normed = res + rows * H;
  float* out = normed + rows * H;
  float* qkv = out + rows * H;
  float* attn = qkv + rows * qkv_n;
  float* gu = attn + rows * q_size;
  float* act = gu + rows * 2 * I;
  float* xa = act + rows * I;
  // a GEMM's output, then (LoraLinear.forward) its adapters' deltas
  auto project = [&](int64_t g, const float* x, float* y) {
    const Gemm& gemm = gemms_[g];
    gemm(x, rows, y);
    if (lora && lora_[g])
      lora_add_into(x, gemm.K, y, gemm.N, lora_[g]->view(), lora_runs_.data(),
                    static_cast<int64_t>(lora_runs_.size()), xa);
  };
  const float* cs = cos_sin_.data_ptr<float>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int32_t* lens = context_lens.data_ptr<int32_t>();
  // LlamaDecoderLayer.forward: the first layer's residual is its input
  std::memcpy(res, hidden.data_ptr<float>(), sizeof(float) * rows * H);
  for (size_t i = 0; i < layers_.size(); ++i) {
    const Layer& l = layers_[i];
    if (i == 0)
      rms_norm_into(res, nullptr, l.input_norm.data_ptr<float>(), normed, nullptr, rows, H, l.input_eps);
    else  // the residual stream takes the last layer's output in place
      rms_norm_into(out, res, l.input_norm.data_ptr<float>(), normed, res, rows, H, l.input_eps);
    // LlamaAttention.forward: q, k and v are column ranges of the projection's output
    project(l.qkv, normed, qkv);
    rope_into(qkv, rows, heads_, D, qkv_n, pos, cs, P);
    rope_into(qkv + q_size, rows, kv_heads_, D, qkv_n, pos, cs, P);
    // PagedAttention.forward, a decode-only step: the K/V write, then the decode kernel
    const bool int8_cache = l.k_cache.scalar_type() == at::kChar;
    float* ks = int8_cache ? l.k_scale->data_ptr<float>() : nullptr;
    float* vs = int8_cache ? l.v_scale->data_ptr<float>() : nullptr;
    kv_store_into(qkv + q_size, qkv + q_size + kv_size, rows, kv_heads_, D, qkv_n, l.k_cache, l.v_cache, ks, vs, sl);
    paged_decode_into(attn, qkv, rows, heads_, D, qkv_n, l.k_cache, l.v_cache, ks, vs, tables, block_tables.size(1),
                      lens, block_size_, scale_);
    project(l.o, attn, out);
    rms_norm_into(out, res, l.post_norm.data_ptr<float>(), normed, res, rows, H, l.post_eps);
    // LlamaMLP.forward
    project(l.gate_up, normed, gu);
    silu_mul_into(gu, act, rows, I);
    project(l.down, act, out);
  }
  at::Tensor final_out = at::empty({rows, H}, hidden.options());
  rms_norm_into(out, res, final_norm_.data_ptr<float>(), final_out.data_ptr<float>(), res, rows, H, final_eps_);
  return final_out;
}

}  // namespace ks
