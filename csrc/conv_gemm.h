// The device-generic half of the conv ops: everything here is ATen calls on whole tensors (BatchNorm
// folding, the convolution GEMMs through ATen/cuDNN/cuBLAS, the per-tap GEMMs of the temporal conv), so
// the CPU and CUDA kernels share it and differ only in their fused elementwise passes.
#pragma once
#include <ATen/ATen.h>

#include <array>
#include <vector>

#include "conv.h"

namespace vd {

inline at::MemoryFormat conv_format(const ConvShape& s) {
  return s.channels_last ? at::MemoryFormat::ChannelsLast : at::MemoryFormat::Contiguous;
}

// Per-channel math runs in float (double for float64 inputs).
inline at::ScalarType acc_dtype(const at::Tensor& x) {
  return x.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
}

struct Folded {
  at::Tensor inv_std;  // 1 / sqrt(bn_var + eps), acc dtype
  at::Tensor scale;    // s = bn_weight * inv_std, acc dtype
  at::Tensor shift;    // b' = (b - bn_mean) * s + bn_bias, acc dtype
  at::Tensor weight;   // w' = w * s, x's dtype and layout
};

inline Folded fold_bn(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
               const at::Tensor& bn_weight, const at::Tensor& bn_bias, const at::Tensor& bn_mean,
               const at::Tensor& bn_var, double eps, at::MemoryFormat fmt) {
  const auto acc = acc_dtype(x);
  Folded f;
  f.inv_std = (bn_var.to(acc) + eps).rsqrt();
  f.scale = bn_weight.to(acc) * f.inv_std;
  at::Tensor b_minus_mean = bias.has_value() ? bias->to(acc) - bn_mean.to(acc) : -bn_mean.to(acc);
  f.shift = (b_minus_mean * f.scale + bn_bias.to(acc)).contiguous();
  f.weight = (weight.to(acc) * f.scale.view({-1, 1, 1, 1})).to(x.scalar_type()).contiguous(fmt);
  return f;
}

inline at::Tensor folded_conv(const at::Tensor& x, const Folded& f, const ConvShape& s) {
  const std::array<int64_t, 2> no_output_padding{0, 0};
  at::Tensor y = at::convolution(x, f.weight, std::nullopt, s.stride, s.padding, s.dilation,
                                 /*transposed=*/false, no_output_padding, s.groups);
  // ATen follows x's layout already; the op's output layout is part of its contract regardless.
  const auto fmt = conv_format(s);
  return y.is_contiguous(fmt) ? y : y.contiguous(fmt);
}

// ---- conv_bn_silu: the device passes bias_act_(y, shift, silu, s) and grad_z_(y, g, shift, silu, s) ----

template <typename BiasAct>
inline at::Tensor conv_bn_silu_forward(const at::Tensor& x_in, const at::Tensor& weight,
                            const std::optional<at::Tensor>& bias, const at::Tensor& bn_weight,
                            const at::Tensor& bn_bias, const at::Tensor& bn_mean,
                            const at::Tensor& bn_var, double eps, at::IntArrayRef stride,
                            at::IntArrayRef padding, at::IntArrayRef dilation, int64_t groups,
                            bool silu, const BiasAct& bias_act_) {
  ConvShape s = check_conv_bn_silu(x_in, weight, bias, bn_weight, bn_bias, bn_mean, bn_var, eps,
                                   stride, padding, dilation, groups);
  const auto fmt = conv_format(s);
  if (s.N == 0)
    return at::empty({0, s.C_out, s.H_out, s.W_out}, x_in.options().memory_format(fmt));
  at::Tensor x = x_in.contiguous(fmt);
  Folded f = fold_bn(x, weight, bias, bn_weight, bn_bias, bn_mean, bn_var, eps, fmt);
  at::Tensor y = folded_conv(x, f, s);
  bias_act_(y, f.shift, silu, s);
  return y;
}

template <typename GradZ>
inline std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> conv_bn_silu_backward(
    const at::Tensor& grad_out, const at::Tensor& x_in, const at::Tensor& weight,
    const std::optional<at::Tensor>& bias, const at::Tensor& bn_weight, const at::Tensor& bn_bias,
    const at::Tensor& bn_mean, const at::Tensor& bn_var, double eps, at::IntArrayRef stride,
    at::IntArrayRef padding, at::IntArrayRef dilation, int64_t groups, bool silu, const GradZ& grad_z_) {
  ConvShape s = check_conv_bn_silu(x_in, weight, bias, bn_weight, bn_bias, bn_mean, bn_var, eps,
                                   stride, padding, dilation, groups);
  check_same_device(x_in, grad_out, kConvBnSiluOp, "x", "grad_out");
  check_same_dtype(x_in, grad_out, kConvBnSiluOp, "x", "grad_out");
  const std::vector<int64_t> out_shape{s.N, s.C_out, s.H_out, s.W_out};
  TORCH_CHECK(grad_out.sizes() == at::IntArrayRef(out_shape), kConvBnSiluOp,
              "_backward: grad_out must have the output's shape ", at::IntArrayRef(out_shape),
              ", got ", grad_out.sizes());
  const auto fmt = conv_format(s);
  const auto acc = acc_dtype(x_in);
  at::Tensor x = x_in.contiguous(fmt);
  at::Tensor g = grad_out.contiguous(fmt);
  Folded f = fold_bn(x, weight, bias, bn_weight, bn_bias, bn_mean, bn_var, eps, fmt);

  at::Tensor dx, dw_raw, sum_dz;
  if (s.N == 0) {
    dx = at::empty_like(x);
    dw_raw = at::zeros(weight.sizes(), weight.options().dtype(acc));
    sum_dz = at::zeros({s.C_out}, weight.options().dtype(acc));
  } else {
    // silu=False: z is never needed, dz is grad_out itself.
    at::Tensor dz = silu ? folded_conv(x, f, s) : g;
    sum_dz = grad_z_(dz, g, f.shift, silu, s).to(acc);
    const std::array<int64_t, 2> no_output_padding{0, 0};
    auto grads = at::convolution_backward(dz, x, f.weight, std::nullopt, s.stride, s.padding,
                                          s.dilation, /*transposed=*/false, no_output_padding,
                                          s.groups, {true, true, false});
    dx = std::get<0>(grads).contiguous(fmt);
    dw_raw = std::get<1>(grads).to(acc);
  }
  // dW_raw is the gradient of the folded weight w' = w * s.
  at::Tensor dweight = (dw_raw * f.scale.view({-1, 1, 1, 1})).to(weight.scalar_type()).contiguous();
  at::Tensor dbias = (sum_dz * f.scale).to(bias.has_value() ? bias->scalar_type() : x.scalar_type());
  at::Tensor dbn_bias = sum_dz.to(bn_bias.scalar_type());
  // dz/dbn_weight = inv_std * (conv(x, w) + b - mean); summing dz * conv(x, w) over the output
  // equals sum(w * dW_raw) over each filter.
  at::Tensor b_minus_mean = bias.has_value() ? bias->to(acc) - bn_mean.to(acc) : -bn_mean.to(acc);
  at::Tensor dbn_weight =
      (f.inv_std * ((weight.to(acc) * dw_raw).sum({1, 2, 3}) + b_minus_mean * sum_dz))
          .to(bn_weight.scalar_type());
  return {dx, dweight, dbias, dbn_weight, dbn_bias};
}

// ---- temporal_conv: a (k, 1, 1) Conv3d over the frame axis, as k GEMMs ----
// Output frame o reads input frame o + t - padding through tap t, so for each tap the valid output
// frames [o0, o1) and input frames [o0 + t - padding, ...) are contiguous ranges. Frames, rows and
// columns of x merge into one axis without copying, both for NCDHW (stride 1) and channels_last_3d
// (stride C): per sample, out[:, o0:o1] += W[:, :, t] @ x[:, f0:f1] is one GEMM on views.

inline at::MemoryFormat temporal_format(const TemporalConvShape& s) {
  return s.channels_last ? at::MemoryFormat::ChannelsLast3d : at::MemoryFormat::Contiguous;
}

// Frames [f0, f0 + n) of a (B, C, F, H, W) tensor as (B, C, n * H * W); view() (not reshape) so a
// layout that would need a copy fails loudly instead of silently writing into a temporary.
inline at::Tensor frames(const at::Tensor& t, int64_t f0, int64_t n) {
  return t.narrow(2, f0, n).view({t.size(0), t.size(1), n * t.size(3) * t.size(4)});
}

// (C_out, C_in, k, 1, 1) -> (k, C_out, C_in): one contiguous matrix per tap.
inline at::Tensor taps(const at::Tensor& weight) {
  return weight.select(4, 0).select(3, 0).permute({2, 0, 1}).contiguous();
}

inline at::Tensor temporal_conv_forward(const at::Tensor& x_in, const at::Tensor& weight,
                             const std::optional<at::Tensor>& bias, int64_t padding) {
  TemporalConvShape s = check_temporal_conv(x_in, weight, padding);
  if (bias.has_value()) check_vector(bias, s.C_out, x_in, kTemporalConvOp, "bias");
  const auto fmt = temporal_format(s);
  at::Tensor x = x_in.contiguous(fmt);
  at::Tensor out = at::empty({s.B, s.C_out, s.F_out, s.H, s.W}, x.options().memory_format(fmt));
  if (out.numel() == 0) return out;
  if (bias.has_value())
    out.copy_(bias->to(x.scalar_type()).view({1, s.C_out, 1, 1, 1}));
  else
    out.zero_();
  at::Tensor w = taps(weight);
  for (int64_t t = 0; t < s.k; ++t) {
    auto [o0, o1] = temporal_tap_range(s, t);
    if (o1 == o0) continue;
    at::Tensor xs = frames(x, o0 + t - s.padding, o1 - o0);
    at::Tensor os = frames(out, o0, o1 - o0);
    for (int64_t b = 0; b < s.B; ++b) os.select(0, b).addmm_(w.select(0, t), xs.select(0, b));
  }
  return out;
}

inline std::tuple<at::Tensor, at::Tensor, at::Tensor> temporal_conv_backward(const at::Tensor& grad_out,
                                                                          const at::Tensor& x_in,
                                                                          const at::Tensor& weight,
                                                                          int64_t padding) {
  TemporalConvShape s = check_temporal_conv(x_in, weight, padding);
  check_same_device(x_in, grad_out, kTemporalConvOp, "x", "grad_out");
  check_same_dtype(x_in, grad_out, kTemporalConvOp, "x", "grad_out");
  const std::vector<int64_t> out_shape{s.B, s.C_out, s.F_out, s.H, s.W};
  TORCH_CHECK(grad_out.sizes() == at::IntArrayRef(out_shape), kTemporalConvOp,
              "_backward: grad_out must have the output's shape ", at::IntArrayRef(out_shape),
              ", got ", grad_out.sizes());
  const auto fmt = temporal_format(s);
  // Weight and bias gradients accumulate over samples in float (double for float64).
  const auto acc = x_in.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  at::Tensor x = x_in.contiguous(fmt);
  at::Tensor g = grad_out.contiguous(fmt);
  // at::zeros has no memory_format argument (it would drop the one in the options).
  at::Tensor dx = at::empty(x.sizes(), x.options().memory_format(fmt)).zero_();
  at::Tensor dw = at::zeros({s.k, s.C_out, s.C_in}, x.options().dtype(acc));
  at::Tensor dbias = at::zeros({s.C_out}, x.options().dtype(acc));
  if (x.numel() > 0) {
    at::Tensor w = taps(weight);
    const bool acc_in_place = x.scalar_type() == acc;
    for (int64_t t = 0; t < s.k; ++t) {
      auto [o0, o1] = temporal_tap_range(s, t);
      if (o1 == o0) continue;
      at::Tensor xs = frames(x, o0 + t - s.padding, o1 - o0);
      at::Tensor dxs = frames(dx, o0 + t - s.padding, o1 - o0);
      at::Tensor gs = frames(g, o0, o1 - o0);
      at::Tensor wt = w.select(0, t).t();
      at::Tensor dwt = dw.select(0, t);
      for (int64_t b = 0; b < s.B; ++b) {
        at::Tensor gb = gs.select(0, b), xbt = xs.select(0, b).t();
        dxs.select(0, b).addmm_(wt, gb);  // (C_in, C_out) @ (C_out, n*H*W)
        if (acc_in_place)
          dwt.addmm_(gb, xbt);  // (C_out, n*H*W) @ (n*H*W, C_in)
        else
          dwt.add_(at::mm(gb, xbt));
      }
    }
    dbias = g.sum({0, 2, 3, 4}, /*keepdim=*/false, acc);
  }
  at::Tensor dweight = dw.permute({1, 2, 0}).reshape({s.C_out, s.C_in, s.k, 1, 1})
                           .to(weight.scalar_type()).contiguous();
  return {dx, dweight, dbias.to(x.scalar_type())};
}

}  // namespace vd
