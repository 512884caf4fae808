// Host-side pieces shared by the Hopper (sm_90a: wgmma + TMA) kernels of attention.cu and
// temporal_conv.cu: which device runs them, and the driver's tensor-map encoder.
#pragma once
#include <c10/cuda/CUDAException.h>
#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime.h>

namespace vd {

// The current device's compute capability as 10 * major + minor.
inline int compute_capability() {
  int dev = 0, major = 0, minor = 0;
  C10_CUDA_CHECK(cudaGetDevice(&dev));
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev));
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev));
  return 10 * major + minor;
}

// True on a compute capability 9.0 device when this build carries sm_90a code (VD_SM90A, set by
// setup.py whenever it targets Hopper): the arch-specific binary runs on 9.0 only.
inline bool device_is_sm90a() {
#if defined(VD_SM90A)
  return compute_capability() == 90;
#else
  return false;
#endif
}

inline int sm_count() {
  int dev = 0, sms = 0;
  C10_CUDA_CHECK(cudaGetDevice(&dev));
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  return sms;
}

#if defined(VD_SM90A)
// cuTensorMapEncodeTiled from the driver, found through the runtime (no link against libcuda).
inline PFN_cuTensorMapEncodeTiled_v12000 tensor_map_encoder() {
  static PFN_cuTensorMapEncodeTiled_v12000 fn = [] {
    void* p = nullptr;
    cudaDriverEntryPointQueryResult q{};
    C10_CUDA_CHECK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &p, 12000, cudaEnableDefault, &q));
    return q == cudaDriverEntryPointSuccess ? reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(p) : nullptr;
  }();
  return fn;
}
#endif

}  // namespace vd
