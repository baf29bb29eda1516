// What the sampler reports about each row's raw logits, in one op: the sampled token's logprob,
// its rank and the top-n logprobs with their token ids (vLLM's raw logprobs).
//
// Per row, three passes over the vocabulary: the largest logit; the sum of exp(x - max), eight
// at a time (`exp8`); then the rank (how many logits are at least the token's) and the n largest
// logits, kept sorted in a small array that a logit enters only when it beats the smallest kept
// (eight compared at once against it, so almost every block of eight is one comparison). The
// logprobs are (x - max) - log(sum), as log_softmax computes them. torch's version (the sampler's
// reference) materialises the [rows, vocab] logprobs and sorts for topk (see
// docs/benchmarks.md#head-kernels). Equal logits keep the lower id first.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <tuple>
#include <vector>

#include "avx2.h"

namespace {

using vllm_aot::exp8;
using vllm_aot::sum8;

float row_max(const float* x, int64_t v) {
  __m256 m = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  int64_t i = 0;
  for (; i + 8 <= v; i += 8) m = _mm256_max_ps(m, _mm256_loadu_ps(x + i));
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, m);
  float top = *std::max_element(lanes, lanes + 8);
  for (; i < v; ++i) top = std::max(top, x[i]);
  return top;
}

float row_sum_exp(const float* x, int64_t v, float top) {
  const __m256 t = _mm256_set1_ps(top);
  __m256 s = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= v; i += 8) s = _mm256_add_ps(s, exp8(_mm256_sub_ps(_mm256_loadu_ps(x + i), t)));
  float total = sum8(s);
  for (; i < v; ++i) total += std::exp(x[i] - top);
  return total;
}

// The n largest of x (descending, lower id first among equals) into ids/values; the count of
// x[i] >= token_logit into *rank.
void rank_and_top(const float* x, int64_t v, float token_logit, int64_t n, int64_t* ids,
                  float* values, int64_t* rank) {
  int64_t kept = 0;
  auto offer = [&](int64_t i) {
    if (kept == n && !(x[i] > values[n - 1])) return;
    int64_t at = kept < n ? kept++ : n - 1;  // the slot the new one starts in
    while (at > 0 && x[i] > values[at - 1]) {
      values[at] = values[at - 1];
      ids[at] = ids[at - 1];
      --at;
    }
    values[at] = x[i];
    ids[at] = i;
  };
  const __m256 tok = _mm256_set1_ps(token_logit);
  int64_t count = 0, i = 0;
  for (; i + 8 <= v; i += 8) {
    const __m256 block = _mm256_loadu_ps(x + i);
    count += __builtin_popcount(_mm256_movemask_ps(_mm256_cmp_ps(block, tok, _CMP_GE_OQ)));
    const float floor = kept == n ? values[n - 1] : -std::numeric_limits<float>::infinity();
    const int above = kept < n ? 0xff
                               : _mm256_movemask_ps(_mm256_cmp_ps(block, _mm256_set1_ps(floor),
                                                                  _CMP_GT_OQ));
    for (int lane = 0; lane < 8; ++lane)
      if (above >> lane & 1) offer(i + lane);
  }
  for (; i < v; ++i) {
    count += x[i] >= token_logit;
    offer(i);
  }
  *rank = count;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> logprob_stats(
    const at::Tensor& logits, const at::Tensor& tokens, int64_t n) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat,
              "logprob_stats: float32 logits [rows, vocab]");
  TORCH_CHECK(tokens.dim() == 1 && tokens.size(0) == logits.size(0) &&
                  tokens.scalar_type() == at::kLong,
              "logprob_stats: int64 tokens [rows]");
  const int64_t rows = logits.size(0), v = logits.size(1);
  TORCH_CHECK(n >= 1 && n <= v, "logprob_stats: n must be in [1, vocab], got ", n);
  const at::Tensor x = logits.contiguous(), tok = tokens.contiguous();
  at::Tensor token_logprobs = at::empty({rows}, x.options());
  at::Tensor ranks = at::empty({rows}, tok.options());
  at::Tensor top_logprobs = at::empty({rows, n}, x.options());
  at::Tensor top_ids = at::empty({rows, n}, tok.options());
  const float* xp = x.data_ptr<float>();
  const int64_t* tp = tok.data_ptr<int64_t>();
  float* lp = token_logprobs.data_ptr<float>();
  int64_t* rp = ranks.data_ptr<int64_t>();
  float* top_lp = top_logprobs.data_ptr<float>();
  int64_t* top_id = top_ids.data_ptr<int64_t>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> values(n);
    for (int64_t r = begin; r < end; ++r) {
      const float* row = xp + r * v;
      const int64_t token = tp[r];
      TORCH_CHECK(token >= 0 && token < v, "logprob_stats: token ", token, " outside [0, ", v,
                  ")");
      const float top = row_max(row, v);
      const float log_sum = std::log(row_sum_exp(row, v, top));
      lp[r] = (row[token] - top) - log_sum;
      rank_and_top(row, v, row[token], n, top_id + r * n, values.data(), rp + r);
      for (int64_t j = 0; j < n; ++j) top_lp[r * n + j] = (values[j] - top) - log_sum;
    }
  });
  return {token_logprobs, ranks, top_logprobs, top_ids};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(vllm_aot, m) {
  m.def(
      "logprob_stats(Tensor logits, Tensor tokens, int n) -> (Tensor token_logprobs, Tensor ranks, "
      "Tensor top_logprobs, Tensor top_ids)");
}

TORCH_LIBRARY_IMPL(vllm_aot, CPU, m) { m.impl("logprob_stats", &logprob_stats); }

// The shape function export's fake tensors run.
TORCH_LIBRARY_IMPL(vllm_aot, Meta, m) {
  m.impl("logprob_stats", [](const at::Tensor& logits, const at::Tensor& tokens, int64_t n) {
    const auto rows = logits.sym_size(0);
    return std::make_tuple(at::empty_symint({rows}, logits.options()),
                           at::empty_symint({rows}, tokens.options()),
                           at::empty_symint({rows, c10::SymInt(n)}, logits.options()),
                           at::empty_symint({rows, c10::SymInt(n)}, tokens.options()));
  });
}
