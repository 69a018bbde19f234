// y = x W^T + b with W in GGUF Q4_1, Q8_0, Q5_0, Q4_K or Q6_K blocks and x rounded to int8
// as llama.cpp rounds it for the type (activation_rounding.h), the products summed in int32:
// the `quantization="gguf_int8"` path.
// With AVX-512 VNNI, vpdpbusd takes four u8 x s8 products into an int32 lane per instruction;
// on AVX2 (and on AVX-512 without VNNI) vpmaddubsw + vpmaddwd do the same in two steps, as
// llama.cpp's AVX2 dot products do. Both sum the same integers exactly and fold them into
// float32 with the same operations per column, so the two give bit-identical results.
//
// Why: the exact path (quantized_linear.cpp) must widen every weight to float32 and run one
// fused multiply-add per weight and row, so at one or two rows its time is the arithmetic, not
// the weight stream (measured: a one-row step's GEMMs at ~40% of the read bandwidth). With x
// in int8, one vpdpbusd takes 64 weights: the step becomes bound by the stream. This is what
// llama.cpp does on such CPUs (its Q4_1 x Q8_1 and Q8_0 x Q8_0 dot products, ggml-cpu's
// quants.c): it changes the numerics (x is rounded to 8 bits, not bit-identical to float32);
// its greedy agreement with llama.cpp is measured in docs/benchmarks.md.
//
// Arithmetic, per 32-value block b of row r of x: qx = round(x / dx) in [-127, 127] (nearest,
// ties to even) with dx = max|x| / 127 over the block (as float16), or over its 256-value
// block for Q4_K and Q6_K (float32), and sx = sum(qx). Then for a Q4_1 weight block (d, m, q in
// [0, 15]): sum_k x_k w_k ~ (d dx) sum(q qx) + m (dx sx); for Q8_0 (d, q in [-128, 127]), the
// quants are stored plus 128 as unsigned bytes (vpdpbusd takes u8 x s8), and
// sum((q + 128) qx) - 128 sx = sum(q qx) exactly in int32, times (d dx).
//
// Layout (made by pipellm/model/gguf_linear.py, pack_int8_weight): per panel of 16 output
// columns and 32-deep block, one record:
//   Q4_1: 16 float16 d, 16 float16 m, then 4 x 64 bytes: vector i, byte 4 j + t holds column
//         j's q at depth 4 i + t (low nibble) and at depth 16 + 4 i + t (high nibble);
//   Q8_0: 16 float16 d, then 8 x 64 bytes: vector g, byte 4 j + t = column j's q at depth
//         4 g + t, plus 128;
//   Q5_0: 16 float16 d, then Q4_1's 4 x 64 bytes of low nibbles (of the 5-bit q in [0, 31],
//         w = d (q - 16)), then per vector i, half h (its 32 bytes) and nibble n (low, high)
//         a 32-bit word at 16 i + 8 h + 4 n whose bit b is the fifth bit of byte b's value:
//         the file's 352 bytes per 16 x 32. sum(w x) ~ (d dx) (sum(q qx) - 16 sx).
//   Q4_K: per panel and 256-deep block, 16 float16 d, 16 float16 dmin, 8 x 16 6-bit scales
//         and 8 x 16 mins (sub-block, column; bytes), then per 32-deep sub-block s Q4_1's
//         4 x 64 bytes of nibble lanes (2,368 bytes, as the exact kernel's record): sub-block
//         s is a Q4_1 block with d' = d scale_s and m' = -(dmin min_s), folded in float32.
//   Q6_K: per panel and 256-deep block, 16 float16 d, 16 x 16 int8 scales (16-deep sub-block,
//         column), then per 32-deep block Q4_1's 4 x 64 bytes of nibble lanes (the 6-bit q's
//         low 4 bits) and 4 x 32 bytes of high bits: per half h and nibble n, byte b holds
//         for vector i the two high bits of byte b's value at bits 2 i (3,360 bytes, as the
//         exact kernel's record). w = d scale (q - 32): the low nibbles are depths 0-15 of
//         the block (one sub-block, one scale), the high nibbles depths 16-31 (the next).
// From kWidenRows rows, the VNNI kernel first widens each Q5_0 or Q6_K panel to one byte a
// quant in Q8_0's order (widen_panel), once per pass, and runs Q8_0's loop on it.
// The AVX2 kernel reads each 64-byte vector as two halves of 8 columns. Compiled into every
// level's library; the VNNI kernel only into the AVX-512 one, with the VNNI instructions enabled
// per function (an AVX-512 CPU without VNNI runs the AVX2 kernel there).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include "kernel_library.h"
#include "kernel_ops.h"

#include <immintrin.h>

#include "activation_rounding.h"
#include "gemm_microkernel.h"
#include "panel_output.h"
#include "prefetch_lines.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <optional>
#include <vector>

namespace {

using pipellm_kernels::GroupScale;
using pipellm_kernels::kPanel;
using pipellm_kernels::PanelOutput;
using pipellm_kernels::prefetch_lines;
using pipellm_kernels::Rounding;

constexpr int64_t kBlock = 32;
constexpr int64_t kQ4_1 = 0, kQ8_0 = 1, kQ5_0 = 2, kQ6_K = 3, kQ4_K = 4;
constexpr int64_t kQ4_1Bytes = 2 * kPanel * 2 + kBlock * kPanel / 2;  // 320
constexpr int64_t kQ8_0Bytes = kPanel * 2 + kBlock * kPanel;          // 544
constexpr int64_t kQ5_0Bytes = kPanel * 2 + kBlock * kPanel / 2 + kBlock * kPanel / 8;  // 352
constexpr int64_t kQ4_KBytes = 2 * kPanel * 2 + 2 * 8 * kPanel + 256 * kPanel / 2;  // 2368
constexpr int64_t kQ4_KHeader = kQ4_KBytes - 256 * kPanel / 2;  // d, dmin, scales, mins
constexpr int64_t kQ6_KHeader = kPanel * 2 + 16 * kPanel;  // d, scales
constexpr int64_t kQ6_KBlockBytes = kBlock * kPanel / 2 + kBlock * kPanel / 4;  // 256 + 128
constexpr int64_t kQ6_KBytes = kQ6_KHeader + 8 * kQ6_KBlockBytes;  // 3360
constexpr int64_t bytes_of(int64_t kind) {
  switch (kind) {
    case kQ4_1: return kQ4_1Bytes;
    case kQ8_0: return kQ8_0Bytes;
    case kQ5_0: return kQ5_0Bytes;
    case kQ6_K: return kQ6_KBytes;
    default: return kQ4_KBytes;
  }
}
constexpr int64_t depth_of(int64_t kind) { return kind == kQ4_K || kind == kQ6_K ? 256 : kBlock; }
constexpr int64_t kRowsChunk = 256;      // rows of x (int8) a thread takes per pass at prefill

// x rounded to int8, with each 32-value block's scale and sums.
struct QuantizedRows {
  const int8_t* q;       // [m, depth]
  const float* scale;    // [m, blocks]: dx
  const int32_t* sum;    // [m, blocks]: sum(qx)
  const float* sum_dx;   // [m, blocks]: dx * sum(qx), Q4_1's and Q4_K's min term
  const int32_t* half_sum;  // [m, blocks, 2]: sum(qx) over each 16 values (Q6_K's sub-blocks)
};

// Kept per calling thread and reused: four tensor allocations a call add up at decode, where
// a step makes 121 calls of a few tens of microseconds each.
struct RowsBuffer {
  std::vector<int8_t> q;
  std::vector<float> scale, sum_dx;
  std::vector<int32_t> sum, half_sum;
};

// x rounded as llama.cpp rounds it for the weight's type (activation_rounding.h).
constexpr Rounding rounding_of(int64_t kind) {
  return kind == kQ4_K || kind == kQ6_K ? Rounding::kQ8_K
         : kind == kQ4_1                ? Rounding::kQ8_1
                                        : Rounding::kQ8_0;
}

QuantizedRows quantize_rows(const float* x, int64_t m, int64_t depth, Rounding rounding) {
  const int64_t blocks = depth / kBlock;
  const int64_t group = pipellm_kernels::group_values(rounding) / kBlock;  // blocks per scale
  thread_local RowsBuffer buffer;
  buffer.q.resize(m * depth);
  buffer.scale.resize(m * blocks);
  buffer.sum.resize(m * blocks);
  buffer.sum_dx.resize(m * blocks);
  buffer.half_sum.resize(m * blocks * 2);
  int8_t* q = buffer.q.data();
  float* scale = buffer.scale.data();
  int32_t* sum = buffer.sum.data();
  float* sum_dx = buffer.sum_dx.data();
  int32_t* half_sum = buffer.half_sum.data();
  // Rows are contiguous and depth a multiple of the group: group g is blocks g group.. of x.
  at::parallel_for(0, m * blocks / group, 64 / group, [&](int64_t first, int64_t last) {
    for (int64_t g = first; g < last; ++g) {
      const float amax = pipellm_kernels::max_magnitude(x + g * group * kBlock, group * kBlock);
      const GroupScale gs = pipellm_kernels::group_scale(amax, rounding);
      const float dx = pipellm_kernels::block_dx(gs, rounding);
      for (int64_t i = g * group; i < (g + 1) * group; ++i) {
        int32_t* halves = half_sum + 2 * i;
        pipellm_kernels::round_block(x + i * kBlock, gs.inverse, q + i * kBlock, halves);
        sum[i] = halves[0] + halves[1];
        scale[i] = dx;
        sum_dx[i] = pipellm_kernels::block_sum_dx(gs, rounding, sum[i]);
      }
    }
  });
  return {q, scale, sum, sum_dx, half_sum};
}

// What a register block prefetches while it works: for its blocks b with b % phases == phase,
// the bytes `ahead` of each record it reads (the same block of the panels the thread takes
// next), never past `end`. The register blocks of one step over the same panels take turns
// (phase = the block's index among them), so the next panels' bytes are asked for once, spread
// over the whole step rather than in a burst.
// `to_l2`: where a step's panels and the next step's do not fit L1 together, the next step's
// bytes go to L2 only, so that they do not evict this step's panels before its later register
// blocks have read them. Measured with the VNNI kernel on an AVX-512 AMD EPYC, 2 threads, 16
// rows: Gemma 3's 262,144 x 640 Q8_0 output head (2 panels a step: 21 KB) 14.7 -> 10.8 ms a
// call; no change where two steps fit (Q4_1, Q5_0 at 576 deep) nor at 2,048 rows. The AVX2
// kernel (one panel a step) measured no gain, so it keeps prefetching into L1.
struct Prefetch {
  const uint8_t* end = nullptr;
  int64_t ahead = 0, phase = 0, phases = 1;
  bool to_l2 = false;
};

// The L1 data cache a step's panels share with the next step's: 32 KB on AVX2 and AVX-512 x86
// CPUs up to Intel's Ice Lake and AMD's Zen 5, 48 KB on those (the smaller errs towards L2).
constexpr int64_t kL1Bytes = 32 * 1024;

inline void prefetch_ahead(const uint8_t* record, int64_t bytes, const Prefetch& prefetch) {
  const uint8_t* ahead = record + prefetch.ahead;
  if (ahead + bytes > prefetch.end) return;  // a prefetch past the weights can cost a page walk
  prefetch_lines(ahead, bytes, prefetch.to_l2);
}

// 32-deep block b of a panel: its record (for the K-quants the 256-deep record's header) and
// the block's quant lanes (nibbles, or Q8_0's bytes); with `prefetch` (where it is this
// register block's turn) it also asks for the same bytes of the next step's panels.
template <int64_t Kind>
inline void locate_block(const uint8_t* panel, int64_t b, const Prefetch* prefetch,
                         const uint8_t*& record, const uint8_t*& lanes) {
  if constexpr (Kind == kQ4_K || Kind == kQ6_K) {
    constexpr int64_t header = Kind == kQ4_K ? kQ4_KHeader : kQ6_KHeader;
    constexpr int64_t block_bytes = Kind == kQ4_K ? 256 : kQ6_KBlockBytes;
    record = panel + b / 8 * bytes_of(Kind);
    lanes = record + header + b % 8 * block_bytes;
    if (prefetch) {
      if (b % 8 == 0) prefetch_ahead(record, header, *prefetch);
      prefetch_ahead(lanes, block_bytes, *prefetch);
    }
  } else {
    record = panel + b * bytes_of(Kind);
    lanes = record + (Kind == kQ4_1 ? 64 : 32);
    if (prefetch) prefetch_ahead(record, bytes_of(Kind), *prefetch);
  }
}

// Whether block b is a register block's turn to prefetch (b % phases == phase), counted
// along the blocks in order: no division in the loop.
class PrefetchTurns {
 public:
  explicit PrefetchTurns(const Prefetch& prefetch) : prefetch_(prefetch), next_(prefetch.phase) {}
  const Prefetch* at(int64_t b) {
    if (b != next_) return nullptr;
    next_ += prefetch_.phases;
    return &prefetch_;
  }

 private:
  const Prefetch& prefetch_;
  int64_t next_;
};

// At one or two rows a thread walks its panels one at a time (np = 1 in quantized_linear_int8),
// and a register block of one or two rows over one panel issues no software prefetch: the
// thread's weights are then one stream read in order, which the hardware prefetcher follows at
// close to the read bandwidth, and the prefetches would only cost issue slots. Several panels
// side by side (more independent chains of vpdpbusd) made as many interleaved streams, and the
// stream, not the arithmetic, is what a one-row step waits on. Measured on Gemma 3's
// 262,144 x 640 Q8_0 output head, one row, one thread of an AVX-512 AMD EPYC: 4 panels with
// prefetches at ~14 GB/s, 1 panel without at ~25. From three rows a step's panels are read by
// several register blocks (from L1 after the first), and they fetch the next step's panels
// between them (Prefetch): its bytes then arrive while this step computes, instead of the
// first register block waiting on memory and the others on the arithmetic. Measured on the
// same CPU, a decode pass over 30 layers of SmolLM2 Q4_K_M's weights (76 MB, 2 threads):
// 16 rows 10.4 -> 8.7 ms, 4 rows 4.8 -> 4.2 ms, against a prefetch 4 KB ahead in each block.
template <int R, int NP>
constexpr bool kPrefetchWeights = !(NP == 1 && R <= 2);

// Rows of x from which the VNNI kernel takes Q5_0 and Q6_K panels widened to bytes once
// (widen_panel) rather than unpacking them in every register block of 4 rows: their unpacking
// (Q5_0's byte masks, Q6_K's high bits) then costs once per pass, and the loop becomes Q8_0's.
// Measured on an AVX-512 AMD EPYC, 2 threads: ~10% faster from 32 rows; no gain at 8-16 rows,
// and none for Q4_1 or Q4_K, whose nibbles cost one and, one shift and one and to unpack.
constexpr int64_t kWidenRows = 32;
constexpr bool widens(int64_t kind) { return kind == kQ5_0 || kind == kQ6_K; }

// Rows a VNNI register block takes at most. Panels at once: 1 at one or two rows (see
// kPrefetchWeights), else 2.
constexpr int kMaxRows = 4;

// One register block: rows [r0, r0 + R) times panels [p0, p0 + NP), whole depth.
using Int8BlockFn = void (*)(const QuantizedRows&, int64_t, const uint8_t*, int64_t, int64_t,
                             int64_t, const PanelOutput&, const Prefetch&, const uint8_t*);

#if defined(__AVX512F__)
#define PIPELLM_VNNI __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni")))

// A panel's 16 float16 scales (or mins) at p, widened to float32: exact.
inline __m512 halves16(const uint8_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// Vector i (of 4) of a 32-deep block's nibble lanes (Q4_1, Q4_K, Q5_0) as u8 quants: `lo` holds
// the 16 columns' depths 4 i.., `hi` depths 16 + 4 i... Q5_0's fifth bits become 16 through byte
// masks (AVX-512BW): the 32-bit word at 256 + 16 i + 8 h + 4 n holds half h's (bytes 32 h..)
// fifth bits of nibble n.
template <int64_t Kind>
PIPELLM_VNNI inline void unpack_nibbles(const uint8_t* lanes, int i, __m512i& lo, __m512i& hi) {
  const __m512i low = _mm512_set1_epi8(0x0F);
  const __m512i packed = _mm512_loadu_si512(lanes + 64 * i);
  lo = _mm512_and_si512(packed, low);
  hi = _mm512_and_si512(_mm512_srli_epi16(packed, 4), low);
  if constexpr (Kind == kQ5_0) {
    const __m512i sixteen = _mm512_set1_epi8(16);
    uint32_t words[4];
    __builtin_memcpy(words, lanes + 256 + 16 * i, 16);
    const __mmask64 lo_bits = words[0] | static_cast<uint64_t>(words[2]) << 32;
    const __mmask64 hi_bits = words[1] | static_cast<uint64_t>(words[3]) << 32;
    lo = _mm512_mask_blend_epi8(lo_bits, lo, _mm512_or_si512(lo, sixteen));
    hi = _mm512_mask_blend_epi8(hi_bits, hi, _mm512_or_si512(hi, sixteen));
  }
}

// A Q6_K block's high bits for nibble n (0: the low nibbles, 1: the high ones), all 4 vectors:
// half 0's 32 bytes at 256 + 32 n, half 1's at 320 + 32 n.
PIPELLM_VNNI inline __m512i q6_k_high_bits(const uint8_t* lanes, int n) {
  return _mm512_inserti64x4(
      _mm512_castsi256_si512(
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(lanes + 256 + 32 * n))),
      _mm256_loadu_si256(reinterpret_cast<const __m256i*>(lanes + 320 + 32 * n)), 1);
}

// Vector i of a Q6_K block as u8 quants in [0, 63]: the nibbles, with vector i's two high bits
// (bits 2 i of `high`) moved to bits 4-5.
PIPELLM_VNNI inline void unpack_q6_k(const uint8_t* lanes, const __m512i (&high)[2], int i,
                                     __m512i& lo, __m512i& hi) {
  const __m512i low = _mm512_set1_epi8(0x0F), high_mask = _mm512_set1_epi8(0x30);
  auto high_of = [&](__m512i v) {
    const __m512i moved =
        i < 2 ? _mm512_slli_epi16(v, 4 - 2 * i) : _mm512_srli_epi16(v, 2 * i - 4);
    return _mm512_and_si512(moved, high_mask);
  };
  const __m512i packed = _mm512_loadu_si512(lanes + 64 * i);
  lo = _mm512_or_si512(_mm512_and_si512(packed, low), high_of(high[0]));
  hi = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(packed, 4), low), high_of(high[1]));
}

// Bytes of one widened 32-deep block: 8 vectors of 64 u8 quants, vector g holding the panel's
// 16 columns at depths 4 g.. (byte 4 j + t: column j at depth 4 g + t), as Q8_0's records do.
constexpr int64_t kWidenedBlockBytes = 8 * 64;

// A panel's quants, every block, widened to bytes (kWidenedBlockBytes each) at `out`: what the
// Widened kernel reads instead of unpacking nibbles and high bits in each register block.
template <int64_t Kind>
PIPELLM_VNNI void widen_panel(const uint8_t* panel, int64_t blocks, uint8_t* out) {
  for (int64_t b = 0; b < blocks; ++b, out += kWidenedBlockBytes) {
    const uint8_t *record, *lanes;
    locate_block<Kind>(panel, b, nullptr, record, lanes);
    __m512i high[2];
    if constexpr (Kind == kQ6_K)
      for (int n = 0; n < 2; ++n) high[n] = q6_k_high_bits(lanes, n);
    for (int i = 0; i < 4; ++i) {
      __m512i lo, hi;
      if constexpr (Kind == kQ6_K)
        unpack_q6_k(lanes, high, i, lo, hi);
      else
        unpack_nibbles<Kind>(lanes, i, lo, hi);
      _mm512_storeu_si512(out + 64 * i, lo);
      _mm512_storeu_si512(out + 64 * (4 + i), hi);
    }
  }
}

// Vector g (depths 4 g..) of a block of NP panels' quants as bytes in Q8_0's order, panel p's
// 8 x 64 bytes at first + p stride (Q8_0's lanes, or the widened copy), times R rows of x at
// the same depths, into dot.
template <int R, int NP>
PIPELLM_VNNI inline void dot_bytes(const uint8_t* first, int64_t stride, int g, const int8_t* qb,
                                   int64_t depth, __m512i (&dot)[R][NP]) {
#pragma GCC unroll 8
  for (int p = 0; p < NP; ++p) {
    const __m512i w = _mm512_loadu_si512(first + p * stride + 64 * g);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      int32_t xg;
      __builtin_memcpy(&xg, qb + r * depth + 4 * g, 4);
      dot[r][p] = _mm512_dpbusd_epi32(dot[r][p], w, _mm512_set1_epi32(xg));
    }
  }
}

// Rows [r0, r0 + R) times panels [p0, p0 + NP), whole depth. Weights are unpacked once per
// group of 4 depths and used by every row, or, where Widened, read already widened
// (widen_panel: Q8_0's loop for every type); each (row, panel) keeps an int32 sum per block,
// folded into its float32 output with the block's scales, by the AVX2 kernel's operations per
// column (so all give the same bits). Q6_K's q = nibble | two high bits << 4 is in [0, 63];
// each 16-deep sub-block (one scale) keeps its own sum, started at -32 sum(qx) over its 16
// values: sum((q - 32) qx).
template <int64_t Kind, int R, int NP, bool Widened>
PIPELLM_VNNI void int8_block(const QuantizedRows& xq, int64_t r0, const uint8_t* wp,
                             int64_t panel_bytes, int64_t p0, int64_t blocks,
                             const PanelOutput& y, const Prefetch& prefetch,
                             const uint8_t* widened) {
  constexpr bool kNibbles = Kind == kQ4_1 || Kind == kQ4_K || Kind == kQ5_0;
  const int64_t depth = blocks * kBlock;
  const int8_t* q = xq.q + r0 * depth;
  const float* scale = xq.scale + r0 * blocks;
  const int32_t* sum = xq.sum + r0 * blocks;
  const float* sum_dx = xq.sum_dx + r0 * blocks;
  const int32_t* half_sum = xq.half_sum + r0 * blocks * 2;
  __m512 acc[R][NP];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int p = 0; p < NP; ++p) {
      const float* bias = y.bias(p0 + p);
      acc[r][p] = bias ? _mm512_loadu_ps(bias) : _mm512_setzero_ps();
    }
  PrefetchTurns turns(prefetch);
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* rec[NP];
    const uint8_t* lanes[NP];  // the block's 4 x 64 bytes of nibble lanes (or Q8_0's 8 x 64)
    __m512i dot[R][NP];
    const Prefetch* ahead = !Widened && kPrefetchWeights<R, NP> ? turns.at(b) : nullptr;
#pragma GCC unroll 8
    for (int p = 0; p < NP; ++p)
      locate_block<Kind>(wp + (p0 + p) * panel_bytes, b, ahead, rec[p], lanes[p]);
    // Where the loop reads bytes in Q8_0's order: the widened copy, or Q8_0's own lanes.
    const uint8_t* bytes = Widened ? widened + b * kWidenedBlockBytes : lanes[0];
    const int64_t bytes_stride = Widened ? blocks * kWidenedBlockBytes : panel_bytes;
    // Q8_0's quants are stored + 128 and Q5_0's are q + 16: start from -128 sum(qx) (or
    // -16 sum(qx)) to take the offset back out.
    constexpr int32_t kOffset = Kind == kQ8_0 ? 128 : Kind == kQ5_0 ? 16 : 0;
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
      for (int p = 0; p < NP; ++p) dot[r][p] = _mm512_set1_epi32(-kOffset * sum[r * blocks + b]);
    const int8_t* qb = q + b * kBlock;
    if constexpr (Kind == kQ6_K) {
      __m512i sub_dot[2][R][NP];  // [n]: the sub-block of depths 0-15, then that of 16-31
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
        for (int p = 0; p < NP; ++p)
          for (int n = 0; n < 2; ++n)
            sub_dot[n][r][p] = _mm512_set1_epi32(-32 * half_sum[r * blocks * 2 + 2 * b + n]);
      if constexpr (Widened) {
#pragma GCC unroll 8
        for (int g = 0; g < 8; ++g)
          dot_bytes<R, NP>(bytes, bytes_stride, g, qb, depth, sub_dot[g / 4]);
      } else {
        __m512i high[NP][2];
#pragma GCC unroll 8
        for (int p = 0; p < NP; ++p)
          for (int n = 0; n < 2; ++n) high[p][n] = q6_k_high_bits(lanes[p], n);
#pragma GCC unroll 4
        for (int i = 0; i < 4; ++i) {
#pragma GCC unroll 8
          for (int p = 0; p < NP; ++p) {
            __m512i lo, hi;
            unpack_q6_k(lanes[p], high[p], i, lo, hi);
#pragma GCC unroll 8
            for (int r = 0; r < R; ++r) {
              const int8_t* xr = qb + r * depth;
              int32_t x_lo, x_hi;
              __builtin_memcpy(&x_lo, xr + 4 * i, 4);
              __builtin_memcpy(&x_hi, xr + 16 + 4 * i, 4);
              sub_dot[0][r][p] = _mm512_dpbusd_epi32(sub_dot[0][r][p], lo, _mm512_set1_epi32(x_lo));
              sub_dot[1][r][p] = _mm512_dpbusd_epi32(sub_dot[1][r][p], hi, _mm512_set1_epi32(x_hi));
            }
          }
        }
      }
      // Each sub-block's int32 sums times its scale, d and dx, as the AVX2 kernel folds them.
#pragma GCC unroll 8
      for (int p = 0; p < NP; ++p) {
        const __m512 d = halves16(rec[p]);
        const uint8_t* scales = rec[p] + kPanel * 2 + 2 * (b % 8) * kPanel;
        __m512 sub_scale[2];
        for (int n = 0; n < 2; ++n)
          sub_scale[n] = _mm512_mul_ps(
              d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                     _mm_loadu_si128(reinterpret_cast<const __m128i*>(scales + n * kPanel)))));
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) {
          const __m512 dx = _mm512_set1_ps(scale[r * blocks + b]);
          for (int n = 0; n < 2; ++n)
            acc[r][p] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sub_dot[n][r][p]),
                                        _mm512_mul_ps(sub_scale[n], dx), acc[r][p]);
        }
      }
      continue;  // folded: the other types' fold below does not apply
    } else if constexpr (kNibbles && !Widened) {
#pragma GCC unroll 4
      for (int i = 0; i < 4; ++i) {
#pragma GCC unroll 8
        for (int p = 0; p < NP; ++p) {
          __m512i lo, hi;
          unpack_nibbles<Kind>(lanes[p], i, lo, hi);
#pragma GCC unroll 8
          for (int r = 0; r < R; ++r) {
            const int8_t* xr = qb + r * depth;
            int32_t x_lo, x_hi;  // 4 int8 of x at depths 4 i.. and 16 + 4 i..
            __builtin_memcpy(&x_lo, xr + 4 * i, 4);
            __builtin_memcpy(&x_hi, xr + 16 + 4 * i, 4);
            dot[r][p] = _mm512_dpbusd_epi32(dot[r][p], lo, _mm512_set1_epi32(x_lo));
            dot[r][p] = _mm512_dpbusd_epi32(dot[r][p], hi, _mm512_set1_epi32(x_hi));
          }
        }
      }
    } else {  // Q8_0, or widened
#pragma GCC unroll 8
      for (int g = 0; g < 8; ++g) dot_bytes<R, NP>(bytes, bytes_stride, g, qb, depth, dot);
    }
#pragma GCC unroll 8
    for (int p = 0; p < NP; ++p) {
      __m512 d = halves16(rec[p]);
      __m512 mins = _mm512_setzero_ps();
      if constexpr (Kind == kQ4_1) mins = halves16(rec[p] + 32);
      if constexpr (Kind == kQ4_K) {  // the sub-block's d scale and -(dmin min)
        const uint8_t* sub = rec[p] + 64 + b % 8 * kPanel;
        auto widen = [](const uint8_t* bytes) {
          return _mm512_cvtepi32_ps(
              _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes))));
        };
        d = _mm512_mul_ps(d, widen(sub));
        const __m512 minus_dmin = _mm512_castsi512_ps(
            _mm512_xor_si512(_mm512_castps_si512(halves16(rec[p] + 32)),
                             _mm512_set1_epi32(static_cast<int32_t>(0x80000000u))));
        mins = _mm512_mul_ps(minus_dmin, widen(sub + 8 * kPanel));
      }
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const __m512 ddx = _mm512_mul_ps(d, _mm512_set1_ps(scale[r * blocks + b]));
        acc[r][p] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[r][p]), ddx, acc[r][p]);
        if constexpr (Kind == kQ4_1 || Kind == kQ4_K)
          acc[r][p] = _mm512_fmadd_ps(mins, _mm512_set1_ps(sum_dx[r * blocks + b]), acc[r][p]);
      }
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int p = 0; p < NP; ++p)
      _mm512_storeu_ps(y.dst(p0 + p) + (r0 + r) * y.ld(p0 + p), acc[r][p]);
}

template <int64_t Kind, int R, bool Widened>
constexpr Int8BlockFn kByPanels[2] = {int8_block<Kind, R, 1, Widened>,
                                      int8_block<Kind, R, 2, Widened>};
// kInt8Block<Kind, Widened>[R - 1][NP - 1]
template <int64_t Kind, bool Widened>
constexpr const Int8BlockFn* kInt8Block[kMaxRows] = {
    kByPanels<Kind, 1, Widened>, kByPanels<Kind, 2, Widened>, kByPanels<Kind, 3, Widened>,
    kByPanels<Kind, 4, Widened>};

// Panels [p, p + n) of a Q5_0 or Q6_K weight widened into this thread's buffer, returned.
const uint8_t* widen_panels(int64_t kind, const uint8_t* wp, int64_t panel_bytes, int64_t p,
                            int64_t n, int64_t blocks) {
  thread_local std::vector<__m512i> buffer;  // 64-byte aligned: whole vectors
  buffer.resize(n * blocks * kWidenedBlockBytes / sizeof(__m512i));
  uint8_t* out = reinterpret_cast<uint8_t*>(buffer.data());
  for (int64_t i = 0; i < n; ++i) {
    const uint8_t* panel = wp + (p + i) * panel_bytes;
    uint8_t* dst = out + i * blocks * kWidenedBlockBytes;
    if (kind == kQ5_0)
      widen_panel<kQ5_0>(panel, blocks, dst);
    else
      widen_panel<kQ6_K>(panel, blocks, dst);
  }
  return out;
}

bool cpu_has_vnni() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512vnni");
}
#endif  // defined(__AVX512F__)

// The 32-bit word at p, bit b -> byte b: 16 where set, 0 where clear (a Q5_0 fifth bit).
inline __m256i sixteens(const uint8_t* p) {
  int32_t bits;
  __builtin_memcpy(&bits, p, 4);
  const __m256i spread = _mm256_shuffle_epi8(
      _mm256_set1_epi32(bits),
      _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2,
                       3, 3, 3, 3, 3, 3, 3, 3));
  const __m256i bit = _mm256_set1_epi64x(static_cast<int64_t>(0x8040201008040201ULL));
  return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit),
                          _mm256_set1_epi8(16));
}

// The AVX2 kernel: rows [r0, r0 + R) times panels [p0, p0 + NP), each panel as two halves of
// 8 columns (R x NP x 2 int32 and float32 accumulators: R x NP <= 3 fits the 16 registers).
// vpmaddubsw multiplies u8 weights by s8 x and adds neighbouring pairs into int16, vpmaddwd
// adds the int16 pairs into the int32 lane: a column's 4 depths per lane, as vpdpbusd.
// Q4_1: a pair is at most 2 x 15 x 127, so a block's 8 pairs add up in int16 (<= 30480)
// before one vpmaddwd. Q8_0: |w| times x carrying w's sign (vpsignb), at most 2 x 128 x 127 a
// pair, widened at once; w = stored - 128, so no sum correction. Q5_0: a pair is at most
// 2 x 31 x 127, so two vectors' pairs (4 a lane) add up in int16 (<= 31496) before vpmaddwd,
// and the block's int32 sum less 16 sum(qx) is sum((q - 16) qx).
template <int64_t Kind, int R, int NP>
void int8_block_avx2(const QuantizedRows& xq, int64_t r0, const uint8_t* wp, int64_t panel_bytes,
                     int64_t p0, int64_t blocks, const PanelOutput& y, const Prefetch& prefetch,
                     const uint8_t* /*widened: the VNNI kernel's only*/) {
  const int64_t depth = blocks * kBlock;
  const int8_t* q = xq.q + r0 * depth;
  const float* scale = xq.scale + r0 * blocks;
  const int32_t* sum = xq.sum + r0 * blocks;
  const float* sum_dx = xq.sum_dx + r0 * blocks;
  __m256 acc[R][NP][2];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int p = 0; p < NP; ++p)
      for (int h = 0; h < 2; ++h) {
        const float* bias = y.bias(p0 + p);
        acc[r][p][h] = bias ? _mm256_loadu_ps(bias + 8 * h) : _mm256_setzero_ps();
      }
  const __m256i low = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  PrefetchTurns turns(prefetch);
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* rec[NP];
    const uint8_t* nibbles[NP];  // the block's quant lanes (Q4_1, Q4_K, Q6_K read them here)
    __m256i dot[R][NP][2];
    const Prefetch* ahead = kPrefetchWeights<R, NP> ? turns.at(b) : nullptr;
#pragma GCC unroll 8
    for (int p = 0; p < NP; ++p)
      locate_block<Kind>(wp + (p0 + p) * panel_bytes, b, ahead, rec[p], nibbles[p]);
    const int8_t* qb = q + b * kBlock;
    if constexpr (Kind == kQ4_1 || Kind == kQ4_K) {
      __m256i pairs[R][NP][2];
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
        for (int p = 0; p < NP; ++p)
          for (int h = 0; h < 2; ++h) pairs[r][p][h] = _mm256_setzero_si256();
#pragma GCC unroll 4
      for (int i = 0; i < 4; ++i) {
        __m256i x_lo[R], x_hi[R];  // 4 int8 of x at depths 4 i.. and 16 + 4 i.., broadcast
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) {
          int32_t lo4, hi4;
          __builtin_memcpy(&lo4, qb + r * depth + 4 * i, 4);
          __builtin_memcpy(&hi4, qb + r * depth + 16 + 4 * i, 4);
          x_lo[r] = _mm256_set1_epi32(lo4), x_hi[r] = _mm256_set1_epi32(hi4);
        }
#pragma GCC unroll 8
        for (int p = 0; p < NP; ++p)
          for (int h = 0; h < 2; ++h) {
            const __m256i packed =
                _mm256_loadu_si256(reinterpret_cast<const __m256i*>(nibbles[p] + 64 * i + 32 * h));
            const __m256i lo = _mm256_and_si256(packed, low);
            const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(packed, 4), low);
#pragma GCC unroll 8
            for (int r = 0; r < R; ++r)
              pairs[r][p][h] = _mm256_add_epi16(
                  pairs[r][p][h], _mm256_add_epi16(_mm256_maddubs_epi16(lo, x_lo[r]),
                                                   _mm256_maddubs_epi16(hi, x_hi[r])));
          }
      }
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
        for (int p = 0; p < NP; ++p)
          for (int h = 0; h < 2; ++h) dot[r][p][h] = _mm256_madd_epi16(pairs[r][p][h], ones);
    } else if constexpr (Kind == kQ6_K) {
      // pairs[..][n]: n = 0 the low nibbles' sub-block, 1 the high ones'. |w| <= 32, so a
      // pair is at most 2 x 32 x 127 and the block's 4 vectors add up in int16 (<= 32512).
      __m256i pairs[R][NP][2][2];
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
        for (int p = 0; p < NP; ++p)
          for (int h = 0; h < 2; ++h)
            pairs[r][p][h][0] = pairs[r][p][h][1] = _mm256_setzero_si256();
      const __m256i high_mask = _mm256_set1_epi8(0x30), thirty_two = _mm256_set1_epi8(32);
#pragma GCC unroll 4
      for (int i = 0; i < 4; ++i) {
        __m256i x_lo[R], x_hi[R];
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) {
          int32_t lo4, hi4;
          __builtin_memcpy(&lo4, qb + r * depth + 4 * i, 4);
          __builtin_memcpy(&hi4, qb + r * depth + 16 + 4 * i, 4);
          x_lo[r] = _mm256_set1_epi32(lo4), x_hi[r] = _mm256_set1_epi32(hi4);
        }
        // vector i's two high bits (at bits 2 i) to bits 4-5
        auto high_of = [&](const uint8_t* bytes) {
          const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bytes));
          const __m256i moved =
              i < 2 ? _mm256_slli_epi16(v, 4 - 2 * i) : _mm256_srli_epi16(v, 2 * i - 4);
          return _mm256_and_si256(moved, high_mask);
        };
#pragma GCC unroll 8
        for (int p = 0; p < NP; ++p)
          for (int h = 0; h < 2; ++h) {
            const __m256i packed =
                _mm256_loadu_si256(reinterpret_cast<const __m256i*>(nibbles[p] + 64 * i + 32 * h));
            const uint8_t* high = nibbles[p] + 256 + 64 * h;
            const __m256i lo = _mm256_sub_epi8(
                _mm256_or_si256(_mm256_and_si256(packed, low), high_of(high)), thirty_two);
            const __m256i hi = _mm256_sub_epi8(
                _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(packed, 4), low),
                                high_of(high + 32)),
                thirty_two);
            const __m256i lo_magnitude = _mm256_abs_epi8(lo), hi_magnitude = _mm256_abs_epi8(hi);
#pragma GCC unroll 8
            for (int r = 0; r < R; ++r) {
              const __m256i lo_products =
                  _mm256_maddubs_epi16(lo_magnitude, _mm256_sign_epi8(x_lo[r], lo));
              const __m256i hi_products =
                  _mm256_maddubs_epi16(hi_magnitude, _mm256_sign_epi8(x_hi[r], hi));
              pairs[r][p][h][0] = _mm256_add_epi16(pairs[r][p][h][0], lo_products);
              pairs[r][p][h][1] = _mm256_add_epi16(pairs[r][p][h][1], hi_products);
            }
          }
      }
      // Each sub-block's int32 sums times its d scale dx.
#pragma GCC unroll 8
      for (int p = 0; p < NP; ++p)
        for (int h = 0; h < 2; ++h) {
          const __m256 d =
              _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(rec[p] + 16 * h)));
          const uint8_t* scales = rec[p] + kPanel * 2 + 2 * (b % 8) * kPanel + 8 * h;
          __m256 sub_scale[2];
          for (int n = 0; n < 2; ++n)
            sub_scale[n] = _mm256_mul_ps(
                d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(
                       reinterpret_cast<const __m128i*>(scales + n * kPanel)))));
#pragma GCC unroll 8
          for (int r = 0; r < R; ++r) {
            const __m256 dx = _mm256_set1_ps(scale[r * blocks + b]);
            for (int n = 0; n < 2; ++n)
              acc[r][p][h] = _mm256_fmadd_ps(
                  _mm256_cvtepi32_ps(_mm256_madd_epi16(pairs[r][p][h][n], ones)),
                  _mm256_mul_ps(sub_scale[n], dx), acc[r][p][h]);
          }
        }
      continue;  // folded: the other types' fold below does not apply
    } else if constexpr (Kind == kQ5_0) {
      __m256i pairs[R][NP][2];
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
        for (int p = 0; p < NP; ++p)
          for (int h = 0; h < 2; ++h) {
            pairs[r][p][h] = _mm256_setzero_si256();
            dot[r][p][h] = _mm256_set1_epi32(-16 * sum[r * blocks + b]);
          }
#pragma GCC unroll 4
      for (int i = 0; i < 4; ++i) {
        __m256i x_lo[R], x_hi[R];
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) {
          int32_t lo4, hi4;
          __builtin_memcpy(&lo4, qb + r * depth + 4 * i, 4);
          __builtin_memcpy(&hi4, qb + r * depth + 16 + 4 * i, 4);
          x_lo[r] = _mm256_set1_epi32(lo4), x_hi[r] = _mm256_set1_epi32(hi4);
        }
#pragma GCC unroll 8
        for (int p = 0; p < NP; ++p)
          for (int h = 0; h < 2; ++h) {
            const uint8_t* fifth = rec[p] + 32 + 256 + 16 * i + 8 * h;
            const __m256i packed =
                _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rec[p] + 32 + 64 * i + 32 * h));
            const __m256i lo = _mm256_or_si256(_mm256_and_si256(packed, low), sixteens(fifth));
            const __m256i hi = _mm256_or_si256(
                _mm256_and_si256(_mm256_srli_epi16(packed, 4), low), sixteens(fifth + 4));
#pragma GCC unroll 8
            for (int r = 0; r < R; ++r)
              pairs[r][p][h] = _mm256_add_epi16(
                  pairs[r][p][h], _mm256_add_epi16(_mm256_maddubs_epi16(lo, x_lo[r]),
                                                   _mm256_maddubs_epi16(hi, x_hi[r])));
          }
        if (i % 2 == 1)
#pragma GCC unroll 8
          for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
            for (int p = 0; p < NP; ++p)
              for (int h = 0; h < 2; ++h) {
                dot[r][p][h] =
                    _mm256_add_epi32(dot[r][p][h], _mm256_madd_epi16(pairs[r][p][h], ones));
                pairs[r][p][h] = _mm256_setzero_si256();
              }
      }
    } else {
      const __m256i offset = _mm256_set1_epi8(static_cast<char>(0x80));
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
        for (int p = 0; p < NP; ++p)
          for (int h = 0; h < 2; ++h) dot[r][p][h] = _mm256_setzero_si256();
#pragma GCC unroll 8
      for (int g = 0; g < 8; ++g) {
        __m256i xg[R];
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) {
          int32_t x4;
          __builtin_memcpy(&x4, qb + r * depth + 4 * g, 4);
          xg[r] = _mm256_set1_epi32(x4);
        }
#pragma GCC unroll 8
        for (int p = 0; p < NP; ++p)
          for (int h = 0; h < 2; ++h) {
            const __m256i w = _mm256_xor_si256(
                _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rec[p] + 32 + 64 * g + 32 * h)),
                offset);
            const __m256i magnitude = _mm256_abs_epi8(w);
#pragma GCC unroll 8
            for (int r = 0; r < R; ++r) {
              const __m256i products = _mm256_maddubs_epi16(magnitude, _mm256_sign_epi8(xg[r], w));
              dot[r][p][h] = _mm256_add_epi32(dot[r][p][h], _mm256_madd_epi16(products, ones));
            }
          }
      }
    }
#pragma GCC unroll 8
    for (int p = 0; p < NP; ++p)
      for (int h = 0; h < 2; ++h) {
        __m256 d =
            _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(rec[p] + 16 * h)));
        __m256 mins = _mm256_setzero_ps();
        if constexpr (Kind == kQ4_1)
          mins = _mm256_cvtph_ps(
              _mm_loadu_si128(reinterpret_cast<const __m128i*>(rec[p] + 32 + 16 * h)));
        if constexpr (Kind == kQ4_K) {  // the sub-block's d scale and -(dmin min)
          const __m256 dmin = _mm256_cvtph_ps(
              _mm_loadu_si128(reinterpret_cast<const __m128i*>(rec[p] + 32 + 16 * h)));
          const uint8_t* sub = rec[p] + 64 + b % 8 * kPanel + 8 * h;
          auto widen = [](const uint8_t* bytes) {
            return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(
                _mm_loadl_epi64(reinterpret_cast<const __m128i*>(bytes))));
          };
          d = _mm256_mul_ps(d, widen(sub));
          const __m256 minus_dmin = _mm256_xor_ps(dmin, _mm256_set1_ps(-0.0f));
          mins = _mm256_mul_ps(minus_dmin, widen(sub + 8 * kPanel));
        }
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) {
          const __m256 ddx = _mm256_mul_ps(d, _mm256_set1_ps(scale[r * blocks + b]));
          acc[r][p][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[r][p][h]), ddx, acc[r][p][h]);
          if constexpr (Kind == kQ4_1 || Kind == kQ4_K)
            acc[r][p][h] =
                _mm256_fmadd_ps(mins, _mm256_set1_ps(sum_dx[r * blocks + b]), acc[r][p][h]);
        }
      }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int p = 0; p < NP; ++p)
      for (int h = 0; h < 2; ++h)
        _mm256_storeu_ps(y.dst(p0 + p) + (r0 + r) * y.ld(p0 + p) + 8 * h, acc[r][p][h]);
}

// Register blocks the AVX2 kernel runs: 1, 2 or 3 rows x 1 panel.
constexpr int kMaxRowsAvx2 = 3;
template <int64_t Kind>
Int8BlockFn int8_block_avx2_for(int64_t rows) {
  if (rows == 1) return int8_block_avx2<Kind, 1, 1>;
  return rows == 2 ? int8_block_avx2<Kind, 2, 1> : int8_block_avx2<Kind, 3, 1>;
}

}  // namespace

at::Tensor pipellm_ops::quantized_linear_int8(const at::Tensor& input, const at::Tensor& packed,
                                              int64_t kind, const std::optional<at::Tensor>& bias,
                                              int64_t out_features) {
#if defined(__AVX512F__)
  // Either kernel computes the same sums (the AVX2 one runs where there is no VNNI).
  static const bool vnni = cpu_has_vnni();
#else
  constexpr bool vnni = false;
#endif
  TORCH_CHECK(kind >= kQ4_1 && kind <= kQ4_K, "quantized_linear_int8: kind 0 (Q4_1), 1 (Q8_0), ",
              "2 (Q5_0), 3 (Q6_K) or 4 (Q4_K), not ", kind);
  TORCH_CHECK(input.scalar_type() == at::kFloat && input.device().is_cpu() && input.dim() == 2,
              "quantized_linear_int8: x must be a 2-D float32 CPU tensor");
  const int64_t bytes = bytes_of(kind);
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.dim() == 3 && packed.is_contiguous() &&
                  packed.size(2) == bytes && packed.size(1) * depth_of(kind) == input.size(1),
              "quantized_linear_int8: weight not packed by pack_int8_weight for this "
              "in_features and kind");
  const int64_t panels = packed.size(0), m = input.size(0), depth = input.size(1);
  const at::Tensor x = input.contiguous();
  PanelOutput y(m, out_features, panels, bias, x.options());
  if (y.empty()) return y.finish();
  const QuantizedRows xq = quantize_rows(x.data_ptr<float>(), m, depth, rounding_of(kind));
  const uint8_t* wp = packed.data_ptr<uint8_t>();
  const int64_t panel_bytes = packed.size(1) * bytes, blocks = depth / kBlock;
  const uint8_t* end = wp + panels * panel_bytes;
  at::parallel_for(0, panels, 1, [&](int64_t first, int64_t last) {
    for (int64_t c0 = 0; c0 < m; c0 += kRowsChunk) {
      const int64_t count = std::min(m, c0 + kRowsChunk) - c0;
      // Rows in register blocks of near-equal size (5 = 3 + 2, not 4 + 1); panels at once: 2
      // for the VNNI kernel past two rows, else 1 (kPrefetchWeights).
      const int64_t max_rows = vnni ? kMaxRows : kMaxRowsAvx2;
      const int64_t row_blocks = (count + max_rows - 1) / max_rows;
      const int64_t np = vnni && count > 2 ? 2 : 1;  // 1: one stream (kPrefetchWeights)
      const bool widen = vnni && widens(kind) && count >= kWidenRows;
      const bool to_l2 = vnni && 2 * np * panel_bytes > kL1Bytes;
      for (int64_t p = first; p < last; p += np) {
        const int64_t n = std::min(np, last - p);
        const uint8_t* widened = nullptr;
#if defined(__AVX512F__)
        if (widen) widened = widen_panels(kind, wp, panel_bytes, p, n, blocks);
#endif
        for (int64_t i = 0, r = c0; i < row_blocks; ++i) {
          const int64_t rows = count / row_blocks + (i < count % row_blocks ? 1 : 0);
          Int8BlockFn fn = kind == kQ4_1   ? int8_block_avx2_for<kQ4_1>(rows)
                           : kind == kQ8_0 ? int8_block_avx2_for<kQ8_0>(rows)
                           : kind == kQ5_0 ? int8_block_avx2_for<kQ5_0>(rows)
                           : kind == kQ6_K ? int8_block_avx2_for<kQ6_K>(rows)
                                           : int8_block_avx2_for<kQ4_K>(rows);
#if defined(__AVX512F__)
          if (widen)
            fn = kind == kQ5_0 ? kInt8Block<kQ5_0, true>[rows - 1][n - 1]
                               : kInt8Block<kQ6_K, true>[rows - 1][n - 1];
          else if (vnni)
            fn = kind == kQ4_1   ? kInt8Block<kQ4_1, false>[rows - 1][n - 1]
                 : kind == kQ8_0 ? kInt8Block<kQ8_0, false>[rows - 1][n - 1]
                 : kind == kQ5_0 ? kInt8Block<kQ5_0, false>[rows - 1][n - 1]
                 : kind == kQ6_K ? kInt8Block<kQ6_K, false>[rows - 1][n - 1]
                                 : kInt8Block<kQ4_K, false>[rows - 1][n - 1];
#endif
          fn(xq, r, wp, panel_bytes, p, blocks, y,
             Prefetch{end, np * panel_bytes, i, row_blocks, to_l2}, widened);
          r += rows;
        }
      }
    }
  });
  return y.finish();
}

PIPELLM_LIBRARY_FRAGMENT(m) {
  m.def("quantized_linear_int8(Tensor x, Tensor packed, int kind, Tensor? bias, "
        "int out_features) -> Tensor",
        &pipellm_ops::quantized_linear_int8);
}
