// CUDA kernels for vd::temporal_conv: the per-tap GEMMs of csrc/conv_gemm.h on cuBLAS, reading
// (B, C, F, H, W) through views (no permute copies).
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "../conv_gemm.h"

namespace vd {
namespace {

at::Tensor temporal_conv_cuda(const at::Tensor& x, const at::Tensor& weight,
                              const std::optional<at::Tensor>& bias, int64_t padding) {
  c10::cuda::CUDAGuard guard(x.device());
  return temporal_conv_forward(x, weight, bias, padding);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> temporal_conv_backward_cuda(const at::Tensor& grad_out,
                                                                           const at::Tensor& x,
                                                                           const at::Tensor& weight,
                                                                           int64_t padding) {
  c10::cuda::CUDAGuard guard(x.device());
  return temporal_conv_backward(grad_out, x, weight, padding);
}

}  // namespace

TORCH_LIBRARY_IMPL(vd, CUDA, m) {
  m.impl("temporal_conv", &temporal_conv_cuda);
  m.impl("temporal_conv_backward", &temporal_conv_backward_cuda);
}

}  // namespace vd
