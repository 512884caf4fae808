// Small pieces shared by the CUDA kernels: the 16-byte vector type and host-side launch sizing.
#pragma once
#include <c10/util/Exception.h>

#include <cstdint>
#include <limits>

namespace vd {

constexpr unsigned kFullMask = 0xffffffffu;

template <typename T, int N>
struct alignas(sizeof(T) * N) Vec {
  T v[N];
};

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

inline bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// A 1-D grid of `blocks`; refuses sizes a launch cannot take.
inline unsigned grid_of(int64_t blocks, const char* op) {
  TORCH_CHECK(blocks <= std::numeric_limits<int32_t>::max(), op, ": input too large for one launch");
  return static_cast<unsigned>(blocks);
}

}  // namespace vd
