// y = x @ W.T for a GGUF Q5_1 weight: qweight uint8 [n, k / 2] (16 bytes per block of 32 inputs:
// the low four bits of input j in the low nibble of byte j, of input j + 16 in its high nibble),
// qh uint8 [n, k / 8] (4 bytes per block: bit j of their little-endian uint32 is input j's fifth
// bit), scale and min float16 [n, k / 32]; w = q * d + m. The paths by rows are `quant.h`'s.
#include <torch/library.h>

#include "quant.h"
#include "quant_amx.h"
#include "quant_avx2.h"
#include "quant_avx2_fixed.h"
#include "quant_avx512.h"
#include "quant_avx512_vnni.h"

namespace {

using namespace vllm_aot::quant;

struct Q5_1 {
  static constexpr bool kRowScale = false;
  static constexpr bool kNibbles = true, kHighBit = true, kBlockScale = true, kHasMin = true;
  static constexpr int kOffset = 0;  // subtracted from the codes
};

const Format kQ5_1{{avx2::multiply<Q5_1>, avx512::multiply<Q5_1>},
                  {avx2_fixed::multiply<Q5_1>, nullptr, avx512_vnni::multiply<Q5_1>,
                   amx::multiply<Q5_1>},
                  avx2::dequantize<Q5_1>,
                  avx512::dequantize_bf16<Q5_1>};

at::Tensor linear_q5_1(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& qh,
                       const at::Tensor& scale, const at::Tensor& min) {
  const int64_t n = qweight.size(0), k = 2 * qweight.size(1);
  TORCH_CHECK(qweight.dim() == 2 && k % kBlock == 0, "linear_q5_1: qweight uint8 [n, k / 2]");
  const at::Tensor q = plane(qweight, at::kByte, n, k / 2, "linear_q5_1 qweight");
  const at::Tensor h = plane(qh, at::kByte, n, k / 8, "linear_q5_1 qh");
  const at::Tensor d = plane(scale, at::kHalf, n, k / kBlock, "linear_q5_1 scale");
  const at::Tensor m = plane(min, at::kHalf, n, k / kBlock, "linear_q5_1 min");
  Weights w{q.data_ptr<uint8_t>(), d.data_ptr<c10::Half>(), m.data_ptr<c10::Half>(), nullptr,
            k / 2, k / kBlock, n, k};
  w.qh = h.data_ptr<uint8_t>();
  return linear(x, w, kQ5_1);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(vllm_aot, m) {
  m.def("linear_q5_1(Tensor x, Tensor qweight, Tensor qh, Tensor scale, Tensor min) -> Tensor");
}

TORCH_LIBRARY_IMPL(vllm_aot, CPU, m) { m.impl("linear_q5_1", &linear_q5_1); }

TORCH_LIBRARY_IMPL(vllm_aot, Meta, m) {
  m.impl("linear_q5_1", [](const at::Tensor& x, const at::Tensor& qweight, const at::Tensor&,
                           const at::Tensor&, const at::Tensor&) {
    return linear_meta(x, qweight);
  });
}
