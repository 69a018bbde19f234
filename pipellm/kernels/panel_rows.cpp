// Rows of a Q8_0 matrix repacked into 16-row panels, as float32: the token embedding of a model
// whose output head is tied to it (model/gguf_linear.py's GgufEmbedding.share_head), read from
// the head's copy so that the stage holds the table once.
//
// Why a kernel: the lookup in PyTorch took ~10 ATen ops (index, reshape, view, cast, multiply)
// for the one row a decode step needs, ~0.2 ms a token. Each value is q d in float32, as `gguf`
// dequantizes Q8_0 (d q is exact in float32): the same bits.
//
// A panel's record per 32-deep block starts with its 16 columns' float16 scales d; then either
// the exact kernel's quants, byte 16 k + j = column j's q at depth k (quantized_linear.cpp), or
// the int8 kernel's lanes, byte 64 (k / 4) + 4 j + k % 4 = column j's q at depth k, plus 128
// (int8_linear.cpp).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include "kernel_library.h"
#include "kernel_ops.h"

#include "gemm_microkernel.h"

#include <cstdint>
#include <vector>

namespace {

using pipellm_kernels::kPanel;

// A Q8_0 record per panel and 32-deep block: 16 float16 scales, then 32 x 16 quants (either
// layout).
constexpr int64_t kBlock = 32, kRecordBytes = kPanel * 2 + kBlock * kPanel;

// Row `row` of the matrix: `blocks` records of its panel, column row % 16, into out.
void panel_row(const uint8_t* packed, int64_t blocks, int64_t row, bool int8_lanes, float* out) {
  const int64_t column = row % kPanel;
  const uint8_t* record = packed + row / kPanel * blocks * kRecordBytes;
  for (int64_t b = 0; b < blocks; ++b, record += kRecordBytes, out += kBlock) {
    at::Half d;
    __builtin_memcpy(&d, record + 2 * column, 2);
    const float scale = static_cast<float>(d);
    const uint8_t* quants = record + 2 * kPanel;
    for (int64_t k = 0; k < kBlock; ++k) {
      const int q = int8_lanes ? quants[64 * (k / 4) + 4 * column + k % 4] - 128
                               : static_cast<int8_t>(quants[kPanel * k + column]);
      out[k] = static_cast<float>(q) * scale;
    }
  }
}

}  // namespace

// ids: any shape, int64 in [0, rows); packed: [panels, blocks, 544] uint8 with rows <= 16
// panels. Returns float32 [*ids.shape, 32 blocks].
at::Tensor pipellm_ops::q8_0_panel_rows(const at::Tensor& ids, const at::Tensor& packed,
                                        bool int8_lanes, int64_t rows) {
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.dim() == 3 && packed.is_contiguous() &&
                  packed.size(2) == kRecordBytes,
              "q8_0_panel_rows: packed must be a contiguous uint8 [panels, blocks, ", kRecordBytes,
              "] Q8_0 weight");
  TORCH_CHECK(rows > 0 && rows <= packed.size(0) * kPanel,
              "q8_0_panel_rows: ", rows, " rows do not fit ", packed.size(0), " panels");
  const int64_t blocks = packed.size(1), hidden = blocks * kBlock;
  const at::Tensor flat = ids.reshape({-1}).to(at::kLong).contiguous();
  const int64_t n = flat.numel();
  const int64_t* id = flat.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i)
    TORCH_CHECK(id[i] >= 0 && id[i] < rows, "q8_0_panel_rows: token id ", id[i],
                " is outside the table's ", rows, " rows");
  std::vector<int64_t> sizes(ids.sizes().begin(), ids.sizes().end());
  sizes.push_back(hidden);
  at::Tensor out = at::empty({n, hidden}, at::TensorOptions().dtype(at::kFloat));
  const uint8_t* base = packed.data_ptr<uint8_t>();
  float* dst = out.data_ptr<float>();
  at::parallel_for(0, n, 8, [&](int64_t first, int64_t last) {
    for (int64_t i = first; i < last; ++i)
      panel_row(base, blocks, id[i], int8_lanes, dst + i * hidden);
  });
  return out.view(sizes);
}

PIPELLM_LIBRARY_FRAGMENT(m) {
  m.def("q8_0_panel_rows(Tensor ids, Tensor packed, bool int8_lanes, int rows) -> Tensor",
        &pipellm_ops::q8_0_panel_rows);
}
