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

#include "../conv_gemm.h"
#include "../activation.h"

namespace vd {
namespace {

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

// The per-channel shift b' as a host vector of the compute type.
template <typename opmath_t>
std::vector<opmath_t> shift_values(const at::Tensor& shift, int64_t C) {
  const at::Tensor t = shift.to(c10::CppTypeToScalarType<opmath_t>::value).contiguous();
  const opmath_t* p = t.const_data_ptr<opmath_t>();
  return std::vector<opmath_t>(p, p + C);
}

// y <- act(y + shift[c]) in place. This file's fold (fold_bn) scales the weight, so there is no output scale.
void bias_act_(at::Tensor& y, const at::Tensor& scale, const at::Tensor& shift, bool silu, const ConvShape& s) {
  TORCH_INTERNAL_ASSERT(!scale.defined(), "conv_bn_silu (CPU): the weight carries s");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, y.scalar_type(), "conv_bn_silu_cpu", [&] {
    using opmath_t = at::opmath_type<scalar_t>;
    const std::vector<opmath_t> sh = shift_values<opmath_t>(shift, s.C_out);
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
    const std::vector<opmath_t> sh = shift_values<opmath_t>(shift, s.C_out);
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

at::Tensor conv_bn_silu_cpu(const at::Tensor& x, const at::Tensor& weight,
                            const std::optional<at::Tensor>& bias, const at::Tensor& bn_weight,
                            const at::Tensor& bn_bias, const at::Tensor& bn_mean,
                            const at::Tensor& bn_var, double eps, at::IntArrayRef stride,
                            at::IntArrayRef padding, at::IntArrayRef dilation, int64_t groups,
                            bool silu) {
  return conv_bn_silu_forward(x, weight, bias, bn_weight, bn_bias, bn_mean, bn_var, eps, stride,
                              padding, dilation, groups, silu, bias_act_,
                              [](const at::Tensor&, const Folded&, const ConvShape&, bool) { return at::Tensor(); },
                              FoldCachePolicy{true, 0});
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> conv_bn_silu_backward_cpu(
    const at::Tensor& grad_out, const at::Tensor& x, const at::Tensor& weight,
    const std::optional<at::Tensor>& bias, const at::Tensor& bn_weight, const at::Tensor& bn_bias,
    const at::Tensor& bn_mean, const at::Tensor& bn_var, double eps, at::IntArrayRef stride,
    at::IntArrayRef padding, at::IntArrayRef dilation, int64_t groups, bool silu) {
  return conv_bn_silu_backward(grad_out, x, weight, bias, bn_weight, bn_bias, bn_mean, bn_var, eps,
                               stride, padding, dilation, groups, silu, grad_z_);
}

}  // namespace

TORCH_LIBRARY_IMPL(vd, CPU, m) {
  m.impl("conv_bn_silu", &conv_bn_silu_cpu);
  m.impl("conv_bn_silu_backward", &conv_bn_silu_backward_cpu);
}

}  // namespace vd
