// Host-side pieces shared by the Hopper kernels: which device runs the sm_90a (wgmma + TMA) kernels,
// persistent grids (of clusters too), and the driver's tensor-map encoder.
#pragma once
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <map>
#include <mutex>
#include <tuple>
#include <utility>

#include "launch.h"

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

// Persistent grid: as many blocks as fit on the device at once (the blocks stride over work).
template <typename Kernel>
unsigned persistent_blocks(Kernel kernel, int threads, size_t smem, int64_t work_blocks) {
  int per_sm = 0;
  C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads, smem));
  const int64_t resident = static_cast<int64_t>(sm_count()) * std::max(per_sm, 1);
  return static_cast<unsigned>(std::max<int64_t>(1, std::min(resident, work_blocks)));
}

// The launch attribute for clusters of K CTAs along x.
inline cudaLaunchAttribute cluster_attr(int K) {
  cudaLaunchAttribute at{};
  at.id = cudaLaunchAttributeClusterDimension;
  at.val.clusterDim.x = K;
  at.val.clusterDim.y = 1;
  at.val.clusterDim.z = 1;
  return at;
}

// Bytes of dynamic shared memory a kernel with attributes `fa` may take on `device`: the opt-in limit less its static
// arrays.
inline int max_dynamic_smem(const cudaFuncAttributes& fa, int device) {
  int optin = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
  return optin - static_cast<int>(fa.sharedSizeBytes);
}

// The same for `kernel` on `device`, cached (host code choosing a ring on every call need not ask the driver).
template <typename Kernel>
int kernel_max_dynamic_smem(Kernel kernel, int device) {
  static std::mutex mu;
  static std::map<std::pair<const void*, int>, int> cache;
  const auto key = std::make_pair(reinterpret_cast<const void*>(kernel), device);
  const std::lock_guard<std::mutex> lock(mu);
  const auto it = cache.find(key);
  if (it != cache.end()) return it->second;
  cudaFuncAttributes fa{};
  C10_CUDA_CHECK(cudaFuncGetAttributes(&fa, kernel));
  return cache.emplace(key, max_dynamic_smem(fa, device)).first->second;
}

// Clusters of K CTAs (`threads` threads, `smem` bytes of dynamic shared memory) resident on `device` at once:
// a persistent grid of clusters. 0 where the kernel has no sm_90 code or the device cannot place one.
// Allows clusters of 16 (over the portable 8) on the kernel first. Cached: the answer depends only on these.
template <typename Kernel>
int resident_clusters(Kernel kernel, int K, int device, int threads, size_t smem) {
  static std::mutex mu;
  static std::map<std::tuple<const void*, int, int, int, size_t>, int> cache;
  const auto key = std::make_tuple(reinterpret_cast<const void*>(kernel), K, device, threads, smem);
  const std::lock_guard<std::mutex> lock(mu);
  const auto it = cache.find(key);
  if (it != cache.end()) return it->second;
  cudaFuncAttributes fa{};
  C10_CUDA_CHECK(cudaFuncGetAttributes(&fa, kernel));
  // The kernel may take up to all of the opt-in shared memory (set once to the maximum, so that launches
  // with different sizes never see a smaller limit set by another).
  const int max_dyn = max_dynamic_smem(fa, device);
  int n = 0;
  if (fa.binaryVersion >= 90 && smem <= static_cast<size_t>(max_dyn) &&
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, max_dyn) == cudaSuccess &&
      (K <= 8 || cudaFuncSetAttribute(kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1) == cudaSuccess)) {
    if (K == 1) {
      int per_sm = 0, sms = 0;
      C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads, smem));
      C10_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
      n = per_sm * sms;
    } else {
      cudaLaunchConfig_t cfg{};
      cfg.gridDim = dim3(K);
      cfg.blockDim = dim3(threads);
      cfg.dynamicSmemBytes = smem;
      cudaLaunchAttribute at = cluster_attr(K);
      cfg.attrs = &at;
      cfg.numAttrs = 1;
      if (cudaOccupancyMaxActiveClusters(&n, kernel, &cfg) != cudaSuccess) n = 0;
    }
  }
  (void)cudaGetLastError();  // a refusal above is an answer (none), not an error to carry on
  cache.emplace(key, n);
  return n;
}

// Launches `kernel` over groups * K CTAs in clusters of K, with arguments a (then `more`); op names the caller in
// errors.
template <typename Kernel, typename Args, typename... More>
void launch_clusters(const char* op, Kernel kernel, const Args& a, int64_t groups, int K, int threads,
                     size_t smem, cudaStream_t stream, const More&... more) {
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = dim3(grid_of(groups * K, op));
  cfg.blockDim = dim3(threads);
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cudaLaunchAttribute at = cluster_attr(K);
  cfg.attrs = &at;
  cfg.numAttrs = K > 1 ? 1 : 0;  // no cluster attribute at all for K = 1: pre-sm_90 devices reject it
  C10_CUDA_CHECK(cudaLaunchKernelEx(&cfg, kernel, a, more...));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

#if defined(VD_SM90A)
// A driver function (CUDA 12.0 ABI), found through the runtime (no link against libcuda); null if absent.
template <typename Fn>
inline Fn driver_entry(const char* name) {
  void* p = nullptr;
  cudaDriverEntryPointQueryResult q{};
  C10_CUDA_CHECK(cudaGetDriverEntryPointByVersion(name, &p, 12000, cudaEnableDefault, &q));
  return q == cudaDriverEntryPointSuccess ? reinterpret_cast<Fn>(p) : nullptr;
}

inline PFN_cuTensorMapEncodeTiled_v12000 tensor_map_encoder() {
  static const auto fn = driver_entry<PFN_cuTensorMapEncodeTiled_v12000>("cuTensorMapEncodeTiled");
  return fn;
}

// A 4-D map's sizes and byte strides (dims 1-3) from element strides; a size-1 dim gets the packed stride
// (never used). False where the copy engine cannot take them (strides must be positive multiples of 16 bytes).
inline bool map_geometry(const at::Tensor& t, const int64_t (&dims)[4], const int64_t (&strides)[3],
                         cuuint64_t (&gdims)[4], cuuint64_t (&bytes)[3]) {
  const int64_t es = t.element_size();
  for (int i = 0; i < 4; ++i) gdims[i] = static_cast<cuuint64_t>(dims[i]);
  int64_t packed = dims[0];
  for (int i = 0; i < 3; ++i) {
    const int64_t st = dims[i + 1] == 1 ? packed : strides[i];
    if (st <= 0 || (st * es) % 16 != 0) return false;
    bytes[i] = static_cast<cuuint64_t>(st * es);
    packed = st * dims[i + 1];
  }
  return true;
}

// The copy engine's element type of t (fp16, bf16 or fp32).
inline CUtensorMapDataType map_type(const at::Tensor& t) {
  return t.scalar_type() == at::kBFloat16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16
         : t.scalar_type() == at::kHalf   ? CU_TENSOR_MAP_DATA_TYPE_FLOAT16
                                          : CU_TENSOR_MAP_DATA_TYPE_FLOAT32;
}

// A 4-D tiled tensor map over t's data (fp16, bf16 or fp32): `dims` innermost first, element strides of
// dims 1-3 (a size-1 dim's stride is never used: it gets the packed one), boxes `box`, the 128-byte
// swizzle (or `swizzle`), L2 misses filled 256 bytes at a time (or `promotion`), zeros outside the tensor. False
// where the copy engine cannot take it (strides must be positive multiples of 16 bytes) or the driver has no encoder.
inline bool tensor_map_4d(CUtensorMap* m, const at::Tensor& t, const int64_t (&dims)[4], const int64_t (&strides)[3],
                          const uint32_t (&box)[4], CUtensorMapSwizzle swizzle = CU_TENSOR_MAP_SWIZZLE_128B,
                          CUtensorMapL2promotion promotion = CU_TENSOR_MAP_L2_PROMOTION_L2_256B) {
  auto encode = tensor_map_encoder();
  cuuint64_t gdims[4], bytes[3];
  if (encode == nullptr || !map_geometry(t, dims, strides, gdims, bytes)) return false;
  const cuuint32_t gbox[4] = {box[0], box[1], box[2], box[3]}, unit[4] = {1, 1, 1, 1};
  return encode(m, map_type(t), 4, const_cast<void*>(t.const_data_ptr()), gdims, bytes, gbox, unit,
                CU_TENSOR_MAP_INTERLEAVE_NONE, swizzle, promotion, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

inline PFN_cuTensorMapEncodeIm2col_v12000 im2col_map_encoder() {
  static const auto fn = driver_entry<PFN_cuTensorMapEncodeIm2col_v12000>("cuTensorMapEncodeIm2col");
  return fn;
}

// An im2col tensor map over a channels_last activation t (fp16, bf16 or fp32) seen as (C, W, H, N), innermost
// first, with element strides `strides` of W, H and N: a load at coordinates (c, w, h, n) with offsets
// (ow, oh) reads `pixels` consecutive output positions starting at (w, h, n), walking W, then H, then N
// through the bounding box [lower, dim + upper) of W and H (corners in W, H order), each shifted by the
// offsets, `channels` channels from c at each (zeros outside the tensor); 128-byte swizzle. False where
// the copy engine cannot take it (16-byte strides, corners within [-128, 127]) or there is no encoder.
inline bool im2col_map_4d(CUtensorMap* m, const at::Tensor& t, const int64_t (&dims)[4], const int64_t (&strides)[3],
                          const int (&lower)[2], const int (&upper)[2], uint32_t channels, uint32_t pixels) {
  auto encode = im2col_map_encoder();
  cuuint64_t gdims[4], bytes[3];
  if (encode == nullptr || !map_geometry(t, dims, strides, gdims, bytes)) return false;
  for (int i = 0; i < 2; ++i)
    if (lower[i] < -128 || lower[i] > 127 || upper[i] < -128 || upper[i] > 127) return false;
  const cuuint32_t unit[4] = {1, 1, 1, 1};
  return encode(m, map_type(t), 4, const_cast<void*>(t.const_data_ptr()), gdims, bytes, lower, upper, channels, pixels,
                unit, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}
#endif

}  // namespace vd
