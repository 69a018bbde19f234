// Which query heads use which key/value head (grouped-query attention), for the attention
// kernels. Usually each KV head serves H / Hkv query heads in a row; a tensor-parallel rank of
// a model whose query heads split evenly over the ranks but whose KV groups do not (SmolLM2's
// 9 query / 3 KV heads over 2 ranks: query heads 0-4 and 5-8) holds uneven runs, given as
// `group_starts`: kv_heads + 1 offsets, KV head h serving query heads [starts[h], starts[h+1]).
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <vector>

namespace pipellm_kernels {

inline std::vector<int64_t> query_group_starts(int64_t heads, int64_t kv_heads,
                                               at::OptionalIntArrayRef group_starts,
                                               const char* what) {
  std::vector<int64_t> starts(kv_heads + 1);
  if (!group_starts.has_value()) {
    TORCH_CHECK(kv_heads > 0 && heads % kv_heads == 0, what, ": ", heads,
                " query heads are not a multiple of ", kv_heads, " KV heads; pass group_starts");
    for (int64_t h = 0; h <= kv_heads; ++h) starts[h] = h * (heads / kv_heads);
    return starts;
  }
  const auto given = *group_starts;
  TORCH_CHECK(static_cast<int64_t>(given.size()) == kv_heads + 1 && given[0] == 0 &&
                  given[kv_heads] == heads,
              what, ": group_starts must be kv_heads + 1 offsets from 0 to the query heads");
  for (int64_t h = 0; h <= kv_heads; ++h) {
    TORCH_CHECK(h == 0 || given[h] >= given[h - 1], what, ": group_starts must not decrease");
    starts[h] = given[h];
  }
  return starts;
}

}  // namespace pipellm_kernels
