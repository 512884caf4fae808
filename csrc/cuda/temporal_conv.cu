// CUDA kernels for vd::temporal_conv: the per-tap GEMMs of csrc/conv_gemm.h on cuBLAS, reading
// (B, C, F, H, W) through views (no permute copies), and the weight's reorder to tap-major rows.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <limits>

#include "../conv_gemm.h"
#include "launch.h"

namespace vd {
namespace {

// out[o, t, c] = w[o, c, t]: one CTA per output channel o. Thread c reads its k consecutive elements
// w[o, c, 0..k) (a warp's reads cover one contiguous span; L1 serves the k passes) and writes them
// to the k rows, coalesced across c. No division per element: the first version's j / C made it
// issue-bound (8 us a call on SVD's 1280-channel weights). T carries the element's bits.
template <typename T>
__global__ void tap_rows_kernel(const T* __restrict__ w, T* __restrict__ out, int C, int k) {
  const int64_t base = static_cast<int64_t>(blockIdx.x) * C * k;
  const T* src = w + base;
  T* dst = out + base;
  for (int c = threadIdx.x; c < C; c += blockDim.x) {
    for (int t = 0; t < k; ++t) dst[static_cast<int64_t>(t) * C + c] = src[static_cast<int64_t>(c) * k + t];
  }
}

template <typename T>
void launch_tap_rows(const at::Tensor& w, at::Tensor& out, int64_t C_out, int C, int k) {
  tap_rows_kernel<T><<<grid_of(C_out, "temporal_conv"), 128, 0, c10::cuda::getCurrentCUDAStream()>>>(
      static_cast<const T*>(w.const_data_ptr()), static_cast<T*>(out.mutable_data_ptr()), C, k);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace

at::Tensor tap_rows_cuda(const at::Tensor& weight) {
  const int64_t C_out = weight.size(0), C = weight.size(1), k = weight.size(2);
  // A row per CTA indexes in int; the element is copied as 2, 4 or 8 bytes.
  const int64_t esize = weight.element_size();
  if (C * k > std::numeric_limits<int>::max() || (esize != 2 && esize != 4 && esize != 8))
    return tap_rows_aten(weight);
  c10::cuda::CUDAGuard guard(weight.device());
  const at::Tensor w = weight.contiguous();
  at::Tensor out = at::empty({C_out, k, C}, w.options());
  if (out.numel() == 0) return out;
  const int Ci = static_cast<int>(C), ki = static_cast<int>(k);
  if (esize == 2) launch_tap_rows<uint16_t>(w, out, C_out, Ci, ki);
  else if (esize == 4) launch_tap_rows<uint32_t>(w, out, C_out, Ci, ki);
  else launch_tap_rows<uint64_t>(w, out, C_out, Ci, ki);
  return out;
}

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
