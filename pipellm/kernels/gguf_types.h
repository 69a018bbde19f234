// What pipellm's GGUF kernels (gguf_linear.cpp) need to know about one GGUF tensor type, and
// the helpers its type families (gguf_legacy_quants.cpp, gguf_k_quants.cpp,
// gguf_iq_quants.cpp, gguf_float_types.cpp) write their blocks with. Adding a type is one entry
// in one family's file (its block layout and decode) and one line of gguf_type_table.cpp.
//
// Every quantized type decodes a block into integers q (int8) and, per 16 values, a scale D and
// an offset M (float32), so that each weight is w = D q + M. For every type D q is exact in
// float32 (a float16 times an integer of at most 14 bits, or for Q6_K and IQ4_XS D itself the
// same float32 product `gguf` computes), so fma(q, D, M) rounds once, as `gguf`'s
// dequantize-then-add does: the exact path's weights are bit-identical to `gguf`'s float32.
// The int8-activation path multiplies the same q with x rounded to int8 per 32 values.
#pragma once

#include <immintrin.h>

#include <cstdint>

namespace pipellm_gguf {

constexpr int64_t kSubBlock = 16;  // values per (D, M) pair of a decoded block
constexpr int64_t kMaxBlockValues = 256;

// Decodes one block: q[block_values], scale[block_values / 16], offset[block_values / 16].
using DecodeFn = void (*)(const uint8_t* block, int8_t* q, float* scale, float* offset);
// Values [first_block * block_values, + blocks * block_values) of one row, as float32.
using ToFloatFn = void (*)(const uint8_t* row, int64_t first_block, int64_t blocks, float* out);

struct GgufType {
  int64_t ggml_type;  // GGMLQuantizationType's value
  const char* name;
  int64_t block_values, block_bytes;
  bool has_offset;  // M != 0 somewhere (the int8 path then needs x's sums)
  DecodeFn decode;  // nullptr for float types (no int8 path)
  ToFloatFn to_float;
};

// The type with GGML id `ggml_type`, or nullptr if the kernels do not take it
// (gguf_type_table.cpp).
const GgufType* find_gguf_type(int64_t ggml_type);

inline float half_to_float(const uint8_t* p) {
  uint16_t bits;
  __builtin_memcpy(&bits, p, 2);
  return _cvtsh_ss(bits);
}

// Vector helpers for the decoders (AVX2, so every level's build has them).
inline __m256i load32(const uint8_t* p) {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
}
inline void store32(int8_t* q, __m256i v) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), v); }
// Each byte of v shifted right by `shift` bits, keeping `mask`.
inline __m256i bits_of(__m256i v, int shift, uint8_t mask) {
  return _mm256_and_si256(_mm256_srli_epi16(v, shift), _mm256_set1_epi8(static_cast<char>(mask)));
}
// 16 bytes of nibble pairs -> 32 bytes: byte j's low nibble at j, its high nibble at j + 16.
inline __m256i split_nibbles(const uint8_t* p) {
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m128i low = _mm_set1_epi8(0x0F);
  return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(bytes, 4), low), _mm_and_si128(bytes, low));
}
// Bit i of `bits` -> byte i: `value` where set, 0 where clear.
inline __m256i bits_to_bytes(uint32_t bits, uint8_t value) {
  const __m256i spread = _mm256_shuffle_epi8(
      _mm256_set1_epi32(static_cast<int>(bits)),
      _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2,
                       3, 3, 3, 3, 3, 3, 3, 3));
  const __m256i bit = _mm256_set1_epi64x(static_cast<int64_t>(0x8040201008040201ULL));
  const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit);
  return _mm256_and_si256(set, _mm256_set1_epi8(static_cast<char>(value)));
}

// A quantized type's to_float from its decode: w = fma(q, D, M), or D q without offsets
// (the same rounding as `gguf`'s single multiply).
template <class Type>
void quantized_to_float(const uint8_t* row, int64_t first_block, int64_t blocks, float* out) {
  alignas(32) int8_t q[Type::kValues];
  float scale[Type::kValues / kSubBlock], offset[Type::kValues / kSubBlock];
  for (int64_t b = 0; b < blocks; ++b) {
    Type::decode(row + (first_block + b) * Type::kBytes, q, scale, offset);
    for (int64_t s = 0; s < Type::kValues / kSubBlock; ++s) {
      const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + s * kSubBlock));
      const __m256 lo = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes));
      const __m256 hi = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(bytes, 8)));
      const __m256 d = _mm256_set1_ps(scale[s]);
      float* dst = out + b * Type::kValues + s * kSubBlock;
      if constexpr (Type::kHasOffset) {
        const __m256 m = _mm256_set1_ps(offset[s]);
        _mm256_storeu_ps(dst, _mm256_fmadd_ps(lo, d, m));
        _mm256_storeu_ps(dst + 8, _mm256_fmadd_ps(hi, d, m));
      } else {
        _mm256_storeu_ps(dst, _mm256_mul_ps(lo, d));
        _mm256_storeu_ps(dst + 8, _mm256_mul_ps(hi, d));
      }
    }
  }
}

template <class Type>
constexpr GgufType quantized_type(int64_t ggml_type, const char* name) {
  static_assert(Type::kValues % 32 == 0 && Type::kValues <= kMaxBlockValues);
  return {ggml_type,          name,          Type::kValues,
          Type::kBytes,       Type::kHasOffset, Type::decode,
          quantized_to_float<Type>};
}

}  // namespace pipellm_gguf
