// Decode attention's two loops over a row's cached positions (`decode_attention.cpp`) on CPUs
// with AVX512-BF16, for bfloat16 queries and pools and heads of 64 or 128: what the AVX2 loops
// spend most of their instructions on, they do not do.
//
// - Scores: a key is read as it is stored, bfloat16 pairs, and `vdpbf16ps` multiplies it by the
//   query heads' raw bfloat16 values (each product exact in float32, the sums float32), no
//   widening. Each key leaves a vector of 16 partial sums a head; 16 keys' vectors are summed
//   across their lanes at once (a tree of lane shuffles, ~3 instructions a key and head where a
//   horizontal sum per key took ~6), then scaled by 1 / sqrt(d).
// - Values: float32 sums in 512-bit registers, each value widened once for the group's heads by
//   interleaving its bfloat16 halves with zeros (one instruction for 16 elements, in an order the
//   sums keep and the store undoes).
#pragma once

#include <c10/util/BFloat16.h>
#include <immintrin.h>

#include <cstdint>

#define VLLM_AOT_AVX512_BF16_ATTENTION \
  __attribute__((target("avx2,fma,avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")))

namespace vllm_aot::attention_avx512 {

using BF16 = c10::BFloat16;

inline bool available() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512bf16");
}

// 16 vectors of partial sums -> one vector of their 16 totals, v[k]'s in lane k.
VLLM_AOT_AVX512_BF16_ATTENTION inline __m512 sum_lanes16(const __m512* v) {
  __m512 c[8], e[4], f[2];
  for (int i = 0; i < 8; ++i)  // v[2i]'s halves added in lanes 0-7, v[2i + 1]'s in 8-15
    c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44),
                         _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE));
  for (int j = 0; j < 4; ++j)  // one vector's quarter a 128-bit lane: v[4j + L] in lane L
    e[j] = _mm512_add_ps(_mm512_shuffle_f32x4(c[2 * j], c[2 * j + 1], 0x88),
                         _mm512_shuffle_f32x4(c[2 * j], c[2 * j + 1], 0xDD));
  for (int m = 0; m < 2; ++m)
    f[m] = _mm512_add_ps(_mm512_unpacklo_ps(e[2 * m], e[2 * m + 1]),
                         _mm512_unpackhi_ps(e[2 * m], e[2 * m + 1]));
  // element x of 128-bit lane L: v[L + 4x]'s total
  const __m512 r = _mm512_add_ps(_mm512_shuffle_ps(f[0], f[1], 0x44),
                                 _mm512_shuffle_ps(f[0], f[1], 0xEE));
  const __m512i order = _mm512_set_epi32(15, 11, 7, 3, 14, 10, 6, 2, 13, 9, 5, 1, 12, 8, 4, 0);
  return _mm512_permutexvar_ps(order, r);
}

// scores[g * stride + t] = scale * q[g] . key(t) for the G query heads of a KV head (q raw, its
// heads contiguous, each 32 * D elements) and every cached position of `keys`.
template <int G, int D, class Keys>
VLLM_AOT_AVX512_BF16_ATTENTION void key_scores(const BF16* q, float scale, const Keys& keys,
                                               float* scores, int64_t stride) {
  __m512bh qv[G][D];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < D; ++c)
      qv[g][c] = (__m512bh)_mm512_loadu_si512(q + (g * D + c) * 32);
  alignas(64) __m512 partial[G][16] = {};
  const __m512 vscale = _mm512_set1_ps(scale);
  const int64_t len = keys.len;
  keys.template each<_MM_HINT_T1>([&](int64_t t, const BF16* key) VLLM_AOT_AVX512_BF16_ATTENTION {
    __m512bh k[D];
    for (int c = 0; c < D; ++c) k[c] = (__m512bh)_mm512_loadu_si512(key + 32 * c);
    const int slot = static_cast<int>(t & 15);
    for (int g = 0; g < G; ++g) {
      __m512 acc = _mm512_dpbf16_ps(_mm512_setzero_ps(), qv[g][0], k[0]);
      for (int c = 1; c < D; ++c) acc = _mm512_dpbf16_ps(acc, qv[g][c], k[c]);
      partial[g][slot] = acc;
    }
    if (slot == 15 || t == len - 1) {
      const int64_t t0 = t - slot;
      const __mmask16 mask = static_cast<__mmask16>((1u << (slot + 1)) - 1);
      for (int g = 0; g < G; ++g)
        _mm512_mask_storeu_ps(scores + g * stride + t0, mask,
                              _mm512_mul_ps(sum_lanes16(partial[g]), vscale));
    }
  });
}

// out[g * 32 * D ...] = sum over t < len of p[g][t] * value(t) + p[g][len] * own, p[g] = probs +
// g * stride: float32 sums, a piece of the head at a time so the G heads' sums stay in
// registers. A value's 32 bfloat16 of a register widen to two float32 vectors by interleaving
// with zeros (elements 0-3, 8-11, 16-19, 24-27 and the rest), which the store puts back in order.
template <int G, int D, class Values>
VLLM_AOT_AVX512_BF16_ATTENTION void weighted_values(const float* probs, int64_t stride,
                                                    const Values& values, const BF16* own,
                                                    float* out) {
  constexpr int kPiece = G <= 2 ? D : 2;  // registers of 32 values a pass
  const int64_t len = values.len;
  const __m512i zero = _mm512_setzero_si512();
  const __m512i first = _mm512_set_epi32(23, 22, 21, 20, 7, 6, 5, 4, 19, 18, 17, 16, 3, 2, 1, 0);
  const __m512i second =
      _mm512_set_epi32(31, 30, 29, 28, 15, 14, 13, 12, 27, 26, 25, 24, 11, 10, 9, 8);
  for (int c0 = 0; c0 < D; c0 += kPiece) {
    __m512 acc[G][2 * kPiece];
    for (int g = 0; g < G; ++g)
      for (int c = 0; c < 2 * kPiece; ++c) acc[g][c] = _mm512_setzero_ps();
    values.template each<_MM_HINT_T1>([&](int64_t t, const BF16* v) VLLM_AOT_AVX512_BF16_ATTENTION {
      __m512 w[G];
      for (int g = 0; g < G; ++g) w[g] = _mm512_set1_ps(probs[g * stride + t]);
      for (int c = 0; c < kPiece; ++c) {
        const __m512i x = _mm512_loadu_si512(v + 32 * (c0 + c));
        const __m512 lo = _mm512_castsi512_ps(_mm512_unpacklo_epi16(zero, x));
        const __m512 hi = _mm512_castsi512_ps(_mm512_unpackhi_epi16(zero, x));
        for (int g = 0; g < G; ++g) {
          acc[g][2 * c] = _mm512_fmadd_ps(w[g], lo, acc[g][2 * c]);
          acc[g][2 * c + 1] = _mm512_fmadd_ps(w[g], hi, acc[g][2 * c + 1]);
        }
      }
    });
    for (int g = 0; g < G; ++g) {
      const __m512 p = _mm512_set1_ps(probs[g * stride + len]);
      for (int c = 0; c < kPiece; ++c) {
        const int64_t at = 32 * (c0 + c);
        const __m256i own_bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(own + at));
        const __m256i own_bits2 =
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(own + at + 16));
        const __m512 own_lo =
            _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(own_bits), 16));
        const __m512 own_hi =
            _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(own_bits2), 16));
        const __m512 a = _mm512_permutex2var_ps(acc[g][2 * c], first, acc[g][2 * c + 1]);
        const __m512 b = _mm512_permutex2var_ps(acc[g][2 * c], second, acc[g][2 * c + 1]);
        _mm512_storeu_ps(out + g * 32 * D + at, _mm512_fmadd_ps(p, own_lo, a));
        _mm512_storeu_ps(out + g * 32 * D + at + 16, _mm512_fmadd_ps(p, own_hi, b));
      }
    }
  }
}

}  // namespace vllm_aot::attention_avx512
