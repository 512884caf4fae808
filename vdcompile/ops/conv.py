"""vd ops of the conv family: conv_bn_silu (Conv2d -> eval BatchNorm -> SiLU) and temporal_conv
(the (k, 1, 1) Conv3d over frames in video UNets)."""
from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from vdcompile.ops._utils import FLOAT_DTYPES, empty_frames_major, empty_in_layout, frames_major_layout

__all__ = ["conv_bn_silu", "reference_conv_bn_silu", "temporal_conv", "reference_temporal_conv"]

_CBS = "vd::conv_bn_silu"
_TC = "vd::temporal_conv"


def _pair(v: int | Sequence[int]) -> list[int]:
    return [v, v] if isinstance(v, int) else list(v)


def conv_bn_silu(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    bn_weight: torch.Tensor,
    bn_bias: torch.Tensor,
    bn_mean: torch.Tensor,
    bn_var: torch.Tensor,
    eps: float = 1e-5,
    stride: int | Sequence[int] = 1,
    padding: int | Sequence[int] = 0,
    dilation: int | Sequence[int] = 1,
    groups: int = 1,
    silu: bool = True,
) -> torch.Tensor:
    r"""SiLU(BatchNorm_eval(conv2d(x))) with BatchNorm folded into the convolution.

    ``x`` is (N, C_in, H, W), ``weight`` (C_out, C_in / groups, kH, kW); ``bias`` and the BatchNorm
    parameters and running statistics are (C_out,). With
    :math:`s_c = \gamma_c / \sqrt{\sigma^2_c + \epsilon}` (``bn_weight``, ``bn_var``):

    .. math:: z_c = s_c \, (\mathrm{conv2d}(x, w)_c + b_c - \mu_c) + \beta_c
              = \mathrm{conv2d}(x, s \cdot w)_c + b'_c, \qquad y = z \cdot \mathrm{sigmoid}(z)

    with :math:`b'_c = (b_c - \mu_c) s_c + \beta_c`. ``silu=False`` returns ``z``. ``stride``,
    ``padding`` and ``dilation`` are ints or (height, width) pairs, as in ``F.conv2d``. The CPU kernel
    convolves with :math:`s \cdot w`; the CUDA kernels convolve with ``weight`` as given and apply
    :math:`s_c` to the result (the first form of z), so a CUDA-graph replay reads a weight already in x's
    memory format in place (others are copied into it on every replay).

    ``weight`` must have x's dtype; ``bias`` and the BatchNorm tensors may be any float dtype (they
    are folded in float32, float64 for float64 inputs). The output has x's dtype; a channels_last
    input gives a channels_last output. The running statistics are constants of the model, but
    their gradients are provided too when they require grad.
    """
    return torch.ops.vd.conv_bn_silu.default(
        x, weight, bias, bn_weight, bn_bias, bn_mean, bn_var, eps,
        _pair(stride), _pair(padding), _pair(dilation), groups, silu)


def reference_conv_bn_silu(x, weight, bias, bn_weight, bn_bias, bn_mean, bn_var, eps=1e-5,
                           stride=1, padding=0, dilation=1, groups=1, silu=True):
    """The math, in plain PyTorch (computed in float64, returned in x's dtype)."""
    d = lambda t: None if t is None else t.double()  # noqa: E731
    y = F.conv2d(x.double(), weight.double(), d(bias), _pair(stride), _pair(padding), _pair(dilation), groups)
    z = F.batch_norm(y, d(bn_mean), d(bn_var), d(bn_weight), d(bn_bias), training=False, eps=eps)
    return (F.silu(z) if silu else z).to(x.dtype)


def temporal_conv(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    padding: int = 0,
) -> torch.Tensor:
    r"""Conv3d with a (k, 1, 1) kernel and stride 1 over the frame axis of x.

    ``x`` is (B, C_in, F, H, W), ``weight`` (C_out, C_in, k, 1, 1), ``bias`` (C_out,). Frames are
    zero-padded by ``padding`` on both ends; each pixel is mixed across frames only:

    .. math:: y_{b,o,f,h,w} = \mathrm{bias}_o + \sum_{t<k} \sum_i
              w_{o,i,t} \, x_{b,i,f+t-\mathrm{padding},h,w}

    for :math:`0 \le f < F_{out} = F + 2\,\mathrm{padding} - k + 1`, terms with an out-of-range
    frame being zero. ``weight`` must have x's dtype, ``bias`` may be any float dtype (cast to
    x's). The output has x's dtype; a channels_last_3d input gives a channels_last_3d output, and a
    frames-major input (a permuted view of a contiguous (B, F, C, H, W) tensor, as diffusers' temporal
    blocks make) a frames-major output.
    """
    return torch.ops.vd.temporal_conv.default(x, weight, bias, padding)


def reference_temporal_conv(x, weight, bias=None, padding=0):
    """The math, in plain PyTorch (computed in float64, returned in x's dtype)."""
    b = None if bias is None else bias.double()
    return F.conv3d(x.double(), weight.double(), b, padding=(padding, 0, 0)).to(x.dtype)


# ---------------------------------------------------------------------------------------------
# Fake kernels: the same checks and messages as csrc/conv.h, exact output metadata.


def _check_float(op, name, t):
    torch._check_type(t.dtype in FLOAT_DTYPES,
                      lambda: f"{op}: {name} must be float32, float16, bfloat16 or float64, got {t.dtype}")


def _check_like_x(op, x, name, t):
    torch._check(t.device == x.device, lambda: f"{op}: {name} is on {t.device} but x is on {x.device}; "
                 "all tensors must be on the same device")
    torch._check_type(t.dtype == x.dtype, lambda: f"{op}: {name} has dtype {t.dtype} but x has dtype {x.dtype}")


def _check_vector(op, x, name, t, n):
    torch._check(t.device == x.device, lambda: f"{op}: {name} is on {t.device} but x is on {x.device}; "
                 "all tensors must be on the same device")
    _check_float(op, name, t)
    torch._check(t.dim() == 1 and t.shape[0] == n, lambda: f"{op}: {name} must have shape ({n},), got {tuple(t.shape)}")


def _check_pair(op, name, v, min_value):
    torch._check(len(v) == 2, lambda: f"{op}: {name} must have 2 elements (height, width), got {list(v)}")
    torch._check(v[0] >= min_value and v[1] >= min_value, lambda: f"{op}: {name} must be >= {min_value}, got {list(v)}")


def _conv_bn_silu_out_shape(x, weight, bias, bn_weight, bn_bias, bn_mean, bn_var, eps, stride, padding,
                            dilation, groups):
    op = _CBS
    torch._check(x.dim() == 4, lambda: f"{op}: x must be 4-D (N, C_in, H, W), got {x.dim()}-D tensor of shape {tuple(x.shape)}")
    torch._check(weight.dim() == 4, lambda: f"{op}: weight must be 4-D (C_out, C_in / groups, kH, kW), "
                 f"got {weight.dim()}-D tensor of shape {tuple(weight.shape)}")
    _check_float(op, "x", x)
    _check_like_x(op, x, "weight", weight)
    _check_pair(op, "stride", stride, 1)
    _check_pair(op, "padding", padding, 0)
    _check_pair(op, "dilation", dilation, 1)
    torch._check(groups >= 1, lambda: f"{op}: groups must be >= 1, got {groups}")
    N, C_in, H, W = x.shape
    C_out, _, kH, kW = weight.shape
    torch._check(C_in >= 1, lambda: f"{op}: x must have at least one channel, got shape {tuple(x.shape)}")
    torch._check(C_out >= 1 and kH >= 1 and kW >= 1,
                 lambda: f"{op}: weight must have non-zero C_out, kH and kW, got shape {tuple(weight.shape)}")
    torch._check(C_in % groups == 0, lambda: f"{op}: groups ({groups}) must divide the input channels x.size(1) = {C_in}")
    torch._check(C_out % groups == 0,
                 lambda: f"{op}: groups ({groups}) must divide the output channels weight.size(0) = {C_out}")
    torch._check(weight.shape[1] * groups == C_in, lambda: f"{op}: weight.size(1) must be C_in / groups = "
                 f"{C_in} / {groups} = {C_in // groups}, got weight of shape {tuple(weight.shape)}")
    if bias is not None:
        _check_vector(op, x, "bias", bias, C_out)
    for name, t in (("bn_weight", bn_weight), ("bn_bias", bn_bias), ("bn_mean", bn_mean), ("bn_var", bn_var)):
        _check_vector(op, x, name, t, C_out)
    torch._check(eps >= 0, lambda: f"{op}: eps must be >= 0, got {eps}")
    span_h, span_w = dilation[0] * (kH - 1) + 1, dilation[1] * (kW - 1) + 1
    torch._check(H + 2 * padding[0] >= span_h and W + 2 * padding[1] >= span_w,
                 lambda: f"{op}: output would be empty: input {H}x{W} with padding {list(padding)} is smaller "
                 f"than the dilated kernel {span_h}x{span_w}")
    H_out = (H + 2 * padding[0] - span_h) // stride[0] + 1
    W_out = (W + 2 * padding[1] - span_w) // stride[1] + 1
    return (N, C_out, H_out, W_out)


@torch.library.register_fake(_CBS)
def _conv_bn_silu_fake(x, weight, bias, bn_weight, bn_bias, bn_mean, bn_var, eps, stride, padding, dilation,
                       groups, silu=True):
    shape = _conv_bn_silu_out_shape(x, weight, bias, bn_weight, bn_bias, bn_mean, bn_var, eps, stride, padding,
                                    dilation, groups)
    return empty_in_layout(x, shape)


@torch.library.register_fake(_CBS + "_backward")
def _conv_bn_silu_backward_fake(grad_out, x, weight, bias, bn_weight, bn_bias, bn_mean, bn_var, eps, stride,
                                padding, dilation, groups, silu):
    shape = _conv_bn_silu_out_shape(x, weight, bias, bn_weight, bn_bias, bn_mean, bn_var, eps, stride, padding,
                                    dilation, groups)
    _check_like_x(_CBS, x, "grad_out", grad_out)
    torch._check(tuple(grad_out.shape) == shape, lambda: f"{_CBS}_backward: grad_out must have the output's "
                 f"shape {list(shape)}, got {list(grad_out.shape)}")
    C_out = weight.shape[0]
    return (
        empty_in_layout(x),
        weight.new_empty(weight.shape),
        x.new_empty((C_out,), dtype=bias.dtype if bias is not None else x.dtype),
        bn_weight.new_empty((C_out,)),
        bn_bias.new_empty((C_out,)),
    )


def _temporal_conv_out_shape(x, weight, padding):
    op = _TC
    torch._check(x.dim() == 5, lambda: f"{op}: x must be 5-D (B, C_in, F, H, W), got {x.dim()}-D tensor of shape {tuple(x.shape)}")
    torch._check(weight.dim() == 5, lambda: f"{op}: weight must be 5-D (C_out, C_in, k, 1, 1), "
                 f"got {weight.dim()}-D tensor of shape {tuple(weight.shape)}")
    _check_float(op, "x", x)
    _check_like_x(op, x, "weight", weight)
    B, C_in, Fr, H, W = x.shape
    C_out, _, k, kh, kw = weight.shape
    torch._check(kh == 1 and kw == 1 and k >= 1,
                 lambda: f"{op}: weight must have a (k, 1, 1) kernel with k >= 1, got shape {tuple(weight.shape)}")
    torch._check(C_in >= 1, lambda: f"{op}: x must have at least one channel, got shape {tuple(x.shape)}")
    torch._check(C_out >= 1, lambda: f"{op}: weight must have at least one output channel, got shape {tuple(weight.shape)}")
    torch._check(weight.shape[1] == C_in, lambda: f"{op}: weight.size(1) must equal the input channels x.size(1) = "
                 f"{C_in}, got weight of shape {tuple(weight.shape)}")
    torch._check(padding >= 0, lambda: f"{op}: padding must be >= 0, got {padding}")
    F_out = Fr + 2 * padding - k + 1
    torch._check(F_out >= 1, lambda: f"{op}: output would have no frames: F + 2 * padding - k + 1 = "
                 f"{Fr} + 2 * {padding} - {k} + 1 = {F_out} (must be >= 1)")
    return (B, C_out, F_out, H, W)


@torch.library.register_fake(_TC)
def _temporal_conv_fake(x, weight, bias=None, padding=0):
    shape = _temporal_conv_out_shape(x, weight, padding)
    if bias is not None:
        _check_vector(_TC, x, "bias", bias, weight.shape[0])
    if frames_major_layout(x):
        return empty_frames_major(shape, x)
    return empty_in_layout(x, shape)


@torch.library.register_fake(_TC + "_backward")
def _temporal_conv_backward_fake(grad_out, x, weight, padding):
    shape = _temporal_conv_out_shape(x, weight, padding)
    _check_like_x(_TC, x, "grad_out", grad_out)
    torch._check(tuple(grad_out.shape) == shape, lambda: f"{_TC}_backward: grad_out must have the output's "
                 f"shape {list(shape)}, got {list(grad_out.shape)}")
    return empty_in_layout(x), weight.new_empty(weight.shape), x.new_empty((weight.shape[0],))


# ---------------------------------------------------------------------------------------------
# Autograd: csrc/autograd.cpp holds both ops' Autograd-key kernels (in C++: a Python formula ran on every call,
# with or without a gradient). conv_bn_silu's running statistics get their gradients from dgamma and dbeta there.
