// CPU kernels for vd::conv_bn_silu. BatchNorm (eval) is folded into the convolution:
//   s = bn_weight / sqrt(bn_var + eps),  w' = w * s,  b' = (b - bn_mean) * s + bn_bias,
// ATen runs the GEMM-heavy convolution with w', then one fused in-place pass adds b' and applies
// SiLU. NCHW and NHWC (channels_last) outputs are walked in place.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <ATen/TensorIterator.h>
#include <torch/library.h>

#include <cmath>
#include <vector>

#include "../conv.h"

namespace vd {
namespace {

constexpr const char* kOp = kConvBnSiluOp;

template <typename T>
inline T silu_fn(T z) {
  return z / (T(1) + std::exp(-z));
}
// d silu / dz
template <typename T>
inline T silu_grad(T z) {
  T sg = T(1) / (T(1) + std::exp(-z));
  return sg * (T(1) + z * (T(1) - sg));
}

at::MemoryFormat conv_format(const ConvShape& s) {
  return s.channels_last ? at::MemoryFormat::ChannelsLast : at::MemoryFormat::Contiguous;
}

// Per-channel math runs in float (double for float64 inputs).
at::ScalarType acc_dtype(const at::Tensor& x) {
  return x.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
}

struct Folded {
  at::Tensor inv_std;  // 1 / sqrt(bn_var + eps), acc dtype
  at::Tensor scale;    // s = bn_weight * inv_std, acc dtype
  at::Tensor shift;    // b' = (b - bn_mean) * s + bn_bias, acc dtype
  at::Tensor weight;   // w' = w * s, x's dtype and layout
};

Folded fold_bn(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
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

at::Tensor folded_conv(const at::Tensor& x, const Folded& f, const ConvShape& s) {
  const std::array<int64_t, 2> no_output_padding{0, 0};
  at::Tensor y = at::convolution(x, f.weight, std::nullopt, s.stride, s.padding, s.dilation,
                                 /*transposed=*/false, no_output_padding, s.groups);
  // ATen follows x's layout already; the op's output layout is part of its contract regardless.
  const auto fmt = conv_format(s);
  return y.is_contiguous(fmt) ? y : y.contiguous(fmt);
}

// Calls fn(chunk, offset, count, channel) for every run of elements of one channel: whole (n, c)
// planes for NCHW, single elements of each pixel's row for NHWC. The work is cut into n_chunks
// fixed chunks, each run by one thread, so callers can keep per-chunk partial sums without atomics
// (and sums do not depend on scheduling, only on the thread count).
template <typename Fn>
void for_each_channel_run(const ConvShape& s, int64_t n_chunks, const Fn& fn) {
  const int64_t C = s.C_out, S = s.H_out * s.W_out;
  const int64_t units = s.channels_last ? s.N * S : s.N * C;
  at::parallel_for(0, n_chunks, 1, [&](int64_t cb, int64_t ce) {
    for (int64_t chunk = cb; chunk < ce; ++chunk) {
      const int64_t ub = units * chunk / n_chunks, ue = units * (chunk + 1) / n_chunks;
      for (int64_t u = ub; u < ue; ++u) {
        if (s.channels_last) {
          for (int64_t c = 0; c < C; ++c) fn(chunk, u * C + c, int64_t(1), c);
        } else {
          fn(chunk, u * S, S, u % C);
        }
      }
    }
  });
}

// Enough chunks to balance the threads, but none smaller than ATen's elementwise grain: a parallel
// region costs more than a small output's whole pass.
int64_t channel_chunks(const ConvShape& s) {
  const int64_t units = s.channels_last ? s.N * s.H_out * s.W_out : s.N * s.C_out;
  const int64_t numel = s.N * s.C_out * s.H_out * s.W_out;
  const int64_t by_size = numel / at::internal::GRAIN_SIZE;
  return std::max<int64_t>(1, std::min({units, by_size, 4 * int64_t(at::get_num_threads())}));
}

// y <- act(y + shift[c]) in place.
void bias_act_(at::Tensor& y, const at::Tensor& shift, bool silu, const ConvShape& s) {
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, y.scalar_type(), "conv_bn_silu_cpu", [&] {
    using opmath_t = at::opmath_type<scalar_t>;
    std::vector<opmath_t> sh(s.C_out);
    at::Tensor shift_op = shift.to(c10::CppTypeToScalarType<opmath_t>::value);
    for (int64_t c = 0; c < s.C_out; ++c) sh[c] = shift_op.const_data_ptr<opmath_t>()[c];
    scalar_t* yp = y.mutable_data_ptr<scalar_t>();
    for_each_channel_run(s, channel_chunks(s), [&](int64_t, int64_t off, int64_t n, int64_t c) {
      const opmath_t b = sh[c];
      scalar_t* p = yp + off;
      for (int64_t i = 0; i < n; ++i) {
        const opmath_t z = static_cast<opmath_t>(p[i]) + b;
        p[i] = static_cast<scalar_t>(silu ? silu_fn(z) : z);
      }
    });
  });
}

// With silu, y (the folded conv without bias) becomes dz = g * silu'(y + shift) in place.
// Either way returns sum(dz) per output channel, in double.
at::Tensor grad_z_(at::Tensor& y, const at::Tensor& g, const at::Tensor& shift, bool silu,
                   const ConvShape& s) {
  const int64_t n_chunks = channel_chunks(s);
  std::vector<double> partial(n_chunks * s.C_out, 0.0);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, g.scalar_type(), "conv_bn_silu_backward_cpu", [&] {
    using opmath_t = at::opmath_type<scalar_t>;
    std::vector<opmath_t> sh(s.C_out);
    at::Tensor shift_op = shift.to(c10::CppTypeToScalarType<opmath_t>::value);
    for (int64_t c = 0; c < s.C_out; ++c) sh[c] = shift_op.const_data_ptr<opmath_t>()[c];
    const scalar_t* gp = g.const_data_ptr<scalar_t>();
    scalar_t* yp = silu ? y.mutable_data_ptr<scalar_t>() : nullptr;
    for_each_channel_run(s, n_chunks, [&](int64_t chunk, int64_t off, int64_t n, int64_t c) {
      double acc = 0;
      if (silu) {
        const opmath_t b = sh[c];
        for (int64_t i = off; i < off + n; ++i) {
          const opmath_t dz = static_cast<opmath_t>(gp[i]) * silu_grad(static_cast<opmath_t>(yp[i]) + b);
          yp[i] = static_cast<scalar_t>(dz);
          acc += static_cast<double>(dz);
        }
      } else {
        for (int64_t i = off; i < off + n; ++i) acc += static_cast<double>(gp[i]);
      }
      partial[chunk * s.C_out + c] += acc;
    });
  });
  at::Tensor sums = at::zeros({s.C_out}, at::TensorOptions().dtype(at::kDouble));
  double* sp = sums.mutable_data_ptr<double>();
  for (int64_t chunk = 0; chunk < n_chunks; ++chunk)
    for (int64_t c = 0; c < s.C_out; ++c) sp[c] += partial[chunk * s.C_out + c];
  return sums;
}

at::Tensor conv_bn_silu_cpu(const at::Tensor& x_in, const at::Tensor& weight,
                            const std::optional<at::Tensor>& bias, const at::Tensor& bn_weight,
                            const at::Tensor& bn_bias, const at::Tensor& bn_mean,
                            const at::Tensor& bn_var, double eps, at::IntArrayRef stride,
                            at::IntArrayRef padding, at::IntArrayRef dilation, int64_t groups,
                            bool silu) {
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

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> conv_bn_silu_backward_cpu(
    const at::Tensor& grad_out, const at::Tensor& x_in, const at::Tensor& weight,
    const std::optional<at::Tensor>& bias, const at::Tensor& bn_weight, const at::Tensor& bn_bias,
    const at::Tensor& bn_mean, const at::Tensor& bn_var, double eps, at::IntArrayRef stride,
    at::IntArrayRef padding, at::IntArrayRef dilation, int64_t groups, bool silu) {
  ConvShape s = check_conv_bn_silu(x_in, weight, bias, bn_weight, bn_bias, bn_mean, bn_var, eps,
                                   stride, padding, dilation, groups);
  check_same_device(x_in, grad_out, kOp, "x", "grad_out");
  check_same_dtype(x_in, grad_out, kOp, "x", "grad_out");
  const std::vector<int64_t> out_shape{s.N, s.C_out, s.H_out, s.W_out};
  TORCH_CHECK(grad_out.sizes() == at::IntArrayRef(out_shape), kOp,
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

}  // namespace

TORCH_LIBRARY_IMPL(vd, CPU, m) {
  m.impl("conv_bn_silu", &conv_bn_silu_cpu);
  m.impl("conv_bn_silu_backward", &conv_bn_silu_backward_cpu);
}

}  // namespace vd
