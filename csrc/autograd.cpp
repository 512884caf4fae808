// Autograd for the vd ops, in C++: one kernel on the Autograd key per op. A call that needs no gradient
// (inference: grad mode off, or no input requiring grad) goes straight on to the backend kernel; the
// others run a torch::autograd::Function whose backward calls the op's backward op through the
// dispatcher (so CPU, CUDA and torch.compile's tracing all see the same graph). The Python formulas
// this replaced ran on every call, gradient or not: ~14 us of host time a call on the GPU machine, half of
// group_norm_silu's (bench/notes/norm_and_elementwise.md). scheduler_step keeps its Python formula.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/autograd.h>
#include <torch/library.h>

namespace vd {
namespace {

using at::Tensor;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;
using OptTensor = std::optional<Tensor>;
using Keys = c10::DispatchKeySet;

template <typename Sig>
c10::TypedOperatorHandle<Sig> op_handle(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Sig>();
}

bool wants_grad(const Tensor& t) { return t.defined() && t.requires_grad(); }
bool wants_grad(const OptTensor& t) { return t.has_value() && wants_grad(*t); }

template <typename... Ts>
bool grad_needed(const Ts&... ts) {
  return at::GradMode::is_enabled() && (wants_grad(ts) || ...);
}

// Each Function's forward takes the dispatch key set after ctx (to redispatch below autograd without a
// second dispatcher call), so its backward returns an undefined gradient for it first.

// Saved optional tensors come back undefined when they were absent.
OptTensor as_optional(const Tensor& t) { return t.defined() ? OptTensor(t) : std::nullopt; }
Tensor or_undefined(const OptTensor& t) { return t.has_value() ? *t : Tensor(); }

c10::IValue optional_double(std::optional<double> v) { return v.has_value() ? c10::IValue(*v) : c10::IValue(); }
std::optional<double> as_optional_double(const c10::IValue& v) {
  return v.isNone() ? std::nullopt : std::optional<double>(v.toDouble());
}

// The kernels' accumulation dtype: float64 for float64 inputs, float32 otherwise.
at::ScalarType compute_dtype(const Tensor& t) {
  return t.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
}

// ---- group_norm_silu ----
using GNSig = Tensor(const Tensor&, int64_t, const OptTensor&, const OptTensor&, double, bool);
using GNBackwardSig = std::tuple<Tensor, Tensor, Tensor>(const Tensor&, const Tensor&, int64_t,
                                                                      const OptTensor&, const OptTensor&, double, bool);

Tensor group_norm_silu_below(Keys ks, const Tensor& x, int64_t G, const OptTensor& w, const OptTensor& b, double eps,
                                 bool silu) {
  static const auto op = op_handle<GNSig>("vd::group_norm_silu");
  at::AutoDispatchBelowADInplaceOrView guard;
  return op.redispatch(ks & c10::after_autograd_keyset, x, G, w, b, eps, silu);
}

struct GroupNormSiluFn : public torch::autograd::Function<GroupNormSiluFn> {
  static Tensor forward(AutogradContext* ctx, Keys ks, const Tensor& x, int64_t G, const OptTensor& w,
                            const OptTensor& b, double eps, bool silu) {
    ctx->save_for_backward({x, or_undefined(w), or_undefined(b)});
    ctx->saved_data["G"] = G;
    ctx->saved_data["eps"] = eps;
    ctx->saved_data["silu"] = silu;
    return group_norm_silu_below(ks, x, G, w, b, eps, silu);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    static const auto op = op_handle<GNBackwardSig>("vd::group_norm_silu_backward");
    const auto saved = ctx->get_saved_variables();
    const OptTensor w = as_optional(saved[1]), b = as_optional(saved[2]);
    auto [dx, dw, db] = op.call(grads[0], saved[0], ctx->saved_data["G"].toInt(), w, b,
                                ctx->saved_data["eps"].toDouble(), ctx->saved_data["silu"].toBool());
    return {Tensor(), dx, Tensor(), w ? dw : Tensor(), b ? db : Tensor(), Tensor(), Tensor()};
  }
};

Tensor group_norm_silu_autograd(Keys ks, const Tensor& x, int64_t G, const OptTensor& w, const OptTensor& b,
                                    double eps, bool silu) {
  if (!grad_needed(x, w, b)) return group_norm_silu_below(ks, x, G, w, b, eps, silu);
  return GroupNormSiluFn::apply(ks, x, G, w, b, eps, silu);
}

// ---- temporal_conv ----
using TCSig = Tensor(const Tensor&, const Tensor&, const OptTensor&, int64_t);
using TCBackwardSig = std::tuple<Tensor, Tensor, Tensor>(const Tensor&, const Tensor&,
                                                                      const Tensor&, int64_t);

Tensor temporal_conv_below(Keys ks, const Tensor& x, const Tensor& w, const OptTensor& b, int64_t padding) {
  static const auto op = op_handle<TCSig>("vd::temporal_conv");
  at::AutoDispatchBelowADInplaceOrView guard;
  return op.redispatch(ks & c10::after_autograd_keyset, x, w, b, padding);
}

struct TemporalConvFn : public torch::autograd::Function<TemporalConvFn> {
  static Tensor forward(AutogradContext* ctx, Keys ks, const Tensor& x, const Tensor& w, const OptTensor& b,
                            int64_t padding) {
    ctx->save_for_backward({x, w});
    ctx->saved_data["padding"] = padding;
    // The op returns grad_bias in x's dtype; the bias may be kept in another float dtype.
    ctx->saved_data["bias_dtype"] = b.has_value() ? c10::IValue(b->scalar_type()) : c10::IValue();
    return temporal_conv_below(ks, x, w, b, padding);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    static const auto op = op_handle<TCBackwardSig>("vd::temporal_conv_backward");
    const auto saved = ctx->get_saved_variables();
    auto [dx, dw, db] = op.call(grads[0], saved[0], saved[1], ctx->saved_data["padding"].toInt());
    const c10::IValue& bias_dtype = ctx->saved_data["bias_dtype"];
    return {Tensor(), dx, dw, bias_dtype.isNone() ? Tensor() : db.to(bias_dtype.toScalarType()), Tensor()};
  }
};

Tensor temporal_conv_autograd(Keys ks, const Tensor& x, const Tensor& w, const OptTensor& b, int64_t padding) {
  if (!grad_needed(x, w, b)) return temporal_conv_below(ks, x, w, b, padding);
  return TemporalConvFn::apply(ks, x, w, b, padding);
}

// ---- conv_bn_silu ----
using CBSSig = Tensor(const Tensor&, const Tensor&, const OptTensor&, const Tensor&, const Tensor&,
                          const Tensor&, const Tensor&, double, at::IntArrayRef, at::IntArrayRef,
                          at::IntArrayRef, int64_t, bool);
using CBSBackwardSig = std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor>(
    const Tensor&, const Tensor&, const Tensor&, const OptTensor&, const Tensor&, const Tensor&,
    const Tensor&, const Tensor&, double, at::IntArrayRef, at::IntArrayRef, at::IntArrayRef, int64_t, bool);

Tensor conv_bn_silu_below(Keys ks, const Tensor& x, const Tensor& w, const OptTensor& b, const Tensor& gamma,
                              const Tensor& beta, const Tensor& mean, const Tensor& var, double eps,
                              at::IntArrayRef stride, at::IntArrayRef padding, at::IntArrayRef dilation,
                              int64_t groups, bool silu) {
  static const auto op = op_handle<CBSSig>("vd::conv_bn_silu");
  at::AutoDispatchBelowADInplaceOrView guard;
  return op.redispatch(ks & c10::after_autograd_keyset, x, w, b, gamma, beta, mean, var, eps, stride, padding, dilation,
                       groups, silu);
}

struct ConvBnSiluFn : public torch::autograd::Function<ConvBnSiluFn> {
  static Tensor forward(AutogradContext* ctx, Keys ks, const Tensor& x, const Tensor& w, const OptTensor& b,
                            const Tensor& gamma, const Tensor& beta, const Tensor& mean,
                            const Tensor& var, double eps, at::IntArrayRef stride, at::IntArrayRef padding,
                            at::IntArrayRef dilation, int64_t groups, bool silu) {
    ctx->save_for_backward({x, w, or_undefined(b), gamma, beta, mean, var});
    ctx->saved_data["eps"] = eps;
    ctx->saved_data["stride"] = stride.vec();
    ctx->saved_data["padding"] = padding.vec();
    ctx->saved_data["dilation"] = dilation.vec();
    ctx->saved_data["groups"] = groups;
    ctx->saved_data["silu"] = silu;
    ctx->saved_data["stats_grad"] = wants_grad(mean) || wants_grad(var);
    return conv_bn_silu_below(ks, x, w, b, gamma, beta, mean, var, eps, stride, padding, dilation, groups, silu);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    static const auto op = op_handle<CBSBackwardSig>("vd::conv_bn_silu_backward");
    const auto s = ctx->get_saved_variables();
    const Tensor &x = s[0], &gamma = s[3], &mean = s[5], &var = s[6];
    const OptTensor b = as_optional(s[2]);
    const double eps = ctx->saved_data["eps"].toDouble();
    const auto stride = ctx->saved_data["stride"].toIntVector(), padding = ctx->saved_data["padding"].toIntVector(),
               dilation = ctx->saved_data["dilation"].toIntVector();
    auto [dx, dw, db, dgamma, dbeta] = op.call(grads[0], x, s[1], b, gamma, s[4], mean, var, eps, stride, padding,
                                               dilation, ctx->saved_data["groups"].toInt(),
                                               ctx->saved_data["silu"].toBool());
    // The running statistics enter z only through s and (b - mean) * s, so their gradients follow from
    // the others: dz/dmean = -s, dz/dvar = -gamma / (2 (var + eps)) * dz/dgamma.
    Tensor dmean, dvar;
    if (ctx->saved_data["stats_grad"].toBool()) {
      const auto acc = compute_dtype(x);
      const Tensor inv_var = 1.0 / (var.to(acc) + eps), g = gamma.to(acc);
      dmean = (-g * inv_var.sqrt() * dbeta.to(acc)).to(mean.scalar_type());
      dvar = (-0.5 * g * inv_var * dgamma.to(acc)).to(var.scalar_type());
    }
    return {Tensor(), dx, dw, b ? db : Tensor(), dgamma, dbeta, dmean, dvar,
            Tensor(), Tensor(), Tensor(), Tensor(), Tensor(), Tensor()};
  }
};

Tensor conv_bn_silu_autograd(Keys ks, const Tensor& x, const Tensor& w, const OptTensor& b,
                                 const Tensor& gamma, const Tensor& beta, const Tensor& mean,
                                 const Tensor& var, double eps, at::IntArrayRef stride, at::IntArrayRef padding,
                                 at::IntArrayRef dilation, int64_t groups, bool silu) {
  if (!grad_needed(x, w, b, gamma, beta, mean, var))
    return conv_bn_silu_below(ks, x, w, b, gamma, beta, mean, var, eps, stride, padding, dilation, groups, silu);
  return ConvBnSiluFn::apply(ks, x, w, b, gamma, beta, mean, var, eps, stride, padding, dilation, groups, silu);
}

// ---- fused_attention / strided_attention ----
using Pair = std::tuple<Tensor, Tensor>;
using Triple = std::tuple<Tensor, Tensor, Tensor>;
using FASig = Pair(const Tensor&, const Tensor&, const Tensor&, const OptTensor&, std::optional<double>);
using FABackwardSig = Triple(const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                             const Tensor&, const Tensor&, const OptTensor&, std::optional<double>,
                             const OptTensor&);
using SASig = Pair(const Tensor&, const Tensor&, const Tensor&, int64_t, std::optional<double>);
using SABackwardSig = Triple(const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                             const Tensor&, const Tensor&, int64_t, std::optional<double>, const OptTensor&);

Pair fused_attention_below(Keys ks, const Tensor& q, const Tensor& k, const Tensor& v, const OptTensor& mask,
                           std::optional<double> scale) {
  static const auto op = op_handle<FASig>("vd::fused_attention");
  at::AutoDispatchBelowADInplaceOrView guard;
  return op.redispatch(ks & c10::after_autograd_keyset, q, k, v, mask, scale);
}

Pair strided_attention_below(Keys ks, const Tensor& q, const Tensor& k, const Tensor& v, int64_t stride,
                             std::optional<double> scale) {
  static const auto op = op_handle<SASig>("vd::strided_attention");
  at::AutoDispatchBelowADInplaceOrView guard;
  return op.redispatch(ks & c10::after_autograd_keyset, q, k, v, stride, scale);
}

// Gradient of a float attn_mask: the score gradient dS = P * (dP - Delta) (the mask is added to the scores
// unscaled), summed over the dims the mask was broadcast along. Plain ATen ops; it forms the full
// (B, H, Lq, Lk) matrix, which only a mask that requires grad pays for.
Tensor mask_grad(const Tensor& grad_out, const Tensor& q, const Tensor& k, const Tensor& v,
                     const Tensor& out, const Tensor& lse, const Tensor& mask, std::optional<double> scale,
                     const OptTensor& grad_lse) {
  const auto acc = compute_dtype(q);
  const double sc = scale.has_value() ? *scale : 1.0 / std::sqrt(static_cast<double>(q.size(-1)));
  const Tensor qa = q.to(acc), ka = k.to(acc), va = v.to(acc), go = grad_out.to(acc), oa = out.to(acc);
  const Tensor s = at::matmul(qa, ka.transpose(-2, -1)) * sc + mask.to(acc);
  const Tensor l = lse.to(acc).unsqueeze(-1);
  // exp(s - lse) is 0/0 on fully masked rows (lse = -inf); those rows have P = 0.
  const Tensor p = at::where(at::isneginf(l), at::zeros_like(s), at::exp(s - l));
  Tensor delta = (go * oa).sum(-1, /*keepdim=*/true);
  if (grad_lse.has_value()) delta = delta - grad_lse->to(acc).unsqueeze(-1);
  const Tensor ds = p * (at::matmul(go, va.transpose(-2, -1)) - delta);
  return ds.sum_to_size(mask.sizes()).to(mask.scalar_type());
}

// Both attention ops: grads of (out, lse) may be absent (not materialized as zeros: an absent grad_lse
// skips its term in the backward kernels).
struct FusedAttentionFn : public torch::autograd::Function<FusedAttentionFn> {
  static variable_list forward(AutogradContext* ctx, Keys ks, const Tensor& q, const Tensor& k, const Tensor& v,
                               const OptTensor& mask, std::optional<double> scale) {
    auto [out, lse] = fused_attention_below(ks, q, k, v, mask, scale);
    ctx->set_materialize_grads(false);
    ctx->save_for_backward({q, k, v, out, lse, or_undefined(mask)});
    ctx->saved_data["scale"] = optional_double(scale);
    ctx->saved_data["mask_grad"] = wants_grad(mask);
    return {out, lse};
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    static const auto op = op_handle<FABackwardSig>("vd::fused_attention_backward");
    const auto s = ctx->get_saved_variables();
    const Tensor &q = s[0], &k = s[1], &v = s[2], &out = s[3], &lse = s[4];
    const OptTensor mask = as_optional(s[5]), grad_lse = as_optional(grads[1]);
    const Tensor grad_out = grads[0].defined() ? grads[0] : at::zeros_like(out);
    const auto scale = as_optional_double(ctx->saved_data["scale"]);
    auto [dq, dk, dv] = op.call(grad_out, q, k, v, out, lse, mask, scale, grad_lse);
    Tensor dmask;
    if (ctx->saved_data["mask_grad"].toBool()) dmask = mask_grad(grad_out, q, k, v, out, lse, *mask, scale, grad_lse);
    return {Tensor(), dq, dk, dv, dmask, Tensor()};
  }
};

struct StridedAttentionFn : public torch::autograd::Function<StridedAttentionFn> {
  static variable_list forward(AutogradContext* ctx, Keys ks, const Tensor& q, const Tensor& k, const Tensor& v,
                               int64_t stride, std::optional<double> scale) {
    auto [out, lse] = strided_attention_below(ks, q, k, v, stride, scale);
    ctx->set_materialize_grads(false);
    ctx->save_for_backward({q, k, v, out, lse});
    ctx->saved_data["stride"] = stride;
    ctx->saved_data["scale"] = optional_double(scale);
    return {out, lse};
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    static const auto op = op_handle<SABackwardSig>("vd::strided_attention_backward");
    const auto s = ctx->get_saved_variables();
    const Tensor grad_out = grads[0].defined() ? grads[0] : at::zeros_like(s[3]);
    auto [dq, dk, dv] = op.call(grad_out, s[0], s[1], s[2], s[3], s[4], ctx->saved_data["stride"].toInt(),
                                as_optional_double(ctx->saved_data["scale"]), as_optional(grads[1]));
    return {Tensor(), dq, dk, dv, Tensor(), Tensor()};
  }
};

Pair fused_attention_autograd(Keys ks, const Tensor& q, const Tensor& k, const Tensor& v, const OptTensor& mask,
                              std::optional<double> scale) {
  if (!grad_needed(q, k, v, mask)) return fused_attention_below(ks, q, k, v, mask, scale);
  const auto r = FusedAttentionFn::apply(ks, q, k, v, mask, scale);
  return {r[0], r[1]};
}

Pair strided_attention_autograd(Keys ks, const Tensor& q, const Tensor& k, const Tensor& v, int64_t stride,
                                std::optional<double> scale) {
  if (!grad_needed(q, k, v)) return strided_attention_below(ks, q, k, v, stride, scale);
  const auto r = StridedAttentionFn::apply(ks, q, k, v, stride, scale);
  return {r[0], r[1]};
}

}  // namespace

TORCH_LIBRARY_IMPL(vd, Autograd, m) {
  m.impl("group_norm_silu", &group_norm_silu_autograd);
  m.impl("temporal_conv", &temporal_conv_autograd);
  m.impl("conv_bn_silu", &conv_bn_silu_autograd);
  m.impl("fused_attention", &fused_attention_autograd);
  m.impl("strided_attention", &strided_attention_autograd);
}

}  // namespace vd
