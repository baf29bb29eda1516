// The quantised linears' integer kernel on AVX-512 VNNI: one `vpdpbusd` multiplies 64 unsigned
// weight codes by 64 signed activations and adds each four products into an int32 lane. A step
// covers one `ActGroup` (four blocks): two `vpdpbusd` (inputs 0-15, then 16-31 of each block),
// then each block's lanes scaled and added into float32 accumulators.
//
// A format F provides `W512 F::load512<kTail>(w, row, group, blocks)`: one row's group of codes as
// unsigned bytes in the activations' order and its block scales spread over each block's four
// lanes (`kHasScale`); kTail loads only the first `blocks` blocks (masked: nothing past the row
// is read). Block minimums (`kHasMin`) are a float dot with the activations' block sums.
//
// A few activation rows (m <= kBlockActs: decode at small batch) take the weights straight from
// memory; more rows unpack each weight-row tile once into a buffer that every block of
// activation rows then reads. Either way each (activation row, weight row) pair runs the same
// operations in the same order, so a row's result does not depend on the others.
#pragma once

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <immintrin.h>

#include <algorithm>

#include "quant.h"

namespace vllm_aot::quant::avx512 {

struct W512 {
  __m512i lo, hi;  // unsigned codes of inputs 0-15 / 16-31 of four blocks
  __m512 scale;    // block j's scale in lanes 4j..4j+3
};

VLLM_AOT_AVX512 VLLM_AOT_INLINE __mmask64 byte_mask(int64_t bytes) {
  return bytes >= 64 ? ~0ULL : bytes <= 0 ? 0ULL : (1ULL << bytes) - 1;
}

// Four fp16 block scales widened, block j's in lanes 4j..4j+3.
template <bool kTail>
VLLM_AOT_AVX512 VLLM_AOT_INLINE __m512 spread(const c10::Half* p, int blocks) {
  const __m128i h = kTail ? _mm_maskz_loadu_epi16((1 << blocks) - 1, p)
                          : _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  const __m512i index = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
  return _mm512_permutexvar_ps(index, _mm512_castps128_ps512(_mm_cvtph_ps(h)));
}

// Four blocks of 16 bytes, each holding input j (low nibble) and j + 16 (high nibble).
template <bool kTail>
VLLM_AOT_AVX512 VLLM_AOT_INLINE void nibbles(const uint8_t* p, int blocks, W512& v) {
  const __m512i bytes =
      kTail ? _mm512_maskz_loadu_epi8(byte_mask(16 * blocks), p) : _mm512_loadu_si512(p);
  const __m512i low = _mm512_set1_epi8(0x0F);
  v.lo = _mm512_and_si512(bytes, low);
  v.hi = _mm512_and_si512(_mm512_srli_epi16(bytes, 4), low);
}

// Four blocks of 32 int8 codes in input order, offset by 128 to unsigned bytes.
template <bool kTail>
VLLM_AOT_AVX512 VLLM_AOT_INLINE void signed_codes(const uint8_t* p, int blocks, W512& v) {
  const __m512i a =
      kTail ? _mm512_maskz_loadu_epi8(byte_mask(32 * blocks), p) : _mm512_loadu_si512(p);
  const __m512i b = kTail ? _mm512_maskz_loadu_epi8(byte_mask(32 * blocks - 64), p + 64)
                          : _mm512_loadu_si512(p + 64);
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
  // 128-bit pieces [0 lo, 0 hi, 1 lo, 1 hi] and [2 lo, ...] -> [0 lo, 1 lo, 2 lo, 3 lo], [.. hi]
  v.lo = _mm512_xor_si512(_mm512_shuffle_i64x2(a, b, 0x88), flip);
  v.hi = _mm512_xor_si512(_mm512_shuffle_i64x2(a, b, 0xDD), flip);
}

// Weight rows row0 .. row0 + rows as bfloat16 [rows, k] (rounded to nearest even), from F's
// block codes and affine map as `avx2::dequantize`.
template <class F>
VLLM_AOT_AVX512_BF16 void dequantize_bf16(const Weights& w, int64_t row0, int64_t rows,
                                          c10::BFloat16* out) {
  for (int64_t r = 0; r < rows; ++r) {
    c10::BFloat16* o = out + r * w.k;
    for (int64_t b = 0; b < w.k / kBlock; ++b) {
      const __m256i codes = F::codes(w, row0 + r, b);
      float d, m;
      F::affine(w, row0 + r, b, d, m);
      const __m512 vd = _mm512_set1_ps(d), vm = _mm512_set1_ps(m);
      __m512 half[2];
      for (int i = 0; i < 2; ++i) {
        const __m128i sixteen =
            i ? _mm256_extracti128_si256(codes, 1) : _mm256_castsi256_si128(codes);
        const __m512i c =
            F::kSigned ? _mm512_cvtepi8_epi32(sixteen) : _mm512_cvtepu8_epi32(sixteen);
        half[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(c), vd, vm);
      }
      _mm512_storeu_si512(o + kBlock * b, (__m512i)_mm512_cvtne2ps_pbh(half[1], half[0]));
    }
    const auto* q = reinterpret_cast<const int8_t*>(w.q + (row0 + r) * w.q_stride);
    for (int64_t i = w.k / kBlock * kBlock; i < w.k; ++i)
      o[i] = c10::BFloat16(q[i] * w.row_scale[row0 + r]);
  }
}

// acc[b][r] += activation row b . weight row r over one group: x is row 0's group, wr the R
// weight rows' (unpacked).
template <class F, int B, int R>
VLLM_AOT_AVX512 VLLM_AOT_INLINE void accumulate(const W512* wr, const ActGroup* x,
                                                int64_t num_groups, __m512 (&acc)[B][R]) {
  for (int b = 0; b < B; ++b) {
    const ActGroup& a = x[b * num_groups];
    const __m512i xlo = _mm512_load_si512(a.q), xhi = _mm512_load_si512(a.q + 64);
    const __m512i init = _mm512_load_si512(a.init);
    const __m512 xs = _mm512_load_ps(a.scale);
    for (int r = 0; r < R; ++r) {
      const __m512i dot =
          _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(init, wr[r].lo, xlo), wr[r].hi, xhi);
      const __m512 s = F::kHasScale ? _mm512_mul_ps(wr[r].scale, xs) : xs;
      acc[b][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), s, acc[b][r]);
    }
  }
}

// acc[b][r] += weight row row0 + r's block minimums . activation row b0 + b's block sums.
template <int B, int R>
VLLM_AOT_AVX512 VLLM_AOT_INLINE void add_min_terms(const Weights& w, int64_t row0, const Acts& a,
                                          int64_t b0, __m512 (&acc)[B][R]) {
  for (int64_t c = 0; c < w.blocks; c += 16) {
    const __mmask16 mask = w.blocks - c >= 16 ? 0xFFFF : (1 << (w.blocks - c)) - 1;
    __m512 mins[R];
    for (int r = 0; r < R; ++r)
      mins[r] = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, w.min + (row0 + r) * w.blocks + c));
    for (int b = 0; b < B; ++b) {
      const __m512 sums = _mm512_load_ps(a.sums + (b0 + b) * a.sums_stride + c);
      for (int r = 0; r < R; ++r) acc[b][r] = _mm512_fmadd_ps(mins[r], sums, acc[b][r]);
    }
  }
}

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

// out[b][r] = the accumulators' sums (times the row's scale for per-row formats).
template <class F, int B, int R, class Out>
VLLM_AOT_AVX512 VLLM_AOT_INLINE void finish(const Weights& w, int64_t row0, __m512 (&acc)[B][R],
                                            Out* out, int64_t ldo) {
  const __m512 zero = _mm512_setzero_ps();
  for (int b = 0; b < B; ++b) {
    for (int r0 = 0; r0 < R; r0 += 4) {
      float sums[4];
      _mm_storeu_ps(sums, reduce4(acc[b][r0], r0 + 1 < R ? acc[b][r0 + 1] : zero,
                                  r0 + 2 < R ? acc[b][r0 + 2] : zero,
                                  r0 + 3 < R ? acc[b][r0 + 3] : zero));
      for (int r = r0; r < std::min(R, r0 + 4); ++r) {
        const float y = F::kRowScale ? sums[r - r0] * w.row_scale[row0 + r] : sums[r - r0];
        store(y, out + b * ldo + r);
      }
    }
  }
}

template <int B, int R>
VLLM_AOT_AVX512 VLLM_AOT_INLINE void zero(__m512 (&acc)[B][R]) {
  for (int b = 0; b < B; ++b)
    for (int r = 0; r < R; ++r) acc[b][r] = _mm512_setzero_ps();
}

// Activation rows b0 .. b0 + B against weight rows row0 .. row0 + R read from memory.
template <class F, int B, int R, class Out>
VLLM_AOT_AVX512 void direct_tile(const Weights& w, int64_t row0, const Acts& a, int64_t b0,
                                 Out* out) {
  __m512 acc[B][R];
  zero(acc);
  const int64_t full = w.blocks / kGroupBlocks;
  const int tail = static_cast<int>(w.blocks % kGroupBlocks);
  const ActGroup* x = a.groups + b0 * a.num_groups;
  W512 wr[R];
  for (int64_t g = 0; g < full; ++g) {
    if constexpr (B == 1) prefetch_ahead<R>(w, row0, g * F::kGroupBytes, F::kGroupBytes);
    for (int r = 0; r < R; ++r) wr[r] = F::template load512<false>(w, row0 + r, g, kGroupBlocks);
    accumulate<F, B, R>(wr, x + g, a.num_groups, acc);
  }
  if (tail) {
    for (int r = 0; r < R; ++r) wr[r] = F::template load512<true>(w, row0 + r, full, tail);
    accumulate<F, B, R>(wr, x + full, a.num_groups, acc);
  }
  if constexpr (F::kHasMin) add_min_terms(w, row0, a, b0, acc);
  finish<F>(w, row0, acc, out + b0 * w.n + row0, w.n);
}

// Activation rows b0 .. b0 + B against R weight rows unpacked in `tile` ([num_groups][R]).
template <class F, int B, int R, class Out>
VLLM_AOT_AVX512 void buffered_tile(const Weights& w, int64_t row0, const W512* tile,
                                   const Acts& a, int64_t b0, Out* out) {
  __m512 acc[B][R];
  zero(acc);
  const ActGroup* x = a.groups + b0 * a.num_groups;
  for (int64_t g = 0; g < a.num_groups; ++g)
    accumulate<F, B, R>(tile + g * R, x + g, a.num_groups, acc);
  if constexpr (F::kHasMin) add_min_terms(w, row0, a, b0, acc);
  finish<F>(w, row0, acc, out + b0 * w.n + row0, w.n);
}

constexpr int kTileRows = 4;   // weight rows per tile
constexpr int kBlockActs = 4;  // activation rows per register block

// Every activation row against weight rows row0 .. row0 + R.
template <class F, int R, class Out>
VLLM_AOT_AVX512 void rows(const Weights& w, int64_t row0, const Acts& a, int64_t m, W512* tile,
                          Out* out) {
  switch (m) {
    case 1: return direct_tile<F, 1, R>(w, row0, a, 0, out);
    case 2: return direct_tile<F, 2, R>(w, row0, a, 0, out);
    case 3: return direct_tile<F, 3, R>(w, row0, a, 0, out);
    case 4: return direct_tile<F, 4, R>(w, row0, a, 0, out);
    default: break;
  }
  const int64_t full = w.blocks / kGroupBlocks;
  const int tail = static_cast<int>(w.blocks % kGroupBlocks);
  for (int64_t g = 0; g < full; ++g)
    for (int r = 0; r < R; ++r) tile[g * R + r] = F::template load512<false>(w, row0 + r, g, 4);
  if (tail)
    for (int r = 0; r < R; ++r)
      tile[full * R + r] = F::template load512<true>(w, row0 + r, full, tail);
  int64_t b = 0;
  for (; b + kBlockActs <= m; b += kBlockActs)
    buffered_tile<F, kBlockActs, R>(w, row0, tile, a, b, out);
  switch (m - b) {
    case 3: return buffered_tile<F, 3, R>(w, row0, tile, a, b, out);
    case 2: return buffered_tile<F, 2, R>(w, row0, tile, a, b, out);
    case 1: return buffered_tile<F, 1, R>(w, row0, tile, a, b, out);
    default: return;
  }
}

template <class F, class Out>
VLLM_AOT_AVX512 void tiles(const Weights& w, const Acts& a, int64_t m, int64_t begin, int64_t end,
                           W512* tile, Out* out) {
  for (int64_t t = begin; t < end; ++t) {
    const int64_t row0 = t * kTileRows;
    if (row0 + kTileRows <= w.n) {
      rows<F, kTileRows>(w, row0, a, m, tile, out);
    } else {
      for (int64_t r = row0; r < w.n; ++r) rows<F, 1>(w, r, a, m, tile, out);
    }
  }
}

// `MultiplyFn` for format F.
template <class F>
void multiply(const Weights& w, const Acts& a, int64_t m, at::Tensor& out) {
  at::parallel_for(0, (w.n + kTileRows - 1) / kTileRows, 1, [&](int64_t begin, int64_t end) {
    // aten's allocator aligns to 64 bytes (std::vector need not align W512).
    const int64_t size = m > kBlockActs ? a.num_groups * kTileRows : 0;
    at::Tensor buffer = at::empty({size * static_cast<int64_t>(sizeof(W512))}, at::kByte);
    auto* tile = reinterpret_cast<W512*>(buffer.data_ptr<uint8_t>());
    if (out.scalar_type() == at::kFloat) {
      tiles<F>(w, a, m, begin, end, tile, out.data_ptr<float>());
    } else {
      tiles<F>(w, a, m, begin, end, tile, out.data_ptr<c10::BFloat16>());
    }
  });
}

}  // namespace vllm_aot::quant::avx512
