// CPU kernel for vd::scheduler_step: one fused elementwise pass writing prev_sample and x0.
// Inputs are read in sample's layout (csrc/layout.h); the batch dim is outermost in every layout
// kept, so element i belongs to batch entry i / inner.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <vector>

#include "../scheduler.h"

namespace vd {
namespace {

// Contiguous float64 copy of a small per-step tensor (coeffs, blend_weight) for host-side reads.
at::Tensor host_values(const at::Tensor& t) { return t.to(at::kDouble).contiguous(); }

template <typename scalar_t, bool kPrevX0, bool kBlend, bool kClip>
void step_range(const StepShape& s, const scalar_t* m, const scalar_t* x, const scalar_t* px,
                const scalar_t* pf, scalar_t* prev_out, scalar_t* x0_out,
                const std::vector<StepCoeffs<at::opmath_type<scalar_t>>>& coeffs,
                const std::vector<at::opmath_type<scalar_t>>& weights, int64_t begin, int64_t end) {
  using opmath_t = at::opmath_type<scalar_t>;
  const opmath_t clip = static_cast<opmath_t>(s.clip);
  int64_t i = begin;
  while (i < end) {
    // One batch entry's slice of [begin, end): its coefficients are loop invariants.
    const int64_t n = i / s.inner;
    const int64_t stop = std::min(end, (n + 1) * s.inner);
    const StepCoeffs<opmath_t> c = coeffs[s.per_batch_coeffs ? n : 0];
    const opmath_t w = kBlend ? weights[s.per_batch_weight ? n : 0] : opmath_t(1);
    for (; i < stop; ++i) {
      opmath_t prev, x0;
      step_element<opmath_t>(static_cast<opmath_t>(x[i]), static_cast<opmath_t>(m[i]),
                             kPrevX0 ? static_cast<opmath_t>(px[i]) : opmath_t(0),
                             kBlend ? static_cast<opmath_t>(pf[i]) : opmath_t(0), w, c, kPrevX0,
                             kBlend, kClip, clip, prev, x0);
      prev_out[i] = static_cast<scalar_t>(prev);
      x0_out[i] = static_cast<scalar_t>(x0);
    }
  }
}

std::tuple<at::Tensor, at::Tensor> scheduler_step_cpu(
    const at::Tensor& model_output, const at::Tensor& sample, const at::Tensor& coeffs,
    const std::optional<at::Tensor>& prev_x0, const std::optional<at::Tensor>& prev_frame,
    const std::optional<at::Tensor>& blend_weight, std::optional<double> clip_x0) {
  const StepShape s =
      check_scheduler_step(model_output, sample, coeffs, prev_x0, prev_frame, blend_weight, clip_x0);
  const StepTensors t = step_tensors(model_output, sample, prev_x0, prev_frame, s);
  const at::Tensor &x = t.x, &m = t.m, &px = t.px, &pf = t.pf, &prev_out = t.prev_out, &x0_out = t.x0_out;
  if (x.numel() == 0) return {prev_out, x0_out};

  const at::Tensor cv = host_values(coeffs);
  const at::Tensor wv = s.has_blend ? host_values(*blend_weight) : at::Tensor();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "scheduler_step_cpu", [&] {
    using opmath_t = at::opmath_type<scalar_t>;
    const double* cp = cv.const_data_ptr<double>();
    std::vector<StepCoeffs<opmath_t>> cs(s.per_batch_coeffs ? s.N : 1);
    for (size_t n = 0; n < cs.size(); ++n) {
      const double* r = cp + n * kNumStepCoeffs;
      cs[n] = {static_cast<opmath_t>(r[0]), static_cast<opmath_t>(r[1]), static_cast<opmath_t>(r[2]),
               static_cast<opmath_t>(r[3]), static_cast<opmath_t>(r[4]), static_cast<opmath_t>(r[5])};
    }
    std::vector<opmath_t> ws;
    if (s.has_blend) {
      const double* wp = wv.const_data_ptr<double>();
      ws.assign(wp, wp + wv.numel());
    }
    const scalar_t* mp = m.const_data_ptr<scalar_t>();
    const scalar_t* xp = x.const_data_ptr<scalar_t>();
    const scalar_t* pxp = s.has_prev_x0 ? px.const_data_ptr<scalar_t>() : nullptr;
    const scalar_t* pfp = s.has_blend ? pf.const_data_ptr<scalar_t>() : nullptr;
    scalar_t* po = prev_out.mutable_data_ptr<scalar_t>();
    scalar_t* xo = x0_out.mutable_data_ptr<scalar_t>();
    // The optional terms become template flags so the inner loop carries no per-element branches.
    auto run = [&](auto px_flag, auto blend_flag, auto clip_flag) {
      at::parallel_for(0, x.numel(), at::internal::GRAIN_SIZE, [&](int64_t b, int64_t e) {
        step_range<scalar_t, decltype(px_flag)::value, decltype(blend_flag)::value,
                   decltype(clip_flag)::value>(s, mp, xp, pxp, pfp, po, xo, cs, ws, b, e);
      });
    };
    auto with_clip = [&](auto px_flag, auto blend_flag) {
      if (s.has_clip) run(px_flag, blend_flag, std::true_type{});
      else run(px_flag, blend_flag, std::false_type{});
    };
    auto with_blend = [&](auto px_flag) {
      if (s.has_blend) with_clip(px_flag, std::true_type{});
      else with_clip(px_flag, std::false_type{});
    };
    if (s.has_prev_x0) with_blend(std::true_type{});
    else with_blend(std::false_type{});
  });
  return {prev_out, x0_out};
}

}  // namespace

TORCH_LIBRARY_IMPL(vd, CPU, m) { m.impl("scheduler_step", &scheduler_step_cpu); }

}  // namespace vd
