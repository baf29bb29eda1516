// Paged decode attention: one query per row against that row's cached keys plus its new key.
//
// Reads only the row's real context (context_lens[r] tokens through its block table), so a
// static context bucket costs a short sequence nothing but the size of its block-table row.
// Grouped-query: the `group` query heads of a KV head share each key and value read. Scores,
// softmax and the weighted sum are float32 whatever the cache dtype (float32 or bfloat16).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "avx2.h"

namespace {

using vllm_aot::load8;
using vllm_aot::sum8;

// Vectorised by hand: the compiler may not reorder a float sum on its own.
template <typename T>
inline float dot(const float* q, const T* k, int64_t d) {
  __m256 acc = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= d; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + i), load8(k + i), acc);
  float total = sum8(acc);
  for (; i < d; ++i) total += q[i] * static_cast<float>(k[i]);
  return total;
}

// out[0:d] = sum over t < n of p[t] * value(t)[0:d], accumulated in D = d / 8 registers.
template <int D, typename T, typename Value>
inline void weighted_sum(const float* p, int64_t n, Value value, float* out) {
  __m256 acc[D];
  for (int j = 0; j < D; ++j) acc[j] = _mm256_setzero_ps();
  for (int64_t t = 0; t < n; ++t) {
    const __m256 w = _mm256_set1_ps(p[t]);
    const T* v = value(t);
    for (int j = 0; j < D; ++j) acc[j] = _mm256_fmadd_ps(w, load8(v + 8 * j), acc[j]);
  }
  for (int j = 0; j < D; ++j) _mm256_storeu_ps(out + 8 * j, acc[j]);
}

// The same for any d: in registers for the common head sizes, a plain loop otherwise.
template <typename T, typename Value>
inline void weighted_sum_any(const float* p, int64_t n, Value value, int64_t d, float* out) {
  switch (d) {
    case 64: return weighted_sum<8, T>(p, n, value, out);
    case 128: return weighted_sum<16, T>(p, n, value, out);
    default:
      std::fill(out, out + d, 0.f);
      for (int64_t t = 0; t < n; ++t) {
        const T* v = value(t);
        for (int64_t i = 0; i < d; ++i) out[i] += p[t] * static_cast<float>(v[i]);
      }
  }
}

template <typename T>
void attend(const at::Tensor& q, const at::Tensor& k_new, const at::Tensor& v_new,
            const at::Tensor& k_pool, const at::Tensor& v_pool, const at::Tensor& block_tables,
            const at::Tensor& context_lens, at::Tensor& out) {
  const int64_t rows = q.size(0), heads = q.size(1), d = q.size(2);
  const int64_t kv_heads = k_new.size(1), group = heads / kv_heads;
  const int64_t block_size = k_pool.size(1), max_blocks = block_tables.size(1);
  const int64_t max_keys = max_blocks * block_size;
  const float scale = 1.f / std::sqrt(static_cast<float>(d));
  const T* qp = q.data_ptr<T>();
  const T* knp = k_new.data_ptr<T>();
  const T* vnp = v_new.data_ptr<T>();
  const T* kp = k_pool.data_ptr<T>();
  const T* vp = v_pool.data_ptr<T>();
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* lens = context_lens.data_ptr<int64_t>();
  T* op = out.data_ptr<T>();
  const int64_t token_stride = kv_heads * d;  // between positions of a block
  at::parallel_for(0, rows * kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(group * d), acc(d), scores(group * (max_keys + 1));
    for (int64_t item = begin; item < end; ++item) {
      const int64_t r = item / kv_heads, h = item % kv_heads;
      const int64_t len = std::min(lens[r], max_keys);
      const int64_t* table = tables + r * max_blocks;
      // Cached position t, then the row's new key/value at t == len.
      auto at = [&](const T* pool, const T* own, int64_t t) {
        if (t == len) return own + (r * kv_heads + h) * d;
        const int64_t block = table[t / block_size];
        return pool + (block * block_size + t % block_size) * token_stride + h * d;
      };
      for (int64_t g = 0; g < group; ++g)
        for (int64_t i = 0; i < d; ++i)
          qf[g * d + i] = static_cast<float>(qp[(r * heads + h * group + g) * d + i]) * scale;
      for (int64_t t = 0; t <= len; ++t) {
        const T* key = at(kp, knp, t);
        for (int64_t g = 0; g < group; ++g) scores[g * (max_keys + 1) + t] = dot(&qf[g * d], key, d);
      }
      for (int64_t g = 0; g < group; ++g) {
        float* s = &scores[g * (max_keys + 1)];
        float top = -std::numeric_limits<float>::infinity();
        for (int64_t t = 0; t <= len; ++t) top = std::max(top, s[t]);
        float total = 0.f;
        for (int64_t t = 0; t <= len; ++t) total += (s[t] = std::exp(s[t] - top));
        const float inv = 1.f / total;
        for (int64_t t = 0; t <= len; ++t) s[t] *= inv;
        auto value = [&](int64_t t) { return at(vp, vnp, t); };
        weighted_sum_any<T>(s, len + 1, value, d, acc.data());
        T* dst = op + r * heads * d + (h * group + g) * d;
        for (int64_t i = 0; i < d; ++i) dst[i] = static_cast<T>(acc[i]);
      }
    }
  });
}

at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k_new, const at::Tensor& v_new,
                            const at::Tensor& k_pool, const at::Tensor& v_pool,
                            const at::Tensor& block_tables, const at::Tensor& context_lens) {
  TORCH_CHECK(q.dim() == 3 && k_new.dim() == 3 && k_pool.dim() == 4,
              "decode_attention: q [rows, heads, d], k_new [rows, kv, d], pools [n, bs, kv, d]");
  TORCH_CHECK(q.size(1) % k_new.size(1) == 0, "decode_attention: heads % kv_heads != 0");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && context_lens.scalar_type() == at::kLong,
              "decode_attention: int64 block tables and lengths");
  const at::Tensor qc = q.contiguous(), kn = k_new.contiguous(), vn = v_new.contiguous();
  const at::Tensor kp = k_pool.contiguous(), vp = v_pool.contiguous();
  const at::Tensor bt = block_tables.contiguous(), cl = context_lens.contiguous();
  at::Tensor out = at::empty({q.size(0), q.size(1) * q.size(2)}, q.options());
  if (q.scalar_type() == at::kBFloat16) {
    attend<c10::BFloat16>(qc, kn, vn, kp, vp, bt, cl, out);
  } else {
    TORCH_CHECK(q.scalar_type() == at::kFloat, "decode_attention: float32 or bfloat16");
    attend<float>(qc, kn, vn, kp, vp, bt, cl, out);
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(vllm_aot, m) {
  m.def(
      "decode_attention(Tensor q, Tensor k_new, Tensor v_new, Tensor k_pool, Tensor v_pool, "
      "Tensor block_tables, Tensor context_lens) -> Tensor");
}

TORCH_LIBRARY_IMPL(vllm_aot, CPU, m) { m.impl("decode_attention", &decode_attention); }

// The shape function export's fake tensors run: q [rows, heads, d] -> [rows, heads * d].
TORCH_LIBRARY_IMPL(vllm_aot, Meta, m) {
  m.impl("decode_attention",
         [](const at::Tensor& q, const at::Tensor&, const at::Tensor&, const at::Tensor&,
            const at::Tensor&, const at::Tensor&, const at::Tensor&) {
           return at::empty_symint({q.sym_size(0), q.sym_size(1) * q.sym_size(2)}, q.options());
         });
}
