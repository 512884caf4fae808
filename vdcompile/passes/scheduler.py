"""The elementwise updates of diffusers' sampler steps => vd::scheduler_step.

Compiling a denoising step that calls ``scheduler.step`` breaks the graph wherever the scheduler
branches on a tensor value; what lands in one graph, and is rewritten here (diffusers 0.42.1):

* EulerDiscreteScheduler: the update sits in a graph of its own (after the s_churn and step-index
  branches): ``x0 = <prediction-type formula>; prev = sample + (sample - x0) / sigma_hat * dt``.
  Rewritten with x0 folded into the op (epsilon, v_prediction) or passed as its model output.
* DDIMScheduler (eta = 0): with an int timestep the whole step is one graph; x0 (epsilon or
  v_prediction, optionally clipped), pred_epsilon and ``prev = sqrt(a_prev) x0 + sqrt(1 - a_prev -
  std^2) pred_epsilon`` become one op. With a tensor timestep (``for t in scheduler.timesteps``) the
  step splits at ``prev_timestep >= 0`` and dynamo specialises on the timestep's value (a recompile
  per step of the graphs before the split, from diffusers' ``alphas_cumprod[timestep]``); the final
  update graph is then rewritten on its own (x0 and pred_epsilon as inputs), the x0 conversion is
  left to the inner compiler.
* DPMSolverMultistepScheduler (dpmsolver++): the step is one graph once the step index is set:
  x0 (epsilon or v_prediction) and the first-order update, or the second-order (midpoint or heun)
  update with the previous x0 as the op's ``prev_x0``, become one op; with another prediction type
  (or an upcast sample) the update alone is rewritten with x0 as an input.

Coefficients are built in the graph from the scalar tensors the scheduler computed, so nothing is
read back to the host and a new step recompiles nothing; a Python float coefficient (burned into
the graph) is refused.
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


# ---------------------------------------------------------------------------------------------------
# DDIMScheduler.step, eta = 0 (std_dev_t = eta * sqrt(variance) is a tensor in the graph, 0 here; any
# other eta matches too: the noise it adds afterwards is outside the pattern)
# ---------------------------------------------------------------------------------------------------


def _ddim_prev(x0, eps, alpha_prev, std):
    # "direction pointing to x_t" and x_{t-1}, formula (12) of the DDIM paper, as diffusers writes it
    return alpha_prev ** 0.5 * x0 + (1 - alpha_prev - std ** 2) ** 0.5 * eps


def _ddim(pred: str, clip: bool):
    """Pattern and replacement of one DDIM prediction type, with or without clip_sample."""

    def pattern(sample, model_output, alpha, beta, alpha_prev, std, lo, hi):
        if pred == "epsilon":
            x0 = (sample - beta ** 0.5 * model_output) / alpha ** 0.5
            eps = model_output
        else:  # v_prediction
            x0 = alpha ** 0.5 * sample - beta ** 0.5 * model_output
            eps = alpha ** 0.5 * model_output + beta ** 0.5 * sample
        if clip:
            x0 = x0.clamp(lo, hi)
        return _ddim_prev(x0, eps, alpha_prev, std), x0

    def replacement(sample, model_output, alpha, beta, alpha_prev, std, clip_x0):
        sa, sb = alpha ** 0.5, beta ** 0.5
        zero, one = torch.zeros_like(sa), torch.ones_like(sa)
        # x0 = c_s sample + c_m model_output; pred_epsilon = e_s sample + e_m model_output
        if pred == "epsilon":
            c_s, c_m, e_s, e_m = 1 / sa, -sb / sa, zero, one
        else:
            c_s, c_m, e_s, e_m = sa, -sb, sb, sa
        dir_ = (1 - alpha_prev - std ** 2) ** 0.5
        coeffs = torch.stack([c_s, c_m, dir_ * e_s, dir_ * e_m, alpha_prev ** 0.5, zero])
        out = torch.ops.vd.scheduler_step.default(model_output, sample, coeffs, None, None, None, clip_x0)
        return out[0], out[1]

    base = _check(("sample", "model_output"), ("alpha", "beta", "alpha_prev", "std"))

    def check(m: Match):
        m.extra["clip_x0"] = None
        if clip:
            lo, hi = m["lo"], m["hi"]
            if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (lo, hi)):
                return "clip range is not a constant"
            if lo != -hi or hi < 0:
                return "clip range is not symmetric (the op clamps to [-r, r])"
            m.extra["clip_x0"] = float(hi)
        return base(m)

    name = f"ddim_{pred}{'_clip' if clip else ''}"
    return Rewrite(FAMILY, name, pattern, replacement, check)


# The update alone (x0 and pred_epsilon computed in another graph, or by a formula not matched
# above): x0 is the op's sample with c_s = 1, pred_epsilon its model output.
def _pattern_ddim_update(x0, eps, alpha_prev, std):
    return _ddim_prev(x0, eps, alpha_prev, std)


def _replacement_ddim_update(x0, eps, alpha_prev, std):
    a = alpha_prev ** 0.5
    zero, one = torch.zeros_like(a), torch.ones_like(a)
    coeffs = torch.stack([one, zero, a, (1 - alpha_prev - std ** 2) ** 0.5, zero, zero])
    return torch.ops.vd.scheduler_step.default(eps, x0, coeffs)[0]


# ---------------------------------------------------------------------------------------------------
# DPMSolverMultistepScheduler.step, algorithm_type="dpmsolver++"
# ---------------------------------------------------------------------------------------------------


def _dpm(pred: str | None, order: str):
    """Pattern and replacement of one (prediction type, solver order) pair. ``pred`` None: x0 is
    an input (the op's model output, passed through with c_s = 0, c_m = 1)."""

    def pattern(sample, model_output, alpha_0, sigma_0, dtype, sigma_t, sigma_s, alpha_t, h, r0, m1):
        # convert_model_output (data prediction), then the update on the float32 sample
        if pred is None:
            x0, s = model_output, sample
        else:
            if pred == "epsilon":
                x0 = (sample - sigma_0 * model_output) / alpha_0
            else:  # v_prediction
                x0 = alpha_0 * sample - sigma_0 * model_output
            s = sample.to(dtype)
        # dpm_solver_first_order_update
        prev = (sigma_t / sigma_s) * s - (alpha_t * (torch.exp(-h) - 1.0)) * x0
        if order != "first":  # multistep_dpm_solver_second_order_update: D0 = x0, D1 = (x0 - m1) / r0
            d1 = (1.0 / r0) * (x0 - m1)
            if order == "midpoint":
                prev = prev - 0.5 * (alpha_t * (torch.exp(-h) - 1.0)) * d1
            else:  # heun
                prev = prev - (alpha_t * ((torch.exp(-h) - 1.0) / h + 1.0)) * d1
        return prev if pred is None else (prev, x0)

    def replacement(sample, model_output, alpha_0, sigma_0, sigma_t, sigma_s, alpha_t, h, r0, m1):
        a = alpha_t * (torch.exp(-h) - 1.0)
        zero, one = torch.zeros_like(a), torch.ones_like(a)
        if pred == "epsilon":
            c_s, c_m = 1 / alpha_0, -sigma_0 / alpha_0
        elif pred == "v_prediction":
            c_s, c_m = alpha_0, -sigma_0
        else:
            c_s, c_m = zero, one
        # prev = d_s sample - a x0 - k (x0 - m1): the D1 term goes to the op's prev_x0 (= m1)
        if order == "first":
            k = zero
        elif order == "midpoint":
            k = 0.5 * a / r0
        else:
            k = alpha_t * ((torch.exp(-h) - 1.0) / h + 1.0) / r0
        coeffs = torch.stack([c_s, c_m, sigma_t / sigma_s, zero, -(a + k), k])
        out = torch.ops.vd.scheduler_step.default(model_output, sample, coeffs, m1)
        return out[0] if pred is None else (out[0], out[1])

    check = _check_upcast(("sample", "model_output", "m1"), ("alpha_0", "sigma_0", "sigma_t", "sigma_s", "alpha_t", "h", "r0"))
    return Rewrite(FAMILY, f"dpmsolver++_{pred or 'update'}_{order}", pattern, replacement, check)


def _check(tensors, scalars):
    """Accepts when the bound tensors (the first is the op's sample) agree in shape, dtype and device
    and every bound scalar is a 0-d float tensor there. Names a variant does not bind are passed to
    its replacement as None."""
    def check(m: Match):
        for name in tensors + scalars:
            if name not in m.bindings:
                m.extra[name] = None
        ts = [m.val(n) for n in tensors if n in m.bindings]
        cs = [m.val(n) for n in scalars if n in m.bindings]
        if not all(isinstance(t, torch.Tensor) for t in cs):
            # A Python float would be burned into the graph: a recompile per step.
            return "a coefficient (sigma, alpha) is not a tensor"
        if not all(t.dim() == 0 and t.dtype.is_floating_point for t in cs):
            return "a coefficient (sigma, alpha) is not a 0-d float tensor"
        if not all(isinstance(t, torch.Tensor) for t in ts):
            return "sample or model output is not a tensor"
        if any(t.shape != ts[0].shape for t in ts) or ts[0].dim() < 1:
            return "sample and model output differ in shape"
        if any(t.device != ts[0].device for t in cs):
            return "a coefficient on another device"
        if any(t.dtype != cs[0].dtype for t in cs):
            return "coefficients of mixed dtypes"
        return kernel_missing(_OP, *ts)
    return check


def _check_upcast(tensors, scalars):
    """_check, and the pattern's ``sample.to(dtype)`` must be a no-op (the op computes in float32
    anyway, but its inputs must share one dtype)."""
    base = _check(tensors, scalars)

    def check(m: Match):
        if "dtype" in m.bindings and m["dtype"] != m.val("sample").dtype:
            return "sample is upcast for the update (mixed precision): x0 and the update differ in dtype"
        return base(m)
    return check


REWRITES = [
    Rewrite(FAMILY, "euler_epsilon", _pattern_epsilon, _replacement_epsilon,
            _check(("sample", "model_output"), ("sigma_hat", "sigma_next"))),
    Rewrite(FAMILY, "euler_v_prediction", _pattern_v, _replacement_v,
            _check(("sample", "model_output"), ("sigma", "sigma_hat", "sigma_next"))),
    Rewrite(FAMILY, "euler_update", _pattern_update, _replacement_update, _check(("sample", "x0"), ("sigma_hat", "sigma_next"))),
    # Whole steps before the update alone, which matches at the same root.
    *(_ddim(pred, clip) for pred in ("epsilon", "v_prediction") for clip in (False, True)),
    Rewrite(FAMILY, "ddim_update", _pattern_ddim_update, _replacement_ddim_update,
            _check(("x0", "eps"), ("alpha_prev", "std"))),
    *(_dpm(pred, order) for order in ("first", "midpoint", "heun") for pred in ("epsilon", "v_prediction", None)),
]
