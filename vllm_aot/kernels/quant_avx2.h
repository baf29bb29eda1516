// The quantised linears on AVX2 + FMA (float32 arithmetic, `quant.h`): `quant_avx512.h`'s kernel
// eight lanes wide, two weight rows a tile and two activation rows a register block (16
// registers), q4_1's minimum terms added per row. Also each format's dequantisation to float32
// for the GEMM path. Both read the codes through the format's traits (`code8`).
#pragma once

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <immintrin.h>

#include <algorithm>

#include "quant.h"

namespace vllm_aot::quant::avx2 {

constexpr int kTileRows = 2;  // weight rows per tile (AVX2 has 16 registers)

// The sums of four accumulators' lanes.
VLLM_AOT_AVX2 VLLM_AOT_INLINE __m128 reduce4(__m256 a, __m256 b, __m256 c, __m256 d) {
  const __m256 abcd = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
  return _mm_add_ps(_mm256_castps256_ps128(abcd), _mm256_extractf128_ps(abcd, 1));
}

// Inputs 8i .. 8i + 7 of block b of a row as float32 codes (fifth bits joined, code - kOffset for
// q4_0 and q5_0).
template <class F>
VLLM_AOT_AVX2 VLLM_AOT_INLINE __m256 code8(const Weights& w, int64_t row, int64_t b, int i) {
  __m256i c;
  if constexpr (F::kNibbles) {  // byte j holds input j (low nibble) and j + 16 (high)
    const uint8_t* p = w.q + row * w.q_stride + 16 * b + 8 * (i % 2);
    const __m256i bytes = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
    c = i < 2 ? _mm256_and_si256(bytes, _mm256_set1_epi32(0x0F)) : _mm256_srli_epi32(bytes, 4);
    if constexpr (kHighBit<F>) {  // bits 8i .. 8i + 7 of the block's fifth bits: 16 or 0
      const __m256i bits = _mm256_set1_epi32(high_row<F>(w, row, b)[i] << 4);
      const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
      const __m256i fifth = _mm256_and_si256(_mm256_srlv_epi32(bits, lane), _mm256_set1_epi32(16));
      c = _mm256_or_si256(c, fifth);
    }
    if constexpr (F::kOffset != 0) c = _mm256_sub_epi32(c, _mm256_set1_epi32(F::kOffset));
  } else {
    const uint8_t* p = w.q + row * w.q_stride + 32 * b + 8 * i;
    c = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  }
  return _mm256_cvtepi32_ps(c);
}

// Weight rows row0 .. row0 + rows as float32 [rows, k].
template <class F>
VLLM_AOT_AVX2 void dequantize(const Weights& w, int64_t row0, int64_t rows, float* out) {
  for (int64_t r = 0; r < rows; ++r) {
    float* o = out + r * w.k;
    for (int64_t b = 0; b < w.k / kBlock; ++b) {
      float d, m;
      affine<F>(w, row0 + r, b, d, m);
      const __m256 vd = _mm256_set1_ps(d), vm = _mm256_set1_ps(m);
      for (int i = 0; i < 4; ++i)
        _mm256_storeu_ps(o + kBlock * b + 8 * i, _mm256_fmadd_ps(code8<F>(w, row0 + r, b, i), vd, vm));
    }
    const auto* q = reinterpret_cast<const int8_t*>(w.q + (row0 + r) * w.q_stride);
    for (int64_t i = w.k / kBlock * kBlock; i < w.k; ++i) o[i] = q[i] * w.row_scale[row0 + r];
  }
}

// Activation rows x[0 .. B) (stride w.k) against weight rows row0 .. row0 + R: per block,
// t = codes . x in eight lanes, acc += t * the block's scale; then q4_1's minimums times the
// activations' block sums `xsum` (stride `lds`) and int8's row scale, per row.
template <class F, int B, int R, class Out>
VLLM_AOT_AVX2 void tile_rows(const Weights& w, int64_t row0, const float* x, const float* xsum,
                             int64_t lds, Out* out) {
  static_assert(R <= 2, "the sums below take two weight rows");
  __m256 acc[B][R];
  for (int b = 0; b < B; ++b)
    for (int r = 0; r < R; ++r) acc[b][r] = _mm256_setzero_ps();
  if constexpr (B == 1) prefetch_rows<R, kToL1>(w, row0);
  const int64_t blocks = w.k / kBlock;
  for (int64_t blk = 0; blk < blocks; ++blk) {
    for (int r = 0; r < R; ++r) {
      __m256 t[B];
      for (int i = 0; i < 4; ++i) {
        const __m256 code = code8<F>(w, row0 + r, blk, i);
        for (int b = 0; b < B; ++b) {
          const __m256 xv = _mm256_loadu_ps(x + b * w.k + blk * kBlock + 8 * i);
          t[b] = i ? _mm256_fmadd_ps(code, xv, t[b]) : _mm256_mul_ps(code, xv);
        }
      }
      if constexpr (F::kBlockScale) {
        const __m256 d = _mm256_set1_ps(widen(w.scale + (row0 + r) * w.blocks + blk));
        for (int b = 0; b < B; ++b) acc[b][r] = _mm256_fmadd_ps(t[b], d, acc[b][r]);
      } else {
        for (int b = 0; b < B; ++b) acc[b][r] = _mm256_add_ps(t[b], acc[b][r]);
      }
    }
  }
  const __m256 zero = _mm256_setzero_ps();
  for (int b = 0; b < B; ++b) {
    float sums[4];
    _mm_storeu_ps(sums, reduce4(acc[b][0], R > 1 ? acc[b][1] : zero, zero, zero));
    for (int r = 0; r < R; ++r) {
      float y = sums[r];
      if constexpr (F::kHasMin) {
        const c10::Half* mins = w.min + (row0 + r) * w.blocks;
        for (int64_t blk = 0; blk < blocks; ++blk) y += widen(mins + blk) * xsum[b * lds + blk];
      }
      if constexpr (F::kRowScale) {  // int8: the row's part block, then its scale
        const auto* q = reinterpret_cast<const int8_t*>(w.q + (row0 + r) * w.q_stride);
        for (int64_t i = blocks * kBlock; i < w.k; ++i) y += x[b * w.k + i] * q[i];
        y *= w.row_scale[row0 + r];
      }
      store(y, out + b * w.n + row0 + r);
    }
  }
}

// Activation rows 0 .. m against weight rows row0 .. row0 + R, two rows a register block.
template <class F, int R, class Out>
VLLM_AOT_AVX2 void rows(const Weights& w, int64_t row0, const float* x, int64_t m,
                        const float* xsum, int64_t lds, Out* out) {
  row_blocks<2>(m, [&](auto block, int64_t b) {
    tile_rows<F, decltype(block)::value, R>(w, row0, x + b * w.k, xsum ? xsum + b * lds : nullptr,
                                            lds, out + b * w.n);
  });
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

}  // namespace vllm_aot::quant::avx2
