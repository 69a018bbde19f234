// GGUF's 32-value block types (ggml's "legacy" quants): Q4_0, Q4_1, Q5_0, Q5_1, Q8_0. Layouts
// as `gguf`'s dequantizers read them (gguf/quants.py): a float16 scale d (and min m), then the
// quants; 4-bit quants hold value j in the low nibble of byte j and value j + 16 in its high
// nibble, and 5-bit ones add value i's fifth bit as bit i of a 32-bit word.
#include "gguf_types.h"

#include <cstring>

namespace pipellm_gguf {
namespace {

inline void nibbles(const uint8_t* qs, int8_t* q, int8_t offset) {
  store32(q, _mm256_add_epi8(split_nibbles(qs), _mm256_set1_epi8(offset)));
}

inline void fifth_bits(const uint8_t* qh_bytes, const uint8_t* qs, int8_t* q, int8_t offset) {
  uint32_t qh;
  std::memcpy(&qh, qh_bytes, 4);  // bit i: value i's fifth bit
  const __m256i values = _mm256_or_si256(split_nibbles(qs), bits_to_bytes(qh, 0x10));
  store32(q, _mm256_add_epi8(values, _mm256_set1_epi8(offset)));
}

inline void same_for_both_halves(float* scale, float* offset, float d, float m) {
  scale[0] = scale[1] = d;
  offset[0] = offset[1] = m;
}

struct Q4_0 {  // d, 16 bytes: w = d (q - 8)
  static constexpr int64_t kValues = 32, kBytes = 18;
  static constexpr bool kHasOffset = false;
  static void decode(const uint8_t* b, int8_t* q, float* scale, float* offset) {
    nibbles(b + 2, q, -8);
    same_for_both_halves(scale, offset, half_to_float(b), 0.0f);
  }
};

struct Q4_1 {  // d, m, 16 bytes: w = d q + m
  static constexpr int64_t kValues = 32, kBytes = 20;
  static constexpr bool kHasOffset = true;
  static void decode(const uint8_t* b, int8_t* q, float* scale, float* offset) {
    nibbles(b + 4, q, 0);
    same_for_both_halves(scale, offset, half_to_float(b), half_to_float(b + 2));
  }
};

struct Q5_0 {  // d, 4 bytes of fifth bits, 16 bytes: w = d (q - 16)
  static constexpr int64_t kValues = 32, kBytes = 22;
  static constexpr bool kHasOffset = false;
  static void decode(const uint8_t* b, int8_t* q, float* scale, float* offset) {
    fifth_bits(b + 2, b + 6, q, -16);
    same_for_both_halves(scale, offset, half_to_float(b), 0.0f);
  }
};

struct Q5_1 {  // d, m, 4 bytes of fifth bits, 16 bytes: w = d q + m
  static constexpr int64_t kValues = 32, kBytes = 24;
  static constexpr bool kHasOffset = true;
  static void decode(const uint8_t* b, int8_t* q, float* scale, float* offset) {
    fifth_bits(b + 4, b + 8, q, 0);
    same_for_both_halves(scale, offset, half_to_float(b), half_to_float(b + 2));
  }
};

struct Q8_0 {  // d, 32 int8: w = d q
  static constexpr int64_t kValues = 32, kBytes = 34;
  static constexpr bool kHasOffset = false;
  static void decode(const uint8_t* b, int8_t* q, float* scale, float* offset) {
    std::memcpy(q, b + 2, 32);
    same_for_both_halves(scale, offset, half_to_float(b), 0.0f);
  }
};

}  // namespace

extern const GgufType kQ4_0Type = quantized_type<Q4_0>(2, "Q4_0");
extern const GgufType kQ4_1Type = quantized_type<Q4_1>(3, "Q4_1");
extern const GgufType kQ5_0Type = quantized_type<Q5_0>(6, "Q5_0");
extern const GgufType kQ5_1Type = quantized_type<Q5_1>(7, "Q5_1");
extern const GgufType kQ8_0Type = quantized_type<Q8_0>(8, "Q8_0");

}  // namespace pipellm_gguf
