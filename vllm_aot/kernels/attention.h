// What the attention kernels share: their scalar inputs and the dispatch on element types.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>

namespace vllm_aot {

// A one-element float32 tensor's value (a layer's K or V scale), refused otherwise.
inline float one_float(const at::Tensor& t, const char* op, const char* name) {
  TORCH_CHECK(t.scalar_type() == at::kFloat && t.numel() == 1, op, ": ", name,
              " must be one float32");
  return *t.data_ptr<float>();
}

// f(T{}, P{}): T the model's dtype (q's: float32 or bfloat16), P the pools' element type (T,
// or an fp8 format); any other dtype refused, naming `op`.
template <class F>
void with_element_types(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool,
                        const char* op, F&& f) {
  const auto pool = k_pool.scalar_type();
  TORCH_CHECK(v_pool.scalar_type() == pool, op, ": K and V pools of one dtype");
  const auto with_pools = [&](auto model) {
    if (pool == q.scalar_type()) {
      f(model, model);
    } else if (pool == at::kFloat8_e4m3fn) {
      f(model, c10::Float8_e4m3fn{});
    } else {
      TORCH_CHECK(pool == at::kFloat8_e5m2, op,
                  ": pools of q's dtype, float8_e4m3fn or float8_e5m2");
      f(model, c10::Float8_e5m2{});
    }
  };
  if (q.scalar_type() == at::kBFloat16) {
    with_pools(c10::BFloat16{});
  } else {
    TORCH_CHECK(q.scalar_type() == at::kFloat, op, ": float32 or bfloat16");
    with_pools(float{});
  }
}

}  // namespace vllm_aot
