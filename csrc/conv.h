// Shared by the CPU and CUDA conv kernels (conv_bn_silu, temporal_conv): validation and shapes.
// Nothing here touches tensor data, so every check is safe on any device.
#pragma once
#include <algorithm>
#include <array>
#include <utility>

#include "checks.h"
#include "layout.h"

namespace vd {

constexpr const char* kConvBnSiluOp = "vd::conv_bn_silu";
constexpr const char* kTemporalConvOp = "vd::temporal_conv";

// A per-output-channel parameter: (n,) of any float dtype (kernels cast it), on x's device.
inline void check_channel_param(const at::Tensor& t, int64_t n, const at::Tensor& x, const char* op,
                                const char* name) {
  check_vector(std::optional<at::Tensor>(t), n, x, op, name);
}

// The checks every conv op starts with: x and weight of rank dim, x a float tensor, weight on x's
// device and of x's dtype.
inline void check_conv_operands(const at::Tensor& x, const at::Tensor& weight, int64_t dim,
                                const char* op, const char* x_layout, const char* w_layout) {
  check_dim(x, dim, op, "x", x_layout);
  check_dim(weight, dim, op, "weight", w_layout);
  check_float_dtype(x, op, "x");
  check_same_device(x, weight, op, "x", "weight");
  check_same_dtype(x, weight, op, "x", "weight");
}

// A backward's grad_out: on x's device, of x's dtype and of the forward output's shape.
inline void check_conv_grad_out(const at::Tensor& grad_out, const at::Tensor& x,
                                at::IntArrayRef out_shape, const char* op) {
  check_same_device(x, grad_out, op, "x", "grad_out");
  check_same_dtype(x, grad_out, op, "x", "grad_out");
  TORCH_CHECK(grad_out.sizes() == out_shape, op, "_backward: grad_out must have the output's shape ",
              out_shape, ", got ", grad_out.sizes());
}

struct ConvShape {
  int64_t N, C_in, H, W;
  int64_t C_out, kH, kW;
  int64_t H_out, W_out;
  int64_t groups;
  std::array<int64_t, 2> stride, padding, dilation;
  bool channels_last;  // layout of the output (and of the tensors the kernel computes on)
};

inline std::array<int64_t, 2> check_pair(at::IntArrayRef v, const char* op, const char* name,
                                         int64_t min_value) {
  TORCH_CHECK(v.size() == 2, op, ": ", name, " must have 2 elements (height, width), got ", v);
  TORCH_CHECK(v[0] >= min_value && v[1] >= min_value, op, ": ", name, " must be >= ", min_value,
              ", got ", v);
  return {v[0], v[1]};
}

inline int64_t conv_out_size(int64_t in, int64_t k, int64_t stride, int64_t pad, int64_t dil) {
  const int64_t span = dil * (k - 1) + 1;
  const int64_t padded = in + 2 * pad;
  return padded < span ? 0 : (padded - span) / stride + 1;
}

// conv_bn_silu and its backward: x (N, C_in, H, W), weight (C_out, C_in / groups, kH, kW),
// bias and the four BatchNorm vectors (C_out,).
inline ConvShape check_conv_bn_silu(const at::Tensor& x, const at::Tensor& weight,
                                    const std::optional<at::Tensor>& bias,
                                    const at::Tensor& bn_weight, const at::Tensor& bn_bias,
                                    const at::Tensor& bn_mean, const at::Tensor& bn_var, double eps,
                                    at::IntArrayRef stride, at::IntArrayRef padding,
                                    at::IntArrayRef dilation, int64_t groups) {
  const char* op = kConvBnSiluOp;
  check_conv_operands(x, weight, 4, op, "(N, C_in, H, W)", "(C_out, C_in / groups, kH, kW)");
  ConvShape s;
  s.stride = check_pair(stride, op, "stride", 1);
  s.padding = check_pair(padding, op, "padding", 0);
  s.dilation = check_pair(dilation, op, "dilation", 1);
  TORCH_CHECK(groups >= 1, op, ": groups must be >= 1, got ", groups);
  s.N = x.size(0);
  s.C_in = x.size(1);
  s.H = x.size(2);
  s.W = x.size(3);
  s.C_out = weight.size(0);
  s.kH = weight.size(2);
  s.kW = weight.size(3);
  s.groups = groups;
  TORCH_CHECK(s.C_in >= 1, op, ": x must have at least one channel, got shape ", x.sizes());
  TORCH_CHECK(s.C_out >= 1 && s.kH >= 1 && s.kW >= 1, op,
              ": weight must have non-zero C_out, kH and kW, got shape ", weight.sizes());
  TORCH_CHECK(s.C_in % groups == 0, op, ": groups (", groups,
              ") must divide the input channels x.size(1) = ", s.C_in);
  TORCH_CHECK(s.C_out % groups == 0, op, ": groups (", groups,
              ") must divide the output channels weight.size(0) = ", s.C_out);
  TORCH_CHECK(weight.size(1) * groups == s.C_in, op, ": weight.size(1) must be C_in / groups = ",
              s.C_in, " / ", groups, " = ", s.C_in / groups, ", got weight of shape ", weight.sizes());
  if (bias.has_value()) check_channel_param(*bias, s.C_out, x, op, "bias");
  check_channel_param(bn_weight, s.C_out, x, op, "bn_weight");
  check_channel_param(bn_bias, s.C_out, x, op, "bn_bias");
  check_channel_param(bn_mean, s.C_out, x, op, "bn_mean");
  check_channel_param(bn_var, s.C_out, x, op, "bn_var");
  TORCH_CHECK(eps >= 0, op, ": eps must be >= 0, got ", eps);
  s.H_out = conv_out_size(s.H, s.kH, s.stride[0], s.padding[0], s.dilation[0]);
  s.W_out = conv_out_size(s.W, s.kW, s.stride[1], s.padding[1], s.dilation[1]);
  TORCH_CHECK(s.H_out >= 1 && s.W_out >= 1, op, ": output would be empty: input ", s.H, "x", s.W,
              " with padding ", padding, " is smaller than the dilated kernel ",
              s.dilation[0] * (s.kH - 1) + 1, "x", s.dilation[1] * (s.kW - 1) + 1);
  s.channels_last = channels_last_layout(x);
  return s;
}

struct TemporalConvShape {
  int64_t B, C_in, F, H, W;
  int64_t C_out, k;
  int64_t F_out, padding;
  bool channels_last;  // channels_last_3d in and out
  bool frames_major;   // x (and the output) are (B, C, F, H, W) views of contiguous (B, F, C, H, W)
};

// temporal_conv and its backward: x (B, C_in, F, H, W), weight (C_out, C_in, k, 1, 1).
inline TemporalConvShape check_temporal_conv(const at::Tensor& x, const at::Tensor& weight,
                                             int64_t padding) {
  const char* op = kTemporalConvOp;
  check_conv_operands(x, weight, 5, op, "(B, C_in, F, H, W)", "(C_out, C_in, k, 1, 1)");
  TemporalConvShape s;
  s.B = x.size(0);
  s.C_in = x.size(1);
  s.F = x.size(2);
  s.H = x.size(3);
  s.W = x.size(4);
  s.C_out = weight.size(0);
  s.k = weight.size(2);
  s.padding = padding;
  TORCH_CHECK(weight.size(3) == 1 && weight.size(4) == 1 && s.k >= 1, op,
              ": weight must have a (k, 1, 1) kernel with k >= 1, got shape ", weight.sizes());
  TORCH_CHECK(s.C_in >= 1, op, ": x must have at least one channel, got shape ", x.sizes());
  TORCH_CHECK(s.C_out >= 1, op, ": weight must have at least one output channel, got shape ",
              weight.sizes());
  TORCH_CHECK(weight.size(1) == s.C_in, op, ": weight.size(1) must equal the input channels x.size(1) = ",
              s.C_in, ", got weight of shape ", weight.sizes());
  TORCH_CHECK(padding >= 0, op, ": padding must be >= 0, got ", padding);
  s.F_out = s.F + 2 * padding - s.k + 1;
  TORCH_CHECK(s.F_out >= 1, op, ": output would have no frames: F + 2 * padding - k + 1 = ", s.F,
              " + 2 * ", padding, " - ", s.k, " + 1 = ", s.F_out, " (must be >= 1)");
  s.channels_last = channels_last_layout(x);
  s.frames_major = frames_major_layout(x);
  return s;
}

// Output frames [o0, o1) that tap t reads from valid input frames (o + t - padding in [0, F)).
inline std::pair<int64_t, int64_t> temporal_tap_range(const TemporalConvShape& s, int64_t t) {
  const int64_t o0 = std::max<int64_t>(0, s.padding - t);
  const int64_t o1 = std::min<int64_t>(s.F_out, s.F + s.padding - t);
  return {o0, std::max(o0, o1)};
}

}  // namespace vd
