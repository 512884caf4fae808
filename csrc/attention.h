// Shared by the CPU and CUDA attention kernels: validation and the mask/scale conventions.
#pragma once
#include <cmath>
#include <vector>

#include "checks.h"

namespace vd {

inline void check_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            const char* op) {
  check_dim(q, 4, op, "q", "(batch, heads, q_len, head_dim)");
  check_dim(k, 4, op, "k", "(batch, heads, kv_len, head_dim)");
  check_dim(v, 4, op, "v", "(batch, heads, kv_len, head_dim)");
  check_same_device(q, k, op, "q", "k");
  check_same_device(q, v, op, "q", "v");
  check_float_dtype(q, op, "q");
  check_same_dtype(q, k, op, "q", "k");
  check_same_dtype(q, v, op, "q", "v");
  const int64_t D = q.size(3);
  TORCH_CHECK(D >= 1 && D <= 256, op, ": head_dim (q.size(3)) must be in 1..256, got ", D);
  TORCH_CHECK(k.size(0) == q.size(0) && k.size(1) == q.size(1) && k.size(3) == D, op,
              ": k must have shape (", q.size(0), ", ", q.size(1), ", kv_len, ", D,
              ") to match q ", q.sizes(), ", got ", k.sizes());
  TORCH_CHECK(v.sizes() == k.sizes(), op, ": v must have the same shape as k ", k.sizes(),
              ", got ", v.sizes());
  TORCH_CHECK(q.size(2) >= 1 && k.size(2) >= 1, op, ": q_len and kv_len must be >= 1, got q ",
              q.sizes(), " and k ", k.sizes());
}

// Returns the mask expanded (as a view, no copy) to (B, H, Lq, Lk).
inline at::Tensor expand_attention_mask(const at::Tensor& mask, const at::Tensor& q,
                                        const at::Tensor& k, const char* op) {
  check_same_device(q, mask, op, "q", "attn_mask");
  auto d = mask.scalar_type();
  TORCH_CHECK_TYPE(d == at::kBool || d == q.scalar_type() || d == at::kFloat, op,
                   ": attn_mask must be bool (True = keep) or a float mask of q's dtype or float32, got ", d);
  TORCH_CHECK(mask.dim() <= 4, op, ": attn_mask must have at most 4 dims, got ", mask.sizes());
  std::vector<int64_t> target = {q.size(0), q.size(1), q.size(2), k.size(2)};
  auto ms = mask.sizes();
  const int64_t off = 4 - mask.dim();
  for (int64_t i = 0; i < mask.dim(); ++i) {
    TORCH_CHECK(ms[i] == 1 || ms[i] == target[off + i], op, ": attn_mask of shape ", ms,
                " is not broadcastable to (batch, heads, q_len, kv_len) = ", at::IntArrayRef(target));
  }
  return mask.expand(target);
}

// An absent mask stays an undefined tensor (the kernels' "no mask").
inline at::Tensor expand_attention_mask(const std::optional<at::Tensor>& mask, const at::Tensor& q,
                                        const at::Tensor& k, const char* op) {
  return mask.has_value() ? expand_attention_mask(*mask, q, k, op) : at::Tensor();
}

// A NaN or infinite scale would turn every output into NaN; refuse it instead.
inline double attention_scale(std::optional<double> scale, int64_t head_dim,
                              const char* op = "vd::attention") {
  if (!scale.has_value()) return 1.0 / std::sqrt(static_cast<double>(head_dim));
  TORCH_CHECK(std::isfinite(*scale), op, ": scale must be finite, got ", *scale);
  return *scale;
}

// The tensors a backward op gets besides q, k, v (already checked by check_attention):
// grad_out and out shaped and typed like q's output, lse and grad_lse (B, H, Lq) in lse's dtype.
inline void check_attention_backward(const at::Tensor& grad_out, const at::Tensor& q,
                                     const at::Tensor& out, const at::Tensor& lse,
                                     const std::optional<at::Tensor>& grad_lse, const char* op) {
  const std::vector<int64_t> lse_shape = {q.size(0), q.size(1), q.size(2)};
  const auto lse_dtype = compute_dtype(q);
  for (auto [t, name] : {std::pair{&grad_out, "grad_out"}, std::pair{&out, "out"}}) {
    check_same_device(q, *t, op, "q", name);
    check_same_dtype(q, *t, op, "q", name);
    TORCH_CHECK(t->sizes() == q.sizes(), op, ": ", name, " must have q's shape ", q.sizes(),
                ", got ", t->sizes());
  }
  auto check_lse = [&](const at::Tensor& t, const char* name) {
    check_same_device(q, t, op, "q", name);
    TORCH_CHECK_TYPE(t.scalar_type() == lse_dtype, op, ": ", name, " must be ", lse_dtype,
                     " for ", q.scalar_type(), " inputs, got ", t.scalar_type());
    TORCH_CHECK(t.sizes() == at::IntArrayRef(lse_shape), op, ": ", name,
                " must have shape (batch, heads, q_len) = ", at::IntArrayRef(lse_shape), ", got ",
                t.sizes());
  };
  check_lse(lse, "lse");
  if (grad_lse.has_value()) check_lse(*grad_lse, "grad_lse");
}

inline void check_stride(int64_t stride, const char* op) {
  TORCH_CHECK(stride >= 1, op, ": stride must be >= 1, got ", stride);
}

// Keys 0, stride, 2*stride, ... of a (B, H, L, D) tensor as a view: the kernels read (and, for
// the gradients, write) it in place.
inline at::Tensor every_stride_key(const at::Tensor& t, int64_t stride) {
  return t.slice(2, 0, t.size(2), stride);
}

}  // namespace vd
