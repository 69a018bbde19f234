// GGUF's 16-bit float tensors, F16 and BF16, kept in 16 bits and widened exactly as `gguf`
// does (float16 by F16C, bfloat16 by a 16-bit shift). They have no int8-activation path: the
// exact one streams the same bytes. Taken in pseudo-blocks of 32 values, so that the kernels'
// slices and rows step alike for every type.
#include "gguf_types.h"

namespace pipellm_gguf {
namespace {

constexpr int64_t kValues = 32, kBytes = 64;

void f16_to_float(const uint8_t* row, int64_t first_block, int64_t blocks, float* out) {
  const uint8_t* p = row + first_block * kBytes;
  for (int64_t i = 0; i < blocks * kValues; i += 8)
    _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128(
                                  reinterpret_cast<const __m128i*>(p + 2 * i))));
}

void bf16_to_float(const uint8_t* row, int64_t first_block, int64_t blocks, float* out) {
  const uint8_t* p = row + first_block * kBytes;
  for (int64_t i = 0; i < blocks * kValues; i += 8) {
    const __m256i wide =
        _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 2 * i)));
    _mm256_storeu_ps(out + i, _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16)));
  }
}

}  // namespace

extern const GgufType kF16Type = {1, "F16", kValues, kBytes, false, nullptr, f16_to_float};
extern const GgufType kBF16Type = {30, "BF16", kValues, kBytes, false, nullptr, bf16_to_float};

}  // namespace pipellm_gguf
