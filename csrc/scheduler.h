// Shared by the CPU and CUDA scheduler_step kernels: validation, the problem's shape and the
// per-element math. Coefficients are read by the kernels themselves (never copied to the host),
// so a denoising loop that keeps them on the device has no host sync.
#pragma once
#include <c10/macros/Macros.h>

#include <cmath>

#include "checks.h"
#include "layout.h"

namespace vd {

constexpr const char* kSchedulerStepOp = "vd::scheduler_step";
constexpr int64_t kNumStepCoeffs = 6;  // [c_s, c_m, d_s, d_m, d_x0, d_p]

struct StepShape {
  int64_t N;      // sample.size(0)
  int64_t inner;  // elements per batch entry
  bool per_batch_coeffs, per_batch_weight, has_prev_x0, has_blend, has_clip;
  double clip;
};

inline void check_like_sample(const at::Tensor& sample, const std::optional<at::Tensor>& t,
                              const char* name) {
  if (!t.has_value()) return;
  check_same_device(sample, *t, kSchedulerStepOp, "sample", name);
  check_same_dtype(sample, *t, kSchedulerStepOp, "sample", name);
  TORCH_CHECK(t->sizes() == sample.sizes(), kSchedulerStepOp, ": ", name,
              " must have sample's shape ", sample.sizes(), ", got ", t->sizes());
}

inline StepShape check_scheduler_step(const at::Tensor& model_output, const at::Tensor& sample,
                                      const at::Tensor& coeffs,
                                      const std::optional<at::Tensor>& prev_x0,
                                      const std::optional<at::Tensor>& prev_frame,
                                      const std::optional<at::Tensor>& blend_weight,
                                      std::optional<double> clip_x0) {
  const char* op = kSchedulerStepOp;
  check_float_dtype(sample, op, "sample");
  TORCH_CHECK(sample.dim() >= 1, op, ": sample must have at least 1 dim (N, ...), got a 0-D tensor");
  check_like_sample(sample, model_output, "model_output");
  check_like_sample(sample, prev_x0, "prev_x0");
  check_like_sample(sample, prev_frame, "prev_frame");
  const int64_t N = sample.size(0);

  check_same_device(sample, coeffs, op, "sample", "coeffs");
  check_float_dtype(coeffs, op, "coeffs");
  const bool coeffs_ok = (coeffs.dim() == 1 && coeffs.size(0) == kNumStepCoeffs) ||
                         (coeffs.dim() == 2 && coeffs.size(0) == N && coeffs.size(1) == kNumStepCoeffs);
  TORCH_CHECK(coeffs_ok, op, ": coeffs must have shape (6,) or (N, 6) with N = sample.size(0) = ", N,
              ", got ", coeffs.sizes());

  // A lone prev_frame or blend_weight is a caller mistake: ignoring it would silently skip the blend.
  TORCH_CHECK(prev_frame.has_value() == blend_weight.has_value(), op,
              ": prev_frame and blend_weight must be given together (got only ",
              prev_frame.has_value() ? "prev_frame" : "blend_weight", ")");
  bool per_batch_weight = false;
  if (blend_weight.has_value()) {
    check_same_device(sample, *blend_weight, op, "sample", "blend_weight");
    check_float_dtype(*blend_weight, op, "blend_weight");
    per_batch_weight = blend_weight->dim() == 1;
    TORCH_CHECK(blend_weight->dim() == 0 || (per_batch_weight && blend_weight->size(0) == N), op,
                ": blend_weight must be 0-D or have shape (N,) with N = sample.size(0) = ", N, ", got ",
                blend_weight->sizes());
  }
  if (clip_x0.has_value())
    TORCH_CHECK(*clip_x0 >= 0, op, ": clip_x0 must be >= 0 (x0 is clamped to [-clip_x0, clip_x0]), got ",
                *clip_x0);

  StepShape s;
  s.N = N;
  s.inner = N == 0 ? 0 : sample.numel() / N;
  s.per_batch_coeffs = coeffs.dim() == 2;
  s.per_batch_weight = per_batch_weight;
  s.has_prev_x0 = prev_x0.has_value();
  s.has_blend = blend_weight.has_value();
  s.has_clip = clip_x0.has_value();
  s.clip = clip_x0.value_or(0.0);
  return s;
}

// The op's tensors in sample's layout (the kernels index them flat) and its two outputs.
struct StepTensors {
  at::Tensor x, m, px, pf;  // sample, model_output, prev_x0 and prev_frame (undefined if absent)
  at::Tensor prev_out, x0_out;
};

inline StepTensors step_tensors(const at::Tensor& model_output, const at::Tensor& sample,
                                const std::optional<at::Tensor>& prev_x0,
                                const std::optional<at::Tensor>& prev_frame, const StepShape& s) {
  const auto fmt = layout_memory_format(sample);
  StepTensors t;
  t.x = sample.contiguous(fmt);
  t.m = model_output.contiguous(fmt);
  if (s.has_prev_x0) t.px = prev_x0->contiguous(fmt);
  if (s.has_blend) t.pf = prev_frame->contiguous(fmt);
  t.prev_out = at::empty_like(t.x);
  t.x0_out = at::empty_like(t.x);
  return t;
}

// One element of the step, in the compute type T. NaN in x0 stays NaN through the clamp, as in torch.clamp.
template <typename T>
struct StepCoeffs {
  T c_s, c_m, d_s, d_m, d_x0, d_p;
};

template <typename T>
C10_HOST_DEVICE inline void step_element(T s, T m, T px, T pf, T w, const StepCoeffs<T>& c,
                                         bool has_prev_x0, bool has_blend, bool has_clip, T clip,
                                         T& prev, T& x0) {
  x0 = c.c_s * s + c.c_m * m;
  if (has_clip) x0 = x0 < -clip ? -clip : (x0 > clip ? clip : x0);
  prev = c.d_s * s + c.d_m * m + c.d_x0 * x0;
  if (has_prev_x0) prev += c.d_p * px;
  if (has_blend) prev = w * prev + (T(1) - w) * pf;
}

}  // namespace vd
