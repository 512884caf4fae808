// CPU kernels for vd::temporal_conv: the per-tap GEMMs of csrc/conv_gemm.h on CPU BLAS.
#include <ATen/ATen.h>
#include <torch/library.h>

#include "../conv_gemm.h"

namespace vd {

#ifdef VD_WITH_CUDA
at::Tensor tap_rows_cuda(const at::Tensor& weight);  // csrc/cuda/temporal_conv.cu
#endif

at::Tensor tap_rows(const at::Tensor& weight) {
#ifdef VD_WITH_CUDA
  if (weight.is_cuda()) return tap_rows_cuda(weight);
#endif
  return tap_rows_aten(weight);
}

TORCH_LIBRARY_IMPL(vd, CPU, m) {
  m.impl("temporal_conv", &temporal_conv_forward);
  m.impl("temporal_conv_backward", &temporal_conv_backward);
}

}  // namespace vd
