// The block formats (q4_0, q4_1, q5_0, q5_1, q8_0) for bfloat16 activations on CPUs with
// AVX512-VNNI (`quant.h`). Widening the codes to float32 costs more than the multiply (a block
// takes ~6 cycles on the float32 path), so here the codes stay bytes and `vpdpbusd` multiplies 64
// of them (unsigned) by 64 signed bytes a cycle, summed in int32:
//
// - the activations are bfloat16 (8 significant bits) and become 15-bit fixed point per block of
//   32: x = s * q with s = the block's largest |x| / 16383, q = 128 h + l (h signed, l in 0-127,
//   both bytes). Each x moves by at most s / 2 = 2^-15 of its block's largest, far below the
//   bfloat16 rounding it came with (2^-9 of itself), so the sums are the bfloat16 program's to
//   float32-like precision (the tests' bound: `tests/test_quant_kernels.py`).
// - the codes of a group of 4 blocks become two registers, one block per 128-bit lane, inputs
//   0-15 in one and 16-31 in the other (`group_codes`): of the nibble formats 64 bytes as stored
//   (GGUF's layout), low nibbles and high (q5's fifth bits added as 16 under a byte mask); of
//   q8_0 two loads of 2 blocks, their lanes interleaved, the signed codes made unsigned (c + 128,
//   `kCodeOffset`). The activations are rearranged once a call to match (h and l of inputs 0-15,
//   then 16-31, of 4 blocks a group), so four `vpdpbusd` consume the 4 blocks, each lane of the
//   sums holding one block's, and (128 * sum_h + sum_l) times s * d (d the block's scale, spread
//   over its lanes) adds them up.
// - the minimums (q4_1, q5_1) and the codes' offset (q4_0's 8, q5_0's 16, q8_0's 128) are a dot
//   per row over blocks of (m - offset * d) * s * sum(q), added into the sums' lanes before they
//   are reduced.
#pragma once

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "quant.h"
#include "quant_avx512.h"

#define VLLM_AOT_AVX512_VNNI \
  __attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq,avx512vnni")))

namespace vllm_aot::quant::avx512_vnni {

using avx512::lane_sums;
using avx512::sixteen_halves;

constexpr int kTileRows = 4;     // weight rows per tile
constexpr float kLevels = 16383;  // |q| <= 2^14 - 1: q = 128 h + l with h in [-128, 127]

// What the codes as `vpdpbusd` reads them (unsigned bytes) exceed the format's codes by: q8_0's
// signed bytes are flipped to c + 128.
template <class F>
constexpr int kCodeOffset = F::kNibbles ? F::kOffset : 128;

// Bytes of codes a group of 4 blocks takes in a row.
template <class F>
constexpr int64_t kGroupBytes = F::kNibbles ? 64 : 128;

// The activations for one call, in buffers the calling thread reuses: per activation row, per
// group of 4 blocks, 256 bytes (h of inputs 0-15, l of 0-15, h of 16-31, l of 16-31; 16 bytes a
// block), zeros after the last block; per row and group, each lane's block scale s (16 floats);
// per row and block, s * sum(q) (rows of `sums_stride` floats, zeros after the last block).
struct Arranged {
  const int8_t* q;
  const float* scales;
  const float* sums;
  int64_t groups, sums_stride;

  // The same from activation row b on.
  Arranged from(int64_t b) const {
    return {q + b * groups * 256, scales + b * groups * 16, sums + b * sums_stride, groups,
            sums_stride};
  }
};

// Block b of an activation row: its 32 bfloat16 as 15-bit fixed point into the group's bytes
// (`dst`: its 16 bytes of each quarter), its scale s returned and s * sum(q) in `sum`.
VLLM_AOT_AVX512_VNNI VLLM_AOT_INLINE float fixed_point(const c10::BFloat16* x, int8_t* dst,
                                                       float& sum) {
  const __m512i bits = _mm512_loadu_si512(x);  // 32 bfloat16 -> two float32 halves
  const __m512 lo = _mm512_castsi512_ps(
      _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(bits)), 16));
  const __m512 hi = _mm512_castsi512_ps(
      _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(bits, 1)), 16));
  const float largest = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
  const __m512 inv = _mm512_set1_ps(largest > 0.f ? kLevels / largest : 0.f);
  // rounded to nearest even, as nearbyint; |q| <= 16383
  const __m512i qlo = _mm512_cvtps_epi32(_mm512_mul_ps(lo, inv));
  const __m512i qhi = _mm512_cvtps_epi32(_mm512_mul_ps(hi, inv));
  const __m512i low7 = _mm512_set1_epi32(127);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), _mm512_cvtepi32_epi8(_mm512_srai_epi32(qlo, 7)));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + 64),
                   _mm512_cvtepi32_epi8(_mm512_and_si512(qlo, low7)));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + 128),
                   _mm512_cvtepi32_epi8(_mm512_srai_epi32(qhi, 7)));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + 192),
                   _mm512_cvtepi32_epi8(_mm512_and_si512(qhi, low7)));
  const float s = largest / kLevels;
  sum = s * static_cast<float>(_mm512_reduce_add_epi32(_mm512_add_epi32(qlo, qhi)));
  return s;
}

VLLM_AOT_AVX512_VNNI inline Arranged arrange(const c10::BFloat16* x, int64_t m, int64_t k) {
  thread_local std::vector<int8_t> qs;
  thread_local std::vector<float> scales, sums;
  const int64_t blocks = k / kBlock, groups = (blocks + 3) / 4, stride = (blocks + 15) / 16 * 16;
  qs.assign(m * groups * 256, 0);
  scales.assign(m * groups * 16, 0.f);
  sums.assign(m * stride, 0.f);
  for (int64_t b = 0; b < m; ++b)
    for (int64_t blk = 0; blk < blocks; ++blk) {
      const int64_t group = b * groups + blk / 4;
      const float s = fixed_point(x + b * k + blk * kBlock, qs.data() + group * 256 + blk % 4 * 16,
                                  sums[b * stride + blk]);
      for (int lane = 0; lane < 4; ++lane) scales[group * 16 + blk % 4 * 4 + lane] = s;
    }
  return {qs.data(), scales.data(), sums.data(), groups, stride};
}

// Scales of 16 blocks (from a multiple of 16) spread over group i's 4 lanes each.
VLLM_AOT_AVX512_VNNI VLLM_AOT_INLINE __m512 group_scales(__m512 scales, int i) {
  const __m512i lane = _mm512_srli_epi32(
      _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0), 2);
  return _mm512_permutexvar_ps(_mm512_add_epi32(lane, _mm512_set1_epi32(4 * i)), scales);
}

// Blocks c .. c + 16 of a row's minimum and offset terms' factors, m - kCodeOffset * d (zeros
// after its last block): times the activations' s * sum(q), they are what the codes' sums leave out.
template <class F>
VLLM_AOT_AVX512_VNNI VLLM_AOT_INLINE __m512 row_shifts(const Weights& w, int64_t row, int64_t c) {
  __m512 shift = _mm512_setzero_ps();
  if constexpr (kCodeOffset<F> != 0)
    shift = _mm512_mul_ps(sixteen_halves(w.scale + row * w.blocks, c, w.blocks),
                          _mm512_set1_ps(-static_cast<float>(kCodeOffset<F>)));
  if constexpr (F::kHasMin)
    shift = _mm512_add_ps(shift, sixteen_halves(w.min + row * w.blocks, c, w.blocks));
  return shift;
}

// Group g of a row's codes (`left` blocks from its first on: fewer than 4 only in a row's last
// group, loaded under a mask; kWhole groups load whole) as unsigned bytes: inputs 0-15 of each of
// its blocks in `lo`, 16-31 in `hi`, a block a lane.
template <class F, bool kWhole>
VLLM_AOT_AVX512_VNNI VLLM_AOT_INLINE void group_codes(const uint8_t* row, const uint8_t* high,
                                                      int64_t g, int64_t left, __m512i& lo,
                                                      __m512i& hi) {
  const auto load = [](const uint8_t* p, int64_t bytes) VLLM_AOT_AVX512_VNNI {
    if constexpr (kWhole) return _mm512_loadu_si512(p);
    const __mmask64 mask =
        bytes >= 64 ? ~__mmask64{0} : bytes <= 0 ? __mmask64{0} : (__mmask64{1} << bytes) - 1;
    return _mm512_maskz_loadu_epi8(mask, p);
  };
  if constexpr (F::kNibbles) {
    const __m512i low = _mm512_set1_epi8(0x0F);
    const __m512i v = load(row + 64 * g, 16 * left);
    lo = _mm512_and_si512(v, low);
    hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
    if constexpr (kHighBit<F>) {  // block t's fifth bits 0-15 to lane t of lo, 16-31 of hi
      __mmask64 lo_mask = 0, hi_mask = 0;
      for (int64_t t = 0; t < std::min<int64_t>(left, 4); ++t) {
        const uint64_t bits = high_bits(high, 4 * g + t);
        lo_mask |= (bits & 0xFFFF) << (16 * t);
        hi_mask |= (bits >> 16) << (16 * t);
      }
      const __m512i sixteen = _mm512_set1_epi8(16);
      lo = _mm512_mask_add_epi8(lo, lo_mask, lo, sixteen);
      hi = _mm512_mask_add_epi8(hi, hi_mask, hi, sixteen);
    }
  } else {  // blocks 0, 1 in a, 2, 3 in b: [0 lo, 0 hi, 1 lo, 1 hi] -> [0 lo, 1 lo, 2 lo, 3 lo]
    const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
    const uint8_t* p = row + 128 * g;
    const __m512i a = _mm512_xor_si512(load(p, 32 * left), flip);
    const __m512i b = _mm512_xor_si512(load(p + 64, 32 * left - 64), flip);
    lo = _mm512_permutex2var_epi64(a, _mm512_set_epi64(13, 12, 9, 8, 5, 4, 1, 0), b);
    hi = _mm512_permutex2var_epi64(a, _mm512_set_epi64(15, 14, 11, 10, 7, 6, 3, 2), b);
  }
}

// Group g of the tile's rows (their codes from `rows`, their block scales `d` spread over the
// group's lanes) against activation rows 0 .. B, into acc. The tile's codes come first (two
// registers a row), then each activation row's four vectors and its scales are loaded once for
// all the tile's rows, and the low bytes' sums start from the high bytes' shifted by 7:
// 128 h + l with no add (see docs/benchmarks.md#vnni-tiles).
template <class F, int B, int R, bool kWhole>
VLLM_AOT_AVX512_VNNI VLLM_AOT_INLINE void group_step(const uint8_t* const (&rows)[R],
                                                     const uint8_t* const (&highs)[R],
                                                     int64_t ahead, int64_t g, int64_t left,
                                                     const __m512 (&d)[R], const Arranged& x,
                                                     __m512 (&acc)[B][R]) {
  __m512i lo[R], hi[R];
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) {
    for (int64_t line = 0; line < kGroupBytes<F>; line += 64)
      prefetch_line<kToL2>(rows[r] + ahead + kGroupBytes<F> * g + line);
    group_codes<F, kWhole>(rows[r], highs[r], g, left, lo[r], hi[r]);
  }
#pragma GCC unroll 4
  for (int b = 0; b < B; ++b) {
    const int8_t* q = x.q + (b * x.groups + g) * 256;
    const __m512i q0 = _mm512_loadu_si512(q), q1 = _mm512_loadu_si512(q + 64);
    const __m512i q2 = _mm512_loadu_si512(q + 128), q3 = _mm512_loadu_si512(q + 192);
    const __m512 s = _mm512_loadu_ps(x.scales + (b * x.groups + g) * 16);
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      const __m512i h = _mm512_dpbusd_epi32(
          _mm512_dpbusd_epi32(_mm512_setzero_si512(), lo[r], q0), hi[r], q2);
      const __m512i hl = _mm512_dpbusd_epi32(
          _mm512_dpbusd_epi32(_mm512_slli_epi32(h, 7), lo[r], q1), hi[r], q3);
      acc[b][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(hl), _mm512_mul_ps(d[r], s), acc[b][r]);
    }
  }
}

// Activation rows 0 .. B against weight rows row0 .. row0 + R. (Bytes past a row's last block
// load as zeros, or 0x80 flipped from them, against zero activations.) Only a row's last group
// may be part of one, so the others load without a mask, and the loops over rows are unrolled so
// the sums stay in registers (see docs/benchmarks.md#vnni-tiles).
template <class F, int B, int R, class Out>
VLLM_AOT_AVX512_VNNI void tile_rows(const Weights& w, int64_t row0, const Arranged& x, Out* out) {
  __m512 acc[B][R];
  for (int b = 0; b < B; ++b)
    for (int r = 0; r < R; ++r) acc[b][r] = _mm512_setzero_ps();
  prefetch_planes<R, kToL2>(w, row0);
  const uint8_t *rows[R], *highs[R];
  for (int r = 0; r < R; ++r) {
    rows[r] = w.q + (row0 + r) * w.q_stride;
    highs[r] = high_row<F>(w, row0 + r);
  }
  const int64_t ahead = kPrefetchRows * w.q_stride, whole = w.blocks / 4;
  for (int64_t c = 0; c < x.groups; c += 4) {  // 16 blocks: one vector of scales a row
    __m512 scales[R];
    for (int r = 0; r < R; ++r)
      scales[r] = sixteen_halves(w.scale + (row0 + r) * w.blocks, 4 * c, w.blocks);
    for (int64_t g = c; g < std::min(c + 4, x.groups); ++g) {
      __m512 d[R];
      for (int r = 0; r < R; ++r) d[r] = group_scales(scales[r], static_cast<int>(g - c));
      if (g < whole) {
        group_step<F, B, R, true>(rows, highs, ahead, g, 4, d, x, acc);
      } else {
        group_step<F, B, R, false>(rows, highs, ahead, g, w.blocks - 4 * g, d, x, acc);
      }
    }
  }
  // The minimum and offset terms, lane by lane into the sums: each weight row's factors worked
  // out once a tile, times each activation row's block sums. Then an activation row's R sums are
  // reduced and stored together. (Per activation row, these had the factors worked out again and
  // a second reduction, and stored one by one: at 8 rows of SmolLM2's [3072, 576] a quarter of
  // the tile's time.)
  for (int64_t c = 0; c < w.blocks; c += 16) {
    __m512 shift[R];
    for (int r = 0; r < R; ++r) shift[r] = row_shifts<F>(w, row0 + r, c);
    for (int b = 0; b < B; ++b) {
      const __m512 sums = _mm512_loadu_ps(x.sums + b * x.sums_stride + c);
      for (int r = 0; r < R; ++r) acc[b][r] = _mm512_fmadd_ps(shift[r], sums, acc[b][r]);
    }
  }
  for (int b = 0; b < B; ++b) store_sums<R>(lane_sums<R>(acc[b]), out + b * w.n + row0);
}

// Activation rows 0 .. m against weight rows row0 .. row0 + R, four rows a register block.
template <class F, int R, class Out>
VLLM_AOT_AVX512_VNNI void rows(const Weights& w, int64_t row0, const Arranged& x, int64_t m,
                               Out* out) {
  row_blocks<4>(m, [&](auto block, int64_t b) {
    tile_rows<F, decltype(block)::value, R>(w, row0, x.from(b), out + b * w.n);
  });
}

// `MultiplyBf16Fn` for a block format F: up to kMaxDirectRows activation rows.
template <class F>
void multiply(const Weights& w, const c10::BFloat16* x, int64_t m, at::Tensor& out) {
  static_assert(F::kBlockScale, "the block formats (q4_0, q4_1, q5_0, q5_1, q8_0)");
  const Arranged arranged = arrange(x, m, w.k);
  parallel_tiles<kTileRows>(w.n, out, [&](auto tile, int64_t row0, auto* o) {
    rows<F, decltype(tile)::value>(w, row0, arranged, m, o);
  });
}

}  // namespace vllm_aot::quant::avx512_vnni
