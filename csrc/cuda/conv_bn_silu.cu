// CUDA kernels for vd::conv_bn_silu: the folded convolution runs through ATen (cuDNN) with the shared
// code of csrc/conv_gemm.h; the bias + SiLU epilogue is one in-place pass over the output, and the
// backward's dz = g * silu'(z) another.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGraphsC10Utils.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "../activation.h"
#include "../conv_gemm.h"
#include "launch.h"

namespace vd {
namespace {

// Channel of flat element i: NCHW planes of S elements, or NHWC rows of C elements.
__device__ __forceinline__ int64_t channel_of(int64_t i, int64_t C, int64_t S, bool channels_last) {
  return channels_last ? i % C : (i / S) % C;
}

template <typename scalar_t, typename acc_t>
__global__ void bias_act_kernel(scalar_t* __restrict__ y, const acc_t* __restrict__ shift, int64_t n,
                                int64_t C, int64_t S, bool channels_last, bool silu) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    const acc_t z = static_cast<acc_t>(y[i]) + shift[channel_of(i, C, S, channels_last)];
    y[i] = static_cast<scalar_t>(silu ? silu_fast(z) : z);
  }
}

// The same pass on 16-byte vectors of V elements that share a channel run: V consecutive channels of an
// NHWC row (C % V == 0) or V positions of one NCHW plane (S % V == 0). The scalar kernel's 64-bit
// division per element made it issue-bound (~25 % of the copy rate on the UNet shapes).
template <typename scalar_t, typename acc_t, int V, bool kSilu, bool kChannelsLast>
__global__ void bias_act_vec_kernel(scalar_t* __restrict__ y, const acc_t* __restrict__ shift, int64_t nv,
                                    int64_t C, int64_t sv) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t v = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; v < nv; v += stride) {
    Vec<scalar_t, V> x = reinterpret_cast<const Vec<scalar_t, V>*>(y)[v];
    // NHWC: sv = C / V vectors a row, the vector's first channel; NCHW: sv = S / V vectors a plane.
    const int64_t c0 = kChannelsLast ? (v % sv) * V : (v / sv) % C;
#pragma unroll
    for (int j = 0; j < V; ++j) {
      const acc_t z = static_cast<acc_t>(x.v[j]) + shift[kChannelsLast ? c0 + j : c0];
      x.v[j] = static_cast<scalar_t>(kSilu ? silu_fast(z) : z);
    }
    reinterpret_cast<Vec<scalar_t, V>*>(y)[v] = x;
  }
}

// y (the folded conv without bias) <- dz = g * silu'(y + shift).
template <typename scalar_t, typename acc_t>
__global__ void grad_z_kernel(scalar_t* __restrict__ y, const scalar_t* __restrict__ g,
                              const acc_t* __restrict__ shift, int64_t n, int64_t C, int64_t S,
                              bool channels_last) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    const acc_t z = static_cast<acc_t>(y[i]) + shift[channel_of(i, C, S, channels_last)];
    y[i] = static_cast<scalar_t>(static_cast<acc_t>(g[i]) * silu_grad(z));
  }
}

unsigned grid_for(int64_t n, int threads) {
  return static_cast<unsigned>(std::max<int64_t>(1, std::min<int64_t>((n + threads - 1) / threads, 65535)));
}

void bias_act_cuda_(at::Tensor& y, const at::Tensor& shift, bool silu, const ConvShape& s) {
  const int64_t n = y.numel();
  if (n == 0) return;
  auto stream = c10::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, y.scalar_type(), "conv_bn_silu_cuda", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    at::Tensor sh = shift.to(c10::CppTypeToScalarType<acc_t>::value).contiguous();
    constexpr int V = 16 / sizeof(scalar_t);
    const int64_t S = s.H_out * s.W_out;
    if (aligned16(y.const_data_ptr()) && (s.channels_last ? s.C_out % V == 0 : S % V == 0)) {
      const int64_t nv = n / V, sv = s.channels_last ? s.C_out / V : S / V;
      auto launch = [&](auto kernel) {
        kernel<<<grid_for(nv, 256), 256, 0, stream>>>(y.mutable_data_ptr<scalar_t>(), sh.const_data_ptr<acc_t>(),
                                                      nv, s.C_out, sv);
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      };
      if (s.channels_last) {
        if (silu) launch(bias_act_vec_kernel<scalar_t, acc_t, V, true, true>);
        else launch(bias_act_vec_kernel<scalar_t, acc_t, V, false, true>);
      } else {
        if (silu) launch(bias_act_vec_kernel<scalar_t, acc_t, V, true, false>);
        else launch(bias_act_vec_kernel<scalar_t, acc_t, V, false, false>);
      }
      return;
    }
    bias_act_kernel<scalar_t, acc_t><<<grid_for(n, 256), 256, 0, stream>>>(
        y.mutable_data_ptr<scalar_t>(), sh.const_data_ptr<acc_t>(), n, s.C_out, s.H_out * s.W_out,
        s.channels_last, silu);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

// Returns sum(dz) per output channel in float (double for float64); dz is written into y when silu.
at::Tensor grad_z_cuda_(at::Tensor& y, const at::Tensor& g, const at::Tensor& shift, bool silu,
                        const ConvShape& s) {
  const auto acc = acc_dtype(g);
  if (!silu) return g.sum({0, 2, 3}, /*keepdim=*/false, acc);
  const int64_t n = y.numel();
  auto stream = c10::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, y.scalar_type(), "conv_bn_silu_backward_cuda", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    at::Tensor sh = shift.to(c10::CppTypeToScalarType<acc_t>::value).contiguous();
    grad_z_kernel<scalar_t, acc_t><<<grid_for(n, 256), 256, 0, stream>>>(
        y.mutable_data_ptr<scalar_t>(), g.const_data_ptr<scalar_t>(), sh.const_data_ptr<acc_t>(), n,
        s.C_out, s.H_out * s.W_out, s.channels_last);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return y.sum({0, 2, 3}, /*keepdim=*/false, acc);
}

at::Tensor conv_bn_silu_cuda(const at::Tensor& x, const at::Tensor& weight,
                             const std::optional<at::Tensor>& bias, const at::Tensor& bn_weight,
                             const at::Tensor& bn_bias, const at::Tensor& bn_mean,
                             const at::Tensor& bn_var, double eps, at::IntArrayRef stride,
                             at::IntArrayRef padding, at::IntArrayRef dilation, int64_t groups,
                             bool silu) {
  c10::cuda::CUDAGuard guard(x.device());
  const auto stream = c10::cuda::getCurrentCUDAStream();
  const FoldCachePolicy policy{c10::cuda::currentStreamCaptureStatusMayInitCtx() ==
                                   c10::cuda::CaptureStatus::None,
                               static_cast<int64_t>(stream.id())};
  return conv_bn_silu_forward(x, weight, bias, bn_weight, bn_bias, bn_mean, bn_var, eps, stride,
                              padding, dilation, groups, silu, bias_act_cuda_, policy);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> conv_bn_silu_backward_cuda(
    const at::Tensor& grad_out, const at::Tensor& x, const at::Tensor& weight,
    const std::optional<at::Tensor>& bias, const at::Tensor& bn_weight, const at::Tensor& bn_bias,
    const at::Tensor& bn_mean, const at::Tensor& bn_var, double eps, at::IntArrayRef stride,
    at::IntArrayRef padding, at::IntArrayRef dilation, int64_t groups, bool silu) {
  c10::cuda::CUDAGuard guard(x.device());
  return conv_bn_silu_backward(grad_out, x, weight, bias, bn_weight, bn_bias, bn_mean, bn_var, eps,
                               stride, padding, dilation, groups, silu, grad_z_cuda_);
}

}  // namespace

TORCH_LIBRARY_IMPL(vd, CUDA, m) {
  m.impl("conv_bn_silu", &conv_bn_silu_cuda);
  m.impl("conv_bn_silu_backward", &conv_bn_silu_backward_cuda);
}

}  // namespace vd
