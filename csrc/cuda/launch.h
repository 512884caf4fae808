// Small pieces shared by the CUDA kernels: the 16-byte vector type, packing a pair of 16-bit outputs and
// host-side launch sizing.
#pragma once
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <limits>
#include <type_traits>

namespace vd {

constexpr unsigned kFullMask = 0xffffffffu;

template <typename T, int N>
struct alignas(sizeof(T) * N) Vec {
  T v[N];
};

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

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

inline bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// A 1-D grid of `blocks`; refuses sizes a launch cannot take.
inline unsigned grid_of(int64_t blocks, const char* op) {
  TORCH_CHECK(blocks <= std::numeric_limits<int32_t>::max(), op, ": input too large for one launch");
  return static_cast<unsigned>(blocks);
}

}  // namespace vd
