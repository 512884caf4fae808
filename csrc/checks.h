// Input validation shared by every backend (clear errors that name the argument), and the accumulation dtype rule.
#pragma once
#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <optional>

namespace vd {

#define VD_CHECK(cond, ...) TORCH_CHECK(cond, __VA_ARGS__)

// The kernels' accumulation dtype, and that of their float side outputs (attention's lse, group_norm_silu's
// statistics): float64 for float64 input, float32 otherwise (vdcompile/ops/_utils.py's compute_dtype).
inline at::ScalarType compute_dtype(const at::Tensor& t) {
  return t.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
}

inline void check_float_dtype(const at::Tensor& t, const char* op, const char* name) {
  auto d = t.scalar_type();
  TORCH_CHECK_TYPE(d == at::kFloat || d == at::kHalf || d == at::kBFloat16 || d == at::kDouble,
                   op, ": ", name, " must be float32, float16, bfloat16 or float64, got ", d);
}

inline void check_same_device(const at::Tensor& ref, const at::Tensor& t, const char* op,
                              const char* ref_name, const char* name) {
  TORCH_CHECK(t.device() == ref.device(), op, ": ", name, " is on ", t.device(), " but ", ref_name,
              " is on ", ref.device(), "; all tensors must be on the same device");
}

inline void check_same_dtype(const at::Tensor& ref, const at::Tensor& t, const char* op,
                             const char* ref_name, const char* name) {
  TORCH_CHECK_TYPE(t.scalar_type() == ref.scalar_type(), op, ": ", name, " has dtype ",
                   t.scalar_type(), " but ", ref_name, " has dtype ", ref.scalar_type());
}

inline void check_dim(const at::Tensor& t, int64_t dim, const char* op, const char* name,
                      const char* layout) {
  TORCH_CHECK(t.dim() == dim, op, ": ", name, " must be ", dim, "-D ", layout, ", got ", t.dim(),
              "-D tensor of shape ", t.sizes());
}

// A tensor that must be a per-channel vector of length n (or absent).
inline void check_vector(const std::optional<at::Tensor>& t, int64_t n, const at::Tensor& ref,
                         const char* op, const char* name) {
  if (!t.has_value()) return;
  check_same_device(ref, *t, op, "x", name);
  check_float_dtype(*t, op, name);
  TORCH_CHECK(t->dim() == 1 && t->size(0) == n, op, ": ", name, " must have shape (", n,
              ",), got ", t->sizes());
}

}  // namespace vd
