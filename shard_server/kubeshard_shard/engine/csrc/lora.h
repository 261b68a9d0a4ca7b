// Multi-LoRA deltas on CPU (lora.cpp): a wrapped layer's stacked adapters, checked once
// when made, and the raw form the fused decode step calls.
#pragma once
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

#include "kernels.h"

namespace ks {

// rows [start, end) of a step use the adapter in `slot` (1-based; slot 0, the base model,
// has no runs)
struct LoraRun {
  int64_t slot, start, end;
};

// A LoraPack's arrays as raw pointers: A [S, n_sub·R, K], Bᵀ_i [S, R, sizes[i]], and
// whether each slot (0..S) has an adapter that adapts this layer.
struct LoraPackView {
  const float* a = nullptr;
  std::vector<const float*> bt;
  std::vector<int64_t> sizes, offsets;
  int64_t rank = 0;
  std::vector<uint8_t> present;
  bool has(int64_t slot) const { return slot > 0 && slot < static_cast<int64_t>(present.size()) && present[slot]; }
};

// One wrapped layer's stacked adapters (models/lora.py LayerPack), holding its tensors.
class LoraPack {
 public:
  LoraPack(at::Tensor a, std::vector<at::Tensor> bt, std::vector<int64_t> offsets, std::vector<int64_t> present);
  // that the pack fits a layer of K inputs and N outputs, naming `what` when not
  void check(int64_t K, int64_t N, const char* what) const;
  const LoraPackView& view() const { return view_; }

 private:
  at::Tensor a_;
  std::vector<at::Tensor> bt_;
  std::vector<int64_t> offsets_;
  LoraPackView view_;
};

// The runs of a [n, 3] int64 tensor (slot, first row, end row), checked: slots from 1,
// rows in order within `rows`.
std::vector<LoraRun> lora_runs(const at::Tensor& runs, int64_t rows, const char* what);

// y [rows, N] += each run's rows' deltas, x [rows, K]; xa: room for rows · n_sub · R
// floats. Runs of slots the pack lacks add nothing.
void lora_add_into(const float* x, int64_t K, float* y, int64_t N, const LoraPackView& p, const LoraRun* runs,
                   int64_t n_runs, float* xa);

// The tensor form: y += the deltas of x's rows, in place.
void lora_add_(at::Tensor y, at::Tensor x, at::Tensor runs, const LoraPack& pack);

}  // namespace ks
