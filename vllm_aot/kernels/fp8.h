// FP8 KV cache elements as float32. AVX2 has no fp8 arithmetic: each format's 256 values are a
// table, filled once when the library loads, and eight elements are one gather from it.
#pragma once

#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>
#include <immintrin.h>

#include <cstdint>

namespace vllm_aot {

template <typename F>
struct Fp8Table {
  alignas(64) float values[256];
  Fp8Table() {
    for (int bits = 0; bits < 256; ++bits)
      values[bits] = static_cast<float>(F(static_cast<uint8_t>(bits), F::from_bits()));
  }
};

template <typename F>
inline const Fp8Table<F> kFp8Table{};

template <typename F>
inline __m256 load8_fp8(const F* p) {
  const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  return _mm256_i32gather_ps(kFp8Table<F>.values, _mm256_cvtepu8_epi32(bytes), 4);
}

inline __m256 load8(const c10::Float8_e4m3fn* p) { return load8_fp8(p); }
inline __m256 load8(const c10::Float8_e5m2* p) { return load8_fp8(p); }

}  // namespace vllm_aot
