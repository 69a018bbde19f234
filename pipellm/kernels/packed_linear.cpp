// y = x W^T + b in float32, with W packed once into column panels: the GEMM pipellm's linear
// layers run on the CPU (AVX2 + FMA) where the kernels build.
//
// Why a kernel of our own: a decode step multiplies a few rows by every weight of the model,
// so it is bound by streaming the weights from memory. oneDNN and MKL reach about half the
// machine's read bandwidth there (measured, docs/performance.md). Here each thread streams
// its own contiguous run of panels front to back, prefetching ahead, and applies every row
// of x to a weight while it is in cache. The same loops, blocked for the caches, serve
// prefill-sized x as fast as MKL does.
//
// Layout: packed[p, k, j] = W[16 p + j, k], zero-padded to a multiple of 16 rows of W.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include "kernel_library.h"
#include "kernel_ops.h"

#include <immintrin.h>

#include "gemm_microkernel.h"
#include "panel_output.h"

#include <algorithm>
#include <cstring>
#include <optional>

namespace {

using pipellm_kernels::kPanel;
using pipellm_kernels::kRowBlock;
using pipellm_kernels::kRows;
using pipellm_kernels::PanelOutput;
// Above kRowsBlock rows, x is taken kRowsBlock rows by kDepthBlock columns at a time, so that
// its block stays in L2 and a panel's slice in L1 while every row block uses it.
constexpr int64_t kRowsBlock = 48;
constexpr int64_t kDepthBlock = 256;
constexpr int64_t kPrefetchPanels = 4;  // how far ahead the first row block prefetches

}  // namespace

at::Tensor pipellm_ops::pack_linear_weight(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kFloat && weight.device().is_cpu(),
              "pack_linear_weight: a 2-D float32 CPU weight [out_features, in_features]");
  const int64_t n = weight.size(0), k = weight.size(1);
  const int64_t panels = (n + kPanel - 1) / kPanel;
  at::Tensor padded = at::zeros({panels * kPanel, k}, weight.options());
  padded.narrow(0, 0, n).copy_(weight);
  return padded.view({panels, kPanel, k}).transpose(1, 2).contiguous();
}

at::Tensor pipellm_ops::packed_linear(const at::Tensor& input, const at::Tensor& packed,
                                      const std::optional<at::Tensor>& bias, int64_t out_features) {
  TORCH_CHECK(input.scalar_type() == at::kFloat && input.device().is_cpu() && input.dim() == 2,
              "packed_linear: x must be a 2-D float32 CPU tensor");
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == kPanel && packed.is_contiguous() &&
                  packed.size(1) == input.size(1),
              "packed_linear: weight not packed by pack_linear_weight for this in_features");
  const int64_t panels = packed.size(0), m = input.size(0), depth = input.size(1);
  const at::Tensor x = input.contiguous();
  PanelOutput y(m, out_features, panels, bias, x.options());
  if (y.empty()) return y.finish();
  const float* xp = x.data_ptr<float>();
  const float* wp = packed.data_ptr<float>();
  const int64_t rows_block = m <= 64 ? m : kRowsBlock;
  const int64_t depth_block = m <= 64 ? depth : kDepthBlock;
  at::parallel_for(0, panels, 1, [&](int64_t first, int64_t last) {
    for (int64_t m0 = 0; m0 < m; m0 += rows_block) {
      const int64_t m1 = std::min(m, m0 + rows_block);
      for (int64_t k0 = 0; k0 < depth; k0 += depth_block) {
        const int64_t k1 = std::min(depth, k0 + depth_block);
        for (int64_t p = first; p < last; ++p) {
          const float* panel = wp + p * depth * kPanel;
          float* dst = y.dst(p);
          const int64_t ld = y.ld(p);
          const float* ahead =
              wp + std::min(p + kPrefetchPanels, panels - 1) * depth * kPanel;
          for (int64_t r = m0; r < m1; r += kRows) {
            const int64_t rows = std::min(kRows, m1 - r);
            kRowBlock[rows](xp + r * depth, depth, panel, k0, k1, dst + r * ld, ld, k0 > 0,
                            y.bias(p), r == m0 ? ahead : nullptr);
          }
        }
      }
    }
  });
  return y.finish();
}

PIPELLM_LIBRARY_FRAGMENT(m) {
  m.def("pack_linear_weight(Tensor weight) -> Tensor", &pipellm_ops::pack_linear_weight);
  m.def("packed_linear(Tensor x, Tensor packed, Tensor? bias, int out_features) -> Tensor",
        &pipellm_ops::packed_linear);
}
