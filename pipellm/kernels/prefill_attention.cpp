// Causal attention of a prompt chunk, as two GEMMs per query block on the register-blocked
// step of gemm_microkernel.h. The chunk may continue a prompt: `prefix` keys (cached, passed
// before the chunk's own) come first and every query sees them, so a 128-token chunk deep into
// a long prompt runs at the rate of a whole prompt (SDPA with an explicit mask ran it several
// times slower).
//
// Why a kernel of our own: SDPA's CPU flash kernel ran prompt attention at ~28 GFLOP/s here,
// a fifth of the machine's fp32 peak. Each task here is one (KV head, block of 64 queries): it
// packs the keys and values the block can see into 16-wide panels once, then for each query
// head of the GQA group computes scores = q K^T (only the panels at or left of the diagonal),
// an exact masked softmax, and out = P V.
//
// A sliding-window layer (window > 0) lets the query at position p = prefix + r see keys
// (p - window, p] only: a query block
// packs just the keys its rows can see, so its work grows with the window, not the prompt.
//
// A continued chunk reads its context straight from the paged KV cache: with `block_table`,
// k and v are a layer's [num_blocks, block_size, Hkv, D] caches (the chunk's own keys already
// written there) and key t lives in block block_table[t / block_size], slot t % block_size.
// Each task packs the keys it sees anyway, so reading them through the table costs nothing;
// gathering the whole context into one tensor first was a full extra copy per chunk. A float16
// cache is widened to float32 as it is packed.
//
// Groups may be uneven: `group_starts` (kv_heads + 1 offsets) gives each KV head's run of
// query heads, e.g. a tensor-parallel rank holding SmolLM2's query heads 0-4 uses KV head 0
// for 3 of them and KV head 1 for 2 (docs/tensor_parallel.md); without it, H / Hkv each.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include "kernel_library.h"
#include "kernel_ops.h"

#include <immintrin.h>

#include "avx2_math.h"
#include "query_groups.h"
#include "gemm_microkernel.h"

#include <algorithm>
#include <vector>

namespace {

using pipellm_kernels::masked_softmax;
using pipellm_kernels::kPanel;
using pipellm_kernels::kRowBlock;
using pipellm_kernels::kRows;

constexpr int64_t kQueryBlock = 64;
// Packed key panels per tile: 256 keys, 64 KB of keys (or values) at head_dim 64, which stays
// in L2 with the block's 64 KB of scores over them.
constexpr int64_t kTilePanels = 16;

}  // namespace

// out, q: [L, H, D]; k, v: [prefix + L, Hkv, D], or with block_table the paged caches
// [num_blocks, block_size, Hkv, D] and block_table [>= ceil((prefix + L) / block_size)] int64;
// last dims contiguous, other strides free. Causal: query row r sees keys up to prefix + r.
void pipellm_ops::prefill_attention(const at::Tensor& out, const at::Tensor& q,
                                    const at::Tensor& k, const at::Tensor& v, double scale,
                                    at::OptionalIntArrayRef group_starts, int64_t window,
                                    int64_t prefix, const std::optional<at::Tensor>& block_table) {
  const bool paged = block_table.has_value();
  const bool half_cache = paged && k.scalar_type() == at::kHalf;
  for (const at::Tensor* t : {&out, &q, &k, &v}) {
    const bool cache = paged && (t == &k || t == &v);
    TORCH_CHECK(t->device().is_cpu() &&
                    t->scalar_type() == (cache && half_cache ? at::kHalf : at::kFloat) &&
                    t->dim() == (cache ? 4 : 3) && t->stride(-1) == 1,
                "prefill_attention: float32 CPU tensors with a contiguous last dim; q and out "
                "3-D, k and v 3-D (or 4-D paged caches, float32 or float16, with a block table)");
  }
  const int64_t len = q.size(0), heads = q.size(1), head_dim = q.size(2);
  const int64_t kv_heads = k.size(-2);
  const int64_t context = prefix + len;
  TORCH_CHECK(prefix >= 0, "prefill_attention: negative prefix");
  TORCH_CHECK(out.sizes() == q.sizes() && k.sizes() == v.sizes() && k.size(-1) == head_dim &&
                  (paged || k.size(0) == context),
              "prefill_attention: shapes do not match");
  // Token t's row of k (or v): its own row, or its slot in the block the table names.
  const int64_t block_size = paged ? k.size(1) : 1;
  std::vector<int64_t> table_blocks;
  if (paged) {
    const at::Tensor& table = *block_table;
    TORCH_CHECK(table.device().is_cpu() && table.scalar_type() == at::kLong && table.dim() == 1,
                "prefill_attention: block_table must be a 1-D int64 CPU tensor");
    const int64_t needed = (context + block_size - 1) / block_size;
    TORCH_CHECK(table.size(0) >= needed, "prefill_attention: shapes do not match: block_table ",
                "has ", table.size(0), " blocks, the context of ", context, " needs ", needed);
    const at::Tensor owned = table.contiguous();
    table_blocks.assign(owned.data_ptr<int64_t>(), owned.data_ptr<int64_t>() + needed);
    for (int64_t b : table_blocks)
      TORCH_CHECK(b >= 0 && b < k.size(0), "prefill_attention: block ", b, " is outside the ",
                  k.size(0), "-block cache");
  }
  auto row_of = [&](const at::Tensor& x, int64_t t, int64_t h) -> int64_t {
    return paged ? table_blocks[t / block_size] * x.stride(0) + (t % block_size) * x.stride(1) +
                       h * x.stride(2)
                 : t * x.stride(0) + h * x.stride(1);
  };
  const std::vector<int64_t> starts =
      pipellm_kernels::query_group_starts(heads, kv_heads, group_starts, "prefill_attention");
  TORCH_CHECK(head_dim % kPanel == 0, "prefill_attention: head_dim ", head_dim,
              " is not a multiple of 16");
  const int64_t dim_panels = head_dim / kPanel;
  const int64_t blocks = (len + kQueryBlock - 1) / kQueryBlock;
  const float* qp = q.data_ptr<float>();
  const char* kp = static_cast<const char*>(k.data_ptr());
  const char* vp = static_cast<const char*>(v.data_ptr());
  // Row `offset` (in elements) of a cache as float32: in place, or widened into `scratch`.
  auto row_floats = [&](const char* base, int64_t offset, float* scratch) -> const float* {
    if (!half_cache) return reinterpret_cast<const float*>(base) + offset;
    const at::Half* row = reinterpret_cast<const at::Half*>(base) + offset;
    for (int64_t d = 0; d < head_dim; ++d) scratch[d] = static_cast<float>(row[d]);
    return scratch;
  };
  float* op = out.data_ptr<float>();
  const auto options = q.options();
  at::parallel_for(0, kv_heads * blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      // Later query blocks see more keys, and parallel_for hands each thread a contiguous run
      // of tasks: order the blocks 0, n-1, 1, n-2, ... so that any run is a fair mix.
      const int64_t h = task % kv_heads, i = task / kv_heads;
      const int64_t block = i % 2 == 0 ? i / 2 : blocks - 1 - i / 2;
      const int64_t r0 = block * kQueryBlock, r1 = std::min(len, r0 + kQueryBlock);
      // The block's first visible key, rounded down to a panel; packed key j is key k0 + j.
      const int64_t k0 =
          window > 0 ? std::max<int64_t>(0, prefix + r0 - window + 1) / kPanel * kPanel : 0;
      const int64_t keys = prefix + r1 - k0, key_panels = (keys + kPanel - 1) / kPanel;
      const int64_t padded = key_panels * kPanel;
      // keys_packed[p, d, j] = k[16 p + j, h, d]; values_packed[c, t, j] = v[t, h, 16 c + j].
      // Only the padding past the last key is cleared: zeroing whole buffers was one more
      // write pass over a long context's keys and values in every task.
      at::Tensor keys_packed = at::empty({key_panels, head_dim, kPanel}, options);
      at::Tensor values_packed = at::empty({dim_panels, padded, kPanel}, options);
      at::Tensor scores = at::empty({r1 - r0, padded}, options);
      float* kpk = keys_packed.data_ptr<float>();
      float* vpk = values_packed.data_ptr<float>();
      float* sp = scores.data_ptr<float>();
      std::vector<float> key_row(half_cache ? head_dim : 0), value_row(key_row.size());
      for (int64_t t = 0; t < keys; ++t) {
        const float* kt = row_floats(kp, row_of(k, k0 + t, h), key_row.data());
        const float* vt = row_floats(vp, row_of(v, k0 + t, h), value_row.data());
        float* kdst = kpk + (t / kPanel) * head_dim * kPanel + t % kPanel;
        for (int64_t d = 0; d < head_dim; ++d) kdst[d * kPanel] = kt[d];
        for (int64_t c = 0; c < dim_panels; ++c)
          std::copy(vt + c * kPanel, vt + (c + 1) * kPanel, vpk + (c * padded + t) * kPanel);
      }
      for (int64_t t = keys; t < padded; ++t) {
        float* kdst = kpk + (t / kPanel) * head_dim * kPanel + t % kPanel;
        for (int64_t d = 0; d < head_dim; ++d) kdst[d * kPanel] = 0.0f;
        for (int64_t c = 0; c < dim_panels; ++c)
          std::fill_n(vpk + (c * padded + t) * kPanel, kPanel, 0.0f);
      }
      for (int64_t head = starts[h]; head < starts[h + 1]; ++head) {
        // Keys a tile at a time, each tile through every row: the tile stays in L2 while the
        // rows go by, where a long context's keys (1 MB at 4096 x 64) streamed from L3 once
        // per row block.
        for (int64_t p0 = 0; p0 < key_panels; p0 += kTilePanels) {
          const int64_t p1 = std::min(key_panels, p0 + kTilePanels);
          for (int64_t r = r0; r < r1; r += kRows) {
            const int64_t rows = std::min(kRows, r1 - r);
            const int64_t visible = prefix + r + rows - k0;  // packed keys its last row sees
            for (int64_t p = p0; p < p1 && p * kPanel < visible; ++p)
              kRowBlock[rows](qp + r * q.stride(0) + head * q.stride(1), q.stride(0),
                              kpk + p * head_dim * kPanel, 0, head_dim,
                              sp + (r - r0) * padded + p * kPanel, padded, false, nullptr,
                              nullptr);
          }
        }
        for (int64_t r = r0; r < r1; ++r) {
          const int64_t position = prefix + r;
          const int64_t hidden =
              (window > 0 ? std::max<int64_t>(0, position - window + 1) : 0) - k0;
          float* row = sp + (r - r0) * padded;
          std::fill(row, row + hidden, 0.0f);
          masked_softmax(row + hidden, position + 1 - k0 - hidden, padded - hidden,
                         static_cast<float>(scale));
        }
        // out = P V a tile of keys at a time, likewise: each output continues its one chain
        // of multiply-adds over the keys in order (accumulating into out), so the sums are
        // the same bits as in one pass.
        for (int64_t t0 = 0; t0 < padded; t0 += kTilePanels * kPanel) {
          for (int64_t r = r0; r < r1; r += kRows) {
            const int64_t rows = std::min(kRows, r1 - r);
            const int64_t depth = prefix + r + rows - k0;  // probabilities past it are zero
            const int64_t t1 = std::min(depth, t0 + kTilePanels * kPanel);
            if (t1 <= t0) continue;
            for (int64_t c = 0; c < dim_panels; ++c)
              kRowBlock[rows](sp + (r - r0) * padded, padded, vpk + c * padded * kPanel, t0, t1,
                              op + r * out.stride(0) + head * out.stride(1) + c * kPanel,
                              out.stride(0), t0 > 0, nullptr, nullptr);
          }
        }
      }
    }
  });
}

PIPELLM_LIBRARY_FRAGMENT(m) {
  m.def(
      "prefill_attention(Tensor(a!) out, Tensor q, Tensor k, Tensor v, float scale, "
      "int[]? group_starts=None, int window=0, int prefix=0, Tensor? block_table=None) -> ()",
      &pipellm_ops::prefill_attention);
}
