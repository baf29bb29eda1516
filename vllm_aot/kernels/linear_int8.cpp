// y = x @ W.T for an int8 weight: qweight int8 [n, k], scale float32 [n]; w = q * scale (per
// output channel, symmetric). The paths by rows are `quant.h`'s, the codes handled as q8_0's
// (`linear_q8_0.cpp`) with the row's scale for every block; a row whose k is not a multiple of
// 32 ends in a part block, multiplied element by element.
#include <torch/library.h>

#include "quant.h"
#include "quant_amx.h"
#include "quant_avx2.h"
#include "quant_avx512.h"

namespace {

using namespace vllm_aot::quant;

struct Int8 {
  static constexpr bool kRowScale = true;
  static constexpr bool kNibbles = false, kBlockScale = false, kHasMin = false;
  static constexpr int kOffset = 0;  // subtracted from the codes
};

const Format kInt8{{avx2::multiply<Int8>, avx512::multiply<Int8>},
                  {nullptr, nullptr, nullptr,
                   amx::multiply<Int8>},
                  avx2::dequantize<Int8>,
                  avx512::dequantize_bf16<Int8>};

at::Tensor linear_int8(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scale) {
  TORCH_CHECK(qweight.dim() == 2, "linear_int8: qweight int8 [n, k]");
  const int64_t n = qweight.size(0), k = qweight.size(1);
  const at::Tensor q = plane(qweight, at::kChar, n, k, "linear_int8 qweight");
  const at::Tensor s = plane(scale, at::kFloat, n, -1, "linear_int8 scale");
  const Weights w{reinterpret_cast<const uint8_t*>(q.data_ptr<int8_t>()), nullptr, nullptr,
                  s.data_ptr<float>(), k, k / kBlock, n, k};
  return linear(x, w, kInt8);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(vllm_aot, m) {
  m.def("linear_int8(Tensor x, Tensor qweight, Tensor scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(vllm_aot, CPU, m) { m.impl("linear_int8", &linear_int8); }

TORCH_LIBRARY_IMPL(vllm_aot, Meta, m) {
  m.impl("linear_int8", [](const at::Tensor& x, const at::Tensor& qweight, const at::Tensor&) {
    return linear_meta(x, qweight);
  });
}
