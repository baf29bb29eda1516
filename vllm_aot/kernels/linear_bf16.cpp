// y = x @ w.T for bfloat16 x [M, K] and w [N, K]: fp32 accumulation, bfloat16 result.
//
// For CPUs without native bfloat16 arithmetic (AVX2 + FMA), where aten's bfloat16 matmul runs
// far below memory bandwidth. Each thread takes tiles of kRows weight rows; a tile's rows are
// widened once into a small float32 buffer (L1-resident) and reused for every activation row,
// kBatch rows at a time with kBatch x kRows accumulators in registers. With one or two activation rows (decode at batch 1)
// the weights are widened straight from memory instead: that case is bound by reading them once.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "avx2.h"

namespace {

using bf16 = c10::BFloat16;
using vllm_aot::load8;
using vllm_aot::sum8;
constexpr int64_t kRows = 4;        // weight rows per widened tile
constexpr int64_t kBatch = 3;       // activation rows per register block
constexpr int64_t kDirectRows = 8;  // weight rows per tile when read straight from memory
constexpr int64_t kRowBlock = 128;  // activation rows per pass (keeps them in L2)

// out[b][r] = dot(x[b], w[r]) for B activation rows and R widened weight rows of length k.
template <int B, int R>
inline void block(const float* x, int64_t ldx, const float* w, int64_t ldw, int64_t k, bf16* out,
                  int64_t ldo) {
  __m256 acc[B][R];
  for (int b = 0; b < B; ++b)
    for (int r = 0; r < R; ++r) acc[b][r] = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= k; i += 8) {
    __m256 wv[R];
    for (int r = 0; r < R; ++r) wv[r] = load8(w + r * ldw + i);
    for (int b = 0; b < B; ++b) {
      __m256 xv = _mm256_loadu_ps(x + b * ldx + i);
      for (int r = 0; r < R; ++r) acc[b][r] = _mm256_fmadd_ps(xv, wv[r], acc[b][r]);
    }
  }
  for (int b = 0; b < B; ++b) {
    for (int r = 0; r < R; ++r) {
      float s = sum8(acc[b][r]);
      for (int64_t j = i; j < k; ++j) s += x[b * ldx + j] * w[r * ldw + j];
      out[b * ldo + r] = bf16(s);
    }
  }
}

// The 16 bfloat16s at p widened as two float32 vectors in the order
// [0-3, 8-11] and [4-7, 12-15] (unpack works within 128-bit lanes); `permute16` puts activations
// in the same order, and a dot product does not care about the order.
inline void load16(const bf16* p, __m256& lo, __m256& hi) {
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  const __m256i zero = _mm256_setzero_si256();
  lo = _mm256_castsi256_ps(_mm256_unpacklo_epi16(zero, v));
  hi = _mm256_castsi256_ps(_mm256_unpackhi_epi16(zero, v));
}

void permute16(const float* x, int64_t k, float* out) {
  int64_t i = 0;
  for (; i + 16 <= k; i += 16) {
    for (int j = 0; j < 4; ++j) {
      out[i + j] = x[i + j];
      out[i + 4 + j] = x[i + 8 + j];
      out[i + 8 + j] = x[i + 4 + j];
      out[i + 12 + j] = x[i + 12 + j];
    }
  }
  for (; i < k; ++i) out[i] = x[i];
}

// out[b][r] = dot(x[b], w[r]) with x permuted by `permute16`, weights read once from memory.
template <int B, int R>
inline void gemv_block(const float* x, int64_t ldx, const bf16* w, int64_t ldw, int64_t k,
                       bf16* out, int64_t ldo) {
  __m256 acc[B][R];
  for (int b = 0; b < B; ++b)
    for (int r = 0; r < R; ++r) acc[b][r] = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= k; i += 16) {
    for (int r = 0; r < R; ++r) {
      __m256 lo, hi;
      load16(w + r * ldw + i, lo, hi);
      for (int b = 0; b < B; ++b) {
        acc[b][r] = _mm256_fmadd_ps(_mm256_loadu_ps(x + b * ldx + i), lo, acc[b][r]);
        acc[b][r] = _mm256_fmadd_ps(_mm256_loadu_ps(x + b * ldx + i + 8), hi, acc[b][r]);
      }
    }
  }
  for (int b = 0; b < B; ++b) {
    for (int r = 0; r < R; ++r) {
      float s = sum8(acc[b][r]);
      for (int64_t j = i; j < k; ++j) s += x[b * ldx + j] * static_cast<float>(w[r * ldw + j]);
      out[b * ldo + r] = bf16(s);
    }
  }
}

// dot(x, w) for one weight row, x permuted by `permute16`: four independent sums, and the row
// read front to back with the next kilobyte prefetched (one batch-1 decode step reads every
// weight once, so this loop runs at memory speed or not at all).
inline float gemv_row(const float* x, const bf16* w, int64_t k) {
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  int64_t i = 0;
  for (; i + 32 <= k; i += 32) {
    _mm_prefetch(reinterpret_cast<const char*>(w + i + 512), _MM_HINT_T0);
    __m256 l0, h0, l1, h1;
    load16(w + i, l0, h0);
    load16(w + i + 16, l1, h1);
    a0 = _mm256_fmadd_ps(_mm256_loadu_ps(x + i), l0, a0);
    a1 = _mm256_fmadd_ps(_mm256_loadu_ps(x + i + 8), h0, a1);
    a2 = _mm256_fmadd_ps(_mm256_loadu_ps(x + i + 16), l1, a2);
    a3 = _mm256_fmadd_ps(_mm256_loadu_ps(x + i + 24), h1, a3);
  }
  for (; i + 16 <= k; i += 16) {
    __m256 l0, h0;
    load16(w + i, l0, h0);
    a0 = _mm256_fmadd_ps(_mm256_loadu_ps(x + i), l0, a0);
    a1 = _mm256_fmadd_ps(_mm256_loadu_ps(x + i + 8), h0, a1);
  }
  float s = sum8(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
  for (; i < k; ++i) s += x[i] * static_cast<float>(w[i]);
  return s;
}

// Two activation rows against `rows` weight rows, four weight rows at a time.
void gemv2_tile(const float* x, int64_t ldx, const bf16* w, int64_t ldw, int64_t rows, int64_t k,
                bf16* out, int64_t ldo) {
  int64_t r = 0;
  for (; r + 4 <= rows; r += 4) gemv_block<2, 4>(x, ldx, w + r * ldw, ldw, k, out + r, ldo);
  for (; r < rows; ++r) gemv_block<2, 1>(x, ldx, w + r * ldw, ldw, k, out + r, ldo);
}

template <int R>
void rows_block(const float* x, int64_t ldx, int64_t m, const float* w, int64_t ldw, int64_t k,
                bf16* out, int64_t ldo) {
  int64_t b = 0;
  for (; b + kBatch <= m; b += kBatch)
    block<kBatch, R>(x + b * ldx, ldx, w, ldw, k, out + b * ldo, ldo);
  if (m - b == 2) block<2, R>(x + b * ldx, ldx, w, ldw, k, out + b * ldo, ldo);
  if (m - b == 1) block<1, R>(x + b * ldx, ldx, w, ldw, k, out + b * ldo, ldo);
}

// m activation rows against a widened tile of `rows` <= kRows weight rows.
void tile(const float* x, int64_t ldx, int64_t m, const float* w, int64_t ldw, int64_t rows,
          int64_t k, bf16* out, int64_t ldo) {
  switch (rows) {
    case 4: return rows_block<4>(x, ldx, m, w, ldw, k, out, ldo);
    case 3: return rows_block<3>(x, ldx, m, w, ldw, k, out, ldo);
    case 2: return rows_block<2>(x, ldx, m, w, ldw, k, out, ldo);
    default: return rows_block<1>(x, ldx, m, w, ldw, k, out, ldo);
  }
}

at::Tensor linear_bf16(const at::Tensor& x, const at::Tensor& w) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && w.scalar_type() == at::kBFloat16,
              "linear_bf16 takes bfloat16 tensors");
  TORCH_CHECK(w.dim() == 2 && x.size(-1) == w.size(1), "linear_bf16: x [..., K], w [N, K]");
  const int64_t k = w.size(1), n = w.size(0);
  const at::Tensor xs = x.reshape({-1, k});
  const int64_t m = xs.size(0);
  std::vector<int64_t> out_shape(x.sizes().begin(), x.sizes().end());
  out_shape.back() = n;
  at::Tensor out = at::empty(out_shape, x.options());
  if (m == 0 || n == 0) return out;
  const at::Tensor xc = xs.contiguous(), wc = w.contiguous();
  std::vector<float> widened_x(m * k);
  const bf16* xb16 = xc.data_ptr<bf16>();
  for (int64_t i = 0; i < m * k; ++i) widened_x[i] = static_cast<float>(xb16[i]);
  const float* xp = widened_x.data();
  const bf16* wp = wc.data_ptr<bf16>();
  bf16* op = out.data_ptr<bf16>();
  if (m <= 2) {  // bound by reading the weights once: widen them in registers
    std::vector<float> xperm(m * k);
    for (int64_t b = 0; b < m; ++b) permute16(xp + b * k, k, xperm.data() + b * k);
    if (m == 1) {
      at::parallel_for(0, n, 64, [&](int64_t begin, int64_t end) {
        for (int64_t r = begin; r < end; ++r) op[r] = bf16(gemv_row(xperm.data(), wp + r * k, k));
      });
      return out;
    }
    at::parallel_for(0, (n + kDirectRows - 1) / kDirectRows, 1, [&](int64_t begin, int64_t end) {
      const int64_t r0 = begin * kDirectRows, rows = std::min(end * kDirectRows, n) - r0;
      gemv2_tile(xperm.data(), k, wp + r0 * k, k, rows, k, op + r0, n);
    });
    return out;
  }
  const int64_t tiles = (n + kRows - 1) / kRows;
  for (int64_t m0 = 0; m0 < m; m0 += kRowBlock) {
    const int64_t mb = std::min(kRowBlock, m - m0);
    const float* xb = xp + m0 * k;
    bf16* ob = op + m0 * n;
    at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> widened(kRows * k);
      for (int64_t t = begin; t < end; ++t) {
        const int64_t r0 = t * kRows, rows = std::min(kRows, n - r0);
        const bf16* wt = wp + r0 * k;
        for (int64_t i = 0; i < rows * k; ++i) widened[i] = static_cast<float>(wt[i]);
        tile(xb, k, mb, widened.data(), k, rows, k, ob + r0, n);
      }
    });
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(vllm_aot, m) { m.def("linear_bf16(Tensor x, Tensor w) -> Tensor"); }

TORCH_LIBRARY_IMPL(vllm_aot, CPU, m) { m.impl("linear_bf16", &linear_bf16); }

// The shape function export's fake tensors run: x [..., K], w [N, K] -> [..., N].
TORCH_LIBRARY_IMPL(vllm_aot, Meta, m) {
  m.impl("linear_bf16", [](const at::Tensor& x, const at::Tensor& w) {
    std::vector<c10::SymInt> sizes = x.sym_sizes().vec();
    sizes.back() = w.sym_size(0);
    return at::empty_symint(sizes, x.options());
  });
}
