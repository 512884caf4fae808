// The device-generic half of the conv ops: everything here is ATen calls on whole tensors (BatchNorm
// folding, the convolution GEMMs through ATen/cuDNN/cuBLAS, the per-tap GEMMs of the temporal conv), so
// the CPU and CUDA kernels share it and differ only in their fused elementwise passes.
#pragma once
#include <ATen/ATen.h>

#include <algorithm>
#include <array>
#include <vector>

#include "conv.h"
#include "fold_cache.h"

namespace vd {

inline at::MemoryFormat conv_format(const ConvShape& s) {
  return s.channels_last ? at::MemoryFormat::ChannelsLast : at::MemoryFormat::Contiguous;
}

struct Folded {
  at::Tensor inv_std;  // 1 / sqrt(bn_var + eps), acc dtype
  at::Tensor scale;    // s = bn_weight * inv_std, acc dtype
  at::Tensor shift;    // b' = (b - bn_mean) * s + bn_bias, acc dtype
  at::Tensor weight;   // w' = w * s, x's dtype and layout; where out_scale is set, w unscaled: w itself where it is
                       // in the op's layout, else a copy in it
  at::Tensor b_minus_mean;  // b - bn_mean, acc dtype (the backward's dbn_weight needs it again)
  // s applied to the convolution's output (y = act(conv(x, w) * s + b')) instead of to the weight: the CUDA
  // forward's (a graph replay must not copy the weight); undefined where the weight carries it.
  at::Tensor out_scale;
  // With out_scale, on CUDA: (s, b') interleaved by channel, (C_out, 2) float32, for the Hopper kernel's epilogue
  // (one load a channel).
  at::Tensor scale_shift;
};

inline Folded fold_bn(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
               const at::Tensor& bn_weight, const at::Tensor& bn_bias, const at::Tensor& bn_mean,
               const at::Tensor& bn_var, double eps, at::MemoryFormat fmt) {
  const auto acc = compute_dtype(x);
  Folded f;
  f.inv_std = (bn_var.to(acc) + eps).rsqrt();
  f.scale = bn_weight.to(acc) * f.inv_std;
  f.b_minus_mean = bias.has_value() ? bias->to(acc) - bn_mean.to(acc) : -bn_mean.to(acc);
  f.shift = (f.b_minus_mean * f.scale + bn_bias.to(acc)).contiguous();
  f.weight = (weight.to(acc) * f.scale.view({-1, 1, 1, 1})).to(x.scalar_type()).contiguous(fmt);
  return f;
}

// torch's CPU convolution of bf16 channels_last input returns wrong values or NaN, or crashes, on some
// small shapes (torch 2.13 CPU): x (2, 3, 3, 2), 9 output channels, groups 3, kernel 2x2, stride (1, 2) gave
// errors of 4-10 and NaN against float64; x (2, 2, 2, 1), a 1x1 kernel, stride (1, 2), padding (0, 1),
// dilation 2 crashed the process. The same sweeps ran clean on NCHW bf16 tensors (25,000 shapes) and on
// fp16 channels_last ones (38,000; fp32 channels_last: 1,150), so the CPU kernels run bf16 convolutions,
// forward and backward, on NCHW-strided tensors and answer in the op's layout. Every bf16 input, not only
// channels_last ones: a tensor the op treats as NCHW may carry channels_last strides where both describe
// its memory (1x1 spatial size), and ATen picks its kernel from the strides.
// conv_operand(t): t as the convolution gets it; CPU bf16 tensors with NCHW strides (contiguous() keeps
// the channels_last strides of a tensor contiguous either way), everything else unchanged.
inline at::Tensor conv_operand(const at::Tensor& t) {
  if (!t.is_cpu() || t.scalar_type() != at::kBFloat16) return t;
  int64_t expected = 1;
  for (int64_t d = t.dim() - 1; d >= 0; --d) {
    if (t.stride(d) != expected) return at::empty(t.sizes(), t.options()).copy_(t);
    expected *= std::max<int64_t>(t.size(d), 1);
  }
  return t;
}

inline at::Tensor folded_conv(const at::Tensor& x, const Folded& f, const ConvShape& s) {
  const std::array<int64_t, 2> no_output_padding{0, 0};
  at::Tensor y = at::convolution(conv_operand(x), conv_operand(f.weight), std::nullopt, s.stride, s.padding,
                                 s.dilation, /*transposed=*/false, no_output_padding, s.groups);
  // ATen follows x's layout already; the op's output layout is part of its contract regardless.
  const auto fmt = conv_format(s);
  return y.is_contiguous(fmt) ? y : y.contiguous(fmt);
}

// The forward's fold, from the cache when fold_cacheable() allows it; the backward folds afresh.
inline Folded forward_fold(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                           const at::Tensor& bn_weight, const at::Tensor& bn_bias, const at::Tensor& bn_mean,
                           const at::Tensor& bn_var, double eps, at::MemoryFormat fmt,
                           const FoldCachePolicy& policy) {
  const std::array<const at::Tensor*, kFoldParams> ps{&weight, bias.has_value() ? &*bias : nullptr, &bn_weight,
                                                      &bn_bias, &bn_mean, &bn_var};
  const FoldFn fold = policy.fold != nullptr ? policy.fold : fold_bn;
  if (!fold_cacheable(x, ps, policy.allowed))
    return fold(x, weight, bias, bn_weight, bn_bias, bn_mean, bn_var, eps, fmt);
  const FoldValue v = fold_cache().find_or_insert(ps, x.scalar_type(), x.device(), fmt, eps, policy.stream, [&] {
    const Folded f = fold(x, weight, bias, bn_weight, bn_bias, bn_mean, bn_var, eps, fmt);
    auto keep = [&](const at::Tensor& t) {
      return !t.defined() ? t : policy.keep != nullptr ? policy.keep(t) : t;
    };
    // The caller's own weight is not kept: the entry would hold alive the tensor its key watches.
    return FoldValue{f.weight.is_same(weight) ? at::Tensor() : keep(f.weight), keep(f.shift), keep(f.out_scale),
                     keep(f.scale_shift)};
  });
  Folded f;
  f.weight = v.weight.defined() ? v.weight : weight;
  f.shift = v.shift;
  f.out_scale = v.out_scale;
  f.scale_shift = v.scale_shift;
  return f;
}

// ---- conv_bn_silu: the device passes bias_act_(y, scale, shift, silu, s) and grad_z_(y, g, shift, silu, s) ----
// (bias_act_'s scale: Folded::out_scale, undefined where the weight carries s)
// fused_(x, f, s, silu): the whole forward in one kernel where the device has one for this configuration
// (an undefined tensor otherwise: then the convolution and the (scale +) bias + SiLU pass).

template <typename BiasAct, typename Fused>
inline at::Tensor conv_bn_silu_forward(const at::Tensor& x_in, const at::Tensor& weight,
                            const std::optional<at::Tensor>& bias, const at::Tensor& bn_weight,
                            const at::Tensor& bn_bias, const at::Tensor& bn_mean,
                            const at::Tensor& bn_var, double eps, at::IntArrayRef stride,
                            at::IntArrayRef padding, at::IntArrayRef dilation, int64_t groups,
                            bool silu, const BiasAct& bias_act_, const Fused& fused_,
                            const FoldCachePolicy& policy) {
  ConvShape s = check_conv_bn_silu(x_in, weight, bias, bn_weight, bn_bias, bn_mean, bn_var, eps,
                                   stride, padding, dilation, groups);
  const auto fmt = conv_format(s);
  if (s.N == 0)
    return at::empty({0, s.C_out, s.H_out, s.W_out}, x_in.options().memory_format(fmt));
  at::Tensor x = x_in.contiguous(fmt);
  Folded f = forward_fold(x_in, weight, bias, bn_weight, bn_bias, bn_mean, bn_var, eps, fmt, policy);
  at::Tensor y = fused_(x, f, s, silu);
  if (y.defined()) return y;
  y = folded_conv(x, f, s);
  bias_act_(y, f.out_scale, f.shift, silu, s);
  return y;
}

template <typename GradZ>
inline std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> conv_bn_silu_backward(
    const at::Tensor& grad_out, const at::Tensor& x_in, const at::Tensor& weight,
    const std::optional<at::Tensor>& bias, const at::Tensor& bn_weight, const at::Tensor& bn_bias,
    const at::Tensor& bn_mean, const at::Tensor& bn_var, double eps, at::IntArrayRef stride,
    at::IntArrayRef padding, at::IntArrayRef dilation, int64_t groups, bool silu, const GradZ& grad_z_) {
  ConvShape s = check_conv_bn_silu(x_in, weight, bias, bn_weight, bn_bias, bn_mean, bn_var, eps,
                                   stride, padding, dilation, groups);
  check_conv_grad_out(grad_out, x_in, {s.N, s.C_out, s.H_out, s.W_out}, kConvBnSiluOp);
  const auto fmt = conv_format(s);
  const auto acc = compute_dtype(x_in);
  at::Tensor x = x_in.contiguous(fmt);
  at::Tensor g = grad_out.contiguous(fmt);
  Folded f = fold_bn(x, weight, bias, bn_weight, bn_bias, bn_mean, bn_var, eps, fmt);

  at::Tensor dx, dw_raw, sum_dz;
  if (s.N == 0) {
    dx = at::empty_like(x);
    dw_raw = at::zeros(weight.sizes(), weight.options().dtype(acc));
    sum_dz = at::zeros({s.C_out}, weight.options().dtype(acc));
  } else {
    // silu=False: z is never needed, dz is grad_out itself.
    at::Tensor dz = silu ? folded_conv(x, f, s) : g;
    sum_dz = grad_z_(dz, g, f.shift, silu, s).to(acc);
    const std::array<int64_t, 2> no_output_padding{0, 0};
    auto grads = at::convolution_backward(conv_operand(dz), conv_operand(x), conv_operand(f.weight), std::nullopt,
                                          s.stride, s.padding, s.dilation, /*transposed=*/false,
                                          no_output_padding, s.groups, {true, true, false});
    dx = std::get<0>(grads).contiguous(fmt);
    dw_raw = std::get<1>(grads).to(acc);
  }
  // dW_raw is the gradient of the folded weight w' = w * s.
  at::Tensor dweight = (dw_raw * f.scale.view({-1, 1, 1, 1})).to(weight.scalar_type()).contiguous();
  at::Tensor dbias = (sum_dz * f.scale).to(bias.has_value() ? bias->scalar_type() : x.scalar_type());
  at::Tensor dbn_bias = sum_dz.to(bn_bias.scalar_type());
  // dz/dbn_weight = inv_std * (conv(x, w) + b - mean); summing dz * conv(x, w) over the output
  // equals sum(w * dW_raw) over each filter.
  at::Tensor dbn_weight =
      (f.inv_std * ((weight.to(acc) * dw_raw).sum({1, 2, 3}) + f.b_minus_mean * sum_dz))
          .to(bn_weight.scalar_type());
  return {dx, dweight, dbias, dbn_weight, dbn_bias};
}

// ---- temporal_conv: a (k, 1, 1) Conv3d over the frame axis, as GEMMs on views ----
// Output frame o reads input frame o + t - padding through tap t. Two ways to lay that out as GEMMs:
//
// Fused taps (frames-major memory, (B, F, C, H*W) contiguous): the k taps' input frames
// o - padding .. o - padding + k - 1 are consecutive, so their k * C_in channel rows sit at one
// uniform stride (H*W) and form a single K = k * C_in reduction:
//   out[b, :, o] = W' (C_out x k*C_in) @ X[b, o - padding : o - padding + k] (k*C_in x H*W)
// with W' the weight as (C_out, k, C_in). Interior frames (all k taps in range) are one batched GEMM
// whose batch stride is one frame (the windows overlap, read-only); edge frames use the column range
// of W' of their valid taps. Each output element is written once: no beta = 1 re-reads.
//
// Per tap (channels_last_3d, k = 1, or where a frames-major copy costs more than it saves): for each
// tap the valid output frames [o0, o1) and input frames are contiguous ranges that merge with H, W
// into one axis, for NCDHW (stride 1) and channels_last_3d (stride C), so
//   out[b, :, o0:o1] += W[:, :, t] @ x[b, :, f0:f1]
// is one GEMM per tap batched over the samples (the weight expanded with batch stride 0).

inline at::MemoryFormat temporal_format(const TemporalConvShape& s) {
  return s.channels_last ? at::MemoryFormat::ChannelsLast3d : at::MemoryFormat::Contiguous;
}

// The op's output: frames-major for frames-major x (so the caller's permute back to (B, F, C, H, W) is
// free), otherwise x's layout rule. vdcompile/ops/conv.py builds the same strides.
inline at::Tensor temporal_output(const at::Tensor& x, const TemporalConvShape& s) {
  if (s.frames_major) return at::empty({s.B, s.F_out, s.C_out, s.H, s.W}, x.options()).transpose(1, 2);
  return at::empty({s.B, s.C_out, s.F_out, s.H, s.W}, x.options().memory_format(temporal_format(s)));
}

// Frames [f0, f0 + n) of a (B, C, F, H, W) tensor as (B, C, n * H * W); view() (not reshape) so a
// layout that would need a copy fails loudly instead of silently writing into a temporary.
inline at::Tensor frames(const at::Tensor& t, int64_t f0, int64_t n) {
  return t.narrow(2, f0, n).view({t.size(0), t.size(1), n * t.size(3) * t.size(4)});
}

// (C_out, C_in, k, 1, 1) -> (C_out, k, C_in) contiguous: the fused GEMMs' (C_out, k * C_in) matrix, and
// tap t's (C_out, C_in) matrix as the row slice [:, t] (row stride k * C_in, which cuBLAS takes as is).
// The one copy a call makes of its weight; on CUDA a kernel of csrc/cuda/temporal_conv.cu does it (ATen's
// permuted copy ran at ~1/4 of the copy rate: 0.5 ms an SVD step). Defined in csrc/cpu/temporal_conv.cpp.
at::Tensor tap_rows(const at::Tensor& weight);

// The same reorder as an ATen copy: the CPU path, and CUDA's for what its kernel does not take.
inline at::Tensor tap_rows_aten(const at::Tensor& weight) {
  return weight.select(4, 0).select(3, 0).transpose(1, 2).contiguous();
}

// Tap t's (C_out, C_in) matrix of tap_rows().
inline at::Tensor tap(const at::Tensor& rows, int64_t t) { return rows.select(1, t); }

// out (n, C_out, N) = w (C_out, K) @ x (n, K, N) [+ bias per row]. The bias goes in as baddbmm's
// beta = 1 input (ATen writes it into out, the GEMM accumulates onto it): no separate pass.
inline void batched_gemm(at::Tensor out, const at::Tensor& w, const at::Tensor& x,
                         const std::optional<at::Tensor>& bias_row) {
  const at::Tensor wb = w.expand({out.size(0), w.size(0), w.size(1)});
  if (bias_row.has_value())
    at::baddbmm_out(out, bias_row->expand(out.sizes()), wb, x);
  else
    at::bmm_out(out, wb, x);
}

// The bias in x's dtype as a (1, C_out, 1) row for batched_gemm, or none.
inline std::optional<at::Tensor> temporal_bias_row(const std::optional<at::Tensor>& bias,
                                                   const at::Tensor& x, const TemporalConvShape& s) {
  if (!bias.has_value()) return std::nullopt;
  return bias->to(x.scalar_type()).view({1, s.C_out, 1});
}

// Whether a contiguous x should be copied to frames-major for the fused GEMMs. Bytes moved per pixel
// and frame, in units of the element size: fused = copy (read + write x) + read x + write out; per tap
// = k reads of x + one write and k - 1 read-modify-writes of out. The fused GEMM is also the better
// shape (K = k * C_in instead of C_in), which this count does not credit.
inline bool fused_pays_off(const TemporalConvShape& s) {
  return s.k >= 2 && 3 * s.C_in + s.C_out < s.k * s.C_in + (2 * s.k - 1) * s.C_out;
}

// xf: (B, F, C_in, H, W) contiguous; of: the output as (B, F_out, C_out, H, W), any strides with
// H, W mergeable and W of stride 1 (frames-major or NCDHW memory).
inline void temporal_conv_fused(const at::Tensor& xf, const at::Tensor& of, const at::Tensor& weight,
                                const std::optional<at::Tensor>& bias, const TemporalConvShape& s) {
  const int64_t HW = s.H * s.W, C = s.C_in, frame = C * HW, sB = s.F * frame;
  const at::Tensor w = tap_rows(weight).view({s.C_out, s.k * C});
  const at::Tensor o4 = of.view({s.B, s.F_out, s.C_out, HW});
  const std::optional<at::Tensor> bias_row = temporal_bias_row(bias, xf, s);
  // Input frames [f, f + nt) of nb samples (or nb consecutive windows), as (nb, nt * C_in, H*W).
  auto window = [&](int64_t b, int64_t f, int64_t nb, int64_t batch_stride, int64_t nt) {
    return xf.as_strided({nb, nt * C, HW}, {batch_stride, HW, 1},
                         xf.storage_offset() + b * sB + f * frame);
  };
  // Interior frames [lo, hi): every tap in range.
  const int64_t lo = std::min(s.padding, s.F_out);
  const int64_t hi = std::max(lo, std::min(s.F_out, s.F + s.padding - s.k + 1));
  const int64_t n_int = hi - lo;
  if (n_int > 0) {
    if (n_int >= s.B) {  // batch over frames, one GEMM per sample
      for (int64_t b = 0; b < s.B; ++b)
        batched_gemm(o4.select(0, b).narrow(0, lo, n_int), w, window(b, lo - s.padding, n_int, frame, s.k),
                     bias_row);
    } else {  // batch over samples, one GEMM per frame
      for (int64_t o = lo; o < hi; ++o)
        batched_gemm(o4.select(1, o), w, window(0, o - s.padding, s.B, sB, s.k), bias_row);
    }
  }
  for (int64_t o = 0; o < s.F_out; ++o) {
    if (o >= lo && o < hi) continue;
    const int64_t t0 = std::max<int64_t>(0, s.padding - o);
    const int64_t t1 = std::min<int64_t>(s.k, s.F + s.padding - o);
    at::Tensor out_o = o4.select(1, o);
    if (t1 > t0) {
      batched_gemm(out_o, w.narrow(1, t0 * C, (t1 - t0) * C), window(0, o + t0 - s.padding, s.B, sB, t1 - t0),
                   bias_row);
    } else if (bias_row.has_value()) {  // all taps in the padding: the bias alone
      out_o.copy_(bias_row->expand(out_o.sizes()));
    } else {
      out_o.zero_();
    }
  }
}

// x and out in the same layout (NCDHW or channels_last_3d).
inline void temporal_conv_taps(const at::Tensor& x, const at::Tensor& out, const at::Tensor& weight,
                               const std::optional<at::Tensor>& bias, const TemporalConvShape& s) {
  const at::Tensor w = tap_rows(weight);
  const std::optional<at::Tensor> bias_row = temporal_bias_row(bias, x, s);
  // The first GEMM writes (bias as its beta input) when one tap covers every output frame, the
  // centre tap of a "same" convolution; otherwise out starts as the bias (or zeros).
  int64_t first = -1;
  for (int64_t t = 0; t < s.k && first < 0; ++t) {
    auto [o0, o1] = temporal_tap_range(s, t);
    if (o0 == 0 && o1 == s.F_out) first = t;
  }
  if (first < 0) {
    if (bias_row.has_value())
      out.copy_(bias_row->view({1, s.C_out, 1, 1, 1}).expand(out.sizes()));
    else
      out.zero_();
  }
  for (int64_t i = -1; i < s.k; ++i) {
    const int64_t t = i < 0 ? first : i;
    if (t < 0 || (i >= 0 && t == first)) continue;
    auto [o0, o1] = temporal_tap_range(s, t);
    if (o1 == o0) continue;
    at::Tensor os = frames(out, o0, o1 - o0);
    at::Tensor xs = frames(x, o0 + t - s.padding, o1 - o0);
    if (t == first)
      batched_gemm(os, tap(w, t), xs, bias_row);
    else
      os.baddbmm_(tap(w, t).expand({s.B, s.C_out, s.C_in}), xs);
  }
}

// out: temporal_output(x_in, s), checked by the caller (the CUDA op tries its Hopper kernel first).
inline void temporal_conv_gemms(const at::Tensor& x_in, const at::Tensor& weight,
                                const std::optional<at::Tensor>& bias, const TemporalConvShape& s, at::Tensor& out) {
  if (s.frames_major) {
    temporal_conv_fused(x_in.transpose(1, 2), out.transpose(1, 2), weight, bias, s);
  } else if (!s.channels_last && fused_pays_off(s)) {
    // One transposing copy of x buys the K = k * C_in GEMMs; out stays NCDHW (its per-frame
    // (C_out, H*W) matrices have row stride F_out * H * W).
    temporal_conv_fused(x_in.transpose(1, 2).contiguous(), out.transpose(1, 2), weight, bias, s);
  } else {
    temporal_conv_taps(x_in.contiguous(temporal_format(s)), out, weight, bias, s);
  }
}

inline at::Tensor temporal_conv_forward(const at::Tensor& x_in, const at::Tensor& weight,
                                        const std::optional<at::Tensor>& bias, int64_t padding) {
  TemporalConvShape s = check_temporal_conv(x_in, weight, padding);
  check_vector(bias, s.C_out, x_in, kTemporalConvOp, "bias");
  at::Tensor out = temporal_output(x_in, s);
  if (out.numel() > 0) temporal_conv_gemms(x_in, weight, bias, s, out);
  return out;
}

inline std::tuple<at::Tensor, at::Tensor, at::Tensor> temporal_conv_backward(const at::Tensor& grad_out,
                                                                          const at::Tensor& x_in,
                                                                          const at::Tensor& weight,
                                                                          int64_t padding) {
  TemporalConvShape s = check_temporal_conv(x_in, weight, padding);
  check_conv_grad_out(grad_out, x_in, {s.B, s.C_out, s.F_out, s.H, s.W}, kTemporalConvOp);
  const auto fmt = temporal_format(s);
  // Weight and bias gradients accumulate over samples in float (double for float64).
  const auto acc = compute_dtype(x_in);
  at::Tensor x = x_in.contiguous(fmt);
  at::Tensor g = grad_out.contiguous(fmt);
  // at::zeros has no memory_format argument (it would drop the one in the options).
  at::Tensor dx = at::empty(x.sizes(), x.options().memory_format(fmt)).zero_();
  at::Tensor dw = at::zeros({s.k, s.C_out, s.C_in}, x.options().dtype(acc));
  at::Tensor dbias = at::zeros({s.C_out}, x.options().dtype(acc));
  if (x.numel() > 0) {
    at::Tensor w = tap_rows(weight);
    const bool acc_in_place = x.scalar_type() == acc;
    for (int64_t t = 0; t < s.k; ++t) {
      auto [o0, o1] = temporal_tap_range(s, t);
      if (o1 == o0) continue;
      at::Tensor xs = frames(x, o0 + t - s.padding, o1 - o0);
      at::Tensor dxs = frames(dx, o0 + t - s.padding, o1 - o0);
      at::Tensor gs = frames(g, o0, o1 - o0);
      at::Tensor wt = tap(w, t).t();
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

}  // namespace vd
