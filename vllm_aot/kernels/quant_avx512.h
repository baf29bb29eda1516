// The quantised linears' integer kernel on AVX-512 VNNI: one `vpdpbusd` multiplies 64 unsigned
// weight codes by 64 signed activations and adds each four products into an int32 lane. A step
// covers one `ActGroup` (four blocks): two `vpdpbusd` (inputs 0-15, then 16-31 of each block),
// then each block's lanes scaled and added into float32 accumulators.
//
// A format F provides `W512 F::load512<kTail>(w, row, group, blocks)`: one row's group of codes as
// unsigned bytes in the activations' order, its block scales spread over each block's four lanes
// (`kHasScale`) and its block minimums in each block's first lane (`kHasMin`); kTail loads only
// the first `blocks` blocks (masked: nothing past the row is read).
#pragma once

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>

#include "quant.h"

namespace vllm_aot::quant::avx512 {

struct W512 {
  __m512i lo, hi;  // unsigned codes of inputs 0-15 / 16-31 of four blocks
  __m512 scale;    // block j's scale in lanes 4j..4j+3
  __m512 min;      // block j's minimum in lane 4j
};

VLLM_AOT_AVX512 inline __mmask64 byte_mask(int64_t bytes) {
  return bytes >= 64 ? ~0ULL : bytes <= 0 ? 0ULL : (1ULL << bytes) - 1;
}

// Four fp16 values (one per block) widened, block j's in the lanes of `lanes` among 4j..4j+3.
template <bool kTail>
VLLM_AOT_AVX512 inline __m512 spread(const c10::Half* p, int blocks, __mmask16 lanes) {
  const __m128i h = kTail ? _mm_maskz_loadu_epi16((1 << blocks) - 1, p)
                          : _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  const __m512i index = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
  return _mm512_maskz_permutexvar_ps(lanes, index, _mm512_castps128_ps512(_mm_cvtph_ps(h)));
}

constexpr __mmask16 kAllLanes = 0xFFFF, kFirstLanes = 0x1111;

// Four blocks of 16 bytes, each holding input j (low nibble) and j + 16 (high nibble).
template <bool kTail>
VLLM_AOT_AVX512 inline void nibbles(const uint8_t* p, int blocks, W512& v) {
  const __m512i bytes =
      kTail ? _mm512_maskz_loadu_epi8(byte_mask(16 * blocks), p) : _mm512_loadu_si512(p);
  const __m512i low = _mm512_set1_epi8(0x0F);
  v.lo = _mm512_and_si512(bytes, low);
  v.hi = _mm512_and_si512(_mm512_srli_epi16(bytes, 4), low);
}

// Four blocks of 32 int8 codes in input order, offset by 128 to unsigned bytes.
template <bool kTail>
VLLM_AOT_AVX512 inline void signed_codes(const uint8_t* p, int blocks, W512& v) {
  const __m512i a =
      kTail ? _mm512_maskz_loadu_epi8(byte_mask(32 * blocks), p) : _mm512_loadu_si512(p);
  const __m512i b = kTail ? _mm512_maskz_loadu_epi8(byte_mask(32 * blocks - 64), p + 64)
                          : _mm512_loadu_si512(p + 64);
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
  // 128-bit pieces [0 lo, 0 hi, 1 lo, 1 hi] and [2 lo, ...] -> [0 lo, 1 lo, 2 lo, 3 lo], [.. hi]
  v.lo = _mm512_xor_si512(_mm512_shuffle_i64x2(a, b, 0x88), flip);
  v.hi = _mm512_xor_si512(_mm512_shuffle_i64x2(a, b, 0xDD), flip);
}

// acc[b][r] += activation row b . weight row row0 + r over group g (`blocks` of its four).
template <class F, int B, int R, bool kTail>
VLLM_AOT_AVX512 inline void step(const Weights& w, int64_t row0, const ActGroup* acts,
                                 int64_t groups, int64_t g, int blocks, __m512 (&acc)[B][R]) {
  W512 wr[R];
  for (int r = 0; r < R; ++r) wr[r] = F::template load512<kTail>(w, row0 + r, g, blocks);
  for (int b = 0; b < B; ++b) {
    const ActGroup& x = acts[b * groups + g];
    const __m512i xlo = _mm512_load_si512(x.q), xhi = _mm512_load_si512(x.q + 64);
    const __m512i init = _mm512_load_si512(x.init);
    const __m512 xs = _mm512_load_ps(x.scale);
    for (int r = 0; r < R; ++r) {
      const __m512i dot = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(init, wr[r].lo, xlo), wr[r].hi, xhi);
      const __m512 s = F::kHasScale ? _mm512_mul_ps(wr[r].scale, xs) : xs;
      acc[b][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), s, acc[b][r]);
      if constexpr (F::kHasMin) {
        acc[b][r] = _mm512_fmadd_ps(wr[r].min, _mm512_load_ps(x.sums), acc[b][r]);
      }
    }
  }
}

// out[b][r] for B activation rows and weight rows row0 .. row0 + R.
template <class F, int B, int R, class Out>
VLLM_AOT_AVX512 void tile(const Weights& w, int64_t row0, const ActGroup* acts, int64_t groups,
                          Out* out, int64_t ldo) {
  __m512 acc[B][R];
  for (int b = 0; b < B; ++b)
    for (int r = 0; r < R; ++r) acc[b][r] = _mm512_setzero_ps();
  const int64_t full = w.blocks / kGroupBlocks;
  const int tail = static_cast<int>(w.blocks % kGroupBlocks);
  for (int64_t g = 0; g < full; ++g) step<F, B, R, false>(w, row0, acts, groups, g, 4, acc);
  if (tail) step<F, B, R, true>(w, row0, acts, groups, full, tail, acc);
  for (int b = 0; b < B; ++b) {
    for (int r = 0; r < R; ++r) {
      float v = _mm512_reduce_add_ps(acc[b][r]);
      if constexpr (F::kRowScale) v *= w.row_scale[row0 + r];
      store(v, out + b * ldo + r);
    }
  }
}

constexpr int kTileRows = 4;   // weight rows per tile
constexpr int kBlockActs = 4;  // activation rows per register block

// Every activation row against weight rows row0 .. row0 + R, kBlockActs rows at a time.
template <class F, int R, class Out>
VLLM_AOT_AVX512 void all_rows(const Weights& w, int64_t row0, const ActGroup* acts, int64_t m,
                              int64_t groups, Out* out) {
  int64_t b = 0;
  for (; b + kBlockActs <= m; b += kBlockActs)
    tile<F, kBlockActs, R>(w, row0, acts + b * groups, groups, out + b * w.n + row0, w.n);
  switch (m - b) {
    case 3: return tile<F, 3, R>(w, row0, acts + b * groups, groups, out + b * w.n + row0, w.n);
    case 2: return tile<F, 2, R>(w, row0, acts + b * groups, groups, out + b * w.n + row0, w.n);
    case 1: return tile<F, 1, R>(w, row0, acts + b * groups, groups, out + b * w.n + row0, w.n);
    default: return;
  }
}

template <class F, class Out>
VLLM_AOT_AVX512 void tiles(const Weights& w, const ActGroup* acts, int64_t m, int64_t begin,
                           int64_t end, Out* out) {
  const int64_t groups = (w.blocks + kGroupBlocks - 1) / kGroupBlocks;
  for (int64_t t = begin; t < end; ++t) {
    const int64_t row0 = t * kTileRows;
    if (row0 + kTileRows <= w.n) {
      all_rows<F, kTileRows>(w, row0, acts, m, groups, out);
    } else {
      for (int64_t r = row0; r < w.n; ++r) all_rows<F, 1>(w, r, acts, m, groups, out);
    }
  }
}

// `MultiplyFn` for format F.
template <class F>
void multiply(const Weights& w, const ActGroup* acts, int64_t m, at::Tensor& out) {
  at::parallel_for(0, (w.n + kTileRows - 1) / kTileRows, 1, [&](int64_t begin, int64_t end) {
    if (out.scalar_type() == at::kFloat) {
      tiles<F>(w, acts, m, begin, end, out.data_ptr<float>());
    } else {
      tiles<F>(w, acts, m, begin, end, out.data_ptr<c10::BFloat16>());
    }
  });
}

}  // namespace vllm_aot::quant::avx512
