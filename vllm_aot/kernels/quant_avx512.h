// The quantised linears on AVX-512 (float32 arithmetic, `quant.h`): tiles of four weight rows in
// parallel, up to four activation rows a register block (32 registers). Each block of 32 weights
// is widened from its codes (`block_codes`: the format's traits kNibbles, kHighBit, kOffset) and
// t = codes . x is scaled by the block's scale (kBlockScale) into the accumulators; q4_1's
// minimums (kHasMin) are one dot with the activations' block sums; int8's row scale (kRowScale)
// multiplies the row's sum. The codes stream from memory once, front to back (the rows ahead
// prefetched), for all the activation rows. Also each format's dequantisation to bfloat16, for
// the GEMM path on CPUs that multiply bfloat16 natively (through the same traits).
#pragma once

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <immintrin.h>

#include <algorithm>

#include "quant.h"

namespace vllm_aot::quant::avx512 {

constexpr int kTileRows = 4;  // weight rows per tile

// The sums of four accumulators' lanes.
VLLM_AOT_AVX512 VLLM_AOT_INLINE __m128 reduce4(__m512 a, __m512 b, __m512 c, __m512 d) {
  const __m512 ab = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
  const __m512 cd = _mm512_add_ps(_mm512_unpacklo_ps(c, d), _mm512_unpackhi_ps(c, d));
  const __m512d abd = _mm512_castps_pd(ab), cdd = _mm512_castps_pd(cd);
  const __m512 abcd = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(abd, cdd)),
                                    _mm512_castpd_ps(_mm512_unpackhi_pd(abd, cdd)));
  const __m256 h = _mm256_add_ps(_mm512_castps512_ps256(abcd), _mm512_extractf32x8_ps(abcd, 1));
  return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

// The lane sums of R <= 4 accumulators.
template <int R>
VLLM_AOT_AVX512 VLLM_AOT_INLINE __m128 lane_sums(const __m512 (&acc)[R]) {
  static_assert(R <= 4, "four accumulators at most");
  const __m512 zero = _mm512_setzero_ps();
  return reduce4(acc[0], R > 1 ? acc[1] : zero, R > 2 ? acc[2] : zero, R > 3 ? acc[3] : zero);
}

// Block b of a row as float32 codes: inputs 0-15 in lo, 16-31 in hi (fifth bits joined, code -
// kOffset for q4_0 and q5_0).
template <class F>
VLLM_AOT_AVX512 VLLM_AOT_INLINE void block_codes(const Weights& w, int64_t row, int64_t b,
                                                 __m512& lo, __m512& hi) {
  __m512i a, c;
  if constexpr (F::kNibbles) {  // one byte holds input j (low nibble) and j + 16 (high)
    const uint8_t* p = w.q + row * w.q_stride + 16 * b;
    const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    a = _mm512_and_si512(bytes, _mm512_set1_epi32(0x0F));
    c = _mm512_srli_epi32(bytes, 4);
    if constexpr (kHighBit<F>) {  // 16 where the block's fifth bit j is set, j = the input
      const uint32_t bits = high_bits(high_row<F>(w, row), b);
      const __m512i sixteen = _mm512_set1_epi32(16);
      a = _mm512_mask_or_epi32(a, static_cast<__mmask16>(bits), a, sixteen);
      c = _mm512_mask_or_epi32(c, static_cast<__mmask16>(bits >> 16), c, sixteen);
    }
    if constexpr (F::kOffset != 0) {
      a = _mm512_sub_epi32(a, _mm512_set1_epi32(F::kOffset));
      c = _mm512_sub_epi32(c, _mm512_set1_epi32(F::kOffset));
    }
  } else {
    const auto* p = reinterpret_cast<const __m128i*>(w.q + row * w.q_stride + 32 * b);
    a = _mm512_cvtepi8_epi32(_mm_loadu_si128(p));
    c = _mm512_cvtepi8_epi32(_mm_loadu_si128(p + 1));
  }
  lo = _mm512_cvtepi32_ps(a);
  hi = _mm512_cvtepi32_ps(c);
}

// Sixteen fp16 per-block values (scales or minimums) of a row from block c (fewer at its end).
VLLM_AOT_AVX512 VLLM_AOT_INLINE __m512 sixteen_halves(const c10::Half* row, int64_t c,
                                                      int64_t blocks) {
  const __mmask16 mask = blocks - c >= 16 ? 0xFFFF : (1u << (blocks - c)) - 1;
  return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, row + c));
}

// out[b][r] = the sum of acc[b][r]'s lanes (times an int8 row's scale, plus its part block).
template <class F, int B, int R, class Out>
VLLM_AOT_AVX512 VLLM_AOT_INLINE void finish(const Weights& w, int64_t row0, const float* x,
                                            __m512 (&acc)[B][R], Out* out) {
  const int64_t full = w.k / kBlock * kBlock;
  for (int b = 0; b < B; ++b) {
    float sums[4];
    _mm_storeu_ps(sums, lane_sums<R>(acc[b]));
    for (int r = 0; r < R; ++r) {
      float y = sums[r];
      if constexpr (F::kRowScale) {
        const auto* q = reinterpret_cast<const int8_t*>(w.q + (row0 + r) * w.q_stride);
        for (int64_t i = full; i < w.k; ++i) y += x[b * w.k + i] * q[i];
        y *= w.row_scale[row0 + r];
      }
      store(y, out + b * w.n + row0 + r);
    }
  }
}

// Activation rows x[0 .. B) (stride w.k) against weight rows row0 .. row0 + R: per block,
// t = codes . x in sixteen lanes, acc += t * the block's scale; q4_1's minimums as one dot with
// the activations' block sums `xsum` (stride `lds`).
template <class F, int B, int R, class Out>
VLLM_AOT_AVX512 void tile_rows(const Weights& w, int64_t row0, const float* x, const float* xsum,
                               int64_t lds, Out* out) {
  __m512 acc[B][R];
  for (int b = 0; b < B; ++b)
    for (int r = 0; r < R; ++r) acc[b][r] = _mm512_setzero_ps();
  if constexpr (B == 1) prefetch_rows<R, kToL2>(w, row0);
  const int64_t blocks = w.k / kBlock;
  for (int64_t c = 0; c < blocks; c += 16) {
    __m512 scales[R];
    if constexpr (F::kBlockScale)
      for (int r = 0; r < R; ++r) scales[r] = sixteen_halves(w.scale + (row0 + r) * w.blocks, c, blocks);
    for (int64_t blk = c; blk < std::min(blocks, c + 16); ++blk) {
      __m512 xlo[B], xhi[B];
      for (int b = 0; b < B; ++b) {
        xlo[b] = _mm512_loadu_ps(x + b * w.k + blk * kBlock);
        xhi[b] = _mm512_loadu_ps(x + b * w.k + blk * kBlock + 16);
      }
      for (int r = 0; r < R; ++r) {
        __m512 lo, hi;
        block_codes<F>(w, row0 + r, blk, lo, hi);
        if constexpr (F::kBlockScale) {
          const __m512 d =
              _mm512_permutexvar_ps(_mm512_set1_epi32(static_cast<int>(blk - c)), scales[r]);
          for (int b = 0; b < B; ++b)
            acc[b][r] = _mm512_fmadd_ps(_mm512_fmadd_ps(hi, xhi[b], _mm512_mul_ps(lo, xlo[b])), d,
                                        acc[b][r]);
        } else {
          for (int b = 0; b < B; ++b)
            acc[b][r] = _mm512_fmadd_ps(hi, xhi[b], _mm512_fmadd_ps(lo, xlo[b], acc[b][r]));
        }
      }
    }
    if constexpr (F::kHasMin) {
      for (int r = 0; r < R; ++r) {
        const __m512 mins = sixteen_halves(w.min + (row0 + r) * w.blocks, c, blocks);
        for (int b = 0; b < B; ++b)
          acc[b][r] = _mm512_fmadd_ps(mins, _mm512_loadu_ps(xsum + b * lds + c), acc[b][r]);
      }
    }
  }
  finish<F>(w, row0, x, acc, out);
}

// Activation rows 0 .. m against weight rows row0 .. row0 + R, four rows a register block.
template <class F, int R, class Out>
VLLM_AOT_AVX512 void rows(const Weights& w, int64_t row0, const float* x, int64_t m,
                          const float* xsum, int64_t lds, Out* out) {
  row_blocks<4>(m, [&](auto block, int64_t b) {
    tile_rows<F, decltype(block)::value, R>(w, row0, x + b * w.k, xsum ? xsum + b * lds : nullptr,
                                            lds, out + b * w.n);
  });
}

// Weight rows row0 .. row0 + rows as bfloat16 [rows, k] (rounded to nearest even).
template <class F>
VLLM_AOT_AVX512_BF16 void dequantize_bf16(const Weights& w, int64_t row0, int64_t rows,
                                          c10::BFloat16* out) {
  for (int64_t r = 0; r < rows; ++r) {
    c10::BFloat16* o = out + r * w.k;
    for (int64_t b = 0; b < w.k / kBlock; ++b) {
      float d, m;
      affine<F>(w, row0 + r, b, d, m);
      const __m512 vd = _mm512_set1_ps(d), vm = _mm512_set1_ps(m);
      __m512 lo, hi;
      block_codes<F>(w, row0 + r, b, lo, hi);
      const __m512bh both =
          _mm512_cvtne2ps_pbh(_mm512_fmadd_ps(hi, vd, vm), _mm512_fmadd_ps(lo, vd, vm));
      _mm512_storeu_si512(o + kBlock * b, (__m512i)both);
    }
    const auto* q = reinterpret_cast<const int8_t*>(w.q + (row0 + r) * w.q_stride);
    for (int64_t i = w.k / kBlock * kBlock; i < w.k; ++i)
      o[i] = c10::BFloat16(q[i] * w.row_scale[row0 + r]);
  }
}

// `MultiplyFn` for format F: up to kMaxDirectRows activation rows.
template <class F>
void multiply(const Weights& w, const float* x, int64_t m, at::Tensor& out) {
  int64_t lds;
  const float* xsum = block_sums<F>(w, x, m, lds);
  parallel_tiles<kTileRows>(w.n, out, [&](auto tile, int64_t row0, auto* o) {
    rows<F, decltype(tile)::value>(w, row0, x, m, xsum, lds, o);
  });
}

}  // namespace vllm_aot::quant::avx512
