// The sampler's draw in one op: a token per row of logits, the maths of `runtime.sampler`'s
// `draw_tokens` (the reference) without its [rows, vocab] intermediates.
//
// Per row: the vocabulary bitmask read a word at a time; greedy rows (top_k 1, or every row of a
// greedy head) take the first largest allowed logit. Sampled rows: the softmax of logits /
// temperature over the allowed tokens (max, then exp8 and the sum, then the probabilities in a
// row buffer); the threshold a kept token's probability must reach (top-k and top-p decided among
// the `num_candidates` most probable, kept in a heap only when the row truncates;
// min-p against the largest); then the exponential race over the kept tokens: argmax of
// p / -ln(u), u the counter-based uniform of (seed, position, token id), hashed in 32-bit lanes
// eight at a time and only for blocks with a kept token. The reference does the same in int64
// tensors over the whole vocabulary for every row (see docs/benchmarks.md#head-kernels). The
// uniforms are bit for bit the reference's; exp and ln
// are within ~2 ulp of torch's, so a draw can differ only where two tokens' scores tie to that
// precision.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <vector>

#include "avx2.h"

namespace {

using vllm_aot::exp8;
using vllm_aot::log8;

constexpr uint32_t kMix = 0x45D9F3B;  // the reference's `_MIX`
constexpr float kInf = std::numeric_limits<float>::infinity();

uint32_t mix32(uint32_t x) {
  x = ((x >> 16) ^ x) * kMix;
  x = ((x >> 16) ^ x) * kMix;
  return (x >> 16) ^ x;
}

__m256i mix32x8(__m256i x) {
  const __m256i mix = _mm256_set1_epi32(static_cast<int>(kMix));
  x = _mm256_mullo_epi32(_mm256_xor_si256(_mm256_srli_epi32(x, 16), x), mix);
  x = _mm256_mullo_epi32(_mm256_xor_si256(_mm256_srli_epi32(x, 16), x), mix);
  return _mm256_xor_si256(_mm256_srli_epi32(x, 16), x);
}

// The reference's per-row hash of (seed, position): `seeded_uniform`'s `row`.
uint32_t row_hash(int64_t seed, int64_t position) {
  const uint64_t s = static_cast<uint64_t>(seed);
  const uint32_t seed_hash =
      mix32(static_cast<uint32_t>(s)) ^ mix32(static_cast<uint32_t>(s >> 32) ^ 0x9E3779B9u);
  return mix32(seed_hash ^ mix32(static_cast<uint32_t>(static_cast<uint64_t>(position))));
}

// Lanes of tokens [i, i + 8) the bitmask allows, as an all-ones/zero mask per lane.
__m256 allowed8(const int32_t* mask, int64_t i) {
  const uint32_t bits = static_cast<uint32_t>(mask[i >> 5]) >> (i & 31);
  const __m256i lane_bit = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
  const __m256i set = _mm256_and_si256(_mm256_set1_epi32(static_cast<int>(bits & 0xff)), lane_bit);
  return _mm256_castsi256_ps(_mm256_cmpeq_epi32(set, lane_bit));
}

bool allowed1(const int32_t* mask, int64_t i) {
  return (static_cast<uint32_t>(mask[i >> 5]) >> (i & 31)) & 1;
}

// Running argmax over lanes: the largest value, the first index among equals (torch's argmax).
struct ArgMax {
  __m256 best = _mm256_set1_ps(-kInf);
  __m256i at = _mm256_setzero_si256();

  void offer(__m256 value, int64_t i) {
    const __m256 better = _mm256_cmp_ps(value, best, _CMP_GT_OQ);
    best = _mm256_blendv_ps(best, value, better);
    const __m256i idx = _mm256_add_epi32(_mm256_set1_epi32(static_cast<int>(i)),
                                         _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    at = _mm256_castps_si256(
        _mm256_blendv_ps(_mm256_castsi256_ps(at), _mm256_castsi256_ps(idx), better));
  }

  // The winner's index across lanes and the scalar tail [from, v) of `value(i)`.
  template <typename F>
  int64_t result(int64_t from, int64_t v, F value) const {
    alignas(32) float b[8];
    alignas(32) int32_t a[8];
    _mm256_store_ps(b, best);
    _mm256_store_si256(reinterpret_cast<__m256i*>(a), at);
    float top = -kInf;
    int64_t arg = 0;
    for (int lane = 0; lane < 8; ++lane)
      if (b[lane] > top || (b[lane] == top && a[lane] < arg)) {
        top = b[lane];
        arg = a[lane];
      }
    for (int64_t i = from; i < v; ++i) {
      const float x = value(i);
      if (x > top) {
        top = x;
        arg = i;
      }
    }
    return arg;
  }
};

int64_t greedy_token(const float* x, const int32_t* mask, int64_t v) {
  ArgMax am;
  int64_t i = 0;
  for (; i + 8 <= v; i += 8)
    am.offer(_mm256_blendv_ps(_mm256_set1_ps(-kInf), _mm256_loadu_ps(x + i), allowed8(mask, i)),
             i);
  return am.result(i, v, [&](int64_t j) { return allowed1(mask, j) ? x[j] : -kInf; });
}

struct RowParams {
  float temperature, top_p, min_p;
  int64_t top_k;
  uint32_t hash;
};

// probs[i] = softmax(x / temperature) over the allowed tokens (0 elsewhere); returns the largest.
float softmax_into(const float* x, const int32_t* mask, int64_t v, float temperature,
                   float* probs) {
  const __m256 t = _mm256_set1_ps(temperature);
  __m256 m = _mm256_set1_ps(-kInf);
  int64_t i = 0;
  for (; i + 8 <= v; i += 8) {
    const __m256 y = _mm256_div_ps(_mm256_loadu_ps(x + i), t);
    m = _mm256_max_ps(m, _mm256_blendv_ps(_mm256_set1_ps(-kInf), y, allowed8(mask, i)));
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, m);
  float top = *std::max_element(lanes, lanes + 8);
  for (int64_t j = i; j < v; ++j)
    if (allowed1(mask, j)) top = std::max(top, x[j] / temperature);
  if (top == -kInf) {  // nothing allowed: every probability 0
    std::fill(probs, probs + v, 0.f);
    return 0.f;
  }
  const __m256 tv = _mm256_set1_ps(top);
  __m256 s = _mm256_setzero_ps();
  for (i = 0; i + 8 <= v; i += 8) {
    const __m256 e = _mm256_and_ps(
        exp8(_mm256_sub_ps(_mm256_div_ps(_mm256_loadu_ps(x + i), t), tv)), allowed8(mask, i));
    _mm256_storeu_ps(probs + i, e);
    s = _mm256_add_ps(s, e);
  }
  float total = vllm_aot::sum8(s);
  for (int64_t j = i; j < v; ++j) {
    probs[j] = allowed1(mask, j) ? std::exp(x[j] / temperature - top) : 0.f;
    total += probs[j];
  }
  const __m256 sv = _mm256_set1_ps(total);
  for (i = 0; i + 8 <= v; i += 8)
    _mm256_storeu_ps(probs + i, _mm256_div_ps(_mm256_loadu_ps(probs + i), sv));
  for (int64_t j = i; j < v; ++j) probs[j] /= total;
  return 1.f / total;
}

// The `n` largest of probs, descending, into `top` (a min-heap while it fills; a block of eight
// none of which beats its smallest is one comparison).
void largest_into(const float* probs, int64_t v, int64_t n, std::vector<float>& top) {
  top.clear();
  auto offer = [&](float p) {
    if (static_cast<int64_t>(top.size()) < n) {
      top.push_back(p);
      std::push_heap(top.begin(), top.end(), std::greater<float>());
    } else if (p > top.front()) {
      std::pop_heap(top.begin(), top.end(), std::greater<float>());
      top.back() = p;
      std::push_heap(top.begin(), top.end(), std::greater<float>());
    }
  };
  int64_t i = 0;
  for (; i + 8 <= v; i += 8) {
    if (static_cast<int64_t>(top.size()) == n) {
      const __m256 above = _mm256_cmp_ps(_mm256_loadu_ps(probs + i), _mm256_set1_ps(top.front()),
                                         _CMP_GT_OQ);
      if (_mm256_movemask_ps(above) == 0) continue;
    }
    for (int lane = 0; lane < 8; ++lane) offer(probs[i + lane]);
  }
  for (; i < v; ++i) offer(probs[i]);
  std::sort_heap(top.begin(), top.end(), std::greater<float>());
}

// The probability a kept token must reach: top-k and top-p among the `candidates` most probable
// (exactly as the reference: an inclusive cumulative sum minus each candidate, counted), min-p
// against the largest.
float keep_threshold(const float* probs, int64_t v, float largest, const RowParams& p,
                     int64_t candidates, std::vector<float>& top) {
  float threshold = 0.f;
  if (p.top_k > 0 || p.top_p < 1.f) {
    largest_into(probs, v, candidates, top);
    const int64_t top_k = p.top_k > 0 ? std::min(p.top_k, candidates) : candidates;
    float mass = 0.f;
    int64_t kept = 0;
    for (int64_t r = 0; r < candidates; ++r) {
      mass += top[r];
      kept += r < top_k && (mass - top[r]) < p.top_p;
    }
    threshold = top[std::max<int64_t>(kept, 1) - 1];
  }
  return std::max(threshold, p.min_p * largest);
}

// The exponential race over the allowed tokens whose probability reaches `threshold`.
int64_t race(const float* probs, const int32_t* mask, int64_t v, float threshold, uint32_t hash) {
  ArgMax am;
  am.best = _mm256_set1_ps(-1.f);  // the reference's score of a token not kept
  const __m256 thr = _mm256_set1_ps(threshold);
  const __m256i row = _mm256_set1_epi32(static_cast<int>(hash));
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256 half = _mm256_set1_ps(0.5f), scale = _mm256_set1_ps(1.f / (1 << 24));
  int64_t i = 0;
  for (; i + 8 <= v; i += 8) {
    const __m256 p = _mm256_loadu_ps(probs + i);
    const __m256 keep = _mm256_and_ps(_mm256_cmp_ps(p, thr, _CMP_GE_OQ), allowed8(mask, i));
    if (_mm256_movemask_ps(keep) == 0) continue;
    const __m256i h = mix32x8(
        _mm256_xor_si256(row, _mm256_add_epi32(_mm256_set1_epi32(static_cast<int>(i)), lane)));
    const __m256 u =
        _mm256_mul_ps(_mm256_add_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(h, 8)), half), scale);
    const __m256 score =
        _mm256_div_ps(p, _mm256_sub_ps(_mm256_setzero_ps(), log8(u)));
    am.offer(_mm256_blendv_ps(_mm256_set1_ps(-1.f), score, keep), i);
  }
  auto tail = [&](int64_t j) {
    if (!(allowed1(mask, j) && probs[j] >= threshold)) return -1.f;
    const uint32_t h = mix32(hash ^ static_cast<uint32_t>(j));
    const float u = (static_cast<float>(h >> 8) + 0.5f) * (1.f / (1 << 24));
    return probs[j] / -std::log(u);
  };
  return am.result(i, v, tail);
}

at::Tensor sample_tokens(const at::Tensor& logits, const at::Tensor& vocab_mask,
                         const at::Tensor& temperature, const at::Tensor& top_k,
                         const at::Tensor& top_p, const at::Tensor& min_p, const at::Tensor& seeds,
                         const at::Tensor& positions, int64_t num_candidates, bool is_greedy) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat,
              "sample_tokens: float32 logits [rows, vocab]");
  const int64_t rows = logits.size(0), v = logits.size(1);
  TORCH_CHECK(vocab_mask.dim() == 2 && vocab_mask.size(0) == rows &&
                  vocab_mask.size(1) == (v + 31) / 32 && vocab_mask.scalar_type() == at::kInt,
              "sample_tokens: int32 vocab_mask [rows, ceil(vocab / 32)]");
  auto check_row = [&](const at::Tensor& t, at::ScalarType dtype, const char* name) {
    TORCH_CHECK(t.dim() == 1 && t.size(0) == rows && t.scalar_type() == dtype, "sample_tokens: ",
                name, " must be [rows] ", c10::toString(dtype));
    return t.contiguous();
  };
  const at::Tensor temp = check_row(temperature, at::kFloat, "temperature"),
                   tk = check_row(top_k, at::kLong, "top_k"),
                   tp = check_row(top_p, at::kFloat, "top_p"),
                   mp = check_row(min_p, at::kFloat, "min_p"),
                   sd = check_row(seeds, at::kLong, "seeds"),
                   pos = check_row(positions, at::kLong, "positions");
  TORCH_CHECK(num_candidates >= 1, "sample_tokens: num_candidates must be >= 1, got ",
              num_candidates);
  const int64_t candidates = std::min(num_candidates, v);
  const at::Tensor x = logits.contiguous(), mask = vocab_mask.contiguous();
  at::Tensor tokens = at::empty({rows}, tk.options());
  const float* xp = x.data_ptr<float>();
  const int32_t* mk = mask.data_ptr<int32_t>();
  int64_t* out = tokens.data_ptr<int64_t>();
  const int64_t words = mask.size(1);
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> probs, scratch;
    for (int64_t r = begin; r < end; ++r) {
      const float* row = xp + r * v;
      const int32_t* row_mask = mk + r * words;
      const RowParams p{temp.data_ptr<float>()[r], tp.data_ptr<float>()[r],
                        mp.data_ptr<float>()[r], tk.data_ptr<int64_t>()[r],
                        row_hash(sd.data_ptr<int64_t>()[r], pos.data_ptr<int64_t>()[r])};
      if (is_greedy || p.top_k == 1) {
        out[r] = greedy_token(row, row_mask, v);
        continue;
      }
      probs.resize(v);
      const float largest = softmax_into(row, row_mask, v, p.temperature, probs.data());
      const float threshold = keep_threshold(probs.data(), v, largest, p, candidates, scratch);
      out[r] = race(probs.data(), row_mask, v, threshold, p.hash);
    }
  });
  return tokens;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(vllm_aot, m) {
  m.def(
      "sample_tokens(Tensor logits, Tensor vocab_mask, Tensor temperature, Tensor top_k, "
      "Tensor top_p, Tensor min_p, Tensor seeds, Tensor positions, int num_candidates, "
      "bool is_greedy) -> Tensor");
}

TORCH_LIBRARY_IMPL(vllm_aot, CPU, m) { m.impl("sample_tokens", &sample_tokens); }

// The shape function export's fake tensors run.
TORCH_LIBRARY_IMPL(vllm_aot, Meta, m) {
  m.impl("sample_tokens",
         [](const at::Tensor& logits, const at::Tensor&, const at::Tensor&,
            const at::Tensor& top_k, const at::Tensor&, const at::Tensor&, const at::Tensor&,
            const at::Tensor&, int64_t, bool) {
           return at::empty_symint({logits.sym_size(0)}, top_k.options());
         });
}
