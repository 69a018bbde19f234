// Rotary position embedding of the query and key heads, and the keys' and values' writes into
// their paged-cache slots, in one pass over the fused q/k/v projection's output.
//
// Why: in PyTorch this is ~10 ops per layer (halves, a concatenation, two products and a sum,
// the split, two index_copy_), each a pass over memory at prefill sizes and a few microseconds
// of dispatch at decode sizes. Rounding is kept exactly as in pipellm/model/rope.py (a product,
// a product, a sum; no fused multiply-add), so both paths give bit-identical results.
//
// A float16 cache gets each key and value rounded to float16 (round to nearest even, F16C), and
// the same rounded numbers replace them in qkv: the step's own attention then sees what later
// steps read from the cache, so a prompt gives the same result in one chunk or in several.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include "kernel_library.h"
#include "kernel_ops.h"

#include <immintrin.h>

#include <cstring>

#pragma GCC optimize("fp-contract=off")  // x * cos + rotated * sin: three roundings, as torch

namespace {

// x: one head of head_dim floats, rotated in place. cos and sin: this token's tables, with
// rotate-half's sign folded into sin: out[i] = x[i] cos[i] + x[(i + d/2) % d] sin[i].
inline void rotate_head(float* x, const float* cos, const float* sin, int64_t head_dim) {
  const int64_t half = head_dim / 2;
  alignas(32) float rotated[512];
  std::memcpy(rotated, x + half, half * sizeof(float));
  std::memcpy(rotated + half, x, half * sizeof(float));
  int64_t i = 0;
  for (; i + 8 <= head_dim; i += 8) {
    const __m256 a = _mm256_mul_ps(_mm256_loadu_ps(x + i), _mm256_loadu_ps(cos + i));
    const __m256 b = _mm256_mul_ps(_mm256_load_ps(rotated + i), _mm256_loadu_ps(sin + i));
    _mm256_storeu_ps(x + i, _mm256_add_ps(a, b));
  }
  for (; i < head_dim; ++i) x[i] = x[i] * cos[i] + rotated[i] * sin[i];
}

// n floats into a float16 cache row, and the rounded values back into x. Both conversions round
// to nearest even, as torch's .half() does.
inline void store_rounded(float* x, at::Half* cache, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m128i half = _mm256_cvtps_ph(_mm256_loadu_ps(x + i), _MM_FROUND_TO_NEAREST_INT);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(cache + i), half);
    _mm256_storeu_ps(x + i, _mm256_cvtph_ps(half));
  }
  for (; i < n; ++i) {
    cache[i] = at::Half(x[i]);
    x[i] = static_cast<float>(cache[i]);
  }
}

}  // namespace

// qkv: [T, num_heads + 2 num_kv_heads, head_dim], query heads, then key heads, then value heads;
// cos, sin: [T, head_dim]; caches: [num_blocks, block_size, num_kv_heads, head_dim], float32 or
// float16;
// slot_mapping: [T] int64, the cache slot (block * block_size + offset) of each token.
void pipellm_ops::rotary_and_cache_(const at::Tensor& qkv, const at::Tensor& cos,
                                    const at::Tensor& sin, const at::Tensor& key_cache,
                                    const at::Tensor& value_cache, const at::Tensor& slot_mapping,
                                    int64_t num_heads, int64_t num_kv_heads) {
  for (const at::Tensor* t : {&qkv, &cos, &sin})
    TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == at::kFloat && t->is_contiguous(),
                "rotary_and_cache_: contiguous float32 CPU tensors only");
  const bool half_cache = key_cache.scalar_type() == at::kHalf;
  for (const at::Tensor* t : {&key_cache, &value_cache})
    TORCH_CHECK(t->device().is_cpu() && t->is_contiguous() &&
                    t->scalar_type() == (half_cache ? at::kHalf : at::kFloat),
                "rotary_and_cache_: the caches must be contiguous float32 or float16 CPU tensors");
  const int64_t tokens = qkv.size(0), head_dim = qkv.size(2);
  TORCH_CHECK(qkv.dim() == 3 && qkv.size(1) == num_heads + 2 * num_kv_heads,
              "rotary_and_cache_: qkv must be [tokens, heads + 2 kv_heads, head_dim]");
  TORCH_CHECK(head_dim % 2 == 0 && head_dim <= 512, "rotary_and_cache_: head_dim ", head_dim);
  TORCH_CHECK(cos.sizes() == sin.sizes() && cos.numel() == tokens * head_dim,
              "rotary_and_cache_: cos and sin must be [tokens, head_dim]");
  TORCH_CHECK(key_cache.sizes() == value_cache.sizes() && key_cache.dim() == 4 &&
                  key_cache.size(2) == num_kv_heads && key_cache.size(3) == head_dim,
              "rotary_and_cache_: caches must be [blocks, block_size, kv_heads, head_dim]");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous() &&
                  slot_mapping.numel() == tokens,
              "rotary_and_cache_: one int64 slot per token");
  const int64_t num_slots = key_cache.size(0) * key_cache.size(1);
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t)
    TORCH_CHECK(slots[t] >= 0 && slots[t] < num_slots, "rotary_and_cache_: slot out of range");
  const int64_t row = (num_heads + 2 * num_kv_heads) * head_dim;
  const int64_t kv_row = num_kv_heads * head_dim;
  float* base = qkv.data_ptr<float>();
  const float* cos_p = cos.data_ptr<float>();
  const float* sin_p = sin.data_ptr<float>();
  void* k_cache = key_cache.data_ptr();
  void* v_cache = value_cache.data_ptr();
  // Grain: a decode batch is too small to be worth waking a second thread for.
  at::parallel_for(0, tokens, 64, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      float* x = base + t * row;
      for (int64_t h = 0; h < num_heads + num_kv_heads; ++h)
        rotate_head(x + h * head_dim, cos_p + t * head_dim, sin_p + t * head_dim, head_dim);
      float* keys = x + num_heads * head_dim;
      if (half_cache) {
        store_rounded(keys, static_cast<at::Half*>(k_cache) + slots[t] * kv_row, kv_row);
        store_rounded(keys + kv_row, static_cast<at::Half*>(v_cache) + slots[t] * kv_row, kv_row);
      } else {
        std::memcpy(static_cast<float*>(k_cache) + slots[t] * kv_row, keys, kv_row * 4);
        std::memcpy(static_cast<float*>(v_cache) + slots[t] * kv_row, keys + kv_row, kv_row * 4);
      }
    }
  });
}

PIPELLM_LIBRARY_FRAGMENT(m) {
  m.def(
      "rotary_and_cache_(Tensor(a!) qkv, Tensor cos, Tensor sin, Tensor(b!) key_cache, "
      "Tensor(c!) value_cache, Tensor slot_mapping, int num_heads, int num_kv_heads) -> ()",
      &pipellm_ops::rotary_and_cache_);
}
