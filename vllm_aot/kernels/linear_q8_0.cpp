// y = x @ W.T for a GGUF Q8_0 weight: qweight int8 [n, k], scale float16 [n, k / 32]; w = q * d.
// The paths by rows are `quant.h`'s.
#include <torch/library.h>

#include "quant.h"
#include "quant_amx.h"
#include "quant_avx2.h"
#include "quant_avx2_fixed.h"
#include "quant_avx512.h"
#include "quant_avx512_vnni.h"

namespace {

using namespace vllm_aot::quant;

struct Q8_0 {
  static constexpr bool kRowScale = false;
  static constexpr bool kNibbles = false, kBlockScale = true, kHasMin = false;
  static constexpr int kOffset = 0;  // subtracted from the codes
};

const Format kQ8_0{{avx2::multiply<Q8_0>, avx512::multiply<Q8_0>},
                  {avx2_fixed::multiply<Q8_0>, nullptr, avx512_vnni::multiply<Q8_0>,
                   amx::multiply<Q8_0>},
                  avx2::dequantize<Q8_0>,
                  avx512::dequantize_bf16<Q8_0>};

at::Tensor linear_q8_0(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scale) {
  const int64_t n = qweight.size(0), k = qweight.size(1);
  TORCH_CHECK(qweight.dim() == 2 && k % kBlock == 0, "linear_q8_0: qweight int8 [n, k]");
  const at::Tensor q = plane(qweight, at::kChar, n, k, "linear_q8_0 qweight");
  const at::Tensor d = plane(scale, at::kHalf, n, k / kBlock, "linear_q8_0 scale");
  const Weights w{reinterpret_cast<const uint8_t*>(q.data_ptr<int8_t>()), d.data_ptr<c10::Half>(),
                  nullptr, nullptr, k, k / kBlock, n, k};
  return linear(x, w, kQ8_0);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(vllm_aot, m) {
  m.def("linear_q8_0(Tensor x, Tensor qweight, Tensor scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(vllm_aot, CPU, m) { m.impl("linear_q8_0", &linear_q8_0); }

TORCH_LIBRARY_IMPL(vllm_aot, Meta, m) {
  m.impl("linear_q8_0", [](const at::Tensor& x, const at::Tensor& qweight, const at::Tensor&) {
    return linear_meta(x, qweight);
  });
}
