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

namespace {

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }

inline __m256 load8(const c10::BFloat16* p) {
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(v), 16));
}

// Vectorised by hand: the compiler may not reorder a float sum on its own.
template <typename T>
inline float dot(const float* q, const T* k, int64_t d) {
  __m256 acc = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= d; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + i), load8(k + i), acc);
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
  s = _mm_hadd_ps(s, s);
  s = _mm_hadd_ps(s, s);
  float total = _mm_cvtss_f32(s);
  for (; i < d; ++i) total += q[i] * static_cast<float>(k[i]);
  return total;
}

template <typename T>
inline void axpy(float a, const T* v, float* out, int64_t d) {
  for (int64_t i = 0; i < d; ++i) out[i] += a * static_cast<float>(v[i]);
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
    std::vector<float> qf(group * d), acc(group * d), scores(group * (max_keys + 1));
    for (int64_t item = begin; item < end; ++item) {
      const int64_t r = item / kv_heads, h = item % kv_heads;
      const int64_t len = std::min(lens[r], max_keys);
      for (int64_t g = 0; g < group; ++g)
        for (int64_t i = 0; i < d; ++i)
          qf[g * d + i] = static_cast<float>(qp[(r * heads + h * group + g) * d + i]) * scale;
      // Scores: cached keys in block order, then the row's new key at index len.
      for (int64_t t = 0; t < len; ++t) {
        const int64_t block = tables[r * max_blocks + t / block_size];
        const T* key = kp + (block * block_size + t % block_size) * token_stride + h * d;
        for (int64_t g = 0; g < group; ++g) scores[g * (max_keys + 1) + t] = dot(&qf[g * d], key, d);
      }
      const T* own_k = knp + (r * kv_heads + h) * d;
      for (int64_t g = 0; g < group; ++g) scores[g * (max_keys + 1) + len] = dot(&qf[g * d], own_k, d);
      // Softmax over len + 1 keys per query head.
      for (int64_t g = 0; g < group; ++g) {
        float* s = &scores[g * (max_keys + 1)];
        float top = -std::numeric_limits<float>::infinity();
        for (int64_t t = 0; t <= len; ++t) top = std::max(top, s[t]);
        float total = 0.f;
        for (int64_t t = 0; t <= len; ++t) total += (s[t] = std::exp(s[t] - top));
        const float inv = 1.f / total;
        for (int64_t t = 0; t <= len; ++t) s[t] *= inv;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t t = 0; t < len; ++t) {
        const int64_t block = tables[r * max_blocks + t / block_size];
        const T* value = vp + (block * block_size + t % block_size) * token_stride + h * d;
        for (int64_t g = 0; g < group; ++g)
          axpy(scores[g * (max_keys + 1) + t], value, &acc[g * d], d);
      }
      const T* own_v = vnp + (r * kv_heads + h) * d;
      for (int64_t g = 0; g < group; ++g) {
        axpy(scores[g * (max_keys + 1) + len], own_v, &acc[g * d], d);
        T* dst = op + r * heads * d + (h * group + g) * d;
        for (int64_t i = 0; i < d; ++i) dst[i] = static_cast<T>(acc[g * d + i]);
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
