// group_norm_silu's autograd, in C++: one kernel on the Autograd key for vd::group_norm_silu and one for
// vd::group_norm_silu_forward. A call that needs no gradient goes straight on to the backend kernel; the others
// run a torch::autograd::Function whose forward saves the statistics group_norm_silu_forward returns and whose
// backward calls vd::group_norm_silu_backward through the dispatcher (so CPU, CUDA and torch.compile's tracing
// see the same graph). Why C++: the backward of a short call is host-bound, and a Python formula adds its
// interpreter time to every backward (bench/notes/norm_and_elementwise.md, "host time").
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

// Saved optional tensors come back undefined when they were absent.
OptTensor as_optional(const Tensor& t) { return t.defined() ? OptTensor(t) : std::nullopt; }
Tensor or_undefined(const OptTensor& t) { return t.has_value() ? *t : Tensor(); }

std::tuple<Tensor, Tensor> forward_below(Keys ks, const Tensor& x, int64_t G, const OptTensor& w,
                                         const OptTensor& b, double eps, bool silu) {
  static const auto op = op_handle<GNForwardSig>("vd::group_norm_silu_forward");
  at::AutoDispatchBelowADInplaceOrView guard;
  return op.redispatch(ks & c10::after_autograd_keyset, x, G, w, b, eps, silu);
}

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
    if (!grads[0].defined()) return variable_list(8);  // y's gradient unused
    static const auto op = op_handle<GNBackwardSig>("vd::group_norm_silu_backward");
    const auto saved = ctx->get_saved_variables();
    const OptTensor w = as_optional(saved[1]), b = as_optional(saved[2]);
    auto [dx, dw, db] = op.call(grads[0], saved[0], ctx->saved_data["G"].toInt(), w, b,
                                ctx->saved_data["eps"].toDouble(), ctx->saved_data["silu"].toBool(), saved[3]);
    return {Tensor(), dx, Tensor(), w ? dw : Tensor(), b ? db : Tensor(), Tensor(), Tensor()};
  }
};

bool grad_needed(const Tensor& x, const OptTensor& w, const OptTensor& b) {
  return at::GradMode::is_enabled() && (wants_grad(x) || wants_grad(w) || wants_grad(b));
}

// vd::group_norm_silu: the op's own kernel (no statistics written) when no gradient is needed.
Tensor group_norm_silu_autograd(Keys ks, const Tensor& x, int64_t G, const OptTensor& w, const OptTensor& b,
                                double eps, bool silu) {
  if (!grad_needed(x, w, b)) {
    static const auto op = op_handle<GNSig>("vd::group_norm_silu");
    at::AutoDispatchBelowADInplaceOrView guard;
    return op.redispatch(ks & c10::after_autograd_keyset, x, G, w, b, eps, silu);
  }
  return GroupNormSiluFn::apply(ks, x, G, w, b, eps, silu)[0];
}

std::tuple<Tensor, Tensor> group_norm_silu_forward_autograd(Keys ks, const Tensor& x, int64_t G, const OptTensor& w,
                                                            const OptTensor& b, double eps, bool silu) {
  if (!grad_needed(x, w, b)) return forward_below(ks, x, G, w, b, eps, silu);
  auto out = GroupNormSiluFn::apply(ks, x, G, w, b, eps, silu);
  return {out[0], out[1]};
}

}  // namespace

TORCH_LIBRARY_IMPL(vd, Autograd, m) {
  m.impl("group_norm_silu", TORCH_FN(group_norm_silu_autograd));
  m.impl("group_norm_silu_forward", TORCH_FN(group_norm_silu_forward_autograd));
}

}  // namespace vd
