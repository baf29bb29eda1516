// What the attention kernels share: their scalar inputs and the pools' element types.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>

namespace vllm_aot {

// A one-element float32 tensor's value (a layer's K or V scale), refused otherwise.
inline float one_float(const at::Tensor& t, const char* op, const char* name) {
  TORCH_CHECK(t.scalar_type() == at::kFloat && t.numel() == 1, op, ": ", name,
              " must be one float32");
  return *t.data_ptr<float>();
}

// f(P{}) with P the pools' element type: the model's T (q's dtype), or an fp8 format.
template <typename T, class F>
void with_pool_type(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool,
                    const char* op, F&& f) {
  const auto pool = k_pool.scalar_type();
  TORCH_CHECK(v_pool.scalar_type() == pool, op, ": K and V pools of one dtype");
  if (pool == q.scalar_type()) {
    f(T{});
  } else if (pool == at::kFloat8_e4m3fn) {
    f(c10::Float8_e4m3fn{});
  } else {
    TORCH_CHECK(pool == at::kFloat8_e5m2, op,
                ": pools of q's dtype, float8_e4m3fn or float8_e5m2");
    f(c10::Float8_e5m2{});
  }
}

}  // namespace vllm_aot
