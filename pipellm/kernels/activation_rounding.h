// How the int8-activation kernels (int8_linear.cpp, gguf_linear.cpp) round x to int8: as
// llama.cpp rounds it for the same weight type (ggml-cpu's quantize_row_q8_0, quantize_row_q8_1
// and quantize_row_q8_K, chosen by each type's vec_dot_type), so that both engines sum the same
// integers and differ only in the order of their float32 additions:
//   Q8_0 (Q4_0, Q5_0, Q8_0, IQ4_NL weights): per 32 values, qx = round(x * (127 / max|x|))
//        (nearest, ties to even: llama.cpp's AVX2 rounding), dx = max|x| / 127 kept as float16;
//   Q8_1 (Q4_1, Q5_1: one offset per 32 values): Q8_0's, and the offset's dx sum(qx) also
//        kept as float16, computed from the float32 dx;
//   Q8_K (the K-quants and IQ4_XS: 256-value blocks): one scale per 256 values,
//        dx = 1 / (127 / max|x|) in float32. (llama.cpp takes the sign of the largest value
//        into the scale; the rounding is symmetric, so dx qx is the same.)
#pragma once

#include <immintrin.h>

#include <cstdint>

namespace pipellm_kernels {

enum class Rounding { kQ8_0, kQ8_1, kQ8_K };

// By a GGUF type's block: 256 values take Q8_K; 32 with an offset Q8_1; the rest Q8_0.
constexpr Rounding rounding_for(int64_t block_values, bool has_offset) {
  return block_values == 256 ? Rounding::kQ8_K : has_offset ? Rounding::kQ8_1 : Rounding::kQ8_0;
}
// Values of x per scale.
constexpr int64_t group_values(Rounding rounding) { return rounding == Rounding::kQ8_K ? 256 : 32; }

inline float to_half_and_back(float v) {
  return _cvtsh_ss(_cvtss_sh(v, _MM_FROUND_TO_NEAREST_INT));
}

// max|v| over n values (n a multiple of 8).
inline float max_magnitude(const float* v, int64_t n) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  __m256 amax8 = _mm256_setzero_ps();
  for (int64_t i = 0; i < n; i += 8)
    amax8 = _mm256_max_ps(amax8, _mm256_andnot_ps(sign, _mm256_loadu_ps(v + i)));
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax8), _mm256_extractf128_ps(amax8, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
  return _mm_cvtss_f32(m4);
}

// A scale group's multiplier 127 / max|x| (0 for an all-zero group) and its float32 dx.
struct GroupScale {
  float inverse, dx;
};
inline GroupScale group_scale(float amax, Rounding rounding) {
  if (!(amax > 0.0f)) return {0.0f, 0.0f};
  const float inverse = 127.0f / amax;
  return {inverse, rounding == Rounding::kQ8_K ? 1.0f / inverse : amax / 127.0f};
}

inline int32_t sum_of(__m256i v) {
  __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
  s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xB1));
  return _mm_cvtsi128_si32(s4);
}

// 32 values: q = round(v * inverse) (nearest, ties to even: the default rounding mode);
// writes the sums of q's two halves of 16.
inline void round_block(const float* v, float inverse, int8_t* q, int32_t half_sums[2]) {
  const __m256 scale = _mm256_set1_ps(inverse);
  __m256i qi[4];
  for (int i = 0; i < 4; ++i)
    qi[i] = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(v + 8 * i), scale));
  // Saturating packs interleave the 128-bit lanes; the permute puts the 32 bytes in order.
  const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(qi[0], qi[1]),
                                           _mm256_packs_epi32(qi[2], qi[3]));
  _mm256_storeu_si256(
      reinterpret_cast<__m256i*>(q),
      _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
  half_sums[0] = sum_of(_mm256_add_epi32(qi[0], qi[1]));
  half_sums[1] = sum_of(_mm256_add_epi32(qi[2], qi[3]));
}

// The scale a kernel multiplies a 32-value block's integer dot product by.
inline float block_dx(const GroupScale& scale, Rounding rounding) {
  return rounding == Rounding::kQ8_K ? scale.dx : to_half_and_back(scale.dx);
}

// dx sum(qx) of a 32-value block, the term an offset (Q4_1's m, a K-quant's min) multiplies.
inline float block_sum_dx(const GroupScale& scale, Rounding rounding, int32_t sum) {
  const float s = static_cast<float>(sum);
  return rounding == Rounding::kQ8_1 ? to_half_and_back(scale.dx * s)
                                     : block_dx(scale, rounding) * s;
}

}  // namespace pipellm_kernels
