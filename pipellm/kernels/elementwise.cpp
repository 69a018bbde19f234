// The elementwise steps between a layer's GEMMs, fused: RMSNorm (with the residual add before
// it, or over each query and key head of a q/k/v output), SiLU(gate) * up and GELU(gate) * up;
// and the greedy sampler's argmax over the vocabulary. Each is one pass over memory and one
// parallel region instead of the 3-6 ATen ops (and as many OpenMP fork/joins) PyTorch's CPU
// path takes: at decode sizes the ops' fixed costs, not their arithmetic, are what these save.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include "kernel_library.h"
#include "kernel_ops.h"

#include <immintrin.h>

#include "avx2_math.h"

#include <algorithm>
#include <cmath>

namespace {

using pipellm_kernels::exp_avx2;
using pipellm_kernels::horizontal_sum;

// Rows per parallel task: enough work (~16k floats) to be worth a thread.
int64_t grain_rows(int64_t width) { return std::max<int64_t>(1, 16384 / std::max<int64_t>(width, 1)); }

void check_rows(const at::Tensor& t, const char* what) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat && t.dim() == 2 &&
                  t.is_contiguous(),
              what, ": a contiguous 2-D float32 CPU tensor expected");
}

// out[i] = x[i] / sqrt(mean(x^2) + eps) * weight[i], one row of `width`.
void rms_norm_row(const float* x, const float* weight, float eps, int64_t width, float* out) {
  __m256 squares = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= width; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    squares = _mm256_fmadd_ps(v, v, squares);
  }
  float sum = horizontal_sum(squares);
  for (; i < width; ++i) sum += x[i] * x[i];
  const float inverse = 1.0f / std::sqrt(sum / static_cast<float>(width) + eps);
  const __m256 scale = _mm256_set1_ps(inverse);
  for (i = 0; i + 8 <= width; i += 8)
    _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(x + i), scale),
                                            _mm256_loadu_ps(weight + i)));
  for (; i < width; ++i) out[i] = x[i] * inverse * weight[i];
}

// gate_up: [T, 2 I], gate then up -> [T, I]: activation(gate) * up, 8 columns at a time by
// `vector`, the rest by `scalar`; both take (gate, up).
template <typename Vector, typename Scalar>
at::Tensor activation_and_mul(const at::Tensor& gate_up, const char* name, Vector vector,
                              Scalar scalar) {
  check_rows(gate_up, name);
  TORCH_CHECK(gate_up.size(1) % 2 == 0, name, ": odd width");
  const int64_t width = gate_up.size(1) / 2;
  at::Tensor out = at::empty({gate_up.size(0), width}, gate_up.options());
  const float* in = gate_up.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, gate_up.size(0), grain_rows(2 * width), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* gate = in + r * 2 * width;
      const float* up = gate + width;
      float* row = op + r * width;
      int64_t i = 0;
      for (; i + 8 <= width; i += 8)
        _mm256_storeu_ps(row + i, vector(_mm256_loadu_ps(gate + i), _mm256_loadu_ps(up + i)));
      for (; i < width; ++i) row[i] = scalar(gate[i], up[i]);
    }
  });
  return out;
}

// The index of the first largest value of x[0, width), or of its first NaN, as torch.argmax
// answers (a NaN is larger than any number). Two passes over the row (which stays in L2): the
// maximum, then its first position; torch's reduction takes ~105 us for SmolLM2's 49152-wide
// row, this ~10.
int64_t argmax_row(const float* x, int64_t width) {
  __m256 best = _mm256_set1_ps(-INFINITY);
  __m256 unordered = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= width; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    best = _mm256_max_ps(best, v);
    unordered = _mm256_or_ps(unordered, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  }
  float top = -INFINITY;
  bool nan = _mm256_movemask_ps(unordered) != 0;
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, best);
  for (float lane : lanes) top = std::max(top, lane);
  for (; i < width; ++i) {
    nan = nan || std::isnan(x[i]);
    top = std::max(top, x[i]);
  }
  if (nan) {
    for (i = 0; i < width; ++i)
      if (std::isnan(x[i])) return i;
  }
  const __m256 target = _mm256_set1_ps(top);
  for (i = 0; i + 8 <= width; i += 8) {
    const int mask = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + i), target, _CMP_EQ_OQ));
    if (mask != 0) return i + __builtin_ctz(mask);
  }
  for (; i < width; ++i)
    if (x[i] == top) return i;
  return 0;  // width 0 is refused by the caller; an all -inf row has matched above
}

}  // namespace

at::Tensor pipellm_ops::rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_rows(x, "rms_norm");
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == x.size(1), "rms_norm: weight size");
  const int64_t width = x.size(1);
  at::Tensor out = at::empty_like(x);
  const float* xp = x.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, x.size(0), grain_rows(width), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      rms_norm_row(xp + r * width, wp, static_cast<float>(eps), width, op + r * width);
  });
  return out;
}

// x += residual (in place: x then carries the residual stream on), returns rms_norm(x).
at::Tensor pipellm_ops::add_rms_norm_(const at::Tensor& x, const at::Tensor& residual,
                                      const at::Tensor& weight, double eps) {
  check_rows(x, "add_rms_norm_");
  check_rows(residual, "add_rms_norm_");
  TORCH_CHECK(residual.sizes() == x.sizes(), "add_rms_norm_: x and residual differ in shape");
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == x.size(1), "add_rms_norm_: weight");
  const int64_t width = x.size(1);
  at::Tensor out = at::empty_like(x);
  float* xp = x.data_ptr<float>();
  const float* rp = residual.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, x.size(0), grain_rows(width), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      float* row = xp + r * width;
      const float* res = rp + r * width;
      int64_t i = 0;
      for (; i + 8 <= width; i += 8)
        _mm256_storeu_ps(row + i, _mm256_add_ps(_mm256_loadu_ps(row + i), _mm256_loadu_ps(res + i)));
      for (; i < width; ++i) row[i] += res[i];
      rms_norm_row(row, wp, static_cast<float>(eps), width, op + r * width);
    }
  });
  return out;
}

// gate_up: [T, 2 I], gate then up. Returns [T, I]: silu(gate) * up = gate * up / (1 + e^-gate).
at::Tensor pipellm_ops::silu_and_mul(const at::Tensor& gate_up) {
  const __m256 one = _mm256_set1_ps(1.0f);
  return activation_and_mul(
      gate_up, "silu_and_mul",
      [&](__m256 g, __m256 u) {
        const __m256 denominator =
            _mm256_add_ps(one, exp_avx2(_mm256_sub_ps(_mm256_setzero_ps(), g)));
        return _mm256_div_ps(_mm256_mul_ps(g, u), denominator);
      },
      [](float g, float u) { return g * u / (1.0f + std::exp(-g)); });
}

// qkv: [T, num_heads + 2 num_kv_heads, head_dim], the q/k/v projection's output. In place,
// each query head is RMS-normed with q_weight and each key head with k_weight (Qwen3's and
// Gemma 3's q/k norms); the value heads stay as they are.
void pipellm_ops::head_rms_norm_(const at::Tensor& qkv, const at::Tensor& q_weight,
                                 const at::Tensor& k_weight, int64_t num_heads,
                                 int64_t num_kv_heads, double eps) {
  TORCH_CHECK(qkv.device().is_cpu() && qkv.scalar_type() == at::kFloat && qkv.dim() == 3 &&
                  qkv.is_contiguous(),
              "head_rms_norm_: qkv must be a contiguous 3-D float32 CPU tensor");
  TORCH_CHECK(num_heads > 0 && num_kv_heads > 0 && qkv.size(1) == num_heads + 2 * num_kv_heads,
              "head_rms_norm_: qkv has ", qkv.size(1), " heads, not num_heads (", num_heads,
              ") + 2 num_kv_heads (", num_kv_heads, ")");
  const int64_t head_dim = qkv.size(2);
  for (const at::Tensor* weight : {&q_weight, &k_weight})
    TORCH_CHECK(weight->scalar_type() == at::kFloat && weight->is_contiguous() &&
                    weight->numel() == head_dim,
                "head_rms_norm_: q_weight and k_weight must be float32 of head_dim (", head_dim,
                ") values");
  const int64_t heads = qkv.size(1);
  const int64_t normed = num_heads + num_kv_heads;  // per token: its query and key heads
  float* base = qkv.data_ptr<float>();
  const float* qw = q_weight.data_ptr<float>();
  const float* kw = k_weight.data_ptr<float>();
  const int64_t rows = qkv.size(0) * normed;
  at::parallel_for(0, rows, grain_rows(head_dim), [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t head = i % normed;
      float* row = base + ((i / normed) * heads + head) * head_dim;
      // In place is safe: rms_norm_row reads the whole row for its sum before it writes.
      rms_norm_row(row, head < num_heads ? qw : kw, static_cast<float>(eps), head_dim, row);
    }
  });
}

// gate_up: [T, 2 I], gate then up. Returns [T, I]: gelu(gate) * up with GELU's tanh
// approximation, 0.5 g (1 + tanh(z)), z = sqrt(2/pi) (g + 0.044715 g^3), computed as the
// equal g / (1 + e^-2z) * up: no 1 + tanh(z) to cancel where z is very negative, and where
// e^-2z overflows (g below about -10) g / inf gives the limit, -0, as F.gelu's tanh does.
at::Tensor pipellm_ops::gelu_tanh_and_mul(const at::Tensor& gate_up) {
  // -2z = g (-a - b g^2), a = 2 sqrt(2/pi), b = 2 sqrt(2/pi) 0.044715.
  constexpr float a = 1.5957691216057308f, b = 0.07135481627260025f;
  // Above 88, where exp_avx2 clamps its input, the denominator is +inf (the scalar tail's
  // std::exp overflows to it): g / e^-2z is below 1e-38 g there.
  constexpr float exp_limit = 88.0f;
  const __m256 minus_a = _mm256_set1_ps(-a), minus_b = _mm256_set1_ps(-b);
  const __m256 one = _mm256_set1_ps(1.0f), limit = _mm256_set1_ps(exp_limit);
  const __m256 infinity = _mm256_set1_ps(INFINITY);
  return activation_and_mul(
      gate_up, "gelu_tanh_and_mul",
      [&](__m256 g, __m256 u) {
        const __m256 exponent =
            _mm256_mul_ps(g, _mm256_fmadd_ps(_mm256_mul_ps(g, g), minus_b, minus_a));
        const __m256 denominator =
            _mm256_blendv_ps(_mm256_add_ps(one, exp_avx2(exponent)), infinity,
                             _mm256_cmp_ps(exponent, limit, _CMP_GT_OQ));
        return _mm256_mul_ps(_mm256_div_ps(g, denominator), u);
      },
      [](float g, float u) { return g / (1.0f + std::exp(g * (-a - b * (g * g)))) * u; });
}

// x: [rows, width] -> [rows] int64, each row's argmax (torch.argmax(x, -1)).
at::Tensor pipellm_ops::argmax_rows(const at::Tensor& x) {
  check_rows(x, "argmax_rows");
  TORCH_CHECK(x.size(1) > 0, "argmax_rows: rows of width 0 have no argmax");
  const int64_t width = x.size(1);
  at::Tensor out = at::empty({x.size(0)}, x.options().dtype(at::kLong));
  const float* xp = x.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, x.size(0), grain_rows(width), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) op[r] = argmax_row(xp + r * width, width);
  });
  return out;
}

PIPELLM_LIBRARY_FRAGMENT(m) {
  m.def("argmax_rows(Tensor x) -> Tensor", &pipellm_ops::argmax_rows);
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor", &pipellm_ops::rms_norm);
  m.def("add_rms_norm_(Tensor(a!) x, Tensor residual, Tensor weight, float eps) -> Tensor",
        &pipellm_ops::add_rms_norm_);
  m.def("silu_and_mul(Tensor gate_up) -> Tensor", &pipellm_ops::silu_and_mul);
  m.def("gelu_tanh_and_mul(Tensor gate_up) -> Tensor", &pipellm_ops::gelu_tanh_and_mul);
  m.def("head_rms_norm_(Tensor(a!) qkv, Tensor q_weight, Tensor k_weight, int num_heads, "
        "int num_kv_heads, float eps) -> ()",
        &pipellm_ops::head_rms_norm_);
}
