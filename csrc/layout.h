// Memory-format rule shared by the kernels and mirrored by the fake kernels (vdcompile/ops/_utils.py):
// a 4-D/5-D input that is channels_last (and not plain contiguous) is kept channels_last, every other
// input is computed on, and answered with, a contiguous tensor; the ops that say so also keep a
// frames-major 5-D input frames-major (frames_major_layout).
#pragma once
#include <ATen/ATen.h>

namespace vd {

inline bool channels_last_layout(const at::Tensor& x) {
  if (x.is_contiguous()) return false;
  if (x.dim() == 4) return x.is_contiguous(at::MemoryFormat::ChannelsLast);
  if (x.dim() == 5) return x.is_contiguous(at::MemoryFormat::ChannelsLast3d);
  return false;
}

// diffusers' temporal blocks reshape (B*F, C, H, W) activations to (B, F, C, H, W) and permute to
// (B, C, F, H, W): no copy, so the temporal layers see "frames-major" memory. Checked after the
// contiguous and channels_last_3d rules (whose size-1 ambiguities keep their meaning). The ops that
// read it in place (temporal_conv, group_norm_silu) answer in the same layout, so a chain of them needs
// no permute copies; mirrored in vdcompile/ops/_utils.py.
inline bool frames_major_layout(const at::Tensor& x) {
  return x.dim() == 5 && !x.is_contiguous() && !channels_last_layout(x) && x.transpose(1, 2).is_contiguous();
}

inline at::MemoryFormat layout_memory_format(const at::Tensor& x) {
  if (channels_last_layout(x))
    return x.dim() == 4 ? at::MemoryFormat::ChannelsLast : at::MemoryFormat::ChannelsLast3d;
  return at::MemoryFormat::Contiguous;
}

}  // namespace vd
