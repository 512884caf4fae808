"""group_norm -> silu  =>  vd::group_norm_silu.

Plain group_norm (no silu after it) is left to inductor: inductor already fuses its normalisation
pass with the elementwise ops around it, while an opaque custom op would cut that fusion.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from vdcompile.passes._common import Match, Rewrite, kernel_missing, value_of

FAMILY = "group_norm_silu"


# diffusers ResnetBlock2D / TemporalResnetBlock / SpatioTemporalResBlock and the VAE's Encoder /
# Decoder / TemporalDecoder: `hidden_states = self.nonlinearity(self.norm1(hidden_states))`.
def _pattern_1(x, num_groups, weight, bias, eps, inplace):
    return F.silu(F.group_norm(x, num_groups, weight, bias, eps), inplace=inplace)


def _replacement_1(x, num_groups, weight, bias, eps):
    return torch.ops.vd.group_norm_silu.default(x, num_groups, weight, bias, eps, True)


def _check(m: Match):
    x, w, b = m.val("x"), m.val("weight"), m.val("bias")
    if not isinstance(x, torch.Tensor):
        return "input is not a tensor"
    if not 3 <= x.dim() <= 5:
        return f"{x.dim()}-D input (the op takes 3-D to 5-D)"
    if not isinstance(m["num_groups"], int) or not isinstance(m["eps"], (int, float)):
        return "num_groups or eps is not a constant"
    reason = kernel_missing("group_norm_silu", x, w, b)
    if reason:
        return reason
    for name, t in (("weight", w), ("bias", b)):
        if t is not None and (t.dim() != 1 or value_of(t.shape[0]) != value_of(x.shape[1])):
            return f"{name} is not a per-channel vector"
    return None


REWRITES = [Rewrite(FAMILY, "group_norm_silu", _pattern_1, _replacement_1, _check)]
