// Autograd of group_norm_silu, temporal_conv and conv_bn_silu, in C++: one kernel on the Autograd key an op. A call
// that needs no gradient goes straight on to the backend kernel; the others run a torch::autograd::Function whose
// backward calls the op's backward op through the dispatcher (so CPU, CUDA and torch.compile's tracing see the
// same graph). Why C++: a Python formula ran on every call, gradient or not (~7-35 us of host time a call on the
// GPU machine), and the backward of a short call is host-bound (bench/notes/norm_and_elementwise.md, "host time").
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/autograd.h>
#include <torch/library.h>

#include "checks.h"

namespace vd {
namespace {

using at::Tensor;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;
using OptTensor = std::optional<Tensor>;
using Keys = c10::DispatchKeySet;

using GNSig = Tensor(const Tensor&, int64_t, const OptTensor&, const OptTensor&, double, bool);
using GNForwardSig = std::tuple<Tensor, Tensor>(const Tensor&, int64_t, const OptTensor&, const OptTensor&, double,
                                                bool);
using GNBackwardSig = std::tuple<Tensor, Tensor, Tensor>(const Tensor&, const Tensor&, int64_t, const OptTensor&,
                                                         const OptTensor&, double, bool, const OptTensor&);

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

// op's kernel below autograd (the backend's, or the tracer's), from the key set this Autograd kernel got.
template <typename Sig, typename... Args>
auto below_autograd(const c10::TypedOperatorHandle<Sig>& op, Keys ks, const Args&... args) {
  at::AutoDispatchBelowADInplaceOrView guard;
  return op.redispatch(ks & c10::after_autograd_keyset, args...);
}

// Saved optional tensors come back undefined when they were absent.
OptTensor as_optional(const Tensor& t) { return t.defined() ? OptTensor(t) : std::nullopt; }
Tensor or_undefined(const OptTensor& t) { return t.has_value() ? *t : Tensor(); }

std::tuple<Tensor, Tensor> forward_below(Keys ks, const Tensor& x, int64_t G, const OptTensor& w,
                                         const OptTensor& b, double eps, bool silu) {
  static const auto op = op_handle<GNForwardSig>("vd::group_norm_silu_forward");
  return below_autograd(op, ks, x, G, w, b, eps, silu);
}

// ---- group_norm_silu ----
// forward takes the dispatch key set after ctx (to redispatch below autograd without a second dispatcher
// call), so backward returns an undefined gradient for it first. Outputs: y and the statistics.
struct GroupNormSiluFn : public torch::autograd::Function<GroupNormSiluFn> {
  static variable_list forward(AutogradContext* ctx, Keys ks, const Tensor& x, int64_t G, const OptTensor& w,
                               const OptTensor& b, double eps, bool silu) {
    auto [y, stats] = forward_below(ks, x, G, w, b, eps, silu);
    ctx->mark_non_differentiable({stats});
    // stats gets no gradient: without this, autograd would allocate and zero-fill one on every backward.
    ctx->set_materialize_grads(false);
    ctx->save_for_backward({x, or_undefined(w), or_undefined(b), stats});
    ctx->saved_data["G"] = G;
    ctx->saved_data["eps"] = eps;
    ctx->saved_data["silu"] = silu;
    return {y, stats};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    if (!grads[0].defined()) return variable_list(7);  // y's gradient undefined (grads are not materialized)
    static const auto op = op_handle<GNBackwardSig>("vd::group_norm_silu_backward");
    const auto saved = ctx->get_saved_variables();
    const OptTensor w = as_optional(saved[1]), b = as_optional(saved[2]);
    auto [dx, dw, db] = op.call(grads[0], saved[0], ctx->saved_data["G"].toInt(), w, b,
                                ctx->saved_data["eps"].toDouble(), ctx->saved_data["silu"].toBool(), saved[3]);
    return {Tensor(), dx, Tensor(), w ? dw : Tensor(), b ? db : Tensor(), Tensor(), Tensor()};
  }
};

// vd::group_norm_silu: the op's own kernel (no statistics written) when no gradient is needed.
Tensor group_norm_silu_autograd(Keys ks, const Tensor& x, int64_t G, const OptTensor& w, const OptTensor& b,
                                double eps, bool silu) {
  if (!grad_needed(x, w, b)) {
    static const auto op = op_handle<GNSig>("vd::group_norm_silu");
    return below_autograd(op, ks, x, G, w, b, eps, silu);
  }
  return GroupNormSiluFn::apply(ks, x, G, w, b, eps, silu)[0];
}

std::tuple<Tensor, Tensor> group_norm_silu_forward_autograd(Keys ks, const Tensor& x, int64_t G, const OptTensor& w,
                                                            const OptTensor& b, double eps, bool silu) {
  if (!grad_needed(x, w, b)) return forward_below(ks, x, G, w, b, eps, silu);
  auto out = GroupNormSiluFn::apply(ks, x, G, w, b, eps, silu);
  return {out[0], out[1]};
}

// ---- temporal_conv ----
using TCSig = Tensor(const Tensor&, const Tensor&, const OptTensor&, int64_t);
using TCBackwardSig = std::tuple<Tensor, Tensor, Tensor>(const Tensor&, const Tensor&, const Tensor&, int64_t);

Tensor temporal_conv_below(Keys ks, const Tensor& x, const Tensor& w, const OptTensor& b, int64_t padding) {
  static const auto op = op_handle<TCSig>("vd::temporal_conv");
  return below_autograd(op, ks, x, w, b, padding);
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
using CBSSig = Tensor(const Tensor&, const Tensor&, const OptTensor&, const Tensor&, const Tensor&, const Tensor&,
                      const Tensor&, double, at::IntArrayRef, at::IntArrayRef, at::IntArrayRef, int64_t, bool);
using CBSBackwardSig = std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor>(
    const Tensor&, const Tensor&, const Tensor&, const OptTensor&, const Tensor&, const Tensor&, const Tensor&,
    const Tensor&, double, at::IntArrayRef, at::IntArrayRef, at::IntArrayRef, int64_t, bool);

Tensor conv_bn_silu_below(Keys ks, const Tensor& x, const Tensor& w, const OptTensor& b, const Tensor& gamma,
                          const Tensor& beta, const Tensor& mean, const Tensor& var, double eps, at::IntArrayRef stride,
                          at::IntArrayRef padding, at::IntArrayRef dilation, int64_t groups, bool silu) {
  static const auto op = op_handle<CBSSig>("vd::conv_bn_silu");
  return below_autograd(op, ks, x, w, b, gamma, beta, mean, var, eps, stride, padding, dilation, groups, silu);
}

struct ConvBnSiluFn : public torch::autograd::Function<ConvBnSiluFn> {
  static Tensor forward(AutogradContext* ctx, Keys ks, const Tensor& x, const Tensor& w, const OptTensor& b,
                        const Tensor& gamma, const Tensor& beta, const Tensor& mean, const Tensor& var, double eps,
                        at::IntArrayRef stride, at::IntArrayRef padding, at::IntArrayRef dilation, int64_t groups,
                        bool silu) {
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
    // The running statistics enter z only through s and (b - mean) * s, so their gradients follow from the others:
    // dz/dmean = -s, dz/dvar = -gamma / (2 (var + eps)) * dz/dgamma.
    Tensor dmean, dvar;
    if (ctx->saved_data["stats_grad"].toBool()) {
      const auto acc = compute_dtype(x);
      const Tensor inv_var = 1.0 / (var.to(acc) + eps), g = gamma.to(acc);
      dmean = (-g * inv_var.sqrt() * dbeta.to(acc)).to(mean.scalar_type());
      dvar = (-0.5 * g * inv_var * dgamma.to(acc)).to(var.scalar_type());
    }
    return {Tensor(), dx,       dw,       b ? db : Tensor(), dgamma,   dbeta,    dmean,
            dvar,     Tensor(), Tensor(), Tensor(),          Tensor(), Tensor(), Tensor()};
  }
};

Tensor conv_bn_silu_autograd(Keys ks, const Tensor& x, const Tensor& w, const OptTensor& b, const Tensor& gamma,
                             const Tensor& beta, const Tensor& mean, const Tensor& var, double eps,
                             at::IntArrayRef stride, at::IntArrayRef padding, at::IntArrayRef dilation, int64_t groups,
                             bool silu) {
  if (!grad_needed(x, w, b, gamma, beta, mean, var))
    return conv_bn_silu_below(ks, x, w, b, gamma, beta, mean, var, eps, stride, padding, dilation, groups, silu);
  return ConvBnSiluFn::apply(ks, x, w, b, gamma, beta, mean, var, eps, stride, padding, dilation, groups, silu);
}

}  // namespace

TORCH_LIBRARY_IMPL(vd, Autograd, m) {
  m.impl("group_norm_silu", TORCH_FN(group_norm_silu_autograd));
  m.impl("group_norm_silu_forward", TORCH_FN(group_norm_silu_forward_autograd));
  m.impl("temporal_conv", TORCH_FN(temporal_conv_autograd));
  m.impl("conv_bn_silu", TORCH_FN(conv_bn_silu_autograd));
}

}  // namespace vd
