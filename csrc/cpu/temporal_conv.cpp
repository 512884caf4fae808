// CPU kernels for vd::temporal_conv: a (k, 1, 1) Conv3d over the frame axis, as k GEMMs.
// Output frame o reads input frame o + t - padding through tap t, so for each tap the valid output
// frames [o0, o1) and input frames [o0 + t - padding, ...) are contiguous ranges. Frames, rows and
// columns of x merge into one axis without copying, both for NCDHW (stride 1) and channels_last_3d
// (stride C): per sample, out[:, o0:o1] += W[:, :, t] @ x[:, f0:f1] is one BLAS call on views.
#include <ATen/ATen.h>
#include <torch/library.h>

#include "../conv.h"

namespace vd {
namespace {

constexpr const char* kOp = kTemporalConvOp;

at::MemoryFormat temporal_format(const TemporalConvShape& s) {
  return s.channels_last ? at::MemoryFormat::ChannelsLast3d : at::MemoryFormat::Contiguous;
}

// Frames [f0, f0 + n) of a (B, C, F, H, W) tensor as (B, C, n * H * W); view() (not reshape) so a
// layout that would need a copy fails loudly instead of silently writing into a temporary.
at::Tensor frames(const at::Tensor& t, int64_t f0, int64_t n) {
  return t.narrow(2, f0, n).view({t.size(0), t.size(1), n * t.size(3) * t.size(4)});
}

// (C_out, C_in, k, 1, 1) -> (k, C_out, C_in): one contiguous matrix per tap.
at::Tensor taps(const at::Tensor& weight) {
  return weight.select(4, 0).select(3, 0).permute({2, 0, 1}).contiguous();
}

at::Tensor temporal_conv_cpu(const at::Tensor& x_in, const at::Tensor& weight,
                             const std::optional<at::Tensor>& bias, int64_t padding) {
  TemporalConvShape s = check_temporal_conv(x_in, weight, padding);
  if (bias.has_value()) check_vector(bias, s.C_out, x_in, kOp, "bias");
  const auto fmt = temporal_format(s);
  at::Tensor x = x_in.contiguous(fmt);
  at::Tensor out = at::empty({s.B, s.C_out, s.F_out, s.H, s.W}, x.options().memory_format(fmt));
  if (out.numel() == 0) return out;
  if (bias.has_value())
    out.copy_(bias->to(x.scalar_type()).view({1, s.C_out, 1, 1, 1}));
  else
    out.zero_();
  at::Tensor w = taps(weight);
  for (int64_t t = 0; t < s.k; ++t) {
    auto [o0, o1] = temporal_tap_range(s, t);
    if (o1 == o0) continue;
    at::Tensor xs = frames(x, o0 + t - s.padding, o1 - o0);
    at::Tensor os = frames(out, o0, o1 - o0);
    for (int64_t b = 0; b < s.B; ++b) os.select(0, b).addmm_(w.select(0, t), xs.select(0, b));
  }
  return out;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> temporal_conv_backward_cpu(const at::Tensor& grad_out,
                                                                          const at::Tensor& x_in,
                                                                          const at::Tensor& weight,
                                                                          int64_t padding) {
  TemporalConvShape s = check_temporal_conv(x_in, weight, padding);
  check_same_device(x_in, grad_out, kOp, "x", "grad_out");
  check_same_dtype(x_in, grad_out, kOp, "x", "grad_out");
  const std::vector<int64_t> out_shape{s.B, s.C_out, s.F_out, s.H, s.W};
  TORCH_CHECK(grad_out.sizes() == at::IntArrayRef(out_shape), kOp,
              "_backward: grad_out must have the output's shape ", at::IntArrayRef(out_shape),
              ", got ", grad_out.sizes());
  const auto fmt = temporal_format(s);
  // Weight and bias gradients accumulate over samples in float (double for float64).
  const auto acc = x_in.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  at::Tensor x = x_in.contiguous(fmt);
  at::Tensor g = grad_out.contiguous(fmt);
  // at::zeros has no memory_format argument (it would drop the one in the options).
  at::Tensor dx = at::empty(x.sizes(), x.options().memory_format(fmt)).zero_();
  at::Tensor dw = at::zeros({s.k, s.C_out, s.C_in}, x.options().dtype(acc));
  at::Tensor dbias = at::zeros({s.C_out}, x.options().dtype(acc));
  if (x.numel() > 0) {
    at::Tensor w = taps(weight);
    const bool acc_in_place = x.scalar_type() == acc;
    for (int64_t t = 0; t < s.k; ++t) {
      auto [o0, o1] = temporal_tap_range(s, t);
      if (o1 == o0) continue;
      at::Tensor xs = frames(x, o0 + t - s.padding, o1 - o0);
      at::Tensor dxs = frames(dx, o0 + t - s.padding, o1 - o0);
      at::Tensor gs = frames(g, o0, o1 - o0);
      at::Tensor wt = w.select(0, t).t();
      at::Tensor dwt = dw.select(0, t);
      for (int64_t b = 0; b < s.B; ++b) {
        at::Tensor gb = gs.select(0, b), xbt = xs.select(0, b).t();
        dxs.select(0, b).addmm_(wt, gb);  // (C_in, C_out) @ (C_out, n*H*W)
        if (acc_in_place)
          dwt.addmm_(gb, xbt);  // (C_out, n*H*W) @ (n*H*W, C_in)
        else
          dwt.add_(at::mm(gb, xbt));
      }
    }
    dbias = g.sum({0, 2, 3, 4}, /*keepdim=*/false, acc);
  }
  at::Tensor dweight = dw.permute({1, 2, 0}).reshape({s.C_out, s.C_in, s.k, 1, 1})
                           .to(weight.scalar_type()).contiguous();
  return {dx, dweight, dbias.to(x.scalar_type())};
}

}  // namespace

TORCH_LIBRARY_IMPL(vd, CPU, m) {
  m.impl("temporal_conv", &temporal_conv_cpu);
  m.impl("temporal_conv_backward", &temporal_conv_backward_cpu);
}

}  // namespace vd
