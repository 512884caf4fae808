"""vd::group_norm_silu: SiLU(GroupNorm(x)), the prologue of diffusers' ResNet blocks."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from vdcompile.ops._utils import compute_dtype, empty_frames_major, empty_in_layout, frames_major_layout

__all__ = ["group_norm_silu", "reference_group_norm_silu"]


def group_norm_silu(
    x: torch.Tensor,
    num_groups: int,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    eps: float = 1e-5,
    silu: bool = True,
) -> torch.Tensor:
    r"""SiLU(GroupNorm(x)) in one fused pass.

    ``x`` is (N, C, *spatial) with 1 to 3 spatial dims (3-D, 4-D or 5-D). Channels are split into
    ``num_groups`` groups; each (sample, group) is normalised with its own mean and biased variance:

    .. math:: z = \frac{x - \mu_{n,g}}{\sqrt{\sigma^2_{n,g} + \epsilon}} \cdot w_c + b_c,
              \qquad y = z \cdot \mathrm{sigmoid}(z)

    ``silu=False`` returns ``z`` (plain GroupNorm). The output has x's dtype; a channels_last input
    gives a channels_last output, and a frames-major 5-D input (a (B, C, F, H, W) view of
    (B, F, C, H, W) memory, as diffusers' temporal blocks make) a frames-major output, read and
    written in place on the GPU. Statistics are accumulated in float64 on the CPU and float32 on the
    GPU, whatever the input dtype.
    """
    return torch.ops.vd.group_norm_silu.default(x, num_groups, weight, bias, eps, silu)


def reference_group_norm_silu(x, num_groups, weight=None, bias=None, eps=1e-5, silu=True):
    """The math, in plain PyTorch (computed in float64, returned in x's dtype)."""
    N, C = x.shape[:2]
    xg = x.double().reshape(N, num_groups, -1)
    mean = xg.mean(dim=-1, keepdim=True)
    var = xg.var(dim=-1, unbiased=False, keepdim=True)
    z = ((xg - mean) / torch.sqrt(var + eps)).reshape(x.shape)
    bshape = (1, C) + (1,) * (x.dim() - 2)
    if weight is not None:
        z = z * weight.double().reshape(bshape)
    if bias is not None:
        z = z + bias.double().reshape(bshape)
    return (F.silu(z) if silu else z).to(x.dtype)


def _check_args(x, num_groups, weight, bias):
    torch._check(3 <= x.dim() <= 5, lambda: f"vd::group_norm_silu: x must be 3-D, 4-D or 5-D, got {tuple(x.shape)}")
    torch._check(num_groups >= 1, lambda: f"vd::group_norm_silu: num_groups must be >= 1, got {num_groups}")
    torch._check(x.shape[1] % num_groups == 0,
                 lambda: f"vd::group_norm_silu: num_groups ({num_groups}) must divide x.size(1) = {x.shape[1]}")
    for name, t in (("weight", weight), ("bias", bias)):
        if t is not None:
            torch._check(t.dim() == 1 and t.shape[0] == x.shape[1],
                         lambda: f"vd::group_norm_silu: {name} must have shape ({x.shape[1]},), got {tuple(t.shape)}")


@torch.library.register_fake("vd::group_norm_silu")
def _group_norm_silu_fake(x, num_groups, weight=None, bias=None, eps=1e-5, silu=True):
    _check_args(x, num_groups, weight, bias)
    if frames_major_layout(x):
        return empty_frames_major(x.shape, x)
    return empty_in_layout(x)


@torch.library.register_fake("vd::group_norm_silu_forward")
def _group_norm_silu_forward_fake(x, num_groups, weight=None, bias=None, eps=1e-5, silu=True):
    out = _group_norm_silu_fake(x, num_groups, weight, bias, eps, silu)
    return out, x.new_empty((3, x.shape[0], num_groups), dtype=compute_dtype(x.dtype))


@torch.library.register_fake("vd::group_norm_silu_backward")
def _group_norm_silu_backward_fake(grad_out, x, num_groups, weight, bias, eps, silu, stats=None):
    _check_args(x, num_groups, weight, bias)
    if stats is not None:
        torch._check(stats.shape == (3, x.shape[0], num_groups) and stats.dtype == compute_dtype(x.dtype),
                     lambda: f"vd::group_norm_silu_backward: stats must be {compute_dtype(x.dtype)} of shape "
                             f"(3, {x.shape[0]}, {num_groups}), got {stats.dtype} {tuple(stats.shape)}")
    C = x.shape[1]
    wdtype = weight.dtype if weight is not None else x.dtype
    bdtype = bias.dtype if bias is not None else wdtype
    return empty_in_layout(x), x.new_empty((C,), dtype=wdtype), x.new_empty((C,), dtype=bdtype)


# Autograd: csrc/autograd.cpp holds the Autograd-key kernels of group_norm_silu and group_norm_silu_forward (in
# C++: a short call's backward is host-bound, and a Python formula added its interpreter time to every call, with
# or without a gradient). With a gradient they run group_norm_silu_forward, which also returns each group's
# statistics (as eager GroupNorm saves its mean and rstd), and the backward hands them to group_norm_silu_backward:
# the two-pass path then reads x twice instead of three times.
