"""diffusers schedulers on the fused vd::scheduler_step op.

:func:`step_coeffs` turns a diffusers scheduler's state into the op's ``coeffs`` tensor, on the
device and without a host sync (no ``.item()``, no Python floats read from tensors), so the step
index may be a device tensor inside a compiled loop. :func:`fused_step` is a drop-in for
``scheduler.step``: same outputs, same state updates.

Supported (the deterministic paths of diffusers 0.42.1, matched step by step):

* ``EulerDiscreteScheduler`` with ``s_churn == 0`` (any ``s_churn > 0`` counts as unsupported:
  whether churn applies depends on sigma's value, a host read); prediction types ``epsilon``,
  ``v_prediction``, ``sample``/``original_sample``; every sigma schedule (karras, exponential, beta,
  continuous timesteps as in Stable Video Diffusion), since the coefficients are read from
  ``scheduler.sigmas``.
* ``DDIMScheduler`` with ``eta == 0``: ``epsilon``, ``v_prediction``, ``sample``; ``clip_sample``
  becomes the op's ``clip_x0``; ``use_clipped_model_output`` is honoured.
* ``DPMSolverMultistepScheduler`` with ``algorithm_type="dpmsolver++"``, ``solver_order`` 1 or 2,
  ``solver_type`` ``midpoint`` or ``heun``: first order on the first step and on the final step
  where diffusers takes it (``lower_order_final``, ``euler_at_final``, ``final_sigmas_type="zero"``),
  second order with the previous converted model output as ``prev_x0`` otherwise; prediction types
  ``epsilon``, ``v_prediction``, ``sample``, ``flow_prediction``.

Anything else (other scheduler classes or subclasses, ``thresholding``, ``eta > 0``,
``s_churn > 0``, ``solver_order`` 3, the ``dpmsolver`` and SDE algorithm types, learned variance)
is unsupported: :func:`step_coeffs` raises :class:`UnsupportedSchedulerError`, and
:func:`fused_step` falls back to ``scheduler.step`` (still applying the optional temporal blend),
or raises the same error when called with ``fallback=False``.
"""
from __future__ import annotations

import dataclasses
import numbers

import torch
from diffusers import DDIMScheduler, DPMSolverMultistepScheduler, EulerDiscreteScheduler
from diffusers.schedulers.scheduling_ddim import DDIMSchedulerOutput
from diffusers.schedulers.scheduling_euler_discrete import EulerDiscreteSchedulerOutput
from diffusers.schedulers.scheduling_utils import SchedulerOutput

from vdcompile.ops._utils import compute_dtype
from vdcompile.ops.scheduler import scheduler_step

__all__ = ["UnsupportedSchedulerError", "unsupported_reason", "step_coeffs", "x0_clip", "fused_step"]


class UnsupportedSchedulerError(NotImplementedError):
    """The scheduler's configuration or step options have no fused equivalent."""


def unsupported_reason(scheduler) -> str | None:
    """Why ``scheduler``'s configuration cannot use the fused step, or None when it can.

    Only per-call options of ``step`` (``s_churn``, ``eta``) are left out: :func:`fused_step` checks those."""
    # Exact classes only: a subclass may override step() and the coefficients would silently diverge.
    kind = type(scheduler)
    cfg = getattr(scheduler, "config", None)
    if kind is EulerDiscreteScheduler:
        if cfg.prediction_type not in ("epsilon", "v_prediction", "sample", "original_sample"):
            return f"EulerDiscreteScheduler prediction_type {cfg.prediction_type!r} is not supported"
        return None
    if kind is DDIMScheduler:
        if cfg.thresholding:
            return "DDIMScheduler with thresholding (dynamic, data-dependent clipping) is not supported"
        if cfg.prediction_type not in ("epsilon", "v_prediction", "sample"):
            return f"DDIMScheduler prediction_type {cfg.prediction_type!r} is not supported"
        return None
    if kind is DPMSolverMultistepScheduler:
        if cfg.algorithm_type != "dpmsolver++":
            return f"DPMSolverMultistepScheduler algorithm_type {cfg.algorithm_type!r} is not supported (only 'dpmsolver++')"
        if cfg.solver_order not in (1, 2):
            return f"DPMSolverMultistepScheduler solver_order {cfg.solver_order} is not supported (only 1 and 2)"
        if cfg.solver_type not in ("midpoint", "heun"):
            return f"DPMSolverMultistepScheduler solver_type {cfg.solver_type!r} is not supported"
        if cfg.thresholding:
            return "DPMSolverMultistepScheduler with thresholding is not supported"
        if cfg.prediction_type not in ("epsilon", "v_prediction", "sample", "flow_prediction"):
            return f"DPMSolverMultistepScheduler prediction_type {cfg.prediction_type!r} is not supported"
        if cfg.prediction_type == "epsilon" and cfg.get("variance_type") in ("learned", "learned_range"):
            return "DPMSolverMultistepScheduler with a learned variance (model_output[:, :3]) is not supported"
        return None
    return f"{kind.__name__} is not supported (only EulerDiscreteScheduler, DDIMScheduler, DPMSolverMultistepScheduler)"


def x0_clip(scheduler) -> float | None:
    """The op's ``clip_x0`` for ``scheduler`` (DDIM's ``clip_sample_range`` when ``clip_sample``), else None."""
    if type(scheduler) is DDIMScheduler and scheduler.config.clip_sample and not scheduler.config.thresholding:
        return float(scheduler.config.clip_sample_range)
    return None


# ---------------------------------------------------------------------------------------------
# Coefficients. Every function takes an index that is a Python int or an integer tensor (0-D, or
# (N,) for per-batch coefficients) and only uses tensor ops on it, so nothing is read back to the host.
# Schedules are copied to the target device with non_blocking=True (a host-to-device copy that
# does not wait for the device), and the math is done in float64 before the cast to ``dtype``.


def _to_device(t: torch.Tensor, device, dtype=None) -> torch.Tensor:
    # Non-blocking only toward an accelerator: a non-blocking copy to the CPU could be read early.
    return t.to(device=device, dtype=dtype, non_blocking=torch.device(device).type != "cpu")


def _table(t: torch.Tensor, device) -> torch.Tensor:
    return _to_device(t, device, torch.float64)


def _take(table: torch.Tensor, i) -> torch.Tensor:
    """table[i] for an int, or a gather with an index tensor's shape (plain indexing by a 0-D tensor
    would convert it to a Python int, a read-back)."""
    return torch.take(table, i) if isinstance(i, torch.Tensor) else table[i]


def _stack(c_s, c_m, d_s, d_m, d_x0, d_p, dtype) -> torch.Tensor:
    parts = torch.broadcast_tensors(c_s, c_m, d_s, d_m, d_x0, d_p)
    return torch.stack(parts, dim=-1).to(dtype)


def _euler_coeffs(scheduler, i, device, dtype):
    sigmas = _table(scheduler.sigmas, device)
    sigma, sigma_next = _take(sigmas, i), _take(sigmas, i + 1)
    zero, one = torch.zeros_like(sigma), torch.ones_like(sigma)
    pred = scheduler.config.prediction_type
    if pred == "epsilon":
        c_s, c_m = one, -sigma
    elif pred == "v_prediction":
        c_s, c_m = 1 / (sigma**2 + 1), -sigma / (sigma**2 + 1).sqrt()
    else:  # "sample" / "original_sample": the model predicts x0
        c_s, c_m = zero, one
    # prev = sample + (sample - x0) / sigma * (sigma_next - sigma)
    ratio = (sigma_next - sigma) / sigma
    return _stack(c_s, c_m, 1 + ratio, zero, -ratio, zero, dtype)


def _ddim_coeffs(scheduler, t, device, dtype, use_clipped_model_output):
    cfg = scheduler.config
    alphas = _table(scheduler.alphas_cumprod, device)
    final = _table(torch.as_tensor(scheduler.final_alpha_cumprod), device)
    prev_t = t - cfg.num_train_timesteps // scheduler.num_inference_steps
    a_t = _take(alphas, t)
    if isinstance(prev_t, torch.Tensor):
        a_prev = torch.where(prev_t >= 0, _take(alphas, prev_t.clamp(min=0)), final)
    else:
        a_prev = alphas[prev_t] if prev_t >= 0 else final
    a_prev = a_prev.expand_as(a_t)
    sa, sb = a_t.sqrt(), (1 - a_t).sqrt()
    zero, one = torch.zeros_like(a_t), torch.ones_like(a_t)
    # x0 = c_s * sample + c_m * model_output; pred_epsilon = e_s * sample + e_m * model_output (+ e_x0 * x0)
    e_x0 = zero
    if cfg.prediction_type == "epsilon":
        c_s, c_m, e_s, e_m = 1 / sa, -sb / sa, zero, one
    elif cfg.prediction_type == "sample":
        # diffusers derives pred_epsilon from the unclipped x0, i.e. from model_output itself
        c_s, c_m, e_s, e_m = zero, one, 1 / sb, -sa / sb
    else:  # v_prediction
        c_s, c_m, e_s, e_m = sa, -sb, sb, sa
    if use_clipped_model_output:
        e_s, e_m, e_x0 = 1 / sb, zero, -sa / sb
    # eta == 0: prev = sqrt(a_prev) * x0 + sqrt(1 - a_prev) * pred_epsilon
    dir_ = (1 - a_prev).sqrt()
    return _stack(c_s, c_m, dir_ * e_s, dir_ * e_m, a_prev.sqrt() + dir_ * e_x0, zero, dtype)


def _dpm_alpha_sigma(scheduler, sigma):
    if scheduler.config.get("use_flow_sigmas", False):
        return 1 - sigma, sigma
    alpha = 1 / (sigma**2 + 1).sqrt()
    return alpha, sigma * alpha


def _dpm_final_first_order(scheduler) -> bool:
    """Whether diffusers takes a first-order step at the last step (its lower_order_final rule)."""
    cfg = scheduler.config
    return bool(cfg.get("euler_at_final", False) or (cfg.lower_order_final and len(scheduler.timesteps) < 15)
                or cfg.get("final_sigmas_type", "zero") == "zero")


def _dpm_first_order(scheduler, i, lower_order_nums):
    """diffusers' order decision (solver_order <= 2): a bool for int arguments, else a bool tensor."""
    if isinstance(lower_order_nums, torch.Tensor) and isinstance(i, torch.Tensor):
        lower_order_nums = lower_order_nums.to(i.device)
    last = i == len(scheduler.timesteps) - 1
    return (lower_order_nums < 1) | (last & _dpm_final_first_order(scheduler)) | (scheduler.config.solver_order == 1)


def _dpm_coeffs(scheduler, i, lower_order_nums, device, dtype):
    cfg = scheduler.config
    sigmas = _table(scheduler.sigmas, device)
    if isinstance(lower_order_nums, torch.Tensor):
        lower_order_nums = _to_device(lower_order_nums, device)
    first = _dpm_first_order(scheduler, i, lower_order_nums)
    prev_i = (i - 1) % len(sigmas)  # sigmas[-1] at i = 0, as diffusers' indexing gives
    sig_raw = _take(sigmas, i)
    alpha_t, sigma_t = _dpm_alpha_sigma(scheduler, _take(sigmas, i + 1))
    alpha_s0, sigma_s0 = _dpm_alpha_sigma(scheduler, sig_raw)
    alpha_s1, sigma_s1 = _dpm_alpha_sigma(scheduler, _take(sigmas, prev_i))
    lam_t = alpha_t.log() - sigma_t.log()
    lam_s0 = alpha_s0.log() - sigma_s0.log()
    lam_s1 = alpha_s1.log() - sigma_s1.log()
    h, h_0 = lam_t - lam_s0, lam_s0 - lam_s1
    zero, one = torch.zeros_like(sig_raw), torch.ones_like(sig_raw)

    # convert_model_output (dpmsolver++): the data prediction x0
    pred = cfg.prediction_type
    if pred == "epsilon":
        c_s, c_m = 1 / alpha_s0, -sigma_s0 / alpha_s0
    elif pred == "sample":
        c_s, c_m = zero, one
    elif pred == "v_prediction":
        c_s, c_m = alpha_s0, -sigma_s0
    else:  # flow_prediction uses the raw sigma
        c_s, c_m = one, -sig_raw

    # first order: prev = (sigma_t / sigma_s0) * sample - A * x0, A = alpha_t * (exp(-h) - 1)
    A = alpha_t * (torch.exp(-h) - 1.0)
    d_s = sigma_t / sigma_s0
    first_c = _stack(c_s, c_m, d_s, zero, -A, zero, torch.float64)
    # second order, D1 = (x0 - prev_x0) / r0 with r0 = h_0 / h
    inv_r0 = h / h_0
    if cfg.solver_type == "midpoint":
        k = -0.5 * A * inv_r0  # the D1 term is k * (x0 - prev_x0)
    else:  # heun
        k = alpha_t * ((torch.exp(-h) - 1.0) / h + 1.0) * inv_r0
    second_c = _stack(c_s, c_m, d_s, zero, -A + k, -k, torch.float64)
    if isinstance(first, bool):
        return (first_c if first else second_c).to(dtype)
    # The unused branch may hold inf/NaN (e.g. r0 = 0 at a zero final sigma): where() drops it.
    return torch.where(first.unsqueeze(-1), first_c, second_c).to(dtype)


def _check_index(step_index, n: int, what: str, device):
    if isinstance(step_index, bool) or not isinstance(step_index, (numbers.Integral, torch.Tensor)):
        raise TypeError(f"step_coeffs: step_index must be an int or an integer tensor, got {type(step_index).__name__}")
    if isinstance(step_index, torch.Tensor):
        if step_index.dtype.is_floating_point or step_index.dtype.is_complex or step_index.dtype == torch.bool:
            raise TypeError(f"step_coeffs: step_index must have an integer dtype, got {step_index.dtype}")
        if step_index.dim() > 1:
            raise ValueError(f"step_coeffs: step_index must be 0-D or (N,), got shape {tuple(step_index.shape)}")
        # Range is not checked for tensors: that would read the index back to the host.
        return _to_device(step_index, device)
    step_index = int(step_index)
    if not 0 <= step_index < n:
        raise IndexError(f"step_coeffs: step_index {step_index} is out of range for {n} {what}")
    return step_index


def step_coeffs(
    scheduler,
    step_index: int | torch.Tensor,
    *,
    lower_order_nums: int | torch.Tensor | None = None,
    use_clipped_model_output: bool = False,
    device: torch.device | str | None = None,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """The ``coeffs`` of :func:`vdcompile.ops.scheduler_step` for step ``step_index`` of ``scheduler``.

    ``step_index`` is an int, a 0-D integer tensor (gives shape (6,)) or an (N,) integer tensor
    (gives per-batch coefficients (N, 6)). ``scheduler.set_timesteps`` must have been called.
    The result is on ``device`` (default: the index's device for a tensor, else the CPU) with
    ``dtype``; no value is read back to the host, so a tensor ``step_index`` can change every step
    of a compiled loop without a recompile. Tensor indices are not range-checked.

    Per scheduler:

    * Euler: the deterministic (``s_churn == 0``) step at ``sigmas[step_index]``.
    * DDIM: the ``eta == 0`` step at ``timesteps[step_index]``; pass :func:`x0_clip` as ``clip_x0``.
    * DPM-Solver++: the step diffusers takes given ``lower_order_nums`` (default: the scheduler's
      current ``lower_order_nums``; may be a tensor). Pass ``scheduler.model_outputs[-1]`` as
      ``prev_x0`` whenever it is not None: the first-order coefficients have ``d_p = 0``.
      The op's x0 output is the converted model output diffusers stores in ``model_outputs``.

    Raises :class:`UnsupportedSchedulerError` for configurations listed in the module docstring.
    """
    reason = unsupported_reason(scheduler)
    if reason is not None:
        raise UnsupportedSchedulerError(reason)
    if scheduler.num_inference_steps is None:
        raise ValueError("step_coeffs: call scheduler.set_timesteps(...) first")
    if device is None:
        device = step_index.device if isinstance(step_index, torch.Tensor) else torch.device("cpu")
    n = len(scheduler.timesteps)
    i = _check_index(step_index, n, "steps", device)
    kind = type(scheduler)
    if kind is EulerDiscreteScheduler:
        return _euler_coeffs(scheduler, i, device, dtype)
    if kind is DDIMScheduler:
        # t stays a tensor (an int index gives a view): no read-back
        t = (_take(_to_device(scheduler.timesteps, device), i) if isinstance(i, torch.Tensor)
             else _to_device(scheduler.timesteps[i], device))
        return _ddim_coeffs(scheduler, t, device, dtype, use_clipped_model_output)
    lon = scheduler.lower_order_nums if lower_order_nums is None else lower_order_nums
    return _dpm_coeffs(scheduler, i, lon, device, dtype)


# ---------------------------------------------------------------------------------------------
# The drop-in step.

_STEP_OPTIONS = {
    EulerDiscreteScheduler: {"s_churn", "s_tmin", "s_tmax", "s_noise", "generator"},
    DDIMScheduler: {"eta", "use_clipped_model_output", "generator", "variance_noise"},
    DPMSolverMultistepScheduler: {"generator", "variance_noise"},
}


def _is_zero(v) -> bool:
    return isinstance(v, numbers.Real) and not isinstance(v, bool) and v == 0


def _call_reason(scheduler, options) -> str | None:
    """Why these per-call options of ``step`` have no fused equivalent, or None."""
    kind = type(scheduler)
    unknown = set(options) - _STEP_OPTIONS[kind]
    if unknown:
        raise TypeError(f"fused_step: {kind.__name__}.step() got unexpected arguments {sorted(unknown)}")
    if kind is EulerDiscreteScheduler and not _is_zero(options.get("s_churn", 0.0)):
        return "EulerDiscreteScheduler.step with s_churn > 0 (stochastic churn) is not supported"
    if kind is DDIMScheduler and not _is_zero(options.get("eta", 0.0)):
        return "DDIMScheduler.step with eta > 0 (stochastic) is not supported"
    return None


def _blend_tensor(blend_weight, like: torch.Tensor) -> torch.Tensor:
    if isinstance(blend_weight, torch.Tensor):
        return blend_weight
    # A Python number never came from a device tensor, so this is a fill, not a read-back.
    cdt = compute_dtype(like.dtype)
    return torch.full((), float(blend_weight), dtype=cdt, device=like.device)


def _blend(prev, prev_frame, blend_weight):
    """The op's temporal blend in torch ops (fallback path), in the op's compute dtype."""
    cdt = compute_dtype(prev.dtype)
    w = _blend_tensor(blend_weight, prev).to(cdt)
    if w.dim() == 1:
        w = w.reshape((-1,) + (1,) * (prev.dim() - 1))
    return (w * prev.to(cdt) + (1 - w) * prev_frame.to(cdt)).to(prev.dtype)


def _fallback(scheduler, model_output, timestep, sample, prev_frame, blend_weight, return_dict, options):
    out = scheduler.step(model_output, timestep, sample, return_dict=return_dict, **options)
    if prev_frame is None:
        return out
    if return_dict:
        return dataclasses.replace(out, prev_sample=_blend(out.prev_sample, prev_frame, blend_weight))
    return (_blend(out[0], prev_frame, blend_weight),) + tuple(out[1:])


def fused_step(
    scheduler,
    model_output: torch.Tensor,
    timestep,
    sample: torch.Tensor,
    *,
    prev_frame: torch.Tensor | None = None,
    blend_weight: torch.Tensor | float | None = None,
    return_dict: bool = True,
    fallback: bool = True,
    **step_options,
):
    """Drop-in for ``scheduler.step(model_output, timestep, sample, **step_options)`` on the fused op.

    Returns what ``scheduler.step`` returns (its output class, or a tuple with ``return_dict=False``)
    and advances the scheduler's state exactly as it does (``step_index``; DPM-Solver's
    ``model_outputs`` and ``lower_order_nums``), so fused and plain steps can be mixed in one loop.

    Optional temporal blending: with ``prev_frame`` and ``blend_weight`` (a 0-D or (N,) tensor, or
    a number), ``prev_sample = w * prev_sample + (1 - w) * prev_frame`` (both or neither).

    Math is done in float32 (float64 for float64 inputs), like diffusers' own upcast. Outputs have
    the dtypes diffusers gives; with float16/bfloat16 inputs diffusers returns Euler's
    ``pred_original_sample`` in float32, here its values are rounded to the input dtype first.

    Unsupported configurations or options (module docstring) call ``scheduler.step`` itself (and
    apply the blend to its result) when ``fallback`` is True, else raise
    :class:`UnsupportedSchedulerError`.
    """
    if (prev_frame is None) != (blend_weight is None):
        raise ValueError("fused_step: prev_frame and blend_weight must be given together")
    reason = unsupported_reason(scheduler) or _call_reason(scheduler, step_options)
    if reason is not None:
        if not fallback:
            raise UnsupportedSchedulerError(reason)
        return _fallback(scheduler, model_output, timestep, sample, prev_frame, blend_weight, return_dict,
                         step_options)

    kind = type(scheduler)
    compute = torch.promote_types(sample.dtype, model_output.dtype)
    coeff_dtype = compute_dtype(compute)
    device = sample.device
    pred = scheduler.config.prediction_type
    prev_x0 = None

    if kind is EulerDiscreteScheduler:
        # Same argument check as EulerDiscreteScheduler.step.
        if isinstance(timestep, (int, torch.IntTensor, torch.LongTensor)):
            raise ValueError(
                "Passing integer indices (e.g. from `enumerate(timesteps)`) as timesteps to"
                " `EulerDiscreteScheduler.step()` is not supported. Make sure to pass"
                " one of the `scheduler.timesteps` as a timestep.")
        if scheduler.step_index is None:
            scheduler._init_step_index(timestep)
        coeffs = _euler_coeffs(scheduler, scheduler.step_index, device, coeff_dtype)
        x0_dtype = (model_output.dtype if pred in ("sample", "original_sample")
                    else torch.promote_types(torch.float32, model_output.dtype))
        prev_dtype = model_output.dtype
    elif kind is DDIMScheduler:
        if scheduler.num_inference_steps is None:
            raise ValueError(
                "Number of inference steps is 'None', you need to run 'set_timesteps' after creating the scheduler")
        t = _to_device(timestep, device) if isinstance(timestep, torch.Tensor) else timestep
        coeffs = _ddim_coeffs(scheduler, t, device, coeff_dtype,
                              bool(step_options.get("use_clipped_model_output", False)))
        x0_dtype = model_output.dtype if pred == "sample" else compute
        prev_dtype = compute
    else:
        if scheduler.num_inference_steps is None:
            raise ValueError(
                "Number of inference steps is 'None', you need to run 'set_timesteps' after creating the scheduler")
        if scheduler.step_index is None:
            scheduler._init_step_index(timestep)
        i, lon = scheduler.step_index, scheduler.lower_order_nums
        coeffs = _dpm_coeffs(scheduler, i, lon, device, coeff_dtype)
        if not _dpm_first_order(scheduler, i, lon):
            prev_x0 = scheduler.model_outputs[-1].to(compute)
        x0_dtype = model_output.dtype if pred == "sample" else compute
        prev_dtype = x0_dtype  # diffusers casts to the converted model output's dtype

    blend = None
    if prev_frame is not None:
        prev_frame = prev_frame.to(compute)
        blend = _blend_tensor(blend_weight, prev_frame)
    prev, x0 = scheduler_step(model_output.to(compute), sample.to(compute), coeffs, prev_x0, prev_frame,
                              blend, x0_clip(scheduler))
    prev, x0 = prev.to(prev_dtype), x0.to(x0_dtype)

    if kind is EulerDiscreteScheduler:
        scheduler._step_index += 1
        return EulerDiscreteSchedulerOutput(prev_sample=prev, pred_original_sample=x0) if return_dict else (prev, x0)
    if kind is DDIMScheduler:
        return DDIMSchedulerOutput(prev_sample=prev, pred_original_sample=x0) if return_dict else (prev, x0)
    # DPM-Solver: the same bookkeeping as DPMSolverMultistepScheduler.step
    order = scheduler.config.solver_order
    for k in range(order - 1):
        scheduler.model_outputs[k] = scheduler.model_outputs[k + 1]
    scheduler.model_outputs[-1] = x0
    if scheduler.lower_order_nums < order:
        scheduler.lower_order_nums += 1
    scheduler._step_index += 1
    return SchedulerOutput(prev_sample=prev) if return_dict else (prev,)
