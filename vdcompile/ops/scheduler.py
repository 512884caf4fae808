"""vd::scheduler_step: one fused update of a diffusion sampler step (Euler, DDIM, DPM-Solver++(2M))."""
from __future__ import annotations

import torch

from vdcompile.ops._utils import FLOAT_DTYPES, compute_dtype, empty_in_layout, grads_for, pad_inputs

__all__ = ["scheduler_step", "reference_scheduler_step"]

_OP = "vd::scheduler_step"
NUM_COEFFS = 6


def scheduler_step(
    model_output: torch.Tensor,
    sample: torch.Tensor,
    coeffs: torch.Tensor,
    prev_x0: torch.Tensor | None = None,
    prev_frame: torch.Tensor | None = None,
    blend_weight: torch.Tensor | None = None,
    clip_x0: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    r"""One sampler step in a single elementwise pass; returns ``(prev_sample, pred_original_sample)``.

    With ``coeffs = [c_s, c_m, d_s, d_m, d_x0, d_p]``:

    .. math::
        x_0 &= \mathrm{clamp}(c_s\,\mathrm{sample} + c_m\,\mathrm{model\_output},\ -\mathrm{clip\_x0},\ \mathrm{clip\_x0}) \\
        \mathrm{prev} &= d_s\,\mathrm{sample} + d_m\,\mathrm{model\_output} + d_{x0}\,x_0 + d_p\,\mathrm{prev\_x0} \\
        \mathrm{prev} &\leftarrow w\,\mathrm{prev} + (1 - w)\,\mathrm{prev\_frame}

    The clamp applies only when ``clip_x0`` is given, the ``d_p`` term only when ``prev_x0`` is given,
    and the blend only when ``prev_frame`` and ``blend_weight`` (``w``) are given (both or neither).

    ``sample`` has any rank >= 1; ``model_output``, ``prev_x0`` and ``prev_frame`` must match its shape
    and dtype. ``coeffs`` is (6,) or (N, 6) with N = sample.size(0) (per-batch coefficients);
    ``blend_weight`` is 0-D or (N,). Both are tensors so a compiled loop does not recompile per step,
    and are read by the kernel on the device (no host sync). Math is done in float32 (float64 for
    float64 inputs); both outputs have sample's dtype, and sample's layout rule (channels_last stays).
    Gradients flow to every tensor input; the clamp passes the x0 gradient only inside
    [-clip_x0, clip_x0], as torch.clamp does.
    """
    return torch.ops.vd.scheduler_step.default(model_output, sample, coeffs, prev_x0, prev_frame,
                                               blend_weight, clip_x0)


def _per_batch(t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A 0-D scalar as is, an (N,) vector shaped (N, 1, ..., 1) to broadcast over ``like``."""
    return t if t.dim() == 0 else t.reshape((-1,) + (1,) * (like.dim() - 1))


def reference_scheduler_step(model_output, sample, coeffs, prev_x0=None, prev_frame=None,
                             blend_weight=None, clip_x0=None):
    """The math, in plain PyTorch, in the op's compute dtype; returns outputs in sample's dtype."""
    cdt = compute_dtype(sample.dtype)
    s, m = sample.to(cdt), model_output.to(cdt)
    c_s, c_m, d_s, d_m, d_x0, d_p = (_per_batch(c, s) for c in coeffs.to(cdt).unbind(-1))
    x0 = c_s * s + c_m * m
    if clip_x0 is not None:
        x0 = x0.clamp(-clip_x0, clip_x0)
    prev = d_s * s + d_m * m + d_x0 * x0
    if prev_x0 is not None:
        prev = prev + d_p * prev_x0.to(cdt)
    if prev_frame is not None:
        w = _per_batch(blend_weight.to(cdt), s)
        prev = w * prev + (1 - w) * prev_frame.to(cdt)
    return prev.to(sample.dtype), x0.to(sample.dtype)


def _check_args(model_output, sample, coeffs, prev_x0, prev_frame, blend_weight, clip_x0):
    for name, t in (("sample", sample), ("coeffs", coeffs), ("blend_weight", blend_weight)):
        if t is not None:
            torch._check(t.dtype in FLOAT_DTYPES,
                         lambda: f"{_OP}: {name} must be float32, float16, bfloat16 or float64, got {t.dtype}")
    for name, t in (("model_output", model_output), ("coeffs", coeffs), ("prev_x0", prev_x0),
                    ("prev_frame", prev_frame), ("blend_weight", blend_weight)):
        if t is not None:
            torch._check(t.device == sample.device,
                         lambda: f"{_OP}: {name} is on {t.device} but sample is on {sample.device}")
    torch._check(sample.dim() >= 1, lambda: f"{_OP}: sample must have at least 1 dim (N, ...), got a 0-D tensor")
    for name, t in (("model_output", model_output), ("prev_x0", prev_x0), ("prev_frame", prev_frame)):
        if t is not None:
            torch._check(t.dtype == sample.dtype,
                         lambda: f"{_OP}: {name} has dtype {t.dtype} but sample has dtype {sample.dtype}")
            torch._check(t.shape == sample.shape,
                         lambda: f"{_OP}: {name} must have sample's shape {tuple(sample.shape)}, got {tuple(t.shape)}")
    N = sample.shape[0]
    torch._check(
        (coeffs.dim() == 1 and coeffs.shape[0] == NUM_COEFFS)
        or (coeffs.dim() == 2 and coeffs.shape[0] == N and coeffs.shape[1] == NUM_COEFFS),
        lambda: f"{_OP}: coeffs must have shape (6,) or (N, 6) with N = sample.size(0) = {N}, got {tuple(coeffs.shape)}")
    torch._check((prev_frame is None) == (blend_weight is None),
                 lambda: f"{_OP}: prev_frame and blend_weight must be given together")
    if blend_weight is not None:
        torch._check(blend_weight.dim() == 0 or (blend_weight.dim() == 1 and blend_weight.shape[0] == N),
                     lambda: f"{_OP}: blend_weight must be 0-D or have shape (N,) with N = {N}, got {tuple(blend_weight.shape)}")
    if clip_x0 is not None:
        torch._check(clip_x0 >= 0, lambda: f"{_OP}: clip_x0 must be >= 0, got {clip_x0}")


@torch.library.register_fake(_OP)
def _scheduler_step_fake(model_output, sample, coeffs, prev_x0=None, prev_frame=None, blend_weight=None,
                         clip_x0=None):
    _check_args(model_output, sample, coeffs, prev_x0, prev_frame, blend_weight, clip_x0)
    return empty_in_layout(sample), empty_in_layout(sample)


# Schema defaults of the trailing arguments (setup_context only sees what the caller passed).
_DEFAULTS = (None, None, None, None)


def _setup_context(ctx, inputs, output):
    model_output, sample, coeffs, prev_x0, prev_frame, blend_weight, clip_x0 = pad_inputs(inputs, 3, _DEFAULTS)
    ctx.save_for_backward(model_output, sample, coeffs, prev_x0, prev_frame, blend_weight)
    ctx.clip_x0 = clip_x0


def _reduce_like(t: torch.Tensor, per_batch: bool) -> torch.Tensor:
    """Sum of an elementwise product down to a scalar coefficient's shape: 0-D, or (N,) per batch."""
    if not per_batch:
        return t.sum()
    return t.sum(dim=tuple(range(1, t.dim()))) if t.dim() > 1 else t


def _backward(ctx, grad_prev, grad_x0):
    model_output, sample, coeffs, prev_x0, prev_frame, blend_weight = ctx.saved_tensors
    cdt = compute_dtype(sample.dtype)
    s, m = sample.to(cdt), model_output.to(cdt)
    gp = grad_prev.to(cdt) if grad_prev is not None else torch.zeros_like(s)
    gx = grad_x0.to(cdt) if grad_x0 is not None else torch.zeros_like(s)
    c_s, c_m, d_s, d_m, d_x0, d_p = (_per_batch(c, s) for c in coeffs.to(cdt).unbind(-1))

    x0 = c_s * s + c_m * m
    if ctx.clip_x0 is not None:
        inside = (x0 >= -ctx.clip_x0) & (x0 <= ctx.clip_x0)
        x0 = x0.clamp(-ctx.clip_x0, ctx.clip_x0)

    g_frame = g_w = None
    if prev_frame is not None:
        w = _per_batch(blend_weight.to(cdt), s)
        pf = prev_frame.to(cdt)
        g_frame = (1 - w) * gp
        if ctx.needs_input_grad[5]:
            unblended = d_s * s + d_m * m + d_x0 * x0
            if prev_x0 is not None:
                unblended = unblended + d_p * prev_x0.to(cdt)
            g_w = _reduce_like(gp * (unblended - pf), blend_weight.dim() == 1).to(blend_weight.dtype)
        gp = w * gp  # gradient of the unblended prev

    g_x0_raw = gx + d_x0 * gp
    if ctx.clip_x0 is not None:
        g_x0_raw = torch.where(inside, g_x0_raw, torch.zeros_like(g_x0_raw))

    g_model = (c_m * g_x0_raw + d_m * gp).to(model_output.dtype)
    g_sample = (c_s * g_x0_raw + d_s * gp).to(sample.dtype)
    g_prev_x0 = (d_p * gp).to(prev_x0.dtype) if prev_x0 is not None else None
    g_coeffs = None
    if ctx.needs_input_grad[2]:
        per_batch = coeffs.dim() == 2
        px_term = gp * prev_x0.to(cdt) if prev_x0 is not None else torch.zeros_like(gp)
        g_coeffs = torch.stack([_reduce_like(t, per_batch) for t in (
            g_x0_raw * s, g_x0_raw * m, gp * s, gp * m, gp * x0, px_term)], dim=-1).to(coeffs.dtype)
    if g_frame is not None:
        g_frame = g_frame.to(prev_frame.dtype)
    return grads_for(ctx, g_model, g_sample, g_coeffs, g_prev_x0, g_frame, g_w, None)


torch.library.register_autograd(_OP, _backward, setup_context=_setup_context)
