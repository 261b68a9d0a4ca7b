// Multi-LoRA deltas on CPU: y[t] += (x[t] A_sᵀ) B_sᵀ for each row t of slot s, over one
// wrapped layer's stacked adapters (models/lora.py: A [S, n_sub·R, K], and per
// sub-projection i Bᵀ_i [S, R, size_i], whose output columns start at offsets[i]).
//
// Why ours: the torch path (a masked GEMM over a window of slots and one addmm_ per
// sub-projection) is a handful of dispatches per layer and is what the modules run on
// other devices and dtypes; here the whole layer is two passes in one call, and the fused
// decode step calls the same raw form, so a step's adapter rows have the same bits through
// the modules and through the fused step (tests/shard_server/test_fused_decode.py).
//
// The step's rows come as runs (slot, first row, end row): the runner puts rows of one
// adapter side by side, so a batch of four adapters is four runs. Pass one (shrink):
// xa[t, c] = x[t] · A_s[c], a run's rows reading each row of A_s once. Pass two (expand):
// each output column's delta over the R entries of its sub-projection, added to y. Each
// value's arithmetic depends on its row and column alone (not on the threads, the other
// rows or the runs), so the result is the same whichever way the work is split.
#include "lora.h"

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>

#include <vector>

#include "simd.h"

namespace ks {

namespace {

// work items are split over the threads only past this many multiply-adds each: a layer's
// deltas at decode batches are tens of microseconds, about what waking a thread costs
constexpr int64_t kGrainMacs = 1 << 15;
constexpr int64_t kShrinkCols = 4;   // columns of xa (rows of A) an item of pass one computes
constexpr int64_t kExpandCols = 64;  // output columns an item of pass two computes

float dot(const float* a, const float* b, int64_t K) {
  int64_t k = 0;
  float sum = 0.f;
#if defined(KS_AVX2)
  __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
  for (; k + 16 <= K; k += 16) {
    acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + k), _mm256_loadu_ps(b + k), acc0);
    acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + k + 8), _mm256_loadu_ps(b + k + 8), acc1);
  }
  for (; k + 8 <= K; k += 8) acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + k), _mm256_loadu_ps(b + k), acc0);
  sum = hsum256(_mm256_add_ps(acc0, acc1));
#endif
  for (; k < K; ++k) sum += a[k] * b[k];
  return sum;
}

// y[j] += Σ_r xa[r] · bt[r, j] for columns [j0, j1) of a [R, ld] matrix bt
void expand_row(const float* xa, const float* bt, int64_t R, int64_t ld, int64_t j0, int64_t j1, float* y) {
  int64_t j = j0;
#if defined(KS_AVX2)
  for (; j + 8 <= j1; j += 8) {
    __m256 acc = _mm256_setzero_ps();
    for (int64_t r = 0; r < R; ++r) acc = _mm256_fmadd_ps(_mm256_set1_ps(xa[r]), _mm256_loadu_ps(bt + r * ld + j), acc);
    _mm256_storeu_ps(y + j, _mm256_add_ps(_mm256_loadu_ps(y + j), acc));
  }
#endif
  for (; j < j1; ++j) {
    float acc = 0.f;
    for (int64_t r = 0; r < R; ++r) acc += xa[r] * bt[r * ld + j];
    y[j] += acc;
  }
}

}  // namespace

void lora_add_into(const float* x, int64_t K, float* y, int64_t N, const LoraPackView& p, const LoraRun* runs,
                   int64_t n_runs, float* xa) {
  const int64_t R = p.rank, n_sub = static_cast<int64_t>(p.bt.size()), C = n_sub * R;
  std::vector<LoraRun> used;
  int64_t rows = 0;
  for (int64_t i = 0; i < n_runs; ++i)
    if (p.has(runs[i].slot)) {
      used.push_back(runs[i]);
      rows += runs[i].end - runs[i].start;
    }
  if (used.empty()) return;
  // pass one: items are (run, block of kShrinkCols columns of xa)
  const int64_t blocks = (C + kShrinkCols - 1) / kShrinkCols, items = static_cast<int64_t>(used.size()) * blocks;
  const int64_t shrink_grain = std::max<int64_t>(1, kGrainMacs * items / std::max<int64_t>(1, rows * C * K));
  at::parallel_for(0, items, shrink_grain, [&](int64_t i0, int64_t i1) {
    for (int64_t item = i0; item < i1; ++item) {
      const LoraRun& run = used[item / blocks];
      const int64_t c0 = item % blocks * kShrinkCols, c1 = std::min(C, c0 + kShrinkCols);
      const float* a = p.a + (run.slot - 1) * C * K;
      for (int64_t t = run.start; t < run.end; ++t)
        for (int64_t c = c0; c < c1; ++c) xa[t * C + c] = dot(x + t * K, a + c * K, K);
    }
  });
  // pass two: items are blocks of kExpandCols columns of one sub-projection
  std::vector<std::pair<int64_t, int64_t>> cols;  // (sub-projection, first column)
  int64_t width = 0;
  for (int64_t i = 0; i < n_sub; ++i) {
    for (int64_t j = 0; j < p.sizes[i]; j += kExpandCols) cols.emplace_back(i, j);
    width += p.sizes[i];
  }
  const int64_t n_cols = static_cast<int64_t>(cols.size());
  const int64_t expand_grain = std::max<int64_t>(1, kGrainMacs * n_cols / std::max<int64_t>(1, rows * R * width));
  at::parallel_for(0, n_cols, expand_grain, [&](int64_t i0, int64_t i1) {
    for (int64_t item = i0; item < i1; ++item) {
      const auto [i, j0] = cols[item];
      const int64_t size = p.sizes[i], j1 = std::min(size, j0 + kExpandCols);
      for (const LoraRun& run : used) {
        const float* bt = p.bt[i] + (run.slot - 1) * R * size;
        for (int64_t t = run.start; t < run.end; ++t)
          expand_row(xa + t * C + i * R, bt, R, size, j0, j1, y + t * N + p.offsets[i]);
      }
    }
  });
}

LoraPack::LoraPack(at::Tensor a, std::vector<at::Tensor> bt, std::vector<int64_t> offsets,
                   std::vector<int64_t> present)
    : a_(std::move(a)), bt_(std::move(bt)), offsets_(std::move(offsets)) {
  TORCH_CHECK(a_.dim() == 3 && a_.is_contiguous() && a_.scalar_type() == at::kFloat && a_.device().is_cpu(),
              "LoraPack: A must be contiguous float32 [slots, sub-projections * rank, in] on the CPU");
  const int64_t S = a_.size(0), n_sub = static_cast<int64_t>(bt_.size());
  TORCH_CHECK(n_sub > 0 && offsets_.size() == bt_.size() && a_.size(1) % n_sub == 0,
              "LoraPack: one Bᵀ and one output offset per sub-projection, and A's rows a multiple of their count");
  const int64_t R = a_.size(1) / n_sub;
  view_.a = a_.data_ptr<float>();
  view_.rank = R;
  view_.offsets = offsets_;
  for (const at::Tensor& b : bt_) {
    TORCH_CHECK(b.dim() == 3 && b.is_contiguous() && b.scalar_type() == at::kFloat && b.size(0) == S &&
                b.size(1) == R && b.device().is_cpu(), "LoraPack: each Bᵀ must be contiguous float32 [", S, ", ", R,
                ", size]");
    view_.bt.push_back(b.data_ptr<float>());
    view_.sizes.push_back(b.size(2));
  }
  view_.present.assign(S + 1, 0);
  for (int64_t s : present) {
    TORCH_CHECK(s >= 1 && s <= S, "LoraPack: slot ", s, " is outside 1..", S);
    view_.present[s] = 1;
  }
}

void LoraPack::check(int64_t K, int64_t N, const char* what) const {
  TORCH_CHECK(a_.size(2) == K, what, ": the adapters' A has ", a_.size(2), " inputs, the layer ", K);
  for (size_t i = 0; i < bt_.size(); ++i)
    TORCH_CHECK(offsets_[i] >= 0 && offsets_[i] + view_.sizes[i] <= N, what, ": sub-projection ", i,
                " (columns ", offsets_[i], "..", offsets_[i] + view_.sizes[i], ") is outside the layer's ", N);
}

std::vector<LoraRun> lora_runs(const at::Tensor& runs, int64_t rows, const char* what) {
  TORCH_CHECK(runs.dim() == 2 && runs.size(1) == 3 && runs.is_contiguous() && runs.scalar_type() == at::kLong &&
              runs.device().is_cpu(), what, ": runs must be a contiguous int64 [n, 3] CPU tensor of "
              "(slot, first row, end row)");
  const int64_t* r = runs.data_ptr<int64_t>();
  std::vector<LoraRun> out;
  int64_t last = 0;
  for (int64_t i = 0; i < runs.size(0); ++i) {
    const LoraRun run{r[3 * i], r[3 * i + 1], r[3 * i + 2]};
    TORCH_CHECK(run.slot >= 1 && run.start >= last && run.start < run.end && run.end <= rows, what, ": run ", i,
                " (slot ", run.slot, ", rows ", run.start, "..", run.end, ") must name a slot from 1 and rows in "
                "order within the ", rows, " rows");
    last = run.end;
    out.push_back(run);
  }
  return out;
}

void lora_add_(at::Tensor y, at::Tensor x, at::Tensor runs, const LoraPack& pack) {
  check_2d(x, "lora_add_ x", at::kFloat);
  check_2d(y, "lora_add_ y", at::kFloat);
  TORCH_CHECK(y.size(0) == x.size(0), "lora_add_: x has ", x.size(0), " rows, y ", y.size(0));
  pack.check(x.size(1), y.size(1), "lora_add_");
  const std::vector<LoraRun> r = lora_runs(runs, x.size(0), "lora_add_");
  const LoraPackView& p = pack.view();
  at::Tensor xa = at::empty({x.size(0) * p.rank * static_cast<int64_t>(p.bt.size())}, x.options());
  lora_add_into(x.data_ptr<float>(), x.size(1), y.data_ptr<float>(), y.size(1), p, r.data(),
                static_cast<int64_t>(r.size()), xa.data_ptr<float>());
}

}  // namespace ks
