"""Attention over every stride-th key => vd::strided_attention.

Matched forms: SDPA on keys and values gathered with a step slice (k[:, :, ::s]); SDPA with a
boolean mask keeping keys j % s == 0; and textbook attention whose scores are masked_fill'ed to
-inf off those keys. Key 0 is always kept, so no row is ever fully masked: a plain softmax and the
op agree there.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from vdcompile.passes._common import Match, Rewrite, kernel_missing, known_equal, static_int
from vdcompile.passes.attention import _sdpa_flags, _shapes

FAMILY = "strided_attention"
_OP = "strided_attention"


# Sparse / dilated temporal attention over long videos (keys subsampled along the frame axis), as
# written on top of diffusers' AttnProcessor2_0: `key = key[:, :, ::stride]`.
def _pattern_slice(q, k, v, stride, attn_mask, dropout_p, is_causal, scale, enable_gqa):
    ks = k[:, :, ::stride]
    vs = v[:, :, ::stride]
    return F.scaled_dot_product_attention(q, ks, vs, attn_mask=attn_mask, dropout_p=dropout_p,
                                          is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)


# The same as a boolean SDPA mask:
# `keep = (torch.arange(n, device=...) % stride == 0).view(1, 1, 1, n)`.
def _pattern_mask(q, k, v, n, device, stride, d0, d1, d2, d3, dropout_p, is_causal, scale, enable_gqa):
    keep = (torch.arange(n, device=device) % stride == 0).view(d0, d1, d2, d3)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=keep, dropout_p=dropout_p,
                                          is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)


# Textbook attention with the same mask applied to the scores.
def _pattern_naive(q, k, v, n, device, stride, scale, fill):
    keep = torch.arange(n, device=device) % stride == 0
    s = torch.matmul(q, k.transpose(-2, -1)) * scale
    s = s.masked_fill(~keep, fill)
    return torch.matmul(s.softmax(dim=-1), v)


def _replacement(q, k, v, stride, scale):
    return torch.ops.vd.strided_attention.default(q, k, v, stride, scale)[0]


def _common(m: Match, lk_full) -> str | None:
    q, k, v = m.val("q"), m.val("k"), m.val("v")
    stride = m["stride"]
    if not isinstance(stride, int) or isinstance(stride, bool) or stride < 1:
        return "stride is not a positive constant"
    reason = _shapes(q, k, v)
    if reason:
        return reason
    if lk_full is not None and not known_equal(lk_full, k.shape[2]):
        return "the mask's length differs from the keys'"
    return kernel_missing(_OP, q, k, v)


def _check_slice(m: Match):
    if m["attn_mask"] is not None:
        return "a mask on top of the strided keys (the op takes none)"
    return _sdpa_flags(m) or _common(m, None)


def _check_mask(m: Match):
    shape = tuple(m[d] for d in ("d0", "d1", "d2", "d3"))
    if shape[:3] != (1, 1, 1) or shape[3] not in (-1, m["n"]):
        return "the mask is not a (1, ..., 1, n) view of the key mask"
    return _sdpa_flags(m) or _common(m, m["n"])


def _check_naive(m: Match):
    if m["fill"] != float("-inf"):
        return "scores are filled with a finite value, not -inf"
    scale = m["scale"]
    if not isinstance(scale, float):
        return "the scale is not a constant"
    q = m.val("q")
    if not isinstance(q, torch.Tensor) or q.dim() != 4:
        return "q is not 4-D"
    return _common(m, m["n"])


REWRITES = [
    Rewrite(FAMILY, "sdpa_step_slice", _pattern_slice, _replacement, _check_slice),
    Rewrite(FAMILY, "sdpa_modulo_mask", _pattern_mask, _replacement, _check_mask),
    Rewrite(FAMILY, "naive_modulo_mask", _pattern_naive, _replacement, _check_naive),
]
