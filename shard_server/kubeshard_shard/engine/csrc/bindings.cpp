// The Python module of the CPU kernels (kernels.py builds it from every .cpp here).
#include <torch/extension.h>

#include "fused_decode.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode", &paged_decode, "decode attention over a paged KV cache (float32, bfloat16, float16)");
  m.def("paged_decode_scaled", &paged_decode_scaled, "decode attention over a paged KV cache, int8 with scales too");
  m.def("gemm_f32", &ks::gemm_f32, "y = x W^T (+ b) for a few rows of x, float32 W");
  m.def("gemm_f32_packed", &ks::gemm_f32_packed, "y = x W^T (+ b) for many rows of x, float32 W (tiles packed)");
  m.def("gemm_q8", &ks::gemm_q8, "y = x W^T (+ b), int8 W with float16 scales per group");
  m.def("gemm_q4", &ks::gemm_q4, "y = x W^T (+ b), packed int4 W with float16 scales and minimums per group");
  m.def("dequant_rows", &ks::dequant_rows, "rows of an int8 or packed int4 matrix as float32");
  m.def("rms_norm", &ks::rms_norm, "(RMSNorm(x + residual), x + residual), or (RMSNorm(x), x)");
  m.def("rope_", &ks::rope_, "rotary embedding of q and k, in place");
  m.def("kv_store", &ks::kv_store, "write K/V rows into the paged cache (quantizing for int8)");
  m.def("silu_mul", &ks::silu_mul, "silu(gate) * up of a fused gate|up projection");
  m.def("argmax_logsumexp", &ks::argmax_logsumexp, "each row's argmax and log-sum-exp (float32 logits)");
  m.def("apply_bitmask_", &ks::apply_bitmask_, "logits a grammar's bitmask forbids set to -inf, in place");
  // module_local: a process may load several builds of this module (a test builds the
  // portable ones beside the native one), and pybind11 registers classes process-wide
  py::class_<ks::LoraPack>(m, "LoraPack", py::module_local(),
                           "a layer's stacked LoRA adapters: A, each sub-projection's B^T, offsets, slots (lora.cpp)")
      .def(py::init<at::Tensor, std::vector<at::Tensor>, std::vector<int64_t>, std::vector<int64_t>>());
  m.def("lora_add_", &ks::lora_add_, "y += the LoRA deltas of x's rows, each run (slot, first, end) its adapter's");
  py::class_<ks::FusedDecode>(m, "FusedDecode", py::module_local(),
                              "a decode-only step through every layer (fused_decode.cpp)")
      .def(py::init<at::Tensor, at::Tensor, double, int64_t, int64_t, int64_t, int64_t, double>())
      .def("add_gemm", &ks::FusedDecode::add_gemm)
      .def("add_layer", &ks::FusedDecode::add_layer)
      .def("set_lora", &ks::FusedDecode::set_lora)
      .def("clear_lora", &ks::FusedDecode::clear_lora)
      .def("run", &ks::FusedDecode::run, py::arg("hidden"), py::arg("positions"), py::arg("slots"),
           py::arg("block_tables"), py::arg("context_lens"), py::arg("runs") = py::none());
}
