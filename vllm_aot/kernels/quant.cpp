// The quantised linears' shared driver (`quant.h`): instruction-set choice, the path by rows (the
// dequantise-and-GEMM one for many rows) and the `quant_isa` op.
#include "quant.h"

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/mm.h>
#include <c10/util/Exception.h>
#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <torch/library.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <string>
#include <vector>


namespace vllm_aot::quant {
namespace {

constexpr int64_t kChunkBytes = 4 << 20;  // dequantised weight rows per GEMM call

bool has_avx512() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
}

Isa choose_isa() {
  const char* forced = std::getenv("VLLM_AOT_KERNEL_ISA");
  const std::string cap = forced ? forced : "";
  TORCH_CHECK(cap.empty() || cap == "auto" || cap == "avx2" || cap == "avx512" ||
                  cap == "avx512_vnni",
              "VLLM_AOT_KERNEL_ISA=", cap,
              " is not supported; supported: auto (the default), avx2, avx512, avx512_vnni");
  if (cap == "avx2" || !has_avx512()) return Isa::kAvx2;
  if (cap == "avx512" || !__builtin_cpu_supports("avx512vnni")) return Isa::kAvx512;
  if (cap == "avx512_vnni" || !amx::available()) return Isa::kAvx512Vnni;
  return Isa::kAmx;
}

// Many rows: chunks of weight rows dequantised (in parallel) into a buffer and multiplied by
// aten's GEMM (in parallel) into out's columns. Chunks are large: each GEMM call has a fixed
// cost (see docs/benchmarks.md#direct-kernels-by-rows).
void dequantized_linear(const at::Tensor& x, const Weights& w, const Format& format, Isa chosen,
                        at::Tensor& out) {
  const bool bf16 = x.scalar_type() == at::kBFloat16 && chosen >= Isa::kAvx512Vnni &&
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

// AMX with bfloat16 tiles (and the AVX-512 BF16 conversions the kernel uses), and Linux let this
// process use the tile state.
bool request_tiles() {
  unsigned a, b, c, d;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
  const bool amx = (d & (1u << 22)) && (d & (1u << 24));  // AMX-BF16, AMX-TILE
  if (!amx || !__get_cpuid_count(7, 1, &a, &b, &c, &d) || !(a & (1u << 5))) return false;
  constexpr long kRequestPermission = 0x1023, kTileData = 18;  // ARCH_REQ_XCOMP_PERM, XTILEDATA
  return syscall(SYS_arch_prctl, kRequestPermission, kTileData) == 0;
}

std::string quant_isa() {
  switch (isa()) {
    case Isa::kAvx2: return "avx2";
    case Isa::kAvx512: return "avx512";
    case Isa::kAvx512Vnni: return "avx512_vnni";
    default: return "amx";
  }
}

}  // namespace

bool amx::available() {
  static const bool granted = request_tiles();
  return granted;
}

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
  // AMX for up to kMaxAmxRows rows of whole blocks, but fewer than kMinAmxRows take the format's
  // VNNI kernel where it has one (it reads the codes as bytes, not widened: q4_0, q4_1).
  const bool vnni_rows =
      m < kMinAmxRows && format.multiply_bf16[static_cast<int>(Isa::kAvx512Vnni)] != nullptr;
  const bool tiles =
      chosen == Isa::kAmx && !vnni_rows && m <= kMaxAmxRows && w.k % kBlock == 0;
  const Isa path = chosen == Isa::kAmx && !tiles ? Isa::kAvx512Vnni : chosen;
  const MultiplyBf16Fn bf16 =
      x2.scalar_type() == at::kBFloat16 ? format.multiply_bf16[static_cast<int>(path)] : nullptr;
  if (tiles && bf16 != nullptr) {
    bf16(w, x2.data_ptr<c10::BFloat16>(), m, out2);
    return out;
  }
  const int64_t direct =
      bf16 != nullptr && chosen == Isa::kAvx2 ? kMaxDirectRowsAvx2Fixed : kMaxDirectRows;
  if (m > direct) {
    dequantized_linear(x2, w, format, chosen, out2);
    return out;
  }
  if (bf16 != nullptr) {
    bf16(w, x2.data_ptr<c10::BFloat16>(), m, out2);
    return out;
  }
  const at::Tensor xf = x2.to(at::kFloat).contiguous();
  format.multiply[chosen == Isa::kAvx2 ? 0 : 1](w, xf.data_ptr<float>(), m, out2);
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

// Which instruction set the quantised linears use on this CPU: "avx512_vnni", "avx512" or "avx2".
TORCH_LIBRARY_FRAGMENT(vllm_aot, m) { m.def("quant_isa() -> str", &vllm_aot::quant::quant_isa); }
