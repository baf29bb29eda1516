// The quantised linears' integer kernel on AVX2: `vpmaddubsw` multiplies 32 unsigned weight
// codes by 32 signed activations and adds pairs into int16 lanes, `vpmaddwd` by ones adds pairs
// of those into int32 lanes. A step covers two blocks (half an `ActGroup`): inputs 0-15 of both,
// then 16-31 of both, then each block's four lanes scaled and added into float32 accumulators.
//
// A format F provides `W256 F::load256<kTail>(w, row, pair)`: one row's two blocks (kTail: only the
// first) as bytes in the activations' order: 4-bit codes as they are, signed codes (`kSigned`)
// as their magnitudes plus the codes themselves for their signs (maddubs needs one unsigned
// operand, and |q| * (x with q's sign) = q * x stays within int16), and its block scales spread
// over each block's four lanes (`kHasScale`). Block minimums (`kHasMin`) are a float dot with
// the activations' block sums. Rows are blocked as in `quant_avx512.h`, with the same guarantee:
// a row's result does not depend on the other rows.
#pragma once

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <immintrin.h>

#include <algorithm>
#include <cstring>

#include "avx2.h"
#include "quant.h"

namespace vllm_aot::quant::avx2 {

struct W256 {
  __m256i lo, hi;            // unsigned codes (or magnitudes) of inputs 0-15 / 16-31 of two blocks
  __m256i sign_lo, sign_hi;  // signed formats: the codes, whose signs the activations take
  __m256 scale;              // block j's scale in lanes 4j..4j+3
};

// Two fp16 block scales (kTail: one) widened, block j's in lanes 4j..4j+3.
template <bool kTail>
VLLM_AOT_AVX2 VLLM_AOT_INLINE __m256 spread(const c10::Half* p) {
  uint32_t bits = 0;
  std::memcpy(&bits, p, kTail ? 2 : 4);
  const __m128 v = _mm_cvtph_ps(_mm_cvtsi32_si128(static_cast<int>(bits)));
  return _mm256_permutevar8x32_ps(_mm256_castps128_ps256(v),
                                  _mm256_set_epi32(1, 1, 1, 1, 0, 0, 0, 0));
}

// Two blocks of 16 bytes, each holding input j (low nibble) and j + 16 (high nibble).
template <bool kTail>
VLLM_AOT_AVX2 VLLM_AOT_INLINE void nibbles(const uint8_t* p, W256& v) {
  const __m256i bytes =
      kTail ? _mm256_zextsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))
            : _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  const __m256i low = _mm256_set1_epi8(0x0F);
  v.lo = _mm256_and_si256(bytes, low);
  v.hi = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), low);
}

// Two blocks of 32 int8 codes in input order.
template <bool kTail>
VLLM_AOT_AVX2 VLLM_AOT_INLINE void signed_codes(const uint8_t* p, W256& v) {
  const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  const __m256i b = kTail ? _mm256_setzero_si256()
                          : _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32));
  v.sign_lo = _mm256_permute2x128_si256(a, b, 0x20);
  v.sign_hi = _mm256_permute2x128_si256(a, b, 0x31);
  v.lo = _mm256_abs_epi8(v.sign_lo);
  v.hi = _mm256_abs_epi8(v.sign_hi);
}

// One block's 16 bytes of nibbles as its 32 codes in input order (inputs 0-15 low, 16-31 high).
VLLM_AOT_AVX2 VLLM_AOT_INLINE __m256i nibble_codes(const uint8_t* p) {
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m128i low = _mm_set1_epi8(0x0F);
  return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(bytes, 4), low), _mm_and_si128(bytes, low));
}

// Weight rows row0 .. row0 + rows as float32 [rows, k]: F gives each block's 32 codes
// (`F::codes`, signed when `kSigned`) and w = code * d + m (`F::affine`). Only int8 rows may end
// in a part block, whose codes are the bytes themselves.
template <class F>
VLLM_AOT_AVX2 void dequantize(const Weights& w, int64_t row0, int64_t rows, float* out) {
  for (int64_t r = 0; r < rows; ++r) {
    float* o = out + r * w.k;
    for (int64_t b = 0; b < w.k / kBlock; ++b) {
      const __m256i codes = F::codes(w, row0 + r, b);
      float d, m;
      F::affine(w, row0 + r, b, d, m);
      const __m256 vd = _mm256_set1_ps(d), vm = _mm256_set1_ps(m);
      const __m128i first = _mm256_castsi256_si128(codes);
      const __m128i second = _mm256_extracti128_si256(codes, 1);
      const __m128i eights[4] = {first, _mm_srli_si128(first, 8), second,
                                 _mm_srli_si128(second, 8)};
      for (int i = 0; i < 4; ++i) {
        const __m256i c =
            F::kSigned ? _mm256_cvtepi8_epi32(eights[i]) : _mm256_cvtepu8_epi32(eights[i]);
        _mm256_storeu_ps(o + kBlock * b + 8 * i, _mm256_fmadd_ps(_mm256_cvtepi32_ps(c), vd, vm));
      }
    }
    const auto* q = reinterpret_cast<const int8_t*>(w.q + (row0 + r) * w.q_stride);
    for (int64_t i = w.k / kBlock * kBlock; i < w.k; ++i) o[i] = q[i] * w.row_scale[row0 + r];
  }
}

// acc[b][r] += activation row b . weight row r over one pair (half `half` of a group): x is row
// 0's group, wr weight row r's pair (unpacked). One weight row at a time: AVX2 has 16 registers.
template <class F, int B, int R>
VLLM_AOT_AVX2 VLLM_AOT_INLINE void accumulate(const W256& wr, int r, const ActGroup* x,
                                              int64_t num_groups, int64_t half,
                                              __m256 (&acc)[B][R]) {
  const __m256i ones = _mm256_set1_epi16(1);
  for (int b = 0; b < B; ++b) {
    const ActGroup& a = x[b * num_groups];
    const auto* q = reinterpret_cast<const __m256i*>(a.q + 32 * half);
    const __m256i xlo = _mm256_load_si256(q), xhi = _mm256_load_si256(q + 2);
    __m256i dot;
    if constexpr (F::kSigned) {
      // Two int16 products of 127 * 127 each: added as int32, not int16.
      const __m256i lo = _mm256_maddubs_epi16(wr.lo, _mm256_sign_epi8(xlo, wr.sign_lo));
      const __m256i hi = _mm256_maddubs_epi16(wr.hi, _mm256_sign_epi8(xhi, wr.sign_hi));
      dot = _mm256_add_epi32(_mm256_madd_epi16(lo, ones), _mm256_madd_epi16(hi, ones));
    } else {
      const __m256i sum16 =
          _mm256_add_epi16(_mm256_maddubs_epi16(wr.lo, xlo), _mm256_maddubs_epi16(wr.hi, xhi));
      const auto* init = reinterpret_cast<const __m256i*>(a.init + 8 * half);
      dot = _mm256_add_epi32(_mm256_madd_epi16(sum16, ones), _mm256_load_si256(init));
    }
    const __m256 xs = _mm256_load_ps(a.scale + 8 * half);
    const __m256 s = F::kHasScale ? _mm256_mul_ps(wr.scale, xs) : xs;
    acc[b][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), s, acc[b][r]);
  }
}

// Eight fp16 values widened; at the end of a row `count` < 8 of them, zeros after (pairs through a
// masked load, nothing past the row read).
VLLM_AOT_AVX2 VLLM_AOT_INLINE __m256 widen8(const c10::Half* p, int64_t count) {
  if (count >= 8) return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m128i lanes = _mm_setr_epi32(0, 1, 2, 3), halves = _mm_setr_epi16(0, 1, 2, 3, 4, 5, 6, 7);
  const __m128i pairs = _mm_cmpgt_epi32(_mm_set1_epi32(static_cast<int>(count / 2)), lanes);
  __m128i bits = _mm_maskload_epi32(reinterpret_cast<const int*>(p), pairs);
  if (count % 2) {
    uint16_t last;
    std::memcpy(&last, p + count - 1, 2);
    const __m128i at = _mm_cmpeq_epi16(_mm_set1_epi16(static_cast<int16_t>(count - 1)), halves);
    bits = _mm_blendv_epi8(bits, _mm_set1_epi16(static_cast<int16_t>(last)), at);
  }
  return _mm256_cvtph_ps(bits);
}

// acc[b][r] += weight row row0 + r's block minimums . activation row b0 + b's block sums.
template <int B, int R>
VLLM_AOT_AVX2 VLLM_AOT_INLINE void add_min_terms(const Weights& w, int64_t row0, const Acts& a,
                                                  int64_t b0, __m256 (&acc)[B][R]) {
  for (int64_t c = 0; c < w.blocks; c += 8) {
    __m256 mins[R];
    for (int r = 0; r < R; ++r) mins[r] = widen8(w.min + (row0 + r) * w.blocks + c, w.blocks - c);
    for (int b = 0; b < B; ++b) {
      const __m256 sums = _mm256_load_ps(a.sums + (b0 + b) * a.sums_stride + c);
      for (int r = 0; r < R; ++r) acc[b][r] = _mm256_fmadd_ps(mins[r], sums, acc[b][r]);
    }
  }
}

// The sums of four accumulators' lanes.
VLLM_AOT_AVX2 VLLM_AOT_INLINE __m128 reduce4(__m256 a, __m256 b, __m256 c, __m256 d) {
  const __m256 abcd = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
  return _mm_add_ps(_mm256_castps256_ps128(abcd), _mm256_extractf128_ps(abcd, 1));
}

// out[b][r] = the accumulators' sums (times the row's scale for per-row formats).
template <class F, int B, int R, class Out>
VLLM_AOT_AVX2 VLLM_AOT_INLINE void finish(const Weights& w, int64_t row0, __m256 (&acc)[B][R],
                                           Out* out, int64_t ldo) {
  const __m256 zero = _mm256_setzero_ps();
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
VLLM_AOT_AVX2 VLLM_AOT_INLINE void zero(__m256 (&acc)[B][R]) {
  for (int b = 0; b < B; ++b)
    for (int r = 0; r < R; ++r) acc[b][r] = _mm256_setzero_ps();
}

// Activation rows b0 .. b0 + B against weight rows row0 .. row0 + R read from memory.
template <class F, int B, int R, class Out>
VLLM_AOT_AVX2 void direct_tile(const Weights& w, int64_t row0, const Acts& a, int64_t b0,
                               Out* out) {
  __m256 acc[B][R];
  zero(acc);
  const int64_t full = w.blocks / 2;
  const ActGroup* x = a.groups + b0 * a.num_groups;
  for (int64_t p = 0; p < full; ++p) {
    if constexpr (B == 1) {
      if (p % 2 == 0) prefetch_ahead<R>(w, row0, p * F::kGroupBytes / 2, F::kGroupBytes);
    }
    for (int r = 0; r < R; ++r) {
      const W256 wr = F::template load256<false>(w, row0 + r, p);
      accumulate<F>(wr, r, x + p / 2, a.num_groups, p % 2, acc);
    }
  }
  if (w.blocks % 2) {
    for (int r = 0; r < R; ++r) {
      const W256 wr = F::template load256<true>(w, row0 + r, full);
      accumulate<F>(wr, r, x + full / 2, a.num_groups, full % 2, acc);
    }
  }
  if constexpr (F::kHasMin) add_min_terms(w, row0, a, b0, acc);
  finish<F>(w, row0, acc, out + b0 * w.n + row0, w.n);
}

// Activation rows b0 .. b0 + B against R weight rows unpacked in `tile` ([pairs][R]).
template <class F, int B, int R, class Out>
VLLM_AOT_AVX2 void buffered_tile(const Weights& w, int64_t row0, const W256* tile, const Acts& a,
                                 int64_t b0, Out* out) {
  __m256 acc[B][R];
  zero(acc);
  const ActGroup* x = a.groups + b0 * a.num_groups;
  for (int64_t p = 0; p < (w.blocks + 1) / 2; ++p)
    for (int r = 0; r < R; ++r)
      accumulate<F>(tile[p * R + r], r, x + p / 2, a.num_groups, p % 2, acc);
  if constexpr (F::kHasMin) add_min_terms(w, row0, a, b0, acc);
  finish<F>(w, row0, acc, out + b0 * w.n + row0, w.n);
}

constexpr int kTileRows = 4;   // weight rows per tile
constexpr int kBlockActs = 3;  // activation rows per register block

// Every activation row against weight rows row0 .. row0 + R.
template <class F, int R, class Out>
VLLM_AOT_AVX2 void rows(const Weights& w, int64_t row0, const Acts& a, int64_t m, W256* tile,
                        Out* out) {
  switch (m) {
    case 1: return direct_tile<F, 1, R>(w, row0, a, 0, out);
    case 2: return direct_tile<F, 2, R>(w, row0, a, 0, out);
    case 3: return direct_tile<F, 3, R>(w, row0, a, 0, out);
    default: break;
  }
  const int64_t full = w.blocks / 2;
  for (int64_t p = 0; p < full; ++p)
    for (int r = 0; r < R; ++r) tile[p * R + r] = F::template load256<false>(w, row0 + r, p);
  if (w.blocks % 2)
    for (int r = 0; r < R; ++r) tile[full * R + r] = F::template load256<true>(w, row0 + r, full);
  int64_t b = 0;
  for (; b + kBlockActs <= m; b += kBlockActs)
    buffered_tile<F, kBlockActs, R>(w, row0, tile, a, b, out);
  switch (m - b) {
    case 2: return buffered_tile<F, 2, R>(w, row0, tile, a, b, out);
    case 1: return buffered_tile<F, 1, R>(w, row0, tile, a, b, out);
    default: return;
  }
}

template <class F, class Out>
VLLM_AOT_AVX2 void tiles(const Weights& w, const Acts& a, int64_t m, int64_t begin, int64_t end,
                         W256* tile, Out* out) {
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
    // aten's allocator aligns to 64 bytes (std::vector need not align W256).
    const int64_t size = m > kBlockActs ? (w.blocks + 1) / 2 * kTileRows : 0;
    at::Tensor buffer = at::empty({size * static_cast<int64_t>(sizeof(W256))}, at::kByte);
    auto* tile = reinterpret_cast<W256*>(buffer.data_ptr<uint8_t>());
    if (out.scalar_type() == at::kFloat) {
      tiles<F>(w, a, m, begin, end, tile, out.data_ptr<float>());
    } else {
      tiles<F>(w, a, m, begin, end, tile, out.data_ptr<c10::BFloat16>());
    }
  });
}

}  // namespace vllm_aot::quant::avx2
