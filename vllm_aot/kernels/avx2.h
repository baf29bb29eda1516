// AVX2 helpers shared by our kernels: widening loads, a horizontal sum, exp, log.
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

// e^x for eight floats to ~2 ulp (x <= 88; below -87.3 the result flushes towards 0): x = n ln 2
// + r with |r| <= ln 2 / 2, e^r by its degree-7 Taylor-like polynomial (Cephes' expf
// coefficients), times 2^n built in the exponent bits. std::exp one score at a time would be
// most of a decode attention call.
inline __m256 exp8(__m256 x) {
  x = _mm256_max_ps(_mm256_min_ps(x, _mm256_set1_ps(88.3762626647949f)),
                    _mm256_set1_ps(-87.3365447504f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.f)));
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n),
                                                          _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(bits));
}

// ln x for eight positive, normal floats to ~2 ulp: x = m 2^e with m in [sqrt(1/2), sqrt(2)),
// ln(m) = f - f^2 / 2 + f^3 P(f) for f = m - 1 (Cephes' logf coefficients), plus e ln 2 in two
// parts. No zero, negative, infinite or subnormal input (the sampler's uniforms are in (0, 1)).
inline __m256 log8(__m256 x) {
  const __m256i bits = _mm256_castps_si256(x);
  __m256 e = _mm256_cvtepi32_ps(
      _mm256_sub_epi32(_mm256_srli_epi32(bits, 23), _mm256_set1_epi32(126)));
  // The mantissa in [0.5, 1): the exponent bits replaced by 0.5's.
  __m256 m = _mm256_castsi256_ps(_mm256_or_si256(
      _mm256_and_si256(bits, _mm256_set1_epi32(0x007FFFFF)), _mm256_set1_epi32(0x3F000000)));
  const __m256 small = _mm256_cmp_ps(m, _mm256_set1_ps(0.707106781186547524f), _CMP_LT_OQ);
  e = _mm256_sub_ps(e, _mm256_and_ps(small, _mm256_set1_ps(1.f)));
  const __m256 f = _mm256_sub_ps(_mm256_add_ps(m, _mm256_and_ps(small, m)), _mm256_set1_ps(1.f));
  const __m256 f2 = _mm256_mul_ps(f, f);
  __m256 y = _mm256_set1_ps(7.0376836292e-2f);
  y = _mm256_fmadd_ps(y, f, _mm256_set1_ps(-1.1514610310e-1f));
  y = _mm256_fmadd_ps(y, f, _mm256_set1_ps(1.1676998740e-1f));
  y = _mm256_fmadd_ps(y, f, _mm256_set1_ps(-1.2420140846e-1f));
  y = _mm256_fmadd_ps(y, f, _mm256_set1_ps(1.4249322787e-1f));
  y = _mm256_fmadd_ps(y, f, _mm256_set1_ps(-1.6668057665e-1f));
  y = _mm256_fmadd_ps(y, f, _mm256_set1_ps(2.0000714765e-1f));
  y = _mm256_fmadd_ps(y, f, _mm256_set1_ps(-2.4999993993e-1f));
  y = _mm256_fmadd_ps(y, f, _mm256_set1_ps(3.3333331174e-1f));
  y = _mm256_mul_ps(_mm256_mul_ps(y, f), f2);
  y = _mm256_fmadd_ps(e, _mm256_set1_ps(-2.12194440e-4f), y);
  y = _mm256_fnmadd_ps(f2, _mm256_set1_ps(0.5f), y);
  return _mm256_fmadd_ps(e, _mm256_set1_ps(0.693359375f), _mm256_add_ps(f, y));
}

}  // namespace vllm_aot
