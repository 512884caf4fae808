r"""vd ops of the attention family: fused (masked) attention and strided (key-subsampled) attention.

Both ops return ``(out, lse)``; ``torch.ops.vd.fused_attention(q, k, v)[0]`` (likewise for
``strided_attention``) is the attention output, ``[1]`` the log-sum-exp of each query row's scaled,
masked scores. ``fused_attention(..., compute_lse=False)`` returns an empty (B, H, 0) lse instead: for
inference, where the lse is not needed and the fp16 / bf16 short-sequence CUDA kernels save its writes (a
backward through such a call still works, at the cost of recomputing the forward for the lse). The
Python wrappers below return the output only, and ask for the lse only when a gradient may be needed.
"""
from __future__ import annotations

import math

import torch

from vdcompile.ops._utils import FLOAT_DTYPES, compute_dtype, grads_for, pad_inputs

__all__ = [
    "fused_attention",
    "strided_attention",
    "reference_fused_attention",
    "reference_strided_attention",
]

_FUSED = "vd::fused_attention"
_FUSED_BWD = "vd::fused_attention_backward"
_STRIDED = "vd::strided_attention"
_STRIDED_BWD = "vd::strided_attention_backward"


def fused_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    scale: float | None = None,
) -> torch.Tensor:
    r"""Scaled dot-product attention in one fused pass.

    ``q`` is (B, H, Lq, D), ``k`` and ``v`` are (B, H, Lk, D); Lq and Lk may differ
    (cross-attention, Lk may be 1) and D (head_dim) is 1..256. Per batch, head and query row i:

    .. math:: S_{ij} = \mathrm{scale} \cdot q_i \cdot k_j + M_{ij}, \qquad
              \mathrm{out}_i = \sum_j \mathrm{softmax}_j(S_{ij})\, v_j

    ``scale`` defaults to :math:`1/\sqrt{D}`. ``attn_mask`` M is either bool (True = keep;
    False sets :math:`S_{ij} = -\infty`) or an additive float mask of q's dtype or float32,
    broadcastable to (B, H, Lq, Lk); it is read through its broadcast strides, never materialised.
    A row whose keys are all masked out (all False, or all -inf) gives ``out_i = 0`` (and
    ``lse_i = -inf``) and contributes zero gradient, instead of softmax's 0/0.

    Inputs may be strided views (e.g. the (B, N, H, D) -> (B, H, N, D) transpose); they are read in
    place. The output is contiguous (B, H, Lq, D) in q's dtype; accumulation is float32 (float64
    for float64 inputs). Differentiable in q, k, v and in a float ``attn_mask``.

    The underlying op ``torch.ops.vd.fused_attention`` returns ``(out, lse)`` with
    :math:`\mathrm{lse}_i = \log \sum_j \exp S_{ij}`, shape (B, H, Lq), float32 (float64 for
    float64 inputs); its ``[0]`` is this function's result. This function passes
    ``compute_lse=False`` when no gradient can flow (grad mode off, or no input requires grad).
    """
    return torch.ops.vd.fused_attention.default(q, k, v, attn_mask, scale, _lse_needed(q, k, v, attn_mask))[0]


def _lse_needed(*tensors) -> bool:
    """Whether a backward through the op may run: grad mode is on and a tensor input requires grad."""
    return torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in tensors)


def strided_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, stride: int, scale: float | None = None
) -> torch.Tensor:
    r"""Attention over every ``stride``-th key: query i attends keys 0, stride, 2*stride, ...

    .. math:: \mathrm{out}_i = \sum_{j \,:\, j \bmod \mathrm{stride} = 0}
              \mathrm{softmax}_j(\mathrm{scale} \cdot q_i \cdot k_j)\, v_j

    Same shapes, dtypes, scale default and layout rules as :func:`fused_attention` (no mask);
    ``stride >= 1`` (1 is plain attention; a stride past Lk leaves key 0 alone). The skipped keys
    receive zero gradient. ``torch.ops.vd.strided_attention(q, k, v, stride)[0]`` is this output,
    ``[1]`` the per-row log-sum-exp over the attended keys.
    """
    return torch.ops.vd.strided_attention.default(q, k, v, stride, scale)[0]


def _default_scale(scale, head_dim):
    return 1.0 / math.sqrt(head_dim) if scale is None else scale


def reference_fused_attention(q, k, v, attn_mask=None, scale=None):
    """The math in plain PyTorch, computed in float64; returns ``(out, lse)`` like the op (out in
    q's dtype, lse in float32, float64 for float64 inputs). Fully masked rows: out 0, lse -inf."""
    scale = _default_scale(scale, q.shape[-1])
    s = (q.double() @ k.double().transpose(-2, -1)) * scale
    if attn_mask is not None:
        s = s.masked_fill(~attn_mask, float("-inf")) if attn_mask.dtype == torch.bool else s + attn_mask.double()
    # Shift by the row max for stability (by 0 on a fully masked row, whose max is -inf).
    m = s.amax(dim=-1, keepdim=True).detach()
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    e = torch.exp(s - m)
    denom = e.sum(dim=-1, keepdim=True)
    empty = denom == 0
    denom = torch.where(empty, torch.ones_like(denom), denom)  # keeps 0/0 out of values and grads
    out = (e @ v.double()) / denom
    lse = torch.where(empty, torch.full_like(denom, float("-inf")), m + torch.log(denom)).squeeze(-1)
    return out.to(q.dtype), lse.to(compute_dtype(q.dtype))


def reference_strided_attention(q, k, v, stride, scale=None):
    """Strided attention as fused attention with a bool mask keeping keys j % stride == 0."""
    keep = torch.arange(k.shape[2], device=k.device) % stride == 0
    return reference_fused_attention(q, k, v, keep, scale)


# ---- validation mirrored from csrc/attention.h, for the fake kernels ----

def _check_attention(q, k, v, op):
    for t, name, layout in ((q, "q", "(batch, heads, q_len, head_dim)"),
                            (k, "k", "(batch, heads, kv_len, head_dim)"),
                            (v, "v", "(batch, heads, kv_len, head_dim)")):
        torch._check(t.dim() == 4,
                     lambda: f"{op}: {name} must be 4-D {layout}, got {t.dim()}-D tensor of shape {list(t.shape)}")
    for t, name in ((k, "k"), (v, "v")):
        torch._check(t.device == q.device, lambda: f"{op}: {name} is on {t.device} but q is on {q.device}; "
                     "all tensors must be on the same device")
    torch._check_type(q.dtype in FLOAT_DTYPES,
                      lambda: f"{op}: q must be float32, float16, bfloat16 or float64, got {q.dtype}")
    for t, name in ((k, "k"), (v, "v")):
        torch._check_type(t.dtype == q.dtype, lambda: f"{op}: {name} has dtype {t.dtype} but q has dtype {q.dtype}")
    B, H, _, D = q.shape
    torch._check(1 <= D <= 256, lambda: f"{op}: head_dim (q.size(3)) must be in 1..256, got {D}")
    torch._check(k.shape[0] == B and k.shape[1] == H and k.shape[3] == D,
                 lambda: f"{op}: k must have shape ({B}, {H}, kv_len, {D}) to match q {list(q.shape)}, "
                 f"got {list(k.shape)}")
    torch._check(v.shape == k.shape, lambda: f"{op}: v must have the same shape as k {list(k.shape)}, got {list(v.shape)}")
    torch._check(q.shape[2] >= 1 and k.shape[2] >= 1,
                 lambda: f"{op}: q_len and kv_len must be >= 1, got q {list(q.shape)} and k {list(k.shape)}")


def _check_mask(mask, q, k, op):
    torch._check(mask.device == q.device, lambda: f"{op}: attn_mask is on {mask.device} but q is on {q.device}; "
                 "all tensors must be on the same device")
    torch._check_type(mask.dtype in (torch.bool, q.dtype, torch.float32),
                      lambda: f"{op}: attn_mask must be bool (True = keep) or a float mask of q's dtype or "
                      f"float32, got {mask.dtype}")
    torch._check(mask.dim() <= 4, lambda: f"{op}: attn_mask must have at most 4 dims, got {list(mask.shape)}")
    target = (q.shape[0], q.shape[1], q.shape[2], k.shape[2])
    for ms, ts in zip(mask.shape, target[4 - mask.dim():]):
        torch._check(ms == 1 or ms == ts, lambda: f"{op}: attn_mask of shape {list(mask.shape)} is not broadcastable "
                     f"to (batch, heads, q_len, kv_len) = {list(target)}")


def _check_scale(scale, op):
    torch._check(scale is None or math.isfinite(scale), lambda: f"{op}: scale must be finite, got {scale}")


def _check_stride(stride, op):
    torch._check(stride >= 1, lambda: f"{op}: stride must be >= 1, got {stride}")


def _check_backward(grad_out, q, out, lse, grad_lse, op):
    for t, name in ((grad_out, "grad_out"), (out, "out")):
        torch._check(t.device == q.device, lambda: f"{op}: {name} is on {t.device} but q is on {q.device}; "
                     "all tensors must be on the same device")
        torch._check_type(t.dtype == q.dtype, lambda: f"{op}: {name} has dtype {t.dtype} but q has dtype {q.dtype}")
        torch._check(t.shape == q.shape, lambda: f"{op}: {name} must have q's shape {list(q.shape)}, got {list(t.shape)}")
    lse_shape = tuple(q.shape[:3])
    for t, name in ((lse, "lse"), (grad_lse, "grad_lse")):
        if t is None:
            continue
        torch._check(t.device == q.device, lambda: f"{op}: {name} is on {t.device} but q is on {q.device}; "
                     "all tensors must be on the same device")
        torch._check_type(t.dtype == compute_dtype(q.dtype),
                          lambda: f"{op}: {name} must be {compute_dtype(q.dtype)} for {q.dtype} inputs, got {t.dtype}")
        torch._check(tuple(t.shape) == lse_shape, lambda: f"{op}: {name} must have shape (batch, heads, q_len) = "
                     f"{list(lse_shape)}, got {list(t.shape)}")


def _forward_outputs(q, compute_lse=True):
    B, H, Lq, D = q.shape
    return q.new_empty((B, H, Lq, D)), q.new_empty((B, H, Lq if compute_lse else 0), dtype=compute_dtype(q.dtype))


def _backward_outputs(q, k):
    B, H, Lq, D = q.shape
    Lk = k.shape[2]
    return q.new_empty((B, H, Lq, D)), q.new_empty((B, H, Lk, D)), q.new_empty((B, H, Lk, D))


@torch.library.register_fake(_FUSED)
def _fused_attention_fake(q, k, v, attn_mask=None, scale=None, compute_lse=True):
    _check_attention(q, k, v, _FUSED)
    _check_scale(scale, _FUSED)
    if attn_mask is not None:
        _check_mask(attn_mask, q, k, _FUSED)
    return _forward_outputs(q, compute_lse)


@torch.library.register_fake(_FUSED_BWD)
def _fused_attention_backward_fake(grad_out, q, k, v, out, lse, attn_mask, scale, grad_lse):
    _check_attention(q, k, v, _FUSED_BWD)
    _check_backward(grad_out, q, out, lse, grad_lse, _FUSED_BWD)
    _check_scale(scale, _FUSED_BWD)
    if attn_mask is not None:
        _check_mask(attn_mask, q, k, _FUSED_BWD)
    return _backward_outputs(q, k)


@torch.library.register_fake(_STRIDED)
def _strided_attention_fake(q, k, v, stride, scale=None):
    _check_attention(q, k, v, _STRIDED)
    _check_stride(stride, _STRIDED)
    _check_scale(scale, _STRIDED)
    return _forward_outputs(q)


@torch.library.register_fake(_STRIDED_BWD)
def _strided_attention_backward_fake(grad_out, q, k, v, out, lse, stride, scale, grad_lse):
    _check_attention(q, k, v, _STRIDED_BWD)
    _check_stride(stride, _STRIDED_BWD)
    _check_backward(grad_out, q, out, lse, grad_lse, _STRIDED_BWD)
    _check_scale(scale, _STRIDED_BWD)
    return _backward_outputs(q, k)


# ---- autograd ----

def _mask_grad(grad_out, q, k, v, out, lse, attn_mask, scale, grad_lse):
    """Gradient of a float attn_mask: the score gradient dS = P * (dP - Delta) (mask is added to the
    scores unscaled), summed over the dims the mask was broadcast along. Plain torch ops; it forms
    the full (B, H, Lq, Lk) matrix, which only a mask that requires grad pays for."""
    acc = compute_dtype(q.dtype)
    q, k, v, grad_out, out = (t.to(acc) for t in (q, k, v, grad_out, out))
    s = (q @ k.transpose(-2, -1)) * _default_scale(scale, q.shape[-1]) + attn_mask.to(acc)
    lse = lse.to(acc).unsqueeze(-1)
    # exp(s - lse) is 0/0 on fully masked rows (lse = -inf); those rows have P = 0.
    p = torch.where(torch.isneginf(lse), torch.zeros_like(s), torch.exp(s - lse))
    delta = (grad_out * out).sum(dim=-1, keepdim=True)
    if grad_lse is not None:
        delta = delta - grad_lse.to(acc).unsqueeze(-1)
    ds = p * (grad_out @ v.transpose(-2, -1) - delta)
    return ds.sum_to_size(attn_mask.shape).to(attn_mask.dtype)


def _fused_setup_context(ctx, inputs, output):
    q, k, v, attn_mask, scale, compute_lse = pad_inputs(inputs, 3, (None, None, True))
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, attn_mask)
    ctx.scale = scale
    ctx.compute_lse = compute_lse


def _fused_backward(ctx, grad_out, grad_lse):
    q, k, v, out, lse, attn_mask = ctx.saved_tensors
    if not ctx.compute_lse:
        # compute_lse=False with a gradient after all (e.g. AOTAutograd traces the backward of any compiled
        # call on inputs that require grad): recompute the lse, one more forward; the empty lse has no gradient.
        lse = torch.ops.vd.fused_attention.default(q, k, v, attn_mask, ctx.scale)[1]
        grad_lse = None
    if grad_out is None:
        grad_out = torch.zeros_like(out)
    dq, dk, dv = torch.ops.vd.fused_attention_backward.default(
        grad_out, q, k, v, out, lse, attn_mask, ctx.scale, grad_lse)
    need = ctx.needs_input_grad
    dmask = None
    if len(need) > 3 and need[3]:
        dmask = _mask_grad(grad_out, q, k, v, out, lse, attn_mask, ctx.scale, grad_lse)
    return grads_for(ctx, dq, dk, dv, dmask, None, None)


torch.library.register_autograd(_FUSED, _fused_backward, setup_context=_fused_setup_context)


def _strided_setup_context(ctx, inputs, output):
    q, k, v, stride, scale = pad_inputs(inputs, 4, (None,))
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.stride, ctx.scale = stride, scale


def _strided_backward(ctx, grad_out, grad_lse):
    q, k, v, out, lse = ctx.saved_tensors
    if grad_out is None:
        grad_out = torch.zeros_like(out)
    dq, dk, dv = torch.ops.vd.strided_attention_backward.default(
        grad_out, q, k, v, out, lse, ctx.stride, ctx.scale, grad_lse)
    return grads_for(ctx, dq, dk, dv, None, None)


torch.library.register_autograd(_STRIDED, _strided_backward, setup_context=_strided_setup_context)
