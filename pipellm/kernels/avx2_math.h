// Small AVX2 + FMA helpers shared by pipellm's CPU kernels.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

namespace pipellm_kernels {

// exp(x), float32: x = n ln2 + r, exp(r) by a degree-6 polynomial (Cephes' coefficients),
// times 2^n built in the exponent bits. ~1 ulp; inputs clamped to [-87, 88] (underflow to
// ~1e-38, no infinities).
inline __m256 exp_avx2(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)), _mm256_set1_ps(88.0f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);  // ln2 in two parts
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  // 2^n in two factors, so that n = 128 (x near 88) does not overflow the exponent field.
  const __m256i half = _mm256_srai_epi32(_mm256_cvtps_epi32(n), 1);
  const __m256i rest = _mm256_sub_epi32(_mm256_cvtps_epi32(n), half);
  const __m256 pow_half =
      _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(half, _mm256_set1_epi32(127)), 23));
  const __m256 pow_rest =
      _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(rest, _mm256_set1_epi32(127)), 23));
  return _mm256_mul_ps(_mm256_mul_ps(p, pow_half), pow_rest);
}

inline float horizontal_sum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_hadd_ps(s, s);
  return _mm_cvtss_f32(_mm_hadd_ps(s, s));
}

inline float horizontal_max(__m256 v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_max_ss(s, _mm_shuffle_ps(s, s, 1)));
}

// Softmax of scores[0, valid) * scale in place; [valid, padded) set to 0.
inline void masked_softmax(float* scores, int64_t valid, int64_t padded, float scale) {
  const __m256 sc = _mm256_set1_ps(scale);
  __m256 m = _mm256_set1_ps(-INFINITY);
  int64_t t = 0;
  for (; t + 8 <= valid; t += 8) m = _mm256_max_ps(m, _mm256_loadu_ps(scores + t));
  float max = horizontal_max(m);
  for (; t < valid; ++t) max = std::max(max, scores[t]);
  const __m256 shift = _mm256_set1_ps(max * scale);
  __m256 total = _mm256_setzero_ps();
  for (t = 0; t + 8 <= valid; t += 8) {
    const __m256 e = exp_avx2(_mm256_fmsub_ps(_mm256_loadu_ps(scores + t), sc, shift));
    _mm256_storeu_ps(scores + t, e);
    total = _mm256_add_ps(total, e);
  }
  float sum = horizontal_sum(total);
  for (; t < valid; ++t) {
    scores[t] = std::exp(scores[t] * scale - max * scale);
    sum += scores[t];
  }
  const float inverse = 1.0f / sum;
  const __m256 inv = _mm256_set1_ps(inverse);
  for (t = 0; t + 8 <= valid; t += 8)
    _mm256_storeu_ps(scores + t, _mm256_mul_ps(_mm256_loadu_ps(scores + t), inv));
  for (; t < valid; ++t) scores[t] *= inverse;
  std::fill(scores + valid, scores + padded, 0.0f);
}

}  // namespace pipellm_kernels
