"""Typed Python entry points of the vd ops, plus their fake kernels and autograd formulas.

Every op is also reachable as ``torch.ops.vd.<name>`` once :mod:`vdcompile` is imported.
Each family lives in its own module (the C++ schemas name it with set_python_module).
"""
from vdcompile.ops import attention, conv, norm, scheduler  # noqa: F401
from vdcompile.ops.attention import (
    fused_attention,
    reference_fused_attention,
    reference_strided_attention,
    strided_attention,
)
from vdcompile.ops.conv import conv_bn_silu, reference_conv_bn_silu, reference_temporal_conv, temporal_conv
from vdcompile.ops.norm import group_norm_silu, reference_group_norm_silu
from vdcompile.ops.scheduler import reference_scheduler_step, scheduler_step

__all__ = [
    "fused_attention",
    "reference_fused_attention",
    "reference_strided_attention",
    "strided_attention",
    "conv_bn_silu",
    "reference_conv_bn_silu",
    "temporal_conv",
    "reference_temporal_conv",
    "group_norm_silu",
    "reference_group_norm_silu",
    "scheduler_step",
    "reference_scheduler_step",
]
