// All of a pipeline stage's decoder layers for a batch of decodes (one new token per sequence),
// in one call from Python (pipellm/model/decode_fast_path.py).
//
// Why: at one sequence a layer's Python forward takes well over its kernels' time; the
// difference is glue (module calls, the kernel wrappers' checks, view/split, one torch.ops
// dispatch from Python per kernel), about a third of a one-sequence decode step
// (docs/performance.md, "The fused decode path"). Here the glue is C++: each layer calls the SAME kernels, in the
// SAME order and on the same inputs as LlamaStage's Python path (model/llama.py), through the
// dispatcher with typed handles looked up once, so the hidden states are bit-identical; the
// Python path stays the reference and the fallback (prefills, mixed batches, models the
// kernels do not cover).
//
// With tensor parallelism each rank runs its share of the layers here too: after o_proj and
// after down_proj, where the Python path's Attention and MLP all-reduce, it calls the same
// shared-memory all-reduce (pipellm/parallel/shm_comm.cpp, registered as the op
// pipellm_shm::all_reduce_), and the attention kernel gets the rank's uneven query groups.
// Where heads straddle the ranks (model/tp_plan.py), q/k/v are computed by rows and
// all-gathered (pipellm_shm::all_gather_columns) before attention, and o_proj takes a slice
// of the heads' outputs, as Attention.forward does.
//
// A DecodeLayers object (a TorchScript custom class) holds a stage's weights, built once at
// load; the KV caches, allocated after the weights, are bound later with set_caches.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/custom_class.h>

#include "kernel_library.h"

#include <optional>
#include <string>
#include <vector>

namespace {

#define PIPELLM_STRINGIFY_(x) #x
#define PIPELLM_STRINGIFY(x) PIPELLM_STRINGIFY_(x)

// This level's op `name`, with the C++ signature its kernel was registered with.
template <class Signature>
c10::TypedOperatorHandle<Signature> level_op(const char* name) {
  const std::string qualified = std::string(PIPELLM_STRINGIFY(PIPELLM_OPS_NAMESPACE)) + "::" + name;
  return c10::Dispatcher::singleton().findSchemaOrThrow(qualified.c_str(), "").typed<Signature>();
}

using Optional = std::optional<at::Tensor>;
using PackedLinearFn = at::Tensor(const at::Tensor&, const at::Tensor&, const Optional&, int64_t);
using QuantizedLinearFn =
    at::Tensor(const at::Tensor&, const at::Tensor&, int64_t, const Optional&, int64_t);
// gguf_linear.cpp's ops: weight parts of GGUF types stacked by rows.
using GgufLinearFn = at::Tensor(const at::Tensor&, at::TensorList, at::IntArrayRef,
                                const Optional&, int64_t);
using RmsNormFn = at::Tensor(const at::Tensor&, const at::Tensor&, double);
using AddRmsNormFn = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, double);
using SiluAndMulFn = at::Tensor(const at::Tensor&);
using RotaryFn = void(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                      const at::Tensor&, const at::Tensor&, int64_t, int64_t);
using AttentionFn = void(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                         const at::Tensor&, const at::Tensor&, const at::Tensor&, double,
                         at::OptionalIntArrayRef, int64_t);
using AllReduceFn = void(const at::Tensor&, int64_t);
using AllGatherColumnsFn = void(const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t);

// How a linear layer computes (model/linear.py's PackedLinear, model/gguf_linear.py's
// QuantizedLinear); the Python side passes these codes.
enum Method : int64_t {
  kPacked = 0,
  kQuantized = 1,
  kQuantizedInt8 = 2,
  kGguf = 3,
  kGgufInt8 = 4
};
constexpr int64_t kLinearsPerLayer = 4;  // qkv_proj, o_proj, gate_up_proj, down_proj
constexpr int64_t kNormsPerLayer = 2;    // input_layernorm, post_attention_layernorm

struct Linear {
  Method method;
  at::Tensor weight;  // packed for its kernel
  Optional bias;
  int64_t kind;  // the GGUF kind code of the quantized kernels; unused for kPacked
  int64_t out_features;
  std::vector<at::Tensor> parts;  // kGguf*: the stored weight parts and their GGUF types
  std::vector<int64_t> types;
};

class DecodeLayers : public torch::CustomClassHolder {
 public:
  // Per layer, in order: norms = (input_layernorm, post_attention_layernorm) weights; the
  // linears (qkv_proj, o_proj, gate_up_proj, down_proj) as weights, biases (an empty tensor:
  // none), methods, kinds and out_features. group_starts: each KV head's first query head
  // and the end (model/tp_plan.py's kv_group_starts), empty where the groups are even.
  // all_reduce_handle: the tensor-parallel group's shared-memory communicator (ShmComm's
  // handle), 0 without tensor parallelism. gather_index (Attention.gather_index) where q/k/v
  // rows are all-gathered, each rank's part padded to qkv_width, else empty (and qkv_width
  // unused); o_slice = (o_offset, o_columns) where o_proj takes part of the heads' outputs,
  // else empty. gguf_parts, gguf_types: the weight parts of the kGguf* linears, in order, each
  // such linear's `kinds` entry saying how many it takes (its `weights` entry is unused).
  DecodeLayers(std::vector<at::Tensor> norms, std::vector<at::Tensor> weights,
               std::vector<at::Tensor> biases, std::vector<int64_t> methods,
               std::vector<int64_t> kinds, std::vector<int64_t> out_features, int64_t num_heads,
               int64_t num_kv_heads, int64_t head_dim, double scale, double eps,
               std::vector<int64_t> group_starts, int64_t all_reduce_handle,
               int64_t qkv_width, at::Tensor gather_index, std::vector<int64_t> o_slice,
               std::vector<at::Tensor> gguf_parts, std::vector<int64_t> gguf_types)
      : norms_(std::move(norms)),
        group_starts_(std::move(group_starts)),
        all_reduce_handle_(all_reduce_handle),
        qkv_width_(qkv_width),
        gather_index_(std::move(gather_index)),
        o_slice_(std::move(o_slice)),
        num_heads_(num_heads),
        num_kv_heads_(num_kv_heads),
        head_dim_(head_dim),
        scale_(scale),
        eps_(eps),
        packed_linear_(level_op<PackedLinearFn>("packed_linear")),
        quantized_linear_(level_op<QuantizedLinearFn>("quantized_linear")),
        rms_norm_(level_op<RmsNormFn>("rms_norm")),
        add_rms_norm_(level_op<AddRmsNormFn>("add_rms_norm_")),
        silu_and_mul_(level_op<SiluAndMulFn>("silu_and_mul")),
        rotary_and_cache_(level_op<RotaryFn>("rotary_and_cache_")),
        paged_decode_attention_(level_op<AttentionFn>("paged_decode_attention")) {
    TORCH_CHECK(group_starts_.empty() ||
                    static_cast<int64_t>(group_starts_.size()) == num_kv_heads + 1,
                "DecodeLayers: group_starts holds num_kv_heads + 1 offsets");
    // By name, and only here: without tensor parallelism the shm library need not be loaded.
    if (all_reduce_handle_ != 0)
      all_reduce_ = c10::Dispatcher::singleton()
                        .findSchemaOrThrow("pipellm_shm::all_reduce_", "")
                        .typed<AllReduceFn>();
    TORCH_CHECK(gather_index_.numel() == 0 || all_reduce_handle_ != 0,
                "DecodeLayers: gathering q/k/v rows needs a communicator");
    TORCH_CHECK(o_slice_.empty() || o_slice_.size() == 2, "DecodeLayers: o_slice is "
                "(o_offset, o_columns)");
    if (gather_index_.numel() > 0)
      all_gather_columns_ = c10::Dispatcher::singleton()
                                .findSchemaOrThrow("pipellm_shm::all_gather_columns", "")
                                .typed<AllGatherColumnsFn>();
    const size_t count = weights.size();
    TORCH_CHECK(count % kLinearsPerLayer == 0 && biases.size() == count &&
                    methods.size() == count && kinds.size() == count &&
                    out_features.size() == count,
                "DecodeLayers: 4 linears a layer, each with a weight, bias, method, kind and "
                "out_features");
    num_layers_ = static_cast<int64_t>(count) / kLinearsPerLayer;
    TORCH_CHECK(static_cast<int64_t>(norms_.size()) == kNormsPerLayer * num_layers_,
                "DecodeLayers: 2 norm weights a layer");
    TORCH_CHECK(gguf_parts.size() == gguf_types.size(),
                "DecodeLayers: one GGUF type per gguf part");
    size_t next_part = 0;
    for (size_t i = 0; i < count; ++i) {
      TORCH_CHECK(methods[i] >= kPacked && methods[i] <= kGgufInt8,
                  "DecodeLayers: method ", methods[i], " is not 0 (packed), 1 (quantized), 2 "
                  "(quantized, int8 activations), 3 (GGUF parts) or 4 (GGUF parts, int8)");
      const Method method = static_cast<Method>(methods[i]);
      if (method == kQuantizedInt8 && !quantized_linear_int8_)
        quantized_linear_int8_ = level_op<QuantizedLinearFn>("quantized_linear_int8");
      Optional bias;
      if (biases[i].numel() > 0) bias = biases[i];
      Linear linear{method, weights[i], bias, kinds[i], out_features[i], {}, {}};
      if (method == kGguf || method == kGgufInt8) {
        const char* name = method == kGguf ? "gguf_linear" : "gguf_linear_int8";
        auto& op = method == kGguf ? gguf_linear_ : gguf_linear_int8_;
        if (!op) op = level_op<GgufLinearFn>(name);
        TORCH_CHECK(kinds[i] > 0 && next_part + kinds[i] <= gguf_parts.size(),
                    "DecodeLayers: a GGUF linear's parts run past gguf_parts");
        for (int64_t p = 0; p < kinds[i]; ++p, ++next_part) {
          linear.parts.push_back(gguf_parts[next_part]);
          linear.types.push_back(gguf_types[next_part]);
        }
      }
      linears_.push_back(std::move(linear));
    }
    TORCH_CHECK(next_part == gguf_parts.size(), "DecodeLayers: gguf_parts left over");
  }

  // Per layer (key cache, value cache), as the Python path's kv_caches.
  void set_caches(std::vector<at::Tensor> caches) {
    TORCH_CHECK(static_cast<int64_t>(caches.size()) == 2 * num_layers_,
                "DecodeLayers.set_caches: a key and a value cache per layer");
    caches_ = std::move(caches);
  }

  // x: [T, hidden], one decode a row; cos, sin: the rope tables at the rows' positions. Returns
  // the stage's output, as LlamaStage.forward does: the last MLP output plus the residual.
  at::Tensor forward(at::Tensor x, at::Tensor cos, at::Tensor sin, at::Tensor slot_mapping,
                     at::Tensor block_tables, at::Tensor context_lens) {
    TORCH_CHECK(static_cast<int64_t>(caches_.size()) == 2 * num_layers_,
                "DecodeLayers: set_caches first");
    if (num_layers_ == 0) return x;
    const int64_t tokens = x.size(0);
    at::Tensor residual;
    for (int64_t l = 0; l < num_layers_; ++l) {
      const Linear* linear = &linears_[l * kLinearsPerLayer];
      const at::Tensor& key_cache = caches_[2 * l];
      const at::Tensor& value_cache = caches_[2 * l + 1];
      // DecoderLayer.forward: x += residual; h = norm(x); the residual stream goes on in x.
      at::Tensor h;
      if (l == 0) {
        h = rms_norm_.call(x, norms_[kNormsPerLayer * l], eps_);
        residual = x;
      } else {
        h = add_rms_norm_.call(x, residual, norms_[kNormsPerLayer * l], eps_);
        residual = x;
      }
      // Attention.forward
      const at::Tensor qkv = gather_heads(apply(linear[0], h)).view({tokens, -1, head_dim_});
      rotary_and_cache_.call(qkv, cos, sin, key_cache, value_cache, slot_mapping, num_heads_,
                             num_kv_heads_);
      const at::Tensor q = qkv.narrow(1, 0, num_heads_);
      const at::Tensor attended = at::empty(q.sizes(), q.options());
      paged_decode_attention_.call(attended, q, key_cache, value_cache, block_tables,
                                   context_lens, scale_, group_starts(), /*window=*/0);
      at::Tensor heads_out = attended.view({tokens, -1});
      if (!o_slice_.empty()) heads_out = heads_out.narrow(1, o_slice_[0], o_slice_[1]).contiguous();
      const at::Tensor out = apply(linear[1], heads_out);
      all_reduce(out);  // Attention.forward's
      h = add_rms_norm_.call(out, residual, norms_[kNormsPerLayer * l + 1], eps_);
      // MLP.forward
      x = apply(linear[3], silu_and_mul_.call(apply(linear[2], h)));
      all_reduce(x);  // MLP.forward's
      residual = out;
    }
    return x.add_(residual);
  }

 private:
  at::OptionalIntArrayRef group_starts() const {
    if (group_starts_.empty()) return std::nullopt;
    return at::IntArrayRef(group_starts_);
  }

  // The computed q/k/v rows [T, w] -> this rank's heads' rows: the ranks' parts (each padded
  // to qkv_width) side by side, columns picked by gather_index. Unchanged where no head
  // straddles.
  at::Tensor gather_heads(at::Tensor qkv) {
    if (!all_gather_columns_) return qkv;
    if (qkv.size(1) < qkv_width_) qkv = at::constant_pad_nd(qkv, {0, qkv_width_ - qkv.size(1)});
    at::Tensor heads = at::empty({qkv.size(0), gather_index_.numel()}, qkv.options());
    all_gather_columns_->call(qkv.contiguous(), gather_index_, heads, all_reduce_handle_);
    return heads;
  }

  // The row-parallel partial sums added over the ranks, in place; nothing without TP.
  void all_reduce(const at::Tensor& x) {
    if (all_reduce_) all_reduce_->call(x, all_reduce_handle_);
  }

  at::Tensor apply(const Linear& linear, const at::Tensor& x) {
    switch (linear.method) {
      case kPacked:
        return packed_linear_.call(x, linear.weight, linear.bias, linear.out_features);
      case kQuantized:
        return quantized_linear_.call(x, linear.weight, linear.kind, linear.bias,
                                      linear.out_features);
      case kQuantizedInt8:
        return quantized_linear_int8_->call(x, linear.weight, linear.kind, linear.bias,
                                            linear.out_features);
      case kGguf:
        return gguf_linear_->call(x, linear.parts, linear.types, linear.bias,
                                  linear.out_features);
      case kGgufInt8:
        return gguf_linear_int8_->call(x, linear.parts, linear.types, linear.bias,
                                       linear.out_features);
    }
    TORCH_CHECK(false, "DecodeLayers: bad linear method");
  }

  std::vector<at::Tensor> norms_;
  std::vector<Linear> linears_;
  std::vector<at::Tensor> caches_;
  std::vector<int64_t> group_starts_;
  int64_t all_reduce_handle_;
  int64_t qkv_width_;
  at::Tensor gather_index_;
  std::vector<int64_t> o_slice_;
  int64_t num_layers_ = 0;
  int64_t num_heads_, num_kv_heads_, head_dim_;
  double scale_, eps_;
  c10::TypedOperatorHandle<PackedLinearFn> packed_linear_;
  c10::TypedOperatorHandle<QuantizedLinearFn> quantized_linear_;
  c10::TypedOperatorHandle<RmsNormFn> rms_norm_;
  c10::TypedOperatorHandle<AddRmsNormFn> add_rms_norm_;
  c10::TypedOperatorHandle<SiluAndMulFn> silu_and_mul_;
  c10::TypedOperatorHandle<RotaryFn> rotary_and_cache_;
  c10::TypedOperatorHandle<AttentionFn> paged_decode_attention_;
  // int8_linear.cpp's op, looked up only where a layer uses it.
  std::optional<c10::TypedOperatorHandle<QuantizedLinearFn>> quantized_linear_int8_;
  std::optional<c10::TypedOperatorHandle<GgufLinearFn>> gguf_linear_, gguf_linear_int8_;
  std::optional<c10::TypedOperatorHandle<AllReduceFn>> all_reduce_;
  std::optional<c10::TypedOperatorHandle<AllGatherColumnsFn>> all_gather_columns_;
};

}  // namespace

PIPELLM_LIBRARY_FRAGMENT(m) {
  m.class_<DecodeLayers>("DecodeLayers")
      .def(torch::init<std::vector<at::Tensor>, std::vector<at::Tensor>, std::vector<at::Tensor>,
                       std::vector<int64_t>, std::vector<int64_t>, std::vector<int64_t>, int64_t,
                       int64_t, int64_t, double, double, std::vector<int64_t>, int64_t,
                       int64_t, at::Tensor, std::vector<int64_t>, std::vector<at::Tensor>,
                       std::vector<int64_t>>())
      .def("set_caches", &DecodeLayers::set_caches)
      .def("forward", &DecodeLayers::forward);
}
