// y = x @ W.T for a GGUF Q6_K weight: blocks uint8 [n, k / 256 * 210], the file's super-blocks
// as stored (models/formats_k.py). The kernels are `quant_k.h`'s and `quant_k_fixed.h`'s,
// the paths by rows `quant.h`'s.
#include <torch/library.h>

#include "quant_k_fixed.h"

namespace {

using namespace vllm_aot::quant;

constexpr Format kQ6K = k_fixed::format<k_fixed::Q6K>();

at::Tensor linear_q6_k(const at::Tensor& x, const at::Tensor& blocks) {
  TORCH_CHECK(blocks.dim() == 2 && blocks.size(1) % 210 == 0,
              "linear_q6_k: blocks uint8 [n, k / 256 * 210], got ", blocks.sizes());
  const int64_t n = blocks.size(0), supers = blocks.size(1) / 210;
  const at::Tensor q = plane(blocks, at::kByte, n, supers * 210, "linear_q6_k blocks");
  const Weights w{q.data_ptr<uint8_t>(), nullptr, nullptr, nullptr, supers * 210, supers, n,
                  supers * k::kSuper};
  return linear(x, w, kQ6K);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(vllm_aot, m) { m.def("linear_q6_k(Tensor x, Tensor blocks) -> Tensor"); }

TORCH_LIBRARY_IMPL(vllm_aot, CPU, m) { m.impl("linear_q6_k", &linear_q6_k); }

TORCH_LIBRARY_IMPL(vllm_aot, Meta, m) {
  m.impl("linear_q6_k",
         [](const at::Tensor& x, const at::Tensor& blocks) { return linear_meta(x, blocks); });
}
