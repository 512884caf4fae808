// CUDA kernel for vd::scheduler_step: one launch, one pass over the tensors. Memory-bound, so each
// thread moves 16-byte vectors when every pointer is aligned; the per-step coefficients are read
// from device memory by the kernel (no host sync, CUDA-graph capturable).
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "../scheduler.h"
#include "launch.h"

namespace vd {
namespace {

struct StepArgs {
  int64_t numel, inner;
  bool per_batch_coeffs, per_batch_weight, has_prev_x0, has_blend, has_clip;
};

template <typename scalar_t, typename acc_t, int VEC>
__global__ void scheduler_step_kernel(const scalar_t* __restrict__ m, const scalar_t* __restrict__ x,
                                      const scalar_t* __restrict__ px, const scalar_t* __restrict__ pf,
                                      const acc_t* __restrict__ coeffs, const acc_t* __restrict__ weights,
                                      scalar_t* __restrict__ prev_out, scalar_t* __restrict__ x0_out,
                                      StepArgs a, acc_t clip) {
  const int64_t n_vec = a.numel / VEC;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t vi = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; vi < n_vec; vi += stride) {
    const int64_t base = vi * VEC;
    // VEC divides inner (checked on the host), so a vector never straddles two batch entries.
    const int64_t n = base / a.inner;
    const acc_t* c = coeffs + (a.per_batch_coeffs ? n * kNumStepCoeffs : 0);
    const StepCoeffs<acc_t> cf{c[0], c[1], c[2], c[3], c[4], c[5]};
    const acc_t w = a.has_blend ? weights[a.per_batch_weight ? n : 0] : acc_t(1);
    Vec<scalar_t, VEC> vm = *reinterpret_cast<const Vec<scalar_t, VEC>*>(m + base);
    Vec<scalar_t, VEC> vx = *reinterpret_cast<const Vec<scalar_t, VEC>*>(x + base);
    Vec<scalar_t, VEC> vpx, vpf;
    if (a.has_prev_x0) vpx = *reinterpret_cast<const Vec<scalar_t, VEC>*>(px + base);
    if (a.has_blend) vpf = *reinterpret_cast<const Vec<scalar_t, VEC>*>(pf + base);
    Vec<scalar_t, VEC> vprev, vx0;
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
      acc_t prev, x0;
      step_element<acc_t>(static_cast<acc_t>(vx.v[j]), static_cast<acc_t>(vm.v[j]),
                          a.has_prev_x0 ? static_cast<acc_t>(vpx.v[j]) : acc_t(0),
                          a.has_blend ? static_cast<acc_t>(vpf.v[j]) : acc_t(0), w, cf, a.has_prev_x0,
                          a.has_blend, a.has_clip, clip, prev, x0);
      vprev.v[j] = static_cast<scalar_t>(prev);
      vx0.v[j] = static_cast<scalar_t>(x0);
    }
    *reinterpret_cast<Vec<scalar_t, VEC>*>(prev_out + base) = vprev;
    *reinterpret_cast<Vec<scalar_t, VEC>*>(x0_out + base) = vx0;
  }
}

std::tuple<at::Tensor, at::Tensor> scheduler_step_cuda(
    const at::Tensor& model_output, const at::Tensor& sample, const at::Tensor& coeffs,
    const std::optional<at::Tensor>& prev_x0, const std::optional<at::Tensor>& prev_frame,
    const std::optional<at::Tensor>& blend_weight, std::optional<double> clip_x0) {
  const StepShape s =
      check_scheduler_step(model_output, sample, coeffs, prev_x0, prev_frame, blend_weight, clip_x0);
  c10::cuda::CUDAGuard guard(sample.device());
  const StepTensors t = step_tensors(model_output, sample, prev_x0, prev_frame, s);
  const at::Tensor &x = t.x, &m = t.m, &px = t.px, &pf = t.pf, &prev_out = t.prev_out, &x0_out = t.x0_out;
  if (x.numel() == 0) return {prev_out, x0_out};
  auto stream = c10::cuda::getCurrentCUDAStream();
  const bool is_double = x.scalar_type() == at::kDouble;
  // Coefficients in the compute type, on the device: a device-side cast, no host read.
  const auto acc_dtype = is_double ? at::kDouble : at::kFloat;
  at::Tensor cv = coeffs.to(acc_dtype).contiguous();
  at::Tensor wv = s.has_blend ? blend_weight->to(acc_dtype).contiguous() : at::Tensor();
  StepArgs a{x.numel(), s.inner, s.per_batch_coeffs, s.per_batch_weight, s.has_prev_x0, s.has_blend, s.has_clip};

  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "scheduler_step_cuda", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    constexpr int kVec = 16 / sizeof(scalar_t);
    const scalar_t* mp = m.const_data_ptr<scalar_t>();
    const scalar_t* xp = x.const_data_ptr<scalar_t>();
    const scalar_t* pxp = s.has_prev_x0 ? px.const_data_ptr<scalar_t>() : nullptr;
    const scalar_t* pfp = s.has_blend ? pf.const_data_ptr<scalar_t>() : nullptr;
    scalar_t* po = prev_out.mutable_data_ptr<scalar_t>();
    scalar_t* xo = x0_out.mutable_data_ptr<scalar_t>();
    const acc_t* cp = cv.const_data_ptr<acc_t>();
    const acc_t* wp = s.has_blend ? wv.const_data_ptr<acc_t>() : nullptr;
    bool vec_ok = s.inner % kVec == 0 && aligned16(mp) && aligned16(xp) && aligned16(po) && aligned16(xo) &&
                  (!pxp || aligned16(pxp)) && (!pfp || aligned16(pfp));
    const int threads = 256;
    auto blocks_for = [&](int64_t n_items) {
      const int64_t max_blocks = 132 * 16;  // enough to fill any current GPU; the loop strides the rest
      return static_cast<unsigned>(std::max<int64_t>(1, std::min<int64_t>((n_items + threads - 1) / threads, max_blocks)));
    };
    const acc_t clip = static_cast<acc_t>(s.clip);
    if (vec_ok) {
      scheduler_step_kernel<scalar_t, acc_t, kVec><<<blocks_for(a.numel / kVec), threads, 0, stream>>>(
          mp, xp, pxp, pfp, cp, wp, po, xo, a, clip);
    } else {
      scheduler_step_kernel<scalar_t, acc_t, 1><<<blocks_for(a.numel), threads, 0, stream>>>(
          mp, xp, pxp, pfp, cp, wp, po, xo, a, clip);
    }
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return {prev_out, x0_out};
}

}  // namespace

TORCH_LIBRARY_IMPL(vd, CUDA, m) { m.impl("scheduler_step", &scheduler_step_cuda); }

}  // namespace vd
