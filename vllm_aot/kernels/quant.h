// What the quantised-weight linears (linear_int8/q8_0/q4_0/q4_1/q5_0/q5_1.cpp, and the GGUF
// K-quants' through `quant_k.h`) share: the stored weight as one view, the instruction set chosen at run
// time, and the op's driver, which picks a path by the number of activation rows m. The
// activations are never rounded to int8: the weights are dequantised (w = code * d + m per block
// of 32) and multiplied by the activations, float32 or
// bfloat16, with float32 sums, so a program computes what the checkpoint's weights say, to
// float32 rounding, as the pure-torch reference does. (llama.cpp quantises the activations to
// int8 blocks for integer dot products, at a cost in accuracy: see
// docs/benchmarks.md#int8-activations. The weights' bytes, which bound a decode step, are the
// same.) bfloat16 activations, 8 significant bits, may become 15- or
// 16-bit fixed point per block for integer products: that moves each by at most 2^-15 of its
// block's largest, 64x below the bfloat16 rounding it already carries.
//
// - m <= kMaxDirectRows (decode at small batch; kMaxDirectRowsAvx2Fixed on that path): weight-row tiles in parallel, each block of 32
//   weights widened from its codes in registers and used by a register block of activation rows
//   at once (`row_blocks`: more rows take further blocks while the tile's codes stay in L1), so
//   the weights stream from memory once, front to back (the tiles ahead prefetched). A row's
//   result does not depend on the other rows (the same operations in the same order whatever m).
//   float32 on AVX2 (`quant_avx2.h`) and AVX-512 (`quant_avx512.h`). bfloat16 activations: of
//   the block formats on AVX2 as 16-bit fixed point, codes widened to int16, `vpmaddwd`
//   (`quant_avx2_fixed.h`); of the block formats with AVX512-VNNI as 15-bit fixed point, codes
//   as bytes, `vpdpbusd` (`quant_avx512_vnni.h`); other bfloat16 activations are widened to
//   float32.
// - bfloat16 activations on CPUs with AMX, kMinAmxRows to kMaxAmxRows rows (int8 from one
//   row): each block dequantised once into two bfloat16 tiles in L1 (the weight to 2^-16)
//   for AMX's tile multiply, 16 rows at once (`quant_amx.h`).
// - larger m (larger decode batches, prefill): chunks of weight rows are dequantised (float32,
//   or bfloat16 where the CPU multiplies bfloat16 natively) and multiplied by aten's GEMM
//   (`quant.cpp`).
//
// A format states its layout as traits, which every path reads: kNibbles (two codes a byte: input j
// low, j + 16 high, per block of 16 bytes; else one signed byte each), kOffset (subtracted from the
// codes: q4_0's 8, q5_0's 16), kBlockScale (an fp16 scale per block), kHasMin (an fp16 minimum per
// block, added), kRowScale (a float32 scale per row, int8; its rows may end in a part block),
// kHighBit (a nibble format's fifth bits, 4 bytes per block: bit j of their little-endian uint32 is
// 16 in input j's code; q5_0, q5_1; false where a format leaves it out).
#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

// The library is built for AVX2 + FMA; F16C (on every AVX2 CPU) widens the fp16 scales, and the
// AVX-512 path is compiled for its own target and chosen at run time.
#define VLLM_AOT_AVX2 __attribute__((target("avx2,fma,f16c")))
#define VLLM_AOT_AVX512 \
  __attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq")))
// The hot helpers: GCC does not always inline functions with a target attribute on its own.
#define VLLM_AOT_INLINE inline __attribute__((always_inline))
#define VLLM_AOT_AVX512_BF16 \
  __attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")))

namespace vllm_aot::quant {

constexpr int64_t kBlock = 32;          // inputs per block (GGUF's)
// Beyond: dequantise and run aten's GEMM. The direct kernels' work grows with the rows, the
// dequantisation's does not (see docs/benchmarks.md#direct-kernels-by-rows).
constexpr int64_t kMaxDirectRows = 8;
// The AVX2 fixed-point kernel's own limit (`quant_avx2_fixed.h`): there aten's GEMM is float32,
// and the direct kernel stays ahead of dequantise-and-GEMM up to 32 rows (see
// docs/benchmarks.md#direct-kernels-by-rows).
constexpr int64_t kMaxDirectRowsAvx2Fixed = 32;
// Up to kMaxAmxRows bfloat16 rows, AMX's tiles where the CPU has them (`quant_amx.h`): a work
// item's weight tiles meet every row in tile multiplies of 16 rows, so 5 rows cost about what 16
// do. Fewer than kMinAmxRows rows take the format's VNNI kernel, which reads the codes as bytes
// where AMX widens them (see docs/benchmarks.md#direct-kernels-by-rows). int8, which has none,
// takes AMX from one row.
constexpr int64_t kMinAmxRows = 5, kMaxAmxRows = 32;

// The kernels' instruction set: AVX2 + FMA (the floor), AVX-512, AVX-512 with VNNI's byte dot
// products (`quant_avx512_vnni.h`), and on top of those AMX's bfloat16 tiles for several
// bfloat16 rows (`quant_amx.h`; kMinAmxRows, kMaxAmxRows).
enum class Isa { kAvx2 = 0, kAvx512 = 1, kAvx512Vnni = 2, kAmx = 3 };

// The best the CPU has, unless `VLLM_AOT_KERNEL_ISA` (avx2, avx512, avx512_vnni) caps it (read
// once per process).
Isa isa();

// One stored weight [n, k], whatever its format (unused planes are null).
struct Weights {
  const uint8_t* q;         // row r's codes start at q + r * q_stride
  const c10::Half* scale;   // per block, row r's at scale + r * blocks (q8_0, q4_0, q4_1)
  const c10::Half* min;     // per block, likewise (q4_1)
  const float* row_scale;   // per row (int8)
  int64_t q_stride, blocks, n, k;
  const uint8_t* qh = nullptr;  // per block 4 bytes of fifth bits, row r's at qh + r * blocks * 4
};

// The kHighBit trait, false for a format that does not state it.
template <class F, class = void>
struct HighBitOf : std::false_type {};
template <class F>
struct HighBitOf<F, std::void_t<decltype(F::kHighBit)>> : std::bool_constant<F::kHighBit> {};
template <class F>
constexpr bool kHighBit = HighBitOf<F>::value;

// Row `row`'s fifth bits from its block b on (kHighBit; null for the other formats).
template <class F>
VLLM_AOT_INLINE const uint8_t* high_row(const Weights& w, int64_t row, int64_t b = 0) {
  return kHighBit<F> ? w.qh + (row * w.blocks + b) * 4 : nullptr;
}

// Block b's fifth bits from a row's (`high_row`): bit j for input j.
VLLM_AOT_INLINE uint32_t high_bits(const uint8_t* row, int64_t b) {
  uint32_t bits;
  std::memcpy(&bits, row + 4 * b, 4);
  return bits;
}

// x [m, k] (float32, contiguous) times every weight row into out [m, n] (float32 or bfloat16),
// in parallel over weight-row tiles.
using MultiplyFn = void (*)(const Weights& w, const float* x, int64_t m, at::Tensor& out);
// The same for bfloat16 activations (`quant_avx2_fixed.h`, `quant_avx512_vnni.h`).
using MultiplyBf16Fn = void (*)(const Weights& w, const c10::BFloat16* x, int64_t m,
                                at::Tensor& out);
// Weight rows row0 .. row0 + rows dequantised into out [rows, k] (float32 or bfloat16).
using DequantizeFn = void (*)(const Weights& w, int64_t row0, int64_t rows, float* out);
using DequantizeBf16Fn = void (*)(const Weights& w, int64_t row0, int64_t rows,
                                  c10::BFloat16* out);

// A format's entry points: its float32 kernel for AVX2 and AVX-512; its bfloat16 ones per
// instruction set (`Isa`; on an AMX CPU, rows outside the AMX range take the VNNI entry; null
// where the format has none: then bfloat16 activations are widened for the float32 kernel); its
// dequantisation to float32 (AVX2) and to bfloat16 (for aten's bfloat16 GEMM where the CPU
// multiplies bfloat16 natively).
struct Format {
  MultiplyFn multiply[2];
  MultiplyBf16Fn multiply_bf16[4];
  DequantizeFn dequantize;
  DequantizeBf16Fn dequantize_bf16;
};

namespace amx {
// The CPU has AMX with bfloat16 tiles and the kernel let this process use them (asked once).
bool available();
}  // namespace amx

// y = x @ w.T: x [..., k] float32 or bfloat16 -> [..., n] of x's dtype.
at::Tensor linear(const at::Tensor& x, const Weights& w, const Format& format);

// The shape function: x [..., k], qweight [n, ...] -> [..., n] of x's dtype.
at::Tensor linear_meta(const at::Tensor& x, const at::Tensor& qweight);

// Checks a stored plane's dtype and shape, and returns it contiguous.
at::Tensor plane(const at::Tensor& t, at::ScalarType dtype, int64_t rows, int64_t cols,
                 const char* what);

// Batch-1 decode streams each weight once, and a thread's tiles take its rows front to back:
// rows too short for the hardware prefetcher to follow. So a tile asks for the rows
// kPrefetchRows further on while it works: their per-block planes (scales, minimums, fifth
// bits) as it starts (`prefetch_planes`), their codes a line at a time as it reads the same line
// of its own rows (`prefetch_line`), spread over the tile (see docs/benchmarks.md#prefetch). A
// prefetch past the weight's end never faults.
constexpr int64_t kPrefetchRows = 16;

// Where a prefetched line is asked into. The AVX-512 kernels ask for L2 (`kToL2`): from DRAM (a
// Zen 4's 32 MB L3 does not hold the model) lines asked into L1 wait in L1's few miss buffers
// beside the kernel's own loads. The AVX2 kernels, slower a block, keep L1 (`kToL1`). See
// docs/benchmarks.md#prefetch.
using Hint = decltype(_MM_HINT_T0);  // the intrinsic's own type for its hint
constexpr Hint kToL1 = _MM_HINT_T0, kToL2 = _MM_HINT_T1;

template <Hint kHint>
VLLM_AOT_AVX2 VLLM_AOT_INLINE void prefetch_line(const void* p) {
  _mm_prefetch(static_cast<const char*>(p), kHint);
}

template <int R, Hint kHint>
VLLM_AOT_AVX2 VLLM_AOT_INLINE void prefetch_planes(const Weights& w, int64_t row0) {
  for (const c10::Half* plane : {w.scale, w.min})
    if (plane != nullptr)
      for (int64_t line = 0; line < R * w.blocks * 2; line += 64)
        prefetch_line<kHint>(
            reinterpret_cast<const char*>(plane + (row0 + kPrefetchRows) * w.blocks) + line);
  if (w.qh != nullptr)
    for (int64_t line = 0; line < R * w.blocks * 4; line += 64)
      prefetch_line<kHint>(w.qh + (row0 + kPrefetchRows) * w.blocks * 4 + line);
}

// The float32 kernels' whole tile ahead at once: its codes, then `prefetch_planes`.
template <int R, Hint kHint>
VLLM_AOT_AVX2 VLLM_AOT_INLINE void prefetch_rows(const Weights& w, int64_t row0) {
  for (int64_t line = 0; line < R * w.q_stride; line += 64)
    prefetch_line<kHint>(w.q + (row0 + kPrefetchRows) * w.q_stride + line);
  prefetch_planes<R, kHint>(w, row0);
}

// A stored fp16 scale as float32 (F16C).
VLLM_AOT_AVX2 VLLM_AOT_INLINE float widen(const c10::Half* p) { return _cvtsh_ss(p->x); }

// Block b of a row as w = code * d + m: its scale d (the row's for int8) and minimum m (0 but for
// q4_1; q4_0's offset is taken from the codes).
template <class F>
VLLM_AOT_AVX2 VLLM_AOT_INLINE void affine(const Weights& w, int64_t row, int64_t b, float& d,
                                          float& m) {
  d = F::kRowScale ? w.row_scale[row] : widen(w.scale + row * w.blocks + b);
  m = F::kHasMin ? widen(w.min + row * w.blocks + b) : 0.f;
}

// q4_1's minimum terms: each activation row's block sums, rows of `stride` floats (blocks rounded
// up to 16, zeros after the last block), in a buffer the calling thread reuses; null for the other
// formats.
template <class F>
const float* block_sums(const Weights& w, const float* x, int64_t m, int64_t& stride) {
  stride = (w.k / kBlock + 15) / 16 * 16;
  if constexpr (!F::kHasMin) {
    return nullptr;
  } else {
    thread_local std::vector<float> sums;
    sums.assign(m * stride, 0.f);
    for (int64_t b = 0; b < m; ++b)
      for (int64_t blk = 0; blk < w.k / kBlock; ++blk) {
        float total = 0.f;
        for (int64_t i = 0; i < kBlock; ++i) total += x[b * w.k + blk * kBlock + i];
        sums[b * stride + blk] = total;
      }
    return sums.data();
  }
}

inline void store(float v, float* p) { *p = v; }
inline void store(float v, c10::BFloat16* p) { *p = c10::BFloat16(v); }

// Four sums to out[0 .. 4) at once: as float32, or as bfloat16 rounded as c10::BFloat16 rounds
// (to nearest even, NaN to 0x7FC0).
VLLM_AOT_AVX2 VLLM_AOT_INLINE void store4(__m128 y, float* out) { _mm_storeu_ps(out, y); }

VLLM_AOT_AVX2 VLLM_AOT_INLINE void store4(__m128 y, c10::BFloat16* out) {
  const __m128i bits = _mm_castps_si128(y);
  const __m128i odd = _mm_and_si128(_mm_srli_epi32(bits, 16), _mm_set1_epi32(1));
  __m128i high = _mm_srli_epi32(_mm_add_epi32(bits, _mm_add_epi32(odd, _mm_set1_epi32(0x7FFF))), 16);
  high = _mm_castps_si128(_mm_blendv_ps(_mm_castsi128_ps(high),
                                        _mm_castsi128_ps(_mm_set1_epi32(0x7FC0)),
                                        _mm_cmpunord_ps(y, y)));
  _mm_storel_epi64(reinterpret_cast<__m128i*>(out), _mm_packus_epi32(high, high));
}

// The first R of four sums to out[0 .. R).
template <int R, class Out>
VLLM_AOT_AVX2 VLLM_AOT_INLINE void store_sums(__m128 y, Out* out) {
  if constexpr (R == 4) {
    store4(y, out);
  } else {
    float v[4];
    _mm_storeu_ps(v, y);
    for (int r = 0; r < R; ++r) store(v[r], out + r);
  }
}

// `block(rows, b)` for the register block of activation rows b .. b + rows, rows a
// std::integral_constant of at most N (the count left, n, when fewer).
template <int N, class Block>
void row_block(int64_t n, int64_t b, const Block& block) {
  if constexpr (N > 1)
    if (n < N) return row_block<N - 1>(n, b, block);
  block(std::integral_constant<int, N>{}, b);
}

// Activation rows 0 .. m in register blocks of kRows (the last one smaller): `block(rows, b)`.
template <int kRows, class Block>
void row_blocks(int64_t m, const Block& block) {
  for (int64_t b = 0; b < m; b += kRows) row_block<kRows>(std::min<int64_t>(m - b, kRows), b, block);
}

// The kernels' driver: tiles of kTile weight rows in parallel (the last part tile row by row),
// `run(tile, row0, out)` with `tile` a std::integral_constant of the tile's rows and `out` the
// output's float or bfloat16 data.
template <int kTile, class Run>
void parallel_tiles(int64_t n, at::Tensor& out, const Run& run) {
  at::parallel_for(0, (n + kTile - 1) / kTile, 1, [&](int64_t begin, int64_t end) {
    const auto tiles = [&](auto* o) {
      for (int64_t t = begin; t < end; ++t) {
        const int64_t row0 = t * kTile;
        if (row0 + kTile <= n) {
          run(std::integral_constant<int, kTile>{}, row0, o);
        } else {
          for (int64_t r = row0; r < n; ++r) run(std::integral_constant<int, 1>{}, r, o);
        }
      }
    };
    if (out.scalar_type() == at::kFloat) {
      tiles(out.data_ptr<float>());
    } else {
      tiles(out.data_ptr<c10::BFloat16>());
    }
  });
}

}  // namespace vllm_aot::quant
