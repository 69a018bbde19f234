// y = x W^T + b in float32, with W kept in a GGUF quantized format (Q4_1, Q8_0 or Q5_0) and
// dequantized on the fly for the same 6 x 16 register block as packed_linear: at 1-4 rows of x
// in registers, depth by depth; at more rows slice by slice into an L1-sized float32 buffer
// that every row block of x then uses.
//
// Why: a decode step at a few rows streams every weight from memory once. At 4-5 bits a
// weight instead of 32, that stream shrinks 5-6x, and the step becomes bound by arithmetic.
// The values are exact: a Q4_1 weight is d * q + m with d, m float16 and q in [0, 15], a Q8_0
// weight d * q with q in [-128, 127]; d * q fits a float32 mantissa, so one fused multiply-add
// rounds exactly as the dequantize-then-add that `gguf` does. The products and sums then run
// in the same order as packed_linear's, so the outputs are bit-identical to packing the
// dequantized float32 weights.
//
// Layout (made by pipellm/model/gguf_linear.py): per panel of 16 output columns and per block
// of 32 input rows, one record:
//   Q4_1: 16 float16 scales d, 16 float16 mins m (as in the file: widened exactly to float32 by
//         F16C's vcvtph2ps, and a sixth fewer bytes to stream than float32 copies), then
//         32 x 8 bytes: at depth k, byte j holds
//         column j's q in its low nibble and column j + 8's in its high nibble;
//   Q8_0: 16 float16 scales d, then 32 x 16 int8 q, column j at byte j;
//   Q5_0: 16 float16 scales d, then 32 x 8 bytes of low nibbles as Q4_1's, then 4 x 16 bytes:
//         for depths 8 g..8 g + 7, byte j holds column j's fifth bits INVERTED, depth 8 g + t
//         at bit t; w = d (q - 16) = d (low - 16 (1 - fifth)), which like Q8_0's d q is one
//         exact product (the same size in memory as the file's blocks). One shift and mask a
//         depth take the bit out, where a 16-bit word per depth took a broadcast, a shuffle
//         and a compare.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include "kernel_library.h"
#include "kernel_ops.h"

#include <immintrin.h>

#include "gemm_microkernel.h"
#include "panel_output.h"
#include "prefetch_lines.h"

#include <algorithm>
#include <array>
#include <cstdint>
#include <type_traits>
#include <utility>
#include <optional>

namespace {

using pipellm_kernels::kPanel;
using pipellm_kernels::kRowBlock;
using pipellm_kernels::prefetch_lines;
using pipellm_kernels::for_each_row_block;
using pipellm_kernels::for_each_slice_pass;
using pipellm_kernels::PanelOutput;

constexpr int64_t kBlock = 32;          // GGUF block: input rows sharing one scale
constexpr int64_t kSliceDepth = 256;    // depth dequantized at a time: 16 KB of float32
#if defined(__AVX512F__)
constexpr int64_t kRowsBlock = 384;     // above 64 rows: rows of x per pass (384 KB in L2)
#else
constexpr int64_t kRowsBlock = 192;     // above 64 rows: rows of x per pass (192 KB in L2)
#endif
constexpr int64_t kQ4_1 = 0, kQ8_0 = 1, kQ5_0 = 2, kQ6_K = 3, kQ4_K = 4;  // `kind`
constexpr int64_t kPrefetchBytes = 4096;  // ~10 Q4_1 records ahead
// Up to this many rows, the weights are dequantized in registers (fused_row_block): measured
// at 1, 3 and 4 rows 9.2, 11.8 and 13.3 ms per step's GEMMs against 13-14 ms through a slice;
// at 6 rows the accumulators, scales and weights no longer fit in registers (19.9 vs 16.5 ms).
#if defined(__AVX512F__)
constexpr int64_t kFusedRows = 8;  // 32 registers: room for more accumulators
#else
constexpr int64_t kFusedRows = 4;
#endif

// Prefetches the record kPrefetchBytes ahead, if it is before `end`: the hardware prefetcher
// alone leaves the stream well below the read bandwidth while the core is busy dequantizing,
// and a prefetch past the weights can cost a page walk. `to_l2`: into L2 only (fused_panels).
inline void prefetch_ahead(const uint8_t* record, int64_t bytes, const uint8_t* end,
                           bool to_l2 = false) {
  const uint8_t* ahead = record + kPrefetchBytes;
  if (ahead + bytes > end) return;
  prefetch_lines(ahead, bytes, to_l2);
}

// 8 (or 16) float16 values at p, widened to float32: exact.
inline __m256 half_to_float(const uint8_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
#if defined(__AVX512F__)
inline __m512 half16_to_float(const uint8_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
#endif

// A panel's 16 columns in registers, at the level's vector width.
#if defined(__AVX512F__)
struct Columns {
  __m512 v;
  static Columns load(const float* p) { return {_mm512_loadu_ps(p)}; }
  static Columns zero() { return {_mm512_setzero_ps()}; }
  void store(float* p) const { _mm512_storeu_ps(p, v); }
  // this + x w, one rounding per column
  void fma(const float* x, const Columns& w) { v = _mm512_fmadd_ps(_mm512_set1_ps(*x), w.v, v); }
};
#else
struct Columns {
  __m256 lo, hi;
  static Columns load(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
  static Columns zero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
  void store(float* p) const { _mm256_storeu_ps(p, lo), _mm256_storeu_ps(p + 8, hi); }
  void fma(const float* x, const Columns& w) {
    const __m256 xv = _mm256_broadcast_ss(x);
    lo = _mm256_fmadd_ps(xv, w.lo, lo), hi = _mm256_fmadd_ps(xv, w.hi, hi);
  }
};
#endif

// One depth's 16 nibbles from its 8 bytes at p (byte j holds column j in its low nibble and
// column j + 8 in its high one), as bytes, column j at byte j.
inline __m128i depth_nibbles(const uint8_t* p) {
  const __m128i low = _mm_set1_epi8(0x0F);
  const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  return _mm_unpacklo_epi64(_mm_and_si128(bytes, low),
                            _mm_and_si128(_mm_srli_epi16(bytes, 4), low));
}

// Two depths' nibbles (depths k and k + 1, 8 bytes each from p) with one load and one unpack.
// Why: at one or two rows the exact kernels are bound by the vector operations that widen
// each weight, and on AVX-512 the byte unpacking is a third of them. Measured on an AVX-512
// AMD EPYC, 2 threads, one row: Q4_1, Q5_0, Q4_K and Q6_K GEMMs 7-24% faster; at the AVX2
// level (PIPELLM_CPU_ISA=avx2) Q5_0 and Q6_K 7-11%.
inline void nibble_pair(const uint8_t* p, __m128i& v0, __m128i& v1) {
  const __m128i low = _mm_set1_epi8(0x0F);
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m128i lo = _mm_and_si128(bytes, low);
  const __m128i hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), low);
  v0 = _mm_unpacklo_epi64(lo, hi);
  v1 = _mm_unpackhi_epi64(lo, hi);
}

// The records below give the 16 columns at depth k as
//   enter(k): the scales of k's sub-block (K-quants; k = 0, 1, ... in order),
//   values(k): the columns' quants as bytes, and value_pair(k) those of depths k and k + 1,
//   widen(v): the quants as float32 weights, gguf's own rounding (one register at the
//   AVX-512 level, two halves of 8 columns at the AVX2 one),
// except that at the AVX2 level Q4_1 and Q4_K widen their nibbles in at() directly.

// One record (a 32-deep block of a panel), dequantized depth by depth into registers.
struct Q4_1Record {
  static constexpr int64_t kDepth = kBlock;
  static constexpr int64_t kBytes = 2 * kPanel * 2 + kBlock * kPanel / 2;
  __m256 d0, d1, m0, m1;
  const uint8_t* q;
  explicit Q4_1Record(const uint8_t* record) {
    d0 = half_to_float(record), d1 = half_to_float(record + 16);
    m0 = half_to_float(record + 32), m1 = half_to_float(record + 48);
#if defined(__AVX512F__)
    d = half16_to_float(record), m = half16_to_float(record + 32);
#endif
    q = record + 2 * kPanel * 2;
  }
  // Columns 0-7 and 8-15 at depth k: byte j holds column j (low nibble) and j + 8 (high).
  void at(int64_t k, __m256& w0, __m256& w1) const {
    const __m128i low = _mm_set1_epi8(0x0F);
    const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + k * 8));
    const __m128i lo = _mm_and_si128(bytes, low);
    const __m128i hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), low);
    w0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo)), d0, m0);
    w1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi)), d1, m1);
  }
#if defined(__AVX512F__)
  __m512 d, m;
  void enter(int64_t) {}
  __m128i values(int64_t k) const { return depth_nibbles(q + k * 8); }
  void value_pair(int64_t k, __m128i& v0, __m128i& v1) const { nibble_pair(q + k * 8, v0, v1); }
  // All 16 columns in one register: the same per-column fma(q, d, m), so the same bits.
  __m512 widen(__m128i v) const {
    return _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(v)), d, m);
  }
  void at(int64_t k, __m512& w) const { w = widen(values(k)); }
  void at(int64_t k, Columns& w) const { at(k, w.v); }
#else
  void at(int64_t k, Columns& w) const { at(k, w.lo, w.hi); }
#endif
};

// The 16 columns at depth k of a record whose weights are int8 values(k) times the per-column
// scale d (Q8_0, Q5_0): one conversion and one product each, gguf's own rounding. CRTP, so the
// record's values() inlines into the templated kernel.
template <class Record>
struct ScaledInt8Columns {
  __m256 d0, d1;
#if defined(__AVX512F__)
  __m512 d;
#endif
  explicit ScaledInt8Columns(const uint8_t* scales) {  // the panel's 16 float16 scales
    d0 = half_to_float(scales), d1 = half_to_float(scales + 16);
#if defined(__AVX512F__)
    d = half16_to_float(scales);
#endif
  }
  void enter(int64_t) {}
  // Columns 0-7 and 8-15 of the quants v (column j at byte j) as weights.
  void widen(__m128i v, __m256& w0, __m256& w1) const {
    w0 = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v)), d0);
    w1 = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(v, 8))), d1);
  }
  void at(int64_t k, __m256& w0, __m256& w1) const {
    widen(static_cast<const Record*>(this)->values(k), w0, w1);
  }
#if defined(__AVX512F__)
  __m512 widen(__m128i v) const {
    return _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(v)), d);
  }
  void at(int64_t k, __m512& w) const { w = widen(static_cast<const Record*>(this)->values(k)); }
  void at(int64_t k, Columns& w) const { at(k, w.v); }
#else
  void at(int64_t k, Columns& w) const { at(k, w.lo, w.hi); }
#endif
};

// Q8_0 has no value_pair: its values are one load a depth, nothing to unpack.
struct Q8_0Record : ScaledInt8Columns<Q8_0Record> {
  static constexpr int64_t kDepth = kBlock;
  static constexpr int64_t kBytes = kPanel * 2 + kBlock * kPanel;
  const uint8_t* q;
  explicit Q8_0Record(const uint8_t* record) : ScaledInt8Columns(record), q(record + kPanel * 2) {}
  __m128i values(int64_t k) const {
    return _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + k * kPanel));
  }
};

struct Q5_0Record : ScaledInt8Columns<Q5_0Record> {
  static constexpr int64_t kDepth = kBlock;
  static constexpr int64_t kBytes = kPanel * 2 + kBlock * kPanel / 2 + kBlock * 2;
  const uint8_t* q;
  const uint8_t* high;
  // The current 8 depths' inverted fifth bits, shifted right once a depth: bit 0 of byte j is
  // column j's at the next depth. values() is called for k = 0, 1, ... in order.
  mutable __m128i bits;
  explicit Q5_0Record(const uint8_t* record)
      : ScaledInt8Columns(record), q(record + kPanel * 2), high(q + kBlock * kPanel / 2) {}
  void load_fifth_bits(int64_t k) const {
    if (k % 8 == 0) bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(high + 2 * k));
  }
  // Columns 0-15 at depth k as int8 q - 16.
  __m128i values(int64_t k) const {
    load_fifth_bits(k);
    // bit 0 of each byte to bit 4 (16-bit shifts: bits crossing into the next byte are masked)
    const __m128i sixteen = _mm_and_si128(_mm_slli_epi16(bits, 4), _mm_set1_epi8(0x10));
    bits = _mm_srli_epi16(bits, 1);
    return _mm_sub_epi8(depth_nibbles(q + k * 8), sixteen);
  }
  // Depths k and k + 1 (k even): bits 0 and 1 out at once, one shift for both.
  void value_pair(int64_t k, __m128i& v0, __m128i& v1) const {
    const __m128i fifth = _mm_set1_epi8(0x10);
    nibble_pair(q + k * 8, v0, v1);
    load_fifth_bits(k);
    v0 = _mm_sub_epi8(v0, _mm_and_si128(_mm_slli_epi16(bits, 4), fifth));
    v1 = _mm_sub_epi8(v1, _mm_and_si128(_mm_slli_epi16(bits, 3), fifth));
    bits = _mm_srli_epi16(bits, 2);
  }
};

// A 256-deep Q4_K block of a panel. Per column d and dmin (float16); per 32 depths and column
// the 6-bit scale and min as bytes; at each depth the 16 columns' nibbles as Q4_1's pairs.
// w = fma(q, d scale, -(dmin min)): both products are exact in float32, so the one rounding
// is `gguf`'s d q - m's. 2,368 bytes a record against the file's 2,304 (the scales unpacked).
struct Q4_KRecord {
  static constexpr int64_t kDepth = 256;
  static constexpr int64_t kBytes = 2 * kPanel * 2 + 2 * (kDepth / 32) * kPanel + kDepth * 8;
  const uint8_t* record;
  __m256 d0, d1, n0, n1, D0, D1, M0, M1;  // n: -dmin
#if defined(__AVX512F__)
  __m512 d, n, D, M;
#endif
  explicit Q4_KRecord(const uint8_t* bytes) : record(bytes) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    d0 = half_to_float(record), d1 = half_to_float(record + 16);
    n0 = _mm256_xor_ps(half_to_float(record + 32), sign);
    n1 = _mm256_xor_ps(half_to_float(record + 48), sign);
#if defined(__AVX512F__)
    d = half16_to_float(record);
    n = _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(half16_to_float(record + 32)),
                                             _mm512_set1_epi32(static_cast<int>(0x80000000u))));
#endif
  }
  const uint8_t* scales(int64_t k) const { return record + 4 * kPanel + k / 32 * kPanel; }
  const uint8_t* mins(int64_t k) const { return scales(k) + kDepth / 32 * kPanel; }
  const uint8_t* nibbles(int64_t k) const {
    return record + 4 * kPanel + 2 * (kDepth / 32) * kPanel + k * 8;
  }
  __m128i values(int64_t k) const { return depth_nibbles(nibbles(k)); }
  static __m256 widen(const uint8_t* p, int half) {
    const __m128i v = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8 * half));
    return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v));
  }
  // Called for k = 0, 1, ... in order: the scales change every 32 depths.
  void at(int64_t k, __m256& w0, __m256& w1) {
    if (k % 32 == 0) {
      D0 = _mm256_mul_ps(d0, widen(scales(k), 0)), D1 = _mm256_mul_ps(d1, widen(scales(k), 1));
      M0 = _mm256_mul_ps(n0, widen(mins(k), 0)), M1 = _mm256_mul_ps(n1, widen(mins(k), 1));
    }
    const __m128i v = values(k);
    w0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v)), D0, M0);
    w1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(v, 8))), D1, M1);
  }
#if defined(__AVX512F__)
  static __m512 widen16(const uint8_t* p) {
    return _mm512_cvtepi32_ps(
        _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  }
  void enter(int64_t k) {
    if (k % 32 == 0)
      D = _mm512_mul_ps(d, widen16(scales(k))), M = _mm512_mul_ps(n, widen16(mins(k)));
  }
  void value_pair(int64_t k, __m128i& v0, __m128i& v1) const { nibble_pair(nibbles(k), v0, v1); }
  __m512 widen(__m128i v) const {
    return _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(v)), D, M);
  }
  void at(int64_t k, __m512& w) { enter(k), w = widen(values(k)); }
  void at(int64_t k, Columns& w) { at(k, w.v); }
#else
  void at(int64_t k, Columns& w) { at(k, w.lo, w.hi); }
#endif
};

// A 256-deep Q6_K block of a panel. Per column d (float16); per 16 depths and column an int8
// scale; at each depth the 16 columns' low nibbles as Q4_1's pairs (8 bytes); then per 4
// depths 16 bytes of high bits, byte j holding column j's two bits for depth 4 i + t at bits
// 2 t (held in a register, shifted 2 bits a depth). w = (d scale) (q - 32): d scale is exact in
// float32 (11 by 8 bits) and the product with q rounds once, as `gguf`'s two multiplies do.
// The same bytes as the file's blocks (210 a column).
struct Q6_KRecord {
  static constexpr int64_t kDepth = 256;
  static constexpr int64_t kBytes = kPanel * 2 + kDepth / 16 * kPanel + kDepth * 12;
  const uint8_t* record;
  __m256 d0, d1, D0, D1;
#if defined(__AVX512F__)
  __m512 d, D;
#endif
  explicit Q6_KRecord(const uint8_t* bytes) : record(bytes) {
    d0 = half_to_float(record), d1 = half_to_float(record + 16);
#if defined(__AVX512F__)
    d = half16_to_float(record);
#endif
  }
  const int8_t* scales(int64_t k) const {
    return reinterpret_cast<const int8_t*>(record + kPanel * 2 + k / 16 * kPanel);
  }
  const uint8_t* nibbles(int64_t k) const {
    return record + kPanel * 2 + kDepth / 16 * kPanel + k * 8;
  }
  // The current 4 depths' high bits, shifted right by 2 a depth: bits 0-1 of byte j are
  // column j's at the next depth. values() is called for k = 0, 1, ... in order.
  mutable __m128i high_bits;
  void load_high_bits(int64_t k) const {
    if (k % 4 == 0)
      high_bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(
          record + kPanel * 2 + kDepth / 16 * kPanel + kDepth * 8 + k / 4 * kPanel));
  }
  __m128i values(int64_t k) const {
    load_high_bits(k);
    // bits 0-1 of each byte to bits 4-5 (16-bit shifts: bits crossing bytes are masked)
    const __m128i bits = _mm_and_si128(_mm_slli_epi16(high_bits, 4), _mm_set1_epi8(0x30));
    high_bits = _mm_srli_epi16(high_bits, 2);
    return _mm_sub_epi8(_mm_or_si128(depth_nibbles(nibbles(k)), bits), _mm_set1_epi8(32));
  }
  // Depths k and k + 1 (k even): bits 0-1 and 2-3 out at once, one shift for both.
  void value_pair(int64_t k, __m128i& v0, __m128i& v1) const {
    const __m128i two_bits = _mm_set1_epi8(0x30), offset = _mm_set1_epi8(32);
    nibble_pair(nibbles(k), v0, v1);
    load_high_bits(k);
    v0 = _mm_sub_epi8(_mm_or_si128(v0, _mm_and_si128(_mm_slli_epi16(high_bits, 4), two_bits)),
                      offset);
    v1 = _mm_sub_epi8(_mm_or_si128(v1, _mm_and_si128(_mm_slli_epi16(high_bits, 2), two_bits)),
                      offset);
    high_bits = _mm_srli_epi16(high_bits, 4);
  }
  // Called for k = 0, 1, ... in order: the scales change every 16 depths.
  void enter(int64_t k) {
    if (k % 16 == 0) {
      const __m128i sc = _mm_loadu_si128(reinterpret_cast<const __m128i*>(scales(k)));
#if defined(__AVX512F__)
      D = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(sc)));
#else
      D0 = _mm256_mul_ps(d0, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(sc)));
      D1 = _mm256_mul_ps(d1, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(sc, 8))));
#endif
    }
  }
  void widen(__m128i v, __m256& w0, __m256& w1) const {
    w0 = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v)), D0);
    w1 = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(v, 8))), D1);
  }
  void at(int64_t k, __m256& w0, __m256& w1) { enter(k), widen(values(k), w0, w1); }
#if defined(__AVX512F__)
  __m512 widen(__m128i v) const {
    return _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(v)), D);
  }
  void at(int64_t k, __m512& w) { enter(k), w = widen(values(k)); }
  void at(int64_t k, Columns& w) { at(k, w.v); }
#else
  void at(int64_t k, Columns& w) { at(k, w.lo, w.hi); }
#endif
};

// Whether a record gives two depths at once (value_pair). At the AVX2 level only Q5_0 and Q6_K
// do: there Q4_1's and Q4_K's single depths are widened from their nibbles without an unpack,
// so a pair would save nothing.
template <class Record, class = void>
constexpr bool kHasPairs = false;
template <class Record>
constexpr bool kHasPairs<Record, std::void_t<decltype(&Record::value_pair)>> = true;

// The 16 columns at depths k and k + 1 (k even, so both in one sub-block): the same products
// as two calls of at(). Always inlined: in the 3-8-row register blocks gcc otherwise called it
// for Q6_K and kept the record in memory (2.4x slower at 8 rows).
template <class Record>
__attribute__((always_inline)) inline void at_pair(Record& record, int64_t k, Columns& w0,
                                                   Columns& w1) {
  record.enter(k);
  __m128i v0, v1;
  record.value_pair(k, v0, v1);
#if defined(__AVX512F__)
  w0.v = record.widen(v0), w1.v = record.widen(v1);
#else
  record.widen(v0, w0.lo, w0.hi), record.widen(v1, w1.lo, w1.hi);
#endif
}

// Dequantizes blocks [b0, b1) of one panel into out[(b - b0) * 32 + k][16].
template <class Record>
void dequantize(const uint8_t* panel, int64_t b0, int64_t b1, float* out, const uint8_t* end) {
  for (int64_t b = b0; b < b1; ++b) {
    const uint8_t* bytes = panel + b * Record::kBytes;
    prefetch_ahead(bytes, Record::kBytes, end);
    Record record(bytes);
    if constexpr (kHasPairs<Record>) {
      for (int64_t k = 0; k < Record::kDepth; k += 2, out += 2 * kPanel) {
        Columns w0, w1;
        at_pair(record, k, w0, w1);
        w0.store(out), w1.store(out + kPanel);
      }
    } else {
      for (int64_t k = 0; k < Record::kDepth; ++k, out += kPanel) {
        Columns w;
        record.at(k, w);
        w.store(out);
      }
    }
  }
}

// A quantized panel read depth by depth, each record dequantized in registers as it is reached.
template <class Record>
struct QuantizedPanel {
  const uint8_t* panel;
  const uint8_t* end;
  Record record;
  void enter_record(int64_t k) {
    if (k % Record::kDepth == 0) {
      const uint8_t* bytes = panel + k / Record::kDepth * Record::kBytes;
      prefetch_ahead(bytes, Record::kBytes, end);
      record = Record(bytes);
    }
  }
  template <class... Vectors>
  void at(int64_t k, Vectors&... w) {
    enter_record(k);
    record.at(k % Record::kDepth, w...);
  }
#if defined(__AVX512F__)
  // row_block_of takes two depths a step where this is true (pipellm_kernels::kTwoDepths). Not
  // at the AVX2 level: its 16 registers hold 4 rows' accumulators and one depth's weights, and
  // a second depth's made 4 rows slower there (measured with PIPELLM_CPU_ISA=avx2).
  static constexpr bool kPairs = kHasPairs<Record>;
  __attribute__((always_inline)) void at_pair(int64_t k, __m512& w0, __m512& w1) {
    enter_record(k);
    Columns c0, c1;
    ::at_pair(record, k % Record::kDepth, c0, c1);
    w0 = c0.v, w1 = c1.v;
  }
#endif
};

// Rows [0, R) of x times one whole panel, each depth's weights dequantized in registers and
// used at once: for a few rows (decode of a few sequences), where storing the slice and
// loading it back costs as much as dequantizing it. Same products, same order as the slice
// path, so the same bits.
template <class Record, int R>
void fused_row_block(const float* x, int64_t ldx, const uint8_t* panel, int64_t blocks,
                     float* out, int64_t ld, const float* init, const uint8_t* end) {
  QuantizedPanel<Record> weights{panel, end, Record(panel)};
  pipellm_kernels::row_block_of<R>(x, ldx, weights, 0, blocks * Record::kDepth, out, ld, false, init);
}

using FusedRowBlockFn = void (*)(const float*, int64_t, const uint8_t*, int64_t, float*, int64_t,
                                 const float*, const uint8_t*);
template <class Record, int... R>
constexpr auto fused_row_blocks(std::integer_sequence<int, R...>) {
  return std::array<FusedRowBlockFn, sizeof...(R)>{
      (R == 0 ? nullptr : fused_row_block<Record, R>)...};
}
// kFusedRowBlock<Record>[r]: r rows, 1 <= r <= kFusedRows.
template <class Record>
constexpr auto kFusedRowBlock =
    fused_row_blocks<Record>(std::make_integer_sequence<int, kFusedRows + 1>{});

// Rows [0, R) of x (R = 1 or 2) times NP panels at once, p0 to p0 + NP - 1, each depth's
// weights dequantized in registers. Why: at one or two rows a single panel's outputs are one
// or two chains of dependent FMAs, each depth waiting on the previous one's latency (4
// cycles); NP panels side by side give the core NP times as many independent chains. Each
// output is still its own chain over the depth in order, so the bits do not change. The NP
// streams are prefetched into L2, not L1: on an AVX-512 AMD EPYC, 2 threads, one row, Gemma
// 3's 262,144 x 640 Q8_0 head took 8.0-8.2 -> 6.7-7.1 ms a call and SmolLM2's 49,152 x 576
// 1.19-1.48 -> 1.09-1.16 ms; the layers' shapes were unchanged or a few percent faster.
// Records with value_pair give two depths at a time (at_pair); each output still adds them in
// order, so the bits do not change.
#define FOR_PANELS(X, r) X(r, 0) X(r, 1) X(r, 2) X(r, 3)
constexpr int kPanelsAtOnce = 4;
template <class Record, int R, int NP>
void fused_panels(const float* x, int64_t ldx, const uint8_t* wp, int64_t panel_bytes, int64_t p0,
                  int64_t blocks, const PanelOutput& y, const uint8_t* end) {
  static_assert(R >= 1 && R <= 2 && NP >= 1 && NP <= kPanelsAtOnce);
#define DECLARE(r, p)                                                       \
  Columns acc##r##p = Columns::zero();                                      \
  if (R > r && NP > p && y.bias(p0 + p)) acc##r##p = Columns::load(y.bias(p0 + p));
  FOR_PANELS(DECLARE, 0)
  FOR_PANELS(DECLARE, 1)
  for (int64_t b = 0; b < blocks; ++b) {
#define RECORD(unused, p)                                                             \
  const uint8_t* bytes##p = wp + (p0 + (NP > p ? p : 0)) * panel_bytes + b * Record::kBytes; \
  if (NP > p) prefetch_ahead(bytes##p, Record::kBytes, end, true);                    \
  Record record##p(bytes##p);
    FOR_PANELS(RECORD, 0)
    const float* xk = x + b * Record::kDepth;
    if constexpr (kHasPairs<Record>) {
      for (int64_t k = 0; k < Record::kDepth; k += 2, xk += 2) {
#define STEP2(unused, p)                         \
  if (NP > p) {                                  \
    Columns w0, w1;                              \
    at_pair(record##p, k, w0, w1);               \
    acc0##p.fma(xk, w0);                         \
    if (R > 1) acc1##p.fma(xk + ldx, w0);        \
    acc0##p.fma(xk + 1, w1);                     \
    if (R > 1) acc1##p.fma(xk + ldx + 1, w1);    \
  }
        FOR_PANELS(STEP2, 0)
      }
    } else {
      for (int64_t k = 0; k < Record::kDepth; ++k, ++xk) {
#define STEP(unused, p)                          \
  if (NP > p) {                                  \
    Columns w;                                   \
    record##p.at(k, w);                          \
    acc0##p.fma(xk, w);                          \
    if (R > 1) acc1##p.fma(xk + ldx, w);         \
  }
        FOR_PANELS(STEP, 0)
      }
    }
  }
#define STORE(r, p) \
  if (R > r && NP > p) acc##r##p.store(y.dst(p0 + p) + r * y.ld(p0 + p));
  FOR_PANELS(STORE, 0)
  FOR_PANELS(STORE, 1)
#undef DECLARE
#undef RECORD
#undef STEP
#undef STEP2
#undef STORE
}
#undef FOR_PANELS

using FusedPanelsFn = void (*)(const float*, int64_t, const uint8_t*, int64_t, int64_t, int64_t,
                               const PanelOutput&, const uint8_t*);
// kFusedPanels<Record>[R - 1][NP - 1]
template <class Record>
constexpr FusedPanelsFn kFusedPanels[2][kPanelsAtOnce] = {
    {fused_panels<Record, 1, 1>, fused_panels<Record, 1, 2>, fused_panels<Record, 1, 3>,
     fused_panels<Record, 1, 4>},
    {fused_panels<Record, 2, 1>, fused_panels<Record, 2, 2>, fused_panels<Record, 2, 3>,
     fused_panels<Record, 2, 4>}};

template <class Record>
at::Tensor quantized_linear_of(const at::Tensor& input, const at::Tensor& packed,
                               const std::optional<at::Tensor>& bias, int64_t out_features) {
  TORCH_CHECK(input.scalar_type() == at::kFloat && input.device().is_cpu() && input.dim() == 2,
              "quantized_linear: x must be a 2-D float32 CPU tensor");
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.dim() == 3 && packed.is_contiguous() &&
                  packed.size(2) == Record::kBytes &&
                  packed.size(1) * Record::kDepth == input.size(1),
              "quantized_linear: weight not packed by gguf_linear for this in_features and kind");
  const int64_t panels = packed.size(0), m = input.size(0), depth = input.size(1);
  const int64_t blocks = depth / Record::kDepth;
  const at::Tensor x = input.contiguous();
  PanelOutput y(m, out_features, panels, bias, x.options());
  if (y.empty()) return y.finish();
  const float* xp = x.data_ptr<float>();
  const uint8_t* wp = packed.data_ptr<uint8_t>();
  const int64_t panel_bytes = blocks * Record::kBytes;
  const uint8_t* end = wp + panels * panel_bytes;
  static_assert(kSliceDepth % Record::kDepth == 0);
  at::parallel_for(0, panels, 1, [&](int64_t first, int64_t last) {
    alignas(64) float slice[kSliceDepth * kPanel];
    // Dequantizes depth [k0, k0 + kSliceDepth) of panel p, then runs rows [m0, m1) on it.
    auto panel_slice = [&](int64_t p, int64_t k0, int64_t m0, int64_t m1) {
      const int64_t k1 = std::min(depth, k0 + kSliceDepth);
      dequantize<Record>(wp + p * panel_bytes, k0 / Record::kDepth, k1 / Record::kDepth, slice,
                         end);
      float* dst = y.dst(p);
      const int64_t ld = y.ld(p);
      for_each_row_block(m0, m1, [&](int64_t r, int64_t rows) {
        kRowBlock[rows](xp + r * depth + k0, depth, slice, 0, k1 - k0, dst + r * ld, ld, k0 > 0,
                        y.bias(p), nullptr);
      });
    };
    if (m <= 2) {  // one or two rows: several panels' dependent FMA chains side by side
      for (int64_t p = first; p < last; p += kPanelsAtOnce) {
        const int64_t np = std::min<int64_t>(kPanelsAtOnce, last - p);
        kFusedPanels<Record>[m - 1][np - 1](xp, depth, wp, panel_bytes, p, blocks, y, end);
      }
      return;
    }
    if (m <= kFusedRows) {  // a few rows: the weights dequantized in registers
      for (int64_t p = first; p < last; ++p)
        kFusedRowBlock<Record>[m](xp, depth, wp + p * panel_bytes, blocks, y.dst(p), y.ld(p),
                                  y.bias(p), end);
      return;
    }
    if (m <= 64) {  // decode sizes: one pass over the weights, each panel front to back
      for (int64_t p = first; p < last; ++p)
        for (int64_t k0 = 0; k0 < depth; k0 += kSliceDepth) panel_slice(p, k0, 0, m);
      return;
    }
    // Prefill sizes: passes of x over this thread's panels (for_each_slice_pass).
    for_each_slice_pass(m, depth, kRowsBlock, kSliceDepth, first, last, panel_slice);
  });
  return y.finish();
}

}  // namespace

at::Tensor pipellm_ops::quantized_linear(const at::Tensor& input, const at::Tensor& packed,
                                         int64_t kind, const std::optional<at::Tensor>& bias,
                                         int64_t out_features) {
  switch (kind) {
    case kQ4_1: return quantized_linear_of<Q4_1Record>(input, packed, bias, out_features);
    case kQ8_0: return quantized_linear_of<Q8_0Record>(input, packed, bias, out_features);
    case kQ5_0: return quantized_linear_of<Q5_0Record>(input, packed, bias, out_features);
    case kQ6_K: return quantized_linear_of<Q6_KRecord>(input, packed, bias, out_features);
    case kQ4_K: return quantized_linear_of<Q4_KRecord>(input, packed, bias, out_features);
    default:
      TORCH_CHECK(false, "quantized_linear: kind 0 (Q4_1), 1 (Q8_0), 2 (Q5_0), 3 (Q6_K) or ",
                  "4 (Q4_K), not ", kind);
  }
}

PIPELLM_LIBRARY_FRAGMENT(m) {
  m.def("quantized_linear(Tensor x, Tensor packed, int kind, Tensor? bias, int out_features) "
        "-> Tensor",
        &pipellm_ops::quantized_linear);
}
