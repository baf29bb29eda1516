// Paged decode attention: one query per row against that row's cached keys plus its new key.
//
// Reads only the row's real context (context_lens[r] tokens through its block table), so a
// static context bucket costs a short sequence nothing but the size of its block-table row.
// Grouped-query: the `group` query heads of a KV head share each key and value read. Scores,
// softmax and the weighted sum are float32 whatever the cache dtype: the model's (float32 or
// bfloat16), or fp8 (e4m3fn, e5m2: elements widened through a table, `fp8.h`, and the layer's
// per-tensor scales folded into the query for keys and into the sum for values).
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
#include "fp8.h"

namespace {

using vllm_aot::exp8;
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

// out[0:d] = v_scale * (sum over t < n of p[t] * value(t)[0:d]) + p[n] * own[0:d]: the cached
// values (stored as value / v_scale), then the row's own, in D = d / 8 registers. A scale of 1
// multiplies nothing, so pools of the model's dtype sum exactly as one loop over n + 1 values.
template <int D, typename P, typename T, typename Value>
inline void weighted_sum(const float* p, int64_t n, Value value, float v_scale, const T* own,
                         float* out) {
  __m256 acc[D];
  for (int j = 0; j < D; ++j) acc[j] = _mm256_setzero_ps();
  for (int64_t t = 0; t < n; ++t) {
    const __m256 w = _mm256_set1_ps(p[t]);
    const P* v = value(t);
    for (int j = 0; j < D; ++j) acc[j] = _mm256_fmadd_ps(w, load8(v + 8 * j), acc[j]);
  }
  if (v_scale != 1.f)
    for (int j = 0; j < D; ++j) acc[j] = _mm256_mul_ps(acc[j], _mm256_set1_ps(v_scale));
  const __m256 w = _mm256_set1_ps(p[n]);
  for (int j = 0; j < D; ++j) acc[j] = _mm256_fmadd_ps(w, load8(own + 8 * j), acc[j]);
  for (int j = 0; j < D; ++j) _mm256_storeu_ps(out + 8 * j, acc[j]);
}

// The same for any d: in registers for the common head sizes, a plain loop otherwise.
template <typename P, typename T, typename Value>
inline void weighted_sum_any(const float* p, int64_t n, Value value, float v_scale, const T* own,
                             int64_t d, float* out) {
  switch (d) {
    case 64: return weighted_sum<8, P>(p, n, value, v_scale, own, out);
    case 128: return weighted_sum<16, P>(p, n, value, v_scale, own, out);
    default:
      std::fill(out, out + d, 0.f);
      for (int64_t t = 0; t < n; ++t) {
        const P* v = value(t);
        for (int64_t i = 0; i < d; ++i) out[i] += p[t] * static_cast<float>(v[i]);
      }
      if (v_scale != 1.f)
        for (int64_t i = 0; i < d; ++i) out[i] *= v_scale;
      for (int64_t i = 0; i < d; ++i) out[i] += p[n] * static_cast<float>(own[i]);
  }
}

// T: q, the new K/V and the output (float32 or bfloat16); P: the pools' elements (T, or an fp8
// type whose elements are key / k_scale and value / v_scale).
template <typename T, typename P>
void attend(const at::Tensor& q, const at::Tensor& k_new, const at::Tensor& v_new,
            const at::Tensor& k_pool, const at::Tensor& v_pool, const at::Tensor& block_tables,
            const at::Tensor& context_lens, float k_scale, float v_scale, at::Tensor& out) {
  const int64_t rows = q.size(0), heads = q.size(1), d = q.size(2);
  const int64_t kv_heads = k_new.size(1), group = heads / kv_heads;
  const int64_t block_size = k_pool.size(1), max_blocks = block_tables.size(1);
  const int64_t max_keys = max_blocks * block_size;
  const float scale = 1.f / std::sqrt(static_cast<float>(d));
  const T* qp = q.data_ptr<T>();
  const T* knp = k_new.data_ptr<T>();
  const T* vnp = v_new.data_ptr<T>();
  const P* kp = k_pool.data_ptr<P>();
  const P* vp = v_pool.data_ptr<P>();
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* lens = context_lens.data_ptr<int64_t>();
  T* op = out.data_ptr<T>();
  const int64_t token_stride = kv_heads * d;  // between positions of a block
  at::parallel_for(0, rows * kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(group * d), qk, acc(d), scores(group * (max_keys + 1));
    for (int64_t item = begin; item < end; ++item) {
      const int64_t r = item / kv_heads, h = item % kv_heads;
      const int64_t len = std::min(lens[r], max_keys);
      const int64_t* table = tables + r * max_blocks;
      const int64_t own = (r * kv_heads + h) * d;  // the row's new key/value, at t == len
      auto cached = [&](const P* pool, int64_t t) {  // cached position t < len
        const int64_t block = table[t / block_size];
        return pool + (block * block_size + t % block_size) * token_stride + h * d;
      };
      for (int64_t g = 0; g < group; ++g)
        for (int64_t i = 0; i < d; ++i)
          qf[g * d + i] = static_cast<float>(qp[(r * heads + h * group + g) * d + i]) * scale;
      // q . key == (q * k_scale) . stored key
      const float* q_cached = qf.data();
      if (k_scale != 1.f) {
        qk.resize(group * d);
        for (int64_t i = 0; i < group * d; ++i) qk[i] = qf[i] * k_scale;
        q_cached = qk.data();
      }
      for (int64_t t = 0; t < len; ++t) {
        const P* key = cached(kp, t);
        for (int64_t g = 0; g < group; ++g)
          scores[g * (max_keys + 1) + t] = dot(&q_cached[g * d], key, d);
      }
      for (int64_t g = 0; g < group; ++g)
        scores[g * (max_keys + 1) + len] = dot(&qf[g * d], knp + own, d);
      for (int64_t g = 0; g < group; ++g) {
        float* s = &scores[g * (max_keys + 1)];
        float top = -std::numeric_limits<float>::infinity();
        for (int64_t t = 0; t <= len; ++t) top = std::max(top, s[t]);
        __m256 sums = _mm256_setzero_ps();
        int64_t t = 0;
        for (; t + 8 <= len + 1; t += 8) {
          const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + t), _mm256_set1_ps(top)));
          _mm256_storeu_ps(s + t, e);
          sums = _mm256_add_ps(sums, e);
        }
        float total = sum8(sums);
        for (; t <= len; ++t) total += (s[t] = std::exp(s[t] - top));
        const float inv = 1.f / total;
        for (int64_t t = 0; t <= len; ++t) s[t] *= inv;
        auto value = [&](int64_t t) { return cached(vp, t); };
        weighted_sum_any<P>(s, len, value, v_scale, vnp + own, d, acc.data());
        T* dst = op + r * heads * d + (h * group + g) * d;
        for (int64_t i = 0; i < d; ++i) dst[i] = static_cast<T>(acc[i]);
      }
    }
  });
}

// The pools' element type: the model's (q's) dtype, or an fp8 format.
template <typename T>
void attend_pools(const at::Tensor& q, const at::Tensor& k_new, const at::Tensor& v_new,
                  const at::Tensor& k_pool, const at::Tensor& v_pool,
                  const at::Tensor& block_tables, const at::Tensor& context_lens, float k_scale,
                  float v_scale, at::Tensor& out) {
  const auto pool = k_pool.scalar_type();
  TORCH_CHECK(v_pool.scalar_type() == pool, "decode_attention: K and V pools of one dtype");
  if (pool == q.scalar_type()) {
    attend<T, T>(q, k_new, v_new, k_pool, v_pool, block_tables, context_lens, k_scale, v_scale,
                 out);
  } else if (pool == at::kFloat8_e4m3fn) {
    attend<T, c10::Float8_e4m3fn>(q, k_new, v_new, k_pool, v_pool, block_tables, context_lens,
                                  k_scale, v_scale, out);
  } else {
    TORCH_CHECK(pool == at::kFloat8_e5m2,
                "decode_attention: pools of q's dtype, float8_e4m3fn or float8_e5m2");
    attend<T, c10::Float8_e5m2>(q, k_new, v_new, k_pool, v_pool, block_tables, context_lens,
                                k_scale, v_scale, out);
  }
}

float scalar(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.scalar_type() == at::kFloat && t.numel() == 1, "decode_attention: ", name,
              " must be one float32");
  return *t.data_ptr<float>();
}

at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k_new, const at::Tensor& v_new,
                            const at::Tensor& k_pool, const at::Tensor& v_pool,
                            const at::Tensor& block_tables, const at::Tensor& context_lens,
                            const at::Tensor& k_scale, const at::Tensor& v_scale) {
  TORCH_CHECK(q.dim() == 3 && k_new.dim() == 3 && k_pool.dim() == 4,
              "decode_attention: q [rows, heads, d], k_new [rows, kv, d], pools [n, bs, kv, d]");
  TORCH_CHECK(q.size(1) % k_new.size(1) == 0, "decode_attention: heads % kv_heads != 0");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && context_lens.scalar_type() == at::kLong,
              "decode_attention: int64 block tables and lengths");
  const at::Tensor qc = q.contiguous(), kn = k_new.contiguous(), vn = v_new.contiguous();
  const at::Tensor kp = k_pool.contiguous(), vp = v_pool.contiguous();
  const at::Tensor bt = block_tables.contiguous(), cl = context_lens.contiguous();
  const float ks = scalar(k_scale, "k_scale"), vs = scalar(v_scale, "v_scale");
  at::Tensor out = at::empty({q.size(0), q.size(1) * q.size(2)}, q.options());
  if (q.scalar_type() == at::kBFloat16) {
    attend_pools<c10::BFloat16>(qc, kn, vn, kp, vp, bt, cl, ks, vs, out);
  } else {
    TORCH_CHECK(q.scalar_type() == at::kFloat, "decode_attention: float32 or bfloat16");
    attend_pools<float>(qc, kn, vn, kp, vp, bt, cl, ks, vs, out);
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(vllm_aot, m) {
  m.def(
      "decode_attention(Tensor q, Tensor k_new, Tensor v_new, Tensor k_pool, Tensor v_pool, "
      "Tensor block_tables, Tensor context_lens, Tensor k_scale, Tensor v_scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(vllm_aot, CPU, m) { m.impl("decode_attention", &decode_attention); }

// The shape function export's fake tensors run: q [rows, heads, d] -> [rows, heads * d].
TORCH_LIBRARY_IMPL(vllm_aot, Meta, m) {
  m.impl("decode_attention",
         [](const at::Tensor& q, const at::Tensor&, const at::Tensor&, const at::Tensor&,
            const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
            const at::Tensor&) {
           return at::empty_symint({q.sym_size(0), q.sym_size(1) * q.sym_size(2)}, q.options());
         });
}
