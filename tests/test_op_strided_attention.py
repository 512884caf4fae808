"""vd::strided_attention: opcheck, equivalence with the float64 reference, gradients, properties, bad inputs."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st

from tests.common import DTYPES, device_params, opcheck_test
from tests.test_op_fused_attention import (assert_heads_independent, assert_within_torch_error, lowprec_attention,
                                           make_qkv, score_term)
from vdcompile.ops import reference_strided_attention, strided_attention

OP = torch.ops.vd.strided_attention.default
BWD = torch.ops.vd.strided_attention_backward.default
FUSED = torch.ops.vd.fused_attention.default
DEVICES = device_params("strided_attention")


def sample_inputs(device, requires_grad):
    def qkv(*shape, layout="contiguous"):
        q, k, v = make_qkv(*shape, layout=layout, device=device)
        return tuple(t.detach().requires_grad_(requires_grad) for t in (q, k, v))

    q, k, v = qkv(2, 3, 17, 23, 16)
    return [
        (q, k, v, 1),
        (q, k, v, 2),
        (*qkv(2, 3, 17, 23, 16, layout="bnhd"), 3, 0.4),
        (*qkv(1, 2, 9, 70, 8, layout="packed_kv"), 4),
        (*qkv(1, 2, 9, 11, 8, layout="d_strided"), 2),
        (q, k, v, 50),                                  # stride past kv_len: key 0 only
        (*qkv(2, 2, 20, 1, 8), 2),                      # a single key
        (*qkv(1, 2, 5, 7, 1), 3),                       # head_dim 1
        (*qkv(1, 1, 33, 130, 256), 2),                  # head_dim 256, 65 attended keys
    ]


test_opcheck = opcheck_test(OP, sample_inputs, DEVICES)


@pytest.mark.parametrize("device", DEVICES)
@settings(max_examples=40, deadline=None)
@given(
    dtype=st.sampled_from(DTYPES),
    Lq=st.sampled_from([1, 2, 13, 64, 65, 127, 1000]),
    Lk=st.sampled_from([1, 2, 13, 64, 130, 1000]),
    D=st.sampled_from([8, 13, 64, 256]),
    BH=st.sampled_from([(1, 1), (1, 3), (2, 2)]),
    stride=st.integers(1, 9),
    layout=st.sampled_from(["contiguous", "bnhd", "packed_kv", "d_strided"]),
    scale=st.one_of(st.none(), st.floats(0.05, 2.0)),
    seed=st.integers(0, 2**31 - 1),
)
def test_matches_reference(device, dtype, Lq, Lk, D, BH, stride, layout, scale, seed):
    B, H = BH
    if Lq * Lk > 20000:  # long sequences: one head of a moderate head_dim keeps CPU time low
        B, H, D = 1, 1, min(D, 64)
    gen = torch.Generator(device=device).manual_seed(seed)
    q, k, v = make_qkv(B, H, Lq, Lk, D, dtype, layout, device, gen)
    out, lse = OP(q, k, v, stride, scale)
    assert out.dtype == dtype and out.shape == (B, H, Lq, D) and out.is_contiguous()
    assert lse.dtype == torch.float32 and lse.shape == (B, H, Lq)
    ref_out, ref_lse = reference_strided_attention(q.double(), k.double(), v.double(), stride, scale)
    torch_out, torch_lse = lowprec_attention(q, k[:, :, ::stride], v[:, :, ::stride], None, scale)
    assert_within_torch_error(out, torch_out, ref_out, dtype, "out", score_term(q, k[:, :, ::stride], v, None, scale))
    assert_within_torch_error(lse, torch_lse, ref_lse, dtype, "lse")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("stride", [1, 2, 5, 200])
def test_same_as_fused_attention_on_strided_keys(dtype, stride):
    """The op is fused attention over k[:, :, ::stride]: bitwise the same outputs and gradients,
    and zero gradient on the skipped keys."""
    gen = torch.Generator().manual_seed(stride)
    q, k, v = (t.detach().requires_grad_() for t in make_qkv(2, 2, 40, 150, 16, dtype, "bnhd", gen=gen))
    out, lse = OP(q, k, v, stride)
    g_out = torch.randn(out.shape, generator=gen).to(dtype)
    g_lse = torch.randn(lse.shape, generator=gen).to(lse.dtype)
    dq, dk, dv = torch.autograd.grad((out, lse), (q, k, v), (g_out, g_lse))

    ks, vs = k.detach()[:, :, ::stride].requires_grad_(), v.detach()[:, :, ::stride].requires_grad_()
    qf = q.detach().requires_grad_()
    out_f, lse_f = FUSED(qf, ks, vs)
    dq_f, dk_f, dv_f = torch.autograd.grad((out_f, lse_f), (qf, ks, vs), (g_out, g_lse))
    assert torch.equal(out, out_f) and torch.equal(lse, lse_f) and torch.equal(dq, dq_f)
    assert torch.equal(dk[:, :, ::stride], dk_f) and torch.equal(dv[:, :, ::stride], dv_f)
    skipped = torch.arange(150) % stride != 0
    assert (dk[:, :, skipped] == 0).all() and (dv[:, :, skipped] == 0).all()
    assert (dk[:, :, ~skipped] != 0).any() and (dv[:, :, ~skipped] != 0).any()


@pytest.mark.parametrize("dtype", DTYPES)
def test_gradients_match_reference_low_precision(dtype):
    B, H, Lq, Lk, D, stride = 2, 2, 37, 140, 32, 3
    gen = torch.Generator().manual_seed(9)
    q, k, v = (t.detach().requires_grad_() for t in make_qkv(B, H, Lq, Lk, D, dtype, "bnhd", gen=gen))
    check_gradients(q, k, v, stride, dtype, gen)


def check_gradients(q, k, v, stride, dtype, gen):
    """dq, dk, dv (from out's and lse's gradients) within PyTorch's own same-dtype gradient error of
    the float64 reference; returns them."""
    B, H, Lq, D = q.shape
    g_out = torch.randn(B, H, Lq, D, generator=gen, device=q.device).to(dtype)
    g_lse = torch.randn(B, H, Lq, generator=gen, device=q.device)
    out, lse = OP(q, k, v, stride)
    got = torch.autograd.grad((out, lse), (q, k, v), (g_out, g_lse))
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref = torch.autograd.grad(reference_strided_attention(q64, k64, v64, stride), (q64, k64, v64),
                              (g_out.double(), g_lse.double()))
    t_out, t_lse = lowprec_attention(q, k[:, :, ::stride], v[:, :, ::stride])
    base = torch.autograd.grad((t_out, t_lse), (q, k, v), (g_out, g_lse.to(t_lse.dtype)))
    for name, g, r, b in zip("qkv", got, ref, base):
        assert g.dtype == dtype and g.shape == r.shape
        assert_within_torch_error(g, b, r, dtype, f"grad {name}")
    return got


@pytest.mark.parametrize("shape,stride,layout", [
    ((2, 2, 5, 9, 4), 2, "contiguous"),
    ((1, 2, 33, 140, 3), 2, "bnhd"),      # 70 attended keys: two key tiles
    ((2, 1, 4, 7, 5), 1, "packed_kv"),
    ((1, 2, 6, 5, 3), 9, "contiguous"),   # stride past kv_len
])
def test_gradcheck(shape, stride, layout):
    q, k, v = (t.detach().requires_grad_() for t in
               make_qkv(*shape, torch.float64, layout, gen=torch.Generator().manual_seed(3)))
    fast = q.numel() + k.numel() > 500
    assert torch.autograd.gradcheck(lambda q, k, v: OP(q, k, v, stride), (q, k, v), fast_mode=fast)
    assert torch.autograd.gradcheck(lambda q, k, v: OP(q, k, v, stride, 0.6)[1], (q, k, v), fast_mode=fast)
    assert torch.autograd.gradcheck(lambda k: strided_attention(q.detach(), k, v.detach(), stride), (k,),
                                    fast_mode=fast)


def test_no_cross_contamination():
    B, H, Lq, Lk, D, stride = 3, 4, 37, 45, 16, 2
    gen = torch.Generator().manual_seed(11)
    q, k, v = make_qkv(B, H, Lq, Lk, D, torch.float32, "bnhd", gen=gen)

    def run(q, k, v):
        q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
        out, lse = OP(q, k, v, stride)
        g = torch.Generator().manual_seed(0)
        grads = torch.autograd.grad((out, lse), (q, k, v),
                                    (torch.randn(out.shape, generator=g), torch.randn(lse.shape, generator=g)))
        return (out, lse, *grads)

    assert_heads_independent(run, q, k, v, gen)


def test_deterministic():
    gen = torch.Generator().manual_seed(1)
    q, k, v = (t.requires_grad_() for t in make_qkv(2, 3, 70, 130, 32, torch.float32, gen=gen))
    g = torch.randn(2, 3, 70, 32, generator=gen)
    runs = [(OP(q, k, v, 3)[0], *torch.autograd.grad(OP(q, k, v, 3)[0], (q, k, v), g)) for _ in range(2)]
    for a, b in zip(*runs):
        assert torch.equal(a, b)


def test_reads_views_without_copies():
    gen = torch.Generator().manual_seed(0)
    q, k, v = make_qkv(2, 3, 40, 50, 16, torch.float32, "packed_kv", gen=gen)
    out, lse = OP(q, k, v, 3)
    g = out.transpose(2, 3).contiguous().transpose(2, 3)  # a grad_out with its own strides
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        OP(q, k, v, 3)
        BWD(g, q, k, v, out, lse, 3, None, None)
    names = {e.name for e in prof.events()}
    assert "vd::strided_attention" in names and "vd::strided_attention_backward" in names
    assert not names & {"aten::copy_", "aten::clone", "aten::contiguous", "aten::to", "aten::_to_copy"}, names


@pytest.mark.parametrize("device", [*DEVICES, "meta"])
def test_bad_inputs(device):
    def t(*shape, dtype=torch.float32):
        return torch.randn(*shape).to(dtype=dtype, device=device)

    q, k, v = t(2, 3, 5, 8), t(2, 3, 7, 8), t(2, 3, 7, 8)
    cases = [
        ((q, k, v, 0), RuntimeError, r"stride must be >= 1, got 0"),
        ((q, k, v, -2), RuntimeError, r"stride must be >= 1, got -2"),
        ((t(5, 8), k, v, 2), RuntimeError, r"q must be 4-D"),
        ((q, t(2, 3, 7, 8, dtype=torch.bfloat16), v, 2), TypeError, r"k has dtype .* but q has dtype"),
        ((q, t(2, 3, 7, 4), t(2, 3, 7, 4), 2), RuntimeError, r"k must have shape \(2, 3, kv_len, 8\)"),
        ((q, k, t(2, 3, 8, 8), 2), RuntimeError, r"v must have the same shape as k"),
        ((t(2, 3, 5, 300), t(2, 3, 7, 300), t(2, 3, 7, 300), 2), RuntimeError, r"head_dim .* must be in 1..256"),
        ((q, k, v, 2, float("inf")), RuntimeError, r"scale must be finite"),
    ]
    for args, exc, msg in cases:
        with pytest.raises(exc, match="vd::strided_attention: " + msg):
            OP(*args)
    out, lse = t(2, 3, 5, 8), t(2, 3, 5)
    bwd_cases = [
        ((q, q, k, v, out, lse, 0, None, None), RuntimeError, r"stride must be >= 1"),
        ((q, q, k, v, out, t(2, 3, 7), 2, None, None), RuntimeError, r"lse must have shape"),
        ((q, q, k, v, out, lse, 2, None, lse.half()), TypeError, r"grad_lse must be"),
        ((t(2, 3, 7, 8), q, k, v, out, lse, 2, None, None), RuntimeError, r"grad_out must have q's shape"),
    ]
    for args, exc, msg in bwd_cases:
        with pytest.raises(exc, match="vd::strided_attention_backward: " + msg):
            BWD(*args)


_CUDA = "CUDA" in torch._C._dispatch_dump("vd::strided_attention") and torch.cuda.is_available()


# The CUDA backward writes dk / dv through the every-stride-th-row views of zero-filled gradients:
# the tensor-core kernels (default; on Hopper the wgmma pair), the mma.sync pair and the CUDA-core
# ones, against the float64 reference.
@pytest.mark.skipif(not _CUDA, reason="vd::strided_attention has no CUDA kernel in this build, or no GPU")
@pytest.mark.parametrize("family", ["default", "mma", "rows"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape,stride", [((2, 2, 300, 517, 64), 2), ((1, 2, 100, 700, 128), 5),
                                          ((2, 3, 37, 140, 32), 3)])
def test_backward_cuda_matches_reference(family, dtype, shape, stride, monkeypatch):
    if family != "default":
        monkeypatch.setenv("VD_ATTENTION_BACKWARD", family)
    B, H, Lq, Lk, D = shape
    gen = torch.Generator(device="cuda").manual_seed(sum(shape) + stride)
    q, k, v = (t.requires_grad_() for t in make_qkv(B, H, Lq, Lk, D, dtype, "bnhd", "cuda", gen))
    got = check_gradients(q, k, v, stride, dtype, gen)
    skipped = torch.arange(Lk, device="cuda") % stride != 0
    assert (got[1][:, :, skipped] == 0).all() and (got[2][:, :, skipped] == 0).all()
