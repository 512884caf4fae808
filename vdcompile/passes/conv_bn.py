"""conv2d -> batch_norm(eval) -> silu, conv2d -> batch_norm(eval), conv2d -> silu  =>  vd::conv_bn_silu.

conv -> silu uses an identity batch norm (scale 1, shift 0, mean 0, var 1, eps 0): exact, since
(y - 0) / sqrt(1 + 0) * 1 + 0 == y in floating point.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from vdcompile.passes._common import Match, Rewrite, kernel_missing, requires_grad, static_int

FAMILY = "conv_bn_silu"
_OP = "conv_bn_silu"


# Conv-BN-SiLU stems of image encoders used as conditioning (EfficientNet-style blocks, timm's
# ConvBnAct with act_layer=SiLU) run in eval mode: nn.Conv2d -> nn.BatchNorm2d -> nn.SiLU.
def _pattern_1(x, weight, bias, stride, padding, dilation, groups, mean, var, bn_w, bn_b, training,
               momentum, eps, inplace):
    y = torch.conv2d(x, weight, bias, stride, padding, dilation, groups)
    y = F.batch_norm(y, mean, var, bn_w, bn_b, training, momentum, eps)
    return F.silu(y, inplace=inplace)


# The same without the activation (conv -> bn of the same encoders, before a residual add).
def _pattern_2(x, weight, bias, stride, padding, dilation, groups, mean, var, bn_w, bn_b, training,
               momentum, eps):
    y = torch.conv2d(x, weight, bias, stride, padding, dilation, groups)
    return F.batch_norm(y, mean, var, bn_w, bn_b, training, momentum, eps)


# diffusers ControlNetConditioningEmbedding: `embedding = F.silu(self.conv_in(conditioning))` and
# the same after each of its blocks.
def _pattern_3(x, weight, bias, stride, padding, dilation, groups, inplace):
    return F.silu(torch.conv2d(x, weight, bias, stride, padding, dilation, groups), inplace=inplace)


def _replacement_bn(x, weight, bias, bn_weight, bn_bias, mean, var, eps, stride2, padding2, dilation2, groups,
                    silu):
    return torch.ops.vd.conv_bn_silu.default(x, weight, bias, bn_weight, bn_bias, mean, var, eps, stride2,
                                             padding2, dilation2, groups, silu)


def _replacement_3(x, weight, bias, stride2, padding2, dilation2, groups, c_out):
    # Built from weight (a graph value) so they are graph nodes, not constants traced in.
    ones = weight.new_ones(c_out)
    zeros = weight.new_zeros(c_out)
    return torch.ops.vd.conv_bn_silu.default(x, weight, bias, ones, zeros, zeros, ones, 0.0, stride2, padding2,
                                             dilation2, groups, True)


def _pair(v):
    if isinstance(v, int) and not isinstance(v, bool):
        return [v, v]
    if isinstance(v, (tuple, list)) and len(v) in (1, 2) and all(isinstance(i, int) for i in v):
        return list(v) * (2 // len(v))
    return None


def _check_conv(m: Match) -> str | None:
    x, w, b = m.val("x"), m.val("weight"), m.val("bias")
    if not isinstance(x, torch.Tensor) or x.dim() != 4 or not isinstance(w, torch.Tensor) or w.dim() != 4:
        return "not a batched 2-D convolution"
    stride, dilation = _pair(m["stride"]), _pair(m["dilation"])
    padding = m["padding"]
    if padding == "valid":
        padding = 0
    elif padding == "same":
        ks = [static_int(w.shape[2]), static_int(w.shape[3])]
        if None in ks or dilation is None or any(d * (k - 1) % 2 for d, k in zip(dilation, ks)):
            return "padding='same' that is asymmetric"
        padding = [d * (k - 1) // 2 for d, k in zip(dilation, ks)]
    padding = _pair(padding)
    if stride is None or padding is None or dilation is None or not isinstance(m["groups"], int):
        return "conv arguments are not constants"
    m.extra.update(stride2=stride, padding2=padding, dilation2=dilation)
    return None


def _check_bn(m: Match, silu: bool):
    reason = _check_conv(m)
    if reason:
        return reason
    if m["training"] is not False:
        return "batch_norm in training mode (batch statistics)"
    mean, var, bn_w, bn_b = m.val("mean"), m.val("var"), m.val("bn_w"), m.val("bn_b")
    if mean is None or var is None:
        return "batch_norm without running statistics"
    if bn_w is None or bn_b is None:
        return "batch_norm without affine weight and bias"
    if not isinstance(m["eps"], float):
        return "eps is not a constant"
    if requires_grad(m["mean"]) or requires_grad(m["var"]):
        return "running statistics require grad (the op gives them no gradient)"
    m.extra.update(bn_weight=m["bn_w"], bn_bias=m["bn_b"], silu=silu)
    x, w, b = m.val("x"), m.val("weight"), m.val("bias")
    return kernel_missing(_OP, x, w, b, bn_w, bn_b, mean, var)


def _check_silu(m: Match):
    reason = _check_conv(m)
    if reason:
        return reason
    x, w, b = m.val("x"), m.val("weight"), m.val("bias")
    c_out = static_int(w.shape[0])
    if c_out is None:
        return "dynamic channel count"
    m.extra["c_out"] = c_out
    return kernel_missing(_OP, x, w, b)


REWRITES = [
    Rewrite(FAMILY, "conv_bn_silu", _pattern_1, _replacement_bn, lambda m: _check_bn(m, True)),
    Rewrite(FAMILY, "conv_bn", _pattern_2, _replacement_bn, lambda m: _check_bn(m, False)),
    Rewrite(FAMILY, "conv_silu", _pattern_3, _replacement_3, _check_silu),
]
