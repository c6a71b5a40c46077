// Binds a csrc/ revision's int4_linear to an op of its own namespace (benchmarks/
// kernel_at_rev.py builds it beside that revision's sources).
#include <torch/extension.h>
at::Tensor int4_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& sz,
                       const c10::optional<at::Tensor>& bias, int64_t group, int64_t in_features,
                       int64_t out_features, int64_t max_rows, int64_t gemv_rows);
TORCH_LIBRARY(asyncllm_old, m) {
  m.def("int4_linear(Tensor x, Tensor packed, Tensor scales_and_zeros, Tensor? bias, "
        "int group_size, int in_features, int out_features, int max_rows, int gemv_rows) "
        "-> Tensor");
  m.impl("int4_linear", c10::DispatchKey::CPU, TORCH_FN(int4_linear));
}
