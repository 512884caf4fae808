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

#if defined(__CUDACC__)
// SiLU on the GPU's special-function unit (ex2 and rcp approximations, a few float ulp): the forward
// passes of the CUDA kernels, where precise expf and division cost several times the rest of the
// arithmetic. The backward keeps silu_grad. For z < -87, 1 + e^-z passes 2^126 and the result is -0
// (the exact value is below 1e-36).
__device__ __forceinline__ float silu_fast(float z) {
  float e;  // 2^(-z log2 e), flushing subnormal results (z > 87: silu is z) instead of rescaling them
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(e) : "f"(z * -1.4426950408889634f));
  return __fdividef(z, 1.f + e);
}
__device__ __forceinline__ double silu_fast(double z) { return silu_fn(z); }
#endif

// d silu / dz
template <typename T>
C10_HOST_DEVICE inline T silu_grad(T z) {
  const T sg = T(1) / (T(1) + act_exp(-z));
  return sg * (T(1) + z * (T(1) - sg));
}

}  // namespace vd
