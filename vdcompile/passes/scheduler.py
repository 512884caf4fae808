"""The elementwise update of diffusers' EulerDiscreteScheduler.step => vd::scheduler_step.

Compiling a denoising step that calls scheduler.step breaks the graph at the scheduler's
data-dependent branches (s_churn bounds on sigma, the step index lookup), so the update lands in a
graph of its own:
    x0 = <prediction-type formula>;  derivative = (sample - x0) / sigma_hat
    prev = sample + derivative * (sigma_next - sigma_hat)
It is rewritten with x0 folded into the op (epsilon, v_prediction) or passed as the op's model
output (any other x0). The coefficients are built in the graph from the sigma tensors, so nothing
is read back to the host and a new step recompiles nothing.

DDIM and DPM-Solver++ steps are split across several graphs by their branches on tensor values
(`prev_timestep >= 0`, the solver-order decision): no graph holds their whole update. Their fused
path is vdcompile.schedulers.fused_step, a drop-in for scheduler.step.
"""
from __future__ import annotations

import torch

from vdcompile.passes._common import Match, Rewrite, kernel_missing

FAMILY = "scheduler_step"
_OP = "scheduler_step"


# diffusers EulerDiscreteScheduler.step, prediction_type="epsilon" (SD-style video UNets).
def _pattern_epsilon(sample, model_output, sigma_hat, sigma_next):
    x0 = sample - sigma_hat * model_output
    derivative = (sample - x0) / sigma_hat
    dt = sigma_next - sigma_hat
    return sample + derivative * dt, x0


def _replacement_epsilon(sample, model_output, sigma_hat, sigma_next):
    ratio = (sigma_next - sigma_hat) / sigma_hat
    one, zero = torch.ones_like(sigma_hat), torch.zeros_like(sigma_hat)
    out = torch.ops.vd.scheduler_step.default(
        model_output, sample, torch.stack([one, -sigma_hat, 1 + ratio, zero, -ratio, zero]))
    return out[0], out[1]


# diffusers EulerDiscreteScheduler.step, prediction_type="v_prediction" (Stable Video Diffusion).
def _pattern_v(sample, model_output, sigma, sigma_hat, sigma_next):
    x0 = model_output * (-sigma / (sigma**2 + 1) ** 0.5) + sample / (sigma**2 + 1)
    derivative = (sample - x0) / sigma_hat
    dt = sigma_next - sigma_hat
    return sample + derivative * dt, x0


def _replacement_v(sample, model_output, sigma, sigma_hat, sigma_next):
    ratio = (sigma_next - sigma_hat) / sigma_hat
    zero = torch.zeros_like(sigma_hat)
    c_s = 1 / (sigma**2 + 1)
    c_m = -sigma / (sigma**2 + 1) ** 0.5
    out = torch.ops.vd.scheduler_step.default(
        model_output, sample, torch.stack([c_s, c_m, 1 + ratio, zero, -ratio, zero]))
    return out[0], out[1]


# Any other x0 ("sample" prediction, or a formula not matched above): the update alone, with x0 as
# the op's model output (c_s = 0, c_m = 1: x0 passes through unchanged).
def _pattern_update(sample, x0, sigma_hat, sigma_next):
    derivative = (sample - x0) / sigma_hat
    dt = sigma_next - sigma_hat
    return sample + derivative * dt


def _replacement_update(sample, x0, sigma_hat, sigma_next):
    ratio = (sigma_next - sigma_hat) / sigma_hat
    one, zero = torch.ones_like(sigma_hat), torch.zeros_like(sigma_hat)
    return torch.ops.vd.scheduler_step.default(x0, sample, torch.stack([zero, one, 1 + ratio, zero, -ratio, zero]))[0]


def _check(names):
    def check(m: Match):
        sample, other = m.val("sample"), m.val(names[0])
        scalars = [m.val(n) for n in names[1:]]
        if not all(isinstance(t, torch.Tensor) for t in scalars):
            # A Python float would be burned into the graph: a recompile per step.
            return "sigma is not a tensor"
        if not all(t.dim() == 0 and t.dtype.is_floating_point for t in scalars):
            return "sigma is not a 0-d float tensor"
        if not isinstance(sample, torch.Tensor) or not isinstance(other, torch.Tensor):
            return "sample or model output is not a tensor"
        if sample.shape != other.shape or sample.dim() < 1:
            return "sample and model output differ in shape"
        if any(t.device != sample.device for t in scalars):
            return "sigma on another device"
        if any(t.dtype != scalars[0].dtype for t in scalars):
            return "sigmas of mixed dtypes"
        return kernel_missing(_OP, sample, other)
    return check


REWRITES = [
    Rewrite(FAMILY, "euler_epsilon", _pattern_epsilon, _replacement_epsilon,
            _check(("model_output", "sigma_hat", "sigma_next"))),
    Rewrite(FAMILY, "euler_v_prediction", _pattern_v, _replacement_v,
            _check(("model_output", "sigma", "sigma_hat", "sigma_next"))),
    Rewrite(FAMILY, "euler_update", _pattern_update, _replacement_update, _check(("x0", "sigma_hat", "sigma_next"))),
]
