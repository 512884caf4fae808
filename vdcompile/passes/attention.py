"""Attention => vd::fused_attention, and single-key attention => V broadcast over the queries.

Matched forms:
  - F.scaled_dot_product_attention as diffusers' AttnProcessor2_0 calls it (on the projections'
    transposed views, which are passed on as they are: no contiguous copies);
  - diffusers' AttnProcessor (Attention.get_attention_scores): head_to_batch_dim, baddbmm, softmax,
    cast, bmm; with the head split absorbed (the op reads (B, H, L, D) views of the projections
    instead of the (B*H, L, D) copies) or without it;
  - the textbook matmul -> scale -> softmax -> (cast) -> matmul on 3-D or 4-D tensors.
Masks are taken with SDPA only: SDPA and the op both give 0 for a row whose keys are all masked
out, where an additive mask before a plain softmax gives NaN.

With the backend's default attention_kernels="auto", an SDPA call on the CPU is kept as it is
(PyTorch's CPU kernel is faster than vd's), and one on CUDA in fp16/bf16 unless q_len and kv_len
are both <= 32 (vd's short-sequence kernels, forward and backward, are faster than every SDPA
backend: temporal attention over frames) or, on a Hopper GPU with the sm_90a kernel built, both
>= 2048 at head_dim <= 64 without a mask and no gradient needed (vd's wgmma kernel beats cuDNN there:
SVD's spatial self-attention; vd's backward beyond 32 tokens is 0.95-0.99x SDPA's on Hopper, ~0.3x elsewhere). Elsewhere
PyTorch's cuDNN / flash kernels are faster (bench/attention.py; bench/notes/attention.md). fp32 SDPA
calls on CUDA are rewritten up to 32 tokens or at head_dim <= 64: vd's 3xTF32 tensor-core kernels beat
SDPA's fp32 paths there (1.8-2.0x on long sequences on Hopper, ~1.05x elsewhere, 2.8-7x on temporal
attention; at head_dim 128 SDPA's wins); in training only up to 16 tokens, because vd's fp32 backward
runs on the CUDA cores (forward + backward beat SDPA's there only).
The textbook and bmm forms are rewritten (vd's kernels beat their unfused matmuls) except in training
on CUDA in fp32 / fp64, where autograd through the matmuls beats vd's CUDA-core fp32 backward.
"""
from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F

from vdcompile.passes._common import (SKIP, Match, Rewrite, hopper_kernels, kernel_missing, known_equal, requires_grad,
                                      static_int)

FAMILY = "attention"
SINGLE_KEY = "single_key_attention"
_OP = "fused_attention"

# ---------------------------------------------------------------------------------------------------
# F.scaled_dot_product_attention
# ---------------------------------------------------------------------------------------------------


# diffusers AttnProcessor2_0 (models/attention_processor.py), used by every Attention of the SVD,
# AnimateDiff and text-to-video UNets: q/k/v linears, .view(B, -1, heads, d).transpose(1, 2), SDPA.
def _pattern_sdpa(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p,
                                          is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)


def _replacement_sdpa(q, k, v, attn_mask, scale, compute_lse):
    return torch.ops.vd.fused_attention.default(q, k, v, attn_mask, scale, compute_lse)[0]


def _sdpa_flags(m: Match) -> str | None:
    if not isinstance(m["dropout_p"], (int, float)) or m["dropout_p"] != 0:
        return "dropout_p != 0"
    if m["is_causal"] is not False:
        return "is_causal=True (the op has no causal mask)"
    if m["enable_gqa"] is not False:
        return "enable_gqa=True"
    if m["scale"] is not None and not isinstance(m["scale"], float):
        return "scale is not a constant"
    return None


def _shapes(q, k, v) -> str | None:
    """(B, H, L, D) operands of one attention: same B and H, k and q share D, v has k's length."""
    if not all(isinstance(t, torch.Tensor) and t.dim() == 4 for t in (q, k, v)):
        return "q, k, v are not all 4-D"
    if not all(known_equal(a, b) for a, b in ((q.shape[0], k.shape[0]), (k.shape[0], v.shape[0]),
                                                (q.shape[1], k.shape[1]), (k.shape[1], v.shape[1]))):
        return "q, k, v differ in batch or head count (broadcast or grouped heads)"
    if not known_equal(q.shape[3], k.shape[3]) or not known_equal(k.shape[2], v.shape[2]):
        return "mismatched q/k head dims or k/v lengths"
    if not known_equal(q.shape[3], v.shape[3]):
        return "v's head dim differs from q's"
    d = static_int(q.shape[3])
    if d is None or not 1 <= d <= 256:
        return "head dim outside the op's 1..256"
    return None


def _mask_ok(mask, q, k) -> str | None:
    """SDPA's masks as the op takes them: bool (True = keep) or additive float of q's dtype or
    float32, broadcastable to (B, H, Lq, Lk). A row with every key masked out gives 0 from the op
    and from SDPA's math, flash (CPU) and efficient backends, so those masks carry over unchanged;
    the cuDNN backend disagrees for boolean masks in half precision, which are refused."""
    if mask is None:
        return None
    if not isinstance(mask, torch.Tensor):
        return "attn_mask is not a tensor"
    if mask.dtype not in (torch.bool, q.dtype, torch.float32):
        return f"attn_mask dtype {mask.dtype} (the op takes bool, q's dtype or float32)"
    if mask.dtype == torch.bool and q.device.type == "cuda" and q.dtype in (torch.float16, torch.bfloat16):
        # SDPA's cuDNN backend (the default there) gives a fully masked row a nonzero output.
        return "boolean attn_mask in half precision on CUDA (eager's cuDNN SDPA differs on fully masked rows)"
    if mask.dim() > 4:
        return "attn_mask has more than 4 dims"
    target = (q.shape[0], q.shape[1], q.shape[2], k.shape[2])
    for s, t in zip(reversed(mask.shape), reversed(target)):
        if not (known_equal(s, t) or known_equal(s, 1)):
            return "attn_mask does not broadcast to (B, H, Lq, Lk)"
    return None


def _check_sdpa(m: Match):
    q, k, v, mask = m.val("q"), m.val("k"), m.val("v"), m.val("attn_mask")
    _set_compute_lse(m, mask=True)
    return (_sdpa_flags(m) or _shapes(q, k, v) or _mask_ok(mask, q, k)
            or kernel_missing(_OP, q, k, v) or _same_device(mask, q) or _sdpa_faster(m, q, k))


def _set_compute_lse(m: Match, mask: bool = False):
    """The replacement asks for the lse only where the graph needs a gradient through the op (q, k, v or,
    with mask, the SDPA mask requires grad in dynamo's graph); inference graphs call compute_lse=False,
    which spares the fp16 / bf16 short-sequence kernels its writes."""
    m.extra["compute_lse"] = _training(m) or (mask and requires_grad(m["attn_mask"]))


SHORT_MAX = 32  # q_len and kv_len up to which vd's short-sequence CUDA kernel is used
HOPPER_MIN = 2048  # q_len and kv_len from which vd's sm_90a kernel beats cuDNN (head_dim <= 64, no mask)
HOPPER_MAX_DIM = 64


FP32_TRAINING_MAX = 16  # q_len and kv_len up to which vd's fp32 forward + backward beat SDPA's
FP32_MAX_DIM = 64  # head_dim up to which vd's fp32 forward beats SDPA's on long sequences


def _at_most(lq, lk, n: int) -> bool:
    """Both lengths are known constants and at most n."""
    return lq is not None and lk is not None and lq <= n and lk <= n


def _forced_vd(m: Match) -> bool:
    """options={'attention_kernels': 'vd'}: every matched attention goes to vd."""
    return m.ctx is not None and m.ctx.attention_kernels == "vd"


def _sdpa_faster(m: Match, q, k) -> str | None:
    if _forced_vd(m):
        return None
    if q.device.type == "cpu":
        # vd's CPU kernel is 1.5-3.4x slower than PyTorch's CPU SDPA on temporal and spatial shapes.
        return "SDPA kept: PyTorch's CPU kernel is faster than vd's (options={'attention_kernels': 'vd'} forces vd)"
    lq, lk = static_int(q.shape[2]), static_int(k.shape[2])
    if _cuda_wide_float_training(m, q):
        # vd's fp32 / fp64 backward runs on the CUDA cores: with the forward, fp32 gains over SDPA only
        # on temporal attention over <= 16 frames (bench/notes/attention.md, version 6).
        if q.dtype == torch.float32 and _at_most(lq, lk, FP32_TRAINING_MAX):
            return None
        return ("SDPA kept: q, k or v requires grad and vd's fp32 / fp64 backward (CUDA cores) is slower than "
                f"SDPA's beyond {FP32_TRAINING_MAX} tokens (options={{'attention_kernels': 'vd'}} forces vd)")
    d = static_int(q.shape[-1])
    if q.device.type == "cuda" and q.dtype == torch.float32:
        # vd's 3xTF32 kernels beat SDPA's fp32 paths on temporal attention and at head_dim <= 64 (1.8-2.0x on
        # Hopper, ~1.05x with mma.sync); at head_dim 128 SDPA's fp32 kernel wins (vd 0.60x on (4, 16, 8192,
        # 128), bench/notes/attention.md, version 9), and head dims off a multiple of 4 run vd's CUDA-core kernel.
        if _at_most(lq, lk, SHORT_MAX) or (d is not None and d <= FP32_MAX_DIM and d % 4 == 0):
            return None
        return (f"SDPA kept: in fp32 beyond {SHORT_MAX} tokens at head_dim > {FP32_MAX_DIM} or not a multiple of 4, "
                "SDPA's kernel is faster than vd's (options={'attention_kernels': 'vd'} forces vd)")
    if q.device.type != "cuda" or q.dtype not in (torch.float16, torch.bfloat16):
        return None  # fp64: not measured
    if _at_most(lq, lk, SHORT_MAX):
        return None
    if _training(m):
        # vd's long-sequence backward runs at 0.95-0.99x SDPA's on Hopper (the fused wgmma kernel; ~0.75x with
        # its deterministic pair; forward + backward 0.97-1.01x on SVD's spatial shapes), ~0.3x elsewhere
        # (mma.sync): bench/notes/attention.md, versions 6-8 and 15.
        return (f"SDPA kept: q, k or v requires grad and vd's backward beyond {SHORT_MAX} tokens is slower than "
                "SDPA's (options={'attention_kernels': 'vd'} forces vd)")
    if (lq is not None and lk is not None and d is not None and min(lq, lk) >= HOPPER_MIN and d <= HOPPER_MAX_DIM
            and d % 8 == 0 and m.val("attn_mask") is None and hopper_kernels(q.device)):
        return None
    return (f"SDPA kept: its CUDA kernels are faster than vd's beyond {SHORT_MAX} tokens, except from "
            f"{HOPPER_MIN} tokens at head_dim <= {HOPPER_MAX_DIM} without a mask on sm_90 "
            "(options={'attention_kernels': 'vd'} forces vd)")


def _training(m: Match) -> bool:
    return any(requires_grad(m[name]) for name in ("q", "k", "v"))


def _cuda_wide_float_training(m: Match, q) -> bool:
    """fp32 / fp64 on CUDA with a gradient needed: vd's backward then runs on the CUDA cores."""
    return q.device.type == "cuda" and q.dtype in (torch.float32, torch.float64) and _training(m)


def _unfused_faster(m: Match, q) -> str | None:
    """The textbook and bmm forms in training on CUDA in fp32 / fp64: autograd through the matmuls
    (cuBLAS) beats vd's CUDA-core fp32 backward on every measured shape, forward included."""
    if _forced_vd(m):
        return None
    if _cuda_wide_float_training(m, q):
        return ("kept: q, k or v requires grad, and autograd through the matmuls beats vd's fp32 / fp64 "
                "backward (CUDA cores) (options={'attention_kernels': 'vd'} forces vd)")
    return None


def _same_device(mask, q) -> str | None:
    if mask is not None and mask.device != q.device:
        return "attn_mask on another device"
    return None


# ---------------------------------------------------------------------------------------------------
# Single key: softmax over one key is exactly 1, so the output is v broadcast over the queries.
# ---------------------------------------------------------------------------------------------------


# SVD (UNetSpatioTemporalConditionModel): every cross-attention attends to the one CLIP image
# embedding token, through AttnProcessor2_0 (the same SDPA call as above, with kv_len == 1).
def _replacement_single_key(v, q, lq):
    # A dense copy, like SDPA's output: later in-place ops or views behave as on SDPA's result.
    return v.expand(-1, -1, lq if lq is not None else q.size(2), -1).contiguous()


def _check_single_key(m: Match):
    q, k, v = m.val("q"), m.val("k"), m.val("v")
    if not all(isinstance(t, torch.Tensor) for t in (q, k, v)) or k.dim() < 2 or static_int(k.shape[-2]) != 1:
        return SKIP
    if m["attn_mask"] is not None:
        return "a mask could mask out the only key"
    reason = _sdpa_flags(m) or _shapes(q, k, v)
    if reason:
        return reason
    if requires_grad(m["q"]) or requires_grad(m["k"]):
        # Eager gives q and k exactly zero gradients; dropping them would leave .grad unset instead.
        return "q or k requires grad"
    m.extra["lq"] = static_int(q.shape[2])  # None for a dynamic length: read from q in the graph
    return None


# ---------------------------------------------------------------------------------------------------
# diffusers AttnProcessor: baddbmm -> softmax -> cast -> bmm on (B*H, L, D)
# ---------------------------------------------------------------------------------------------------


# diffusers Attention.head_to_batch_dim + get_attention_scores + torch.bmm (AttnProcessor, the
# default before SDPA, still used by AttnProcessor-configured UNets and the VAE's mid-block).
def _pattern_bmm_split(q, k, v, bias, beta, alpha, dtype, b, h, d, bh, lq, lk):
    q3 = q.reshape(b, lq, h, d).permute(0, 2, 1, 3).reshape(bh, lq, d)
    k3 = k.reshape(b, lk, h, d).permute(0, 2, 1, 3).reshape(bh, lk, d)
    v3 = v.reshape(b, lk, h, d).permute(0, 2, 1, 3).reshape(bh, lk, d)
    scores = torch.baddbmm(bias, q3, k3.transpose(-1, -2), beta=beta, alpha=alpha)
    return torch.bmm(scores.softmax(dim=-1).to(dtype), v3)


def _replacement_bmm_split(q, k, v, alpha, b, h, d, bh, lq, lk, compute_lse):
    q4 = q.view(b, lq, h, d).transpose(1, 2)
    k4 = k.view(b, lk, h, d).transpose(1, 2)
    v4 = v.view(b, lk, h, d).transpose(1, 2)
    return torch.ops.vd.fused_attention.default(q4, k4, v4, None, alpha, compute_lse)[0].reshape(bh, lq, d)


def _pattern_bmm(q, k, v, bias, beta, alpha, dtype):
    scores = torch.baddbmm(bias, q, k.transpose(-1, -2), beta=beta, alpha=alpha)
    return torch.bmm(scores.softmax(dim=-1).to(dtype), v)


def _replacement_bmm(q, k, v, alpha, compute_lse):
    out = torch.ops.vd.fused_attention.default(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), None, alpha,
                                               compute_lse)[0]
    return out.squeeze(0)


# SDPA gives 0 for a row whose keys are all masked out, like the op; a plain softmax gives NaN.
_SOFTMAX_MASK = ("additive mask before a plain softmax: a row with every key at -inf is NaN in eager "
                 "but 0 from the op")


def _baddbmm_no_mask(m: Match) -> str | None:
    """baddbmm's input is ignored when beta == 0 (diffusers passes an uninitialised torch.empty
    when there is no mask); with beta == 1 it is an additive mask, which is refused."""
    beta, alpha = m["beta"], m["alpha"]
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool):
        return "alpha is not a constant"
    if isinstance(beta, bool) or beta not in (0, 1):
        return "baddbmm beta is neither 0 nor 1"
    if beta == 1:
        return _SOFTMAX_MASK
    m.extra["alpha"] = float(alpha)
    return None


def _softmax_cast_ok(m: Match, probs_dtype) -> str | None:
    if m["dtype"] != probs_dtype:
        return "softmax output cast to another dtype (upcast attention)"
    return None


def _check_bmm(m: Match):
    q, k, v = m.val("q"), m.val("k"), m.val("v")
    reason = _baddbmm_no_mask(m)
    if reason:
        return reason
    if not all(isinstance(t, torch.Tensor) and t.dim() == 3 for t in (q, k, v)):
        return "q, k, v are not all 3-D"
    q4, k4, v4 = (t.unsqueeze(0) for t in (q, k, v))
    return _softmax_cast_ok(m, q.dtype) or _shapes(q4, k4, v4) or kernel_missing(_OP, q, k, v)


def _check_bmm_split(m: Match):
    reason = _baddbmm_no_mask(m)
    if reason:
        return reason
    q, k, v = m.val("q"), m.val("k"), m.val("v")
    ints = {n: m[n] for n in ("b", "h", "d", "bh", "lq", "lk")}
    if not all(isinstance(x, int) for x in ints.values()):
        return "head split sizes are not constants"
    if ints["b"] * ints["h"] != ints["bh"]:
        return "head split sizes are inconsistent"
    for t, L in ((q, ints["lq"]), (k, ints["lk"]), (v, ints["lk"])):
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != (ints["b"], L, ints["h"] * ints["d"]):
            return "projection shapes differ from the head split"
    q4 = q.view(ints["b"], ints["lq"], ints["h"], ints["d"]).transpose(1, 2)
    k4 = k.view(ints["b"], ints["lk"], ints["h"], ints["d"]).transpose(1, 2)
    v4 = v.view(ints["b"], ints["lk"], ints["h"], ints["d"]).transpose(1, 2)
    return _softmax_cast_ok(m, q.dtype) or _shapes(q4, k4, v4) or kernel_missing(_OP, q, k, v)


# Single key in AttnProcessor's form (cross-attention to one token through baddbmm/bmm): the
# probabilities are all 1, so the output is the (head-split) v repeated over the queries.
def _replacement_bmm_split_one_key(v, b, h, d, bh, lq):
    v3 = v.reshape(b, 1, h, d).permute(0, 2, 1, 3).reshape(bh, 1, d)
    return v3.expand(bh, lq, d).contiguous()  # dense, like bmm's output


def _replacement_bmm_one_key(q, v):
    return v.expand(-1, q.size(1), -1).contiguous()


def _check_one_key_bmm(m: Match, lk):
    if lk != 1:
        return SKIP
    if m["beta"] != 0:
        return "a mask could mask out the only key"
    v = m.val("v")
    if requires_grad(m["q"]) or requires_grad(m["k"]):
        return "q or k requires grad"  # eager gives them zero gradients, the rewrite none
    return _softmax_cast_ok(m, v.dtype)


def _check_bmm_split_one_key(m: Match):
    ints = [m[n] for n in ("b", "h", "d", "bh", "lq", "lk")]
    if not all(isinstance(x, int) for x in ints):
        return SKIP if m["lk"] != 1 else "head split sizes are not constants"
    reason = _check_one_key_bmm(m, m["lk"])
    return reason or _check_bmm_split(m)


def _check_bmm_one_key(m: Match):
    k = m.val("k")
    if not isinstance(k, torch.Tensor) or k.dim() != 3:
        return SKIP
    reason = _check_one_key_bmm(m, static_int(k.shape[1]))
    return reason or _check_bmm(m)


# ---------------------------------------------------------------------------------------------------
# Textbook attention: q @ k^T -> scale -> softmax -> (cast) -> @ v, 3-D or 4-D
# ---------------------------------------------------------------------------------------------------


def _naive(scale_form: str, masked: bool, cast: bool):
    """Pattern, replacement and check of one spelling (generated: the spellings multiply). The
    masked spellings are matched only to report why they are refused."""

    # AnimateDiff's original motion module / VersatileAttention and hand-written temporal attention:
    # `attn = (q @ k.transpose(-2, -1)) * scale; attn = attn.softmax(dim=-1); out = attn @ v`.
    def pattern(q, k, v, scale, mask, dtype):
        if scale_form == "q_mul":
            s = torch.matmul(q * scale, k.transpose(-2, -1))
        else:
            s = torch.matmul(q, k.transpose(-2, -1))
            s = s * scale if scale_form == "mul" else s / scale
        if masked:
            s = s + mask
        p = s.softmax(dim=-1)
        if cast:
            p = p.to(dtype)
        return torch.matmul(p, v)

    def replacement(q, k, v, scale_value, squeeze, compute_lse):
        if squeeze:
            q, k, v = q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0)
        out = torch.ops.vd.fused_attention.default(q, k, v, None, scale_value, compute_lse)[0]
        return out.squeeze(0) if squeeze else out

    def check(m: Match):
        q, k, v = m.val("q"), m.val("k"), m.val("v")
        if not all(isinstance(t, torch.Tensor) for t in (q, k, v)) or {q.dim(), k.dim(), v.dim()} not in ({3}, {4}):
            return "q, k, v are not all 3-D or all 4-D"
        if masked:
            return _SOFTMAX_MASK
        scale = m["scale"]
        if not isinstance(scale, (int, float)) or isinstance(scale, bool) or scale == 0:
            return "the scale is not a nonzero constant"
        m.extra["scale_value"] = float(scale) if scale_form != "div" else 1.0 / float(scale)
        squeeze = q.dim() == 3
        m.extra["squeeze"] = squeeze
        _set_compute_lse(m)
        if cast and m["dtype"] != q.dtype:
            return "softmax output cast to another dtype"
        q4, k4, v4 = (t.unsqueeze(0) if squeeze else t for t in (q, k, v))
        return _shapes(q4, k4, v4) or kernel_missing(_OP, q, k, v) or _unfused_faster(m, q)

    tag = f"naive_{scale_form}{'_mask' if masked else ''}{'_cast' if cast else ''}"
    return Rewrite(FAMILY, tag, pattern, replacement, check)


def _vd_bmm(check):
    """A bmm form's check for the vd rewrite (the single-key ones share the structural checks)."""
    def run(m: Match):
        _set_compute_lse(m)
        reason = check(m)
        return reason if reason is not None else _unfused_faster(m, m.val("q"))
    return run


REWRITES = [
    Rewrite(SINGLE_KEY, "sdpa_one_key", _pattern_sdpa, _replacement_single_key, _check_single_key),
    Rewrite(SINGLE_KEY, "bmm_head_split_one_key", _pattern_bmm_split, _replacement_bmm_split_one_key,
            _check_bmm_split_one_key),
    Rewrite(SINGLE_KEY, "bmm_one_key", _pattern_bmm, _replacement_bmm_one_key, _check_bmm_one_key),
    Rewrite(FAMILY, "sdpa", _pattern_sdpa, _replacement_sdpa, _check_sdpa),
    Rewrite(FAMILY, "bmm_head_split", _pattern_bmm_split, _replacement_bmm_split, _vd_bmm(_check_bmm_split)),
    Rewrite(FAMILY, "bmm", _pattern_bmm, _replacement_bmm, _vd_bmm(_check_bmm)),
    *(_naive(s, mk, c) for s, mk, c in itertools.product(("mul", "div", "q_mul"), (True, False), (True, False))),
]
