"""vd::scheduler_step: opcheck, equivalence with the reference, gradients, bad inputs."""
from __future__ import annotations

import functools
import pytest
import torch
from hypothesis import given, settings, strategies as st

from tests.common import DTYPES, assert_close_to, device_params, opcheck_test, sample_tensor
from vdcompile import has_cuda_kernels
from vdcompile.ops import reference_scheduler_step, scheduler_step

OP = torch.ops.vd.scheduler_step.default
DEVICES = device_params("scheduler_step")


def sample_inputs(device, requires_grad):
    t = functools.partial(sample_tensor, device=device, requires_grad=requires_grad)

    def leaf(x):
        return x.detach().requires_grad_(requires_grad)

    shape = (2, 3, 2, 4, 5)  # (B, C, F, H, W) latents
    cl = torch.channels_last
    coeffs, coeffs_b = t(6), t(2, 6)
    w0, wb = leaf(torch.rand((), device=device)), leaf(torch.rand(2, device=device))
    strided = torch.randn(2, 3, 4, 10, device=device)[:, :, :, ::2]  # non-contiguous view
    return [
        (t(*shape), t(*shape), coeffs),                                            # no optionals
        (t(*shape), t(*shape), coeffs_b, t(*shape)),                               # per-batch, prev_x0
        (t(*shape), t(*shape), coeffs, None, t(*shape), w0, 0.8),                  # blend + clip
        (t(*shape), t(*shape), coeffs_b, t(*shape), t(*shape), wb, 1.5),           # everything, per-batch
        (leaf(strided), t(2, 3, 4, 5), coeffs_b, leaf(strided.clone()), None, None, 0.5),
        (t(2, 3, 4, 5, memory_format=cl), t(2, 3, 4, 5, memory_format=cl), coeffs_b),
        (t(3), t(3), t(3, 6), t(3), t(3), leaf(torch.rand(3, device=device))),   # rank-1 sample
    ]


test_opcheck = opcheck_test(OP, sample_inputs, DEVICES)


@pytest.mark.parametrize("device", DEVICES)
@settings(max_examples=40, deadline=None)
@given(
    shape=st.lists(st.integers(1, 7), min_size=1, max_size=5),
    dtype=st.sampled_from(DTYPES + [torch.float64]), per_batch=st.booleans(), with_prev_x0=st.booleans(),
    blend=st.sampled_from([None, "scalar", "per_batch"]), clip=st.sampled_from([None, 0.0, 0.5, 2.0]),
    strided=st.booleans(), seed=st.integers(0, 2**31),
)
def test_matches_reference(device, shape, dtype, per_batch, with_prev_x0, blend, clip, strided, seed):
    """Against a float64 evaluation of the math: outputs are rounded once to ``dtype`` (tolerances
    in tests/common.py, relative to the reference's magnitude)."""
    torch.manual_seed(seed)
    N = shape[0]

    def t(*s):
        if strided:  # every other element of the last dim: a non-contiguous view
            return (torch.randn(*s[:-1], 2 * s[-1], device=device) * 2).to(dtype)[..., ::2]
        return (torch.randn(*s, device=device) * 2).to(dtype)

    m, x = t(*shape), t(*shape)
    coeffs = torch.randn(N, 6, device=device) if per_batch else torch.randn(6, device=device)
    px = t(*shape) if with_prev_x0 else None
    pf = w = None
    if blend is not None:
        pf = t(*shape)
        w = torch.rand((N,) if blend == "per_batch" else (), device=device)
    prev, x0 = scheduler_step(m, x, coeffs, px, pf, w, clip)
    d = lambda a: None if a is None else a.double()  # noqa: E731
    ref_prev, ref_x0 = reference_scheduler_step(d(m), d(x), coeffs.double(), d(px), d(pf), d(w), clip)
    assert prev.dtype == dtype and x0.dtype == dtype
    assert prev.is_contiguous() and x0.is_contiguous()
    if clip is not None:
        assert x0.abs().max() <= clip
    assert_close_to(x0, ref_x0, dtype, what="x0")
    # prev sums up to five terms computed in float32 before its one rounding: twice x0's budget.
    assert_close_to(prev, ref_prev, dtype, factor=2, what="prev")


@pytest.mark.parametrize("device", DEVICES)
def test_channels_last_kept(device):
    x = torch.randn(2, 3, 4, 5, device=device).to(memory_format=torch.channels_last)
    m = torch.randn(2, 3, 4, 5, device=device)  # contiguous: read in sample's layout
    c = torch.randn(2, 6, device=device)
    prev, x0 = scheduler_step(m, x, c)
    assert prev.is_contiguous(memory_format=torch.channels_last)
    assert x0.is_contiguous(memory_format=torch.channels_last)
    ref_prev, ref_x0 = reference_scheduler_step(m, x, c)
    torch.testing.assert_close(prev, ref_prev)
    torch.testing.assert_close(x0, ref_x0)


def _clip_between(x0: torch.Tensor) -> float:
    """A clip value that clamps about half of x0 and sits far (for finite differences) from every |x0|."""
    a = x0.detach().abs().flatten().sort().values
    k = len(a) // 2
    return float((a[k - 1] + a[k]) / 2)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", [(2, 3, 4), (3,), (2, 2, 2, 3, 2)])
@pytest.mark.parametrize("per_batch", [False, True])
@pytest.mark.parametrize("clip", [False, True])
def test_gradcheck(device, shape, per_batch, clip):
    torch.manual_seed(0)
    N = shape[0]
    f64 = dict(device=device, dtype=torch.float64)
    m, x, px, pf = (torch.randn(*shape, **f64) for _ in range(4))
    coeffs = torch.randn(N, 6, **f64) if per_batch else torch.randn(6, **f64)
    w = torch.rand(N, **f64) if per_batch else torch.rand((), **f64)
    clip_x0 = _clip_between(reference_scheduler_step(m, x, coeffs)[1]) if clip else None
    inputs = [a.requires_grad_() for a in (m, x, coeffs, px, pf, w)]
    assert torch.autograd.gradcheck(lambda *a: scheduler_step(*a, clip_x0), inputs)
    # Fewer optional inputs: the same formulas without the prev_x0 / blend terms.
    assert torch.autograd.gradcheck(lambda m, x, c: scheduler_step(m, x, c, clip_x0=clip_x0), inputs[:3])


@pytest.mark.parametrize("device", DEVICES)
def test_gradients_match_reference(device):
    """Gradients of every input against autograd through the reference, per dtype."""
    torch.manual_seed(1)
    for dtype in DTYPES:
        shape = (2, 3, 5, 4)
        m, x, px, pf = (torch.randn(*shape, device=device).to(dtype).requires_grad_() for _ in range(4))
        coeffs = torch.randn(2, 6, device=device, requires_grad=True)
        w = torch.rand(2, device=device, requires_grad=True)
        gp, gx = torch.randn(*shape, device=device).to(dtype), torch.randn(*shape, device=device).to(dtype)
        inputs = (m, x, coeffs, px, pf, w)
        prev, x0 = scheduler_step(*inputs, 1.0)
        grads = torch.autograd.grad((prev, x0), inputs, (gp, gx))
        ref_in = [a.detach().double().requires_grad_() for a in inputs]
        rp, rx = reference_scheduler_step(*ref_in, 1.0)
        ref = torch.autograd.grad((rp, rx), ref_in, (gp.double(), gx.double()))
        for got, want, a, name in zip(grads, ref, inputs, ["model_output", "sample", "coeffs", "prev_x0",
                                                            "prev_frame", "blend_weight"]):
            assert got.dtype == a.dtype and got.shape == a.shape
            # Each gradient is rounded once to its input's dtype; coeffs / blend_weight (float32)
            # ones are float32 sums over an example's elements, hence the factor.
            factor = 1 if name not in ("coeffs", "blend_weight") else 8
            assert_close_to(got, want, a.dtype, factor=factor, what=f"grad {name} ({dtype})")


def test_gradient_only_through_x0():
    """With only x0 used, gradients of the prev-only inputs are zero and x0's follow its formula."""
    x = torch.randn(2, 3, requires_grad=True)
    m = torch.randn(2, 3, requires_grad=True)
    px = torch.randn(2, 3, requires_grad=True)
    coeffs = torch.tensor([0.5, -2.0, 1.0, 1.0, 1.0, 1.0], requires_grad=True)
    _, x0 = scheduler_step(m, x, coeffs, px)
    gx, gm, gpx, gc = torch.autograd.grad(x0.sum(), (x, m, px, coeffs))
    torch.testing.assert_close(gx, torch.full_like(x, 0.5))
    torch.testing.assert_close(gm, torch.full_like(m, -2.0))
    torch.testing.assert_close(gpx, torch.zeros_like(px))
    torch.testing.assert_close(gc, torch.stack([x.sum(), m.sum(), *torch.zeros(4)]).detach())


def test_clamp_masks_gradient():
    x = torch.tensor([[-3.0, -0.5, 0.2, 4.0]], requires_grad=True)
    m = torch.zeros_like(x)
    coeffs = torch.tensor([1.0, 0.0, 0.0, 0.0, 2.0, 0.0])  # x0 = clamp(x), prev = 2 * x0
    prev, x0 = scheduler_step(m, x, coeffs, clip_x0=1.0)
    torch.testing.assert_close(x0, torch.tensor([[-1.0, -0.5, 0.2, 1.0]]))
    (g,) = torch.autograd.grad((prev + x0).sum(), x)
    torch.testing.assert_close(g, torch.tensor([[0.0, 3.0, 3.0, 0.0]]))


@pytest.mark.parametrize("device", DEVICES)
def test_bad_inputs(device):
    x = torch.randn(2, 3, 4, device=device)
    c = torch.randn(6, device=device)
    with pytest.raises(RuntimeError, match="model_output must have sample's shape"):
        scheduler_step(torch.randn(2, 3, 5, device=device), x, c)
    with pytest.raises(RuntimeError, match="prev_x0 must have sample's shape"):
        scheduler_step(x, x, c, torch.randn(2, 3, device=device))
    with pytest.raises(RuntimeError, match="prev_frame must have sample's shape"):
        scheduler_step(x, x, c, None, torch.randn(1, 3, 4, device=device), torch.tensor(0.5, device=device))
    for bad in (torch.randn(5, device=device), torch.randn(3, 6, device=device), torch.randn(2, 6, 1, device=device),
                torch.randn(2, 7, device=device), torch.randn((), device=device)):
        with pytest.raises(RuntimeError, match="coeffs must have shape \\(6,\\) or \\(N, 6\\) with N = sample.size\\(0\\) = 2"):
            scheduler_step(x, x, bad)
    with pytest.raises(TypeError, match="model_output has dtype Half but sample has dtype Float"):
        scheduler_step(x.half(), x, c)
    with pytest.raises(TypeError, match="prev_x0 has dtype"):
        scheduler_step(x, x, c, x.double())
    with pytest.raises(TypeError, match="sample must be float32, float16, bfloat16 or float64"):
        scheduler_step(x.int(), x.int(), c)
    with pytest.raises(TypeError, match="coeffs must be float32, float16, bfloat16 or float64"):
        scheduler_step(x, x, c.long())
    with pytest.raises(RuntimeError, match="prev_frame and blend_weight must be given together"):
        scheduler_step(x, x, c, None, x)
    with pytest.raises(RuntimeError, match="prev_frame and blend_weight must be given together"):
        scheduler_step(x, x, c, None, None, torch.tensor(0.5, device=device))
    with pytest.raises(RuntimeError, match="blend_weight must be 0-D or have shape \\(N,\\)"):
        scheduler_step(x, x, c, None, x, torch.rand(3, device=device))
    with pytest.raises(TypeError, match="blend_weight must be float32"):
        scheduler_step(x, x, c, None, x, torch.tensor(1, device=device))
    with pytest.raises(RuntimeError, match="clip_x0 must be >= 0"):
        scheduler_step(x, x, c, clip_x0=-1.0)
    with pytest.raises(RuntimeError, match="clip_x0 must be >= 0"):
        scheduler_step(x, x, c, clip_x0=float("nan"))
    with pytest.raises(RuntimeError, match="sample must have at least 1 dim"):
        scheduler_step(torch.randn((), device=device), torch.randn((), device=device), c)


@pytest.mark.skipif(not (torch.cuda.is_available() and has_cuda_kernels("scheduler_step")),
                    reason="needs a CUDA device and the CUDA kernel (the dispatcher picks it for mixed devices)")
def test_device_mismatch():
    x = torch.randn(2, 3, 4, device="cuda")
    c = torch.randn(6, device="cuda")
    with pytest.raises(RuntimeError, match="coeffs is on cpu but sample is on cuda"):
        scheduler_step(x, x, c.cpu())
    with pytest.raises(RuntimeError, match="model_output is on cpu but sample is on cuda"):
        scheduler_step(x.cpu(), x, c)
    with pytest.raises(RuntimeError, match="blend_weight is on cpu"):
        scheduler_step(x, x, c, None, x, torch.tensor(0.5))


def test_bad_inputs_fake():
    """The fake kernel rejects the same shapes, so a compiled graph fails at trace time with the message."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        x = torch.randn(2, 3, 4)
        with pytest.raises(RuntimeError, match="coeffs must have shape"):
            OP(x, x, torch.randn(3, 6))
        with pytest.raises(RuntimeError, match="model_output must have sample's shape"):
            OP(torch.randn(2, 3, 5), x, torch.randn(6))
        with pytest.raises(RuntimeError, match="prev_frame and blend_weight must be given together"):
            OP(x, x, torch.randn(6), None, x)
        with pytest.raises(RuntimeError, match="coeffs is on meta but sample is on cpu"):
            OP(x, x, torch.randn(6, device="meta"))


def test_empty_batch():
    x = torch.randn(0, 4, 3)
    prev, x0 = scheduler_step(x, x, torch.randn(0, 6))
    assert prev.shape == x0.shape == (0, 4, 3)


def test_large_parallel_matches_reference():
    """Big enough for several parallel chunks, with chunk edges inside a batch entry."""
    torch.manual_seed(2)
    shape = (3, 4, 5, 37, 61)
    m, x, px, pf = (torch.randn(*shape) for _ in range(4))
    c, w = torch.randn(3, 6), torch.rand(3)
    for got, want in zip(scheduler_step(m, x, c, px, pf, w, 1.0), reference_scheduler_step(m, x, c, px, pf, w, 1.0)):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
