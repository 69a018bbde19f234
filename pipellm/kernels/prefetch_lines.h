// A byte range asked for line by line ahead of its use: the software prefetch the GEMM and
// attention kernels share. Whether a caller's bytes belong in L1 or only in L2 is measured
// where it calls (int8_linear.cpp, quantized_linear.cpp, paged_decode_attention.cpp).
#pragma once

#include <immintrin.h>

#include <cstdint>

namespace pipellm_kernels {

// The cache lines of [p, p + bytes): into L1 (the T0 hint), or with `to_l2` into L2 only (T1).
inline void prefetch_lines(const void* p, int64_t bytes, bool to_l2) {
  const char* bytes_at = static_cast<const char*>(p);
  for (int64_t line = 0; line < bytes; line += 64) {
    if (to_l2)
      _mm_prefetch(bytes_at + line, _MM_HINT_T1);
    else
      _mm_prefetch(bytes_at + line, _MM_HINT_T0);
  }
}

}  // namespace pipellm_kernels
