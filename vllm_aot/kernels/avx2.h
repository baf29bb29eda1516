// AVX2 helpers shared by our kernels: widening loads and a horizontal sum.
#pragma once

#include <c10/util/BFloat16.h>
#include <immintrin.h>

namespace vllm_aot {

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }

// Eight bfloat16s as float32: a bfloat16 is the top half of a float32, so widening is one shift.
inline __m256 load8(const c10::BFloat16* p) {
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(v), 16));
}

inline float sum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_hadd_ps(s, s);
  s = _mm_hadd_ps(s, s);
  return _mm_cvtss_f32(s);
}

}  // namespace vllm_aot
