"""vd::temporal_conv: opcheck, equivalence with the reference, gradients, layouts, bad inputs."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st
from torch._subclasses.fake_tensor import FakeTensorMode

from tests.common import (assert_close_to, assert_fake_matches_real, check_cpp_autograd, cuda_kernels_run,
                          device_params, opcheck_test, run_opcheck)
from vdcompile.ops import reference_temporal_conv, temporal_conv

OP = torch.ops.vd.temporal_conv.default
BACKWARD = torch.ops.vd.temporal_conv_backward.default
DEVICES = device_params("temporal_conv")


def make_weight(c_in, c_out, k, device="cpu", dtype=torch.float32):
    return (torch.randn(c_out, c_in, k, 1, 1, device=device) / (c_in * k) ** 0.5).to(dtype)


def frames_major(b, c, f, h, w, device="cpu", dtype=torch.float32):
    """(B, C, F, H, W) view of a contiguous (B, F, C, H, W) tensor, as diffusers' temporal blocks permute."""
    return torch.randn(b, f, c, h, w, device=device).to(dtype).transpose(1, 2)


def make_input(layout, b, c, f, h, w, device="cpu", dtype=torch.float32, scale=1.0):
    if layout == "frames_major":
        return frames_major(b, c, f, h, w, device, dtype).mul_(scale)
    x = (torch.randn(b, c, f, h, w, device=device) * scale).to(dtype)
    return x.to(memory_format=torch.channels_last_3d) if layout == "channels_last" else x


def sample_inputs(device, requires_grad):
    def x_(*shape, cl=False, fm=False):
        x = frames_major(*shape, device=device) if fm else torch.randn(*shape, device=device)
        assert x.is_contiguous() != fm
        if cl:
            x = x.to(memory_format=torch.channels_last_3d)
        return x.requires_grad_(requires_grad)

    def w_(c_in, c_out, k):
        return make_weight(c_in, c_out, k, device).requires_grad_(requires_grad)

    def b_(c, dtype=torch.float32):
        return torch.randn(c, device=device, dtype=dtype).requires_grad_(requires_grad)

    xs = torch.randn(2, 3, 5, 4, 6, device=device)[..., ::2].requires_grad_(requires_grad)
    return [
        (x_(2, 3, 5, 4, 3), w_(3, 4, 3), b_(4), 1),
        (x_(2, 3, 5, 4, 3, cl=True), w_(3, 4, 3), b_(4), 1),        # channels_last_3d
        (x_(1, 2, 4, 3, 3), w_(2, 5, 3), None, 0),                  # no bias, no padding
        (x_(2, 3, 3, 2, 5), w_(3, 2, 2), b_(2), 3),                 # padding >= k: bias-only frames
        (xs, w_(3, 4, 1), b_(4), 0),                                # non-contiguous input, k = 1
        (x_(1, 3, 6, 2, 2, cl=True), w_(3, 3, 3)),                  # trailing defaults omitted
        (x_(1, 2, 4, 3, 2), w_(2, 3, 3), b_(3, torch.float64), 2),  # float64 bias
        (x_(2, 3, 5, 4, 3, fm=True), w_(3, 4, 3), b_(4), 1),        # frames-major (diffusers' permute)
        (x_(1, 2, 4, 3, 2, fm=True), w_(2, 3, 2), None, 0),         # frames-major, no bias, no padding
        (x_(2, 3, 2, 2, 3, fm=True), w_(3, 2, 4), b_(2), 3),        # frames-major, only edge frames
    ]


test_opcheck = opcheck_test(OP, sample_inputs, DEVICES)


@pytest.mark.parametrize("device", DEVICES)
def test_fake_metadata_and_backward_opcheck(device):
    for args in sample_inputs(device, requires_grad=False):
        assert_fake_matches_real(OP, args)
        out = OP(*args)
        padding = args[3] if len(args) == 4 else 0
        for grad in (torch.randn_like(out), torch.randn_like(out, memory_format=torch.channels_last_3d)):
            bargs = (grad, args[0], args[1], padding)
            assert_fake_matches_real(BACKWARD, bargs)
        run_opcheck(BACKWARD, bargs)


@pytest.mark.parametrize("device", DEVICES)
@settings(max_examples=30, deadline=None)
@given(
    b=st.integers(1, 3), c_in=st.integers(1, 5), c_out=st.integers(1, 5), k=st.integers(1, 4),
    padding=st.integers(0, 3), extra_frames=st.integers(0, 6), h=st.integers(1, 5), w=st.integers(1, 5),
    dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16, torch.float64]),
    has_bias=st.booleans(), layout=st.sampled_from(["contiguous", "channels_last", "frames_major"]),
    seed=st.integers(0, 2**31),
)
def test_matches_reference(device, b, c_in, c_out, k, padding, extra_frames, h, w, dtype, has_bias,
                           layout, seed):
    torch.manual_seed(seed)
    frames = max(1, k - 2 * padding) + extra_frames  # smallest clip with one output frame, plus extra
    x = make_input(layout, b, c_in, frames, h, w, device, dtype, scale=2.0)
    weight = make_weight(c_in, c_out, k, device, dtype)
    bias = torch.randn(c_out, device=device, dtype=dtype) if has_bias else None
    out = temporal_conv(x, weight, bias, padding)
    ref = reference_temporal_conv(x.double(), weight.double(), None if bias is None else bias.double(), padding)
    assert out.dtype == dtype
    assert out.shape == (b, c_out, frames + 2 * padding - k + 1, h, w)
    assert_close_to(out, ref, dtype)
    if x.is_contiguous():
        assert out.is_contiguous()
    elif layout == "channels_last":
        assert out.is_contiguous(memory_format=torch.channels_last_3d)
    elif x.transpose(1, 2).is_contiguous():
        assert out.transpose(1, 2).is_contiguous()  # frames-major in, frames-major out
    else:
        assert out.is_contiguous()


# Channel pairs: (3, 4) takes the fused K = k * C_in GEMMs for a contiguous input (k >= 2), (8, 1)
# the per-tap GEMMs (a frames-major copy of the wide input would cost more than the narrow output).
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", ["contiguous", "channels_last", "frames_major"])
@pytest.mark.parametrize("channels", [(3, 4), (8, 1)])
def test_every_k_and_padding(one_thread, device, layout, channels):
    """Every kernel size and padding the op allows on short clips: interior frames, edge frames with
    fewer taps, frames that only see padding (bias alone), with and without bias, and the output strides
    equal to the fake kernel's."""
    c_in, c_out = channels
    torch.manual_seed(0)
    for k in range(1, 5):
        for padding in range(0, k + 2):
            for frames in range(max(1, k - 2 * padding), 6):
                x = make_input(layout, 2, c_in, frames, 3, 2, device)
                w = make_weight(c_in, c_out, k, device)
                for bias in (None, torch.randn(c_out, device=device)):
                    out = OP(x, w, bias, padding)
                    ref = reference_temporal_conv(x.double(), w.double(), None if bias is None else bias.double(),
                                                  padding)
                    assert_close_to(out, ref, torch.float32, what=f"k={k} padding={padding} frames={frames}")
                    assert_fake_matches_real(OP, (x, w, bias, padding))
                    if layout == "frames_major" and not x.is_contiguous():
                        assert out.transpose(1, 2).is_contiguous()


@pytest.mark.parametrize("device", DEVICES)
def test_frames_major_output_permutes_back_without_copy(device):
    # diffusers permutes the result back to (B, F, C, H, W) and reshapes it to (B*F, C, H, W).
    x = frames_major(2, 4, 5, 3, 3, device)
    out = temporal_conv(x, make_weight(4, 6, 3, device), torch.randn(6, device=device), 1)
    back = out.permute(0, 2, 1, 3, 4).reshape(10, 6, 3, 3)
    assert back.data_ptr() == out.data_ptr() and back._base is not None
    # A sliced frames-major view (storage offset, batch stride larger than one sample) is still one.
    big = torch.randn(3, 5, 4, 3, 3, device=device)[1:].transpose(1, 2)
    w = make_weight(4, 2, 3, device)
    assert_close_to(temporal_conv(big, w, None, 1), reference_temporal_conv(big.double(), w.double(), None, 1),
                    torch.float32)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", ["contiguous", "channels_last", "frames_major"])
@pytest.mark.parametrize("k,padding,bias", [(3, 1, True), (2, 0, False), (1, 2, True), (3, 3, False)])
def test_gradcheck(one_thread, device, layout, k, padding, bias):
    x = make_input(layout, 2, 2, 3, 1, 2, device, torch.float64)
    assert x.is_contiguous() == (layout == "contiguous")
    x.requires_grad_()
    w = make_weight(2, 3, k, device, torch.float64).requires_grad_()
    if bias:
        b = torch.randn(3, device=device, dtype=torch.float64, requires_grad=True)
        assert torch.autograd.gradcheck(lambda x, w, b: temporal_conv(x, w, b, padding), (x, w, b))
    else:
        assert torch.autograd.gradcheck(lambda x, w: temporal_conv(x, w, None, padding), (x, w))


@pytest.mark.parametrize("device", DEVICES)
def test_gradients_match_reference_low_precision(device):
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        torch.manual_seed(0)
        x = torch.randn(2, 6, 7, 5, 3, device=device, dtype=dtype).to(memory_format=torch.channels_last_3d)
        w = make_weight(6, 4, 3, device, dtype)
        b = torch.randn(4, device=device, dtype=dtype)
        g = torch.randn(2, 4, 9, 5, 3, device=device, dtype=dtype)
        ins = (x.requires_grad_(), w.requires_grad_(), b.requires_grad_())
        grads = torch.autograd.grad(temporal_conv(*ins, padding=2), ins, g)
        ref_in = [t.detach().double().requires_grad_() for t in ins]
        ref = torch.autograd.grad(reference_temporal_conv(*ref_in, padding=2), ref_in, g.double())
        for got, want, name in zip(grads, ref, ["x", "weight", "bias"]):
            assert got.dtype == dtype
            assert_close_to(got, want, dtype, factor=4, what=f"grad {name}")
        assert grads[0].is_contiguous(memory_format=torch.channels_last_3d)


def test_bias_in_other_dtype_gets_grad_in_its_dtype():
    x = torch.randn(1, 2, 4, 3, 3, requires_grad=True)
    w = make_weight(2, 3, 3).requires_grad_()
    b = torch.randn(3, dtype=torch.float64, requires_grad=True)
    g = torch.randn(1, 3, 4, 3, 3)
    temporal_conv(x, w, b, 1).backward(g)
    assert b.grad.dtype == torch.float64
    torch.testing.assert_close(b.grad, g.double().sum((0, 2, 3, 4)), rtol=1e-5, atol=1e-5)  # summed in float32


@pytest.mark.parametrize("device", DEVICES)
def test_empty_batch(device):
    x = torch.randn(0, 2, 4, 3, 3, device=device, requires_grad=True)
    w = make_weight(2, 3, 3, device).requires_grad_()
    b = torch.randn(3, device=device, requires_grad=True)
    out = temporal_conv(x, w, b, 1)
    assert out.shape == (0, 3, 4, 3, 3)
    out.sum().backward()
    assert x.grad.shape == x.shape and w.grad.abs().sum() == 0 and b.grad.abs().sum() == 0


def _bad_cases(device):
    x = torch.randn(2, 3, 5, 4, 4, device=device)
    w = make_weight(3, 4, 3, device)
    ok = dict(x=x, weight=w, bias=torch.randn(4, device=device), padding=1)
    return ok, [
        (dict(x=x[0]), RuntimeError, r"x must be 5-D \(B, C_in, F, H, W\), got 4-D"),
        (dict(weight=w[..., 0]), RuntimeError, r"weight must be 5-D \(C_out, C_in, k, 1, 1\)"),
        (dict(weight=torch.randn(4, 3, 3, 3, 1, device=device)), RuntimeError, r"weight must have a \(k, 1, 1\) kernel"),
        (dict(weight=torch.randn(4, 3, 0, 1, 1, device=device)), RuntimeError, r"weight must have a \(k, 1, 1\) kernel with k >= 1"),
        (dict(weight=make_weight(2, 4, 3, device)), RuntimeError, r"weight.size\(1\) must equal the input channels x.size\(1\) = 3"),
        (dict(x=x.to(torch.int64)), TypeError, r"x must be float32, float16, bfloat16 or float64"),
        (dict(weight=w.half()), TypeError, r"weight has dtype \S+ but x has dtype"),
        (dict(bias=torch.randn(3, device=device)), RuntimeError, r"bias must have shape \(4,\)"),
        (dict(bias=torch.ones(4, dtype=torch.int32, device=device)), TypeError, r"bias must be float32"),
        (dict(padding=-1), RuntimeError, r"padding must be >= 0, got -1"),
        (dict(x=x[:, :, :1], padding=0), RuntimeError, r"output would have no frames: .* = 1 \+ 2 \* 0 - 3 \+ 1 = -1"),
        (dict(bias=torch.randn(4, device="meta")), RuntimeError, r"bias is on meta but x is on"),
    ]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", ["kernel", "fake"])
def test_bad_inputs(device, mode):
    ok, cases = _bad_cases(device)
    for change, exc, msg in cases:
        args = {**ok, **change}
        if mode == "fake":
            if any(isinstance(v, torch.Tensor) and v.device.type == "meta" for v in change.values()):
                continue  # a meta tensor dispatches to the fake kernel in "kernel" mode already
            with FakeTensorMode(allow_non_fake_inputs=True) as fm:
                fake = {k: fm.from_tensor(v) if isinstance(v, torch.Tensor) else v for k, v in args.items()}
                with pytest.raises(exc, match=msg):
                    OP(*fake.values())
        else:
            with pytest.raises(exc, match=msg):
                OP(*args.values())


def test_mixed_devices_checked_by_kernel():
    # Run the CPU kernel itself with a meta tensor (the dispatcher would pick the fake kernel).
    ok, _ = _bad_cases("cpu")
    args = {**ok, "weight": make_weight(3, 4, 3, "meta")}
    with pytest.raises(RuntimeError, match="weight is on meta but x is on cpu"):
        OP.redispatch(torch._C.DispatchKeySet(torch._C.DispatchKey.CPU), *args.values())


def test_backward_bad_grad_out():
    ok, _ = _bad_cases("cpu")
    x, w = ok["x"], ok["weight"]
    with pytest.raises(RuntimeError, match=r"grad_out must have the output's shape \[2, 4, 5, 4, 4\]"):
        BACKWARD(torch.randn(2, 4, 4, 4, 4), x, w, 1)
    with pytest.raises(TypeError, match="grad_out has dtype"):
        BACKWARD(torch.randn(2, 4, 5, 4, 4, dtype=torch.float64), x, w, 1)


# ---- the Hopper kernel (sm_90a, fp16 / bf16, contiguous or frames-major x, H*W and C_in multiples of 8) ----
CUDA = [p for p in DEVICES if p.id == "cuda"]
HOPPER_KERNEL = "temporal_conv_wgmma_kernel"


def on_hopper(device) -> bool:
    return torch.cuda.get_device_capability(device) == (9, 0)


# (B, C_in, C_out, F, H, W, k, padding, layout): partial channel blocks (C_out 200, 64 leaves the second
# warpgroup idle), input channels that are not whole 64-channel chunks, pixel counts that are not whole
# 128-pixel tiles, edge frames with fewer taps, frames that see only padding, k = 1 and 5, a channel slice;
# a last pixel block of at most 64 pixels beside full ones (576 = 4 x 128 + 64, 192 = 128 + 64: the
# kernel runs those tiles last, at N = 64).
HOPPER_CASES = [
    ((1, 64, 200, 6, 18, 32, 3, 1), "contiguous"),
    ((2, 72, 128, 5, 12, 16, 3, 1), "frames_major"),
    ((2, 64, 128, 5, 8, 16, 3, 1), "contiguous"),
    ((2, 72, 200, 4, 4, 26, 3, 1), "frames_major"),
    ((1, 40, 64, 3, 8, 8, 5, 2), "contiguous"),
    ((3, 16, 24, 2, 2, 4, 3, 3), "frames_major"),
    ((1, 128, 320, 14, 16, 24, 3, 1), "contiguous"),
    ((1, 128, 320, 14, 16, 24, 3, 1), "frames_major"),
    ((2, 8, 8, 1, 1, 8, 1, 0), "contiguous"),
    ((2, 64, 96, 4, 4, 8, 3, 1), "channel_slice"),
]


@pytest.mark.parametrize("device", CUDA)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("case", HOPPER_CASES, ids=lambda c: f"{c[1]}-{'x'.join(map(str, c[0]))}")
def test_hopper_kernel_matches_reference(device, dtype, case, monkeypatch):
    (b, c_in, c_out, f, h, w, k, padding), layout = case
    torch.manual_seed(0)
    if layout == "channel_slice":  # channels [16, 16 + c_in) of a wider contiguous tensor
        x = torch.randn(b, c_in + 32, f, h, w, device=device).to(dtype)[:, 16:16 + c_in]
    else:
        x = make_input(layout, b, c_in, f, h, w, device, dtype)
    weight = make_weight(c_in, c_out, k, device, dtype)
    for bias in (None, torch.randn(c_out, device=device, dtype=dtype)):
        ref = reference_temporal_conv(x.double(), weight.double(), None if bias is None else bias.double(), padding)
        monkeypatch.delenv("VD_TEMPORAL_CONV_KERNEL", raising=False)
        out = OP(x, weight, bias, padding)
        ran = cuda_kernels_run(lambda: OP(x, weight, bias, padding))
        assert (HOPPER_KERNEL in " ".join(ran)) == on_hopper(device), ran
        assert_close_to(out, ref, dtype, what=f"bias={bias is not None}")
        assert_fake_matches_real(OP, (x, weight, bias, padding))
        monkeypatch.setenv("VD_TEMPORAL_CONV_KERNEL", "gemm")  # the cuBLAS path, for comparison
        assert HOPPER_KERNEL not in " ".join(cuda_kernels_run(lambda: OP(x, weight, bias, padding)))
        assert_close_to(OP(x, weight, bias, padding), ref, dtype, what="cuBLAS path")


TF32_KERNEL = "temporal_conv_tf32_kernel"
WINO_KERNEL = "temporal_conv_tf32_wino_kernel"
# The kernel each (dtype, VD_TEMPORAL_CONV_TF32_ALGO) case below runs on Hopper: bf16 (None), float32 direct / Winograd.
KERNEL_OF_ALGO = {None: HOPPER_KERNEL, "direct": TF32_KERNEL, "winograd": WINO_KERNEL}


@pytest.mark.parametrize("device", CUDA)
@pytest.mark.parametrize("tile", ["128", "160"])
@pytest.mark.parametrize("case", HOPPER_CASES, ids=lambda c: f"{c[1]}-{'x'.join(map(str, c[0]))}")
def test_hopper_tf32_kernel_matches_reference(device, tile, case, monkeypatch):
    """float32 takes the TF32 kernel where cuDNN's convolutions may run TF32 (torch.backends.cudnn.allow_tf32, as
    eager's Conv3d), held to fp16's bound (TF32 keeps fp16's 10-bit mantissa), at both channel tiles: partial
    channel tiles, partial pixel tiles with warpgroups past H * W, edge and padding-only frames, k = 1 and 5, a
    channel slice. With the switch off, the cuBLAS path at float32's bound."""
    (b, c_in, c_out, f, h, w, k, padding), layout = case
    torch.manual_seed(0)
    monkeypatch.setenv("VD_TEMPORAL_CONV_TF32_TILE", tile)
    monkeypatch.setenv("VD_TEMPORAL_CONV_TF32_ALGO", "direct")  # k = 3, padding 1: Winograd's otherwise
    if layout == "channel_slice":
        x = torch.randn(b, c_in + 32, f, h, w, device=device)[:, 16:16 + c_in]
    else:
        x = make_input(layout, b, c_in, f, h, w, device, torch.float32)
    weight = make_weight(c_in, c_out, k, device, torch.float32)
    for bias in (None, torch.randn(c_out, device=device)):
        ref = reference_temporal_conv(x.double(), weight.double(), None if bias is None else bias.double(), padding)
        monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", True)
        out = OP(x, weight, bias, padding)
        ran = cuda_kernels_run(lambda: OP(x, weight, bias, padding))
        assert (TF32_KERNEL in " ".join(ran)) == on_hopper(device), ran
        assert_close_to(out, ref, torch.float16, what=f"bias={bias is not None}")
        assert_fake_matches_real(OP, (x, weight, bias, padding))
        monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
        assert TF32_KERNEL not in " ".join(cuda_kernels_run(lambda: OP(x, weight, bias, padding)))
        assert_close_to(OP(x, weight, bias, padding), ref, torch.float32, what="cuBLAS path")


@pytest.mark.parametrize("device", CUDA)
def test_hopper_tf32_tile_choice(device, monkeypatch):
    """The TF32 kernel takes 160 channels a tile, or 128 where that pads C_out to fewer channels (256, 200)."""
    monkeypatch.delenv("VD_TEMPORAL_CONV_TF32_TILE", raising=False)
    monkeypatch.setenv("VD_TEMPORAL_CONV_TF32_ALGO", "direct")
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", True)
    if not on_hopper(device):
        pytest.skip("needs an sm_90 device (the TF32 kernel)")
    torch.manual_seed(0)
    x = torch.randn(2, 64, 6, 8, 24, device=device)
    for c_out, want in [(320, "160"), (640, "160"), (256, "128"), (200, "128")]:
        weight = make_weight(64, c_out, 3, device, torch.float32)
        ran = " ".join(cuda_kernels_run(lambda: OP(x, weight, None, 1)))
        assert f"{TF32_KERNEL}<{want}>" in ran, (c_out, ran)
        assert_close_to(OP(x, weight, None, 1), reference_temporal_conv(x.double(), weight.double(), None, 1),
                        torch.float16, what=f"C_out {c_out}")


# (B, C_in, C_out, F, H, W, k, padding, layout): more tiles than a grid's round (132 SMs or fewer), not whole
# rounds: SVD's 1280-channel row with few input channels (672 tiles), k = 5 (two edge frames each end), frames
# that are all edges, frames-major x.
TF32_ORDER_CASES = [
    ((2, 64, 1280, 14, 18, 32, 3, 1), "contiguous"),
    ((3, 64, 320, 14, 16, 24, 3, 1), "frames_major"),
    ((16, 32, 320, 9, 8, 24, 5, 2), "contiguous"),
    ((32, 16, 320, 3, 8, 24, 5, 2), "frames_major"),
]


@pytest.mark.parametrize("device", CUDA)
@pytest.mark.parametrize("case", TF32_ORDER_CASES, ids=lambda c: f"{c[1]}-{'x'.join(map(str, c[0]))}")
def test_hopper_tf32_tile_orders(device, case, monkeypatch):
    """The TF32 kernel's two tile orders (the round robin and the edge-first one, VD_TEMPORAL_CONV_TF32_ORDER)
    each cover every tile once: both match the reference and each other bitwise (a tile's sums run in the same
    order whichever CTA takes it), as does the launcher's own choice."""
    if not on_hopper(device):
        pytest.skip("needs an sm_90 device (the TF32 kernel)")
    (b, c_in, c_out, f, h, w, k, padding), layout = case
    torch.manual_seed(0)
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", True)
    monkeypatch.setenv("VD_TEMPORAL_CONV_TF32_ALGO", "direct")
    x = make_input(layout, b, c_in, f, h, w, device, torch.float32)
    weight = make_weight(c_in, c_out, k, device, torch.float32)
    bias = torch.randn(c_out, device=device)
    ref = reference_temporal_conv(x.double(), weight.double(), bias.double(), padding)
    outs = {}
    for order in ("rr", "edges", None):
        if order is None:
            monkeypatch.delenv("VD_TEMPORAL_CONV_TF32_ORDER", raising=False)
        else:
            monkeypatch.setenv("VD_TEMPORAL_CONV_TF32_ORDER", order)
        # torch.empty's memory may hold a previous result: poison the pool's free blocks so a missed tile shows
        torch.full((x.shape[0], c_out, f + 2 * padding - k + 1, h, w), float("nan"), device=device)
        outs[order] = OP(x, weight, bias, padding)
        assert TF32_KERNEL in " ".join(cuda_kernels_run(lambda: OP(x, weight, bias, padding)))
        assert_close_to(outs[order], ref, torch.float16, what=f"order {order}")
    assert torch.equal(outs["rr"], outs["edges"])
    assert torch.equal(outs["rr"], outs[None])


# (B, C_in, C_out, F, H, W, layout) for the Winograd kernel (k = 3, padding 1; units of 64 pixels x 160 channels x 2
# frames, two a CTA): even and odd frame counts (the last pair's second frame dropped), one and two frames, an odd
# count of units (an idle warpgroup) and of unit pairs (the cluster's second CTA idle), a partial last pixel block,
# C_out off 160 (weight rows past C_out zero-filled), C_in not a multiple of 16 or 32 (zero-filled chunks),
# frames-major x, a channel slice, and more items than an H100 / H200 has SMs (rings and accumulators carried from
# one item to the next).
WINO_CASES = [
    ((1, 64, 320, 6, 8, 24), "contiguous"),
    ((2, 72, 200, 5, 4, 26), "frames_major"),
    ((1, 40, 64, 1, 8, 8), "contiguous"),
    ((1, 16, 160, 2, 8, 48), "frames_major"),
    ((2, 136, 240, 7, 12, 16), "contiguous"),
    ((2, 64, 96, 4, 4, 8), "channel_slice"),
    ((2, 32, 640, 14, 24, 32), "contiguous"),  # 336 items (168 in clusters of two)
]


@pytest.mark.parametrize("device", CUDA)
@pytest.mark.parametrize("case", WINO_CASES, ids=lambda c: f"{c[1]}-{'x'.join(map(str, c[0]))}")
def test_hopper_tf32_winograd_matches_reference(device, case, monkeypatch):
    """float32 at k = 3, padding 1 takes the Winograd TF32 kernel, held to the direct TF32 kernel's bound (fp16's)
    with and without a bias, in clusters of two CTAs and without (bitwise equal: a unit's sums do not depend on
    who loads the weight rows), every output written (the pool's free memory poisoned with NaN first)."""
    if not on_hopper(device):
        pytest.skip("needs an sm_90 device (the TF32 kernels)")
    (b, c_in, c_out, f, h, w), layout = case
    torch.manual_seed(0)
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", True)
    monkeypatch.delenv("VD_TEMPORAL_CONV_TF32_ALGO", raising=False)
    if layout == "channel_slice":
        x = torch.randn(b, c_in + 32, f, h, w, device=device)[:, 16:16 + c_in]
    else:
        x = make_input(layout, b, c_in, f, h, w, device, torch.float32)
    weight = make_weight(c_in, c_out, 3, device, torch.float32)
    for bias in (None, torch.randn(c_out, device=device)):
        ref = reference_temporal_conv(x.double(), weight.double(), None if bias is None else bias.double(), 1)
        outs = {}
        for cluster in ("1", "2"):
            monkeypatch.setenv("VD_TEMPORAL_CONV_WINO_CLUSTER", cluster)
            # freed at once: the op's output, its first allocation of this size, reuses the NaN block
            torch.full((b, c_out, f, h, w), float("nan"), device=device)
            outs[cluster] = OP(x, weight, bias, 1)
            assert f"{WINO_KERNEL}<{cluster}>" in " ".join(cuda_kernels_run(lambda: OP(x, weight, bias, 1)))
            assert_close_to(outs[cluster], ref, torch.float16, what=f"cluster {cluster}, bias={bias is not None}")
        assert torch.equal(outs["1"], outs["2"])
        monkeypatch.delenv("VD_TEMPORAL_CONV_WINO_CLUSTER")
        assert_fake_matches_real(OP, (x, weight, bias, 1))


@pytest.mark.parametrize("device", CUDA)
def test_hopper_tf32_winograd_error_against_direct(device, monkeypatch):
    """The Winograd kernel's error against float64 stays within 1.5x the direct TF32 kernel's (measured 1.05-1.15x
    on random data: the frames' sums are read as TF32 like x itself), on SVD's 1280 channels with a non-zero mean."""
    if not on_hopper(device):
        pytest.skip("needs an sm_90 device (the TF32 kernels)")
    torch.manual_seed(0)
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", True)
    x = make_input("frames_major", 1, 1280, 6, 8, 24, device, torch.float32) + 0.5
    weight = make_weight(1280, 1280, 3, device, torch.float32)
    ref = reference_temporal_conv(x.double(), weight.double(), None, 1)
    errs = {}
    for algo in ("direct", "winograd"):
        monkeypatch.setenv("VD_TEMPORAL_CONV_TF32_ALGO", algo)
        out = OP(x, weight, None, 1)
        assert (WINO_KERNEL if algo == "winograd" else TF32_KERNEL) in " ".join(
            cuda_kernels_run(lambda: OP(x, weight, None, 1)))
        errs[algo] = ((out.double() - ref).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt()).item()
    assert errs["direct"] > 0  # the products ran in TF32, not float32
    assert errs["winograd"] <= 1.5 * errs["direct"], errs


@pytest.mark.parametrize("device", CUDA)
@pytest.mark.parametrize("dtype,algo", [(torch.bfloat16, None), (torch.float32, "direct"), (torch.float32, "winograd")])
def test_hopper_weight_copy_follows_weight_changes(device, dtype, algo, monkeypatch):
    """The kernel's tap-major weight copy (float32: the direct TF32 kernel's, channels reordered, or the Winograd
    kernel's G rows) is kept while the weight is unchanged and rebuilt after an in-place update, a .data swap (no
    version bump) or for another weight; the TMA and register epilogues of the 16-bit kernel agree bitwise."""
    torch.manual_seed(0)
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", True)
    if algo is not None:
        monkeypatch.setenv("VD_TEMPORAL_CONV_TF32_ALGO", algo)
    tol = torch.float16 if dtype == torch.float32 else dtype
    x = make_input("contiguous", 2, 64, 6, 8, 16, device, dtype)
    w = torch.nn.Parameter(make_weight(64, 96, 3, device, dtype))
    bias = torch.randn(96, device=device, dtype=dtype)

    def check(weight):
        with torch.no_grad():
            out = OP(x, weight, bias, 1)
        ref = reference_temporal_conv(x.double(), weight.detach().double(), bias.double(), 1)
        assert_close_to(out, ref, tol)
        return out

    first = check(w)
    if on_hopper(device):
        want = KERNEL_OF_ALGO[algo]
        with torch.no_grad():
            assert want in " ".join(cuda_kernels_run(lambda: OP(x, w, bias, 1)))
    assert torch.equal(check(w), first)
    with torch.no_grad():
        w.mul_(-0.5)
    assert not torch.equal(check(w), first)
    w.data = make_weight(64, 96, 3, device, dtype)
    check(w)
    check(make_weight(64, 96, 3, device, dtype))
    if dtype == torch.float32:
        return
    with torch.no_grad():
        tma = OP(x, w, bias, 1)
        monkeypatch.setenv("VD_TEMPORAL_CONV_STORE", "regs")
        assert torch.equal(OP(x, w, bias, 1), tma)


@pytest.mark.parametrize("device", CUDA)
def test_hopper_kernel_leaves_other_inputs_to_cublas(device, monkeypatch):
    """fp32 with cuDNN's TF32 switch off (the tests' default), channels_last_3d and H*W not a multiple of 8 (fp32
    with the switch on too) take the cuBLAS path (and stay correct)."""
    torch.manual_seed(0)
    cases = [  # (x, dtype, cuDNN's TF32 switch)
        (make_input("contiguous", 1, 16, 4, 4, 8, device, torch.float32), torch.float32, False),
        (make_input("channels_last", 1, 16, 4, 4, 8, device, torch.bfloat16), torch.bfloat16, False),
        (make_input("contiguous", 1, 16, 4, 3, 5, device, torch.bfloat16), torch.bfloat16, False),
        (make_input("channels_last", 1, 16, 4, 4, 8, device, torch.float32), torch.float32, True),
        (make_input("contiguous", 1, 16, 4, 3, 5, device, torch.float32), torch.float32, True),
    ]
    for x, dtype, tf32 in cases:
        monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", tf32)
        weight = make_weight(16, 24, 3, device, dtype)
        out = OP(x, weight, None, 1)
        ran = " ".join(cuda_kernels_run(lambda: OP(x, weight, None, 1)))
        assert HOPPER_KERNEL not in ran and TF32_KERNEL not in ran and WINO_KERNEL not in ran, ran
        assert_close_to(out, reference_temporal_conv(x.double(), weight.double(), None, 1), dtype)


@pytest.mark.parametrize("device", CUDA)
@pytest.mark.parametrize("layout", ["contiguous", "frames_major"])
@pytest.mark.parametrize("dtype,algo", [(torch.bfloat16, None), (torch.float32, "direct"), (torch.float32, "winograd")])
def test_over_2_31_elements(device, layout, dtype, algo, monkeypatch):
    """x and the output of 3.2 G elements (bf16; float32 on both TF32 kernels): the output offsets of the last rows
    pass 2^31."""
    gib = 24 if dtype == torch.bfloat16 else 48
    if torch.cuda.get_device_properties(device).total_memory < gib * 2**30:
        pytest.skip(f"needs {gib} GiB of GPU memory")
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", True)
    if algo is not None:
        monkeypatch.setenv("VD_TEMPORAL_CONV_TF32_ALGO", algo)
    torch.manual_seed(0)
    b, c, f, h, w = 1, 16, 3, 8192, 8192
    x = torch.empty((b, f, c, h, w) if layout == "frames_major" else (b, c, f, h, w), device=device,
                    dtype=dtype).normal_()
    if layout == "frames_major":
        x = x.transpose(1, 2)
    weight = make_weight(c, c, 3, device, dtype)
    bias = torch.randn(c, device=device, dtype=dtype)
    ran = " ".join(cuda_kernels_run(lambda: OP(x, weight, bias, 1)))
    if on_hopper(device):
        want = KERNEL_OF_ALGO[algo]
        assert want in ran, ran
    out = OP(x, weight, bias, 1)
    for rows in (slice(0, 1), slice(h - 1, h)):
        ref = reference_temporal_conv(x[..., rows, :].double(), weight.double(), bias.double(), 1)
        assert_close_to(out[..., rows, :], ref, torch.float16 if dtype == torch.float32 else dtype,
                        what=f"rows {rows}")
    del out, x


@pytest.mark.parametrize("device", DEVICES)
def test_autograd_kernel(device):
    # With a gradient: one C++ node whose backward runs temporal_conv_backward; a bias kept in another dtype gets
    # its gradient in that dtype.
    torch.manual_seed(0)
    x = torch.randn(1, 4, 5, 3, 2, device=device)
    w, b = torch.randn(6, 4, 3, 1, 1, device=device), torch.randn(6, device=device, dtype=torch.float64)
    xg, wg, bg = (t.clone().requires_grad_() for t in (x, w, b))
    out = check_cpp_autograd("temporal_conv", (x, w, b, 1), (xg, wg, bg, 1), "TemporalConvFn")
    g = torch.randn_like(out)
    dx, dw, db = torch.autograd.grad(out, (xg, wg, bg), g)
    want = torch.ops.vd.temporal_conv_backward(g, x, w, 1)
    assert torch.equal(dx, want[0]) and torch.equal(dw, want[1]) and db.dtype == torch.float64
    assert torch.equal(db, want[2].double())
