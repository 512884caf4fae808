// Shared by the CPU and CUDA group_norm_silu kernels: validation and the problem's shape.
#pragma once
#include "checks.h"
#include "layout.h"

namespace vd {

constexpr const char* kGroupNormOp = "vd::group_norm_silu";

struct GNShape {
  int64_t N, C, G, S;  // S: product of the trailing (spatial) dims
  bool channels_last;
  bool frames_major;   // 5-D frames-major (layout.h): read in place, answered frames-major
};

inline GNShape check_group_norm(const at::Tensor& x, int64_t num_groups,
                         const std::optional<at::Tensor>& weight,
                         const std::optional<at::Tensor>& bias, double eps) {
  TORCH_CHECK(x.dim() >= 3 && x.dim() <= 5, kGroupNormOp,
              ": x must be 3-D, 4-D or 5-D (N, C, *spatial), got shape ", x.sizes());
  check_float_dtype(x, kGroupNormOp, "x");
  const int64_t C = x.size(1);
  TORCH_CHECK(num_groups >= 1, kGroupNormOp, ": num_groups must be >= 1, got ", num_groups);
  TORCH_CHECK(C % num_groups == 0, kGroupNormOp, ": num_groups (", num_groups,
              ") must divide the number of channels x.size(1) = ", C);
  TORCH_CHECK(eps >= 0, kGroupNormOp, ": eps must be >= 0, got ", eps);
  check_vector(weight, C, x, kGroupNormOp, "weight");
  check_vector(bias, C, x, kGroupNormOp, "bias");
  GNShape s;
  s.N = x.size(0);
  s.C = C;
  s.G = num_groups;
  s.S = x.numel() / std::max<int64_t>(1, s.N * C);
  if (s.N * C == 0) s.S = 0;
  s.channels_last = channels_last_layout(x);
  s.frames_major = frames_major_layout(x);
  return s;
}

// The forward's output for x: x's layout when frames-major, else the layout rule's.
inline at::Tensor group_norm_output(const at::Tensor& x, const GNShape& s) {
  if (s.frames_major) return at::empty({x.size(0), x.size(2), x.size(1), x.size(3), x.size(4)}, x.options()).transpose(1, 2);
  return at::empty(x.sizes(), x.options().memory_format(layout_memory_format(x)));
}

// out, computed contiguous, answered in the forward's output layout for x (a copy when frames-major:
// the kernels that read frames-major memory in place write the output directly instead).
inline at::Tensor group_norm_answer(const at::Tensor& out, const at::Tensor& x, const GNShape& s) {
  return s.frames_major ? group_norm_output(x, s).copy_(out) : out;
}

// The backward's grad_out: x's shape, dtype and device.
inline void check_group_norm_grad_out(const at::Tensor& grad_out, const at::Tensor& x) {
  TORCH_CHECK(grad_out.sizes() == x.sizes(), kGroupNormOp, "_backward: grad_out must have x's shape ",
              x.sizes(), ", got ", grad_out.sizes());
  check_same_dtype(x, grad_out, kGroupNormOp, "x", "grad_out");
  check_same_device(x, grad_out, kGroupNormOp, "x", "grad_out");
}

// The forward's statistics (3, N, G): mean high part, mean low part, rstd; zeros where x has no elements (C or S
// of 0), which no kernel runs for.
inline at::Tensor group_norm_stats_output(const at::Tensor& x, const GNShape& s) {
  const auto opts = x.options().dtype(compute_dtype(x));
  return x.numel() == 0 ? at::zeros({3, s.N, s.G}, opts) : at::empty({3, s.N, s.G}, opts);
}

// The backward's stats argument (group_norm_silu_forward's): contiguous (3, N, G) of the statistics' dtype.
inline void check_group_norm_stats(const at::Tensor& stats, const at::Tensor& x, const GNShape& s) {
  check_same_device(x, stats, kGroupNormOp, "x", "stats");
  TORCH_CHECK(stats.dim() == 3 && stats.size(0) == 3 && stats.size(1) == s.N && stats.size(2) == s.G, kGroupNormOp,
              "_backward: stats must have shape (3, ", s.N, ", ", s.G, ") (mean high, mean low, rstd per sample and "
              "group), got ", stats.sizes());
  TORCH_CHECK_TYPE(stats.scalar_type() == compute_dtype(x), kGroupNormOp, "_backward: stats must be ",
                   compute_dtype(x), " for x of dtype ", x.scalar_type(), ", got ", stats.scalar_type());
  TORCH_CHECK(stats.is_contiguous(), kGroupNormOp, "_backward: stats must be contiguous, got strides ",
              stats.strides());
}

// weight or bias as the kernels read it: contiguous in x's dtype, undefined when absent.
inline at::Tensor group_norm_param(const std::optional<at::Tensor>& t, const at::Tensor& x) {
  return t.has_value() ? t->to(x.scalar_type()).contiguous() : at::Tensor();
}

}  // namespace vd
