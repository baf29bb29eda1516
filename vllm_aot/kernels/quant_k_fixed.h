// The GGUF K-quants (q4_k, q5_k, q6_k) for bfloat16 activations on AVX2: codes times 16-bit
// fixed-point activations by `vpmaddwd`, summed in int32 (`quant_k.h` has the float32 kernel
// and the layouts). As `quant_avx2_fixed.h` does for the 32-input formats, but per super-block:
//
// - an activation row becomes 16-bit fixed point per super-block of 256 inputs: x = s * q with
//   s = the super-block's largest |x| / 32767, so each x moves by at most 2^-16 of its
//   super-block's largest, far below the bfloat16 rounding it came with; per 32 inputs s * sum(q)
//   is kept for the minimums (q4_k, q5_k). A call converts its rows once.
// - a super-block's codes widen to int16 sixteen inputs a vector, already times their sub-block's
//   integer scale (q6_k's offset 32 taken first), so every activation row costs one `vpmaddwd`
//   and one add per sixteen inputs and a row's sums stay integers across sub-blocks: |code * sc|
//   <= 31 * 63 (q5_k) or 32 * 128 (q6_k), |q| <= 32767, so a lane's 32 products of a q4_k or q5_k
//   super-block, or 16 of a q6_k half, stay below 2^31. Each such run becomes float32 once,
//   times d * s, and q4_k's and q5_k's minimums are one FMA a super-block (dmin m against the
//   rows' sums per 32).
// - up to kRows activation rows take the codes from registers, decoded per chunk of 64 inputs;
//   more rows take them from a buffer each weight row is decoded into once (L1: 4 KB for 2048
//   inputs), so every register block of rows reads it. A row's result does not depend on the
//   other rows (the same integer sums and float32 operations in the same order).
#pragma once

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "avx2.h"
#include "quant.h"
#include "quant_avx2_fixed.h"
#include "quant_k.h"

namespace vllm_aot::quant::k_fixed {

using k::kSuper;
constexpr int kRows = 4;          // activation rows per register block
constexpr int kTileRows = 2;      // weight rows per parallel work item
using avx2_fixed::kLevels;        // |q| <= 2^15 - 1

// One call's activations, in buffers the calling thread reuses, laid out for the register blocks
// of kRows rows (`row_blocks`; the last block may be smaller): a block's rows of one super-block
// side by side, so a kernel reads them from one pointer at constant offsets. Per row and
// super-block its 256 inputs as int16, its scale s, and per 32 inputs s * sum(q).
struct Fixed {
  const int16_t* q;    // block b0's super-block sb, row b: q[b0 k + (sb B + b) 256 ..]
  const float* scale;  // [b0 supers + sb B + b]
  const float* sums;   // [(b0 supers + sb B + b) 8 ..]
  int64_t k, supers;

  // The register block from row b on (b a multiple of kRows).
  Fixed from(int64_t b) const {
    return {q + b * k, scale + b * supers, sums + b * supers * 8, k, supers};
  }
};

VLLM_AOT_AVX2 inline Fixed to_fixed(const c10::BFloat16* x, int64_t m, int64_t k) {
  thread_local std::vector<int16_t> qs;
  thread_local std::vector<float> scales, sums;
  const int64_t supers = k / kSuper;
  qs.resize(m * k);
  scales.resize(m * supers);
  sums.resize(m * supers * 8);
  const __m256 sign = _mm256_set1_ps(-0.f);
  for (int64_t r = 0; r < m; ++r) {
    const int64_t b0 = r / kRows * kRows, rows = std::min<int64_t>(kRows, m - b0);
    for (int64_t sb = 0; sb < supers; ++sb) {
      const c10::BFloat16* p = x + r * k + sb * kSuper;
      const int64_t at = b0 * supers + sb * rows + (r - b0);  // (row, super-block) in the layout
      __m256 largest = _mm256_setzero_ps();
      for (int j = 0; j < kSuper; j += 8)
        largest = _mm256_max_ps(largest, _mm256_andnot_ps(sign, load8(p + j)));
      const float top = avx2_fixed::max8(largest);
      const __m256 inv = _mm256_set1_ps(top > 0.f ? kLevels / top : 0.f);
      const float s = top / kLevels;
      for (int j = 0; j < kSuper; j += 32) {
        const int32_t total = avx2_fixed::quantize32(p + j, inv, qs.data() + at * kSuper + j);
        sums[at * 8 + j / 32] = s * static_cast<float>(total);
      }
      scales[at] = s;
    }
  }
  return {qs.data(), scales.data(), sums.data(), k, supers};
}

// A super-block's header: its sub-block scales as int16 (eight a 128-bit half), d, and (q4_k,
// q5_k) the eight dmin m.
struct Header {
  __m128i sc[2];
  float d;
  __m256 mn;
};

VLLM_AOT_AVX2 VLLM_AOT_INLINE __m256i bytes16(const uint8_t* p) {  // 16 bytes as int16
  return _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

VLLM_AOT_AVX2 VLLM_AOT_INLINE __m256i scaled(__m256i codes, __m256i sc) {
  return _mm256_mullo_epi16(codes, sc);
}

// Sub-block S's scale in every int16 lane: one byte shuffle of its half of the scales (a call
// per scale through a general register would cost three instructions).
template <int S>
VLLM_AOT_AVX2 VLLM_AOT_INLINE __m256i scale_of(const Header& h) {
  constexpr char lo = 2 * (S % 8), hi = 2 * (S % 8) + 1;
  const __m256i pick =
      _mm256_setr_epi8(lo, hi, lo, hi, lo, hi, lo, hi, lo, hi, lo, hi, lo, hi, lo, hi, lo, hi, lo,
                       hi, lo, hi, lo, hi, lo, hi, lo, hi, lo, hi, lo, hi);
  return _mm256_shuffle_epi8(_mm256_broadcastsi128_si256(h.sc[S / 8]), pick);
}

// The kWidth bits from bit kBit of each int16 lane of h, moved to bit kTo, the others cleared.
template <int kBit, int kTo, int kWidth>
VLLM_AOT_AVX2 VLLM_AOT_INLINE __m256i bits_at(__m256i h) {
  const __m256i moved =
      kBit >= kTo ? _mm256_srli_epi16(h, kBit - kTo) : _mm256_slli_epi16(h, kTo - kBit);
  return _mm256_and_si256(moved, _mm256_set1_epi16(((1 << kWidth) - 1) << kTo));
}

// q4_k's and q5_k's header: d, dmin, twelve bytes of 6-bit scales and mins.
VLLM_AOT_AVX2 VLLM_AOT_INLINE void scale_min_header(const uint8_t* blk, Header& h) {
  uint32_t u[3];
  std::memcpy(u, blk + 4, 12);
  const uint32_t sc_lo = u[0] & 0x3f3f3f3f, mn_lo = u[1] & 0x3f3f3f3f;
  const uint32_t sc_hi = (u[2] & 0x0f0f0f0f) | ((u[0] >> 2) & 0x30303030);
  const uint32_t mn_hi = ((u[2] >> 4) & 0x0f0f0f0f) | ((u[1] >> 2) & 0x30303030);
  h.sc[0] = _mm_cvtepu8_epi16(_mm_set_epi32(0, 0, sc_hi, sc_lo));
  const __m256 mn = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_set_epi32(0, 0, mn_hi, mn_lo)));
  h.d = k::half_at(blk);
  h.mn = _mm256_mul_ps(mn, _mm256_set1_ps(k::half_at(blk + 2)));
}

// Each format: kChunks chunks of 64 inputs a super-block, an int32 run every kRun chunks;
// chunk<C> its four vectors of sixteen codes times their scales, vector i for the inputs from
// offset(C, i) on.
//
// q4_k and q5_k: d, dmin, twelve bytes of 6-bit scales and mins, (q5_k, kFifth) 32 bytes of fifth
// bits qh, then the nibbles. Nibble bytes 32C .. 32C + 32 hold sub-block 2C's inputs in their low
// nibbles and 2C + 1's in their high ones; q5_k adds bit S of qh[j] as 16 to sub-block S's input j.
template <class F, bool kFifth>
struct ScaleMinK {
  using Float = F;
  static constexpr int kBytes = F::kBytes, kChunks = 4, kRun = 4;
  static constexpr int kNibbles = kFifth ? 48 : 16;  // where the nibbles start
  static constexpr bool kHasMin = true;
  VLLM_AOT_AVX2 static VLLM_AOT_INLINE void header(const uint8_t* blk, Header& h) {
    scale_min_header(blk, h);
  }
  static constexpr int offset(int c, int i) { return 64 * c + 16 * i; }
  template <int C>
  VLLM_AOT_AVX2 static VLLM_AOT_INLINE void chunk(const uint8_t* blk, const Header& h,
                                                  __m256i (&v)[4]) {
    const __m256i a = bytes16(blk + kNibbles + 32 * C), b = bytes16(blk + kNibbles + 16 + 32 * C);
    const __m256i nibble = _mm256_set1_epi16(15);
    __m256i low[2] = {_mm256_and_si256(a, nibble), _mm256_and_si256(b, nibble)};
    __m256i high[2] = {_mm256_srli_epi16(a, 4), _mm256_srli_epi16(b, 4)};
    if constexpr (kFifth) {
      const __m256i qh[2] = {bytes16(blk + 16), bytes16(blk + 32)};
      for (int i = 0; i < 2; ++i) {
        low[i] = _mm256_or_si256(low[i], bits_at<2 * C, 4, 1>(qh[i]));
        high[i] = _mm256_or_si256(high[i], bits_at<2 * C + 1, 4, 1>(qh[i]));
      }
    }
    for (int i = 0; i < 2; ++i) {
      v[i] = scaled(low[i], scale_of<2 * C>(h));
      v[2 + i] = scaled(high[i], scale_of<2 * C + 1>(h));
    }
  }
};

using Q4K = ScaleMinK<k::Q4K, false>;
using Q5K = ScaleMinK<k::Q5K, true>;

struct Q6K {
  using Float = k::Q6K;
  // a run per half of 128 inputs
  static constexpr int kBytes = Float::kBytes, kChunks = 4, kRun = 2;
  static constexpr bool kHasMin = false;
  VLLM_AOT_AVX2 static VLLM_AOT_INLINE void header(const uint8_t* blk, Header& h) {
    const __m128i sc = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 192));
    h.sc[0] = _mm_cvtepi8_epi16(sc);
    h.sc[1] = _mm_cvtepi8_epi16(_mm_srli_si128(sc, 8));
    h.d = k::half_at(blk + 208);
  }
  // Chunk C is half H = C / 2, groups G = C % 2 (low nibbles) and G + 2 (high) of 32 inputs.
  static constexpr int offset(int c, int i) {
    return 128 * (c / 2) + 32 * (c % 2 + 2 * (i / 2)) + 16 * (i % 2);
  }
  // Group G's input J: ql[64 H + 32 (G % 2) + J] >> 4 (G / 2) & 15, plus (qh[32 H + J] >> 2 G
  // & 3) << 4, minus 32; sub-block 8 H + 2 G + J / 16.
  template <int C>
  VLLM_AOT_AVX2 static VLLM_AOT_INLINE void chunk(const uint8_t* blk, const Header& h,
                                                  __m256i (&v)[4]) {
    constexpr int H = C / 2, G = C % 2, S = 8 * H + 2 * G;
    const __m256i a = bytes16(blk + 64 * H + 32 * G), b = bytes16(blk + 64 * H + 32 * G + 16);
    const __m256i ha = bytes16(blk + 128 + 32 * H), hb = bytes16(blk + 144 + 32 * H);
    const __m256i nibble = _mm256_set1_epi16(15), offset = _mm256_set1_epi16(32);
    const auto code = [&](__m256i low, __m256i high, __m256i sc)
        __attribute__((always_inline, target("avx2,fma,f16c"))) {
      return scaled(_mm256_sub_epi16(_mm256_or_si256(low, high), offset), sc);
    };
    v[0] = code(_mm256_and_si256(a, nibble), bits_at<2 * G, 4, 2>(ha), scale_of<S>(h));
    v[1] = code(_mm256_and_si256(b, nibble), bits_at<2 * G, 4, 2>(hb), scale_of<S + 1>(h));
    v[2] = code(_mm256_srli_epi16(a, 4), bits_at<2 * G + 4, 4, 2>(ha), scale_of<S + 4>(h));
    v[3] = code(_mm256_srli_epi16(b, 4), bits_at<2 * G + 4, 4, 2>(hb), scale_of<S + 5>(h));
  }
};

// A weight row decoded once for many activation rows: its codes times their scales in input
// order, and its super-blocks' headers.
struct Decoded {
  const int16_t* codes;
  const Header* headers;
};

// The sum as it stands, in a register: integer adds may be reassociated, and GCC would otherwise
// take every product of a super-block first and add them as a tree (spilling most of them).
VLLM_AOT_AVX2 VLLM_AOT_INLINE void keep(__m256i& v) { asm("" : "+x"(v)); }

// Chunk C's four vectors: decoded from the super-block, or (kDecoded) read from the decoded row's.
template <class F, int C, bool kDecoded>
VLLM_AOT_AVX2 VLLM_AOT_INLINE void chunk_codes(const uint8_t* blk, const Header& h,
                                               const int16_t* decoded, __m256i (&v)[4]) {
  if constexpr (!kDecoded) {
    F::template chunk<C>(blk, h, v);
  } else {
    for (int i = 0; i < 4; ++i)
      v[i] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(decoded + F::offset(C, i)));
  }
}

// Chunks C .. C + kRun of a super-block against B activation rows (`xq`: the rows' inputs of the
// super-block, side by side) into the int32 sums t.
template <class F, int B, bool kDecoded, int C, int kEnd>
VLLM_AOT_AVX2 VLLM_AOT_INLINE void run(const uint8_t* blk, const Header& h, const int16_t* decoded,
                                       const int16_t* xq, __m256i (&t)[B]) {
  if constexpr (C < kEnd) {
    __m256i v[4];
    chunk_codes<F, C, kDecoded>(blk, h, decoded, v);
#pragma GCC unroll 4
    for (int i = 0; i < 4; ++i)
#pragma GCC unroll 4
      for (int b = 0; b < B; ++b) {
        const auto* x = reinterpret_cast<const __m256i*>(xq + b * kSuper + F::offset(C, i));
        t[b] = _mm256_add_epi32(t[b], _mm256_madd_epi16(v[i], _mm256_loadu_si256(x)));
        keep(t[b]);
      }
    run<F, B, kDecoded, C + 1, kEnd>(blk, h, decoded, xq, t);
  }
}

// The runs from chunk C on: acc[b] += float(t) * d * s_b.
template <class F, int B, bool kDecoded, int C>
VLLM_AOT_AVX2 VLLM_AOT_INLINE void runs(const uint8_t* blk, const Header& h, const int16_t* decoded,
                                        const int16_t* xq, const float (&ds)[B], __m256 (&acc)[B]) {
  if constexpr (C < F::kChunks) {
    __m256i t[B];
    for (int b = 0; b < B; ++b) t[b] = _mm256_setzero_si256();
    run<F, B, kDecoded, C, C + F::kRun>(blk, h, decoded, xq, t);
    for (int b = 0; b < B; ++b)
      acc[b] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(t[b]), _mm256_set1_ps(ds[b]), acc[b]);
    runs<F, B, kDecoded, C + F::kRun>(blk, h, decoded, xq, ds, acc);
  }
}

// Weight row `row` against activation rows x[0 .. B) into out[b * n + row]; its codes from the
// file's blocks (the next rows prefetched when `prefetch`) or (kDecoded) from `decoded`.
template <class F, int B, bool kDecoded, class Out>
VLLM_AOT_AVX2 void row_dot(const Weights& w, int64_t row, const Fixed& x, const Decoded* decoded,
                           bool prefetch, Out* out) {
  __m256 acc[B];
  for (int b = 0; b < B; ++b) acc[b] = _mm256_setzero_ps();
  const uint8_t* blocks = w.q + row * w.q_stride;
  const uint8_t* ahead = blocks + kPrefetchRows * w.q_stride;
  constexpr int kBytes = F::kBytes;
  for (int64_t sb = 0; sb < w.blocks; ++sb) {
    const uint8_t* blk = blocks + sb * kBytes;
    Header own;
    const Header* h = &own;
    const int16_t* codes = nullptr;
    if constexpr (kDecoded) {
      h = decoded->headers + sb;
      codes = decoded->codes + sb * kSuper;
    } else {
      if (prefetch) k::prefetch_block<kBytes>(ahead + sb * kBytes);
      F::header(blk, own);
    }
    float ds[B];
    for (int b = 0; b < B; ++b) ds[b] = h->d * x.scale[sb * B + b];
    runs<F, B, kDecoded, 0>(blk, *h, codes, x.q + sb * B * kSuper, ds, acc);
    if constexpr (F::kHasMin)
      for (int b = 0; b < B; ++b)
        acc[b] = _mm256_fnmadd_ps(h->mn, _mm256_loadu_ps(x.sums + (sb * B + b) * 8), acc[b]);
  }
  for (int b = 0; b < B; ++b) store(k::hsum(acc[b]), out + b * w.n + row);
}

// Weight row `row` decoded into the calling thread's buffers.
template <class F, int C = 0>
VLLM_AOT_AVX2 VLLM_AOT_INLINE void decode_chunks(const uint8_t* blk, const Header& h,
                                                 int16_t* out) {
  if constexpr (C < F::kChunks) {
    __m256i v[4];
    F::template chunk<C>(blk, h, v);
    for (int i = 0; i < 4; ++i)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + F::offset(C, i)), v[i]);
    decode_chunks<F, C + 1>(blk, h, out);
  }
}

template <class F>
VLLM_AOT_AVX2 Decoded decode_row(const Weights& w, int64_t row) {
  thread_local std::vector<int16_t> codes;
  thread_local std::vector<Header> headers;
  codes.resize(w.k);
  headers.resize(w.blocks);
  constexpr int kBytes = F::kBytes;
  const uint8_t* blocks = w.q + row * w.q_stride;
  for (int64_t sb = 0; sb < w.blocks; ++sb) {
    const uint8_t* blk = blocks + sb * kBytes;
    for (int off = 0; off < kBytes; off += 64)
      prefetch_line<kToL1>(blk + kPrefetchRows * w.q_stride + off);
    F::header(blk, headers[sb]);
    decode_chunks<F>(blk, headers[sb], codes.data() + sb * kSuper);
  }
  return {codes.data(), headers.data()};
}

// `MultiplyBf16Fn` for K-quant F: up to kMaxDirectRowsAvx2Fixed activation rows.
template <class F>
void multiply(const Weights& w, const c10::BFloat16* x, int64_t m, at::Tensor& out) {
  const Fixed fixed = to_fixed(x, m, w.k);
  parallel_tiles<kTileRows>(w.n, out, [&](auto tile, int64_t row0, auto* o) {
    for (int64_t r = row0; r < row0 + decltype(tile)::value; ++r) {
      if (m <= kRows) {
        row_blocks<kRows>(m, [&](auto block, int64_t b) {
          row_dot<F, decltype(block)::value, false>(w, r, fixed.from(b), nullptr, true,
                                                    o + b * w.n);
        });
        continue;
      }
      const Decoded decoded = decode_row<F>(w, r);
      row_blocks<kRows>(m, [&](auto block, int64_t b) {
        row_dot<F, decltype(block)::value, true>(w, r, fixed.from(b), &decoded, false, o + b * w.n);
      });
    }
  });
}

// A K-quant's entry points (`quant.h`'s `Format`), F this file's traits: float32 activations take
// `quant_k.h`'s kernel (on every instruction set), bfloat16 ones this kernel (AVX2 code, so also
// on AVX-512 CPUs; with AMX below kMinAmxRows rows, the VNNI slot's), many rows the dequantisation.
template <class F>
constexpr Format format() {
  using Float = typename F::Float;
  return {{k::multiply<Float>, k::multiply<Float>},
          {multiply<F>, multiply<F>, multiply<F>, nullptr},
          k::dequantize<Float>,
          k::dequantize_bf16<Float>};
}

}  // namespace vllm_aot::quant::k_fixed
