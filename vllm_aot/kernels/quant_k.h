// What the GGUF K-quant linears (linear_q4_k/q5_k/q6_k.cpp) share. A weight is one plane, its
// rows' super-blocks of 256 inputs as the file stores them (layouts in models/formats_k.py):
// `Weights.q` the blocks, q_stride the bytes of a row, blocks = k / 256, scale and min null. The
// driver is `quant.h`'s `linear`: up to kMaxDirectRows activation rows the direct kernel here,
// beyond that rows dequantised (`dequantize`) for aten's GEMM.
//
// The direct kernel (float32 arithmetic, AVX2 + FMA): weight-row tiles in parallel; each row's
// super-blocks stream once, front to back, for a register block of up to four activation rows
// (the row's codes stay in L1 for further blocks; rows kPrefetchRows ahead prefetched a block at
// a time). Per super-block the sub-block scales (and q4_k's, q5_k's mins) are unpacked once into
// float32 (`Scales`); per sub-block t = codes . x in eight lanes, the codes widened from their
// bits in registers (`code8`), and acc += t * d sc; q4_k's and q5_k's mins are one FMA a
// super-block, the eight dmin m against the activations' sub-block sums. q6_k's offset 32 is
// taken from the codes. A row's result does not depend on the other rows.
//
// bfloat16 activations take the fixed-point kernel (`quant_k_fixed.h`, which also gathers each
// format's entry points). The AVX-512 slots take these AVX2 functions (no AVX-512 or AMX path of
// their own), and `dequantize_bf16` (aten's bfloat16 GEMM where the CPU multiplies bfloat16
// natively) rounds the float32 dequantisation.
#pragma once

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <cstdint>
#include <cstring>
#include <vector>

#include "quant.h"

namespace vllm_aot::quant::k {

constexpr int64_t kSuper = 256;  // inputs per super-block
constexpr int kTileRows = 2;     // weight rows per parallel work item
constexpr int kRows = 4;         // activation rows per register block

VLLM_AOT_AVX2 VLLM_AOT_INLINE __m256 load_codes(const uint8_t* p) {  // 8 bytes as int32 lanes
  return _mm256_castsi256_ps(
      _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

VLLM_AOT_AVX2 VLLM_AOT_INLINE __m256i lanes(__m256 v) { return _mm256_castps_si256(v); }

VLLM_AOT_AVX2 VLLM_AOT_INLINE float half_at(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
  return _cvtsh_ss(bits);
}

// A super-block's sub-block scales d sc (and mins dmin m) as float32.
template <int kSubs>
struct Scales {
  alignas(32) float sc[kSubs];
  __m256 mn;  // q4_k, q5_k: the eight dmin m
};

// q4_k's and q5_k's header: d, dmin, then twelve bytes of 6-bit scales and mins.
VLLM_AOT_AVX2 VLLM_AOT_INLINE void unpack_scale_min(const uint8_t* blk, Scales<8>& s) {
  uint32_t u[3];
  std::memcpy(u, blk + 4, 12);
  const uint32_t sc_lo = u[0] & 0x3f3f3f3f, mn_lo = u[1] & 0x3f3f3f3f;
  const uint32_t sc_hi = (u[2] & 0x0f0f0f0f) | ((u[0] >> 2) & 0x30303030);
  const uint32_t mn_hi = ((u[2] >> 4) & 0x0f0f0f0f) | ((u[1] >> 2) & 0x30303030);
  const __m256 sc = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_set_epi32(0, 0, sc_hi, sc_lo)));
  const __m256 mn = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_set_epi32(0, 0, mn_hi, mn_lo)));
  _mm256_store_ps(s.sc, _mm256_mul_ps(sc, _mm256_set1_ps(half_at(blk))));
  s.mn = _mm256_mul_ps(mn, _mm256_set1_ps(half_at(blk + 2)));
}

struct Q4K {
  static constexpr int kBytes = 144, kSub = 32, kSubs = 8;
  static constexpr bool kHasMin = true;
  VLLM_AOT_AVX2 static VLLM_AOT_INLINE void scales(const uint8_t* blk, Scales<kSubs>& s) {
    unpack_scale_min(blk, s);
  }
  // Inputs 8i .. 8i + 7 of sub-block S: chunk S / 2's low (S even) or high nibbles.
  template <int S>
  VLLM_AOT_AVX2 static VLLM_AOT_INLINE __m256 code8(const uint8_t* blk, int i) {
    const __m256i b = lanes(load_codes(blk + 16 + 32 * (S / 2) + 8 * i));
    const __m256i q = S % 2 ? _mm256_srli_epi32(b, 4) : _mm256_and_si256(b, _mm256_set1_epi32(15));
    return _mm256_cvtepi32_ps(q);
  }
};

struct Q5K {
  static constexpr int kBytes = 176, kSub = 32, kSubs = 8;
  static constexpr bool kHasMin = true;
  VLLM_AOT_AVX2 static VLLM_AOT_INLINE void scales(const uint8_t* blk, Scales<kSubs>& s) {
    unpack_scale_min(blk, s);
  }
  // q4_k's nibble (qs at 48) plus bit S of qh[j] (at 16) as 16.
  template <int S>
  VLLM_AOT_AVX2 static VLLM_AOT_INLINE __m256 code8(const uint8_t* blk, int i) {
    const __m256i b = lanes(load_codes(blk + 48 + 32 * (S / 2) + 8 * i));
    const __m256i h = lanes(load_codes(blk + 16 + 8 * i));
    const __m256i low = S % 2 ? _mm256_srli_epi32(b, 4) : _mm256_and_si256(b, _mm256_set1_epi32(15));
    const __m256i high = _mm256_and_si256(
        S >= 4 ? _mm256_srli_epi32(h, S - 4) : _mm256_slli_epi32(h, 4 - S),
        _mm256_set1_epi32(16));
    return _mm256_cvtepi32_ps(_mm256_or_si256(low, high));
  }
};

struct Q6K {
  static constexpr int kBytes = 210, kSub = 16, kSubs = 16;
  static constexpr bool kHasMin = false;
  VLLM_AOT_AVX2 static VLLM_AOT_INLINE void scales(const uint8_t* blk, Scales<kSubs>& s) {
    const __m256 d = _mm256_set1_ps(half_at(blk + 208));
    for (int half = 0; half < 2; ++half) {
      const __m128i sc = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(blk + 192 + 8 * half));
      _mm256_store_ps(s.sc + 8 * half,
                      _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(sc)), d));
    }
  }
  // Sub-block S is half H = S / 8 (128 inputs), group G = S % 8 / 2 (32 inputs), inputs
  // J = 16 (S % 2) + 8i of the group: ql[64 H + 32 (G % 2) + J] >> 4 (G / 2) & 15, plus
  // (qh[32 H + J] >> 2 G & 3) << 4, minus 32.
  template <int S>
  VLLM_AOT_AVX2 static VLLM_AOT_INLINE __m256 code8(const uint8_t* blk, int i) {
    constexpr int H = S / 8, G = S % 8 / 2, J = 16 * (S % 2);
    const __m256i l = lanes(load_codes(blk + 64 * H + 32 * (G % 2) + J + 8 * i));
    const __m256i h = lanes(load_codes(blk + 128 + 32 * H + J + 8 * i));
    const __m256i low = G >= 2 ? _mm256_srli_epi32(l, 4) : _mm256_and_si256(l, _mm256_set1_epi32(15));
    const __m256i high = _mm256_and_si256(
        2 * G >= 4 ? _mm256_srli_epi32(h, 2 * G - 4) : _mm256_slli_epi32(h, 4 - 2 * G),
        _mm256_set1_epi32(48));
    return _mm256_cvtepi32_ps(
        _mm256_sub_epi32(_mm256_or_si256(low, high), _mm256_set1_epi32(32)));
  }
};

VLLM_AOT_AVX2 VLLM_AOT_INLINE float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

// A super-block of kBytes at p asked into L1: every cache line it touches (it need not start on
// one).
template <int kBytes>
VLLM_AOT_AVX2 VLLM_AOT_INLINE void prefetch_block(const uint8_t* p) {
  for (int off = 0; off < kBytes; off += 64) prefetch_line<kToL1>(p + off);
  prefetch_line<kToL1>(p + kBytes - 1);
}

// Sub-blocks S .. kSubs of one super-block against B activation rows (x: the super-block's first
// input of row 0, rows `k` apart): acc[b] += (codes . x) * d sc.
template <class F, int B, int S>
VLLM_AOT_AVX2 VLLM_AOT_INLINE void sub_blocks(const uint8_t* blk, const Scales<F::kSubs>& s,
                                              const float* x, int64_t k, __m256 (&acc)[B]) {
  if constexpr (S < F::kSubs) {
    __m256 t[B];
#pragma GCC unroll 4
    for (int i = 0; i < F::kSub / 8; ++i) {
      const __m256 code = F::template code8<S>(blk, i);
      for (int b = 0; b < B; ++b) {
        const __m256 xv = _mm256_loadu_ps(x + b * k + S * F::kSub + 8 * i);
        t[b] = i ? _mm256_fmadd_ps(code, xv, t[b]) : _mm256_mul_ps(code, xv);
      }
    }
    const __m256 d = _mm256_broadcast_ss(s.sc + S);
    for (int b = 0; b < B; ++b) acc[b] = _mm256_fmadd_ps(t[b], d, acc[b]);
    sub_blocks<F, B, S + 1>(blk, s, x, k, acc);
  }
}

// Weight row `row` against activation rows x[0 .. B) into out[b * n + row]; xsum: the rows'
// sums per 32 inputs (stride k / 32; q4_k, q5_k).
template <class F, int B, class Out>
VLLM_AOT_AVX2 void row_dot(const Weights& w, int64_t row, const float* x, const float* xsum,
                           bool prefetch, Out* out) {
  __m256 acc[B];
  for (int b = 0; b < B; ++b) acc[b] = _mm256_setzero_ps();
  const uint8_t* blocks = w.q + row * w.q_stride;
  const uint8_t* ahead = blocks + kPrefetchRows * w.q_stride;
  const int64_t lds = w.k / kBlock;
  for (int64_t sb = 0; sb < w.blocks; ++sb) {
    const uint8_t* blk = blocks + sb * F::kBytes;
    if (prefetch) prefetch_block<F::kBytes>(ahead + sb * F::kBytes);
    Scales<F::kSubs> s;
    F::scales(blk, s);
    sub_blocks<F, B, 0>(blk, s, x + sb * kSuper, w.k, acc);
    if constexpr (F::kHasMin)
      for (int b = 0; b < B; ++b)
        acc[b] = _mm256_fnmadd_ps(s.mn, _mm256_loadu_ps(xsum + b * lds + sb * 8), acc[b]);
  }
  for (int b = 0; b < B; ++b) store(hsum(acc[b]), out + b * w.n + row);
}

// `MultiplyFn` for format F: up to kMaxDirectRows activation rows.
template <class F>
void multiply(const Weights& w, const float* x, int64_t m, at::Tensor& out) {
  const int64_t lds = w.k / kBlock;
  thread_local std::vector<float> sums;
  if constexpr (F::kHasMin) {
    sums.assign(m * lds, 0.f);
    for (int64_t i = 0; i < m * lds; ++i)
      for (int64_t j = 0; j < kBlock; ++j) sums[i] += x[i * kBlock + j];
  }
  const float* xsum = sums.data();
  parallel_tiles<kTileRows>(w.n, out, [&](auto tile, int64_t row0, auto* o) {
    for (int64_t r = row0; r < row0 + decltype(tile)::value; ++r)
      row_blocks<kRows>(m, [&](auto block, int64_t b) {
        row_dot<F, decltype(block)::value>(w, r, x + b * w.k, xsum + b * lds, b == 0,
                                           o + b * w.n);
      });
  });
}

// Sub-blocks S .. kSubs of one super-block dequantised into o: codes * d sc - dmin m.
template <class F, int S>
VLLM_AOT_AVX2 VLLM_AOT_INLINE void dequantize_subs(const uint8_t* blk, const Scales<F::kSubs>& s,
                                                   const float* mn, float* o) {
  if constexpr (S < F::kSubs) {
    const __m256 d = _mm256_set1_ps(s.sc[S]), m = _mm256_set1_ps(F::kHasMin ? mn[S] : 0.f);
    for (int i = 0; i < F::kSub / 8; ++i)
      _mm256_storeu_ps(o + S * F::kSub + 8 * i,
                       _mm256_fmsub_ps(F::template code8<S>(blk, i), d, m));
    dequantize_subs<F, S + 1>(blk, s, mn, o);
  }
}

// Weight rows row0 .. row0 + rows as float32 [rows, k].
template <class F>
VLLM_AOT_AVX2 void dequantize(const Weights& w, int64_t row0, int64_t rows, float* out) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t sb = 0; sb < w.blocks; ++sb) {
      const uint8_t* blk = w.q + (row0 + r) * w.q_stride + sb * F::kBytes;
      Scales<F::kSubs> s;
      F::scales(blk, s);
      alignas(32) float mn[8] = {};
      if constexpr (F::kHasMin) _mm256_store_ps(mn, s.mn);
      dequantize_subs<F, 0>(blk, s, mn, out + r * w.k + sb * kSuper);
    }
}

// `DequantizeBf16Fn`: the float32 dequantisation, rounded to bfloat16.
template <class F>
VLLM_AOT_AVX2 void dequantize_bf16(const Weights& w, int64_t row0, int64_t rows,
                                   c10::BFloat16* out) {
  thread_local std::vector<float> row;
  row.resize(w.k);
  for (int64_t r = 0; r < rows; ++r) {
    dequantize<F>(w, row0 + r, 1, row.data());
    for (int64_t i = 0; i < w.k; i += 4) store4(_mm_loadu_ps(row.data() + i), out + r * w.k + i);
  }
}

}  // namespace vllm_aot::quant::k
