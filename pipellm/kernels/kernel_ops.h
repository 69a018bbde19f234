// The C++ signature of every op pipellm's kernel library registers (kernel_library.h), one
// declaration each. A source defines its op as `pipellm_ops::NAME` (a qualified definition
// compiles only if it matches the declaration here) and registers that function; C++ callers
// (decode_layers.cpp) call these declarations directly, so a changed signature breaks the
// build, not a run. The namespace is hidden (each level's library keeps its own copy), which
// also makes a declaration without its definition fail at link time rather than at load
// (-fvisibility=hidden alone leaves declarations default). Python's wrappers of the same ops,
// with the same parameter names: pipellm/kernels/kernel_ops.py.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace pipellm_ops __attribute__((visibility("hidden"))) {

// packed_linear.cpp: float32 weights packed for the GEMM.
at::Tensor pack_linear_weight(const at::Tensor& weight);
at::Tensor packed_linear(const at::Tensor& input, const at::Tensor& packed,
                         const std::optional<at::Tensor>& bias, int64_t out_features);

// quantized_linear.cpp, int8_linear.cpp: repacked Q4_1 / Q8_0 / Q5_0 weights.
at::Tensor quantized_linear(const at::Tensor& input, const at::Tensor& packed, int64_t kind,
                            const std::optional<at::Tensor>& bias, int64_t out_features);
at::Tensor quantized_linear_int8(const at::Tensor& input, const at::Tensor& packed, int64_t kind,
                                 const std::optional<at::Tensor>& bias, int64_t out_features);

// gguf_linear.cpp: weight parts in GGUF types, stacked by rows; gguf_type_table.cpp.
at::Tensor gguf_linear(const at::Tensor& input, at::TensorList parts, at::IntArrayRef types,
                       const std::optional<at::Tensor>& bias, int64_t out_features);
at::Tensor gguf_linear_int8(const at::Tensor& input, at::TensorList parts, at::IntArrayRef types,
                            const std::optional<at::Tensor>& bias, int64_t out_features);
at::Tensor gguf_embedding(const at::Tensor& ids, const at::Tensor& blocks, int64_t ggml_type,
                          int64_t hidden);
std::vector<int64_t> gguf_kernel_types();
at::Tensor q8_0_panel_rows(const at::Tensor& ids, const at::Tensor& packed, bool int8_lanes,
                           int64_t rows);

// rotary_and_cache.cpp, paged_decode_attention.cpp, prefill_attention.cpp.
void rotary_and_cache_(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                       const at::Tensor& key_cache, const at::Tensor& value_cache,
                       const at::Tensor& slot_mapping, int64_t num_heads, int64_t num_kv_heads);
void paged_decode_attention(const at::Tensor& out, const at::Tensor& query,
                            const at::Tensor& key_cache, const at::Tensor& value_cache,
                            const at::Tensor& block_tables, const at::Tensor& context_lens,
                            double scale, at::OptionalIntArrayRef group_starts, int64_t window);
void prefill_attention(const at::Tensor& out, const at::Tensor& q, const at::Tensor& k,
                       const at::Tensor& v, double scale, at::OptionalIntArrayRef group_starts,
                       int64_t window, int64_t prefix,
                       const std::optional<at::Tensor>& block_table);

// elementwise.cpp.
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);
at::Tensor add_rms_norm_(const at::Tensor& x, const at::Tensor& residual,
                         const at::Tensor& weight, double eps);
void head_rms_norm_(const at::Tensor& qkv, const at::Tensor& q_weight,
                    const at::Tensor& k_weight, int64_t num_heads, int64_t num_kv_heads,
                    double eps);
at::Tensor silu_and_mul(const at::Tensor& gate_up);
at::Tensor gelu_tanh_and_mul(const at::Tensor& gate_up);
at::Tensor argmax_rows(const at::Tensor& x);

// pipellm/parallel/shm_comm.cpp: a tensor-parallel group's shared-memory collectives.
int64_t shm_open_segment(const std::string& name, bool create, int64_t size, int64_t rank,
                         int64_t capacity);
void shm_close_segment(int64_t handle);
void shm_unlink_segment(const std::string& name);
void shm_all_reduce_(const at::Tensor& x, int64_t handle);
void shm_all_gather(const at::Tensor& x, const at::Tensor& out, int64_t handle);
void shm_all_gather_columns(const at::Tensor& x, const at::Tensor& index, const at::Tensor& out,
                            int64_t handle);
void shm_broadcast_send(const at::Tensor& data, int64_t handle);
at::Tensor shm_broadcast_recv(int64_t handle, int64_t root);

}  // namespace pipellm_ops
