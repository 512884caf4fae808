// Small pieces shared by the CUDA kernels: the 16-byte vector type, packing a pair of 16-bit outputs, 16-byte
// asynchronous copies into shared memory and host-side launch sizing.
#pragma once
#include <ATen/ATen.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGraphsC10Utils.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <limits>
#include <map>
#include <mutex>
#include <string>
#include <tuple>
#include <type_traits>

#include "../fold_cache.h"

namespace vd {

constexpr unsigned kFullMask = 0xffffffffu;

template <typename T, int N>
struct alignas(sizeof(T) * N) Vec {
  T v[N];
};

// x rounded to the nearest TF32 value (10 mantissa bits, ties away from zero), as 32 bits: what the tensor
// cores' TF32 products read, which would otherwise truncate. Before sm_80: x unchanged.
__device__ __forceinline__ unsigned tf32_of(float x) {
  unsigned r;
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800
  asm("cvt.rna.tf32.f32 %0, %1;\n" : "=r"(r) : "f"(x));
#else
  r = __float_as_uint(x);
#endif
  return r;
}

// Two floats as one 32-bit word of scalar_t (bf16 or fp16; lo in the low half), rounded to nearest.
template <typename scalar_t>
__device__ __forceinline__ uint32_t pack_pair(float lo, float hi) {
  if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {
    const __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<const uint32_t*>(&h);
  } else {
    const __half2 h = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<const uint32_t*>(&h);
  }
}

__device__ __forceinline__ unsigned smem_addr(const void* p) {
  return static_cast<unsigned>(__cvta_generic_to_shared(p));
}

// 16-byte global -> shared copy (sm_80+); zero-fills when !valid (src must still be a valid address). A thread that
// reads back only its own copies needs no barrier: cp.async.wait_group makes them visible to it.
__device__ __forceinline__ void cp_async16(void* dst, const void* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(dst)), "l"(src),
               "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
// Until at most N of this thread's committed groups are still in flight.
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}
__device__ __forceinline__ void cp_async_wait_all() { cp_async_wait<0>(); }

// The value of environment variable `name`, empty where it is unset (the kernels' benchmark and test switches).
inline std::string env_str(const char* name) {
  const char* e = std::getenv(name);
  return e == nullptr ? std::string() : std::string(e);
}

// Its value as an integer; `otherwise` where it is unset or not a whole positive number.
inline int64_t env_int(const char* name, int64_t otherwise) {
  const std::string v = env_str(name);
  if (v.empty() || v.find_first_not_of("0123456789") != std::string::npos || v.size() > 18) return otherwise;
  const int64_t n = std::stoll(v);
  return n > 0 ? n : otherwise;
}

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

inline bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// A 1-D grid of `blocks`; refuses sizes a launch cannot take.
inline unsigned grid_of(int64_t blocks, const char* op) {
  TORCH_CHECK(blocks <= std::numeric_limits<int32_t>::max(), op, ": input too large for one launch");
  return static_cast<unsigned>(blocks);
}

// CTAs of `kernel` (`threads` threads, `smem` bytes of dynamic shared memory) resident at once on one SM of
// `device`, the current device (the callers' device guard); cached (the answer depends only on these), so a plan
// can ask it on every call.
template <typename Kernel>
int resident_blocks(Kernel kernel, int device, int threads, size_t smem) {
  static std::mutex mu;
  static std::map<std::tuple<const void*, int, int, size_t>, int> cache;
  const auto key = std::make_tuple(reinterpret_cast<const void*>(kernel), device, threads, smem);
  const std::lock_guard<std::mutex> lock(mu);
  const auto it = cache.find(key);
  if (it != cache.end()) return it->second;
  int per_sm = 0;
  if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads, smem) != cudaSuccess) per_sm = 0;
  (void)cudaGetLastError();  // a refusal is an answer (none known): callers fall back to their plain rule
  cache.emplace(key, per_sm);
  return per_sm;
}

// A copy of t in device memory of its own (cudaMalloc, freed with the copy), for what the weight caches
// keep across calls. While torch.compile's CUDA-graph trees (mode="reduce-overhead") warm a graph up, the
// caching allocator hands this thread's allocations to the graph's private pool, and a tensor a cache kept
// alive there fails the trees' check of that pool ("tensor(s) in the cudagraph pool not tracked as
// outputs"): the compiled model stopped with that error. The copy runs on the current stream, as the fold
// did; the free synchronizes the device, so no kernel still reads the memory (entries go only when a
// weight changes or dies).
inline at::Tensor keep_outside_pools(const at::Tensor& t) {
  if (!t.defined() || !t.is_cuda()) return t;
  const at::Tensor src = t.is_non_overlapping_and_dense() ? t : t.contiguous();
  const size_t bytes = std::max<size_t>(src.nbytes(), 16);
  void* p = nullptr;
  cudaError_t err = cudaMalloc(&p, bytes);
  if (err != cudaSuccess) {  // the caching allocator's free blocks back to the driver, then once more
    (void)cudaGetLastError();
    c10::cuda::CUDACachingAllocator::emptyCache();
    err = cudaMalloc(&p, bytes);
  }
  if (err != cudaSuccess) {
    (void)cudaGetLastError();
    TORCH_CHECK(false, "vd: could not allocate ", bytes, " bytes of device memory for a cached weight: ",
                cudaGetErrorString(err));
  }
  at::Tensor out = at::from_blob(p, src.sizes(), src.strides(), [](void* q) { (void)cudaFree(q); }, src.options());
  out.copy_(src);
  return out;
}

// Whether the current stream is capturing a CUDA graph.
inline bool stream_capturing() {
  return c10::cuda::currentStreamCaptureStatusMayInitCtx() != c10::cuda::CaptureStatus::None;
}

// A copy derived from a weight (make(): a FoldValue), kept in `cache` while the weight is unchanged (the same
// tensor, version and data; fold_cacheable's rules) under key `tag`, its tensors outside the caching
// allocator's pools. Made afresh while a CUDA graph is captured: a replay would keep reading the captured copy
// after the weight changes.
template <typename Make>
FoldValue cached_weight_copy(FoldCache& cache, const at::Tensor& x, const at::Tensor& weight, double tag, Make make) {
  const bool capturing = stream_capturing();
  const std::array<const at::Tensor*, kFoldParams> ps{&weight, nullptr, nullptr, nullptr, nullptr, nullptr};
  if (!fold_cacheable(x, ps, !capturing)) return make();
  return cache.find_or_insert(ps, weight.scalar_type(), weight.device(), at::MemoryFormat::Contiguous, tag,
                              static_cast<int64_t>(c10::cuda::getCurrentCUDAStream().id()), [&] {
                                const FoldValue v = make();
                                return FoldValue{keep_outside_pools(v.weight), keep_outside_pools(v.shift),
                                                 keep_outside_pools(v.out_scale), keep_outside_pools(v.scale_shift)};
                              });
}

}  // namespace vd
