// SiLU and its derivative, shared by the CPU and CUDA kernels (host and device).
#pragma once
#include <c10/macros/Macros.h>

#include <cmath>

namespace vd {

// exp in the compute type: float stays float (expf) on the GPU as on the CPU.
C10_HOST_DEVICE inline float act_exp(float x) { return ::expf(x); }
C10_HOST_DEVICE inline double act_exp(double x) { return ::exp(x); }

template <typename T>
C10_HOST_DEVICE inline T silu_fn(T z) {
  return z / (T(1) + act_exp(-z));
}

// d silu / dz
template <typename T>
C10_HOST_DEVICE inline T silu_grad(T z) {
  const T sg = T(1) / (T(1) + act_exp(-z));
  return sg * (T(1) + z * (T(1) - sg));
}

}  // namespace vd
