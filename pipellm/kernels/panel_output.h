// The output side of pipellm's GEMMs over 16-column weight panels (packed_linear and
// quantized_linear): y [m, out_features], the bias padded to whole panels, and a [m, 16] buffer
// for a ragged last panel, whose real columns finish() copies into y.
#pragma once

#include <ATen/ATen.h>

#include <optional>

#include "gemm_microkernel.h"

namespace pipellm_kernels {

class PanelOutput {
 public:
  PanelOutput(int64_t m, int64_t out_features, int64_t panels,
              const std::optional<at::Tensor>& bias, const at::TensorOptions& options)
      : out_features_(out_features), panels_(panels) {
    TORCH_CHECK(out_features > (panels - 1) * kPanel && out_features <= panels * kPanel,
                "out_features does not match the packed weight");
    // Padded, so every panel starts its accumulators from 16 values.
    if (bias.has_value() && bias->defined()) {
      TORCH_CHECK(bias->numel() == out_features, "the bias needs out_features values");
      padded_bias_ = at::zeros({panels * kPanel}, options);
      padded_bias_.narrow(0, 0, out_features).copy_(bias->reshape({-1}));
    }
    out_ = at::empty({m, out_features}, options);
    if (out_features % kPanel != 0) tail_ = at::empty({m, kPanel}, options);
  }

  bool empty() const { return out_.size(0) == 0; }
  // Where panel p's 16 columns go, row 0, and the stride between rows there.
  float* dst(int64_t p) const {
    return is_tail(p) ? tail_.data_ptr<float>() : out_.data_ptr<float>() + p * kPanel;
  }
  int64_t ld(int64_t p) const { return is_tail(p) ? kPanel : out_features_; }
  // Panel p's 16 bias values, or nullptr for none.
  const float* bias(int64_t p) const {
    return padded_bias_.defined() ? padded_bias_.data_ptr<float>() + p * kPanel : nullptr;
  }

  at::Tensor finish() {
    if (tail_.defined()) {
      const int64_t start = (panels_ - 1) * kPanel, width = out_features_ - start;
      out_.narrow(1, start, width).copy_(tail_.narrow(1, 0, width));
    }
    return out_;
  }

 private:
  bool is_tail(int64_t p) const { return tail_.defined() && p == panels_ - 1; }

  int64_t out_features_, panels_;
  at::Tensor out_, tail_, padded_bias_;
};

}  // namespace pipellm_kernels
