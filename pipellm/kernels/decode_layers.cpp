// All of a pipeline stage's decoder layers for a batch of decodes (one new token per sequence),
// in one call from Python (pipellm/model/decode_fast_path.py).
//
// Why: at one sequence a layer's Python forward takes well over its kernels' time; the
// difference is glue (module calls, the kernel wrappers' checks, view/split, one torch.ops
// dispatch from Python per kernel), about a third of a one-sequence decode step
// (docs/performance.md, "The fused decode path"). Here the glue is C++: each layer calls the
// SAME kernels, in the SAME order and on the same inputs as LlamaStage's Python path
// (model/llama.py), so the hidden states are bit-identical; the Python path stays the
// reference and the fallback (prefills, mixed batches, models the kernels do not cover). The
// kernels are called through their declarations (kernel_ops.h): a changed signature fails to
// compile here. Every step of a layer is one of those kernels, the q/k per-head norms and the
// GELU gate included; ATen is left with views, allocations and what the Python path does in
// ATen too (the stage's last residual add; with tensor parallelism, a pad and a copy).
//
// The family switches (model/model_config.py) are per layer: q/k norms (Qwen3, Gemma 3), the
// norms after attention and the MLP (Gemma 3's four a layer), the tanh-GELU gate (Gemma), a
// sliding window with its own KV-cache group and RoPE tables (Gemma 3, Mistral).
//
// With tensor parallelism each rank runs its share of the layers here too: after o_proj and
// after down_proj, where the Python path's Attention and MLP all-reduce, it calls the same
// shared-memory all-reduce (pipellm/parallel/shm_comm.cpp), and the attention kernel gets the
// rank's uneven query groups. Where heads straddle the ranks (model/tp_plan.py), q/k/v are
// computed by rows and all-gathered before attention, and o_proj takes a slice of the heads'
// outputs, as Attention.forward does.
//
// Python fills three TorchScript classes field by field (decode_fast_path.py): a DecodeLinear
// per linear layer, a DecodeLayer per decoder layer holding its norms, linears and switches,
// and one DecodeLayers for the stage, its attention geometry and tensor-parallel wiring, to
// which each layer is added; the KV caches, allocated after the weights, are bound later with
// set_caches.
#include <ATen/ATen.h>
#include <torch/custom_class.h>

#include "kernel_library.h"
#include "kernel_ops.h"

#include <optional>
#include <vector>

namespace {

using Optional = std::optional<at::Tensor>;

// How a linear layer computes (model/linear.py's PackedLinear, model/gguf_linear.py's
// QuantizedLinear); the Python side passes these codes.
enum Method : int64_t {
  kPacked = 0,
  kQuantized = 1,
  kQuantizedInt8 = 2,
  kGguf = 3,
  kGgufInt8 = 4
};

// One linear layer's weights, as its Python module holds them.
struct DecodeLinear : torch::CustomClassHolder {
  int64_t method = kPacked;
  at::Tensor weight;  // kPacked, kQuantized*: packed for its kernel
  Optional bias;
  int64_t kind = 0;  // kQuantized*: the repacked weight's kernel kind
  int64_t out_features = 0;
  std::vector<at::Tensor> parts;  // kGguf*: the stored weight parts, stacked by rows,
  std::vector<int64_t> types;     // and their GGUF types

  void check(const char* name) const {
    TORCH_CHECK(method >= kPacked && method <= kGgufInt8, "DecodeLayers: ", name, "'s method ",
                method, " is not 0 (packed), 1 (quantized), 2 (quantized, int8 activations), "
                "3 (GGUF parts) or 4 (GGUF parts, int8)");
    const bool gguf = method == kGguf || method == kGgufInt8;
    TORCH_CHECK(gguf ? !parts.empty() && parts.size() == types.size() : weight.defined(),
                "DecodeLayers: ", name, " needs ", gguf ? "parts with a type each" : "a weight");
    TORCH_CHECK(out_features > 0, "DecodeLayers: ", name, " has no out_features");
  }

  at::Tensor operator()(const at::Tensor& x) const {
    switch (static_cast<Method>(method)) {
      case kPacked:
        return pipellm_ops::packed_linear(x, weight, bias, out_features);
      case kQuantized:
        return pipellm_ops::quantized_linear(x, weight, kind, bias, out_features);
      case kQuantizedInt8:
        return pipellm_ops::quantized_linear_int8(x, weight, kind, bias, out_features);
      case kGguf:
        return pipellm_ops::gguf_linear(x, parts, types, bias, out_features);
      case kGgufInt8:
        return pipellm_ops::gguf_linear_int8(x, parts, types, bias, out_features);
    }
    TORCH_CHECK(false, "DecodeLayers: bad linear method ", method);
  }
};

// One decoder layer: Hugging Face's norm names; the optional ones only where the family has
// them.
struct DecodeLayer : torch::CustomClassHolder {
  at::Tensor input_layernorm, post_attention_layernorm;
  Optional q_norm, k_norm;  // over each query and key head, before RoPE
  // Sandwich norms: post_attention_layernorm then norms the attention output and
  // pre_feedforward_layernorm is the MLP's input norm; post_feedforward_layernorm norms its
  // output.
  Optional pre_feedforward_layernorm, post_feedforward_layernorm;
  c10::intrusive_ptr<DecodeLinear> qkv_proj, o_proj, gate_up_proj, down_proj;
  bool gelu_tanh = false;  // the MLP's gate: tanh-approximated GELU (GeGLU), else SiLU
  int64_t window = 0;      // > 0: attends to the last `window` positions only
  int64_t cache_group = 0;  // the KV-cache group whose slots and block tables it reads
  bool local_rope = false;  // takes the second RoPE tables (the window layers' own base)

  void check() const {
    TORCH_CHECK(input_layernorm.defined() && post_attention_layernorm.defined(),
                "DecodeLayers: a layer needs input_layernorm and post_attention_layernorm");
    TORCH_CHECK(q_norm.has_value() == k_norm.has_value(),
                "DecodeLayers: q_norm and k_norm come together");
    TORCH_CHECK(pre_feedforward_layernorm.has_value() == post_feedforward_layernorm.has_value(),
                "DecodeLayers: pre_ and post_feedforward_layernorm come together");
    TORCH_CHECK(window >= 0 && cache_group >= 0, "DecodeLayers: negative window or group");
    const std::pair<const char*, const c10::intrusive_ptr<DecodeLinear>*> linears[] = {
        {"qkv_proj", &qkv_proj},
        {"o_proj", &o_proj},
        {"gate_up_proj", &gate_up_proj},
        {"down_proj", &down_proj}};
    for (const auto& [name, linear] : linears) {
      TORCH_CHECK(*linear, "DecodeLayers: a layer's ", name, " is not set");
      (*linear)->check(name);
    }
  }
};

class DecodeLayers : public torch::CustomClassHolder {
 public:
  // The stage's attention geometry (every layer of a rank holds the same heads,
  // model/tp_plan.py) and norms' eps.
  int64_t num_heads = 0, num_kv_heads = 0, head_dim = 0;
  double scale = 1.0, eps = 1e-6;
  // Each KV head's first query head and the end (model/tp_plan.py's kv_group_starts), empty
  // where the groups are even.
  std::vector<int64_t> group_starts;
  // The tensor-parallel group's shared-memory communicator (ShmComm's handle), 0 without
  // tensor parallelism.
  int64_t comm_handle = 0;
  // Where q/k/v rows are all-gathered (Attention.gather_index), each rank's part padded to
  // qkv_width; unset otherwise.
  Optional gather_index;
  int64_t qkv_width = 0;
  // (o_offset, o_columns) where o_proj takes part of the heads' outputs, else empty.
  std::vector<int64_t> o_slice;

  void add_layer(c10::intrusive_ptr<DecodeLayer> layer) {
    TORCH_CHECK(layer, "DecodeLayers.add_layer: no layer");
    layer->check();
    TORCH_CHECK(num_heads > 0 && num_kv_heads > 0 && head_dim > 0,
                "DecodeLayers: set num_heads, num_kv_heads and head_dim before adding layers");
    TORCH_CHECK(group_starts.empty() ||
                    static_cast<int64_t>(group_starts.size()) == num_kv_heads + 1,
                "DecodeLayers: group_starts holds num_kv_heads + 1 offsets");
    TORCH_CHECK(!gather_index.has_value() || comm_handle != 0,
                "DecodeLayers: gathering q/k/v rows needs a communicator");
    TORCH_CHECK(o_slice.empty() || o_slice.size() == 2,
                "DecodeLayers: o_slice is (o_offset, o_columns)");
    layers_.push_back(std::move(layer));
  }

  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }

  // Per layer (key cache, value cache), as the Python path's kv_caches.
  void set_caches(std::vector<at::Tensor> caches) {
    TORCH_CHECK(static_cast<int64_t>(caches.size()) == 2 * num_layers(),
                "DecodeLayers.set_caches: a key and a value cache per layer");
    caches_ = std::move(caches);
  }

  // x: [T, hidden], one decode a row; rope: (cos, sin) at the rows' positions, then the
  // local_rope layers' (cos, sin) where any layer has them; per KV-cache group, the rows'
  // slot_mapping, block_tables and context_lens (ForwardBatch.for_group). Returns the
  // stage's output, as LlamaStage.forward does: the last MLP output plus the residual.
  at::Tensor forward(at::Tensor x, std::vector<at::Tensor> rope,
                     std::vector<at::Tensor> slot_mappings, std::vector<at::Tensor> block_tables,
                     std::vector<at::Tensor> context_lens) {
    TORCH_CHECK(static_cast<int64_t>(caches_.size()) == 2 * num_layers(),
                "DecodeLayers: set_caches first");
    TORCH_CHECK(rope.size() == 2 || rope.size() == 4,
                "DecodeLayers.forward: rope is (cos, sin) or (cos, sin, local cos, local sin)");
    TORCH_CHECK(slot_mappings.size() == block_tables.size() &&
                    context_lens.size() == block_tables.size(),
                "DecodeLayers.forward: one slot_mapping, block_tables and context_lens a group");
    if (layers_.empty()) return x;
    at::Tensor residual;
    for (int64_t l = 0; l < num_layers(); ++l) {
      const DecodeLayer& layer = *layers_[l];
      const size_t group = static_cast<size_t>(layer.cache_group);
      TORCH_CHECK(group < block_tables.size(), "DecodeLayers.forward: no tables for group ",
                  group);
      TORCH_CHECK(!layer.local_rope || rope.size() == 4,
                  "DecodeLayers.forward: a layer needs the local RoPE tables");
      const size_t tables = layer.local_rope ? 2 : 0;
      // DecoderLayer.forward: x += residual; h = norm(x); the residual stream goes on in x.
      at::Tensor h;
      if (l == 0) {
        h = pipellm_ops::rms_norm(x, layer.input_layernorm, eps);
      } else {
        h = pipellm_ops::add_rms_norm_(x, residual, layer.input_layernorm, eps);
      }
      residual = x;
      at::Tensor out = attention(layer, h, rope[tables], rope[tables + 1], slot_mappings[group],
                                 block_tables[group], context_lens[group], 2 * l);
      if (layer.pre_feedforward_layernorm) {
        out = pipellm_ops::rms_norm(out, layer.post_attention_layernorm, eps);
        h = pipellm_ops::add_rms_norm_(out, residual, *layer.pre_feedforward_layernorm, eps);
        x = pipellm_ops::rms_norm(mlp(layer, h), *layer.post_feedforward_layernorm, eps);
      } else {
        h = pipellm_ops::add_rms_norm_(out, residual, layer.post_attention_layernorm, eps);
        x = mlp(layer, h);
      }
      residual = out;
    }
    return x.add_(residual);
  }

 private:
  // Attention.forward.
  at::Tensor attention(const DecodeLayer& layer, const at::Tensor& h, const at::Tensor& cos,
                       const at::Tensor& sin, const at::Tensor& slot_mapping,
                       const at::Tensor& block_tables, const at::Tensor& context_lens,
                       int64_t cache) {
    const int64_t tokens = h.size(0);
    const at::Tensor& key_cache = caches_[cache];
    const at::Tensor& value_cache = caches_[cache + 1];
    at::Tensor qkv = gather_heads((*layer.qkv_proj)(h)).view({tokens, -1, head_dim});
    if (layer.q_norm) {  // Attention._norm_query_and_key_heads, in place
      pipellm_ops::head_rms_norm_(qkv, *layer.q_norm, *layer.k_norm, num_heads, num_kv_heads,
                                  eps);
    }
    pipellm_ops::rotary_and_cache_(qkv, cos, sin, key_cache, value_cache, slot_mapping,
                                   num_heads, num_kv_heads);
    const at::Tensor q = qkv.narrow(1, 0, num_heads);
    const at::Tensor attended = at::empty(q.sizes(), q.options());
    pipellm_ops::paged_decode_attention(attended, q, key_cache, value_cache, block_tables,
                                        context_lens, scale, query_groups(), layer.window);
    at::Tensor heads_out = attended.view({tokens, -1});
    if (!o_slice.empty()) heads_out = heads_out.narrow(1, o_slice[0], o_slice[1]).contiguous();
    const at::Tensor out = (*layer.o_proj)(heads_out);
    all_reduce(out);  // Attention.forward's
    return out;
  }

  // MLP.forward.
  at::Tensor mlp(const DecodeLayer& layer, const at::Tensor& h) {
    const at::Tensor gate_up = (*layer.gate_up_proj)(h);
    const at::Tensor activated = layer.gelu_tanh ? pipellm_ops::gelu_tanh_and_mul(gate_up)
                                                 : pipellm_ops::silu_and_mul(gate_up);
    at::Tensor out = (*layer.down_proj)(activated);
    all_reduce(out);  // MLP.forward's
    return out;
  }

  at::OptionalIntArrayRef query_groups() const {
    if (group_starts.empty()) return std::nullopt;
    return at::IntArrayRef(group_starts);
  }

  // The computed q/k/v rows [T, w] -> this rank's heads' rows: the ranks' parts (each padded
  // to qkv_width) side by side, columns picked by gather_index. Unchanged where no head
  // straddles.
  at::Tensor gather_heads(at::Tensor qkv) const {
    if (!gather_index) return qkv;
    if (qkv.size(1) < qkv_width) qkv = at::constant_pad_nd(qkv, {0, qkv_width - qkv.size(1)});
    at::Tensor heads = at::empty({qkv.size(0), gather_index->numel()}, qkv.options());
    pipellm_ops::shm_all_gather_columns(qkv.contiguous(), *gather_index, heads, comm_handle);
    return heads;
  }

  // The row-parallel partial sums added over the ranks, in place; nothing without TP.
  void all_reduce(const at::Tensor& x) const {
    if (comm_handle != 0) pipellm_ops::shm_all_reduce_(x, comm_handle);
  }

  std::vector<c10::intrusive_ptr<DecodeLayer>> layers_;
  std::vector<at::Tensor> caches_;
};

}  // namespace

PIPELLM_LIBRARY_FRAGMENT(m) {
  m.class_<DecodeLinear>("DecodeLinear")
      .def(torch::init<>())
      .def_readwrite("method", &DecodeLinear::method)
      .def_readwrite("weight", &DecodeLinear::weight)
      .def_readwrite("bias", &DecodeLinear::bias)
      .def_readwrite("kind", &DecodeLinear::kind)
      .def_readwrite("out_features", &DecodeLinear::out_features)
      .def_readwrite("parts", &DecodeLinear::parts)
      .def_readwrite("types", &DecodeLinear::types);
  m.class_<DecodeLayer>("DecodeLayer")
      .def(torch::init<>())
      .def_readwrite("input_layernorm", &DecodeLayer::input_layernorm)
      .def_readwrite("post_attention_layernorm", &DecodeLayer::post_attention_layernorm)
      .def_readwrite("q_norm", &DecodeLayer::q_norm)
      .def_readwrite("k_norm", &DecodeLayer::k_norm)
      .def_readwrite("pre_feedforward_layernorm", &DecodeLayer::pre_feedforward_layernorm)
      .def_readwrite("post_feedforward_layernorm", &DecodeLayer::post_feedforward_layernorm)
      .def_readwrite("qkv_proj", &DecodeLayer::qkv_proj)
      .def_readwrite("o_proj", &DecodeLayer::o_proj)
      .def_readwrite("gate_up_proj", &DecodeLayer::gate_up_proj)
      .def_readwrite("down_proj", &DecodeLayer::down_proj)
      .def_readwrite("gelu_tanh", &DecodeLayer::gelu_tanh)
      .def_readwrite("window", &DecodeLayer::window)
      .def_readwrite("cache_group", &DecodeLayer::cache_group)
      .def_readwrite("local_rope", &DecodeLayer::local_rope);
  m.class_<DecodeLayers>("DecodeLayers")
      .def(torch::init<>())
      .def_readwrite("num_heads", &DecodeLayers::num_heads)
      .def_readwrite("num_kv_heads", &DecodeLayers::num_kv_heads)
      .def_readwrite("head_dim", &DecodeLayers::head_dim)
      .def_readwrite("scale", &DecodeLayers::scale)
      .def_readwrite("eps", &DecodeLayers::eps)
      .def_readwrite("group_starts", &DecodeLayers::group_starts)
      .def_readwrite("comm_handle", &DecodeLayers::comm_handle)
      .def_readwrite("gather_index", &DecodeLayers::gather_index)
      .def_readwrite("qkv_width", &DecodeLayers::qkv_width)
      .def_readwrite("o_slice", &DecodeLayers::o_slice)
      .def("add_layer", &DecodeLayers::add_layer)
      .def("num_layers", &DecodeLayers::num_layers)
      .def("set_caches", &DecodeLayers::set_caches)
      .def("forward", &DecodeLayers::forward);
}
