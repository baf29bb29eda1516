// Paged prefill attention: a step's packed tokens (chunks of one or more sequences) against
// their sequences' cached blocks and, causally, their own new keys, with an online softmax over
// chunks of keys, so a token pays only for the keys it sees: not for its context bucket's
// padding, not for the keys after it, not for the other sequences in the step.
//
// The inputs are the reference's (`models.layers.prefill_attention`): the cached blocks of every
// sequence flattened into one list, and a [tokens, cached keys + tokens] visibility mask. Each
// token's visible keys are one range of the cached keys and one range of the new ones (its
// sequence's cached positions, then its chunk's tokens up to itself); the kernel reads the two
// ranges off the mask and refuses a mask that is not of that form.
//
// Work items are (tile of kTile consecutive tokens, KV head): the tile's tokens times the group's
// query heads share every key and value read, widened to float32 once per chunk of kChunk keys
// (keys transposed, so a score is eight keys' FMAs). Scores, softmax and the weighted sums are
// float32 whatever the model's dtype; bfloat16 products are exact in float32, so this is the
// reference's float32 SDPA up to the order of the sums. Pools of fp8 are widened through their
// tables (`fp8.h`) and scaled by the layer's K/V scales as they are read.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "attention.h"
#include "avx2.h"
#include "fp8.h"

namespace {

using vllm_aot::exp8;
using vllm_aot::load8;

constexpr int64_t kTile = 8;  // tokens a work item
constexpr int64_t kChunk = 32;  // keys widened at a time (four registers of scores)
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// What one token sees: cached keys [ctx_begin, ctx_end) of the flattened list and new keys
// [own_begin, own_end) of the step.
struct Visible {
  int64_t ctx_begin, ctx_end, own_begin, own_end;
};

// The number of nonzero bytes of a bool row (0/1 bytes: their sum).
inline int64_t count_true(const uint8_t* p, int64_t n) {
  int64_t i = 0;
  __m256i sums = _mm256_setzero_si256();
  for (; i + 32 <= n; i += 32)
    sums = _mm256_add_epi64(sums, _mm256_sad_epu8(_mm256_loadu_si256(
                                                      reinterpret_cast<const __m256i*>(p + i)),
                                                  _mm256_setzero_si256()));
  alignas(32) int64_t lanes[4];
  _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), sums);
  int64_t total = lanes[0] + lanes[1] + lanes[2] + lanes[3];
  for (; i < n; ++i) total += p[i] != 0;
  return total;
}

// The one range of true bytes in p[0, n) as [begin, end) (empty: begin == end == 0); false if
// the true bytes are not one range.
inline bool one_range(const uint8_t* p, int64_t n, int64_t& begin, int64_t& end) {
  const int64_t count = count_true(p, n);
  begin = end = 0;
  if (count == 0) return true;
  const void* first = std::memchr(p, 1, n);
  if (first == nullptr) return false;  // a bool byte other than 0 and 1
  begin = static_cast<const uint8_t*>(first) - p;
  end = begin + count;
  return end <= n && count_true(p + begin, count) == count;
}

// Eight keys' columns: kt[c * kChunk + j] = scale * key j's element c, for keys j0 .. j0 + 7
// (the first n real, the rest zero) of head size d (a multiple of 8).
template <typename P>
inline void transpose8(const P* const* rows, int n, int64_t d, float scale, float* kt,
                       int64_t j0) {
  for (int64_t c = 0; c < d; c += 8) {
    __m256 r[8];
    for (int j = 0; j < 8; ++j)
      r[j] = j < n ? _mm256_mul_ps(load8(rows[j] + c), _mm256_set1_ps(scale))
                   : _mm256_setzero_ps();
    const __m256 t0 = _mm256_unpacklo_ps(r[0], r[1]), t1 = _mm256_unpackhi_ps(r[0], r[1]);
    const __m256 t2 = _mm256_unpacklo_ps(r[2], r[3]), t3 = _mm256_unpackhi_ps(r[2], r[3]);
    const __m256 t4 = _mm256_unpacklo_ps(r[4], r[5]), t5 = _mm256_unpackhi_ps(r[4], r[5]);
    const __m256 t6 = _mm256_unpacklo_ps(r[6], r[7]), t7 = _mm256_unpackhi_ps(r[6], r[7]);
    const __m256 s0 = _mm256_shuffle_ps(t0, t2, 0x44), s1 = _mm256_shuffle_ps(t0, t2, 0xEE);
    const __m256 s2 = _mm256_shuffle_ps(t1, t3, 0x44), s3 = _mm256_shuffle_ps(t1, t3, 0xEE);
    const __m256 s4 = _mm256_shuffle_ps(t4, t6, 0x44), s5 = _mm256_shuffle_ps(t4, t6, 0xEE);
    const __m256 s6 = _mm256_shuffle_ps(t5, t7, 0x44), s7 = _mm256_shuffle_ps(t5, t7, 0xEE);
    const __m256 cols[8] = {
        _mm256_permute2f128_ps(s0, s4, 0x20), _mm256_permute2f128_ps(s1, s5, 0x20),
        _mm256_permute2f128_ps(s2, s6, 0x20), _mm256_permute2f128_ps(s3, s7, 0x20),
        _mm256_permute2f128_ps(s0, s4, 0x31), _mm256_permute2f128_ps(s1, s5, 0x31),
        _mm256_permute2f128_ps(s2, s6, 0x31), _mm256_permute2f128_ps(s3, s7, 0x31)};
    for (int i = 0; i < 8; ++i) _mm256_storeu_ps(kt + (c + i) * kChunk + j0, cols[i]);
  }
}

// A chunk of up to kChunk keys and values, widened (and scaled) to float32: keys transposed
// (kt[c * kChunk + j]), values as rows (vf[j * d + c]).
template <typename P>
void widen_chunk(const P* const* krows, const P* const* vrows, int64_t n, int64_t d,
                 float k_scale, float v_scale, float* kt, float* vf) {
  for (int64_t j0 = 0; j0 < kChunk; j0 += 8)
    transpose8(krows + j0, static_cast<int>(std::clamp<int64_t>(n - j0, 0, 8)), d, k_scale, kt,
               j0);
  for (int64_t j = 0; j < n; ++j)
    for (int64_t c = 0; c < d; c += 8)
      _mm256_storeu_ps(vf + j * d + c, _mm256_mul_ps(load8(vrows[j] + c), _mm256_set1_ps(v_scale)));
}

// One query vector's running softmax: the largest score so far and the sum of exponentials
// (its weighted sum of values is a row of the work item's `acc`).
struct Running {
  float top, total;
};

// Scores of two query vectors against the chunk's keys: s[v * kChunk + j] = q_v . key j.
inline void scores2(const float* q0, const float* q1, const float* kt, int64_t d, float* s0,
                    float* s1) {
  __m256 a[4], b[4];
  for (int i = 0; i < 4; ++i) a[i] = b[i] = _mm256_setzero_ps();
  for (int64_t c = 0; c < d; ++c) {
    const __m256 x = _mm256_set1_ps(q0[c]), y = _mm256_set1_ps(q1[c]);
    for (int i = 0; i < 4; ++i) {
      const __m256 k = _mm256_loadu_ps(kt + c * kChunk + 8 * i);
      a[i] = _mm256_fmadd_ps(x, k, a[i]);
      b[i] = _mm256_fmadd_ps(y, k, b[i]);
    }
  }
  for (int i = 0; i < 4; ++i) {
    _mm256_storeu_ps(s0 + 8 * i, a[i]);
    _mm256_storeu_ps(s1 + 8 * i, b[i]);
  }
}

// The largest of s[lo, hi) (hi > lo), eight at a time.
inline float largest(const float* s, int64_t lo, int64_t hi) {
  __m256 top = _mm256_set1_ps(kNegInf);
  int64_t j = lo;
  for (; j + 8 <= hi; j += 8) top = _mm256_max_ps(top, _mm256_loadu_ps(s + j));
  __m128 t = _mm_max_ps(_mm256_castps256_ps128(top), _mm256_extractf128_ps(top, 1));
  t = _mm_max_ps(t, _mm_movehl_ps(t, t));
  t = _mm_max_ss(t, _mm_movehdup_ps(t));
  float m = _mm_cvtss_f32(t);
  for (; j < hi; ++j) m = std::max(m, s[j]);
  return m;
}

// acc[0, 8 * P) = acc * rescale + sum over k in [lo, hi) of p[k] * vf[k * d + ...]: P registers
// of the sum held through the keys.
template <int P>
inline void weigh(const float* p, int64_t lo, int64_t hi, const float* vf, int64_t d,
                  float rescale, float* acc) {
  __m256 o[P];
  const __m256 r = _mm256_set1_ps(rescale);
  for (int i = 0; i < P; ++i) o[i] = _mm256_mul_ps(_mm256_loadu_ps(acc + 8 * i), r);
  for (int64_t k = lo; k < hi; ++k) {
    const __m256 w = _mm256_set1_ps(p[k]);
    const float* v = vf + k * d;
    for (int i = 0; i < P; ++i) o[i] = _mm256_fmadd_ps(w, _mm256_loadu_ps(v + 8 * i), o[i]);
  }
  for (int i = 0; i < P; ++i) _mm256_storeu_ps(acc + 8 * i, o[i]);
}

// Folds scores s[lo, hi) of one query vector (the keys it sees in this chunk) into its running
// softmax and weighted sum acc[d] over the chunk's values vf.
inline void fold(float* s, int64_t lo, int64_t hi, const float* vf, int64_t d, Running& run,
                 float* acc) {
  const float top = std::max(run.top, largest(s, lo, hi));
  const float rescale = run.top == kNegInf ? 0.f : std::exp(run.top - top);
  __m256 sums = _mm256_setzero_ps();
  int64_t j = lo;
  for (; j + 8 <= hi; j += 8) {
    const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + j), _mm256_set1_ps(top)));
    _mm256_storeu_ps(s + j, e);
    sums = _mm256_add_ps(sums, e);
  }
  float total = vllm_aot::sum8(sums);
  for (; j < hi; ++j) total += (s[j] = std::exp(s[j] - top));
  run.total = run.total * rescale + total;
  run.top = top;
  int64_t c = 0;
  for (; c + 64 <= d; c += 64) weigh<8>(s, lo, hi, vf + c, d, rescale, acc + c);
  for (; c < d; c += 8) weigh<1>(s, lo, hi, vf + c, d, rescale, acc + c);
}

// T: q, the new K/V and the output (float32 or bfloat16); P: the pools' elements (T or fp8).
template <typename T, typename P>
void attend(const at::Tensor& q, const at::Tensor& k_new, const at::Tensor& v_new,
            const at::Tensor& k_pool, const at::Tensor& v_pool, const at::Tensor& block_ids,
            const std::vector<Visible>& visible, float k_scale, float v_scale, at::Tensor& out) {
  const int64_t tokens = q.size(0), heads = q.size(1), d = q.size(2);
  const int64_t kv_heads = k_new.size(1), group = heads / kv_heads;
  const int64_t block_size = k_pool.size(1), token_stride = kv_heads * d;
  const float scale = 1.f / std::sqrt(static_cast<float>(d));
  const T* qp = q.data_ptr<T>();
  const T* knp = k_new.data_ptr<T>();
  const T* vnp = v_new.data_ptr<T>();
  const P* kp = k_pool.data_ptr<P>();
  const P* vp = v_pool.data_ptr<P>();
  const int64_t* ids = block_ids.data_ptr<int64_t>();
  T* op = out.data_ptr<T>();
  // Each tile's union of its tokens' ranges; tiles taken by the threads as they free up,
  // the costliest first (a causal prompt's last tiles read the most keys).
  const int64_t tiles = (tokens + kTile - 1) / kTile;
  std::vector<Visible> spans(tiles);
  std::vector<int64_t> order(tiles), cost(tiles);
  for (int64_t tile = 0; tile < tiles; ++tile) {
    Visible u{INT64_MAX, 0, INT64_MAX, 0};
    for (int64_t t = tile * kTile; t < std::min(tokens, (tile + 1) * kTile); ++t) {
      const Visible& w = visible[t];
      if (w.ctx_end > w.ctx_begin)
        u.ctx_begin = std::min(u.ctx_begin, w.ctx_begin),
        u.ctx_end = std::max(u.ctx_end, w.ctx_end);
      if (w.own_end > w.own_begin)
        u.own_begin = std::min(u.own_begin, w.own_begin),
        u.own_end = std::max(u.own_end, w.own_end);
    }
    spans[tile] = u;
    cost[tile] = std::max<int64_t>(0, u.ctx_end - u.ctx_begin) +
                 std::max<int64_t>(0, u.own_end - u.own_begin);
    order[tile] = tile;
  }
  std::stable_sort(order.begin(), order.end(),
                   [&](int64_t a, int64_t b) { return cost[a] > cost[b]; });
  const int64_t items = tiles * kv_heads;
  std::atomic<int64_t> next{0};
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    const int64_t vectors = kTile * group;  // query vectors of a work item: token-major
    thread_local std::vector<float> qf, acc, s, kt, vf;
    thread_local std::vector<Running> run;
    qf.resize(vectors * d), acc.resize(vectors * d), s.resize((vectors + 1) * kChunk);
    kt.resize(d * kChunk), vf.resize(kChunk * d), run.resize(vectors);
    const P* kc[kChunk];
    const P* vc[kChunk];
    const T* kn[kChunk];
    const T* vn[kChunk];
    for (int64_t item; (item = next.fetch_add(1)) < items;) {
      const int64_t tile = order[item / kv_heads], h = item % kv_heads;
      const int64_t t0 = tile * kTile, nt = std::min(kTile, tokens - t0), nv = nt * group;
      const Visible& u = spans[tile];
      for (int64_t t = 0; t < nt; ++t)
        for (int64_t g = 0; g < group; ++g) {
          const T* src = qp + ((t0 + t) * heads + h * group + g) * d;
          float* dst = &qf[(t * group + g) * d];
          for (int64_t c = 0; c < d; ++c) dst[c] = static_cast<float>(src[c]) * scale;
        }
      std::fill(acc.begin(), acc.begin() + nv * d, 0.f);
      for (int64_t v = 0; v < nv; ++v) run[v] = {kNegInf, 0.f};
      // The chunks: cached keys first (part 0), then the step's own (part 1).
      for (int part = 0; part < 2; ++part) {
        const int64_t lo = part == 0 ? u.ctx_begin : u.own_begin;
        const int64_t hi = part == 0 ? u.ctx_end : u.own_end;
        for (int64_t j0 = lo; j0 < hi; j0 += kChunk) {
          const int64_t n = std::min(kChunk, hi - j0);
          if (part == 0) {
            for (int64_t j = 0; j < n; ++j) {
              const int64_t p = j0 + j;
              const int64_t slot = ids[p / block_size] * block_size + p % block_size;
              const int64_t at = slot * token_stride + h * d;
              kc[j] = kp + at, vc[j] = vp + at;
            }
            widen_chunk<P>(kc, vc, n, d, k_scale, v_scale, kt.data(), vf.data());
          } else {
            for (int64_t j = 0; j < n; ++j) {
              const int64_t at = (j0 + j) * token_stride + h * d;
              kn[j] = knp + at, vn[j] = vnp + at;
            }
            widen_chunk<T>(kn, vn, n, d, 1.f, 1.f, kt.data(), vf.data());
          }
          for (int64_t v = 0; v < nv; v += 2)  // an odd last vector pairs with a scratch row
            scores2(&qf[v * d], &qf[std::min(v + 1, nv - 1) * d], kt.data(), d, &s[v * kChunk],
                    &s[(v + 1 < nv ? v + 1 : vectors) * kChunk]);
          for (int64_t v = 0; v < nv; ++v) {
            const Visible& w = visible[t0 + v / group];
            const int64_t b = part == 0 ? w.ctx_begin : w.own_begin;
            const int64_t e = part == 0 ? w.ctx_end : w.own_end;
            const int64_t a = std::max(b, j0) - j0, z = std::min(e, j0 + n) - j0;
            if (a < z) fold(&s[v * kChunk], a, z, vf.data(), d, run[v], &acc[v * d]);
          }
        }
      }
      for (int64_t v = 0; v < nv; ++v) {
        const int64_t t = v / group, g = v % group;
        const float inv = run[v].total > 0.f ? 1.f / run[v].total : 0.f;
        T* dst = op + ((t0 + t) * heads + h * group + g) * d;
        for (int64_t c = 0; c < d; ++c) dst[c] = static_cast<T>(acc[v * d + c] * inv);
      }
    }
  });
}

// Each token's two ranges, read off its mask row; a row of another form is refused.
std::vector<Visible> visible_ranges(const at::Tensor& mask, int64_t num_ctx) {
  const int64_t tokens = mask.size(0), width = mask.size(1);
  const uint8_t* m = reinterpret_cast<const uint8_t*>(mask.data_ptr<bool>());
  std::vector<Visible> visible(tokens);
  std::atomic<int64_t> bad{-1};
  at::parallel_for(0, tokens, 64, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const uint8_t* row = m + t * width;
      Visible& w = visible[t];
      if (!one_range(row, num_ctx, w.ctx_begin, w.ctx_end) ||
          !one_range(row + num_ctx, width - num_ctx, w.own_begin, w.own_end))
        bad.store(t);
    }
  });
  TORCH_CHECK(bad.load() < 0, "prefill_attention: token ", bad.load(),
              " does not see one range of cached keys and one range of new keys");
  return visible;
}

at::Tensor prefill_attention(const at::Tensor& q, const at::Tensor& k_new,
                             const at::Tensor& v_new, const at::Tensor& k_pool,
                             const at::Tensor& v_pool, const at::Tensor& block_ids,
                             const at::Tensor& mask, const at::Tensor& k_scale,
                             const at::Tensor& v_scale) {
  TORCH_CHECK(q.dim() == 3 && k_new.dim() == 3 && k_pool.dim() == 4,
              "prefill_attention: q [tokens, heads, d], k_new [tokens, kv, d], "
              "pools [n, bs, kv, d]");
  TORCH_CHECK(q.size(1) % k_new.size(1) == 0, "prefill_attention: heads % kv_heads != 0");
  TORCH_CHECK(q.size(2) % 8 == 0, "prefill_attention: head size a multiple of 8, got ", q.size(2));
  TORCH_CHECK(k_new.size(0) == q.size(0) && v_new.sizes() == k_new.sizes(),
              "prefill_attention: q, k_new and v_new of the same tokens");
  TORCH_CHECK(block_ids.scalar_type() == at::kLong && block_ids.dim() == 1,
              "prefill_attention: int64 block ids [ctx_blocks]");
  const int64_t num_ctx = block_ids.size(0) * k_pool.size(1);
  TORCH_CHECK(mask.scalar_type() == at::kBool && mask.dim() == 2 && mask.size(0) == q.size(0) &&
                  mask.size(1) == num_ctx + q.size(0),
              "prefill_attention: bool mask [tokens, ctx_blocks * block_size + tokens]");
  const at::Tensor qc = q.contiguous(), kn = k_new.contiguous(), vn = v_new.contiguous();
  const at::Tensor kp = k_pool.contiguous(), vp = v_pool.contiguous();
  const at::Tensor ids = block_ids.contiguous();
  const std::vector<Visible> visible = visible_ranges(mask.contiguous(), num_ctx);
  const float ks = vllm_aot::one_float(k_scale, "prefill_attention", "k_scale");
  const float vs = vllm_aot::one_float(v_scale, "prefill_attention", "v_scale");
  at::Tensor out = at::empty({q.size(0), q.size(1) * q.size(2)}, q.options());
  vllm_aot::with_element_types(qc, kp, vp, "prefill_attention", [&](auto model, auto element) {
    attend<decltype(model), decltype(element)>(qc, kn, vn, kp, vp, ids, visible, ks, vs, out);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(vllm_aot, m) {
  m.def(
      "prefill_attention(Tensor q, Tensor k_new, Tensor v_new, Tensor k_pool, Tensor v_pool, "
      "Tensor block_ids, Tensor mask, Tensor k_scale, Tensor v_scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(vllm_aot, CPU, m) { m.impl("prefill_attention", &prefill_attention); }

// The shape function export's fake tensors run: q [tokens, heads, d] -> [tokens, heads * d].
TORCH_LIBRARY_IMPL(vllm_aot, Meta, m) {
  m.impl("prefill_attention",
         [](const at::Tensor& q, const at::Tensor&, const at::Tensor&, const at::Tensor&,
            const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
            const at::Tensor&) {
           return at::empty_symint({q.sym_size(0), q.sym_size(1) * q.sym_size(2)}, q.options());
         });
}
