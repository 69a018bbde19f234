// GGUF's non-linear 4-bit types: IQ4_NL (32-value blocks) and IQ4_XS (256-value blocks with
// 6-bit sub-block scales). A nibble indexes a fixed table of 16 int8 levels (ggml's kvalues
// for these types, also in gguf/quants.py), so q is the level and D the block's scale.
#include "gguf_types.h"

namespace pipellm_gguf {
namespace {

constexpr int8_t kLevels[16] = {-127, -104, -83, -65, -49, -35, -22, -10,
                                1,    13,   25,  38,  53,  69,  89,  113};

inline void level_nibbles(const uint8_t* qs, int8_t* q) {
  const __m256i table = _mm256_broadcastsi128_si256(
      _mm_loadu_si128(reinterpret_cast<const __m128i*>(kLevels)));
  store32(q, _mm256_shuffle_epi8(table, split_nibbles(qs)));
}

struct IQ4_NL {  // d, 16 bytes of nibbles (value j low, j + 16 high)
  static constexpr int64_t kValues = 32, kBytes = 18;
  static constexpr bool kHasOffset = false;
  static void decode(const uint8_t* b, int8_t* q, float* scale, float* offset) {
    level_nibbles(b + 2, q);
    scale[0] = scale[1] = half_to_float(b);
    offset[0] = offset[1] = 0.0f;
  }
};

struct IQ4_XS {  // d, 2 bytes of scales' high bits, 4 of their low bits, 8 x 16 nibble bytes
  static constexpr int64_t kValues = 256, kBytes = 136;
  static constexpr bool kHasOffset = false;
  static void decode(const uint8_t* b, int8_t* q, float* scale, float* offset) {
    const float d = half_to_float(b);
    const unsigned scales_high = b[2] | (b[3] << 8);
    for (int s = 0; s < 8; ++s) {
      const int low = (b[4 + s / 2] >> (4 * (s % 2))) & 0x0F;
      const int high = (scales_high >> (2 * s)) & 3;
      scale[2 * s] = scale[2 * s + 1] = d * static_cast<float>((low | (high << 4)) - 32);
      offset[2 * s] = offset[2 * s + 1] = 0.0f;
      level_nibbles(b + 8 + 16 * s, q + 32 * s);
    }
  }
};

}  // namespace

extern const GgufType kIQ4_NLType = quantized_type<IQ4_NL>(20, "IQ4_NL");
extern const GgufType kIQ4_XSType = quantized_type<IQ4_XS>(23, "IQ4_XS");

}  // namespace pipellm_gguf
