// Decode attention read straight from the paged KV cache: one query token per sequence.
//
// Why a kernel of our own: on the CPU, gathering each sequence's blocks into a padded tensor
// and calling SDPA copies every key and value once (the gather) and then runs SDPA's flash
// kernel, which is slow at query length 1. Here each task (a sequence, or a sequence's KV head
// when there are fewer sequences than twice the threads) reads its keys and values once, in
// place, and serves all query heads of each GQA group while they are in L1. Two passes: scores
// (and an exact softmax over them), then the weighted sum of values. Groups may be uneven
// (`group_starts`, query_groups.h). AVX2 + FMA; the query and out are float32, the cache
// float32 or float16 (widened as it is read, F16C: half the bytes to stream, the cache
// llama.cpp keeps by default); pipellm/kernels/cpu_kernels.py builds it and falls back to SDPA
// where it cannot.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include "kernel_library.h"
#include "kernel_ops.h"

#include <immintrin.h>

#include "avx2_math.h"
#include "prefetch_lines.h"
#include "query_groups.h"

#include <algorithm>
#include <cmath>
#include <tuple>
#include <utility>
#include <vector>

namespace {

using pipellm_kernels::masked_softmax;
using pipellm_kernels::prefetch_lines;

// Tokens whose key (or value) rows are looked up together and reused by every head of a group.
constexpr int64_t kChunk = 64;

// out[i] = sum of the lanes of a[i]: eight dot products finished with 7 hadds instead of 24.
inline __m256 sum_each(const __m256 a[8]) {
  const __m256 s0123 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
  const __m256 s4567 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(s0123, s4567, 0x20),
                       _mm256_permute2f128_ps(s0123, s4567, 0x31));
}

// Eight cache values as float32.
inline __m256 load8(const float* x) { return _mm256_loadu_ps(x); }
inline __m256 load8(const at::Half* x) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x)));
}

template <typename T>
struct CacheView {
  const T* base;         // this KV head's slice of the cache (block 0, token 0)
  const int64_t* table;  // this sequence's block ids
  int64_t block_size;
  int64_t block_stride;  // elements between blocks
  int64_t token_stride;  // elements between tokens of a block

  // Row pointers of tokens [first, first + n).
  void rows(int64_t first, int64_t n, const T** out) const {
    for (int64_t i = 0, b = first / block_size, o = first % block_size; i < n; ++i) {
      out[i] = base + table[b] * block_stride + o * token_stride;
      if (++o == block_size) {
        o = 0;
        ++b;
      }
    }
  }
};

// Rows to bring into cache while a pass works through its chunk: the pass's next chunk, or, at
// its last, the first chunk of what comes next (the values after the keys, the thread's next
// task's keys after the values). The block table hides the next rows from the hardware
// prefetcher, which only follows plain strides; asking for a chunk in one burst filled the
// core's miss buffers and stalled the arithmetic behind it, so the rows are asked for a few
// at a time as the chunk's tokens go by (`up_to`), one chunk ahead. They go to L2 (the T1
// hint), which tracks more misses in flight than L1: 16 sequences x ~290 tokens, 30 layers read
// from memory, on an AVX-512 AMD EPYC with 2 threads, took ~25-35% less time than with T0
// (float16 cache, heads 9/3 of 64: 222-284 -> 160-179 us a layer; float32 432-458 -> 287-319;
// Gemma 3's 4/1 of 256: 278-308 -> 206-234; the same at the AVX2 level); one sequence
// unchanged.
template <typename T>
class Upcoming {
 public:
  explicit Upcoming(int64_t row_elements) : row_bytes_(row_elements * int64_t{sizeof(T)}) {}
  void set(const CacheView<T>& view, int64_t first, int64_t n) {
    view.rows(first, n, rows_);
    n_ = n, done_ = 0;
  }
  void clear() { n_ = done_ = 0; }
  // Rows in proportion to the work done on the chunk in hand: `done` of `total` steps.
  void up_to(int64_t done, int64_t total) {
    for (const int64_t target = done >= total ? n_ : n_ * done / total; done_ < target; ++done_)
      prefetch_lines(rows_[done_], row_bytes_, /*to_l2=*/true);
  }

 private:
  const T* rows_[kChunk];
  int64_t row_bytes_, n_ = 0, done_ = 0;
};

// Tokens a pass takes: up to kChunk, fewer for wide heads and for several KV heads at once, so
// that a pass's rows (row_elements a token) stay in L1 while every query head reads them.
constexpr int64_t chunk_tokens(int64_t row_elements) {
  return std::max<int64_t>(8, std::min<int64_t>(kChunk, 4096 / row_elements / 8 * 8));
}

// Output vectors one pass over a pass's value rows accumulates: the largest divisor of V up to
// 8 of the 16 AVX2 registers, so that a 256-wide head does not spill its accumulators.
constexpr int piece_of(int v) {
  int piece = 8;
  while (v % piece != 0) --piece;
  return piece;
}

// The thread's next task's keys and the tokens [begin, len) it attends to (len 0: none).
template <typename T>
struct NextKeys {
  CacheView<T> keys;
  int64_t begin = 0, len = 0;
};

// One sequence, KV heads [0, kv_heads) of the views (whose rows start at the first of them),
// head h serving query heads [groups[h], groups[h + 1]) (groups[0] = 0) of head_dim 8 * V,
// attending to cached tokens [begin, len) (begin > 0 for a sliding-window layer). A token's
// rows of all these heads are adjacent in the cache, so a chunk's rows are read (and
// prefetched) whole. scores: scratch of groups[kv_heads] * round_up(len - begin, 8) floats.
template <int V, typename T>
void attend(const float* query, int64_t query_head_stride, int64_t kv_heads,
            const int64_t* groups, const CacheView<T>& keys, const CacheView<T>& values,
            int64_t begin, int64_t len, const NextKeys<T>& next, float scale, float* scores,
            float* out) {
  constexpr int64_t D = 8 * V;
  const int64_t chunk = chunk_tokens(kv_heads * D);
  const int64_t count = len - begin, padded = (count + 7) / 8 * 8, heads = groups[kv_heads];
  const T* rows[kChunk];
  Upcoming<T> upcoming(kv_heads * D);
  for (int64_t first = begin; first < len; first += chunk) {
    const int64_t n = std::min(chunk, len - first), steps = (n + 7) / 8;
    keys.rows(first, n, rows);
    if (first + n < len)
      upcoming.set(keys, first + n, std::min(chunk, len - first - n));
    else
      upcoming.set(values, begin, std::min(chunk, count));
    for (int64_t h = 0; h < kv_heads; ++h)
      for (int64_t g = groups[h]; g < groups[h + 1]; ++g) {
        const float* qg = query + g * query_head_stride;
        for (int64_t i = 0; i < n; i += 8) {
          upcoming.up_to(g * steps + i / 8 + 1, heads * steps);
          const T* k[8];
          for (int u = 0; u < 8; ++u)
            k[u] = rows[std::min<int64_t>(i + u, n - 1)] + h * D;  // a repeat past n
          // The 8 tokens' dot products advance together, one query vector at a time: a wide
          // head's query (32 vectors at head_dim 256) does not fit the 16 registers, and held
          // whole it spilled to the stack.
          __m256 dots[8];
          const __m256 q0 = _mm256_loadu_ps(qg);
          for (int u = 0; u < 8; ++u) dots[u] = _mm256_mul_ps(q0, load8(k[u]));
          for (int j = 1; j < V; ++j) {
            const __m256 qj = _mm256_loadu_ps(qg + j * 8);
            for (int u = 0; u < 8; ++u)
              dots[u] = _mm256_fmadd_ps(qj, load8(k[u] + j * 8), dots[u]);
          }
          _mm256_storeu_ps(scores + g * padded + first - begin + i, sum_each(dots));
        }
      }
    upcoming.up_to(1, 1);
  }
  for (int64_t g = 0; g < heads; ++g) {
    masked_softmax(scores + g * padded, count, padded, scale);
    std::fill(out + g * D, out + (g + 1) * D, 0.0f);
  }
  constexpr int piece = piece_of(V);
  for (int64_t first = begin; first < len; first += chunk) {
    const int64_t n = std::min(chunk, len - first);
    values.rows(first, n, rows);
    if (first + n < len)
      upcoming.set(values, first + n, std::min(chunk, len - first - n));
    else if (next.len > 0)
      upcoming.set(next.keys, next.begin, std::min(chunk, next.len - next.begin));
    else
      upcoming.clear();
    for (int64_t h = 0; h < kv_heads; ++h)
      for (int64_t g = groups[h]; g < groups[h + 1]; ++g) {
        const float* p = scores + g * padded + first - begin;
        for (int j0 = 0; j0 < V; j0 += piece) {
          upcoming.up_to(g * (V / piece) + j0 / piece + 1, heads * (V / piece));
          __m256 acc[piece];
          for (int j = 0; j < piece; ++j) acc[j] = _mm256_loadu_ps(out + g * D + (j0 + j) * 8);
          for (int64_t i = 0; i < n; ++i) {
            const __m256 weight = _mm256_broadcast_ss(p + i);
            const T* row = rows[i] + h * D + j0 * 8;
            for (int j = 0; j < piece; ++j)
              acc[j] = _mm256_fmadd_ps(weight, load8(row + j * 8), acc[j]);
          }
          for (int j = 0; j < piece; ++j) _mm256_storeu_ps(out + g * D + (j0 + j) * 8, acc[j]);
        }
      }
    upcoming.up_to(1, 1);
  }
}

template <typename T>
using AttendFn = void (*)(const float*, int64_t, int64_t, const int64_t*, const CacheView<T>&,
                          const CacheView<T>&, int64_t, int64_t, const NextKeys<T>&, float,
                          float*, float*);

template <typename T>
AttendFn<T> attend_for(int64_t head_dim) {
  switch (head_dim) {
    case 16: return attend<2, T>;
    case 32: return attend<4, T>;
    case 64: return attend<8, T>;
    case 80: return attend<10, T>;
    case 96: return attend<12, T>;
    case 128: return attend<16, T>;
    case 256: return attend<32, T>;
    default: return nullptr;
  }
}

struct Shapes {
  int64_t seqs, heads, head_dim, kv_heads, block_size, max_blocks;
};

template <typename T>
void attend_all(const at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
                const at::Tensor& value_cache, const int64_t* tables, const int64_t* lens,
                const std::vector<int64_t>& starts, const Shapes& s, float scale, int64_t window) {
  const AttendFn<T> attend_fn = attend_for<T>(s.head_dim);
  TORCH_CHECK(attend_fn != nullptr, "paged_decode_attention: head_dim ", s.head_dim,
              " unsupported");
  const int64_t token_stride = s.kv_heads * s.head_dim, block_stride = s.block_size * token_stride;
  const float* q = query.data_ptr<float>();
  const T* k = key_cache.data_ptr<T>();
  const T* v = value_cache.data_ptr<T>();
  float* o = out.data_ptr<float>();
  const int64_t query_seq_stride = query.stride(0), query_head_stride = query.stride(1);
  // A task's window: tokens [first, len) of its sequence.
  auto window_of = [&](int64_t seq) {
    const int64_t len = lens[seq];
    return std::pair<int64_t, int64_t>{window > 0 ? std::max<int64_t>(0, len - window) : 0, len};
  };
  auto view_of = [&](const T* cache, int64_t seq, int64_t h) {
    return CacheView<T>{cache + h * s.head_dim, tables + seq * s.max_blocks, s.block_size,
                        block_stride, token_stride};
  };
  // Tasks: whole sequences where there are enough to share out (a task then reads its blocks
  // in order, every KV head's rows of a token together, which the hardware prefetcher
  // follows), else (sequence, KV head) pairs, so that a lone sequence still uses every thread.
  const int64_t heads_per_task = s.seqs >= 2 * at::get_num_threads() ? s.kv_heads : 1;
  const int64_t tasks_per_seq = s.kv_heads / heads_per_task;
  auto task_at = [&](int64_t task) {
    return std::pair<int64_t, int64_t>{task / tasks_per_seq, task % tasks_per_seq * heads_per_task};
  };
  at::parallel_for(0, s.seqs * tasks_per_seq, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    std::vector<int64_t> groups(heads_per_task + 1);
    for (int64_t task = begin; task < end; ++task) {
      const auto [seq, h0] = task_at(task);
      const auto [first, len] = window_of(seq);
      for (int64_t h = 0; h <= heads_per_task; ++h) groups[h] = starts[h0 + h] - starts[h0];
      if (groups[heads_per_task] == 0) continue;
      scores.resize(groups[heads_per_task] * ((len - first + 7) / 8 * 8));
      NextKeys<T> next{};
      if (task + 1 < end) {
        const auto [next_seq, next_h0] = task_at(task + 1);
        next.keys = view_of(k, next_seq, next_h0);
        std::tie(next.begin, next.len) = window_of(next_seq);
      }
      attend_fn(q + seq * query_seq_stride + starts[h0] * query_head_stride, query_head_stride,
                heads_per_task, groups.data(), view_of(k, seq, h0), view_of(v, seq, h0), first,
                len, next, scale, scores.data(), o + (seq * s.heads + starts[h0]) * s.head_dim);
    }
  });
}

}  // namespace

// out, query: [S, H, D]; key_cache, value_cache: [num_blocks, block_size, Hkv, D];
// block_tables: [S, max_blocks] int64; context_lens: [S] int64, tokens to attend to (>= 1);
// window > 0: only the last `window` of them (a sliding-window layer).
void pipellm_ops::paged_decode_attention(const at::Tensor& out, const at::Tensor& query,
                                         const at::Tensor& key_cache,
                                         const at::Tensor& value_cache,
                                         const at::Tensor& block_tables,
                                         const at::Tensor& context_lens, double scale,
                                         at::OptionalIntArrayRef group_starts, int64_t window) {
  for (const at::Tensor* t : {&out, &query})
    TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == at::kFloat,
                "paged_decode_attention: float32 CPU query and out only");
  const at::ScalarType cache_type = key_cache.scalar_type();
  TORCH_CHECK(key_cache.device().is_cpu() && value_cache.device().is_cpu() &&
                  value_cache.scalar_type() == cache_type &&
                  (cache_type == at::kFloat || cache_type == at::kHalf),
              "paged_decode_attention: the caches must be float32 or float16 CPU tensors");
  TORCH_CHECK(out.is_contiguous() && key_cache.is_contiguous() && value_cache.is_contiguous(),
              "paged_decode_attention: out and the caches must be contiguous");
  TORCH_CHECK(query.dim() == 3 && query.stride(2) == 1 && out.sizes() == query.sizes(),
              "paged_decode_attention: query and out must be [seqs, heads, head_dim]");
  TORCH_CHECK(key_cache.dim() == 4 && key_cache.sizes() == value_cache.sizes(),
              "paged_decode_attention: caches must be [blocks, block_size, kv_heads, head_dim]");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && block_tables.is_contiguous() &&
                  context_lens.scalar_type() == at::kLong && context_lens.is_contiguous(),
              "paged_decode_attention: block_tables and context_lens must be contiguous int64");
  const Shapes shapes{query.size(0),     query.size(1),     query.size(2),
                      key_cache.size(2), key_cache.size(1), block_tables.size(1)};
  TORCH_CHECK(key_cache.size(3) == shapes.head_dim,
              "paged_decode_attention: query and cache head shapes do not match");
  const std::vector<int64_t> starts = pipellm_kernels::query_group_starts(
      shapes.heads, shapes.kv_heads, group_starts, "paged_decode_attention");
  TORCH_CHECK(block_tables.size(0) == shapes.seqs && context_lens.numel() == shapes.seqs,
              "paged_decode_attention: one block table and context length per sequence");
  const int64_t num_blocks = key_cache.size(0), max_blocks = shapes.max_blocks;
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* lens = context_lens.data_ptr<int64_t>();
  for (int64_t s = 0; s < shapes.seqs; ++s) {
    TORCH_CHECK(lens[s] >= 1 && lens[s] <= max_blocks * shapes.block_size, "bad context length");
    for (int64_t b = 0; b < (lens[s] + shapes.block_size - 1) / shapes.block_size; ++b)
      TORCH_CHECK(tables[s * max_blocks + b] >= 0 && tables[s * max_blocks + b] < num_blocks,
                  "block id out of range");
  }
  if (cache_type == at::kHalf)
    attend_all<at::Half>(out, query, key_cache, value_cache, tables, lens, starts, shapes,
                         static_cast<float>(scale), window);
  else
    attend_all<float>(out, query, key_cache, value_cache, tables, lens, starts, shapes,
                      static_cast<float>(scale), window);
}

PIPELLM_LIBRARY_FRAGMENT(m) {
  m.def(
      "paged_decode_attention(Tensor(a!) out, Tensor query, Tensor key_cache, "
      "Tensor value_cache, Tensor block_tables, Tensor context_lens, float scale, "
      "int[]? group_starts=None, int window=0) -> ()",
      &pipellm_ops::paged_decode_attention);
}
