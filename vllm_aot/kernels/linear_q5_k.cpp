// y = x @ W.T for a GGUF Q5_K weight: blocks uint8 [n, k / 256 * 176], the file's super-blocks
// as stored (models/formats_k.py). The kernels are `quant_k.h`'s and `quant_k_fixed.h`'s,
// the paths by rows `quant.h`'s.
#include <torch/library.h>

#include "quant_k_fixed.h"

namespace {

using namespace vllm_aot::quant;

constexpr Format kQ5K = k_fixed::format<k_fixed::Q5K>();

at::Tensor linear_q5_k(const at::Tensor& x, const at::Tensor& blocks) {
  TORCH_CHECK(blocks.dim() == 2 && blocks.size(1) % 176 == 0,
              "linear_q5_k: blocks uint8 [n, k / 256 * 176], got ", blocks.sizes());
  const int64_t n = blocks.size(0), supers = blocks.size(1) / 176;
  const at::Tensor q = plane(blocks, at::kByte, n, supers * 176, "linear_q5_k blocks");
  const Weights w{q.data_ptr<uint8_t>(), nullptr, nullptr, nullptr, supers * 176, supers, n,
                  supers * k::kSuper};
  return linear(x, w, kQ5K);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(vllm_aot, m) { m.def("linear_q5_k(Tensor x, Tensor blocks) -> Tensor"); }

TORCH_LIBRARY_IMPL(vllm_aot, CPU, m) { m.impl("linear_q5_k", &linear_q5_k); }

TORCH_LIBRARY_IMPL(vllm_aot, Meta, m) {
  m.impl("linear_q5_k",
         [](const at::Tensor& x, const at::Tensor& blocks) { return linear_meta(x, blocks); });
}
