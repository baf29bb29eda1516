// What the quantised-weight linears (linear_int8/q8_0/q4_0/q4_1.cpp) share: the stored weight
// as one view, the activations quantised to int8 blocks, the instruction set chosen at run time,
// and the op's driver, which picks a path by the number of activation rows m.
//
// - m <= kMaxIntegerRows (decode): the activations are quantised once per call to int8 blocks of
//   32 with a float32 scale each (llama.cpp's q8 blocks), and each output is a sum over blocks of
//   an integer dot product times the two blocks' scales (`quant_avx2.h`, `quant_avx512.h`). The
//   weights are read in tiles of a few rows, in parallel over tiles: with one activation row they
//   stream from memory once, front to back, the tiles ahead prefetched; with more, each tile is
//   unpacked once and used by every activation row while it sits in L1. A row's result never
//   depends on the other rows (the same operations in the same order whatever m).
// - larger m (prefill): chunks of weight rows are dequantised (float32, or bfloat16 where the CPU
//   multiplies bfloat16 natively) and multiplied by aten's GEMM (`quant.cpp`).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <immintrin.h>

#include <cstdint>

// The library is built for AVX2 + FMA; F16C (on every AVX2 CPU) widens the fp16 scales, and the
// AVX-512 VNNI path is compiled for its own target and chosen at run time.
#define VLLM_AOT_AVX2 __attribute__((target("avx2,fma,f16c")))
#define VLLM_AOT_AVX512 \
  __attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq,avx512vnni")))
// The hot helpers: GCC does not always inline functions with a target attribute on its own.
#define VLLM_AOT_INLINE inline __attribute__((always_inline))
#define VLLM_AOT_AVX512_BF16 \
  __attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")))

namespace vllm_aot::quant {

constexpr int64_t kBlock = 32;      // inputs per block: GGUF's, and the activations' scale blocks
constexpr int64_t kGroupBlocks = 4;  // blocks per `ActGroup`
constexpr int64_t kSumsAlign = 16;   // `Acts::sums_stride` is a multiple: whole 16-lane vectors
constexpr int64_t kMaxIntegerRows = 32;  // beyond: dequantise and run aten's GEMM

enum class Isa { kAvx2 = 0, kAvx512Vnni = 1 };

// AVX-512 VNNI where the CPU has it, unless `VLLM_AOT_KERNEL_ISA=avx2` (read once per process).
Isa isa();

// 128 activations (four blocks of 32) of one row, quantised, in the order the integer dot
// products want them: inputs 0-15 of each block, then inputs 16-31 of each (a GGUF 4-bit block
// packs input j and j + 16 in one byte). Lanes 4j..4j+3 of the 16-lane planes belong to block j
// (an int32 lane of a byte dot product sums four consecutive bytes).
struct alignas(64) ActGroup {
  int8_t q[128];     // x / scale rounded to nearest (even), in [-127, 127]
  int32_t init[16];  // block j's -offset * sum(q) in lane 4j, zeros elsewhere: the dots' start
  float scale[16];   // block j's scale (its largest |x| / 127) in lanes 4j..4j+3
};

// Quantised activations [m, k]: each row's groups, and each row's block sums (scale * sum(q) per
// block, for q4_1's min term: a float dot with the weight row's minimums).
struct Acts {
  const ActGroup* groups;  // row b's at groups + b * num_groups
  const float* sums;       // row b's at sums + b * sums_stride, zeros past the last block
  int64_t num_groups, sums_stride;
};

// One stored weight [n, k], whatever its format (unused planes are null).
struct Weights {
  const uint8_t* q;         // row r's codes start at q + r * q_stride
  const c10::Half* scale;   // per block, row r's at scale + r * blocks (q8_0, q4_0, q4_1)
  const c10::Half* min;     // per block, likewise (q4_1)
  const float* row_scale;   // per row (int8)
  int64_t q_stride, blocks, n, k;
};

// Multiplies quantised activations [m, groups] by every weight row into out [m, n] (float32 or
// bfloat16), in parallel over weight-row tiles.
using MultiplyFn = void (*)(const Weights& w, const Acts& acts, int64_t m, at::Tensor& out);
// Weight rows row0 .. row0 + rows dequantised into out [rows, k] (float32 or bfloat16).
using DequantizeFn = void (*)(const Weights& w, int64_t row0, int64_t rows, float* out);
using DequantizeBf16Fn = void (*)(const Weights& w, int64_t row0, int64_t rows,
                                  c10::BFloat16* out);

// A format's entry points: its kernel per `Isa`, the offset its stored codes carry there (the
// integer dot runs on unsigned codes u = q + offset, so the quantised activations start each
// block's dot at -offset * sum(q)), and its dequantisation to float32 (AVX2) and to bfloat16
// (AVX-512 BF16, for CPUs that multiply bfloat16 natively).
struct Format {
  MultiplyFn multiply[2];
  int32_t offset[2];
  DequantizeFn dequantize;
  DequantizeBf16Fn dequantize_bf16;
};

// y = x @ w.T: x [..., k] float32 or bfloat16 -> [..., n] of x's dtype.
at::Tensor linear(const at::Tensor& x, const Weights& w, const Format& format);

// The shape function: x [..., k], qweight [n, ...] -> [..., n] of x's dtype.
at::Tensor linear_meta(const at::Tensor& x, const at::Tensor& qweight);

// Checks a stored plane's dtype and shape, and returns it contiguous.
at::Tensor plane(const at::Tensor& t, at::ScalarType dtype, int64_t rows, int64_t cols,
                 const char* what);

// Batch-1 decode streams every weight once, so while one tile of rows runs it asks for what the
// tile kPrefetchRows further on will read: `bytes` of codes from byte `offset` of each of its R
// rows and, at a tile's start (offset 0), its rows' block scales and minimums.
constexpr int64_t kPrefetchRows = 16;

template <int R>
inline void prefetch_ahead(const Weights& w, int64_t row0, int64_t offset, int64_t bytes) {
  const int64_t ahead = row0 + kPrefetchRows;
  for (int r = 0; r < R; ++r)
    for (int64_t line = 0; line < bytes; line += 64)
      _mm_prefetch(reinterpret_cast<const char*>(w.q + (ahead + r) * w.q_stride + offset + line),
                   _MM_HINT_T0);
  if (offset != 0) return;
  for (const c10::Half* plane : {w.scale, w.min}) {
    if (plane == nullptr) continue;
    for (int64_t line = 0; line < R * w.blocks * 2; line += 64)
      _mm_prefetch(reinterpret_cast<const char*>(plane + ahead * w.blocks) + line, _MM_HINT_T0);
  }
}

inline void store(float v, float* p) { *p = v; }
inline void store(float v, c10::BFloat16* p) { *p = c10::BFloat16(v); }

}  // namespace vllm_aot::quant
