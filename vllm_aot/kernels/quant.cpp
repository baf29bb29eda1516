// The quantised linears' shared driver (`quant.h`): instruction-set choice, activation
// quantisation, the dequantise-and-GEMM path for many rows, and the `quant_isa` op.
#include "quant.h"

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/mm.h>
#include <c10/util/Exception.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "avx2.h"

namespace vllm_aot::quant {
namespace {

constexpr int64_t kChunkBytes = 4 << 20;  // dequantised weight rows per GEMM call

bool has_avx512_vnni() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
         __builtin_cpu_supports("avx512vnni");
}

Isa choose_isa() {
  const char* forced = std::getenv("VLLM_AOT_KERNEL_ISA");
  const std::string value = forced ? forced : "";
  TORCH_CHECK(value.empty() || value == "auto" || value == "avx2", "VLLM_AOT_KERNEL_ISA=", value,
              " is not supported; supported: auto (the default), avx2");
  return value != "avx2" && has_avx512_vnni() ? Isa::kAvx512Vnni : Isa::kAvx2;
}

VLLM_AOT_AVX2 inline float max8(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

VLLM_AOT_AVX2 inline int32_t sum8_epi32(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  return _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1)));
}

// One row of k = 32 * blocks activations into its groups and block sums (zeros past the last).
template <class T>
VLLM_AOT_AVX2 void quantize_row(const T* x, int64_t blocks, int32_t offset, ActGroup* groups,
                                float* sums) {
  std::memset(groups, 0, sizeof(ActGroup) * ((blocks + kGroupBlocks - 1) / kGroupBlocks));
  std::memset(sums, 0, sizeof(float) * ((blocks + kSumsAlign - 1) / kSumsAlign * kSumsAlign));
  const __m256 sign = _mm256_set1_ps(-0.f);
  for (int64_t blk = 0; blk < blocks; ++blk) {
    __m256 v[4];
    for (int i = 0; i < 4; ++i) v[i] = load8(x + blk * kBlock + 8 * i);
    const __m256 amax = _mm256_max_ps(
        _mm256_max_ps(_mm256_andnot_ps(sign, v[0]), _mm256_andnot_ps(sign, v[1])),
        _mm256_max_ps(_mm256_andnot_ps(sign, v[2]), _mm256_andnot_ps(sign, v[3])));
    const float d = max8(amax) / 127.f;
    const __m256 inverse = _mm256_set1_ps(d != 0.f ? 1.f / d : 0.f);
    __m256i q[4];
    for (int i = 0; i < 4; ++i) q[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], inverse));
    const int32_t sum = sum8_epi32(
        _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3])));
    // packs work within 128-bit lanes; the permutation puts the 32 bytes back in input order.
    const __m256i bytes = _mm256_permutevar8x32_epi32(
        _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3])),
        _mm256_set_epi32(7, 3, 6, 2, 5, 1, 4, 0));
    ActGroup& g = groups[blk / kGroupBlocks];
    const int j = static_cast<int>(blk % kGroupBlocks);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(g.q + 16 * j), _mm256_castsi256_si128(bytes));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(g.q + 64 + 16 * j),
                     _mm256_extracti128_si256(bytes, 1));
    g.init[4 * j] = -offset * sum;
    for (int i = 0; i < 4; ++i) g.scale[4 * j + i] = d;
    sums[blk] = d * static_cast<float>(sum);
  }
}

// x [m, k] (k a multiple of 32) quantised into `buffer` (a byte tensor it allocates).
Acts quantize_activations(const at::Tensor& x, int32_t offset, at::Tensor& buffer) {
  const int64_t m = x.size(0), k = x.size(1), blocks = k / kBlock;
  const int64_t num_groups = (blocks + kGroupBlocks - 1) / kGroupBlocks;
  const int64_t stride = (blocks + kSumsAlign - 1) / kSumsAlign * kSumsAlign;
  const int64_t group_bytes = m * num_groups * static_cast<int64_t>(sizeof(ActGroup));
  buffer = at::empty({group_bytes + m * stride * 4}, x.options().dtype(at::kByte));
  auto* groups = reinterpret_cast<ActGroup*>(buffer.data_ptr<uint8_t>());
  auto* sums = reinterpret_cast<float*>(buffer.data_ptr<uint8_t>() + group_bytes);
  at::parallel_for(0, m, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      ActGroup* row_groups = groups + r * num_groups;
      if (x.scalar_type() == at::kFloat) {
        quantize_row(x.data_ptr<float>() + r * k, blocks, offset, row_groups, sums + r * stride);
      } else {
        quantize_row(x.data_ptr<c10::BFloat16>() + r * k, blocks, offset, row_groups,
                     sums + r * stride);
      }
    }
  });
  return Acts{groups, sums, num_groups, stride};
}

// Many rows: chunks of weight rows dequantised (in parallel) into a buffer and multiplied by
// aten's GEMM (in parallel) into out's columns. Chunks are large: each GEMM call costs ~15 us.
void dequantized_linear(const at::Tensor& x, const Weights& w, const Format& format, Isa chosen,
                        at::Tensor& out) {
  const bool bf16 = x.scalar_type() == at::kBFloat16 && chosen == Isa::kAvx512Vnni &&
                    __builtin_cpu_supports("avx512bf16");
  const at::Tensor xc = x.to(bf16 ? at::kBFloat16 : at::kFloat);
  at::Tensor result =
      out.scalar_type() == xc.scalar_type() ? out : at::empty(out.sizes(), xc.options());
  const int64_t row_bytes = std::max<int64_t>(w.k, 1) * (bf16 ? 2 : 4);
  const int64_t chunk_rows = std::min(w.n, std::max<int64_t>(kChunkBytes / row_bytes, 64));
  at::Tensor chunk = at::empty({chunk_rows, w.k}, xc.options());
  for (int64_t r0 = 0; r0 < w.n; r0 += chunk_rows) {
    const int64_t rows = std::min(chunk_rows, w.n - r0);
    at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
      if (bf16) {
        format.dequantize_bf16(w, r0 + begin, end - begin,
                               chunk.data_ptr<c10::BFloat16>() + begin * w.k);
      } else {
        format.dequantize(w, r0 + begin, end - begin, chunk.data_ptr<float>() + begin * w.k);
      }
    });
    at::Tensor columns = result.narrow(1, r0, rows);
    at::mm_out(columns, xc, chunk.narrow(0, 0, rows).t());
  }
  if (!result.is_same(out)) out.copy_(result);
}

std::string quant_isa() { return isa() == Isa::kAvx512Vnni ? "avx512_vnni" : "avx2"; }

}  // namespace

Isa isa() {
  static const Isa chosen = choose_isa();
  return chosen;
}

at::Tensor linear(const at::Tensor& x, const Weights& w, const Format& format) {
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "quantised linears take float32 or bfloat16 activations, got ", x.scalar_type());
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) == w.k, "quantised linear: x [..., ", w.k, "], got ",
              x.sizes());
  const at::Tensor x2 = x.reshape({-1, w.k}).contiguous();
  const int64_t m = x2.size(0);
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = w.n;
  at::Tensor out = at::empty(shape, x.options());
  if (m == 0 || w.n == 0) return out;
  at::Tensor out2 = out.view({m, w.n});
  const Isa chosen = isa();
  if (m > kMaxIntegerRows || w.k % kBlock != 0) {
    dequantized_linear(x2, w, format, chosen, out2);
    return out;
  }
  at::Tensor buffer;
  const Acts acts = quantize_activations(x2, format.offset[static_cast<int>(chosen)], buffer);
  format.multiply[static_cast<int>(chosen)](w, acts, m, out2);
  return out;
}

at::Tensor linear_meta(const at::Tensor& x, const at::Tensor& qweight) {
  std::vector<c10::SymInt> sizes = x.sym_sizes().vec();
  sizes.back() = qweight.sym_size(0);
  return at::empty_symint(sizes, x.options());
}

at::Tensor plane(const at::Tensor& t, at::ScalarType dtype, int64_t rows, int64_t cols,
                 const char* what) {
  const bool shaped = cols < 0 ? t.dim() == 1 && t.size(0) == rows
                               : t.dim() == 2 && t.size(0) == rows && t.size(1) == cols;
  TORCH_CHECK(t.scalar_type() == dtype && shaped, what, ": expected ", dtype, " [", rows,
              cols < 0 ? "" : ", " + std::to_string(cols), "], got ", t.scalar_type(), " ",
              t.sizes());
  return t.contiguous();
}

}  // namespace vllm_aot::quant

// Which path the quantised linears take on this CPU: "avx512_vnni" or "avx2".
TORCH_LIBRARY_FRAGMENT(vllm_aot, m) { m.def("quant_isa() -> str", &vllm_aot::quant::quant_isa); }
