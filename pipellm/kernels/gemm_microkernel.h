// The register-blocked GEMM step shared by pipellm's CPU kernels (float32): up to kRows rows of
// x times one packed panel of 16 columns, at the vector width of the level being compiled.
#pragma once

#include <immintrin.h>

#include <array>
#include <cstdint>
#include <type_traits>
#include <utility>

namespace pipellm_kernels {

constexpr int64_t kPanel = 16;  // output columns per panel: two AVX registers, or one AVX-512

#if defined(__AVX512F__)
// AVX-512: one register a panel row and 32 registers, so 12 rows of x per register block: 12
// accumulators, a weight vector, and x broadcast from memory into each FMA.
constexpr int64_t kRows = 12;
#define FOR_ROWS(X) X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7) X(8) X(9) X(10) X(11)
#else
constexpr int64_t kRows = 6;  // rows of x per register block: 12 accumulators of 8
#define FOR_ROWS(X) X(0) X(1) X(2) X(3) X(4) X(5)
#endif

// Rows [0, R) of x times one panel of 16 columns over depth [k0, k1), into out (ld = out's row
// stride), the panel's 16 weights at depth k given by weights.at(k, ...): a packed float32
// panel (PackedPanel) or a quantized one dequantized in registers (quantized_linear.cpp).
// Starts from `init` (bias, or nullptr for zero) when `accumulate` is false, else from out.
// Every output is one chain of fused multiply-adds over k in order, at either vector width:
// the AVX2 and AVX-512 builds give the same bits.
// Named accumulators, not arrays: gcc keeps arrays of vectors on the stack in this loop.
#if defined(__AVX512F__)
// Whether Weights gives two depths at once, at_pair(k, w0, w1) for k even: a quantized panel
// whose unpacking then costs once for both (quantized_linear.cpp). Each output still adds its
// depths in order, so the bits do not change. Measured on an AVX-512 AMD EPYC, 2 threads, 3 and
// 4 rows: Q4_1, Q5_0, Q4_K and Q6_K GEMMs 4-15% faster; 8 rows the same or faster.
template <class Weights, class = void>
constexpr bool kTwoDepths = false;
template <class Weights>
constexpr bool kTwoDepths<Weights, std::void_t<decltype(Weights::kPairs)>> = Weights::kPairs;

template <int R, class Weights>
inline void row_block_of(const float* x, int64_t ldx, Weights& weights, int64_t k0, int64_t k1,
                         float* out, int64_t ld, bool accumulate, const float* init) {
  const __m512 init0 = init ? _mm512_loadu_ps(init) : _mm512_setzero_ps();
#define DECLARE(i)                                        \
  __m512 acc##i = init0;                                  \
  if (R > i && accumulate) acc##i = _mm512_loadu_ps(out + i * ld);
  FOR_ROWS(DECLARE)
  const float* xk = x + k0;
  int64_t k = k0;
#define FMA(i) \
  if (R > i) acc##i = _mm512_fmadd_ps(_mm512_set1_ps(xk[i * ldx]), w, acc##i);
  if constexpr (kTwoDepths<Weights>) {
    for (; k + 1 < k1; k += 2) {  // k0 is even: the callers' depths are whole blocks
      __m512 w, w_next;
      weights.at_pair(k, w, w_next);
      FOR_ROWS(FMA)
      w = w_next, ++xk;
      FOR_ROWS(FMA)
      ++xk;
    }
  }
  for (; k < k1; ++k, ++xk) {
    __m512 w;
    weights.at(k, w);
    FOR_ROWS(FMA)
  }
#define STORE(i) \
  if (R > i) _mm512_storeu_ps(out + i * ld, acc##i);
  FOR_ROWS(STORE)
#undef DECLARE
#undef FMA
#undef STORE
}
#else
template <int R, class Weights>
inline void row_block_of(const float* x, int64_t ldx, Weights& weights, int64_t k0, int64_t k1,
                         float* out, int64_t ld, bool accumulate, const float* init) {
  const __m256 init0 = init ? _mm256_loadu_ps(init) : _mm256_setzero_ps();
  const __m256 init1 = init ? _mm256_loadu_ps(init + 8) : _mm256_setzero_ps();
#define DECLARE(i)                                                         \
  __m256 acc##i##0 = init0, acc##i##1 = init1;                            \
  if (R > i && accumulate) {                                               \
    acc##i##0 = _mm256_loadu_ps(out + i * ld);                             \
    acc##i##1 = _mm256_loadu_ps(out + i * ld + 8);                         \
  }
  FOR_ROWS(DECLARE)
  const float* xk = x + k0;
  for (int64_t k = k0; k < k1; ++k, ++xk) {
    __m256 w0, w1;
    weights.at(k, w0, w1);
#define FMA(i)                                                   \
  if (R > i) {                                                   \
    const __m256 xi = _mm256_broadcast_ss(xk + i * ldx);         \
    acc##i##0 = _mm256_fmadd_ps(xi, w0, acc##i##0);              \
    acc##i##1 = _mm256_fmadd_ps(xi, w1, acc##i##1);              \
  }
    FOR_ROWS(FMA)
  }
#define STORE(i)                                         \
  if (R > i) {                                           \
    _mm256_storeu_ps(out + i * ld, acc##i##0);           \
    _mm256_storeu_ps(out + i * ld + 8, acc##i##1);       \
  }
  FOR_ROWS(STORE)
#undef DECLARE
#undef FMA
#undef STORE
}
#endif
#undef FOR_ROWS

// A packed float32 panel: packed[k][16], 64-byte aligned; optionally prefetching the same
// depth of another panel (`prefetch`, or nullptr) as it goes.
struct PackedPanel {
  const float* panel;
  const float* prefetch;
  void at(int64_t k, __m256& w0, __m256& w1) const {
    w0 = _mm256_load_ps(panel + k * kPanel);
    w1 = _mm256_load_ps(panel + k * kPanel + 8);
    if (prefetch) _mm_prefetch(reinterpret_cast<const char*>(prefetch + k * kPanel), _MM_HINT_T0);
  }
#if defined(__AVX512F__)
  void at(int64_t k, __m512& w) const {
    w = _mm512_loadu_ps(panel + k * kPanel);
    if (prefetch) _mm_prefetch(reinterpret_cast<const char*>(prefetch + k * kPanel), _MM_HINT_T0);
  }
#endif
};

template <int R>
void row_block(const float* x, int64_t ldx, const float* panel, int64_t k0, int64_t k1,
               float* out, int64_t ld, bool accumulate, const float* init,
               const float* prefetch) {
  PackedPanel weights{panel, prefetch};
  row_block_of<R>(x, ldx, weights, k0, k1, out, ld, accumulate, init);
}

// Calls f(first_row, rows) for rows [m0, m1) in ceil(rows / kRows) register blocks of near-equal
// size: 13 rows as 5 + 4 + 4, 8 as 4 + 4. Where the weights come from cache, a block of 1-3
// rows has too few accumulators to keep both FMA units busy, so 6 + 6 + 1 or 6 + 2 is slower
// for the same arithmetic (measured: ~13% at 7 and 13 rows). Where they stream from memory
// (packed_linear at few rows), the first block waits on memory anyway and 6 + 1 is as fast.
template <typename F>
inline void for_each_row_block(int64_t m0, int64_t m1, F&& f) {
  const int64_t m = m1 - m0, blocks = (m + kRows - 1) / kRows;
  for (int64_t b = 0, r = m0; b < blocks; ++b) {
    const int64_t rows = m / blocks + (b < m % blocks ? 1 : 0);
    f(r, rows);
    r += rows;
  }
}

// A GEMM on weights dequantized a slice at a time, at prefill sizes: x is taken in near-equal
// passes of at most `rows_block` rows by `slice_depth` columns, a block that stays in L2 while a
// thread's panels [first, last) go by, so each pass pays the dequantization once (256 rows at
// 192: one pass of 256, not 192 + 64). panel_slice(p, k0, m0, m1) does panel p's slice at
// depth k0 for rows [m0, m1).
template <typename F>
inline void for_each_slice_pass(int64_t m, int64_t depth, int64_t rows_block,
                                int64_t slice_depth, int64_t first, int64_t last,
                                F&& panel_slice) {
  const int64_t passes = (m + rows_block - 1) / rows_block;
  for (int64_t i = 0, m0 = 0; i < passes; ++i) {
    const int64_t m1 = m0 + m / passes + (i < m % passes ? 1 : 0);
    for (int64_t k0 = 0; k0 < depth; k0 += slice_depth)
      for (int64_t p = first; p < last; ++p) panel_slice(p, k0, m0, m1);
    m0 = m1;
  }
}

using RowBlockFn = void (*)(const float*, int64_t, const float*, int64_t, int64_t, float*,
                            int64_t, bool, const float*, const float*);
// kRowBlock[r]: the register block for r rows, 1 <= r <= kRows.
template <int... R>
constexpr auto row_blocks(std::integer_sequence<int, R...>) {
  return std::array<RowBlockFn, sizeof...(R)>{(R == 0 ? nullptr : row_block<R>)...};
}
inline constexpr auto kRowBlock = row_blocks(std::make_integer_sequence<int, kRows + 1>{});

}  // namespace pipellm_kernels
