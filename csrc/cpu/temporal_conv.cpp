// CPU kernels for vd::temporal_conv: the per-tap GEMMs of csrc/conv_gemm.h on CPU BLAS.
#include <ATen/ATen.h>
#include <torch/library.h>

#include "../conv_gemm.h"

namespace vd {

TORCH_LIBRARY_IMPL(vd, CPU, m) {
  m.impl("temporal_conv", &temporal_conv_forward);
  m.impl("temporal_conv_backward", &temporal_conv_backward);
}

}  // namespace vd
