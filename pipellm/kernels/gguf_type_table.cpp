// The one table from a GGUF tensor type to the kernels' code for it (the type families'
// files define the entries), and an op that tells Python what the table holds.
#include <ATen/ATen.h>

#include "gguf_types.h"
#include "kernel_library.h"
#include "kernel_ops.h"

#include <vector>

namespace pipellm_gguf {

extern const GgufType kQ4_0Type, kQ4_1Type, kQ5_0Type, kQ5_1Type, kQ8_0Type;
extern const GgufType kQ2_KType, kQ3_KType, kQ4_KType, kQ5_KType, kQ6_KType;
extern const GgufType kIQ4_NLType, kIQ4_XSType;
extern const GgufType kF16Type, kBF16Type;

namespace {
const GgufType* const kTypes[] = {
    &kQ4_0Type, &kQ4_1Type, &kQ5_0Type,   &kQ5_1Type,   &kQ8_0Type, &kQ2_KType, &kQ3_KType,
    &kQ4_KType, &kQ5_KType, &kQ6_KType,   &kIQ4_NLType, &kIQ4_XSType, &kF16Type, &kBF16Type,
};
}  // namespace

const GgufType* find_gguf_type(int64_t ggml_type) {
  for (const GgufType* type : kTypes)
    if (type->ggml_type == ggml_type) return type;
  return nullptr;
}

}  // namespace pipellm_gguf

// [ggml type, block values, block bytes, has an int8 path] for each type the kernels take.
std::vector<int64_t> pipellm_ops::gguf_kernel_types() {
  std::vector<int64_t> rows;
  for (const pipellm_gguf::GgufType* type : pipellm_gguf::kTypes)
    rows.insert(rows.end(), {type->ggml_type, type->block_values, type->block_bytes,
                             type->decode != nullptr});
  return rows;
}

PIPELLM_LIBRARY_FRAGMENT(m) {
  m.def("gguf_kernel_types() -> int[]", &pipellm_ops::gguf_kernel_types);
}
