// y = x @ W.T for a GGUF Q4_0 weight: qweight uint8 [n, k / 2] (16 bytes per block of 32 inputs:
// input j in the low nibble of byte j, input j + 16 in its high nibble), scale float16
// [n, k / 32]; w = (q - 8) * d. The paths by rows are `quant.h`'s.
#include <torch/library.h>

#include "quant.h"
#include "quant_amx.h"
#include "quant_avx2.h"
#include "quant_avx2_fixed.h"
#include "quant_avx512.h"
#include "quant_avx512_vnni.h"

namespace {

using namespace vllm_aot::quant;

struct Q4_0 {
  static constexpr bool kRowScale = false;
  static constexpr bool kNibbles = true, kBlockScale = true, kHasMin = false;
  static constexpr int kOffset = 8;  // subtracted from the codes
};

const Format kQ4_0{{avx2::multiply<Q4_0>, avx512::multiply<Q4_0>},
                  {avx2_fixed::multiply<Q4_0>, nullptr, avx512_vnni::multiply<Q4_0>,
                   amx::multiply<Q4_0>},
                  avx2::dequantize<Q4_0>,
                  avx512::dequantize_bf16<Q4_0>};

at::Tensor linear_q4_0(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scale) {
  const int64_t n = qweight.size(0), k = 2 * qweight.size(1);
  TORCH_CHECK(qweight.dim() == 2 && k % kBlock == 0, "linear_q4_0: qweight uint8 [n, k / 2]");
  const at::Tensor q = plane(qweight, at::kByte, n, k / 2, "linear_q4_0 qweight");
  const at::Tensor d = plane(scale, at::kHalf, n, k / kBlock, "linear_q4_0 scale");
  const Weights w{q.data_ptr<uint8_t>(), d.data_ptr<c10::Half>(), nullptr, nullptr, k / 2,
                  k / kBlock, n, k};
  return linear(x, w, kQ4_0);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(vllm_aot, m) {
  m.def("linear_q4_0(Tensor x, Tensor qweight, Tensor scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(vllm_aot, CPU, m) { m.impl("linear_q4_0", &linear_q4_0); }

TORCH_LIBRARY_IMPL(vllm_aot, Meta, m) {
  m.impl("linear_q4_0", [](const at::Tensor& x, const at::Tensor& qweight, const at::Tensor&) {
    return linear_meta(x, qweight);
  });
}
