// The block formats (q8_0, q4_0, q4_1, q5_0, q5_1) for bfloat16 activations on AVX2 (`quant.h`).
// The float32 kernel (`quant_avx2.h`) spends most of its time widening codes to float32. Here the
// codes widen only to 16-bit integers and `vpmaddwd` multiplies them by the activations as 16-bit
// fixed point, summed in int32 (see docs/benchmarks.md#avx2-fixed-point-tiles):
//
// - the activations are bfloat16 (8 significant bits) and become 16-bit fixed point per block of
//   32: x = s * q with s = the block's largest |x| / 32767. Each x moves by at most s / 2 = 2^-16
//   of its block's largest, far below the bfloat16 rounding it came with (2^-9 of itself), so the
//   sums are the bfloat16 program's to float32-like precision (the tests' bound:
//   `tests/test_quant_kernels.py`). A call converts its rows once; every weight tile reads them.
// - a block's codes are 32 int16 in two registers: inputs 0-15 and 16-31 (a nibble format's low
//   and high nibbles of its 16 bytes, with q5's fifth bits, or q8_0's two halves), so the
//   activations stay in their own order. Two `vpmaddwd` and an add give eight int32 partial
//   sums, which times s * d (d the block's scale) add up in float32.
// - the minimums (q4_1, q5_1) and the offsets (q4_0's, q5_0's), (m - kOffset * d) * s * sum(q)
//   per block, join the same sums eight blocks at a time.
// - a tile of 4 weight rows widens its scales (and minimums) once per chunk of 64 blocks into
//   float32 on the stack and multiplies them by each activation row's block scales there (d * s:
//   one broadcast a block and row in the inner loop, no multiply), so the inner loop makes no
//   call (a call would keep the sums in memory), holds a block's activations in registers for the
//   tile's rows, and takes a cache line of codes at a time, asking for the one 16 rows on.
// - more activation rows than one register block: the tile's codes are widened to int16 once into
//   a buffer that every register block reads, and its scales and shifts to float32 once.
// - a row's scales widen eight at a time, the last part vector by a masked load: no loop of
//   unknown length, whose exits mispredict.
#pragma once

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "avx2.h"
#include "quant.h"
#include "quant_avx2.h"

namespace vllm_aot::quant::avx2_fixed {

using vllm_aot::load8;

constexpr int kTileRows = 4;      // weight rows per tile
constexpr int kRowBlock = 2;      // activation rows per register block
constexpr float kLevels = 32767;  // |q| <= 2^15 - 1

// One call's activations, in buffers the calling thread reuses: per row, its whole blocks as
// int16 fixed point (`blocks` * 32); per row and block, its scale s and s * sum(q) (rows of
// `stride` floats, zeros after the last block).
struct Fixed {
  const int16_t* q;
  const float* scales;
  const float* sums;
  int64_t blocks, stride;

  // The same from activation row b on.
  Fixed from(int64_t b) const {
    return {q + b * blocks * kBlock, scales + b * stride, sums + b * stride, blocks, stride};
  }
};

VLLM_AOT_AVX2 VLLM_AOT_INLINE float max8(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

VLLM_AOT_AVX2 VLLM_AOT_INLINE int32_t sum8i(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  return _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1)));
}

// 32 bfloat16 times `inv` (kLevels over their scale's largest |x|), rounded to nearest even (as
// nearbyint), as int16 into dst in order; returns the sum of the 32 integers.
VLLM_AOT_AVX2 VLLM_AOT_INLINE int32_t quantize32(const c10::BFloat16* x, __m256 inv, int16_t* dst) {
  __m256i q[4];
  for (int i = 0; i < 4; ++i) q[i] = _mm256_cvtps_epi32(_mm256_mul_ps(load8(x + 8 * i), inv));
  for (int i = 0; i < 4; i += 2)  // packs works per 128-bit lane: put the quarters back in order
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + 8 * i),
                        _mm256_permute4x64_epi64(_mm256_packs_epi32(q[i], q[i + 1]), 0xD8));
  return sum8i(_mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3])));
}

// One block of 32 bfloat16 as 16-bit fixed point into dst; returns its scale s, and s * sum(q)
// in `sum`.
VLLM_AOT_AVX2 VLLM_AOT_INLINE float fixed_point(const c10::BFloat16* x, int16_t* dst, float& sum) {
  const __m256 sign = _mm256_set1_ps(-0.f);
  __m256 largest = _mm256_setzero_ps();
  for (int i = 0; i < 4; ++i)
    largest = _mm256_max_ps(largest, _mm256_andnot_ps(sign, load8(x + 8 * i)));
  const float top = max8(largest);
  const __m256 inv = _mm256_set1_ps(top > 0.f ? kLevels / top : 0.f);
  const float s = top / kLevels;
  sum = s * static_cast<float>(quantize32(x, inv, dst));
  return s;
}

VLLM_AOT_AVX2 inline Fixed to_fixed(const c10::BFloat16* x, int64_t m, int64_t k) {
  thread_local std::vector<int16_t> qs;
  thread_local std::vector<float> scales, sums;
  const int64_t blocks = k / kBlock, stride = (blocks + 7) / 8 * 8;
  qs.resize(m * blocks * kBlock);
  scales.assign(m * stride, 0.f);
  sums.assign(m * stride, 0.f);
  for (int64_t b = 0; b < m; ++b)
    for (int64_t blk = 0; blk < blocks; ++blk)
      scales[b * stride + blk] = fixed_point(x + b * k + blk * kBlock,
                                             qs.data() + (b * blocks + blk) * kBlock,
                                             sums[b * stride + blk]);
  return {qs.data(), scales.data(), sums.data(), blocks, stride};
}

// Sixteen fifth bits (bit j for int16 lane j) as 16 or 0.
VLLM_AOT_AVX2 VLLM_AOT_INLINE __m256i fifth_bits(uint32_t bits) {
  const __m256i lane = _mm256_setr_epi16(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096,
                                         8192, 16384, -32768);
  const __m256i set = _mm256_and_si256(_mm256_set1_epi16(static_cast<int16_t>(bits)), lane);
  return _mm256_and_si256(_mm256_cmpeq_epi16(set, lane), _mm256_set1_epi16(16));
}

// Block b's codes of a row as int16: inputs 0-15 in lo, 16-31 in hi (code - kOffset is left to
// the offset terms), the fifth bits (kHighBit) joined from the row's `high` (`high_row`).
template <class F>
VLLM_AOT_AVX2 VLLM_AOT_INLINE void codes16(const uint8_t* row, const uint8_t* high, int64_t b,
                                           __m256i& lo, __m256i& hi) {
  if constexpr (F::kNibbles) {
    const __m256i v =
        _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 16 * b)));
    lo = _mm256_and_si256(v, _mm256_set1_epi16(0x0F));
    hi = _mm256_srli_epi16(v, 4);
    if constexpr (kHighBit<F>) {
      const uint32_t bits = high_bits(high, b);
      lo = _mm256_or_si256(lo, fifth_bits(bits & 0xFFFF));
      hi = _mm256_or_si256(hi, fifth_bits(bits >> 16));
    }
  } else {
    const auto* p = reinterpret_cast<const __m128i*>(row + 32 * b);
    lo = _mm256_cvtepi8_epi16(_mm_loadu_si128(p));
    hi = _mm256_cvtepi8_epi16(_mm_loadu_si128(p + 1));
  }
}

constexpr int64_t kChunk = 64;  // blocks whose scales a tile widens at a time

// n (<= kChunk) fp16 of a row's per-block plane as float32, zeros after them up to a multiple
// of 8. No library call (a call would make the kernel keep its sums in memory) and no loop of
// unknown length: the last part vector is a masked load (it reads nothing past the n halves),
// so a tile's scales cost no branch mispredictions (they had cost as much as its blocks).
VLLM_AOT_AVX2 VLLM_AOT_INLINE void widen_halves(const c10::Half* p, int64_t n, float* out) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + i));
    _mm256_storeu_ps(out + i, _mm256_cvtph_ps(v));
  }
  if (i < n) {  // 1-7 halves left: (rest + 1) / 2 dwords loaded, an odd last one masked off
    const int rest = static_cast<int>(n - i);
    const __m128i dwords =
        _mm_cmpgt_epi32(_mm_set1_epi32((rest + 1) / 2), _mm_setr_epi32(0, 1, 2, 3));
    const __m128i halves = _mm_cmpgt_epi16(_mm_set1_epi16(static_cast<int16_t>(rest)),
                                           _mm_setr_epi16(0, 1, 2, 3, 4, 5, 6, 7));
    const __m128i v = _mm_maskload_epi32(reinterpret_cast<const int*>(p + i), dwords);
    _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_and_si128(v, halves)));
  }
}

// Weight row `row`'s factors for blocks c0 .. c0 + n (n <= kChunk) as float32, zeros after them
// up to a multiple of 8: its scales d, and the shift (m - kOffset * d) that multiplies
// s * sum(q) (formats with a minimum or an offset).
template <class F>
VLLM_AOT_AVX2 VLLM_AOT_INLINE void row_factors(const Weights& w, int64_t row, int64_t c0,
                                               int64_t n, float* d, float* shift) {
  widen_halves(w.scale + row * w.blocks + c0, n, d);
  if constexpr (F::kHasMin) widen_halves(w.min + row * w.blocks + c0, n, shift);
  if constexpr (F::kOffset != 0)
    for (int64_t i = 0; i < n; i += 8) {
      const __m256 base = F::kHasMin ? _mm256_loadu_ps(shift + i) : _mm256_setzero_ps();
      _mm256_storeu_ps(shift + i,
                       _mm256_fnmadd_ps(_mm256_loadu_ps(d + i),
                                        _mm256_set1_ps(static_cast<float>(F::kOffset)), base));
    }
}

// Activation rows 0 .. B against weight rows row0 .. row0 + R. Per chunk of blocks, each
// weight row's factors (`row_factors`: widened here, or with kWidened read from `factors`, which
// `rows` widened once for the tile, as it did the codes into `widened`) are multiplied by each
// activation row's scales (d * s, so the inner loop scales a block's sums with one broadcast),
// and the minimum and offset terms,
// (m - kOffset * d) * s * sum(q), join the sums eight blocks at a time. The inner loop then
// takes a cache line of each row's codes at a time (asking for the line kPrefetchRows rows on),
// its sums in registers.
template <class F, int B, int R, bool kWidened, class Out>
VLLM_AOT_AVX2 void tile_rows(const Weights& w, int64_t row0, const Fixed& x, Out* out,
                             const int16_t* widened, const float* factors) {
  static_assert(R == 1 || R == kTileRows, "a tile of 4 rows, or one left over");
  constexpr bool kShift = F::kOffset != 0 || F::kHasMin;
  constexpr int64_t kBlockBytes = F::kNibbles ? 16 : 32;
  constexpr int64_t kPerLine = 64 / kBlockBytes;
  __m256 acc[B][R];
#pragma GCC unroll 8
  for (int b = 0; b < B; ++b)
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) acc[b][r] = _mm256_setzero_ps();
  if constexpr (B == 1) prefetch_planes<R, kToL1>(w, row0);
  alignas(32) float ds[B][R][kChunk];
  for (int64_t c0 = 0; c0 < x.blocks; c0 += kChunk) {
    const int64_t n = std::min(kChunk, x.blocks - c0);
    for (int r = 0; r < R; ++r) {
      alignas(32) float own_d[kChunk], own_shift[kChunk];
      const float* d = own_d;
      const float* shift = own_shift;
      if constexpr (kWidened) {
        d = factors + 2 * r * x.stride + c0;
        shift = d + x.stride;
      } else {
        row_factors<F>(w, row0 + r, c0, n, own_d, own_shift);
      }
      for (int64_t i = 0; i < n; i += 8) {
        const __m256 dv = _mm256_loadu_ps(d + i);
        for (int b = 0; b < B; ++b)
          _mm256_store_ps(ds[b][r] + i,
                          _mm256_mul_ps(dv, _mm256_loadu_ps(x.scales + b * x.stride + c0 + i)));
        if constexpr (kShift) {
          const __m256 v = _mm256_loadu_ps(shift + i);
          for (int b = 0; b < B; ++b)
            acc[b][r] = _mm256_fmadd_ps(v, _mm256_loadu_ps(x.sums + b * x.stride + c0 + i),
                                        acc[b][r]);
        }
      }
    }
    const uint8_t* codes = w.q + row0 * w.q_stride + c0 * kBlockBytes;
    const uint8_t* highs[R];
    for (int r = 0; r < R; ++r) highs[r] = high_row<F>(w, row0 + r, c0);
    const int16_t* xq = x.q + c0 * kBlock;
    const auto block = [&](int64_t i) __attribute__((always_inline, target("avx2,fma,f16c"))) {
      __m256i xs[B][2];  // the block's activations, in registers for every weight row
#pragma GCC unroll 8
      for (int b = 0; b < B; ++b) {
        const auto* q = reinterpret_cast<const __m256i*>(xq + (b * x.blocks + i) * kBlock);
        xs[b][0] = _mm256_loadu_si256(q);
        xs[b][1] = _mm256_loadu_si256(q + 1);
      }
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        __m256i lo, hi;
        if constexpr (kWidened) {
          const auto* p =
              reinterpret_cast<const __m256i*>(widened + (r * x.blocks + c0 + i) * kBlock);
          lo = _mm256_loadu_si256(p);
          hi = _mm256_loadu_si256(p + 1);
        } else {
          codes16<F>(codes + r * w.q_stride, highs[r], i, lo, hi);
        }
#pragma GCC unroll 8
        for (int b = 0; b < B; ++b) {
          const __m256i t = _mm256_add_epi32(_mm256_madd_epi16(lo, xs[b][0]),
                                             _mm256_madd_epi16(hi, xs[b][1]));
          acc[b][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(t), _mm256_broadcast_ss(&ds[b][r][i]),
                                      acc[b][r]);
        }
      }
    };
    int64_t i = 0;
    for (; i + kPerLine <= n; i += kPerLine) {
      if constexpr (B == 1 && !kWidened)  // never faults past the weight's end
#pragma GCC unroll 4
        for (int r = 0; r < R; ++r)
          prefetch_line<kToL1>(codes + (r + kPrefetchRows) * w.q_stride + i * kBlockBytes);
#pragma GCC unroll 4
      for (int64_t j = 0; j < kPerLine; ++j) block(i + j);
    }
    for (; i < n; ++i) block(i);
  }
  const __m256 zero = _mm256_setzero_ps();
  for (int b = 0; b < B; ++b) {
    __m128 y;
    if constexpr (R == 4) {
      y = avx2::reduce4(acc[b][0], acc[b][1], acc[b][2], acc[b][3]);
    } else {
      y = avx2::reduce4(acc[b][0], zero, zero, zero);
    }
    store_sums<R>(y, out + b * w.n + row0);
  }
}

// Activation rows 0 .. m against weight rows row0 .. row0 + R, kRowBlock rows a register block.
// Beyond one register block the tile's codes are widened to int16 once, into a buffer every
// register block then reads (L1 for a few thousand inputs): loads instead of shifts and masks.
template <class F, int R, class Out>
VLLM_AOT_AVX2 void rows(const Weights& w, int64_t row0, const Fixed& x, int64_t m, Out* out) {
  if (m <= kRowBlock) {
    row_blocks<kRowBlock>(m, [&](auto block, int64_t b) {
      tile_rows<F, decltype(block)::value, R, false>(w, row0, x.from(b), out + b * w.n, nullptr,
                                                      nullptr);
    });
    return;
  }
  thread_local std::vector<int16_t> widened;
  thread_local std::vector<float> factors;  // per row: d, then the shift; `stride` each
  widened.resize(R * x.blocks * kBlock);
  factors.resize(2 * R * x.stride);
  for (int r = 0; r < R; ++r)
    for (int64_t c0 = 0; c0 < x.blocks; c0 += kChunk) {
      float* d = factors.data() + 2 * r * x.stride + c0;
      row_factors<F>(w, row0 + r, c0, std::min(kChunk, x.blocks - c0), d, d + x.stride);
    }
  for (int r = 0; r < R; ++r)
    for (int64_t blk = 0; blk < x.blocks; ++blk) {
      __m256i lo, hi;
      codes16<F>(w.q + (row0 + r) * w.q_stride, high_row<F>(w, row0 + r), blk, lo,
                 hi);
      auto* p = reinterpret_cast<__m256i*>(widened.data() + (r * x.blocks + blk) * kBlock);
      _mm256_storeu_si256(p, lo);
      _mm256_storeu_si256(p + 1, hi);
    }
  row_blocks<kRowBlock>(m, [&](auto block, int64_t b) {
    tile_rows<F, decltype(block)::value, R, true>(w, row0, x.from(b), out + b * w.n,
                                                   widened.data(), factors.data());
  });
}

// `MultiplyBf16Fn` for a block format F: up to kMaxDirectRowsAvx2Fixed activation rows.
template <class F>
void multiply(const Weights& w, const c10::BFloat16* x, int64_t m, at::Tensor& out) {
  static_assert(F::kBlockScale, "the block formats (q8_0, q4_0, q4_1, q5_0, q5_1)");
  const Fixed fixed = to_fixed(x, m, w.k);
  parallel_tiles<kTileRows>(w.n, out, [&](auto tile, int64_t row0, auto* o) {
    rows<F, decltype(tile)::value>(w, row0, fixed, m, o);
  });
}

}  // namespace vllm_aot::quant::avx2_fixed
