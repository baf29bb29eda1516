// The quantised linears' integer kernel on AVX2: `vpmaddubsw` multiplies 32 unsigned weight
// codes by 32 signed activations and adds pairs into int16 lanes, `vpmaddwd` by ones adds pairs
// of those into int32 lanes. A step covers two blocks (half an `ActGroup`): inputs 0-15 of both,
// then 16-31 of both, then each block's four lanes scaled and added into float32 accumulators.
//
// A format F provides `W256 F::load256<kTail>(w, row, pair)`: one row's two blocks (kTail: only the
// first) as bytes in the activations' order: 4-bit codes as they are, signed codes (`kSigned`)
// as their magnitudes plus the codes themselves for their signs (maddubs needs one unsigned
// operand, and |q| * (x with q's sign) = q * x stays within int16), its block scales spread over
// each block's four lanes (`kHasScale`) and its block minimums in each block's first lane.
#pragma once

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <cstring>

#include "avx2.h"
#include "quant.h"

namespace vllm_aot::quant::avx2 {

struct W256 {
  __m256i lo, hi;      // unsigned codes (or magnitudes) of inputs 0-15 / 16-31 of two blocks
  __m256i sign_lo, sign_hi;  // signed formats: the codes, whose signs the activations take
  __m256 scale;        // block j's scale in lanes 4j..4j+3
  __m256 min;          // block j's minimum in lane 4j
};

// Two fp16 values (one per block; kTail: one) widened, block j's in lanes 4j..4j+3, or only in
// lane 4j when `first_lane`.
template <bool kTail>
VLLM_AOT_AVX2 inline __m256 spread(const c10::Half* p, bool first_lane) {
  uint32_t bits = 0;
  std::memcpy(&bits, p, kTail ? 2 : 4);
  const __m128 v = _mm_cvtph_ps(_mm_cvtsi32_si128(static_cast<int>(bits)));
  const __m256 s = _mm256_permutevar8x32_ps(_mm256_castps128_ps256(v),
                                            _mm256_set_epi32(1, 1, 1, 1, 0, 0, 0, 0));
  return first_lane ? _mm256_blend_ps(_mm256_setzero_ps(), s, 0x11) : s;
}

// Two blocks of 16 bytes, each holding input j (low nibble) and j + 16 (high nibble).
template <bool kTail>
VLLM_AOT_AVX2 inline void nibbles(const uint8_t* p, W256& v) {
  const __m256i bytes =
      kTail ? _mm256_zextsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))
            : _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  const __m256i low = _mm256_set1_epi8(0x0F);
  v.lo = _mm256_and_si256(bytes, low);
  v.hi = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), low);
}

// Two blocks of 32 int8 codes in input order.
template <bool kTail>
VLLM_AOT_AVX2 inline void signed_codes(const uint8_t* p, W256& v) {
  const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  const __m256i b = kTail ? _mm256_setzero_si256()
                          : _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32));
  v.sign_lo = _mm256_permute2x128_si256(a, b, 0x20);
  v.sign_hi = _mm256_permute2x128_si256(a, b, 0x31);
  v.lo = _mm256_abs_epi8(v.sign_lo);
  v.hi = _mm256_abs_epi8(v.sign_hi);
}

// One block's 32 codes, in input order (16 + 16 bytes), as float32 code * d + m into out.
template <bool kSigned>
VLLM_AOT_AVX2 inline void widen_block(__m128i first, __m128i second, float d, float m,
                                      float* out) {
  const __m256 vd = _mm256_set1_ps(d), vm = _mm256_set1_ps(m);
  const __m128i halves[2] = {first, second};
  for (int h = 0; h < 2; ++h) {
    for (int i = 0; i < 2; ++i) {
      const __m128i eight = i ? _mm_srli_si128(halves[h], 8) : halves[h];
      const __m256i c = kSigned ? _mm256_cvtepi8_epi32(eight) : _mm256_cvtepu8_epi32(eight);
      _mm256_storeu_ps(out + 16 * h + 8 * i, _mm256_fmadd_ps(_mm256_cvtepi32_ps(c), vd, vm));
    }
  }
}

// One block's 16 bytes of nibbles as float32 code * d + m (inputs 0-15 low, 16-31 high).
VLLM_AOT_AVX2 inline void widen_nibbles(const uint8_t* p, float d, float m, float* out) {
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m128i low = _mm_set1_epi8(0x0F);
  widen_block<false>(_mm_and_si128(bytes, low), _mm_and_si128(_mm_srli_epi16(bytes, 4), low), d,
                     m, out);
}

// acc[b][r] += activation row b . weight row row0 + r over pair p (blocks 2p, 2p + 1).
template <class F, int B, int R, bool kTail>
VLLM_AOT_AVX2 inline void step(const Weights& w, int64_t row0, const ActGroup* acts,
                               int64_t groups, int64_t p, __m256 (&acc)[B][R]) {
  W256 wr[R];
  for (int r = 0; r < R; ++r) wr[r] = F::template load256<kTail>(w, row0 + r, p);
  const int64_t g = p / 2, half = p % 2;
  const __m256i ones = _mm256_set1_epi16(1);
  for (int b = 0; b < B; ++b) {
    const ActGroup& x = acts[b * groups + g];
    const auto* q = reinterpret_cast<const __m256i*>(x.q + 32 * half);
    const __m256i xlo = _mm256_load_si256(q), xhi = _mm256_load_si256(q + 2);
    const __m256i init = _mm256_load_si256(reinterpret_cast<const __m256i*>(x.init + 8 * half));
    const __m256 xs = _mm256_load_ps(x.scale + 8 * half);
    for (int r = 0; r < R; ++r) {
      __m256i dot;
      if constexpr (F::kSigned) {
        // Two int16 products of 127 * 127 each: added as int32, not int16.
        const __m256i lo = _mm256_maddubs_epi16(wr[r].lo, _mm256_sign_epi8(xlo, wr[r].sign_lo));
        const __m256i hi = _mm256_maddubs_epi16(wr[r].hi, _mm256_sign_epi8(xhi, wr[r].sign_hi));
        dot = _mm256_add_epi32(_mm256_madd_epi16(lo, ones), _mm256_madd_epi16(hi, ones));
      } else {
        const __m256i sum16 = _mm256_add_epi16(_mm256_maddubs_epi16(wr[r].lo, xlo),
                                               _mm256_maddubs_epi16(wr[r].hi, xhi));
        dot = _mm256_add_epi32(_mm256_madd_epi16(sum16, ones), init);
      }
      const __m256 s = F::kHasScale ? _mm256_mul_ps(wr[r].scale, xs) : xs;
      acc[b][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), s, acc[b][r]);
      if constexpr (F::kHasMin) {
        acc[b][r] = _mm256_fmadd_ps(wr[r].min, _mm256_load_ps(x.sums + 8 * half), acc[b][r]);
      }
    }
  }
}

// out[b][r] for B activation rows and weight rows row0 .. row0 + R.
template <class F, int B, int R, class Out>
VLLM_AOT_AVX2 void tile(const Weights& w, int64_t row0, const ActGroup* acts, int64_t groups,
                        Out* out, int64_t ldo) {
  __m256 acc[B][R];
  for (int b = 0; b < B; ++b)
    for (int r = 0; r < R; ++r) acc[b][r] = _mm256_setzero_ps();
  const int64_t full = w.blocks / 2;
  for (int64_t p = 0; p < full; ++p) step<F, B, R, false>(w, row0, acts, groups, p, acc);
  if (w.blocks % 2) step<F, B, R, true>(w, row0, acts, groups, full, acc);
  for (int b = 0; b < B; ++b) {
    for (int r = 0; r < R; ++r) {
      float v = sum8(acc[b][r]);
      if constexpr (F::kRowScale) v *= w.row_scale[row0 + r];
      store(v, out + b * ldo + r);
    }
  }
}

constexpr int kTileRows = 4;   // weight rows per tile
constexpr int kBlockActs = 3;  // activation rows per register block

template <class F, int R, class Out>
VLLM_AOT_AVX2 void all_rows(const Weights& w, int64_t row0, const ActGroup* acts, int64_t m,
                            int64_t groups, Out* out) {
  int64_t b = 0;
  for (; b + kBlockActs <= m; b += kBlockActs)
    tile<F, kBlockActs, R>(w, row0, acts + b * groups, groups, out + b * w.n + row0, w.n);
  switch (m - b) {
    case 2: return tile<F, 2, R>(w, row0, acts + b * groups, groups, out + b * w.n + row0, w.n);
    case 1: return tile<F, 1, R>(w, row0, acts + b * groups, groups, out + b * w.n + row0, w.n);
    default: return;
  }
}

template <class F, class Out>
VLLM_AOT_AVX2 void tiles(const Weights& w, const ActGroup* acts, int64_t m, int64_t begin,
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

}  // namespace vllm_aot::quant::avx2
