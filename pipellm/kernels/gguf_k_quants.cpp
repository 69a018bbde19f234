// GGUF's 256-value "K-quant" block types: Q2_K, Q3_K, Q4_K, Q5_K, Q6_K. Each block holds
// float16 super-scales (d, and dmin for the types with offsets) and small integer scales per
// sub-block of 16 or 32 values; the layouts are those `gguf`'s dequantizers read
// (gguf/quants.py), value v of a block numbered as they return it. A sub-block's D is the
// float32 product d * scale and its M is -(dmin * min), as `gguf` computes them.
#include "gguf_types.h"

namespace pipellm_gguf {
namespace {

constexpr int64_t kK = 256;

// Q4_K and Q5_K: 8 scales and 8 mins of 6 bits in 12 bytes.
inline void six_bit_scales(const uint8_t* s, int i, uint8_t& scale, uint8_t& min) {
  if (i < 4) {
    scale = s[i] & 63, min = s[i + 4] & 63;
  } else {
    scale = (s[i + 4] & 0x0F) | ((s[i - 4] >> 2) & 0x30);
    min = (s[i + 4] >> 4) | ((s[i] >> 2) & 0x30);
  }
}

struct Q2_K {  // 16 scale bytes (scale low nibble, min high), 64 bytes of 2-bit q, d, dmin
  static constexpr int64_t kValues = kK, kBytes = 84;
  static constexpr bool kHasOffset = true;
  static void decode(const uint8_t* b, int8_t* q, float* scale, float* offset) {
    const uint8_t* scales = b;
    const uint8_t* qs = b + 16;
    const float d = half_to_float(b + 80), dmin = half_to_float(b + 82);
    for (int h = 0; h < 2; ++h) {
      const __m256i bytes = load32(qs + 32 * h);
      for (int g = 0; g < 4; ++g) store32(q + 128 * h + 32 * g, bits_of(bytes, 2 * g, 3));
    }
    for (int s = 0; s < 16; ++s) {
      scale[s] = d * static_cast<float>(scales[s] & 0x0F);
      offset[s] = -(dmin * static_cast<float>(scales[s] >> 4));
    }
  }
};

struct Q3_K {  // 32 bytes of high bits, 64 bytes of low 2 bits, 12 bytes of 6-bit scales, d
  static constexpr int64_t kValues = kK, kBytes = 110;
  static constexpr bool kHasOffset = false;
  static void decode(const uint8_t* b, int8_t* q, float* scale, float* offset) {
    const uint8_t* hmask = b;
    const uint8_t* qs = b + 32;
    const uint8_t* scales = b + 96;
    const float d = half_to_float(b + 108);
    const __m256i high_bits = load32(hmask);  // value 32 i + j: bit i of byte j
    for (int h = 0; h < 2; ++h) {
      const __m256i bytes = load32(qs + 32 * h);
      for (int g = 0; g < 4; ++g) {
        const __m256i low = bits_of(bytes, 2 * g, 3);
        const __m256i high = bits_of(high_bits, 4 * h + g, 1);
        // low - 4 where the high bit is clear: low + 4 high - 4
        store32(q + 128 * h + 32 * g,
                _mm256_sub_epi8(_mm256_add_epi8(low, _mm256_slli_epi16(high, 2)),
                                _mm256_set1_epi8(4)));
      }
    }
    for (int s = 0; s < 16; ++s) {
      const int low = s < 8 ? scales[s] & 0x0F : scales[s - 8] >> 4;
      const int high = (scales[8 + s % 4] >> (2 * (s / 4))) & 3;
      scale[s] = d * static_cast<float>((low | (high << 4)) - 32);
      offset[s] = 0.0f;
    }
  }
};

struct Q4_K {  // d, dmin, 12 bytes of 6-bit scales and mins, 128 bytes of nibbles
  static constexpr int64_t kValues = kK, kBytes = 144;
  static constexpr bool kHasOffset = true;
  static void decode(const uint8_t* b, int8_t* q, float* scale, float* offset) {
    const float d = half_to_float(b), dmin = half_to_float(b + 2);
    const uint8_t* qs = b + 16;
    for (int c = 0; c < 4; ++c) {  // 64 values: 32 low nibbles, then the same bytes' high ones
      const __m256i bytes = load32(qs + 32 * c);
      store32(q + 64 * c, bits_of(bytes, 0, 0x0F));
      store32(q + 64 * c + 32, bits_of(bytes, 4, 0x0F));
    }
    for (int i = 0; i < 8; ++i) {
      uint8_t sc, m;
      six_bit_scales(b + 4, i, sc, m);
      scale[2 * i] = scale[2 * i + 1] = d * static_cast<float>(sc);
      offset[2 * i] = offset[2 * i + 1] = -(dmin * static_cast<float>(m));
    }
  }
};

struct Q5_K {  // as Q4_K, with 32 bytes of fifth bits before the nibbles
  static constexpr int64_t kValues = kK, kBytes = 176;
  static constexpr bool kHasOffset = true;
  static void decode(const uint8_t* b, int8_t* q, float* scale, float* offset) {
    const float d = half_to_float(b), dmin = half_to_float(b + 2);
    const uint8_t* qh = b + 16;
    const uint8_t* qs = b + 48;
    const __m256i high_bits = load32(qh);  // sub-block s's fifth bits: bit s of each byte
    for (int c = 0; c < 4; ++c) {
      const __m256i bytes = load32(qs + 32 * c);
      const __m256i high0 = _mm256_slli_epi16(bits_of(high_bits, 2 * c, 1), 4);
      const __m256i high1 = _mm256_slli_epi16(bits_of(high_bits, 2 * c + 1, 1), 4);
      store32(q + 64 * c, _mm256_or_si256(bits_of(bytes, 0, 0x0F), high0));
      store32(q + 64 * c + 32, _mm256_or_si256(bits_of(bytes, 4, 0x0F), high1));
    }
    for (int i = 0; i < 8; ++i) {
      uint8_t sc, m;
      six_bit_scales(b + 4, i, sc, m);
      scale[2 * i] = scale[2 * i + 1] = d * static_cast<float>(sc);
      offset[2 * i] = offset[2 * i + 1] = -(dmin * static_cast<float>(m));
    }
  }
};

struct Q6_K {  // 128 bytes of low nibbles, 64 of high 2 bits, 16 int8 scales, d: w = D (q - 32)
  static constexpr int64_t kValues = kK, kBytes = 210;
  static constexpr bool kHasOffset = false;
  static void decode(const uint8_t* b, int8_t* q, float* scale, float* offset) {
    const uint8_t* ql = b;
    const uint8_t* qh = b + 128;
    const int8_t* scales = reinterpret_cast<const int8_t*>(b + 192);
    const float d = half_to_float(b + 208);
    const __m256i offset32 = _mm256_set1_epi8(32);
    for (int h = 0; h < 2; ++h) {  // halves of 128 values; value 32 g + j of a half:
      const __m256i low_bytes[2] = {load32(ql + 64 * h), load32(ql + 64 * h + 32)};
      const __m256i high_bytes = load32(qh + 32 * h);
      for (int g = 0; g < 4; ++g) {
        // low nibble: byte (32 g + j) % 64 of the half's ql, its high nibble from g = 2 on;
        // high 2 bits: bits 2 g of byte j of the half's qh
        const __m256i low = bits_of(low_bytes[g % 2], 4 * (g / 2), 0x0F);
        const __m256i high = _mm256_slli_epi16(bits_of(high_bytes, 2 * g, 3), 4);
        store32(q + 128 * h + 32 * g, _mm256_sub_epi8(_mm256_or_si256(low, high), offset32));
      }
    }
    for (int s = 0; s < 16; ++s) {
      scale[s] = d * static_cast<float>(scales[s]);
      offset[s] = 0.0f;
    }
  }
};

}  // namespace

extern const GgufType kQ2_KType = quantized_type<Q2_K>(10, "Q2_K");
extern const GgufType kQ3_KType = quantized_type<Q3_K>(11, "Q3_K");
extern const GgufType kQ4_KType = quantized_type<Q4_K>(12, "Q4_K");
extern const GgufType kQ5_KType = quantized_type<Q5_K>(13, "Q5_K");
extern const GgufType kQ6_KType = quantized_type<Q6_K>(14, "Q6_K");

}  // namespace pipellm_gguf
