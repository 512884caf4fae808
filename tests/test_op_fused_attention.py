"""vd::fused_attention: opcheck, equivalence with the float64 reference, gradients, properties, bad inputs."""
from __future__ import annotations

import contextlib
import math
import re

import pytest
import torch
from hypothesis import given, settings, strategies as st

from tests.common import DTYPES, cuda_kernels_run, device_params, opcheck_test, set_env
from vdcompile.ops import fused_attention, reference_fused_attention

OP = torch.ops.vd.fused_attention.default
BWD = torch.ops.vd.fused_attention_backward.default
DEVICES = device_params("fused_attention")

# Accuracy bound, flash-attention style, against the float64 reference ref64:
#   max|out - ref64| <= 2 * max|out_torch - ref64| + ULPS[dtype] * eps(dtype) * (1 + max|ref64|) + score_term
# out_torch is the plain matmul-softmax-matmul in the input dtype (what a model computes without the
# kernel). The ulp term covers cases where PyTorch's error happens to be ~0 (e.g. kv_len 1).
# score_term = eps(float32) * max|S| * max|v| is one float32 rounding of the largest score carried
# to the output (d out = sum_j P_j dS_j (v_j - out)): the kernel's scores are float32 sums in
# another order than PyTorch's, so with large scores (scale * sqrt(head_dim) >> 1) the two errors
# are independent and a single row of PyTorch's can be luckily small. It is ~1e-6 at usual scales.
FACTOR = 2.0
ULPS = {torch.float32: 8, torch.float16: 2, torch.bfloat16: 2}


def score_term(q, k, v, attn_mask=None, scale=None):
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    s = ((q.double() @ k.double().transpose(-2, -1)) * scale).abs().max()
    if attn_mask is not None and attn_mask.is_floating_point():
        finite = attn_mask[torch.isfinite(attn_mask)]
        s = s + (finite.abs().max() if finite.numel() else 0)
    return torch.finfo(torch.float32).eps * s.item() * v.double().abs().max().item()


def assert_within_torch_error(got, torch_lowprec, ref64, dtype, what, extra_atol=0.0):
    got, torch_lowprec = got.double(), torch_lowprec.double()
    assert torch.isfinite(got).all(), f"{what}: non-finite values"
    if ref64.numel() == 0:
        return
    err = (got - ref64).abs().max().item()
    # Plain PyTorch gives NaN on fully masked rows (the op defines them as 0): its error is taken over
    # the rows it does define, and ours must hold everywhere.
    finite = torch.isfinite(torch_lowprec)
    torch_err = (torch_lowprec - ref64)[finite].abs().max().item() if finite.any() else 0.0
    bound = FACTOR * torch_err + ULPS[dtype] * torch.finfo(dtype).eps * (1 + ref64.abs().max().item()) + extra_atol
    assert err <= bound, f"{what}: max error {err:.3e} > {bound:.3e} (torch {dtype} error {torch_err:.3e})"


def lowprec_attention(q, k, v, attn_mask=None, scale=None):
    """Plain PyTorch attention in the inputs' dtype: the accuracy baseline."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    s = (q @ k.transpose(-2, -1)) * scale
    if attn_mask is not None:
        s = s.masked_fill(~attn_mask, float("-inf")) if attn_mask.dtype == torch.bool else s + attn_mask.to(q.dtype)
    return torch.softmax(s, dim=-1) @ v, torch.logsumexp(s, dim=-1)


def make_qkv(B, H, Lq, Lk, D, dtype=torch.float32, layout="contiguous", device="cpu", gen=None):
    """q (B, H, Lq, D), k and v (B, H, Lk, D) in one of the layouts models hand to attention."""
    def randn(*shape):
        return torch.randn(*shape, generator=gen, device=device).to(dtype)
    if layout == "contiguous":
        return randn(B, H, Lq, D), randn(B, H, Lk, D), randn(B, H, Lk, D)
    if layout == "bnhd":  # diffusers' (B, N, H, D) -> (B, H, N, D) transpose
        return (randn(B, Lq, H, D).transpose(1, 2), randn(B, Lk, H, D).transpose(1, 2),
                randn(B, Lk, H, D).transpose(1, 2))
    if layout == "packed_kv":  # k and v as slices of one (B, N, 2, H, D) projection
        kv = randn(B, Lk, 2, H, D)
        return randn(B, Lq, H, D).transpose(1, 2), kv[:, :, 0].transpose(1, 2), kv[:, :, 1].transpose(1, 2)
    if layout == "d_strided":  # head_dim elements not adjacent
        return randn(B, H, Lq, 2 * D)[..., ::2], randn(B, H, Lk, 2 * D)[..., ::2], randn(B, H, Lk, 2 * D)[..., 1::2]
    raise ValueError(layout)


def sample_inputs(device, requires_grad):
    def rg(*ts):
        return tuple(t.requires_grad_(requires_grad) if t.is_floating_point() else t for t in ts)

    def qkv(*shape, layout="contiguous"):
        q, k, v = make_qkv(*shape, layout=layout, device=device)
        if layout != "contiguous":  # views must stay views: make the leaf first, then view it
            q, k, v = (t.detach() for t in (q, k, v))
        return rg(q, k, v)

    q, k, v = qkv(2, 3, 17, 23, 16)
    bool_mask = torch.rand(17, 23, device=device) > 0.3
    bool_mask[4] = False  # one fully masked row
    float_mask = torch.randn(2, 1, 1, 23, device=device)
    head_mask = torch.randn(3, 17, 1, device=device)
    samples = [
        (q, k, v),
        (*qkv(2, 3, 17, 23, 16, layout="bnhd"), None, 0.3),
        (*qkv(1, 2, 9, 70, 8, layout="packed_kv"),),
        (*qkv(1, 2, 9, 11, 8, layout="d_strided"),),
        (q, k, v, bool_mask),
        (q, k, v, *rg(float_mask)),
        (q, k, v, *rg(head_mask), 0.5),
        (*qkv(2, 2, 40, 1, 8),),                      # cross-attention with a single key
        (*qkv(1, 2, 5, 7, 1),),                       # head_dim 1
        (*qkv(1, 1, 33, 65, 256),),                   # head_dim 256, crosses both tile sizes
    ]
    k_bcast = torch.randn(2, 1, 23, 16, device=device).expand(2, 3, 23, 16)  # stride-0 heads
    samples.append((q.detach(), k_bcast, v.detach()))
    if not requires_grad:  # no lse, no backward
        samples += [(q, k, v, None, None, False), (*qkv(2, 3, 14, 14, 16, layout="bnhd"), bool_mask[:14, :14], 0.3, False)]
    return samples


test_opcheck = opcheck_test(OP, sample_inputs, DEVICES)


@st.composite
def attention_cases(draw):
    dtype = draw(st.sampled_from(DTYPES))
    Lq = draw(st.sampled_from([1, 2, 13, 32, 33, 127, 1000]))
    Lk = draw(st.sampled_from([1, 2, 13, 64, 65, 127, 1000]))
    D = draw(st.sampled_from([8, 13, 32, 64, 96, 256]))
    B, H = draw(st.integers(1, 2)), draw(st.integers(1, 3))
    if Lq * Lk > 20000:  # long sequences: one head of a moderate head_dim keeps CPU time low
        B, H, D = 1, 1, min(D, 64)
    layout = draw(st.sampled_from(["contiguous", "bnhd", "packed_kv", "d_strided"]))
    mask = draw(st.sampled_from([None, "bool", "float", "float32"]))
    keep_dims = draw(st.lists(st.booleans(), min_size=4, max_size=4))
    drop_leading = draw(st.integers(0, 2))
    scale = draw(st.one_of(st.none(), st.floats(0.05, 2.0)))
    seed = draw(st.integers(0, 2**31 - 1))
    return dict(dtype=dtype, shape=(B, H, Lq, Lk, D), layout=layout, mask=mask, keep_dims=keep_dims,
                drop_leading=drop_leading, scale=scale, seed=seed)


def make_mask(kind, full_shape, keep_dims, drop_leading, dtype, device, gen):
    """A mask of a broadcastable shape: some dims of (B, H, Lq, Lk) set to 1, some leading ones dropped."""
    if kind is None:
        return None
    shape = [s if keep else 1 for s, keep in zip(full_shape, keep_dims)][drop_leading:]
    if kind == "bool":
        return torch.rand(shape, generator=gen, device=device) < 0.8
    m = torch.randn(shape, generator=gen, device=device) * 2
    m = m.masked_fill(torch.rand(shape, generator=gen, device=device) < 0.1, float("-inf"))
    return m.to(dtype if kind == "float" else torch.float32)


@pytest.mark.parametrize("device", DEVICES)
@settings(max_examples=60, deadline=None)
@given(case=attention_cases())
def test_matches_reference(device, case):
    dtype, (B, H, Lq, Lk, D) = case["dtype"], case["shape"]
    gen = torch.Generator(device=device).manual_seed(case["seed"])
    q, k, v = make_qkv(B, H, Lq, Lk, D, dtype, case["layout"], device, gen)
    mask = make_mask(case["mask"], (B, H, Lq, Lk), case["keep_dims"], case["drop_leading"], dtype, device, gen)
    scale = case["scale"]

    out, lse = OP(q, k, v, mask, scale)
    assert out.dtype == dtype and out.shape == (B, H, Lq, D) and out.is_contiguous()
    assert lse.dtype == torch.float32 and lse.shape == (B, H, Lq)
    ref_out, ref_lse = reference_fused_attention(q.double(), k.double(), v.double(), mask, scale)
    torch_out, torch_lse = lowprec_attention(q, k, v, mask, scale)

    # Rows with every key masked out: defined as 0 / -inf (plain softmax gives NaN there).
    empty = torch.isneginf(ref_lse)
    assert (out[empty] == 0).all() and torch.isneginf(lse[empty]).all()
    live = ~empty
    assert_within_torch_error(out[live], torch_out[live], ref_out[live], dtype, "out",
                              score_term(q, k, v, mask, scale))
    assert_within_torch_error(lse[live], torch_lse[live], ref_lse[live], dtype, "lse")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape,layout,mask_kind", [
    ((2, 3, 37, 70, 16), "bnhd", None),
    ((1, 2, 33, 1, 64), "contiguous", None),
    ((2, 2, 20, 45, 32), "packed_kv", "bool"),
    ((1, 2, 9, 130, 128), "contiguous", "float"),
])
def test_gradients_match_reference_low_precision(device, dtype, shape, layout, mask_kind):
    B, H, Lq, Lk, D = shape
    gen = torch.Generator(device=device).manual_seed(sum(shape))
    q, k, v = (t.requires_grad_() for t in make_qkv(*shape, dtype, layout, device, gen))
    mask = make_mask(mask_kind, (B, H, Lq, Lk), [False, True, True, True], 1, dtype, device, gen)
    if mask is not None and mask.dtype == torch.bool:
        mask[..., 0] = True  # no fully masked rows: the baseline would be NaN there
    if mask is not None and mask.is_floating_point():
        mask[..., 0] = 0.0
    check_gradients(q, k, v, mask, dtype, gen)


def check_gradients(q, k, v, mask, dtype, gen):
    """dq, dk, dv (from out's and lse's gradients) within PyTorch's own same-dtype gradient error of
    the float64 reference. The mask must leave every row a key (the baseline is NaN otherwise)."""
    B, H, Lq, D = q.shape
    g_out = torch.randn(B, H, Lq, D, generator=gen, device=q.device).to(dtype)
    g_lse = torch.randn(B, H, Lq, generator=gen, device=q.device)

    out, lse = OP(q, k, v, mask)
    got = torch.autograd.grad((out, lse), (q, k, v), (g_out, g_lse))
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref = torch.autograd.grad(reference_fused_attention(q64, k64, v64, mask), (q64, k64, v64),
                              (g_out.double(), g_lse.double()))
    t_out, t_lse = lowprec_attention(q, k, v, mask)
    base = torch.autograd.grad((t_out, t_lse), (q, k, v), (g_out, g_lse.to(t_lse.dtype)))
    for name, g, r, b in zip("qkv", got, ref, base):
        assert g.dtype == dtype and g.shape == r.shape
        assert_within_torch_error(g, b, r, dtype, f"grad {name}")


# ---- float64 gradcheck (q, k, v, float masks, lse used downstream) ----

def _f64(*shape, layout="contiguous"):
    q, k, v = make_qkv(*shape, torch.float64, layout, gen=torch.Generator().manual_seed(7))
    return tuple(t.detach().requires_grad_() for t in (q, k, v))


@pytest.mark.parametrize("shape,layout", [
    ((2, 2, 5, 7, 4), "contiguous"),
    ((1, 2, 33, 70, 3), "bnhd"),       # several query and key tiles
    ((2, 1, 6, 1, 5), "packed_kv"),    # a single key
])
def test_gradcheck_qkv_out_and_lse(shape, layout):
    q, k, v = _f64(*shape, layout=layout)
    fast = q.numel() + k.numel() > 500
    assert torch.autograd.gradcheck(lambda q, k, v: OP(q, k, v), (q, k, v), fast_mode=fast)
    # lse alone downstream: the output's gradient is then all zeros.
    assert torch.autograd.gradcheck(lambda q, k, v: OP(q, k, v, None, 0.7)[1], (q, k, v), fast_mode=fast)


@pytest.mark.parametrize("mask_shape", [(5, 7), (2, 1, 1, 7), (1, 2, 5, 1), (2, 2, 5, 7), (7,)])
def test_gradcheck_float_mask(mask_shape):
    q, k, v = _f64(2, 2, 5, 7, 4)
    mask = torch.randn(mask_shape, dtype=torch.float64, requires_grad=True)
    # Full Jacobians for one broadcast shape; random projections (fast mode) for the others.
    fast = mask_shape != (5, 7)
    assert torch.autograd.gradcheck(lambda q, k, v, m: OP(q, k, v, m), (q, k, v, mask), fast_mode=fast)


def test_gradcheck_mask_only_requires_grad():
    q, k, v = (t.detach() for t in _f64(2, 2, 5, 7, 4))
    mask = torch.randn(2, 1, 5, 7, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda m: fused_attention(q, k, v, m), (mask,))


def test_gradcheck_bool_mask():
    q, k, v = _f64(1, 2, 6, 9, 4)
    mask = torch.rand(2, 6, 9, generator=torch.Generator().manual_seed(3)) > 0.4
    mask[:, :, 0] = True  # lse of a fully masked row is -inf: finite differences are undefined there
    assert torch.autograd.gradcheck(lambda q, k, v: OP(q, k, v, mask), (q, k, v))


def test_float32_mask_grad_with_half_inputs():
    """A float32 mask on half inputs gets a float32 gradient equal to the float64 reference's."""
    q, k, v = (t.half() for t in make_qkv(1, 2, 6, 9, 8, gen=torch.Generator().manual_seed(5)))
    mask = torch.randn(6, 9, requires_grad=True)
    g = torch.randn(1, 2, 6, 8).half()
    (dm,) = torch.autograd.grad(fused_attention(q, k, v, mask), mask, g)
    m64 = mask.detach().double().requires_grad_()
    (dm_ref,) = torch.autograd.grad(reference_fused_attention(q.double(), k.double(), v.double(), m64)[0], m64,
                                    g.double())
    assert dm.dtype == torch.float32
    torch.testing.assert_close(dm.double(), dm_ref, atol=2e-3, rtol=2e-2)


# ---- properties ----

def _forward_backward(q, k, v, mask=None, g_seed=0):
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    out, lse = OP(q, k, v, mask)
    gen = torch.Generator().manual_seed(g_seed)
    g_out, g_lse = torch.randn(out.shape, generator=gen).to(out.dtype), torch.randn(lse.shape, generator=gen)
    grads = torch.autograd.grad((out, lse), (q, k, v), (g_out, g_lse))
    return (out, lse, *grads)


def assert_heads_independent(run, q, k, v, gen):
    """Redrawing (batch 1, head 2) of q, k, v changes that head's (out, lse, dq, dk, dv) from
    ``run(q, k, v)`` and leaves every other head's bit for bit."""
    before = run(q, k, v)
    q2, k2, v2 = (t.clone() for t in (q, k, v))
    for t in (q2, k2, v2):
        t[1, 2] = torch.randn(t[1, 2].shape, generator=gen).to(t.dtype)
    after = run(q2, k2, v2)
    other = torch.ones(q.shape[0], q.shape[1], dtype=torch.bool)
    other[1, 2] = False
    for name, x, y in zip(["out", "lse", "dq", "dk", "dv"], before, after):
        assert torch.equal(x[other], y[other]), f"{name} of an untouched head changed"
        assert not torch.equal(x[1, 2], y[1, 2]), f"{name} of the changed head did not change"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_no_cross_contamination(dtype):
    """Changing one (batch, head)'s q, k, v changes that head's outputs and gradients only."""
    B, H, Lq, Lk, D = 3, 4, 37, 45, 16
    gen = torch.Generator().manual_seed(11)
    q, k, v = make_qkv(B, H, Lq, Lk, D, dtype, "bnhd", gen=gen)
    mask = torch.randn(Lq, Lk, generator=gen)  # shared by every (batch, head)
    assert_heads_independent(lambda q, k, v: _forward_backward(q, k, v, mask), q, k, v, gen)


def test_deterministic_and_thread_count_independent():
    gen = torch.Generator().manual_seed(1)
    q, k, v = make_qkv(2, 3, 70, 130, 32, torch.float32, "bnhd", gen=gen)
    mask = torch.randn(2, 1, 70, 130, generator=gen)
    first = _forward_backward(q, k, v, mask)
    second = _forward_backward(q, k, v, mask)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        single = _forward_backward(q, k, v, mask)
    finally:
        torch.set_num_threads(threads)
    for a, b, c in zip(first, second, single):
        assert torch.equal(a, b) and torch.equal(a, c)


@pytest.mark.parametrize("dtype", DTYPES)
def test_large_scores_stay_finite(dtype):
    """Scores far outside the low-precision range (|S| ~ 1e5) and finfo.min masks: finite, one-hot-like."""
    gen = torch.Generator().manual_seed(2)
    q, k, v = make_qkv(1, 2, 20, 50, 64, torch.float32, gen=gen)
    q, k, v = (q * 40).to(dtype), (k * 40).to(dtype), v.to(dtype)
    mask = torch.zeros(20, 50, dtype=dtype)
    mask[:, 25:] = torch.finfo(dtype).min
    for m in (None, mask):
        out, lse, dq, dk, dv = _forward_backward(q, k, v, m)
        for t in (out, lse, dq, dk, dv):
            assert torch.isfinite(t).all()
        ref_out, ref_lse = reference_fused_attention(q.double(), k.double(), v.double(), m, scale=1 / 8)
        assert lse.abs().max() > 1e3  # the scores really are large
        torch.testing.assert_close(out.double(), ref_out.double(), atol=torch.finfo(dtype).eps * 4, rtol=0)
        torch.testing.assert_close(lse.double(), ref_lse.double(), atol=0, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("kind", ["bool", "float"])
def test_fully_masked_rows(dtype, kind):
    """All-False / all -inf rows: out 0, lse -inf, zero gradients; other rows as if those were absent."""
    B, H, Lq, Lk, D = 2, 2, 40, 70, 8
    gen = torch.Generator().manual_seed(4)
    q, k, v = make_qkv(B, H, Lq, Lk, D, dtype, "bnhd", gen=gen)
    keep = torch.rand(B, 1, Lq, Lk, generator=gen) > 0.3
    keep[..., 0] = True
    dead = torch.zeros(Lq, dtype=torch.bool)
    dead[[0, 5, 33, 39]] = True  # in both query tiles
    keep[:, :, dead] = False
    if kind == "bool":
        mask = keep
    else:
        mask = torch.zeros(keep.shape, dtype=dtype).masked_fill(~keep, float("-inf")).requires_grad_()
    out, lse, dq, dk, dv = _forward_backward(q, k, v, mask)
    assert (out[:, :, dead] == 0).all() and torch.isneginf(lse[:, :, dead]).all()
    assert torch.isfinite(out).all() and torch.isfinite(lse[:, :, ~dead]).all()
    assert (dq[:, :, dead] == 0).all()
    for g in (dq, dk, dv):
        assert torch.isfinite(g).all()
    # dk, dv: the dead rows contribute nothing, so they match attention over the live rows alone.
    ql, ml = q[:, :, ~dead].detach().requires_grad_(), mask[:, :, ~dead].detach()
    kl, vl = k.detach().requires_grad_(), v.detach().requires_grad_()
    out_l, lse_l = OP(ql, kl, vl, ml)
    gen = torch.Generator().manual_seed(0)  # the same upstream gradients as _forward_backward drew
    g_out = torch.randn(out.shape, generator=gen).to(dtype)
    g_lse = torch.randn(lse.shape, generator=gen)
    g_lse = g_lse.to(lse.dtype)
    dkl, dvl = torch.autograd.grad((out_l, lse_l), (kl, vl), (g_out[:, :, ~dead], g_lse[:, :, ~dead]))
    tol = dict(atol=1e-12, rtol=1e-10) if dtype == torch.float64 else dict(atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(dk, dkl, **tol)
    torch.testing.assert_close(dv, dvl, **tol)
    if kind == "float":
        out, lse = OP(q, k, v, mask)
        (dmask,) = torch.autograd.grad((out, lse), mask, (g_out, g_lse))
        assert torch.isfinite(dmask).all() and (dmask[:, :, dead] == 0).all()
        assert (dmask[:, :, ~dead] != 0).any()


def test_reads_views_without_copies():
    """Transposed, packed and broadcast inputs are read in place: no copy is recorded."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = make_qkv(2, 3, 40, 50, 16, torch.float32, "packed_kv", gen=gen)
    q, k, v = (t.requires_grad_() for t in (q.detach(), k.detach(), v.detach()))
    mask = torch.randn(40, 50, generator=gen)
    out, lse = OP(q, k, v, mask)
    g = torch.randn(out.shape, generator=gen).transpose(1, 2).contiguous().transpose(1, 2)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        OP(q.detach(), k.detach(), v.detach(), mask)
        BWD(g, q.detach(), k.detach(), v.detach(), out.detach(), lse.detach(), mask, None, None)
    names = {e.name for e in prof.events()}
    assert "vd::fused_attention" in names and "vd::fused_attention_backward" in names
    assert not names & {"aten::copy_", "aten::clone", "aten::contiguous", "aten::to", "aten::_to_copy"}, names


def test_wrapper_returns_op_output():
    gen = torch.Generator().manual_seed(0)
    q, k, v = make_qkv(1, 2, 5, 6, 8, gen=gen)
    assert torch.equal(fused_attention(q, k, v, None, 0.3), OP(q, k, v, None, 0.3)[0])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape,layout,mask_kind", [
    ((3, 2, 14, 14, 64), "bnhd", None),        # the short kernels
    ((2, 2, 25, 25, 40), "contiguous", "bool"),
    ((1, 2, 70, 90, 64), "packed_kv", "float"),  # the long-sequence kernels
])
def test_compute_lse_false_returns_the_same_out_and_an_empty_lse(device, dtype, shape, layout, mask_kind):
    B, H, Lq, Lk, D = shape
    gen = torch.Generator(device=device).manual_seed(sum(shape))
    q, k, v = make_qkv(B, H, Lq, Lk, D, dtype, layout, device, gen)
    mask = make_mask(mask_kind, (B, H, Lq, Lk), [True, False, True, True], 0, dtype, device, gen)
    out, lse = OP(q, k, v, mask, None)
    out_only, no_lse = OP(q, k, v, mask, None, compute_lse=False)
    assert torch.equal(out_only, out)
    assert no_lse.shape == (B, H, 0) and no_lse.dtype == lse.dtype and no_lse.device == lse.device


@pytest.mark.parametrize("compiled", [False, True])
def test_compute_lse_false_backward_recomputes_the_lse(compiled):
    # A gradient through a call without the lse (AOTAutograd traces one for any compiled call on inputs that
    # require grad): the backward recomputes the lse; gradients as with it, also of a float mask.
    gen = torch.Generator().manual_seed(0)
    q, k, v = make_qkv(2, 2, 5, 6, 8, gen=gen)
    mask = torch.randn(5, 6, generator=gen)
    g = torch.randn(2, 2, 5, 8, generator=gen)

    def grads(compute_lse):
        leaves = [t.detach().requires_grad_() for t in (q, k, v, mask)]
        fn = lambda *a: OP(*a, None, compute_lse)[0]  # noqa: E731
        out = (torch.compile(fn, backend="aot_eager", fullgraph=True) if compiled else fn)(*leaves)
        return torch.autograd.grad(out, leaves, g)

    for got, want in zip(grads(False), grads(True)):
        torch.testing.assert_close(got, want, atol=0, rtol=0)


@pytest.mark.parametrize("device", [*DEVICES, "meta"])
def test_compute_lse_false_empty_batch(device):
    q = torch.randn(0, 3, 5, 8, device=device, dtype=torch.float64)
    out, lse = OP(q, q, q, None, None, False)
    assert out.shape == (0, 3, 5, 8) and lse.shape == (0, 3, 0) and lse.dtype == torch.float64


class _RecordOps(torch.utils._python_dispatch.TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls.append((func, args, kwargs or {}))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("grad_mode,requires_grad,expected", [
    (True, True, True), (False, True, False), (True, False, False)])
def test_wrapper_asks_for_the_lse_only_when_a_gradient_can_flow(grad_mode, requires_grad, expected):
    gen = torch.Generator().manual_seed(0)
    q, k, v = make_qkv(1, 2, 5, 6, 8, gen=gen)
    q.requires_grad_(requires_grad)
    with torch.set_grad_enabled(grad_mode), _RecordOps() as rec:
        fused_attention(q, k, v)
    (call,) = [(a, kw) for f, a, kw in rec.calls if f is OP]
    args, kwargs = call
    compute_lse = args[5] if len(args) > 5 else kwargs.get("compute_lse", True)  # a default may be left out
    assert compute_lse is expected


def test_float64_precision():
    gen = torch.Generator().manual_seed(0)
    q, k, v = make_qkv(2, 2, 50, 90, 24, torch.float64, "bnhd", gen=gen)
    out, lse = OP(q, k, v)
    assert lse.dtype == torch.float64
    ref_out, ref_lse = reference_fused_attention(q, k, v)
    torch.testing.assert_close(out, ref_out, atol=1e-13, rtol=0)
    torch.testing.assert_close(lse, ref_lse, atol=1e-13, rtol=0)


# ---- bad inputs (the CPU kernel and, on meta tensors, the fake kernel give the same errors) ----

@pytest.mark.parametrize("device", [*DEVICES, "meta"])
def test_bad_inputs(device):
    def t(*shape, dtype=torch.float32):
        return torch.randn(*shape).to(dtype=dtype, device=device)

    q, k, v = t(2, 3, 5, 8), t(2, 3, 7, 8), t(2, 3, 7, 8)
    cases = [
        ((t(3, 5, 8), k, v), RuntimeError, r"q must be 4-D \(batch, heads, q_len, head_dim\), got 3-D"),
        ((q, t(2, 3, 7), v), RuntimeError, r"k must be 4-D"),
        ((q, k, t(2, 3, 7, 8, 1)), RuntimeError, r"v must be 4-D"),
        ((q, t(2, 3, 7, 8, dtype=torch.float16), v), TypeError, r"k has dtype .* but q has dtype"),
        ((q, k, t(2, 3, 7, 8, dtype=torch.float64)), TypeError, r"v has dtype .* but q has dtype"),
        ((q.int(), k.int(), v.int()), TypeError, r"q must be float32, float16, bfloat16 or float64"),
        ((t(2, 3, 5, 257), t(2, 3, 7, 257), t(2, 3, 7, 257)), RuntimeError, r"head_dim \(q.size\(3\)\) must be in 1..256, got 257"),
        ((t(2, 3, 5, 0), t(2, 3, 7, 0), t(2, 3, 7, 0)), RuntimeError, r"head_dim .* got 0"),
        ((q, t(2, 4, 7, 8), t(2, 4, 7, 8)), RuntimeError, r"k must have shape \(2, 3, kv_len, 8\)"),
        ((q, t(1, 3, 7, 8), t(1, 3, 7, 8)), RuntimeError, r"k must have shape \(2, 3, kv_len, 8\)"),
        ((q, t(2, 3, 7, 4), t(2, 3, 7, 4)), RuntimeError, r"k must have shape"),
        ((q, k, t(2, 3, 6, 8)), RuntimeError, r"v must have the same shape as k"),
        ((t(2, 3, 0, 8), k, v), RuntimeError, r"q_len and kv_len must be >= 1"),
        ((q, t(2, 3, 0, 8), t(2, 3, 0, 8)), RuntimeError, r"q_len and kv_len must be >= 1"),
        ((q, k, v, t(5, 7).int()), TypeError, r"attn_mask must be bool \(True = keep\) or a float mask"),
        ((q, k, v, t(5, 7, dtype=torch.float64)), TypeError, r"attn_mask must be bool"),
        ((q, k, v, t(5, 6)), RuntimeError, r"attn_mask of shape \[5, 6\] is not broadcastable to \(batch, heads, q_len, kv_len\)"),
        ((q, k, v, t(3, 2, 5, 7)), RuntimeError, r"attn_mask of shape .* is not broadcastable"),
        ((q, k, v, t(1, 2, 3, 5, 7)), RuntimeError, r"attn_mask must have at most 4 dims"),
        ((q, k, v, None, float("nan")), RuntimeError, r"scale must be finite, got nan"),
        ((q, k, v, None, float("inf")), RuntimeError, r"scale must be finite, got inf"),
    ]
    for args, exc, msg in cases:
        with pytest.raises(exc, match="vd::fused_attention: " + msg):
            OP(*args)
    with pytest.raises(TypeError, match="attn_mask must be bool"):  # a half mask on float32 inputs
        OP(q, k, v, t(5, 7, dtype=torch.float16))


@pytest.mark.parametrize("device", [*DEVICES, "meta"])
def test_bad_backward_inputs(device):
    def t(*shape, dtype=torch.float32):
        return torch.randn(*shape).to(dtype=dtype, device=device)

    q, k, v, out, lse = t(2, 3, 5, 8), t(2, 3, 7, 8), t(2, 3, 7, 8), t(2, 3, 5, 8), t(2, 3, 5)
    cases = [
        ((t(2, 3, 5, 4), q, k, v, out, lse, None, None, None), RuntimeError, r"grad_out must have q's shape"),
        ((q.half(), q, k, v, out, lse, None, None, None), TypeError, r"grad_out has dtype"),
        ((q, q, k, v, t(2, 3, 6, 8), lse, None, None, None), RuntimeError, r"out must have q's shape"),
        ((q, q, k, v, out, t(2, 3, 4), None, None, None), RuntimeError, r"lse must have shape \(batch, heads, q_len\)"),
        ((q, q, k, v, out, lse.double(), None, None, None), TypeError, r"lse must be"),
        ((q, q, k, v, out, lse, None, None, t(2, 3)), RuntimeError, r"grad_lse must have shape"),
        ((q, q, k, v, out, lse, t(5, 6), None, None), RuntimeError, r"attn_mask of shape \[5, 6\] is not broadcastable"),
        ((q, q, k, t(2, 3, 6, 8), out, lse, None, None, None), RuntimeError, r"v must have the same shape as k"),
        ((q, q, k, v, out, lse, None, float("nan"), None), RuntimeError, r"scale must be finite"),
    ]
    for args, exc, msg in cases:
        with pytest.raises(exc, match="vd::fused_attention_backward: " + msg):
            BWD(*args)


def test_mixed_devices():
    q = torch.randn(1, 2, 4, 8)
    with pytest.raises(RuntimeError, match="k is on meta but q is on cpu; all tensors must be on the same device"):
        OP(q, q.to("meta"), q)
    with pytest.raises(RuntimeError, match="attn_mask is on meta but q is on cpu"):
        OP(q, q, q, torch.ones(4, 4, dtype=torch.bool, device="meta"))
    if torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="is on cuda"):
            OP(q, q, q.cuda())


def test_empty_batch():
    q = torch.randn(0, 2, 5, 8)
    out, lse = OP(q, torch.randn(0, 2, 3, 8), torch.randn(0, 2, 3, 8))
    assert out.shape == (0, 2, 5, 8) and lse.shape == (0, 2, 5)


_CUDA = "CUDA" in torch._C._dispatch_dump("vd::fused_attention") and torch.cuda.is_available()


def check_cuda_against_reference(q, k, v, mask, dtype):
    """out and lse within PyTorch's own same-dtype error of the float64 reference; empty rows exact."""
    out, lse = OP(q, k, v, mask)
    ref_out, ref_lse = reference_fused_attention(q.double(), k.double(), v.double(), mask)
    torch_out, torch_lse = lowprec_attention(q, k, v, mask)
    empty = torch.isneginf(ref_lse)
    assert (out[empty] == 0).all() and torch.isneginf(lse[empty]).all()
    live = ~empty
    assert_within_torch_error(out[live], torch_out[live], ref_out[live], dtype, "out", score_term(q, k, v, mask))
    assert_within_torch_error(lse[live], torch_lse[live], ref_lse[live], dtype, "lse")


needs_cuda = pytest.mark.skipif(not _CUDA, reason="vd::fused_attention has no CUDA kernel in this build, or no GPU")


# The short-sequence CUDA kernels (fp16/bf16, q_len and kv_len <= 32, head_dim <= 128, multiple of 8):
# both tile heights, padded head dims, the projections' strided views, masks, and more (b, h)
# problems than the persistent grid has warps. On Hopper, unmasked problems at head_dim <= 64 take the
# copy-engine kernel unless VD_ATTENTION_SHORT=cpasync pins the cp.async one; each case checks which ran.
@needs_cuda
@pytest.mark.parametrize("kernel", ["default", "cpasync"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape,layout,mask_kind", [
    ((1152, 20, 14, 14, 64), "bnhd", None),      # SVD temporal attention: 23040 problems
    ((64, 5, 14, 14, 64), "contiguous", "bool"),
    ((8, 4, 25, 25, 40), "bnhd", None),          # SVD-XT frames, AnimateDiff head_dim 40
    ((300, 7, 25, 25, 64), "contiguous", None),  # SVD-XT: 2100 problems, several a warp
    ((4, 3, 16, 17, 128), "packed_kv", "float"),  # crosses the 16-row tile
    ((4, 3, 32, 32, 128), "contiguous", "float32"),
    ((3, 2, 1, 32, 8), "contiguous", None),
    ((3, 2, 32, 1, 96), "bnhd", None),
    ((5, 3, 14, 25, 64), "packed_kv", None),     # q in the 16-row tile, keys past it
    ((5, 3, 25, 9, 16), "bnhd", None),
    ((7, 2, 32, 32, 64), "contiguous", None),
    ((9, 2, 16, 16, 56), "packed_kv", None),
    ((3, 2, 20, 9, 64), "d_strided", None),      # non-unit head_dim stride: copies first
])
def test_short_kernel_cuda_matches_reference(kernel, dtype, shape, layout, mask_kind, monkeypatch):
    set_env(monkeypatch, "VD_ATTENTION_SHORT", "cpasync" if kernel == "cpasync" else None)
    B, H, Lq, Lk, D = shape
    gen = torch.Generator(device="cuda").manual_seed(sum(shape))
    q, k, v = make_qkv(B, H, Lq, Lk, D, dtype, layout, "cuda", gen)
    mask = make_mask(mask_kind, (B, H, Lq, Lk), [True, False, True, True], 0, dtype, "cuda", gen)
    tma = kernel == "default" and mask is None and D <= 64 and torch.cuda.get_device_capability() == (9, 0)
    expected = "attn_fwd_short_tma_kernel" if tma else "attn_fwd_short_kernel"
    names = cuda_kernels_run(lambda: OP(q, k, v, mask))
    assert any(expected + "<" in n for n in names), sorted(set(names))
    check_cuda_against_reference(q, k, v, mask, dtype)
    # compute_lse=False: the same kernel without the lse stores, the same out.
    names = cuda_kernels_run(lambda: OP(q, k, v, mask, None, False))
    assert any(expected + "<" in n for n in names), sorted(set(names))
    out_only, no_lse = OP(q, k, v, mask, None, False)
    assert torch.equal(out_only, OP(q, k, v, mask)[0]) and no_lse.shape == (B, H, 0)


@needs_cuda
@pytest.mark.parametrize("kernel", ["default", "cpasync"])
@pytest.mark.parametrize("L", [14, 25])
def test_short_kernels_cuda_propagate_nan(kernel, L, monkeypatch):
    # A NaN in one query row makes that row's output and lse NaN (the lse was -inf before: an empty row's
    # value) and leaves every other row as without it.
    set_env(monkeypatch, "VD_ATTENTION_SHORT", "cpasync" if kernel == "cpasync" else None)
    gen = torch.Generator(device="cuda").manual_seed(L)
    q, k, v = make_qkv(40, 3, L, L, 64, torch.bfloat16, "contiguous", "cuda", gen)
    clean_out, clean_lse = OP(q, k, v)
    q[7, 1, 5, 3] = float("nan")
    out, lse = OP(q, k, v)
    bad = torch.zeros_like(lse, dtype=torch.bool)
    bad[7, 1, 5] = True
    assert lse[bad].isnan().all() and out[7, 1, 5].isnan().all()
    torch.testing.assert_close(lse[~bad], clean_lse[~bad], atol=0, rtol=0)
    torch.testing.assert_close(out[~bad], clean_out[~bad], atol=0, rtol=0)


@needs_cuda
@pytest.mark.parametrize("dtype,L,gib,tol", [(torch.bfloat16, 14, 24, 2e-2), (torch.float32, 14, 44, 1e-5),
                                              (torch.float32, 25, 44, 1e-5),
                                              (torch.bfloat16, 64, 24, 2e-2), (torch.float32, 64, 44, 1e-5)])
def test_kernels_cuda_over_2_31_elements(dtype, L, gib, tol):
    # 64-bit offsets: q, k, v and out each hold more than 2^31 elements (4.3 GB apiece in bf16); 14
    # rows run the short kernels (25 rows in fp32 the CUDA-core one), 64 the long ones (on Hopper the
    # wgmma kernels).
    torch.cuda.empty_cache()  # earlier tests' cached blocks count as used
    free, _ = torch.cuda.mem_get_info()
    if free < gib * 2**30:
        pytest.skip(f"needs {gib} GiB of free GPU memory")
    D = 64
    P = 2**31 // (L * D) + 1024
    q, k, v = (torch.randn(P, 1, L, D, device="cuda", dtype=dtype) for _ in range(3))
    assert q.numel() > 2**31
    out, lse = OP(q, k, v)
    tail = slice(P - 8, P)
    ref_out, ref_lse = reference_fused_attention(q[tail].double(), k[tail].double(), v[tail].double())
    torch.testing.assert_close(out[tail].double(), ref_out, atol=tol, rtol=tol)
    torch.testing.assert_close(lse[tail].double(), ref_lse, atol=min(tol, 1e-3), rtol=min(tol, 1e-3))


# float32 on tensor cores (3xTF32; compute capability 8.0+, head_dim <= 128 and % 4 == 0): the
# flash kernels (on Hopper the wgmma one up to head_dim 64; VD_ATTENTION_KERNEL=mma keeps mma.sync)
# and the warp-per-problem short kernel, held to float32's own error bound (PyTorch's float32
# matmuls, TF32 off). Lengths off the tiles, padded head dims, every mask kind, views.
@needs_cuda
@pytest.mark.parametrize("family", ["default", "mma"])
@pytest.mark.parametrize("shape,layout,mask_kind", [
    ((2, 3, 300, 517, 64), "contiguous", None),
    ((1, 2, 1000, 1000, 64), "bnhd", "bool"),      # several key tiles of both stages, a partial last one
    ((1, 2, 256, 4096, 40), "contiguous", "float32"),  # a long chain of key tiles, padded head_dim
    ((1, 2, 200, 150, 128), "bnhd", "bool"),
    ((2, 2, 64, 33, 36), "packed_kv", "float"),
    ((1, 3, 193, 129, 96), "contiguous", "float32"),
    ((2, 1, 577, 77, 64), "bnhd", None),           # cross-attention to 77 text tokens
    ((1, 2, 130, 260, 8), "contiguous", None),
    ((1, 1, 70, 40, 64), "d_strided", None),       # non-unit head_dim stride: a copy first
    ((1152, 5, 14, 14, 64), "bnhd", None),         # temporal attention: the short kernel
    ((8, 4, 25, 25, 40), "bnhd", "bool"),
    ((4, 3, 16, 17, 128), "packed_kv", "float"),
    ((3, 2, 1, 32, 12), "contiguous", None),
    ((3, 2, 32, 1, 96), "bnhd", None),
])
def test_fp32_tensor_core_kernels_match_reference(family, shape, layout, mask_kind, monkeypatch):
    if family == "mma":
        monkeypatch.setenv("VD_ATTENTION_KERNEL", "mma")
    B, H, Lq, Lk, D = shape
    gen = torch.Generator(device="cuda").manual_seed(sum(shape) + 7)
    q, k, v = make_qkv(B, H, Lq, Lk, D, torch.float32, layout, "cuda", gen)
    mask = make_mask(mask_kind, (B, H, Lq, Lk), [True, False, True, True], 0, torch.float32, "cuda", gen)
    check_cuda_against_reference(q, k, v, mask, torch.float32)


@needs_cuda
def test_fp32_kernel_choice(monkeypatch):
    # Which kernel serves float32: the tensor-core ones on compute capability 8.0+ (on Hopper the wgmma
    # one up to head_dim 64 unless VD_ATTENTION_KERNEL=mma), else (and for head dims that are not a
    # multiple of 4) the CUDA-core "rows" kernel.
    tc = torch.cuda.get_device_capability() >= (8, 0)
    hopper = torch.cuda.get_device_capability() == (9, 0)
    cases = [(None, (1, 2, 256, 256, 64), "attn_fwd_tf32_wgmma_kernel", hopper),
             (None, (1, 2, 256, 256, 64), "attn_fwd_tf32_kernel", tc and not hopper),
             ("mma", (1, 2, 256, 256, 64), "attn_fwd_tf32_kernel", tc),
             (None, (1, 2, 256, 256, 128), "attn_fwd_tf32_kernel", tc),
             (None, (4, 2, 14, 14, 64), "attn_fwd_tf32_short_kernel", tc),
             (None, (1, 2, 256, 256, 30), "attn_fwd_rows_kernel", True)]
    for env, (B, H, Lq, Lk, D), kernel, want in cases:
        set_env(monkeypatch, "VD_ATTENTION_KERNEL", env)
        q = torch.randn(B, H, Lq, D, device="cuda")
        k = torch.randn(B, H, Lk, D, device="cuda")
        names = cuda_kernels_run(lambda: OP(q, k, k))
        assert any(kernel in n for n in names) == want, (env, kernel, sorted(set(names)))


# float32 short problems of 17-32 rows (q_len, kv_len <= 32, head_dim <= 128 and % 4 == 0, compute
# capability 8.0+): the CUDA-core FMA kernel by default, the 3xTF32 short kernel with
# VD_ATTENTION_FP32_SHORT=tf32; each pinned by name and held to float32's own error bound. Both head_dim
# buckets (64, 128), head dims off the 8-dim steps (36, 100, 12), a single key, keys in a partial group
# of 4, masks broadcast over heads (with a fully masked row), the projections' views, and more problems
# than the persistent grid has warps (each warp then prefetches the next one's loads).
@needs_cuda
@pytest.mark.parametrize("kernel", ["fma", "tf32"])
@pytest.mark.parametrize("shape,layout,mask_kind", [
    ((3, 5, 25, 25, 64), "contiguous", None),
    ((3, 5, 25, 25, 64), "bnhd", "bool"),
    ((2, 3, 17, 32, 64), "packed_kv", "float"),
    ((2, 3, 32, 20, 128), "bnhd", "bool"),
    ((4, 2, 25, 1, 64), "contiguous", None),      # one key
    ((4, 2, 25, 1, 64), "bnhd", "bool"),          # one key: a fifth of the rows fully masked
    ((2, 2, 31, 29, 40), "bnhd", "float"),        # head_dim 40 in the 64 bucket
    ((2, 2, 31, 29, 36), "contiguous", "bool"),   # head_dim % 8 == 4: the upper half's last chunk is padding
    ((2, 2, 20, 18, 100), "packed_kv", None),     # the same in the 128 bucket
    ((3, 2, 1, 32, 12), "contiguous", "float"),   # one query row
    ((3, 2, 32, 5, 64), "d_strided", None),       # a copy first
    ((1152, 5, 25, 25, 64), "bnhd", None),        # SVD-XT temporal attention: 5760 problems
    ((256, 4, 32, 32, 128), "contiguous", "float"),
    ((2, 3, 19, 25, 64), "bnhd", "bool"),         # the FMA kernel's row buckets: 25 exact with fewer queries,
    ((2, 3, 25, 19, 64), "contiguous", None),     # 28 (25 queries, fewer keys), 24, and 28 at head_dim 128
    ((2, 3, 22, 23, 64), "contiguous", "float"),
    ((2, 2, 27, 26, 128), "packed_kv", "bool"),
])
def test_fp32_short_kernels_match_reference(kernel, shape, layout, mask_kind, monkeypatch):
    if torch.cuda.get_device_capability() < (8, 0):
        pytest.skip("the short fp32 kernels need compute capability 8.0+")
    set_env(monkeypatch, "VD_ATTENTION_FP32_SHORT", "tf32" if kernel == "tf32" else None)
    B, H, Lq, Lk, D = shape
    gen = torch.Generator(device="cuda").manual_seed(sum(shape) + 11)
    q, k, v = make_qkv(B, H, Lq, Lk, D, torch.float32, layout, "cuda", gen)
    mask = make_mask(mask_kind, (B, H, Lq, Lk), [True, False, True, True], 0, torch.float32, "cuda", gen)
    if mask is not None and Lq > 3:  # a fully masked row: out 0, lse -inf
        mask[:, :, 3] = False if mask.dtype == torch.bool else float("-inf")
    names = cuda_kernels_run(lambda: OP(q, k, v, mask))
    fma, tf32 = "attn_fwd_fp32_short_kernel", "attn_fwd_tf32_short_kernel"
    want, other = (fma, tf32) if kernel == "fma" else (tf32, fma)
    assert any(want in n for n in names) and not any(other in n for n in names), sorted(set(names))
    check_cuda_against_reference(q, k, v, mask, torch.float32)


@needs_cuda
@pytest.mark.parametrize("scale", [0.7, 0.0, -0.3])
@pytest.mark.parametrize("shape,mask_kind", [((3, 4, 25, 25, 64), None), ((2, 3, 19, 25, 64), "bool"),
                                             ((2, 2, 30, 17, 100), None)])
def test_fp32_short_fma_kernel_scales(scale, shape, mask_kind):
    # The FMA kernel folds a positive scale into the exponent without a mask; zero and negative scales
    # (the row max of scale * s is then at the smallest score) and masks take the scaled path.
    if torch.cuda.get_device_capability() < (8, 0):
        pytest.skip("the short fp32 kernels need compute capability 8.0+")
    B, H, Lq, Lk, D = shape
    gen = torch.Generator(device="cuda").manual_seed(sum(shape) + 13)
    q, k, v = make_qkv(B, H, Lq, Lk, D, torch.float32, "contiguous", "cuda", gen)
    mask = make_mask(mask_kind, (B, H, Lq, Lk), [True, False, True, True], 0, torch.float32, "cuda", gen)
    names = cuda_kernels_run(lambda: OP(q, k, v, mask, scale))
    assert any("attn_fwd_fp32_short_kernel" in n for n in names), sorted(set(names))
    out, lse = OP(q, k, v, mask, scale)
    ref_out, ref_lse = reference_fused_attention(q.double(), k.double(), v.double(), mask, scale)
    torch_out, torch_lse = lowprec_attention(q, k, v, mask, scale)
    empty = torch.isneginf(ref_lse)
    assert (out[empty] == 0).all() and torch.isneginf(lse[empty]).all()
    live = ~empty
    assert_within_torch_error(out[live], torch_out[live], ref_out[live], torch.float32, "out",
                              score_term(q, k, v, mask, scale))
    assert_within_torch_error(lse[live], torch_lse[live], ref_lse[live], torch.float32, "lse")


@needs_cuda
def test_fp32_short_kernel_choice(monkeypatch):
    # Which kernel serves float32 with q_len, kv_len <= 32 (compute capability 8.0+, head_dim <= 128 and
    # % 4 == 0): up to 16 rows the 3xTF32 short kernel; 17-32 rows (either length) the CUDA-core FMA
    # kernel, or the 3xTF32 one with VD_ATTENTION_FP32_SHORT=tf32. Other head dims: the "rows" kernel.
    tc = torch.cuda.get_device_capability() >= (8, 0)
    fma, tf32, rows = "attn_fwd_fp32_short_kernel", "attn_fwd_tf32_short_kernel", "attn_fwd_rows_kernel"
    cases = [(None, (4, 2, 25, 25, 64), fma if tc else rows),
             ("tf32", (4, 2, 25, 25, 64), tf32 if tc else rows),
             (None, (4, 2, 32, 32, 128), fma if tc else rows),
             (None, (4, 2, 1, 17, 8), fma if tc else rows),
             (None, (4, 2, 17, 1, 8), fma if tc else rows),
             (None, (4, 2, 14, 14, 64), tf32 if tc else rows),
             (None, (4, 2, 16, 16, 128), tf32 if tc else rows),
             (None, (4, 2, 25, 25, 30), rows),
             (None, (4, 2, 25, 25, 132), rows)]
    for env, (B, H, Lq, Lk, D), want in cases:
        set_env(monkeypatch, "VD_ATTENTION_FP32_SHORT", env)
        q = torch.randn(B, H, Lq, D, device="cuda")
        k = torch.randn(B, H, Lk, D, device="cuda")
        names = cuda_kernels_run(lambda: OP(q, k, k))
        ran = {n for n in (fma, tf32, rows) if any(n + "<" in e for e in names)}
        assert ran == {want}, (env, (B, H, Lq, Lk, D), sorted(set(names)))


# The backward kernels for fp16/bf16: the tensor-core kernels (head_dim <= 128 and % 8 == 0; dq and
# dk/dv kernels; on Hopper the fused wgmma kernel up to head_dim 64, the wgmma pair beyond) by default,
# VD_ATTENTION_BACKWARD=fused192 / fused128 the fused kernel with each of its tiles, =pair the deterministic
# wgmma pair, =mma the mma.sync pair, =rows the CUDA-core ones; each against the float64 reference. Lengths off the 64-row blocks and 64/32-row tiles, padded
# head dims, masks of every kind (with fully masked rows), the projections' views, a single key,
# temporal lengths.
@needs_cuda
@pytest.mark.parametrize("family", ["default", "fused192", "fused128", "pair", "mma", "rows"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape,layout,mask_kind", [
    ((2, 3, 300, 517, 64), "contiguous", None),
    ((1, 2, 200, 130, 128), "bnhd", "bool"),
    ((1, 2, 700, 300, 128), "contiguous", None),  # several stages of both wgmma kernels at head_dim 128
    ((2, 2, 64, 33, 40), "packed_kv", "float"),
    ((1, 3, 193, 129, 96), "contiguous", "float32"),
    ((2, 1, 77, 1, 64), "bnhd", None),           # one key
    ((1, 2, 130, 260, 8), "contiguous", None),
    ((1, 1, 70, 40, 64), "d_strided", None),     # non-unit head_dim stride: copies first
    ((1, 2, 192, 300, 64), "contiguous", "bool"),  # a query tile of 128 half padding, a partial key block
    ((2, 2, 640, 256, 48), "bnhd", None),        # five 128-row query tiles (both dS^T buffers reused)
    # q_len, kv_len <= 32: the short-sequence kernel (a warp per problem), both tile heights
    ((1152, 5, 14, 14, 64), "bnhd", None),       # SVD temporal attention: more problems than warps
    ((64, 5, 14, 14, 64), "contiguous", "bool"),
    ((8, 4, 25, 25, 40), "bnhd", "float"),       # SVD-XT frames, AnimateDiff head_dim 40
    ((4, 3, 16, 17, 128), "packed_kv", "float32"),
    ((4, 3, 32, 32, 128), "contiguous", None),
    ((3, 2, 1, 32, 8), "contiguous", None),
    ((3, 2, 32, 1, 96), "bnhd", None),
    ((3, 2, 20, 9, 64), "d_strided", "bool"),
])
def test_backward_kernels_cuda_match_reference(family, dtype, shape, layout, mask_kind, monkeypatch):
    if family != "default":
        monkeypatch.setenv("VD_ATTENTION_BACKWARD", family)
    B, H, Lq, Lk, D = shape
    gen = torch.Generator(device="cuda").manual_seed(sum(shape) + D + 1)
    q, k, v = (t.requires_grad_() for t in make_qkv(B, H, Lq, Lk, D, dtype, layout, "cuda", gen))
    mask = make_mask(mask_kind, (B, H, Lq, Lk), [True, False, True, True], 0, dtype, "cuda", gen)
    if mask is not None and mask.dtype == torch.bool:
        mask[..., 0] = True  # every row keeps a key: the baseline would be NaN otherwise
    if mask is not None and mask.is_floating_point():
        mask[..., 0] = 0.0
    check_gradients(q, k, v, mask, dtype, gen)


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_backward_cuda_fully_masked_rows(dtype):
    # Rows whose keys are all masked out get zero dq; keys no live row attends to get zero dk, dv.
    B, H, Lq, Lk, D = 2, 2, 100, 90, 64
    gen = torch.Generator(device="cuda").manual_seed(4)
    q, k, v = (t.requires_grad_() for t in make_qkv(B, H, Lq, Lk, D, dtype, "contiguous", "cuda", gen))
    mask = torch.rand(Lq, Lk, generator=gen, device="cuda") < 0.7
    mask[:, 0] = True
    mask[:, 5] = False
    mask[10] = False
    mask[70:] = False
    out, lse = OP(q, k, v, mask)
    dq, dk, dv = torch.autograd.grad((out, lse), (q, k, v), (torch.randn_like(out), torch.randn_like(lse)))
    for t in (dq, dk, dv):
        assert torch.isfinite(t).all()
    assert (dq[:, :, 10] == 0).all() and (dq[:, :, 70:] == 0).all()
    assert (dk[:, :, 5] == 0).all() and (dv[:, :, 5] == 0).all()
    assert (dq[:, :, :10] != 0).any() and (dk[:, :, 6:] != 0).any()


@needs_cuda
def test_backward_kernel_choice(monkeypatch):
    # Which kernels serve the backward, fp16/bf16 at head_dim <= 128 and % 8 == 0: the short kernel
    # up to 32 tokens, beyond it on Hopper the fused wgmma kernel at head_dim <= 64 (with its prep and
    # finish launches) and the wgmma pair above 64, with VD_ATTENTION_BACKWARD=pair or under
    # torch.use_deterministic_algorithms; the mma.sync pair elsewhere or with VD_ATTENTION_BACKWARD=mma;
    # else (or with VD_ATTENTION_BACKWARD=rows) the CUDA-core pair.
    short, mma, rows = ("attn_bwd_short_kernel",), ("attn_bwd_dq_mma_kernel", "attn_bwd_dkdv_mma_kernel"), \
        ("attn_bwd_dq_kernel", "attn_bwd_dkdv_kernel")
    wgmma = ("attn_bwd_dq_wgmma_kernel", "attn_bwd_dkdv_wgmma_kernel")
    fused = ("attn_bwd_prep_kernel", "attn_bwd_fused_wgmma_kernel", "attn_bwd_dq_finish_kernel")
    # Which tile the fused kernel ran: the one with less padded work (192 keys x 64 queries on a tie),
    # or the one VD_ATTENTION_BACKWARD pins.
    tiles = {(100, None): "WgFusedPairTile<", (300, None): "WgFusedTile<", (576, None): "WgFusedTile<",
             (512, None): "WgFusedPairTile<", (300, "fused128"): "WgFusedPairTile<", (100, "fused192"): "WgFusedTile<"}
    hopper = torch.cuda.get_device_capability() == (9, 0)
    pair = wgmma if hopper else mma
    cases = [(torch.bfloat16, 100, 64, None, fused if hopper else mma), (torch.float16, 300, 40, None, fused if hopper else mma),
             (torch.bfloat16, 576, 64, None, fused if hopper else mma), (torch.float16, 512, 64, None, fused if hopper else mma),
             (torch.bfloat16, 300, 64, "fused128", fused if hopper else mma),
             (torch.bfloat16, 100, 64, "fused192", fused if hopper else mma),
             (torch.float16, 100, 128, None, pair), (torch.bfloat16, 100, 64, "pair", pair),
             (torch.bfloat16, 100, 64, "deterministic", pair),
             (torch.bfloat16, 100, 64, "mma", mma), (torch.float16, 300, 96, "mma", mma),
             (torch.bfloat16, 14, 64, None, short), (torch.float16, 32, 128, None, short),
             (torch.bfloat16, 100, 64, "rows", rows), (torch.bfloat16, 14, 64, "rows", rows),
             (torch.bfloat16, 100, 36, None, rows), (torch.bfloat16, 14, 256, None, rows),
             (torch.float32, 100, 64, None, rows)]
    for dtype, L, D, env, want in cases:
        set_env(monkeypatch, "VD_ATTENTION_BACKWARD", None if env == "deterministic" else env)
        q = torch.randn(3, 2, L, D, device="cuda", dtype=dtype, requires_grad=True)
        out, _ = OP(q, q, q)
        with deterministic(env == "deterministic"):
            names = cuda_kernels_run(lambda: torch.autograd.grad(out, q, torch.ones_like(out)))
        ran = {n for n in short + mma + wgmma + fused + rows if any(n + "<" in e for e in names)}
        assert ran == set(want), (dtype, L, D, env, sorted(set(names)))
        if want is fused:
            kernel = [e for e in names if "attn_bwd_fused_wgmma_kernel<" in e]
            assert len(kernel) == 1 and tiles[L, env] in kernel[0], (L, env, kernel)


@contextlib.contextmanager
def deterministic(on: bool = True):
    """torch.use_deterministic_algorithms(on) for the block, restored after it."""
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(on)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(was)


@needs_cuda
@pytest.mark.parametrize("D", [64, 128])
def test_backward_cuda_takes_strided_out_and_grad(D):
    # out with a head_dim stride of 2 (copied before the kernels read it in vectors) and grad_out in
    # (B, L, H, D) order (read through its strides): the same gradients, bit for bit, as from contiguous ones
    # (deterministic kernels: the fused one's dq may differ in its last bits between any two runs).
    B, H, L = 2, 3, 300
    gen = torch.Generator(device="cuda").manual_seed(D + 7)
    q, k, v = make_qkv(B, H, L, L, D, torch.bfloat16, "contiguous", "cuda", gen)
    out, lse = OP(q, k, v)
    go = torch.randn(out.shape, generator=gen, device="cuda", dtype=out.dtype)
    out_v = torch.zeros(B, H, L, 2 * D, device="cuda", dtype=out.dtype)[..., ::2]
    out_v.copy_(out)
    go_v = go.transpose(1, 2).contiguous().transpose(1, 2)
    with deterministic():
        ref = BWD(go, q, k, v, out, lse, None, None, None)
        got = BWD(go_v, q, k, v, out_v, lse, None, None, None)
    for r, g in zip(ref, got):
        assert torch.equal(r, g)
    got = BWD(go_v, q, k, v, out_v, lse, None, None, None)  # the default kernels
    for r, g in zip(ref, got):
        torch.testing.assert_close(g, r, rtol=2e-2, atol=2e-2)


@needs_cuda
@pytest.mark.parametrize("L,D", [(700, 64), (700, 128), (14, 64)])
def test_backward_cuda_is_deterministic(L, D):
    # Under torch.use_deterministic_algorithms every backward kernel that runs is free of atomics: the
    # same gradients, bit for bit, on every run. Without it, the fused Hopper kernel's dq (float atomic
    # adds in varying order) may differ in its last bits between runs, dk and dv may not.
    B, H = 2, 3
    gen = torch.Generator(device="cuda").manual_seed(D + L)
    q, k, v = (t.requires_grad_() for t in make_qkv(B, H, L, L, D, torch.bfloat16, "contiguous", "cuda", gen))
    out, _ = OP(q, k, v)
    go = torch.randn(out.shape, generator=gen, device="cuda", dtype=out.dtype)
    with deterministic():
        runs = [torch.autograd.grad(out, (q, k, v), go, retain_graph=True) for _ in range(3)]
    for r in runs[1:]:
        for x, y in zip(runs[0], r):
            assert torch.equal(x, y)
    assert all((g != 0).any() for g in runs[0])
    free = [torch.autograd.grad(out, (q, k, v), go, retain_graph=True) for _ in range(3)]
    for r in free:
        assert torch.equal(r[1], free[0][1]) and torch.equal(r[2], free[0][2])
        for x, y in zip(r, runs[0]):  # the default kernels against the deterministic ones
            torch.testing.assert_close(x, y, rtol=2e-2, atol=2e-2)


@needs_cuda
def test_short_backward_cuda_over_2_31_elements():
    # 64-bit offsets in the short backward: q, k, v, dO and the gradients each hold more than 2^31
    # elements (4.3 GB apiece in bf16).
    torch.cuda.empty_cache()  # earlier tests' cached blocks count as used
    free, _ = torch.cuda.mem_get_info()
    if free < 48 * 2**30:
        pytest.skip("needs 48 GiB of free GPU memory")
    L, D = 14, 64
    P = 2**31 // (L * D) + 1024
    q, k, v = (torch.randn(P, 1, L, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    assert q.numel() > 2**31
    out, lse = OP(q, k, v)
    g_out = torch.randn_like(out)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), g_out)
    tail = slice(P - 8, P)
    q64, k64, v64 = (t[tail].detach().double().requires_grad_() for t in (q, k, v))
    ref = torch.autograd.grad(reference_fused_attention(q64, k64, v64)[0], (q64, k64, v64), g_out[tail].double())
    for name, g, r in zip("qkv", (dq, dk, dv), ref):
        torch.testing.assert_close(g[tail].double(), r, atol=3e-2, rtol=3e-2, msg=f"grad {name}")


# The long-sequence tensor-core kernels (fp16/bf16, head_dim % 8 == 0): on Hopper the wgmma kernel
# (sm_90a) takes them by default, and VD_ATTENTION_KERNEL=mma keeps the mma.sync kernel; both are
# checked here, and at head_dim > 64 the wgmma kernel both with its P V / softmax overlap (the default)
# and without (VD_ATTENTION_OVERLAP=0). Lengths off the tiles (64/192
# query rows, 64/128 keys; a last key tile of at most 64 keys runs at N = 64 in the serial loop: 517,
# 150, 33, 129, 260, 40, 576 and 192, the boundary), padded head dims, masks of every kind, the
# projections' strided views and lengths where one key tile is all there is.
@needs_cuda
@pytest.mark.parametrize("family", ["default", "mma", "serial"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape,layout,mask_kind", [
    ((2, 3, 300, 517, 64), "contiguous", None),
    ((1, 2, 1000, 1000, 128), "bnhd", "bool"),
    ((4, 40, 200, 150, 64), "contiguous", "bool"),  # more query blocks than SMs: a CTA runs several
    ((2, 40, 300, 200, 128), "bnhd", None),
    ((2, 2, 64, 33, 40), "packed_kv", "float"),
    ((1, 3, 193, 129, 96), "contiguous", "float32"),
    ((2, 1, 577, 77, 64), "bnhd", None),          # cross-attention to 77 text tokens
    ((1, 2, 130, 260, 8), "contiguous", None),
    ((1, 1, 70, 40, 64), "d_strided", None),      # non-unit head_dim stride: a copy first
    ((2, 4, 576, 576, 128), "contiguous", None),  # SVD's 576 tokens at head_dim 128
    ((1, 2, 100, 192, 64), "bnhd", "bool"),       # last tile of exactly 64 keys
])
def test_long_kernels_cuda_match_reference(family, dtype, shape, layout, mask_kind, monkeypatch):
    if family == "mma":
        monkeypatch.setenv("VD_ATTENTION_KERNEL", "mma")
    elif family == "serial":
        monkeypatch.setenv("VD_ATTENTION_OVERLAP", "0")
    B, H, Lq, Lk, D = shape
    gen = torch.Generator(device="cuda").manual_seed(sum(shape) + D)
    q, k, v = make_qkv(B, H, Lq, Lk, D, dtype, layout, "cuda", gen)
    mask = make_mask(mask_kind, (B, H, Lq, Lk), [True, False, True, True], 0, dtype, "cuda", gen)
    check_cuda_against_reference(q, k, v, mask, dtype)


@needs_cuda
def test_hopper_runs_wgmma_kernel(monkeypatch):
    # The cases above pass on the mma.sync kernel too: pin which kernel runs where.
    q = torch.randn(1, 2, 256, 64, device="cuda", dtype=torch.bfloat16)
    hopper = torch.cuda.get_device_capability() == (9, 0)
    for env, want in [(None, hopper), ("mma", False)]:
        set_env(monkeypatch, "VD_ATTENTION_KERNEL", env)
        names = cuda_kernels_run(lambda: OP(q, q, q))
        assert any("attn_fwd_wgmma_kernel" in n for n in names) == want, (env, sorted(set(names)))
        assert any("attn_fwd_mma_kernel" in n for n in names) == (not want), (env, sorted(set(names)))


@needs_cuda
def test_hopper_wgmma_overlap_choice(monkeypatch):
    # Which wgmma variant runs (pinned by the kernel's template arguments): overlapped at head_dim > 64
    # unless VD_ATTENTION_OVERLAP=0, serial at 64 whatever the variable says.
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the wgmma kernel runs on compute capability 9.0 only")
    pattern = re.compile(r"attn_fwd_wgmma_kernel<[^,<>]+, (\d+), (true|false)>")
    cases = [(None, 64, "false"), (None, 128, "true"), (None, 96, "true"),
             ("0", 128, "false"), ("0", 96, "false"), ("1", 64, "false"), ("1", 128, "true")]
    for env, D, want in cases:
        set_env(monkeypatch, "VD_ATTENTION_OVERLAP", env)
        q = torch.randn(1, 2, 256, D, device="cuda", dtype=torch.bfloat16)
        names = cuda_kernels_run(lambda: OP(q, q, q))
        ran = {m.groups() for n in names for m in [pattern.search(n)] if m}
        assert ran == {(str(64 if D <= 64 else 128), want)}, (env, D, sorted(set(names)))
