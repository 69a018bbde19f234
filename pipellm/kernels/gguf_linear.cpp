// y = x W^T + b with W in any GGUF type the table holds (gguf_type_table.cpp), kept in the
// file's own row-major blocks; W may be several parts of different types stacked by rows (a
// fused q/k/v or gate/up whose parts the file stores in different types). And the embedding
// lookup on such rows.
//
// Exact path (gguf_linear): for each panel of 16 output columns and each 256-deep slice, the
// 16 rows' blocks are decoded to integers q with a (D, M) per 16 values (the int8 path's
// decode) and transposed as bytes to depth-major order; the same register blocks as
// packed_linear then multiply, in the same order, weights w = fma(q, D, M) that round exactly
// as `gguf`'s float32 do, so the outputs are bit-identical to packing the dequantized weights.
// Up to one register block of rows (decode) the weights are dequantized in registers as the
// block reads them; for more rows, once into an L1-sized float32 slice that every block
// reads. A panel holding a 16-bit float row takes its values from to_float, transposed.
// Against dequantizing each row to float32 and transposing floats, this moves 4x fewer bytes
// per weight before the multiply.
//
// Int8-activation path (gguf_linear_int8): x is rounded to int8 as llama.cpp rounds it for
// each row's type (per 32 values, or per 256 for the K-quants: activation_rounding.h); each weight
// row is decoded once into int8 q with a (D, M) per 16 values and dotted with every row of x
// in integers (vpmaddubsw + vpmaddwd), each 16 values' sum folded in with D dx, and the
// offsets M with the sums of x's int8 values.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include "activation_rounding.h"
#include "gemm_microkernel.h"
#include "gguf_types.h"
#include "kernel_library.h"
#include "kernel_ops.h"
#include "panel_output.h"

#include <algorithm>
#include <cmath>
#include <optional>
#include <vector>

namespace pipellm_gguf {
namespace {

using pipellm_kernels::block_dx;
using pipellm_kernels::block_sum_dx;
using pipellm_kernels::for_each_row_block;
using pipellm_kernels::for_each_slice_pass;
using pipellm_kernels::kPanel;
using pipellm_kernels::kRowBlock;
using pipellm_kernels::group_scale;
using pipellm_kernels::group_values;
using pipellm_kernels::GroupScale;
using pipellm_kernels::max_magnitude;
using pipellm_kernels::PanelOutput;
using pipellm_kernels::round_block;
using pipellm_kernels::Rounding;
using pipellm_kernels::rounding_for;

constexpr int64_t kSliceDepth = 256;  // a multiple of every type's block
constexpr int64_t kRowsBlock = 192;   // rows of x per pass over the weights (L2-sized)
constexpr int64_t kXBlock = 32;       // values of x per int8 scale

// One output row of W: its blocks and type.
struct WeightRow {
  const uint8_t* blocks;
  const GgufType* type;
};

// The rows of parts stacked in order, checked against the type list and depth.
std::vector<WeightRow> weight_rows(at::TensorList parts, at::IntArrayRef types, int64_t depth,
                                   const char* op) {
  TORCH_CHECK(parts.size() == types.size() && !parts.empty(), op,
              ": one GGUF type per weight part");
  std::vector<WeightRow> rows;
  for (size_t i = 0; i < parts.size(); ++i) {
    const GgufType* type = find_gguf_type(types[i]);
    TORCH_CHECK(type != nullptr, op, ": GGUF type ", types[i], " has no kernel");
    const at::Tensor& part = parts[i];
    TORCH_CHECK(part.scalar_type() == at::kByte && part.dim() == 2 && part.is_contiguous(), op,
                ": each weight part is a contiguous uint8 [rows, bytes] tensor");
    TORCH_CHECK(depth % type->block_values == 0 &&
                    part.size(1) == depth / type->block_values * type->block_bytes,
                op, ": a ", type->name, " part of ", part.size(1), " bytes a row does not hold ",
                depth, " values");
    const uint8_t* base = part.data_ptr<uint8_t>();
    for (int64_t r = 0; r < part.size(0); ++r)
      rows.push_back({base + r * part.size(1), type});
  }
  return rows;
}

// tmp [16][n] (row c: column c's values) -> slice [n][16], n a multiple of 8.
void transpose_into_slice(const float* tmp, int64_t n, float* slice) {
  for (int64_t k0 = 0; k0 < n; k0 += 8)
    for (int64_t c0 = 0; c0 < kPanel; c0 += 8) {
      __m256 r[8], t[8];
      for (int i = 0; i < 8; ++i) r[i] = _mm256_loadu_ps(tmp + (c0 + i) * kSliceDepth + k0);
      for (int i = 0; i < 4; ++i) {
        t[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);
      }
      for (int i = 0; i < 2; ++i)
        for (int j = 0; j < 2; ++j) {
          const __m256 a = t[4 * i + j], b = t[4 * i + j + 2];
          r[4 * i + 2 * j] = _mm256_shuffle_ps(a, b, 0x44);
          r[4 * i + 2 * j + 1] = _mm256_shuffle_ps(a, b, 0xEE);
        }
      // r[i], i < 4: columns c0..c0+3 at depth k0 + i (low half) and k0 + i + 4 (high half);
      // r[4 + i]: the same for columns c0+4..c0+7.
      for (int i = 0; i < 4; ++i) {
        const __m256 lo = r[i], hi = r[4 + i];
        _mm256_storeu_ps(slice + (k0 + i) * kPanel + c0, _mm256_permute2f128_ps(lo, hi, 0x20));
        _mm256_storeu_ps(slice + (k0 + i + 4) * kPanel + c0,
                         _mm256_permute2f128_ps(lo, hi, 0x31));
      }
    }
}

// 16 rows' decoded q [16][256] -> qt [n][16] (depth-major), n a multiple of 32: a 16 x 16
// byte transpose is four rounds of interleaving register i with register i + 8 (each round
// rotates the 8-bit (register, byte) index by one); the two 128-bit lanes do depths k..k+15
// and k+16..k+31 at once.
void transpose_q_into_slice(const int8_t* q, int64_t n, int8_t* qt) {
  for (int64_t k0 = 0; k0 < n; k0 += 32) {
    __m256i r[16], t[16];
    for (int i = 0; i < 16; ++i)
      r[i] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + i * kSliceDepth + k0));
    for (int round = 0; round < 4; ++round) {
      for (int i = 0; i < 8; ++i) {
        t[2 * i] = _mm256_unpacklo_epi8(r[i], r[i + 8]);
        t[2 * i + 1] = _mm256_unpackhi_epi8(r[i], r[i + 8]);
      }
      for (int i = 0; i < 16; ++i) r[i] = t[i];
    }
    for (int i = 0; i < 16; ++i) {
      _mm_storeu_si128(reinterpret_cast<__m128i*>(qt + (k0 + i) * kPanel),
                       _mm256_castsi256_si128(r[i]));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(qt + (k0 + 16 + i) * kPanel),
                       _mm256_extracti128_si256(r[i], 1));
    }
  }
}

// A panel's slice as decoded integers, depth-major, dequantized in registers as the GEMM step
// reads it: w = fma(q, D, M) (or D q where no row has an offset), the same single rounding as
// the type's to_float, so the weights, and with them the outputs, are bit-identical to the
// float32 slice; it saves the float32 slice's stores, loads and transpose.
struct DecodedSlice {
  const int8_t* qt;     // [n][16]
  const float* scale;   // [n / 16][16]
  const float* offset;  // [n / 16][16]
  bool has_offset;
  void at(int64_t k, __m256& w0, __m256& w1) const {
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qt + k * kPanel));
    const __m256 q0 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes));
    const __m256 q1 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(bytes, 8)));
    const float* d = scale + (k / kSubBlock) * kPanel;
    if (has_offset) {
      const float* m = offset + (k / kSubBlock) * kPanel;
      w0 = _mm256_fmadd_ps(q0, _mm256_loadu_ps(d), _mm256_loadu_ps(m));
      w1 = _mm256_fmadd_ps(q1, _mm256_loadu_ps(d + 8), _mm256_loadu_ps(m + 8));
    } else {
      w0 = _mm256_mul_ps(q0, _mm256_loadu_ps(d));
      w1 = _mm256_mul_ps(q1, _mm256_loadu_ps(d + 8));
    }
  }
#if defined(__AVX512F__)
  void at(int64_t k, __m512& w) const {
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qt + k * kPanel));
    const __m512 q = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes));
    const float* d = scale + (k / kSubBlock) * kPanel;
    w = has_offset ? _mm512_fmadd_ps(q, _mm512_loadu_ps(d),
                                     _mm512_loadu_ps(offset + (k / kSubBlock) * kPanel))
                   : _mm512_mul_ps(q, _mm512_loadu_ps(d));
  }
#endif
};

// Whether every row of panel p has an integer decode (a 16-bit float row has none).
bool panel_decodes(const std::vector<WeightRow>& rows, int64_t p) {
  const int64_t last = std::min<int64_t>(rows.size(), (p + 1) * kPanel);
  for (int64_t c = p * kPanel; c < last; ++c)
    if (rows[c].type->decode == nullptr) return false;
  return true;
}

at::Tensor gguf_linear(const at::Tensor& input, at::TensorList parts, at::IntArrayRef types,
                       const std::optional<at::Tensor>& bias, int64_t out_features) {
  TORCH_CHECK(input.scalar_type() == at::kFloat && input.device().is_cpu() && input.dim() == 2,
              "gguf_linear: x must be a 2-D float32 CPU tensor");
  const int64_t m = input.size(0), depth = input.size(1);
  const std::vector<WeightRow> rows = weight_rows(parts, types, depth, "gguf_linear");
  TORCH_CHECK(static_cast<int64_t>(rows.size()) == out_features,
              "gguf_linear: the parts hold ", rows.size(), " rows, not ", out_features);
  const at::Tensor x = input.contiguous();
  const int64_t panels = (out_features + kPanel - 1) / kPanel;
  PanelOutput y(m, out_features, panels, bias, x.options());
  if (y.empty()) return y.finish();
  const float* xp = x.data_ptr<float>();
  constexpr int64_t kSubs = kSliceDepth / kSubBlock;
  at::parallel_for(0, panels, 1, [&](int64_t first, int64_t last) {
    alignas(64) float tmp[kPanel * kSliceDepth];
    alignas(64) float slice[kSliceDepth * kPanel];
    alignas(64) int8_t q[kPanel * kSliceDepth];
    alignas(64) int8_t qt[kSliceDepth * kPanel];
    alignas(64) float row_scale[kPanel][kSubs], row_offset[kPanel][kSubs];
    alignas(64) float scale[kSubs * kPanel], offset[kSubs * kPanel];
    auto run_rows = [&](auto& weights, int64_t p, int64_t k0, int64_t n, int64_t m0,
                        int64_t m1) {
      float* dst = y.dst(p);
      const int64_t ld = y.ld(p);
      for_each_row_block(m0, m1, [&](int64_t r, int64_t count) {
        auto block = [&]<int R>() {
          pipellm_kernels::row_block_of<R>(xp + r * depth + k0, depth, weights, 0, n,
                                           dst + r * ld, ld, k0 > 0, y.bias(p));
        };
        [&]<int... R>(std::integer_sequence<int, R...>) {
          ((count == R + 1 ? (block.template operator()<R + 1>(), 0) : 0), ...);
        }(std::make_integer_sequence<int, pipellm_kernels::kRows>{});
      });
    };
    // The 16 rows decoded to integers, transposed, and dequantized in registers.
    auto decoded_slice = [&](int64_t p, int64_t k0, int64_t m0, int64_t m1) {
      const int64_t k1 = std::min(depth, k0 + kSliceDepth), n = k1 - k0;
      bool has_offset = false;
      for (int64_t c = 0; c < kPanel; ++c) {
        const int64_t column = p * kPanel + c;
        int8_t* qc = q + c * kSliceDepth;
        if (column >= out_features) {
          std::fill(qc, qc + n, 0);
          std::fill(row_scale[c], row_scale[c] + n / kSubBlock, 0.0f);
          std::fill(row_offset[c], row_offset[c] + n / kSubBlock, 0.0f);
          continue;
        }
        const GgufType* type = rows[column].type;
        const int64_t bv = type->block_values, per_block = bv / kSubBlock;
        for (int64_t b = 0; b < n / bv; ++b)
          type->decode(rows[column].blocks + (k0 / bv + b) * type->block_bytes, qc + b * bv,
                       row_scale[c] + b * per_block, row_offset[c] + b * per_block);
        if (type->has_offset)
          has_offset = true;
        else  // D q alone, as the type's to_float computes it
          std::fill(row_offset[c], row_offset[c] + n / kSubBlock, 0.0f);
      }
      transpose_q_into_slice(q, n, qt);
      for (int64_t s = 0; s < n / kSubBlock; ++s)
        for (int64_t c = 0; c < kPanel; ++c) {
          scale[s * kPanel + c] = row_scale[c][s];
          offset[s * kPanel + c] = row_offset[c][s];
        }
      DecodedSlice decoded{qt, scale, offset, has_offset};
      if (m1 - m0 <= pipellm_kernels::kRows) {  // one register block: dequantized once anyway
        run_rows(decoded, p, k0, n, m0, m1);
        return;
      }
      // Several register blocks would each dequantize it again: once, into float32.
      for (int64_t k = 0; k < n; ++k) {
        __m256 w0, w1;
        decoded.at(k, w0, w1);
        _mm256_store_ps(slice + k * kPanel, w0);
        _mm256_store_ps(slice + k * kPanel + 8, w1);
      }
      pipellm_kernels::PackedPanel weights{slice, nullptr};
      run_rows(weights, p, k0, n, m0, m1);
    };
    // Panels holding a 16-bit float row: float32 values, transposed.
    auto float_slice = [&](int64_t p, int64_t k0, int64_t m0, int64_t m1) {
      const int64_t k1 = std::min(depth, k0 + kSliceDepth), n = k1 - k0;
      for (int64_t c = 0; c < kPanel; ++c) {
        const int64_t column = p * kPanel + c;
        float* dst = tmp + c * kSliceDepth;
        if (column >= out_features) {
          std::fill(dst, dst + n, 0.0f);
          continue;
        }
        const WeightRow& row = rows[column];
        const int64_t bv = row.type->block_values;
        row.type->to_float(row.blocks, k0 / bv, n / bv, dst);
      }
      transpose_into_slice(tmp, n, slice);
      pipellm_kernels::PackedPanel weights{slice, nullptr};
      run_rows(weights, p, k0, n, m0, m1);
    };
    auto panel_slice = [&](int64_t p, int64_t k0, int64_t m0, int64_t m1) {
      if (panel_decodes(rows, p))
        decoded_slice(p, k0, m0, m1);
      else
        float_slice(p, k0, m0, m1);
    };
    for_each_slice_pass(m, depth, kRowsBlock, kSliceDepth, first, last, panel_slice);
  });
  return y.finish();
}

// x rounded to int8 as llama.cpp rounds it for one family of weight types
// (activation_rounding.h), with each 32-value block's scale and each half's dx sum(qx).
struct Int8Rows {
  std::vector<int8_t> q;       // [m, depth]
  std::vector<float> scale;    // [m, depth / 32]
  std::vector<float> sums_dx;  // [m, depth / 16]
};

void quantize_rows(const float* x, int64_t m, int64_t depth, Rounding rounding, Int8Rows& out) {
  const int64_t blocks = m * depth / kXBlock, group = group_values(rounding) / kXBlock;
  out.q.resize(m * depth);
  out.scale.resize(blocks);
  out.sums_dx.resize(2 * blocks);
  at::parallel_for(0, blocks / group, 64 / group, [&](int64_t first, int64_t last) {
    for (int64_t g = first; g < last; ++g) {
      const GroupScale gs = group_scale(max_magnitude(x + g * group * kXBlock, group * kXBlock),
                                        rounding);
      for (int64_t i = g * group; i < (g + 1) * group; ++i) {
        int32_t halves[2];
        round_block(x + i * kXBlock, gs.inverse, out.q.data() + i * kXBlock, halves);
        out.scale[i] = block_dx(gs, rounding);
        if (rounding == Rounding::kQ8_1) {
          // One offset per 32 values (Q4_1, Q5_1): the block's whole sum goes with the first
          // half, rounded once as llama.cpp's Q8_1 keeps it.
          out.sums_dx[2 * i] = block_sum_dx(gs, rounding, halves[0] + halves[1]);
          out.sums_dx[2 * i + 1] = 0.0f;
        } else {
          out.sums_dx[2 * i] = block_sum_dx(gs, rounding, halves[0]);
          out.sums_dx[2 * i + 1] = block_sum_dx(gs, rounding, halves[1]);
        }
      }
    }
  });
}

inline float horizontal_sum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

Rounding rounding_of(const GgufType& type) {
  return rounding_for(type.block_values, type.has_offset);
}

constexpr int kRowsAtOnce = 4;  // rows of x per pass over a decoded weight row

// One decoded weight row times rows [r0, r0 + R) of x.
template <int R>
void dot_rows(const int8_t* wq, const float* wscale, const float* woffset, bool has_offset,
              const Int8Rows& xq, int64_t r0, int64_t depth, float bias, float* y,
              int64_t ldy) {
  const int64_t groups = depth / kXBlock;
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[R];
  float offsets[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps(), offsets[r] = 0.0f;
  for (int64_t g = 0; g < groups; ++g) {
    const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wq + g * kXBlock));
    const __m256i magnitude = _mm256_abs_epi8(w);
    const __m256 d = _mm256_set_m128(_mm_set1_ps(wscale[2 * g + 1]), _mm_set1_ps(wscale[2 * g]));
    for (int r = 0; r < R; ++r) {
      const int64_t block = (r0 + r) * groups + g;
      const __m256i xv =
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq.q.data() + block * kXBlock));
      const __m256i pairs = _mm256_maddubs_epi16(magnitude, _mm256_sign_epi8(xv, w));
      const __m256 dot = _mm256_cvtepi32_ps(_mm256_madd_epi16(pairs, ones));
      acc[r] = _mm256_fmadd_ps(dot, _mm256_mul_ps(d, _mm256_set1_ps(xq.scale[block])), acc[r]);
      if (has_offset)
        offsets[r] += woffset[2 * g] * xq.sums_dx[2 * block] +
                      woffset[2 * g + 1] * xq.sums_dx[2 * block + 1];
    }
  }
  for (int r = 0; r < R; ++r) y[(r0 + r) * ldy] = horizontal_sum(acc[r]) + offsets[r] + bias;
}

struct DecodedRow {
  std::vector<int8_t> q;
  std::vector<float> scale, offset;
};

at::Tensor gguf_linear_int8(const at::Tensor& input, at::TensorList parts, at::IntArrayRef types,
                            const std::optional<at::Tensor>& bias, int64_t out_features) {
  TORCH_CHECK(input.scalar_type() == at::kFloat && input.device().is_cpu() && input.dim() == 2,
              "gguf_linear_int8: x must be a 2-D float32 CPU tensor");
  const int64_t m = input.size(0), depth = input.size(1);
  const std::vector<WeightRow> rows = weight_rows(parts, types, depth, "gguf_linear_int8");
  TORCH_CHECK(static_cast<int64_t>(rows.size()) == out_features,
              "gguf_linear_int8: the parts hold ", rows.size(), " rows, not ", out_features);
  for (const WeightRow& row : rows)
    TORCH_CHECK(row.type->decode != nullptr, "gguf_linear_int8: ", row.type->name,
                " has no int8-activation path; use gguf_linear");
  const bool has_bias = bias.has_value() && bias->defined();
  if (has_bias) TORCH_CHECK(bias->numel() == out_features, "the bias needs out_features values");
  const at::Tensor x = input.contiguous();
  at::Tensor out = at::empty({m, out_features}, x.options());
  if (m == 0 || out_features == 0) return out;
  // x rounded once per rounding its rows' types need (most weights: one). Kept per calling
  // thread and reused (decode makes a hundred calls a step); the workers below read the
  // caller's through this pointer, not their own thread_local copies.
  thread_local Int8Rows buffers[3];
  Int8Rows* rounded = buffers;
  bool needed[3] = {false, false, false};
  for (const WeightRow& row : rows) needed[static_cast<int>(rounding_of(*row.type))] = true;
  for (int k = 0; k < 3; ++k)
    if (needed[k])
      quantize_rows(x.data_ptr<float>(), m, depth, static_cast<Rounding>(k), buffers[k]);
  const at::Tensor bias_tensor = has_bias ? bias->contiguous() : at::Tensor();
  const float* bias_values = has_bias ? bias_tensor.data_ptr<float>() : nullptr;
  float* y = out.data_ptr<float>();
  at::parallel_for(0, out_features, 16, [&](int64_t first, int64_t last) {
    DecodedRow decoded;
    decoded.q.resize(depth);
    decoded.scale.resize(depth / kSubBlock);
    decoded.offset.resize(depth / kSubBlock);
    for (int64_t n = first; n < last; ++n) {
      const GgufType* type = rows[n].type;
      const int64_t bv = type->block_values, per_block = bv / kSubBlock;
      for (int64_t b = 0; b < depth / bv; ++b)
        type->decode(rows[n].blocks + b * type->block_bytes, decoded.q.data() + b * bv,
                     decoded.scale.data() + b * per_block, decoded.offset.data() + b * per_block);
      const float b0 = bias_values ? bias_values[n] : 0.0f;
      const Int8Rows& xq = rounded[static_cast<int>(rounding_of(*type))];
      int64_t r = 0;
      for (; r + kRowsAtOnce <= m; r += kRowsAtOnce)
        dot_rows<kRowsAtOnce>(decoded.q.data(), decoded.scale.data(), decoded.offset.data(),
                              type->has_offset, xq, r, depth, b0, y + n, out_features);
      for (; r < m; ++r)
        dot_rows<1>(decoded.q.data(), decoded.scale.data(), decoded.offset.data(),
                    type->has_offset, xq, r, depth, b0, y + n, out_features);
    }
  });
  return out;
}

// Rows `ids` of a GGUF matrix [vocab, hidden] as float32 [n, hidden]: the embedding lookup,
// reading only the rows it needs (bit-identical to `gguf`'s dequantized rows).
at::Tensor gguf_embedding(const at::Tensor& ids, const at::Tensor& blocks, int64_t ggml_type,
                          int64_t hidden) {
  const GgufType* type = find_gguf_type(ggml_type);
  TORCH_CHECK(type != nullptr, "gguf_embedding: GGUF type ", ggml_type, " has no kernel");
  TORCH_CHECK(blocks.scalar_type() == at::kByte && blocks.dim() == 2 && blocks.is_contiguous() &&
                  hidden % type->block_values == 0 &&
                  blocks.size(1) == hidden / type->block_values * type->block_bytes,
              "gguf_embedding: the table is not a uint8 [rows, bytes] ", type->name,
              " tensor of ", hidden, " values a row");
  const at::Tensor flat = ids.reshape({-1}).to(at::kLong).contiguous();
  const int64_t n = flat.numel(), vocab = blocks.size(0);
  std::vector<int64_t> sizes(ids.sizes().begin(), ids.sizes().end());
  sizes.push_back(hidden);
  at::Tensor out = at::empty({n, hidden}, at::TensorOptions().dtype(at::kFloat));
  const int64_t* id = flat.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i)
    TORCH_CHECK(id[i] >= 0 && id[i] < vocab, "gguf_embedding: token id ", id[i],
                " is outside the table's ", vocab, " rows");
  const uint8_t* base = blocks.data_ptr<uint8_t>();
  float* dst = out.data_ptr<float>();
  at::parallel_for(0, n, 8, [&](int64_t first, int64_t last) {
    for (int64_t i = first; i < last; ++i)
      type->to_float(base + id[i] * blocks.size(1), 0, hidden / type->block_values,
                     dst + i * hidden);
  });
  return out.view(sizes);
}

}  // namespace
}  // namespace pipellm_gguf

// The ops, as kernel_ops.h declares them.
at::Tensor pipellm_ops::gguf_linear(const at::Tensor& input, at::TensorList parts,
                                    at::IntArrayRef types, const std::optional<at::Tensor>& bias,
                                    int64_t out_features) {
  return pipellm_gguf::gguf_linear(input, parts, types, bias, out_features);
}
at::Tensor pipellm_ops::gguf_linear_int8(const at::Tensor& input, at::TensorList parts,
                                         at::IntArrayRef types,
                                         const std::optional<at::Tensor>& bias,
                                         int64_t out_features) {
  return pipellm_gguf::gguf_linear_int8(input, parts, types, bias, out_features);
}
at::Tensor pipellm_ops::gguf_embedding(const at::Tensor& ids, const at::Tensor& blocks,
                                       int64_t ggml_type, int64_t hidden) {
  return pipellm_gguf::gguf_embedding(ids, blocks, ggml_type, hidden);
}

PIPELLM_LIBRARY_FRAGMENT(m) {
  m.def("gguf_linear(Tensor x, Tensor[] parts, int[] types, Tensor? bias, int out_features) "
        "-> Tensor",
        &pipellm_ops::gguf_linear);
  m.def("gguf_linear_int8(Tensor x, Tensor[] parts, int[] types, Tensor? bias, "
        "int out_features) -> Tensor",
        &pipellm_ops::gguf_linear_int8);
  m.def("gguf_embedding(Tensor ids, Tensor blocks, int type, int hidden) -> Tensor",
        &pipellm_ops::gguf_embedding);
}
