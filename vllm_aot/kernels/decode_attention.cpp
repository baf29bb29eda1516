// Paged decode attention: one query per row against that row's cached keys plus its new key, or,
// for speculative decoding's verify steps, n queries per row (the newest token and its drafts),
// each against the row's cached keys and, causally, the row's new keys up to its own.
//
// Reads only the row's real context (context_lens[r] tokens through its block table), so a
// static context bucket costs a short sequence nothing but the size of its block-table row.
// Grouped-query: the `group` query heads of a KV head share each key and value read, widened to
// float32 once for every 4 of them (heads of 64 or 128, the sums in registers; other head sizes
// one query head at a time); bfloat16 queries and pools on a CPU with AVX512-BF16 take the
// loops of `decode_attention_avx512.h` (keys read as stored, 16 keys' sums reduced at once:
// docs/benchmarks.md#decode-attention-on-avx512-bf16). Scores,
// softmax and the weighted sum are float32 whatever the cache dtype: the model's (float32 or
// bfloat16), or fp8 (e4m3fn, e5m2: elements widened through a table, `fp8.h`, and the layer's
// per-tensor scales folded into the query for keys and into the sum for values). The new keys
// and values are attended as computed.
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
#include <type_traits>
#include <vector>

#include "attention.h"
#include "avx2.h"
#include "decode_attention_avx512.h"
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

// A row's cached positions of one KV head, walked block by block through its block table.
template <typename P>
struct Cached {
  const P* pool;  // the pool at this KV head's first element
  const int64_t* table;
  int64_t len, block_size, token_stride, head_dim;

  // f(t, the element at position t) for t < len, in order; the next block's positions are
  // prefetched as a block starts (a row's blocks are scattered over the pool, and one head's
  // elements of a position are a line or two in a stride of every head's: too sparse for the
  // hardware prefetcher), into L1 (`kHint`; the AVX512-BF16 loops ask into L2: see
  // docs/benchmarks.md#prefetch). Always inlined, so that in the
  // AVX512-BF16 loops (`decode_attention_avx512.h`) `f`, compiled for that target, is inlined too.
  template <decltype(_MM_HINT_T0) kHint = _MM_HINT_T0, class F>
  __attribute__((always_inline)) inline void each(const F& f) const {
    constexpr int64_t kLine = 64 / sizeof(P);
    for (int64_t t0 = 0, b = 0; t0 < len; t0 += block_size, ++b) {
      const P* base = pool + table[b] * block_size * token_stride;
      const int64_t n = std::min(block_size, len - t0);
      if (t0 + block_size < len) {
        const P* next = pool + table[b + 1] * block_size * token_stride;
        const int64_t later = std::min(block_size, len - t0 - block_size);
        for (int64_t j = 0; j < later; ++j)
          for (int64_t e = 0; e < head_dim; e += kLine)
            _mm_prefetch(reinterpret_cast<const char*>(next + j * token_stride + e), kHint);
      }
      for (int64_t j = 0; j < n; ++j) f(t0 + j, base + j * token_stride);
    }
  }
};

// scores[g * stride + t] = q[g] . key(t) for the G query heads of a KV head and every cached
// position, d = 8 * D: each key widened once for all G heads (the sums in dot's order).
template <int G, int D, typename P>
void key_scores(const float* q, const Cached<P>& keys, float* scores, int64_t stride) {
  keys.each([&](int64_t t, const P* key) {
    __m256 acc[G];
    for (int g = 0; g < G; ++g) acc[g] = _mm256_setzero_ps();
    for (int c = 0; c < D; ++c) {
      const __m256 k = load8(key + 8 * c);
      for (int g = 0; g < G; ++g)
        acc[g] = _mm256_fmadd_ps(_mm256_loadu_ps(q + g * 8 * D + 8 * c), k, acc[g]);
    }
    for (int g = 0; g < G; ++g) scores[g * stride + t] = sum8(acc[g]);
  });
}

// out[g * d : (g + 1) * d] = v_scale * (sum over t < len of p[g][t] * value(t)) + p[g][len] *
// own, p[g] = probs + g * stride: each value widened once for all G heads, a piece of kPiece
// registers of it at a time so the G * kPiece sums stay in registers (a scale of 1 multiplies
// nothing: pools of the model's dtype sum as one loop over len + 1 values).
template <int G, int D, typename P, typename T>
void weighted_values(const float* probs, int64_t stride, const Cached<P>& values, float v_scale,
                     const T* own, float* out) {
  constexpr int kPiece = G == 1 ? 8 : G <= 3 ? 4 : 2;
  static_assert(D % kPiece == 0, "head size in pieces");
  const int64_t len = values.len;
  for (int c0 = 0; c0 < D; c0 += kPiece) {
    __m256 acc[G][kPiece];
    for (int g = 0; g < G; ++g)
      for (int c = 0; c < kPiece; ++c) acc[g][c] = _mm256_setzero_ps();
    values.each([&](int64_t t, const P* v) {
      __m256 w[G];
      for (int g = 0; g < G; ++g) w[g] = _mm256_set1_ps(probs[g * stride + t]);
      for (int c = 0; c < kPiece; ++c) {
        const __m256 x = load8(v + 8 * (c0 + c));
        for (int g = 0; g < G; ++g) acc[g][c] = _mm256_fmadd_ps(w[g], x, acc[g][c]);
      }
    });
    for (int g = 0; g < G; ++g) {
      const __m256 w = _mm256_set1_ps(probs[g * stride + len]);
      for (int c = 0; c < kPiece; ++c) {
        if (v_scale != 1.f) acc[g][c] = _mm256_mul_ps(acc[g][c], _mm256_set1_ps(v_scale));
        acc[g][c] = _mm256_fmadd_ps(w, load8(own + 8 * (c0 + c)), acc[g][c]);
        _mm256_storeu_ps(out + g * 8 * D + 8 * (c0 + c), acc[g][c]);
      }
    }
  }
}

// The same for any head size, one query head at a time.
template <typename P>
void key_scores_any(const float* q, const Cached<P>& keys, float* scores, int64_t stride,
                    int64_t group, int64_t d) {
  keys.each([&](int64_t t, const P* key) {
    for (int64_t g = 0; g < group; ++g) scores[g * stride + t] = dot(q + g * d, key, d);
  });
}

template <typename P, typename T>
void weighted_values_any(const float* probs, int64_t stride, const Cached<P>& values,
                         float v_scale, const T* own, float* out, int64_t group, int64_t d) {
  std::fill(out, out + group * d, 0.f);
  values.each([&](int64_t t, const P* v) {
    for (int64_t g = 0; g < group; ++g)
      for (int64_t i = 0; i < d; ++i)
        out[g * d + i] += probs[g * stride + t] * static_cast<float>(v[i]);
  });
  for (int64_t g = 0; g < group; ++g)
    for (int64_t i = 0; i < d; ++i) {
      if (v_scale != 1.f) out[g * d + i] *= v_scale;
      out[g * d + i] += probs[g * stride + values.len] * static_cast<float>(own[i]);
    }
}

// The register paths for a head size, by how many query heads (1 to kMaxGroup) share the keys
// and values they read; empty for head sizes without one.
constexpr int64_t kMaxGroup = 4;

template <typename P, typename T>
struct GroupFns {
  void (*scores[kMaxGroup + 1])(const float*, const Cached<P>&, float*, int64_t) = {};
  void (*values[kMaxGroup + 1])(const float*, int64_t, const Cached<P>&, float, const T*,
                                float*) = {};
  bool empty() const { return scores[1] == nullptr; }
};

template <int D, typename P, typename T>
GroupFns<P, T> group_fns_d() {
  return {{nullptr, &key_scores<1, D, P>, &key_scores<2, D, P>, &key_scores<3, D, P>,
           &key_scores<4, D, P>},
          {nullptr, &weighted_values<1, D, P, T>, &weighted_values<2, D, P, T>,
           &weighted_values<3, D, P, T>, &weighted_values<4, D, P, T>}};
}

template <typename P, typename T>
GroupFns<P, T> group_fns(int64_t d) {
  if (d == 64) return group_fns_d<8, P, T>();
  if (d == 128) return group_fns_d<16, P, T>();
  return {};
}

// The AVX512-BF16 loops (`decode_attention_avx512.h`) by group size: for bfloat16 queries and
// pools with heads of 64 or 128 on a CPU that has them; empty otherwise (and for other types).
template <typename T, typename P>
struct WideFns {
  void (*scores[kMaxGroup + 1])(const T*, float, const Cached<P>&, float*, int64_t) = {};
  void (*values[kMaxGroup + 1])(const float*, int64_t, const Cached<P>&, const T*, float*) = {};
  bool empty() const { return scores[1] == nullptr; }
};

template <int D, typename B>
WideFns<B, B> wide_fns_d() {
  namespace a = vllm_aot::attention_avx512;
  using C = Cached<B>;
  return {{nullptr, &a::key_scores<1, D, C>, &a::key_scores<2, D, C>, &a::key_scores<3, D, C>,
           &a::key_scores<4, D, C>},
          {nullptr, &a::weighted_values<1, D, C>, &a::weighted_values<2, D, C>,
           &a::weighted_values<3, D, C>, &a::weighted_values<4, D, C>}};
}

template <typename T, typename P>
WideFns<T, P> wide_fns(int64_t d) {
  if constexpr (std::is_same_v<T, c10::BFloat16> && std::is_same_v<P, c10::BFloat16>) {
    static const bool available = vllm_aot::attention_avx512::available();
    if (available && d == 64) return wide_fns_d<2, T>();
    if (available && d == 128) return wide_fns_d<4, T>();
  }
  return {};
}

// In place over each of the group's score rows [0, n]: softmax, float32 (exp8 eight at a time).
inline void softmax_rows(float* scores, int64_t stride, int64_t group, int64_t n) {
  for (int64_t g = 0; g < group; ++g) {
    float* s = scores + g * stride;
    // the largest eight lanes at a time (a scalar max a score is a chain of its latencies)
    __m256 tops = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
    int64_t i = 0;
    for (; i + 8 <= n + 1; i += 8) tops = _mm256_max_ps(tops, _mm256_loadu_ps(s + i));
    float lanes[8];
    _mm256_storeu_ps(lanes, tops);
    float top = *std::max_element(lanes, lanes + 8);
    for (; i <= n; ++i) top = std::max(top, s[i]);
    __m256 sums = _mm256_setzero_ps();
    int64_t t = 0;
    for (; t + 8 <= n + 1; t += 8) {
      const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + t), _mm256_set1_ps(top)));
      _mm256_storeu_ps(s + t, e);
      sums = _mm256_add_ps(sums, e);
    }
    float total = sum8(sums);
    for (; t <= n; ++t) total += (s[t] = std::exp(s[t] - top));
    const float inv = 1.f / total;
    for (int64_t t = 0; t <= n; ++t) s[t] *= inv;
  }
}

// The later new values of a row's new token `token` (new tokens 1 .. token, the first being
// weighted_values' own): out[g * d + c] += p[g][len + j] * value j.
template <typename T>
void later_values(const float* probs, int64_t stride, int64_t len, const T* first,
                  int64_t value_stride, int64_t token, float* out, int64_t group, int64_t d) {
  for (int64_t j = 1; j <= token; ++j) {
    const T* v = first + j * value_stride;
    for (int64_t g = 0; g < group; ++g) {
      const __m256 w = _mm256_set1_ps(probs[g * stride + len + j]);
      int64_t c = 0;
      for (; c + 8 <= d; c += 8)
        _mm256_storeu_ps(out + g * d + c,
                         _mm256_fmadd_ps(w, load8(v + c), _mm256_loadu_ps(out + g * d + c)));
      for (; c < d; ++c) out[g * d + c] += probs[g * stride + len + j] * static_cast<float>(v[c]);
    }
  }
}

// T: q, the new K/V and the output (float32 or bfloat16); P: the pools' elements (T, or an fp8
// type whose elements are key / k_scale and value / v_scale). q and the new K/V hold n tokens
// per row of the block tables (row-major: row, then token); token i of a row sees the row's
// context and its new tokens 0 .. i. Work items are (row, token, KV head): the group's query
// heads share every key and value read.
template <typename T, typename P>
void attend(const at::Tensor& q, const at::Tensor& k_new, const at::Tensor& v_new,
            const at::Tensor& k_pool, const at::Tensor& v_pool, const at::Tensor& block_tables,
            const at::Tensor& context_lens, float k_scale, float v_scale, at::Tensor& out) {
  const int64_t queries = q.size(0), heads = q.size(1), d = q.size(2);
  const int64_t per_row = queries / block_tables.size(0);  // new tokens per row
  const int64_t kv_heads = k_new.size(1), group = heads / kv_heads;
  const int64_t block_size = k_pool.size(1), max_blocks = block_tables.size(1);
  // a query head's scores, the row's new keys last
  const int64_t stride = max_blocks * block_size + per_row;
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
  const GroupFns<P, T> fast = group_fns<P, T>(d);
  const WideFns<T, P> wide = wide_fns<T, P>(d);
  at::parallel_for(0, queries * kv_heads, 1, [&](int64_t begin, int64_t end) {
    // Scratch kept by each thread (sized, never cleared: every element read is written first).
    thread_local std::vector<float> qf, qk, acc, scores;
    qf.resize(group * d), qk.resize(group * d), acc.resize(group * d);
    scores.resize(group * stride);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t qr = item / kv_heads, h = item % kv_heads;  // query row r * per_row + token
      const int64_t r = qr / per_row, token = qr % per_row;
      const int64_t len = std::min(lens[r], stride - per_row);
      const int64_t* table = tables + r * max_blocks;
      // the row's first new key/value (at t == len); new token j's is j * token_stride on
      const int64_t own = (r * per_row * kv_heads + h) * d;
      const Cached<P> keys{kp + h * d, table, len, block_size, token_stride, d};
      const Cached<P> values{vp + h * d, table, len, block_size, token_stride, d};
      const T* qh = qp + (qr * heads + h * group) * d;  // the group's query heads, contiguous
      for (int64_t i = 0; i < group * d; ++i) qf[i] = static_cast<float>(qh[i]) * scale;
      // q . key == (q * k_scale) . stored key
      const float* q_cached = qf.data();
      if (k_scale != 1.f) {
        for (int64_t i = 0; i < group * d; ++i) qk[i] = qf[i] * k_scale;
        q_cached = qk.data();
      }
      if (!wide.empty()) {
        for (int64_t g0 = 0; g0 < group; g0 += kMaxGroup) {  // query heads kMaxGroup at a time
          const int64_t n = std::min(kMaxGroup, group - g0);
          wide.scores[n](qh + g0 * d, scale, keys, &scores[g0 * stride], stride);
        }
      } else if (!fast.empty()) {
        for (int64_t g0 = 0; g0 < group; g0 += kMaxGroup) {
          const int64_t n = std::min(kMaxGroup, group - g0);
          fast.scores[n](q_cached + g0 * d, keys, &scores[g0 * stride], stride);
        }
      } else {
        key_scores_any<P>(q_cached, keys, scores.data(), stride, group, d);
      }
      for (int64_t g = 0; g < group; ++g)
        for (int64_t j = 0; j <= token; ++j)
          scores[g * stride + len + j] = dot(&qf[g * d], knp + own + j * token_stride, d);
      softmax_rows(scores.data(), stride, group, len + token);
      if (!wide.empty()) {
        for (int64_t g0 = 0; g0 < group; g0 += kMaxGroup) {
          const int64_t n = std::min(kMaxGroup, group - g0);
          wide.values[n](&scores[g0 * stride], stride, values, vnp + own, &acc[g0 * d]);
        }
      } else if (!fast.empty()) {
        for (int64_t g0 = 0; g0 < group; g0 += kMaxGroup) {
          const int64_t n = std::min(kMaxGroup, group - g0);
          fast.values[n](&scores[g0 * stride], stride, values, v_scale, vnp + own, &acc[g0 * d]);
        }
      } else {
        weighted_values_any<P, T>(scores.data(), stride, values, v_scale, vnp + own,
                                  acc.data(), group, d);
      }
      later_values(scores.data(), stride, len, vnp + own, token_stride, token, acc.data(), group,
                   d);
      T* dst = op + (qr * heads + h * group) * d;
      for (int64_t i = 0; i < group * d; ++i) dst[i] = static_cast<T>(acc[i]);
    }
  });
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
  TORCH_CHECK(block_tables.size(0) > 0 && q.size(0) % block_tables.size(0) == 0 &&
                  k_new.size(0) == q.size(0) && context_lens.size(0) == block_tables.size(0),
              "decode_attention: q and k_new [rows * n, ...] for block tables [rows, ...]");
  const at::Tensor qc = q.contiguous(), kn = k_new.contiguous(), vn = v_new.contiguous();
  const at::Tensor kp = k_pool.contiguous(), vp = v_pool.contiguous();
  const at::Tensor bt = block_tables.contiguous(), cl = context_lens.contiguous();
  const float ks = vllm_aot::one_float(k_scale, "decode_attention", "k_scale");
  const float vs = vllm_aot::one_float(v_scale, "decode_attention", "v_scale");
  at::Tensor out = at::empty({q.size(0), q.size(1) * q.size(2)}, q.options());
  vllm_aot::with_element_types(qc, kp, vp, "decode_attention", [&](auto model, auto element) {
    attend<decltype(model), decltype(element)>(qc, kn, vn, kp, vp, bt, cl, ks, vs, out);
  });
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
