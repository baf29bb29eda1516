// A rank's experts of a sparse MoE block over the tokens routed to them (`moe_experts`), where
// the pure-torch version (`models.layers.moe_experts`, the reference) multiplies every token by
// every expert of the rank to keep its shapes static.
//
// Static shapes outside, dynamic inside: the (token, slot) pairs routed to this rank's experts
// (ids first_expert .. first_expert + experts - 1; the others belong to other ranks and add
// nothing) are counted and grouped by expert in two passes over topk_ids; then, expert by
// expert, only its tokens' rows are gathered, multiplied by its gate|up, SiLU(gate) * up, by its
// down projection, weighted and added into a float32 [tokens, hidden] sum, cast to x's dtype at
// the end. The multiplications are aten's GEMM in float32 and, for bfloat16, our `linear_bf16`
// (weights widened in registers) where the CPU lacks bfloat16 arithmetic, else aten's, as the
// bf16 weight format chooses (`use_linear_bf16`). Each product is parallel inside; experts run
// one after the other.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <cstdint>
#include <cstring>
#include <vector>

namespace {

// x [n, in] @ w [out, in].T
at::Tensor expert_linear(const at::Tensor& x, const at::Tensor& w, bool use_linear_bf16) {
  if (use_linear_bf16 && x.scalar_type() == at::kBFloat16) {
    static const auto op = c10::Dispatcher::singleton()
                               .findSchemaOrThrow("vllm_aot::linear_bf16", "")
                               .typed<at::Tensor(const at::Tensor&, const at::Tensor&)>();
    return op.call(x, w);
  }
  return at::mm(x, w.t());
}

// The (token, weight) pairs of each local expert, grouped: expert e's are
// [offsets[e], offsets[e + 1]).
struct Groups {
  std::vector<int64_t> offsets;
  std::vector<int64_t> tokens;
  std::vector<float> weights;
};

Groups group_by_expert(const at::Tensor& topk_ids, const at::Tensor& topk_weights,
                       int64_t first, int64_t num_experts) {
  const at::Tensor ids = topk_ids.contiguous();
  const at::Tensor wts = topk_weights.to(at::kFloat).contiguous();
  const int64_t* id = ids.data_ptr<int64_t>();
  const float* wt = wts.data_ptr<float>();
  const int64_t top_k = ids.size(1), pairs = ids.numel();
  Groups g;
  g.offsets.assign(num_experts + 1, 0);
  for (int64_t i = 0; i < pairs; ++i) {
    const int64_t e = id[i] - first;
    if (e >= 0 && e < num_experts) ++g.offsets[e + 1];
  }
  for (int64_t e = 0; e < num_experts; ++e) g.offsets[e + 1] += g.offsets[e];
  g.tokens.resize(g.offsets[num_experts]);
  g.weights.resize(g.offsets[num_experts]);
  std::vector<int64_t> cursor(g.offsets.begin(), g.offsets.end() - 1);
  for (int64_t i = 0; i < pairs; ++i) {
    const int64_t e = id[i] - first;
    if (e < 0 || e >= num_experts) continue;
    g.tokens[cursor[e]] = i / top_k;
    g.weights[cursor[e]++] = wt[i];
  }
  return g;
}

at::Tensor moe_experts(const at::Tensor& x, const at::Tensor& topk_ids,
                       const at::Tensor& topk_weights, const at::Tensor& w13, const at::Tensor& w2,
                       const at::Tensor& first_expert, bool use_linear_bf16) {
  TORCH_CHECK(x.dim() == 2 && topk_ids.dim() == 2 && topk_ids.size(0) == x.size(0),
              "moe_experts: x [tokens, hidden], topk_ids [tokens, top_k]");
  TORCH_CHECK(topk_ids.scalar_type() == at::kLong && topk_weights.sizes() == topk_ids.sizes(),
              "moe_experts: topk_ids int64 and topk_weights of its shape");
  TORCH_CHECK(w13.dim() == 3 && w2.dim() == 3 && w13.size(0) == w2.size(0) &&
                  w13.size(2) == x.size(1) && w2.size(1) == x.size(1) &&
                  w13.size(1) == 2 * w2.size(2),
              "moe_experts: w13 [experts, 2 * inter, hidden], w2 [experts, hidden, inter]");
  TORCH_CHECK(w13.scalar_type() == x.scalar_type() && w2.scalar_type() == x.scalar_type(),
              "moe_experts: expert weights of x's dtype");
  const int64_t num_experts = w13.size(0), inter = w2.size(2);
  const Groups g =
      group_by_expert(topk_ids, topk_weights, first_expert.item<int64_t>(), num_experts);
  at::Tensor out = at::zeros({x.size(0), x.size(1)}, x.options().dtype(at::kFloat));
  for (int64_t e = 0; e < num_experts; ++e) {
    const int64_t begin = g.offsets[e], n = g.offsets[e + 1] - begin;
    if (n == 0) continue;
    at::Tensor index = at::empty({n}, x.options().dtype(at::kLong));
    std::memcpy(index.data_ptr<int64_t>(), g.tokens.data() + begin, n * sizeof(int64_t));
    at::Tensor weight = at::empty({n, 1}, x.options().dtype(at::kFloat));
    std::memcpy(weight.data_ptr<float>(), g.weights.data() + begin, n * sizeof(float));
    const at::Tensor gate_up = expert_linear(x.index_select(0, index), w13[e], use_linear_bf16);
    const at::Tensor hidden = at::silu(gate_up.narrow(1, 0, inter)) * gate_up.narrow(1, inter, inter);
    const at::Tensor y = expert_linear(hidden, w2[e], use_linear_bf16);
    out.index_add_(0, index, y.to(at::kFloat) * weight);
  }
  return out.to(x.scalar_type());
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(vllm_aot, m) {
  m.def(
      "moe_experts(Tensor x, Tensor topk_ids, Tensor topk_weights, Tensor w13, Tensor w2, "
      "Tensor first_expert, bool use_linear_bf16) -> Tensor");
}

TORCH_LIBRARY_IMPL(vllm_aot, CPU, m) { m.impl("moe_experts", &moe_experts); }

// The shape function export's fake tensors run: the output is x's shape and dtype.
TORCH_LIBRARY_IMPL(vllm_aot, Meta, m) {
  m.impl("moe_experts", [](const at::Tensor& x, const at::Tensor&, const at::Tensor&,
                           const at::Tensor&, const at::Tensor&, const at::Tensor&,
                           bool) { return at::empty_like(x); });
}
