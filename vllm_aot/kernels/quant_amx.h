// The quantised linears for several bfloat16 activation rows on CPUs with AMX (`quant.h`). The
// direct kernels' work grows with the rows (every block meets every row in vector registers);
// here it does not: each block of 32 weights is dequantised once into tiles in L1, and AMX's tile
// multiply (`tdpbf16ps`: 16 x 16 x 32 in one instruction, float32 sums) applies it to 16
// activation rows at a time. So a step of 4-32 rows reads and widens its weights once, as one
// row does.
//
// - A weight w = code * d + m (float32) is two bfloat16 tiles: hi, w with its low 16 bits cut
//   off (exact), and lo, the rest (w - hi, exact in float32) rounded. Both multiply the same
//   activations into the same sums, so each weight moves by at most 2^-16 of itself: the
//   products are the exact weights' to float32-like precision, as the direct kernels' are. (hi
//   alone, the weights rounded to bfloat16, would save a third of the dequantisation but move
//   each weight by up to 2^-9 of itself.)
// - The weights are tiles A (16 weight rows x one block of 32 inputs, row-major); the
//   activations are tiles B (the pairs of inputs interleaved by row, as AMX wants them: packed
//   once a call); C is 16 weight rows x up to 16 activation rows, written out transposed.
// - A work item is 32 weight rows against up to 16 activation rows, or 16 weight rows against
//   up to 32: two C tiles, four A tiles (hi and lo), one or two B tiles.
// - A row's result does not depend on the other rows: its sums run in the same order whatever
//   m (from kMinAmxRows; fewer take the direct kernels).
#pragma once

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <immintrin.h>

#include <algorithm>
#include <vector>

#include "quant.h"
#include "quant_avx512.h"

#define VLLM_AOT_AMX                                                                            \
  __attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,amx-tile," \
                        "amx-bf16")))

namespace vllm_aot::quant::amx {

using avx512::sixteen_halves;

constexpr int kTile = 16;  // rows of a tile: weight rows of A, input pairs of B

// The tile configuration `ldtilecfg` reads (palette 1). Tiles: C 0-1 (16 weight rows x
// `columns` activation rows), A hi 2-3 and lo 4-5 (16 weight rows x 32 inputs), B 6-7 (16 pairs
// of inputs x `columns` activation rows).
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};

  explicit TileConfig(int64_t columns) {
    for (int t = 0; t < 8; ++t) {
      rows[t] = kTile;
      colsb[t] = t >= 2 && t <= 5 ? 64 : static_cast<uint16_t>(4 * columns);
    }
  }
};

// 0, 16, 32, ... 240: sixteen rows of a tile of floats or pairs.
VLLM_AOT_AMX VLLM_AOT_INLINE __m512i tile_rows() {
  return _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                            _mm512_set1_epi32(kTile));
}

// x [m <= 32, k] as B tiles: per 16 activation rows and block of 32 inputs, 16 rows of 64 bytes
// (row p holds inputs 2p and 2p + 1 of each activation row in turn), zeros past the last row.
VLLM_AOT_AMX inline const uint32_t* pack(const c10::BFloat16* x, int64_t m, int64_t k) {
  thread_local std::vector<uint32_t> packed;
  const int64_t blocks = k / kBlock;
  packed.assign((m + kTile - 1) / kTile * blocks * kTile * kTile, 0);
  for (int64_t r = 0; r < m; ++r) {
    const auto* row = reinterpret_cast<const uint32_t*>(x + r * k);
    uint32_t* half = packed.data() + r / kTile * blocks * kTile * kTile + r % kTile;
    for (int64_t b = 0; b < blocks; ++b)
      _mm512_i32scatter_epi32(half + b * kTile * kTile, tile_rows(),
                              _mm512_loadu_si512(row + b * kTile), 4);
  }
  return packed.data();
}

// An item's weight rows' block scales d and minimums m as float32, rows of `stride` (the codes'
// offset folded into m: q4_0's w = code * d - 8 d). Rows past the weight's last repeat it.
template <class F>
VLLM_AOT_AMX void item_affine(const Weights& w, int64_t n0, int rows, float* d, float* mn,
                              int64_t stride) {
  for (int r = 0; r < rows; ++r) {
    const int64_t row = std::min<int64_t>(n0 + r, w.n - 1);
    for (int64_t c = 0; c < w.blocks; c += 16) {
      const __m512 scale = F::kRowScale ? _mm512_set1_ps(w.row_scale[row])
                                        : sixteen_halves(w.scale + row * w.blocks, c, w.blocks);
      __m512 minimum = _mm512_mul_ps(scale, _mm512_set1_ps(-static_cast<float>(F::kOffset)));
      if constexpr (F::kHasMin) minimum = sixteen_halves(w.min + row * w.blocks, c, w.blocks);
      _mm512_storeu_ps(d + r * stride + c, scale);
      _mm512_storeu_ps(mn + r * stride + c, minimum);
    }
  }
}

// A block of 32 weights (codes at p, fifth bits `bits` for kHighBit), code * d + m in float32,
// as bfloat16 hi (cut) and lo (the rest, rounded) into 64 bytes each.
template <class F>
VLLM_AOT_AMX VLLM_AOT_INLINE void block_bf16(const uint8_t* p, uint32_t bits, __m512 d, __m512 m,
                                             c10::BFloat16* hi, c10::BFloat16* lo) {
  __m512i a, b;
  if constexpr (F::kNibbles) {  // input j in the low nibble of byte j, j + 16 in the high one
    const __m512i bytes =
        _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    a = _mm512_and_si512(bytes, _mm512_set1_epi32(0x0F));
    b = _mm512_srli_epi32(bytes, 4);
    if constexpr (kHighBit<F>) {  // 16 where fifth bit j is set, j = the input
      const __m512i sixteen = _mm512_set1_epi32(16);
      a = _mm512_mask_or_epi32(a, static_cast<__mmask16>(bits), a, sixteen);
      b = _mm512_mask_or_epi32(b, static_cast<__mmask16>(bits >> 16), b, sixteen);
    }
  } else {
    const auto* bytes = reinterpret_cast<const __m128i*>(p);
    a = _mm512_cvtepi8_epi32(_mm_loadu_si128(bytes));
    b = _mm512_cvtepi8_epi32(_mm_loadu_si128(bytes + 1));
  }
  const __m512 wa = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a), d, m);  // inputs 0-15
  const __m512 wb = _mm512_fmadd_ps(_mm512_cvtepi32_ps(b), d, m);  // inputs 16-31
  const __m512i cut = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  const __m512 ha = _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(wa), cut));
  const __m512 hb = _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(wb), cut));
  // the high halves of the 32 float32 in order: words 1, 3, ... of wa, then of wb
  const __m512i odd =
      _mm512_set_epi16(63, 61, 59, 57, 55, 53, 51, 49, 47, 45, 43, 41, 39, 37, 35, 33, 31, 29, 27,
                       25, 23, 21, 19, 17, 15, 13, 11, 9, 7, 5, 3, 1);
  _mm512_store_si512(hi, _mm512_permutex2var_epi16(_mm512_castps_si512(wa), odd,
                                                   _mm512_castps_si512(wb)));
  const __m512bh rest = _mm512_cvtne2ps_pbh(_mm512_sub_ps(wb, hb), _mm512_sub_ps(wa, ha));
  _mm512_store_si512(lo, (__m512i)rest);
}

// C tile `sums` (16 weight rows x `columns` activation rows, rows of 16 floats) into
// out[j][i] (rows of n) for i < `valid` weight rows.
template <class Out>
VLLM_AOT_AMX void write_out(const float* sums, int64_t columns, int64_t valid, Out* out,
                            int64_t n) {
  const __mmask16 mask = valid >= kTile ? 0xFFFF : (1u << valid) - 1;
  for (int64_t j = 0; j < columns; ++j) {
    const __m512 y = _mm512_i32gather_ps(tile_rows(), sums + j, 4);
    if constexpr (std::is_same_v<Out, float>) {
      _mm512_mask_storeu_ps(out + j * n, mask, y);
    } else {
      _mm256_mask_storeu_epi16(out + j * n, mask, (__m256i)_mm512_cvtneps_pbh(y));
    }
  }
}

// C tile w * H + h += A (hi and lo of weight tile w) times B h, for block s's tiles.
template <int W, int H>
VLLM_AOT_AMX VLLM_AOT_INLINE void multiply_block(const c10::BFloat16* hi, const c10::BFloat16* lo,
                                                 const uint32_t* b, int64_t b_half, int64_t s) {
  _tile_loadd(2, hi, 64);
  _tile_loadd(4, lo, 64);
  if constexpr (W == 2) {
    _tile_loadd(3, hi + kTile * kBlock, 64);
    _tile_loadd(5, lo + kTile * kBlock, 64);
  }
  _tile_loadd(6, b + s * kTile * kTile, 64);
  if constexpr (H == 2) _tile_loadd(7, b + b_half + s * kTile * kTile, 64);
  _tile_dpbf16ps(0, 2, 6);
  _tile_dpbf16ps(0, 4, 6);
  if constexpr (W == 2) {
    _tile_dpbf16ps(1, 3, 6);
    _tile_dpbf16ps(1, 5, 6);
  } else {
    _tile_dpbf16ps(1, 2, 7);
    _tile_dpbf16ps(1, 4, 7);
  }
}

// Weight rows n0 .. n0 + 16 W against activation rows 0 .. 16 H (B tiles b, the second half
// b_half further on).
template <class F, int W, int H, class Out>
VLLM_AOT_AMX void item(const Weights& w, int64_t n0, const uint32_t* b, int64_t b_half, int64_t m,
                       Out* out) {
  static_assert(W * H == 2, "two C tiles");
  constexpr int kRows = W * kTile;
  constexpr int64_t kBlockBytes = F::kNibbles ? kBlock / 2 : kBlock;
  const int64_t stride = (w.blocks + 15) / 16 * 16;
  thread_local std::vector<float> scales;
  scales.resize(2 * kRows * stride);
  float *d = scales.data(), *mn = d + kRows * stride;
  item_affine<F>(w, n0, kRows, d, mn, stride);
  const uint8_t *codes[kRows], *highs[kRows];
  for (int r = 0; r < kRows; ++r) {
    const int64_t row = std::min<int64_t>(n0 + r, w.n - 1);
    codes[r] = w.q + row * w.q_stride;
    highs[r] = high_row<F>(w, row);
  }
  alignas(64) c10::BFloat16 buffers[2][2][kRows * kBlock];  // [stage][hi, lo]
  _tile_zero(0);
  _tile_zero(1);
  // The next item's codes (contiguous rows), a share each step: 32 row streams at once are more
  // than the hardware prefetcher follows.
  const int64_t next = std::min<int64_t>(n0 + kRows, w.n);
  const int64_t ahead_bytes = (std::min<int64_t>(next + kRows, w.n) - next) * w.q_stride;
  const char* ahead = reinterpret_cast<const char*>(w.q + next * w.q_stride);
  const int64_t lines_per_step = (ahead_bytes / 64 + w.blocks) / w.blocks;
  // Block s + 1 is dequantised while the tiles take block s, so the tile loads never wait for
  // the stores that fill them.
  const auto dequantize = [&](int64_t s) VLLM_AOT_AMX {
    for (int64_t l = s * lines_per_step; l < (s + 1) * lines_per_step && 64 * l < ahead_bytes; ++l)
      _mm_prefetch(ahead + 64 * l, _MM_HINT_T0);
    for (int r = 0; r < kRows; ++r)
      block_bf16<F>(codes[r] + s * kBlockBytes, kHighBit<F> ? high_bits(highs[r], s) : 0u,
                    _mm512_set1_ps(d[r * stride + s]),
                    _mm512_set1_ps(mn[r * stride + s]), buffers[s & 1][0] + r * kBlock,
                    buffers[s & 1][1] + r * kBlock);
  };
  dequantize(0);
  for (int64_t s = 0; s < w.blocks; ++s) {
    if (s + 1 < w.blocks) dequantize(s + 1);
    multiply_block<W, H>(buffers[s & 1][0], buffers[s & 1][1], b, b_half, s);
  }
  alignas(64) float sums[2 * kTile * kTile];
  _tile_stored(0, sums, 64);
  _tile_stored(1, sums + kTile * kTile, 64);
  for (int t = 0; t < 2; ++t) {  // C tile t: weight tile t (W = 2) or activation half t (H = 2)
    const int64_t row0 = n0 + (W == 2 ? t * kTile : 0), act0 = H == 2 ? t * kTile : 0;
    const int64_t valid = std::min<int64_t>(kTile, w.n - row0);
    const int64_t columns = std::min<int64_t>(kTile, m - act0);
    if (valid > 0 && columns > 0)
      write_out(sums + t * kTile * kTile, columns, valid, out + act0 * w.n + row0, w.n);
  }
}

// Work items begin .. end: 32 weight rows each for up to 16 activation rows, else 16.
template <class F, class Out>
VLLM_AOT_AMX void items(const Weights& w, const uint32_t* b, int64_t m, Out* out, int64_t begin,
                        int64_t end) {
  const TileConfig config(std::min<int64_t>(m, kTile));
  _tile_loadconfig(&config);
  const int64_t b_half = w.blocks * kTile * kTile;
  for (int64_t i = begin; i < end; ++i) {
    if (m > kTile) {
      item<F, 1, 2>(w, i * kTile, b, b_half, m, out);
    } else {
      item<F, 2, 1>(w, i * 2 * kTile, b, b_half, m, out);
    }
  }
  _tile_release();
}

// `MultiplyBf16Fn` for format F: up to kMaxAmxRows activation rows, k a multiple of 32.
template <class F>
void multiply(const Weights& w, const c10::BFloat16* x, int64_t m, at::Tensor& out) {
  const uint32_t* b = pack(x, m, w.k);
  const int64_t rows = m > kTile ? kTile : 2 * kTile;  // weight rows per item
  at::parallel_for(0, (w.n + rows - 1) / rows, 1, [&](int64_t begin, int64_t end) {
    if (out.scalar_type() == at::kFloat) {
      items<F>(w, b, m, out.data_ptr<float>(), begin, end);
    } else {
      items<F>(w, b, m, out.data_ptr<c10::BFloat16>(), begin, end);
    }
  });
}

}  // namespace vllm_aot::quant::amx
