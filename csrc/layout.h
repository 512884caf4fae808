// Memory-format rule shared by the kernels and mirrored by the fake kernels (vdcompile/ops/_utils.py):
// a 4-D/5-D input that is channels_last (and not plain contiguous) is kept channels_last, every other
// input is computed on, and answered with, a contiguous tensor.
#pragma once
#include <ATen/ATen.h>

namespace vd {

inline bool channels_last_layout(const at::Tensor& x) {
  if (x.is_contiguous()) return false;
  if (x.dim() == 4) return x.is_contiguous(at::MemoryFormat::ChannelsLast);
  if (x.dim() == 5) return x.is_contiguous(at::MemoryFormat::ChannelsLast3d);
  return false;
}

inline at::MemoryFormat layout_memory_format(const at::Tensor& x) {
  if (channels_last_layout(x))
    return x.dim() == 4 ? at::MemoryFormat::ChannelsLast : at::MemoryFormat::ChannelsLast3d;
  return at::MemoryFormat::Contiguous;
}

}  // namespace vd
