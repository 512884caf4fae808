"""vd::group_norm_silu: opcheck, equivalence with the reference, gradients, bad inputs."""
from __future__ import annotations

import functools
import itertools
import math
import os
import re
import pytest
import torch
from hypothesis import given, settings, strategies as st

from tests.common import (DTYPES, assert_close_to, check_cpp_autograd, cuda_kernels_run, device_params, opcheck_test,
                          sample_tensor)
from vdcompile.ops import group_norm_silu, reference_group_norm_silu

OP = torch.ops.vd.group_norm_silu.default
DEVICES = device_params("group_norm_silu")


def sample_inputs(device, requires_grad):
    t = functools.partial(sample_tensor, device=device, requires_grad=requires_grad)

    def wb(c):
        return (torch.randn(c, device=device).requires_grad_(requires_grad),
                torch.randn(c, device=device).requires_grad_(requires_grad))

    w8, b8 = wb(8)
    return [
        (t(2, 8, 5, 6), 4, w8, b8, 1e-5, True),
        (t(2, 8, 5, 6, memory_format=torch.channels_last), 4, w8, b8, 1e-5, True),
        (t(2, 8, 7), 2, None, None, 1e-6, True),                            # 3-D, no affine
        (t(1, 8, 3, 4, 5), 8, w8, None, 1e-5, False),                      # 5-D, plain GroupNorm
        (t(2, 8, 3, 4, 5, memory_format=torch.channels_last_3d), 2, w8, b8, 1e-5, True),
        (t(2, 8, 6, 10)[:, :, :, ::2], 4, w8, b8, 1e-5, True),             # non-contiguous view
        (frames_major(t(2, 3, 8, 4, 5)), 4, w8, b8, 1e-5, True),           # frames-major 5-D
    ]


def frames_major(x):
    """(B, F, C, H, W) memory seen as (B, C, F, H, W), as diffusers' temporal blocks see it."""
    return x.detach().transpose(1, 2).requires_grad_(x.requires_grad)


test_opcheck = opcheck_test(OP, sample_inputs, DEVICES)


@pytest.mark.parametrize("device", DEVICES)
@settings(max_examples=25, deadline=None)
@given(
    n=st.integers(1, 3), groups=st.sampled_from([1, 2, 4, 8]), cpg=st.integers(1, 5),
    spatial=st.lists(st.integers(1, 13), min_size=1, max_size=3),
    dtype=st.sampled_from(DTYPES), affine=st.booleans(), channels_last=st.booleans(), seed=st.integers(0, 2**31),
)
def test_matches_reference(device, n, groups, cpg, spatial, dtype, affine, channels_last, seed):
    torch.manual_seed(seed)
    C = groups * cpg
    x = (torch.randn(n, C, *spatial, device=device) * 3 + 1).to(dtype)
    if channels_last and x.dim() in (4, 5):
        x = x.to(memory_format=torch.channels_last if x.dim() == 4 else torch.channels_last_3d)
    w = torch.randn(C, device=device, dtype=dtype) if affine else None
    b = torch.randn(C, device=device, dtype=dtype) if affine else None
    out = group_norm_silu(x, groups, w, b, 1e-5)
    ref = reference_group_norm_silu(x.double(), groups, None if w is None else w.double(),
                                    None if b is None else b.double(), 1e-5)
    assert out.dtype == dtype
    assert_close_to(out, ref, dtype)
    expect_cl = channels_last and x.dim() in (4, 5) and not x.is_contiguous()
    fmt = torch.channels_last if x.dim() == 4 else torch.channels_last_3d
    if expect_cl:
        assert out.is_contiguous(memory_format=fmt)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape,cl", [((2, 6, 3, 4), False), ((2, 6, 3, 4), True), ((1, 4, 5), False), ((1, 4, 2, 3, 2), False)])
@pytest.mark.parametrize("silu", [True, False])
def test_gradcheck(device, shape, cl, silu):
    x = torch.randn(*shape, device=device, dtype=torch.float64)
    if cl:
        x = x.to(memory_format=torch.channels_last)
    x.requires_grad_()
    C = shape[1]
    w = torch.randn(C, device=device, dtype=torch.float64, requires_grad=True)
    b = torch.randn(C, device=device, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x, w, b: group_norm_silu(x, 2, w, b, 1e-5, silu), (x, w, b))
    assert torch.autograd.gradcheck(lambda x: group_norm_silu(x, 2, None, None, 1e-5, silu), (x,))


@pytest.mark.parametrize("device", DEVICES)
def test_gradients_match_reference_low_precision(device):
    for dtype in DTYPES:
        x = torch.randn(2, 8, 6, 5, device=device, dtype=dtype, requires_grad=True)
        w = torch.randn(8, device=device, dtype=dtype, requires_grad=True)
        b = torch.randn(8, device=device, dtype=dtype, requires_grad=True)
        g = torch.randn(2, 8, 6, 5, device=device, dtype=dtype)
        grads = torch.autograd.grad(group_norm_silu(x, 4, w, b), (x, w, b), g)
        xr, wr, br = (t.detach().double().requires_grad_() for t in (x, w, b))
        ref = torch.autograd.grad(reference_group_norm_silu(xr, 4, wr, br), (xr, wr, br), g.double())
        for got, want, name in zip(grads, ref, "xwb"):
            assert got.dtype == dtype
            assert_close_to(got, want, dtype, factor=4 if name != "x" else 1, what=f"grad {name}")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("wdtype,bdtype", [("x", "x"), (torch.float32, torch.float32), (torch.float32, "x"),
                                           (None, torch.float32), ("x", None)])
def test_backward_parameter_dtypes(device, wdtype, bdtype):
    # grad_weight / grad_bias come back in the parameters' dtypes (x's where absent): written straight by
    # the reduce kernel when both share x's dtype or float32, converted otherwise. H * W = 30 takes the two-pass
    # backward on CUDA, 8 * 16 the on-chip one (sm_90).
    for dtype, (H, W) in itertools.product((torch.bfloat16, torch.float16), ((6, 5), (8, 16))):
        def param(pd, seed):
            if pd is None:
                return None
            g = torch.Generator().manual_seed(seed)
            return torch.randn(8, generator=g).to(device, dtype if pd == "x" else pd).requires_grad_()
        x = torch.randn(2, 8, H, W, device=device, dtype=dtype, requires_grad=True)
        w, b = param(wdtype, 1), param(bdtype, 2)
        g = torch.randn(2, 8, H, W, device=device, dtype=dtype)
        inputs = [t for t in (x, w, b) if t is not None]
        grads = torch.autograd.grad(group_norm_silu(x, 4, w, b), inputs, g)
        ref_in = [t.detach().double().requires_grad_() for t in inputs]
        xr, wr, br = ref_in[0], (ref_in[1] if w is not None else None), (ref_in[-1] if b is not None else None)
        ref = torch.autograd.grad(reference_group_norm_silu(xr, 4, wr, br), ref_in, g.double())
        for got, want, t in zip(grads, ref, inputs):
            assert got.dtype == t.dtype and got.shape == t.shape
            assert_close_to(got, want, dtype, factor=4 if t is not x else 1, what=f"grad {tuple(t.shape)} {t.dtype}")


@pytest.mark.parametrize("device", DEVICES)
def test_bad_inputs(device):
    x = torch.randn(2, 6, 4, 4, device=device)
    with pytest.raises(RuntimeError, match="num_groups \\(4\\) must divide"):
        group_norm_silu(x, 4)
    with pytest.raises(RuntimeError, match="x must be 3-D, 4-D or 5-D"):
        group_norm_silu(torch.randn(2, 6, device=device), 2)
    with pytest.raises(RuntimeError, match="weight must have shape \\(6,\\)"):
        group_norm_silu(x, 2, torch.randn(5, device=device))
    with pytest.raises(TypeError, match="x must be float32, float16, bfloat16 or float64"):
        group_norm_silu(x.to(torch.int32), 2)
    with pytest.raises(RuntimeError, match="num_groups must be >= 1"):
        group_norm_silu(x, 0)
    if device == "cpu" and torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="bias is on"):
            group_norm_silu(x, 2, None, torch.randn(6, device="cuda"))


def test_empty_batch():
    x = torch.randn(0, 4, 3, 3)
    assert group_norm_silu(x, 2).shape == (0, 4, 3, 3)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("channels_last", [False, True])
def test_large_mean_small_spread(device, channels_last):
    # A group whose mean dwarfs its spread: x - mean must not lose the spread to rounding.
    torch.manual_seed(0)
    x = torch.randn(2, 8, 20, 30, device=device) * 0.05 + 1000
    if channels_last:
        x = x.to(memory_format=torch.channels_last)
    out = group_norm_silu(x, 4)
    ref = reference_group_norm_silu(x.double(), 4)
    assert_close_to(out, ref, torch.float32, factor=5)


CUDA = [p for p in DEVICES if p.id == "cuda"]

# Forward paths of the CUDA kernel. A group of cpg * S elements that is a whole number of 16-byte
# vectors (cpg <= 4096) goes to version 4 (streamed twice through L2 by a cluster of 1-16 blocks, groups
# up to 1.5 MB) or version 3 (held in registers by a cluster of 1-8 blocks, up to 393 KB; first choice
# for inputs under 16 MB); other groups take the two-pass path. test_forward_kernel_families runs each
# family on its own. Comments give M = cpg * S and version 4's cluster.
FORWARD_CASES = [
    ((2, 64, 16, 16), 32),       # M 512: one block
    ((2, 1280, 18, 32), 32),     # M 23040: cluster of 2 (16-bit), 4 (fp32)
    ((2, 640, 36, 64), 32),      # M 46080: cluster of 4 (16-bit), 8 (fp32)
    ((2, 320, 72, 128), 32),     # M 92160: cluster of 8 with 8 (16-bit) or 12 (fp32) vectors a thread
    ((1, 512, 72, 128), 32),     # M 147456: cluster of 4 (16-bit), 8 (fp32)
    ((1, 64, 256, 256), 8),      # M 524288: cluster of 16 (16-bit); version 12 (fp32: 2 MB groups)
    ((1, 960, 72, 128), 32),     # M 276480: version 6 on a cluster of 16 (16-bit, 553 KB; fp32 at M 147456 above)
    ((1, 64, 512, 512), 16),     # M 1048576: over 1.5 MB, two-pass (16-bit), version 12 (fp32)
    ((2, 24, 5, 7), 3),          # M 280, S 35: vectors straddle two channels
    ((2, 16, 3), 2),             # M 24, S 3: a vector spans several channels
    ((2, 40, 4, 4, 3), 4),       # 5-D, M 480
    ((2, 6, 5, 7), 3),           # M 70: not whole vectors, two-pass
    ((1, 8192, 2), 1),           # cpg 8192: over the on-chip channel table, two-pass
]

# Frames-major (B, C, F, H, W) views of (B, F, C, H, W) memory: a group is F segments of cpg * H * W
# contiguous elements, read and written in place when a segment is whole 16-byte vectors.
FRAMES_MAJOR_CASES = [
    ((2, 320, 14, 9, 16), 32),   # segments of 1440: on chip, cluster of 2 (16-bit)
    ((2, 640, 14, 18, 32), 32),  # segments of 11520: on chip, cluster of 8
    ((2, 64, 25, 4, 4), 8),      # 25 frames, segments of 128
    ((1, 32, 3, 5, 7), 4),       # segments of 280, H * W = 35: vectors straddle two channels
    ((2, 6, 3, 5, 7), 3),        # segments of 70: not whole vectors, computed contiguous and copied
    ((1, 64, 14, 32, 64), 8),    # groups of 229376 elements: cluster of 8 (16-bit), 16 (fp32)
]

# channels_last (N, C, *) inputs: versions 8 (sm_90, on chip) and 5 (through L2) take a block of gb whole groups
# (a row of >= 128 bytes where the groups allow) over a cluster of K CTAs when C is whole 16-byte vectors and a
# CTA's part fits 96 KB; the rest takes the two-pass cols kernels. Comments give version 5's 16-bit plan.
CHANNELS_LAST_CASES = [
    ((2, 320, 72, 128), 32),     # gb 8 (160 B rows), K 16
    ((2, 640, 36, 64), 32),      # gb 4, K 4, grown to 16 (toward two CTAs an SM)
    ((2, 1280, 18, 32), 32),     # gb 2, K 1, grown to 4 (a row a thread at least)
    ((14, 320, 32, 32), 32),     # the 256x256 UNet's: K 8
    ((2, 960, 9, 16), 32),       # cpg 30: gb 4, 120 channels a row
    ((2, 64, 16, 16), 32),       # cpg 2: all 32 groups in one block
    ((2, 48, 6, 6), 16),         # cpg 3: vectors straddle several groups
    ((2, 24, 5, 7), 3),          # cpg 8: no block reaches 128 bytes
    ((2, 40, 4, 4, 3), 4),       # 5-D channels_last_3d, cpg 10
    ((1, 64, 256, 256), 8),      # parts over 96 KB: two-pass
    ((2, 12, 5, 5), 3),          # C not whole vectors: two-pass
    ((2, 2560, 3, 5), 32),       # two-pass statistics over two column tiles of 2048 channels: group 25 in both
    ((1, 2112, 4, 4), 3),        # cpg 704: group 2 straddles the tiles, groups 0 and 1 never reach the second
]


def channels_last(x):
    return x.to(memory_format=torch.channels_last if x.dim() == 4 else torch.channels_last_3d)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape,groups", FRAMES_MAJOR_CASES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_frames_major(device, shape, groups, dtype):
    torch.manual_seed(0)
    B, C, F, H, W = shape
    x = frames_major((torch.randn(B, F, C, H, W, device=device) * 3 + 1).to(dtype))
    w, b = torch.randn(C, device=device, dtype=dtype), torch.randn(C, device=device, dtype=dtype)
    out = group_norm_silu(x, groups, w, b, 1e-5)
    assert out.stride() == x.stride(), "a frames-major input gives a frames-major output"
    ref = reference_group_norm_silu(x.double(), groups, w.double(), b.double(), 1e-5)
    assert_close_to(out, ref, dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape,groups", [((2, 16, 3, 4, 8), 4), ((1, 32, 3, 5, 7), 4), ((2, 64, 5, 6, 8), 8),
                                          ((1, 32, 3, 24, 40), 4), ((1, 16, 2, 40, 65), 4)])
@pytest.mark.parametrize("dy_layout", ["frames-major", "contiguous"])
def test_frames_major_backward(device, shape, groups, dy_layout):
    # Frames-major x with a frames-major grad_out is read in place on CUDA (rows (n, f, c), dx written to its
    # contiguous rows; H * W = 35 takes the scalar path); with a contiguous grad_out both are copied. Rows of
    # 960 and 2600 elements: whole batches of loads and the rest after them, two chunks a row at 2600.
    torch.manual_seed(0)
    B, C, F, H, W = shape
    for dtype in DTYPES:
        x = frames_major((torch.randn(B, F, C, H, W, device=device) * 2 + 1).to(dtype))
        w = torch.randn(C, device=device, dtype=dtype)
        b = torch.randn(C, device=device, dtype=dtype)
        g = torch.randn(B, F, C, H, W, device=device, dtype=dtype)
        g = g.transpose(1, 2) if dy_layout == "frames-major" else g.transpose(1, 2).contiguous()
        dx, dw, db = torch.ops.vd.group_norm_silu_backward(g, x, groups, w, b, 1e-5, True)
        assert dx.is_contiguous(), "dx keeps the op's contiguous layout for frames-major x"
        xr, wr, br = (t.double().requires_grad_() for t in (x, w, b))
        ref = torch.autograd.grad(reference_group_norm_silu(xr, groups, wr, br), (xr, wr, br), g.double())
        for got, want, name in zip((dx, dw, db), ref, "xwb"):
            assert_close_to(got, want, dtype, factor=4 if name != "x" else 1, what=f"{dtype} grad {name}")


@pytest.mark.parametrize("device", CUDA)
@pytest.mark.parametrize("shape,groups,cl", [(s, g, False) for s, g in FORWARD_CASES]
                         + [(s, g, True) for s, g in CHANNELS_LAST_CASES])
@pytest.mark.parametrize("dtype", DTYPES)
def test_forward_paths(device, shape, groups, cl, dtype):
    torch.manual_seed(0)
    C = shape[1]
    x = (torch.randn(shape, device=device) * 3 + 1).to(dtype)
    if cl:
        x = channels_last(x)
    w, b = torch.randn(C, device=device, dtype=dtype), torch.randn(C, device=device, dtype=dtype)
    for silu in (True, False):
        out = group_norm_silu(x, groups, w, b, 1e-5, silu)
        assert out.stride() == x.stride(), "the output keeps the input's layout"
        ref = reference_group_norm_silu(x.double(), groups, w.double(), b.double(), 1e-5, silu)
        assert_close_to(out, ref, dtype, what=f"silu={silu}")
    out = group_norm_silu(x, groups)
    assert_close_to(out, reference_group_norm_silu(x.double(), groups), dtype, what="no affine")


# Each forward kernel family on its own (VD_GROUP_NORM_KERNEL; a family that does not apply to a
# shape leaves it to the two-pass path), on the cases above.
FAMILIES = ["smem", "stream", "l2", "onchip", "twopass"]


@pytest.fixture(params=FAMILIES)
def family(request, monkeypatch):
    """Pins the forward kernel family for the test."""
    monkeypatch.setenv("VD_GROUP_NORM_KERNEL", request.param)
    return request.param


def family_cases():
    """(shape, groups, layout) of the forward's cases in each layout."""
    return ([(s, g, "contiguous") for s, g in FORWARD_CASES] + [(s, g, "frames-major") for s, g in FRAMES_MAJOR_CASES]
            + [(s, g, "channels_last") for s, g in CHANNELS_LAST_CASES])


def layout_input(shape, layout, dtype, device, scale=3, shift=1):
    """N(shift, scale^2) input of shape in layout (frames-major: (B, C, F, H, W) over (B, F, C, H, W) memory)."""
    if layout == "frames-major":
        B, C, F, H, W = shape
        return frames_major((torch.randn(B, F, C, H, W, device=device) * scale + shift).to(dtype))
    x = (torch.randn(shape, device=device) * scale + shift).to(dtype)
    return channels_last(x) if layout == "channels_last" else x


@pytest.mark.parametrize("device", CUDA)
@pytest.mark.parametrize("dtype", DTYPES)
def test_forward_kernel_families(device, family, dtype):
    torch.manual_seed(0)
    for shape, groups, layout in family_cases():
        C = shape[1]
        x = layout_input(shape, layout, dtype, device)
        w, b = torch.randn(C, device=device, dtype=dtype), torch.randn(C, device=device, dtype=dtype)
        for silu in (True, False):
            out = group_norm_silu(x, groups, w, b, 1e-5, silu)
            ref = reference_group_norm_silu(x.double(), groups, w.double(), b.double(), 1e-5, silu)
            assert_close_to(out, ref, dtype, what=f"{family} {layout} {shape} silu={silu}")


@pytest.mark.parametrize("device", CUDA)
def test_channels_last_runs_version_5(device, monkeypatch):
    # The channels_last cases above pass on version 1 too: pin that version 5 is the kernel that runs
    # where it should (on devices with clusters), and version 1 where the parts are too large.
    if torch.cuda.get_device_capability(device)[0] < 9:
        pytest.skip("version 5 needs thread-block clusters (sm_90+)")
    monkeypatch.setenv("VD_GROUP_NORM_KERNEL", "l2")
    for shape, groups, want in [((14, 320, 32, 32), 32, True), ((1, 64, 256, 256), 8, False)]:
        x = channels_last(torch.randn(shape, device=device, dtype=torch.bfloat16))
        names = cuda_kernels_run(lambda: group_norm_silu(x, groups))
        assert any("l2_cols_kernel" in n for n in names) == want, (shape, sorted(set(names)))


@pytest.fixture
def smem_family(device, monkeypatch):
    """Pins the "smem" family (versions 6 and 8: the copy engine and clusters, sm_90+)."""
    if torch.cuda.get_device_capability(device)[0] < 9:
        pytest.skip("versions 6 and 8 need the bulk / tensor copy engine and clusters (sm_90+)")
    monkeypatch.setenv("VD_GROUP_NORM_KERNEL", "smem")
    torch.manual_seed(0)


def check_kernel_serves(kernel, want, x, groups, w, b, silu=True, what=""):
    """Asserts whether `kernel` serves group_norm_silu(x, ...) and that its output matches the reference;
    returns the output."""
    names = cuda_kernels_run(lambda: group_norm_silu(x, groups, w, b, 1e-5, silu))
    assert any(kernel in n for n in names) == want, (what, sorted(set(names)))
    out = group_norm_silu(x, groups, w, b, 1e-5, silu)
    ref = reference_group_norm_silu(x.double(), groups, w.double(), b.double(), 1e-5, silu)
    assert_close_to(out, ref, x.dtype, what=what)
    return out


@pytest.mark.parametrize("device", CUDA)
@pytest.mark.parametrize("dtype", DTYPES)
def test_channels_last_version_8(device, dtype, smem_family):
    # Version 8 (channels_last, sm_90): persistent clusters walk blocks of gb groups, each CTA's rows of a block
    # in a shared-memory stage. Comments give the 16-bit plan (fp32 blocks have half the channels, the same
    # bytes). Pins that it is the kernel that runs, and where it does not.
    for shape, groups, want in [((40, 1280, 9, 16), 32, True),   # 23 KB blocks: K 1, 4 stages, 640 blocks (reused)
                                ((20, 640, 36, 64), 32, True),   # K 8, parts of 144-row boxes x 2, 2 stages
                                ((2, 320, 72, 128), 32, True),   # K 16, one stage of 90 KB a CTA (3 boxes)
                                # the same with 24 blocks over fewer clusters: the stage refilled box by box for
                                # the next block (16-bit); the last rank's third box partly past the sample
                                ((6, 320, 72, 125), 32, True),
                                ((2, 960, 72, 128), 32, False),  # 138 KB parts at K 16: version 5 / 1
                                ((2, 24, 5, 7), 3, True),        # 35 rows in a box of 40 (past the sample: zeros)
                                ((2, 40, 4, 4, 3), 4, True),     # 5-D channels_last_3d, 80-byte rows
                                # cpg 3: a vector spans three groups in 16-bit (not taken), two in fp32
                                ((2, 48, 6, 6), 16, None),
                                ((1, 64, 256, 256), 8, False)]:  # 8 MB blocks
        want = dtype.itemsize == 4 if want is None else want
        C = shape[1]
        x = channels_last((torch.randn(shape, device=device) * 3 + 1).to(dtype))
        w, b = torch.randn(C, device=device, dtype=dtype), torch.randn(C, device=device, dtype=dtype)
        for silu in (True, False):
            out = check_kernel_serves("smem_cols_kernel", want, x, groups, w, b, silu, f"{shape} silu={silu}")
            assert out.stride() == x.stride(), "the output keeps the input's layout"


@pytest.mark.parametrize("device", CUDA)
@pytest.mark.parametrize("dtype", DTYPES)
def test_channels_last_version_8_three_ctas(device, dtype, smem_family, monkeypatch):
    # Version 8 with one stage of up to ~72 KB a CTA runs three CTAs an SM (sm_90: 228 KB an SM), its group states
    # folded over each warp's rows first where the block's vector columns divide 32 (up to ~64 KB unfolded);
    # VD_GROUP_NORM_THREE_CTAS=0 keeps two. Pins the instantiation that runs (the kernel's CTAS and FOLD template
    # arguments) and checks both against the reference.
    def ctas(x, silu):
        names = [n for n in cuda_kernels_run(lambda: group_norm_silu(x, 32, None, None, 1e-5, silu))
                 if "smem_cols_kernel" in n]
        assert len(set(names)) == 1, names
        args = [t.strip() for t in re.search(r"smem_cols_kernel<([^>]*)>", names[0]).group(1).split(",")]
        return int(args[2]), args[3] == "true"

    two = (2, False)
    cases = [((2, 512, 72, 128), (3, True) if dtype.itemsize == 4 else two),  # 72 KB: fp32 fits a third CTA, 16-bit not
             ((3, 512, 72, 125), (3, True)),  # 70.5 KB (563 rows): the last rank's part shorter, the third box partly past
             ((5, 512, 64, 128), (3, True)),  # 64 KB; 16-bit: 40 blocks over fewer clusters, refilled box by box
             # 320 channels: 10 vector columns (160-byte rows), states unfolded (8 KB); 60 KB parts
             ((2, 320, 48, 128), (3, False)),
             ((3, 320, 48, 125), (3, False)),   # 376-row parts, the last rank's 360 rows
             ((12, 320, 48, 128), (3, False))]  # 48 / 96 blocks over fewer clusters: the stage reused
    for shape, want in cases:
        C = shape[1]
        x = channels_last((torch.randn(shape, device=device) * 3 + 1).to(dtype))
        w, b = torch.randn(C, device=device, dtype=dtype), torch.randn(C, device=device, dtype=dtype)
        for silu in (True, False):
            assert ctas(x, silu) == want, (shape, silu)
            out3 = check_kernel_serves("smem_cols_kernel", True, x, 32, w, b, silu, f"{shape} silu={silu}")
            with monkeypatch.context() as m:
                m.setenv("VD_GROUP_NORM_THREE_CTAS", "0")
                assert ctas(x, silu) == two, (shape, silu)
                out2 = check_kernel_serves("smem_cols_kernel", True, x, 32, w, b, silu, f"{shape} silu={silu} two")
            # The same statistics up to the order of the merges: outputs within a few units of the last place.
            torch.testing.assert_close(out3.float(), out2.float(), rtol=4 * torch.finfo(dtype).eps, atol=1e-5)
        # The forward's statistics (for the backward) from the folded states too.
        y, stats = torch.ops.vd.group_norm_silu_forward(x, 32, w, b, 1e-5, True)
        y2 = group_norm_silu(x, 32, w, b, 1e-5, True)
        assert torch.equal(y, y2)
        xd = x.double().reshape(shape[0], 32, -1)
        torch.testing.assert_close(stats[2].double(), xd.var(-1, unbiased=False).add(1e-5).rsqrt(), rtol=1e-4, atol=0)


@pytest.mark.parametrize("device", CUDA)
def test_channels_last_fp32_unaligned_rows_two_pass(device, monkeypatch):
    # fp32 blocks whose rows are not whole 32-byte sectors (cpg 30: 240-byte rows) in one stage of version 8 ran
    # slower than the two-pass kernels: the op's own choice takes those (not version 5 either), the same rows in a
    # ring of stages keep version 8, 16-bit ones too unless the blocks make ten rounds or more of version 8's
    # resident clusters, and the pinned "smem" family still runs version 8 on them.
    if torch.cuda.get_device_capability(device)[0] < 9:
        pytest.skip("version 8 needs the tensor copy engine and clusters (sm_90+)")
    monkeypatch.delenv("VD_GROUP_NORM_KERNEL", raising=False)
    torch.manual_seed(0)
    for shape, dtype, want in [((1, 960, 64, 64), torch.float32, False),   # K 16, one 60 KB stage: two-pass
                               ((2, 960, 48, 100), torch.float32, False),  # 2 boxes of 152 rows: one 71 KB stage
                               ((1, 960, 64, 64), torch.bfloat16, True),   # 16-bit, 8 blocks: version 8
                               ((8, 960, 64, 96), torch.float16, True),    # 64 blocks: version 8
                               ((32, 960, 64, 96), torch.bfloat16, False),  # 256 blocks: two-pass
                               ((2, 1920, 32, 48), torch.float32, True)]:  # K 8, 45 KB parts in 2 stages
        C = shape[1]
        x = channels_last((torch.randn(shape, device=device) * 3 + 1).to(dtype))
        w, b = torch.randn(C, device=device, dtype=dtype), torch.randn(C, device=device, dtype=dtype)
        names = cuda_kernels_run(lambda: group_norm_silu(x, 32, w, b, 1e-5, True))
        assert any("stats_cols_kernel" in n for n in names) == (not want), (shape, dtype, sorted(set(names)))
        assert not any("l2_cols_kernel" in n for n in names), (shape, dtype, sorted(set(names)))
        check_kernel_serves("smem_cols_kernel", want, x, 32, w, b, True, f"{shape} {dtype}")
        with monkeypatch.context() as m:
            m.setenv("VD_GROUP_NORM_KERNEL", "smem")
            check_kernel_serves("smem_cols_kernel", True, x, 32, w, b, True, f"{shape} {dtype} pinned")


@pytest.mark.parametrize("device", CUDA)
@pytest.mark.parametrize("dtype", DTYPES)
def test_version_6_persistent_loop(device, dtype, smem_family):
    # Version 6's clusters stay resident and walk many groups each, through a ring of shared-memory stages:
    # more groups than resident clusters times stages, so stages are reused and barrier phases flip; parts
    # that cross frames (several bulk copies a part). Pins that it is the kernel that runs, and where it
    # does not (groups over 16 parts of 48 KB).
    for shape, groups, frames, want in [((40, 256, 9, 16), 32, 0, True),       # M 1152: K 1, 1280 groups
                                        ((20, 640, 36, 64), 32, 0, True),      # K 2 (16-bit), 4 (fp32)
                                        ((6, 640, 14, 9, 16), 32, 14, True),   # frames-major: K 2 / 4, 192 groups
                                        ((1, 64, 512, 512), 16, 0, False),     # 2 MB groups: two-pass
                                        # frames-major 645 KB groups (16-bit): K 16; 1.3 MB (fp32): K 16,
                                        # 81 KB parts in one stage
                                        ((2, 1280, 14, 18, 32), 32, 14, True),
                                        # 1.3 MB (16-bit, one stage a CTA); 2.6 MB (fp32): two-pass
                                        ((2, 640, 14, 36, 64), 32, 14, None),
                                        ((4, 960, 72, 128), 32, 0, True)]:     # 553 KB (16-bit); 1.1 MB (fp32)
        want = dtype.itemsize == 2 if want is None else want
        C = shape[1]
        if frames:
            B, _, F, H, W = shape
            x = frames_major((torch.randn(B, F, C, H, W, device=device) * 3 + 1).to(dtype))
        else:
            x = (torch.randn(shape, device=device) * 3 + 1).to(dtype)
        w, b = torch.randn(C, device=device, dtype=dtype), torch.randn(C, device=device, dtype=dtype)
        check_kernel_serves("smem_rows_kernel", want, x, groups, w, b, what=f"{shape}")


def check_pinned_case(kernel, want, x, groups, w, b, what):
    """A pinned family's case: whether `kernel` serves it (with and without SiLU) and its output; without affine; the
    statistics it writes, and the same output when it writes them."""
    for silu in (True, False):
        check_kernel_serves(kernel, want, x, groups, w, b, silu, what=f"{what} silu={silu}")
    out = group_norm_silu(x, groups)
    assert_close_to(out, reference_group_norm_silu(x.double(), groups), x.dtype, what=f"{what} no affine")
    out, stats = FORWARD_WITH_STATS(x, groups, w, b, 1e-5, True)
    assert torch.equal(out, group_norm_silu(x, groups, w, b, 1e-5, True)), what
    check_stats(stats, x, groups, 1e-5, what)


def assert_same_bits(out, x, groups, w, b, what, times=1):
    """Each of `times` further calls of group_norm_silu(x, ...) (under the environment of the moment) returns `out`
    bit for bit."""
    for _ in range(times):
        assert torch.equal(group_norm_silu(x, groups, w, b, 1e-5, True), out), what


def stream_family_ok(device):
    if torch.cuda.get_device_capability(device)[0] < 9:
        pytest.skip("version 12 needs the bulk copy engine (sm_90+)")


@pytest.mark.parametrize("device", CUDA)
@pytest.mark.parametrize("dtype", DTYPES)
def test_version_12_stream(device, dtype):
    # Version 12 (sm_90): tiles of up to 32 KB (a stage of the ring: six of 32 KB, or all the shared memory in seven
    # where a group is 1.5 rounds of the grid's tiles or more, eight in float32 from two rounds) taken from a
    # device-wide counter, statistics per tile in global slots, merged per group by every CTA holding a tile of it.
    # Taken by default for groups over 1.5 MB, and for frames-major groups version 6 would hold in one stage a CTA
    # (768 KB to 1.5 MB); pinned ("stream") for smaller groups.
    # Pins where it runs, and that its output matches the reference and is the same bit for bit on every call
    # (tiles go to whichever CTA asks first).
    stream_family_ok(device)
    torch.manual_seed(0)
    fp32 = dtype == torch.float32
    for shape, groups, frames, want in [
        ((2, 64, 256, 256), 8, 0, fp32),          # 2 MB fp32 groups: 64 tiles a group, 16 groups (16-bit: version 6)
        ((1, 32, 6, 90, 100), 4, 6, True),        # frames-major, segments of 72000: nine tiles of 8000 each (864 KB)
        ((1, 64, 512, 512), 16, 0, True),         # 4 MB groups (fp32; 16-bit 2 MB): 128 tiles, over a round of CTAs
        ((1, 32, 520, 512), 4, 0, True),          # 4.3 MB groups in 16-bit (8.5 MB fp32)
        ((1, 16, 600, 1000), 4, 0, True),         # fp32 9.6 MB groups, 293 tiles of 32 KB: eight stages (16-bit six)
        ((1, 16, 600, 800), 2, 0, True),          # fp32 15.4 MB, 469 tiles: eight stages would cut 541, seven 475
        ((1, 32, 400, 512), 4, 0, True),          # 3.3 MB in 16-bit
        ((1, 32, 8, 128, 128), 4, 8, True),       # frames-major, 2 MB groups in 16-bit: past version 6
        ((1, 128, 300, 400), 2, 0, not fp32),     # cpg 64: fp32 30 MB, over 512 tiles: two-pass; 16-bit 475 in 7 stages
        ((1, 256, 256, 256), 2, 0, False),        # cpg 128: two-pass
        ((2, 320, 72, 128), 32, 0, False),        # 369 KB groups (fp32): version 6, two stages
        ((4, 960, 72, 128), 32, 0, False),        # 1.1 MB contiguous (fp32) in version 6's one stage stays there
    ]:
        C = shape[1]
        x = layout_input(shape, "frames-major" if frames else "contiguous", dtype, device)
        w, b = torch.randn(C, device=device, dtype=dtype), torch.randn(C, device=device, dtype=dtype)
        out = check_kernel_serves("stream_rows_kernel", want, x, groups, w, b, what=f"{shape}")
        if want:
            assert_same_bits(out, x, groups, w, b, f"{shape}: not repeatable", times=3)


def stream_case(shape, frames, dtype, device, scale=2, shift=-1):
    """x (contiguous, or frames-major where `frames`; values about `shift` with spread `scale`), a weight and a bias."""
    x = layout_input(shape, "frames-major" if frames else "contiguous", dtype, device, scale=scale, shift=shift)
    C = shape[1]
    return x, torch.randn(C, device=device, dtype=dtype), torch.randn(C, device=device, dtype=dtype)


def stream_vectors_fit(shape, frames, dtype):
    """Whether a channel's run in a segment is whole 16-byte vectors (version 12 takes only those)."""
    return torch.Size(shape[2 + bool(frames):]).numel() % (16 // dtype.itemsize) == 0


@pytest.mark.parametrize("device", CUDA)
@pytest.mark.parametrize("dtype", DTYPES)
def test_version_12_stream_pinned(device, dtype, monkeypatch):
    # Pinned, version 12 also takes small groups: one tile a group, more CTAs than tiles, several tiles a segment,
    # frames-major segments, S of one vector; without SiLU or affine; statistics written. (A tile shorter than the
    # segment's others: (1, 960, 72, 128) of the family-pinned tests, 34 tiles of 8132 floats, the last of 8124.)
    stream_family_ok(device)
    monkeypatch.setenv("VD_GROUP_NORM_KERNEL", "stream")
    torch.manual_seed(0)
    for shape, groups, frames in [((2, 64, 16, 16), 32, 0), ((3, 40, 5, 4, 12), 4, 5), ((1, 8, 8, 1), 2, 0),
                                  ((2, 128, 100, 100), 32, 0), ((2, 64, 14, 36, 64), 8, 14)]:
        x, w, b = stream_case(shape, frames, dtype, device)
        want = stream_vectors_fit(shape, frames, dtype)
        check_pinned_case("stream_rows_kernel", want, x, groups, w, b, f"{shape} {dtype}")


@pytest.mark.parametrize("device", CUDA)
@pytest.mark.parametrize("dtype", DTYPES)
def test_version_12_stream_ring(device, dtype, monkeypatch):
    # Version 12's ring cut other ways (VD_GROUP_NORM_STREAM_RING_KB, VD_GROUP_NORM_STREAM_STAGES): six stages of 32
    # KB (the ring before it filled the shared memory), two of 32 KB, eight of 12.5 KB (more tiles a group), three of
    # 21.25 KB: each matches the reference and repeats its bits.
    stream_family_ok(device)
    monkeypatch.setenv("VD_GROUP_NORM_KERNEL", "stream")
    torch.manual_seed(0)
    for ring_kb, stages in [(192, 6), (64, 2), (100, 8), (64, 3)]:
        monkeypatch.setenv("VD_GROUP_NORM_STREAM_RING_KB", str(ring_kb))
        monkeypatch.setenv("VD_GROUP_NORM_STREAM_STAGES", str(stages))
        for shape, groups, frames in [((1, 64, 256, 256), 8, 0), ((1, 32, 6, 90, 100), 4, 6)]:
            x, w, b = stream_case(shape, frames, dtype, device)
            what = f"{shape} {dtype} ring {ring_kb} KB in {stages}"
            out = check_kernel_serves("stream_rows_kernel", True, x, groups, w, b, what=what)
            assert_same_bits(out, x, groups, w, b, f"{what}: not repeatable", times=2)


@pytest.mark.parametrize("device", CUDA)
@pytest.mark.parametrize("dtype", DTYPES)
def test_version_12_stream_far_mean(device, dtype, monkeypatch):
    # Values far from 0 against their spread (mean 60, spread 0.5: each scale times the mean ~120): 16-bit input has
    # the pivot folded into each channel's shift, float subtracts it; both match the reference. The shapes give a
    # normalizer thread's vectors of a tile one channel ((1, 32, 520, 512)); a new channel at every one of its eight
    # vectors ((1, 64, 16, 16) in one group: 64 channels of S = 256 against 2048 (16-bit) or 1024 elements between a
    # thread's vectors); one vector each in short segments ((2, 64, 16, 16), (3, 40, 5, 4, 12)); a channel's end
    # inside a tile ((1, 32, 6, 90, 100): S = 9000, frames-major segments).
    stream_family_ok(device)
    monkeypatch.setenv("VD_GROUP_NORM_KERNEL", "stream")
    torch.manual_seed(0)
    for shape, groups, frames in [((1, 32, 520, 512), 4, 0), ((1, 64, 16, 16), 1, 0), ((2, 64, 16, 16), 32, 0),
                                  ((3, 40, 5, 4, 12), 4, 5), ((1, 32, 6, 90, 100), 4, 6)]:
        x, w, b = stream_case(shape, frames, dtype, device, scale=0.5, shift=60)
        want = stream_vectors_fit(shape, frames, dtype)
        for silu in (True, False):
            check_kernel_serves("stream_rows_kernel", want, x, groups, w, b, silu, what=f"{shape} {dtype} far mean")


@pytest.mark.parametrize("device", CUDA)
@pytest.mark.parametrize("dtype", DTYPES)
def test_version_13_stream_cols(device, dtype, monkeypatch):
    # Version 13 (sm_90): version 12's tiles and slots over channels_last blocks of gb groups (a tile: rows of a block,
    # one tensor copy), each group's slots merged once, by a folder warp of the CTA that counts the block's last tile
    # (four folder warps by default, fewer with VD_GROUP_NORM_STREAM_COLS_FOLDERS: the same bits).
    # It serves the float32 rows larger than the L2 that version 8 declines or would hold in one stage at two CTAs an
    # SM; VD_GROUP_NORM_STREAM_COLS=0 leaves them to the two-pass kernels and version 8. Pins where it runs, that its
    # output matches the reference, is the same bit for bit on every call (tiles go to whichever CTA asks first,
    # blocks are folded by whichever CTA counts last) and with a bulk copy a row instead of the tensor copies (the same
    # tiles).
    stream_family_ok(device)
    monkeypatch.delenv("VD_GROUP_NORM_KERNEL", raising=False)
    monkeypatch.delenv("VD_GROUP_NORM_STREAM_COLS", raising=False)
    torch.manual_seed(0)
    fp32 = dtype == torch.float32
    for shape, want in [((6, 960, 72, 128), fp32),   # gb 4 (120 channels, 480-byte rows), 84 tiles of 110 rows a block
                        ((1, 960, 48, 64), False),   # 11.8 MB (fp32): within the L2, two-pass
                        ((2, 320, 72, 128), False),  # version 8 (fp32 within the L2)
                        # 71 MB fp32: version 8 would hold 92 KB parts in one stage at two CTAs an SM
                        ((6, 320, 72, 128), fp32)]:
        C = shape[1]
        x = layout_input(shape, "channels_last", dtype, device)
        w, b = torch.randn(C, device=device, dtype=dtype), torch.randn(C, device=device, dtype=dtype)
        out = check_kernel_serves("stream_cols_kernel", want, x, 32, w, b, what=f"{shape} by default")
        with monkeypatch.context() as m:
            m.setenv("VD_GROUP_NORM_STREAM_COLS", "0")
            check_kernel_serves("stream_cols_kernel", False, x, 32, w, b, what=f"{shape} turned off")
        if want:
            assert_same_bits(out, x, 32, w, b, f"{shape}: not repeatable", times=3)
            with monkeypatch.context() as m:
                m.setenv("VD_GROUP_NORM_STREAM_COLS_COPY", "rows")
                assert_same_bits(out, x, 32, w, b, f"{shape}: bulk copies differ")
            for folders in ("1", "3"):  # a group's fold is the same whichever folder warp takes it
                with monkeypatch.context() as m:
                    m.setenv("VD_GROUP_NORM_STREAM_COLS_FOLDERS", folders)
                    assert_same_bits(out, x, 32, w, b, f"{shape}: {folders} folder warps differ")


@pytest.mark.parametrize("device", CUDA)
@pytest.mark.parametrize("dtype", DTYPES)
def test_version_13_stream_cols_pinned(device, dtype, monkeypatch):
    # Pinned ("stream"), version 13 takes channels_last input of any size: a block's last tile shorter, one tile a
    # block, more CTAs than tiles, vectors straddling groups, the whole row one block, 5-D, narrow rows (a bulk copy
    # of 16 bytes a row); without SiLU or affine; statistics written.
    stream_family_ok(device)
    monkeypatch.setenv("VD_GROUP_NORM_KERNEL", "stream")
    torch.manual_seed(0)
    for shape, groups, want in [
        ((2, 960, 20, 30), 32, True),    # cpg 30: gb 8; 600 rows in tiles of a box each, the last one short
        ((2, 64, 5, 7), 32, True),       # cpg 2: all groups in one block, one tile a block
        ((1, 192, 40, 40), 32, True),    # cpg 6: vectors straddle groups; the whole 192-channel row a block
        ((2, 320, 3, 10, 12), 32, True),  # 5-D channels_last_3d, cpg 10: gb 16
        ((1, 8, 3, 2), 2, True),         # cpg 4, S 6: rows of 16 (16-bit) or 32 bytes
        ((1, 32, 512, 512), 32, True),   # cpg 1: 16-byte rows (fp32: gb 4, 79 tiles of 13 boxes of 256 rows)
        ((1, 128, 300, 400), 2, False),  # cpg 64 (fp32: 575 tiles a group at its narrowest): two-pass
        ((2, 12, 5, 5), 3, None),        # C whole vectors in fp32 only (16-bit: two-pass)
    ]:
        want = dtype == torch.float32 if want is None else want
        C = shape[1]
        x = layout_input(shape, "channels_last", dtype, device, scale=2, shift=-1)
        w, b = torch.randn(C, device=device, dtype=dtype), torch.randn(C, device=device, dtype=dtype)
        check_pinned_case("stream_cols_kernel", want, x, groups, w, b, f"{shape} {dtype}")
        if want:  # tensor copies (one or several boxes a tile) and a bulk copy a row fill the same tiles
            out = group_norm_silu(x, groups, w, b, 1e-5, True)
            with monkeypatch.context() as m:
                m.setenv("VD_GROUP_NORM_STREAM_COLS_COPY", "rows")
                assert_same_bits(out, x, groups, w, b, f"{shape} {dtype}: bulk copies")


@pytest.mark.parametrize("device", CUDA)
@pytest.mark.parametrize("dtype", DTYPES)
def test_misaligned_input(device, dtype):
    # One element into its storage: no 16-byte vectors, whatever the shape.
    shape = (2, 320, 8, 16)
    x = (torch.randn(torch.Size(shape).numel() + 1, device=device) * 2 - 1).to(dtype)[1:].view(shape)
    assert x.data_ptr() % 16 != 0
    w, b = torch.randn(320, device=device, dtype=dtype), torch.randn(320, device=device, dtype=dtype)
    out = group_norm_silu(x, 32, w, b)
    assert_close_to(out, reference_group_norm_silu(x.double(), 32, w.double(), b.double()), dtype)


@pytest.mark.parametrize("device", CUDA)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("cl", [False, True])
def test_cluster_blocks_share_statistics(device, family, dtype, cl):
    # Without affine, equal inputs of a group must give equal outputs, bit for bit, whichever block of
    # the cluster holds them: every block must end with the same mean and rstd.
    torch.manual_seed(0)
    x = torch.randint(0, 5, (2, 320, 72, 128), device=device).to(dtype)
    if cl:
        x = channels_last(x)
    out = group_norm_silu(x, 32).contiguous().reshape(2, 32, -1)
    xg = x.contiguous().reshape(2, 32, -1)
    for n in range(2):
        for g in (0, 31):
            for v in range(5):
                ys = out[n, g][xg[n, g] == v]
                assert (ys == ys[0]).all(), f"group ({n}, {g}), x = {v}: {ys.unique().tolist()}"


@pytest.mark.parametrize("device", CUDA)
@pytest.mark.parametrize("shape,groups", [((2, 320, 72, 128), 32), ((1, 512, 72, 128), 32), ((1, 960, 72, 128), 32),
                                          ((1, 64, 256, 256), 8)])
@pytest.mark.parametrize("cl", [False, True])
def test_large_mean_small_spread_on_chip(device, family, shape, groups, cl):
    # As test_large_mean_small_spread, over a group split across a cluster (and, where a family does not
    # take the shape, the two-pass path).
    torch.manual_seed(0)
    x = torch.randn(shape, device=device) * 0.05 + 1000
    if cl:
        x = channels_last(x)
    assert_close_to(group_norm_silu(x, groups), reference_group_norm_silu(x.double(), groups), torch.float32,
                    factor=5)


@pytest.mark.parametrize("device", CUDA)
@pytest.mark.parametrize("shape,cl", [
    ((1025, 32, 256, 256), False),  # the last groups start past 2^31 (version 6: 128 KB groups, K 2)
    ((6600, 320, 32, 32), True),    # channels_last on version 8 (clusters of 4): the last samples past 2^31
])
def test_over_2_31_elements(device, shape, cl):
    if torch.cuda.get_device_properties(device).total_memory < 24 * 2**30:
        pytest.skip("needs 24 GiB of GPU memory")
    torch.manual_seed(0)
    N, C = shape[:2]
    x = torch.randn(shape, device=device, dtype=torch.bfloat16)
    if cl:
        x = channels_last(x)
    w, b = torch.randn(C, device=device, dtype=torch.bfloat16), torch.randn(C, device=device, dtype=torch.bfloat16)
    out = group_norm_silu(x, 32, w, b)
    for sl in (slice(0, 1), slice(N - 2, N)):
        ref = reference_group_norm_silu(x[sl].double(), 32, w.double(), b.double())
        assert_close_to(out[sl], ref, torch.bfloat16, what=f"samples {sl}")


# The backward of NC* input with each group on chip (version 7: persistent clusters, x's and dy's parts in a
# shared-memory stage of up to 48 KB, or one of up to 96 KB at K 16). Comments give the 16-bit plan (fp32 parts
# hold half as many elements).
BACKWARD_ON_CHIP_CASES = [
    # The plan: the smallest cluster whose part of x and dy fits one stage of up to 96 KB (several stages where
    # parts are small enough).
    ((40, 256, 9, 16), 32),    # M 1152, S 144: K 1, four stages, 1280 groups (stages reused), runs shorter than 32
    ((20, 640, 36, 64), 32),   # K 2 (16-bit), 4 (fp32), one 92 KB stage
    ((2, 320, 72, 128), 32),   # K 4 (16-bit; the round-fill rule may take K 8 at three CTAs), 8 (fp32): parts
                               # straddle channels
    ((2, 320, 70, 100), 32),   # S 7000: K 4 / 8, the last rank holds fewer vectors
    ((1, 512, 72, 128), 32),   # K 8 (16-bit); K 16 (fp32), one 74 KB stage
    ((2, 40, 4, 4, 3), 4),     # 5-D, M 480
    ((2, 64, 7, 9), 32),       # S 63: not whole vectors a channel, two-pass
    ((1, 960, 72, 128), 32),   # 30 channels of 9216: K 16 in one 69 KB stage (16-bit); two-pass (fp32: 138 KB)
    ((1, 64, 256, 256), 8),    # 1 MB groups (16-bit): two-pass
]


def backward_on_chip(shape, groups, dtype):
    """Whether version 7 takes the case: whole vectors a channel, cpg <= 256, parts of x and dy that fit a stage
    (up to 96 KB, one a CTA, at 16 CTAs a group)."""
    vec = 16 // torch.tensor([], dtype=dtype).element_size()
    S = torch.Size(shape[2:]).numel()
    cpg = shape[1] // groups
    part = -(-cpg * S // vec // 16)
    stage = 2 * (-(-part * 16 // 128) * 128)
    return S % vec == 0 and cpg <= 256 and stage <= 96 * 1024


def backward_inputs(shape, device, dtype):
    """x (mean 1, spread 3), grad_out, weight and bias for a backward case."""
    C = shape[1]
    x = (torch.randn(shape, device=device) * 3 + 1).to(dtype)
    g = torch.randn(shape, device=device, dtype=dtype)
    return x, g, torch.randn(C, device=device, dtype=dtype), torch.randn(C, device=device, dtype=dtype)


def check_backward_kernel(kernel, want, g, x, groups, w, b):
    """For SiLU and affine on, SiLU off, affine off, each with the statistics computed by the backward and with the
    forward's (what autograd passes): asserts whether `kernel` serves the backward, and dx, grad_weight, grad_bias
    (and dx's layout) against the float64 reference."""
    for silu, affine in ((True, True), (False, True), (True, False)):
        wa, ba = (w, b) if affine else (None, None)
        xr = x.double().requires_grad_()
        wr = w.double().requires_grad_() if affine else None
        br = b.double().requires_grad_() if affine else None
        inputs = [t for t in (xr, wr, br) if t is not None]
        ref = torch.autograd.grad(reference_group_norm_silu(xr, groups, wr, br, 1e-5, silu), inputs, g.double())
        _, stats = torch.ops.vd.group_norm_silu_forward(x, groups, wa, ba, 1e-5, silu)
        for st in (None, stats):

            def run():
                return torch.ops.vd.group_norm_silu_backward(g, x, groups, wa, ba, 1e-5, silu, st)
            names = cuda_kernels_run(run)
            what = f"{tuple(x.shape)} {x.dtype} silu={silu} affine={affine} saved statistics={st is not None}"
            assert any(kernel in n for n in names) == want, (what, sorted(set(names)))
            dx, dw, db = run()
            assert dx.stride() == x.stride(), f"dx keeps x's layout ({what})"
            assert_close_to(dx, ref[0], x.dtype, what=f"dx {what}")
            if affine:
                assert_close_to(dw, ref[1], x.dtype, factor=4, what=f"dw {what}")
                assert_close_to(db, ref[2], x.dtype, factor=4, what=f"db {what}")


@pytest.mark.parametrize("device", CUDA)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("variant", ["", "smem2", "recompute"])
def test_backward_on_chip(device, dtype, variant, monkeypatch):
    # dx, grad_weight, grad_bias against the float64 reference, with and without SiLU and affine, as chosen
    # (three CTAs an SM where the cluster need not grow, e.g. (1, 512, 72, 128), or at twice the cluster by the
    # round-fill rule; dz kept from the sums' pass),
    # pinned to two CTAs an SM, and with dz evaluated again for dx (VD_GROUP_NORM_BACKWARD_DZ=recompute);
    # pins which kernel serves each case, and that VD_GROUP_NORM_BACKWARD=twopass keeps version 1.
    version_7_as_chosen(device, monkeypatch)
    if variant == "recompute":
        monkeypatch.setenv("VD_GROUP_NORM_BACKWARD_DZ", variant)
    elif variant:
        monkeypatch.setenv("VD_GROUP_NORM_BACKWARD", variant)
    torch.manual_seed(0)
    for shape, groups in BACKWARD_ON_CHIP_CASES:
        want_chip = backward_on_chip(shape, groups, dtype)
        x, g, w, b = backward_inputs(shape, device, dtype)
        check_backward_kernel("smem_grad_kernel", want_chip, g, x, groups, w, b)
    assert any(backward_on_chip(s, g, dtype) for s, g in BACKWARD_ON_CHIP_CASES)
    monkeypatch.setenv("VD_GROUP_NORM_BACKWARD", "twopass")
    x = torch.randn(2, 320, 72, 128, device=device, dtype=dtype)
    names = cuda_kernels_run(lambda: torch.ops.vd.group_norm_silu_backward(x, x, 32, None, None, 1e-5, True))
    assert not any("smem_grad_kernel" in n for n in names)


def clear_backward_switches(monkeypatch):
    """The backward's kernel switches (VD_GROUP_NORM_BACKWARD*) unset (the test sets those it compares)."""
    for name in [n for n in os.environ if n.startswith("VD_GROUP_NORM_BACKWARD")]:
        monkeypatch.delenv(name)


def version_7_as_chosen(device, monkeypatch):
    """Skips below sm_90 (version 7 needs the bulk copy engine and clusters), then clears the backward's switches."""
    if torch.cuda.get_device_capability(device)[0] < 9:
        pytest.skip("version 7 needs the bulk copy engine and clusters (sm_90+)")
    clear_backward_switches(monkeypatch)


@pytest.mark.parametrize("device", CUDA)
@pytest.mark.parametrize("dtype", DTYPES)
def test_backward_on_chip_chunks(device, dtype, monkeypatch):
    # Version 7 lands a CTA's part in chunks, each with its own barrier (VD_GROUP_NORM_BACKWARD_CHUNKS, 2 by
    # default), and its sums' pass starts on the first; one-stage plans also take dx a chunk at a time and refill
    # each chunk with the next group's (VD_GROUP_NORM_BACKWARD_EARLY). The sums' runs and their order do not change,
    # nor dx's formula, so every setting gives the same bits as one chunk without refills; with the forward's
    # statistics and without, SiLU on and off, dz kept and evaluated again. Plans (16-bit; fp32 parts twice the
    # vectors): one stage at two CTAs an SM, with several groups a cluster ((20, 640, 36, 64), K 2) and parts whose
    # last rank is short ((2, 320, 70, 100)); one stage at three CTAs an SM, several groups a cluster ((8, 512, 72,
    # 128), K 8); two stages of 1440-vector parts in 16-bit ((4, 640, 18, 32); fp32 (4, 320, 18, 32)), so stage 1's
    # chunk barriers; four stages of short parts ((40, 256, 9, 16): one chunk in 16-bit).
    version_7_as_chosen(device, monkeypatch)
    torch.manual_seed(0)
    shapes = [(2, 320, 72, 128), (2, 320, 70, 100), (20, 640, 36, 64), (40, 256, 9, 16), (8, 512, 72, 128),
              (4, 640, 18, 32), (4, 320, 18, 32)]
    for shape in shapes:
        x, g, w, b = backward_inputs(shape, device, dtype)
        for silu, dz in ((True, "keep"), (True, "recompute"), (False, "keep")):
            monkeypatch.setenv("VD_GROUP_NORM_BACKWARD_DZ", dz)
            _, stats = torch.ops.vd.group_norm_silu_forward(x, 32, w, b, 1e-5, silu)
            for st in (stats, None):
                def run():
                    return torch.ops.vd.group_norm_silu_backward(g, x, 32, w, b, 1e-5, silu, st)
                monkeypatch.setenv("VD_GROUP_NORM_BACKWARD_CHUNKS", "1")
                monkeypatch.setenv("VD_GROUP_NORM_BACKWARD_EARLY", "0")
                names = cuda_kernels_run(run)
                assert any("smem_grad_kernel" in n for n in names), (shape, sorted(set(names)))
                want = run()
                for early, chunks in itertools.product(("0", "1"), ("1", "2", "3", "4", "8")):
                    monkeypatch.setenv("VD_GROUP_NORM_BACKWARD_CHUNKS", chunks)
                    monkeypatch.setenv("VD_GROUP_NORM_BACKWARD_EARLY", early)
                    for got, ref, name in zip(run(), want, ("dx", "dw", "db")):
                        what = f"{name} {shape} {dtype} silu={silu} dz={dz} chunks={chunks} early={early}"
                        assert torch.equal(got, ref), what


@pytest.mark.parametrize("device", CUDA)
@pytest.mark.parametrize("dtype", DTYPES)
def test_backward_on_chip_runs(device, dtype, monkeypatch):
    # Version 7's sums' pass cuts each channel into runs of up to four vectors a lane that cut a whole channel evenly
    # (VD_GROUP_NORM_BACKWARD_RUN=fewest: the fewest runs alone; =2: the earlier rule, two a lane for channels of
    # >= 128 vectors, else one); dx walks the same runs where channels are long and the part is not refilled chunk by
    # chunk. Channels of (16-bit vectors; fp32 twice as many): 1152 (nine runs of four a lane, a whole channel; one
    # stage with refills), 875 (a short last run), 800 (no even cut: the fewest runs, 6 × 128 + 32; fp32 1600: 17 of
    # three), 288 (three of three; fp32 576: six of three, or four of four and one of two at =fewest), 72 (a channel a
    # run, three a lane; two stages at (4, 640, 18, 32)), 40 (two a lane), 18 (one); fp32 (4, 320, 18, 32) two stages
    # of 144 (96 + 48). One-stage plans also without refills
    # (VD_GROUP_NORM_BACKWARD_EARLY=0: dx by the runs where channels are long). Every setting against the float64
    # reference, with the kernel pinned; refills or not give the same bits.
    version_7_as_chosen(device, monkeypatch)
    torch.manual_seed(0)
    shapes = [(2, 320, 72, 128), (2, 320, 70, 100), (2, 320, 80, 80), (20, 640, 36, 64), (4, 640, 18, 32),
              (4, 256, 16, 20), (40, 256, 9, 16), (4, 320, 18, 32)]
    for shape in shapes:
        x, g, w, b = backward_inputs(shape, device, dtype)
        for run in ("", "fewest", "2"):
            monkeypatch.setenv("VD_GROUP_NORM_BACKWARD_RUN", run)
            outs = {}
            for early in ("", "0"):
                monkeypatch.setenv("VD_GROUP_NORM_BACKWARD_EARLY", early)
                check_backward_kernel("smem_grad_kernel", True, g, x, 32, w, b)
                outs[early] = torch.ops.vd.group_norm_silu_backward(g, x, 32, w, b, 1e-5, True)
            for got, want, name in zip(outs[""], outs["0"], ("dx", "dw", "db")):
                assert torch.equal(got, want), f"{name} {shape} {dtype} run={run or 'default'}: refills change the bits"


def on_chip_ctas_an_sm(run):
    """The CTAs an SM (the BLOCKS argument) of the version 7 kernel one call of run launches."""
    pattern = re.compile(r"smem_grad_kernel<[^,]+, \w+, (\d)")
    found = {m.group(1) for n in cuda_kernels_run(run) for m in [pattern.search(n)] if m}
    assert len(found) == 1, found
    return int(found.pop())


@pytest.mark.parametrize("device", CUDA)
@pytest.mark.parametrize("dtype", DTYPES)
def test_backward_on_chip_round_fill(device, dtype, monkeypatch):
    # Where two CTAs an SM take a group each in one stage and their last round leaves many clusters idle, version 7
    # takes three CTAs an SM at twice the cluster (half the part); VD_GROUP_NORM_BACKWARD_FILL=0 keeps two. Both
    # against the float64 reference. (N, 1280, 18, 32) in 16-bit ((N, 1280, 16, 16) in fp32; stages of 90 KB
    # (16-bit) and 80 KB (fp32)) on a 132-SM device: N = 28, 896 groups over 264 CTAs, four rounds, the last 40 % full, against
    # 396 CTAs in clusters of two, five rounds of half the bytes (costs less); N = 20, 640 groups, three rounds, the
    # last 42 % full, against four (the same cost, the last round under half full). Other SM counts fill the rounds
    # otherwise: there only correctness is asserted.
    version_7_as_chosen(device, monkeypatch)
    torch.manual_seed(0)
    for n in (28, 20):
        shape = (n, 1280, 18, 32) if dtype != torch.float32 else (n, 1280, 16, 16)
        x, g, w, b = backward_inputs(shape, device, dtype)
        blocks = {}
        for fill in ("1", "0"):
            monkeypatch.setenv("VD_GROUP_NORM_BACKWARD_FILL", fill)
            check_backward_kernel("smem_grad_kernel", True, g, x, 32, w, b)
            blocks[fill] = on_chip_ctas_an_sm(
                lambda: torch.ops.vd.group_norm_silu_backward(g, x, 32, w, b, 1e-5, True))
        assert blocks["0"] == 2, shape
        if torch.cuda.get_device_properties(device).multi_processor_count == 132:
            assert blocks["1"] == 3, shape


@pytest.mark.parametrize("device", CUDA)
@pytest.mark.parametrize("cl", [False, True])
def test_backward_on_chip_deterministic_and_precise(device, cl):
    # The same bits on every call (no atomics anywhere in the sums), and x - mean kept exact when the mean
    # dwarfs the spread (fp32; NCHW: version 7, a group split over a cluster of 16; channels_last: version 10,
    # blocks of two groups over a cluster of 16).
    torch.manual_seed(0)
    shape = (2, 640, 36, 64) if cl else (2, 320, 72, 128)
    x = torch.randn(shape, device=device) * 0.05 + 1000
    if cl:
        x = channels_last(x)
    g = torch.randn_like(x)
    w, b = torch.randn(shape[1], device=device), torch.randn(shape[1], device=device)
    xr, wr, br = (t.double().requires_grad_() for t in (x, w, b))
    ref = torch.autograd.grad(reference_group_norm_silu(xr, 32, wr, br), (xr, wr, br), g.double())
    _, stats = torch.ops.vd.group_norm_silu_forward(x, 32, w, b, 1e-5, True)
    for st in (None, stats):  # the statistics taken by the backward, and the forward's (mean as high + low parts)
        if torch.cuda.get_device_capability(device)[0] >= 9:
            names = cuda_kernels_run(lambda: torch.ops.vd.group_norm_silu_backward(g, x, 32, w, b, 1e-5, True, st))
            assert any(("smem_cols_grad_kernel" if cl else "smem_grad_kernel") in n for n in names), sorted(set(names))
        first = torch.ops.vd.group_norm_silu_backward(g, x, 32, w, b, 1e-5, True, st)
        for _ in range(3):
            again = torch.ops.vd.group_norm_silu_backward(g, x, 32, w, b, 1e-5, True, st)
            for u, v in zip(first, again):
                assert torch.equal(u, v)
        for got, want, name in zip(first, ref, "xwb"):
            assert_close_to(got, want, torch.float32, factor=5, what=f"grad {name} saved statistics={st is not None}")


# The 16-bit backward's lean kernels (on by default; VD_GROUP_NORM_BACKWARD_LEAN=0 keeps the earlier form): (layout,
# shape, the kernel, the ends of its name lean and not, with SiLU, then without). Version 7 at two CTAs an SM with
# SiLU takes 384 threads a CTA (VD_GROUP_NORM_BACKWARD_THREADS=256 keeps 256); at three CTAs an SM
# ((1, 512, 72, 128)) and without SiLU, 256.
LEAN_CASES = [
    ("nchw", (2, 320, 72, 128), "smem_grad_kernel", ("2, 1, 384, true>", "2, 1, 384, false>"),
     ("2, 0, 256, true>", "2, 0, 256, false>")),
    ("nchw", (1, 512, 72, 128), "smem_grad_kernel", ("3, 1, 256, true>", "3, 1, 256, false>"),
     ("3, 0, 256, true>", "3, 0, 256, false>")),
    ("cl", (2, 320, 72, 128), "grad_sums_cols_kernel", ("4, 8, true>", "4, 8, false>"), ("4, 8, true>", "4, 8, false>")),
    ("fm", (1, 320, 4, 36, 64), "grad_sums_rows_kernel", ("8, true>", "8, false>"), ("8, true>", "8, false>")),
]


def launched(names, kernel, end):
    """Whether a kernel `kernel<..., end` is among the profiler's names."""
    short = [n.replace("(anonymous namespace)", "").split("(")[0] for n in names]
    return any(kernel + "<" in n and n.endswith(end) for n in short)


@pytest.mark.parametrize("device", CUDA)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("layout,shape,kernel,ends_silu,ends_plain", LEAN_CASES)
def test_backward_lean_16bit(device, dtype, layout, shape, kernel, ends_silu, ends_plain, monkeypatch):
    # The lean kernels fold the group mean into z's shift and dx's constant (sums of dz * x, moved to the mean
    # afterwards): against the float64 reference they stay within 1.5x the earlier form's error (plus a 16-bit
    # rounding step), with and without SiLU, on input of mean 1 and spread 3 and on input whose mean is 12 spreads
    # out; each form pinned by its kernel's name.
    if layout == "nchw" and torch.cuda.get_device_capability(device)[0] < 9:
        pytest.skip("version 7 needs the bulk copy engine and clusters (sm_90+)")
    clear_backward_switches(monkeypatch)  # the kernels as chosen, but for the round-fill rule, which may take three
    monkeypatch.setenv("VD_GROUP_NORM_BACKWARD_FILL", "0")  # CTAs an SM for (2, 320, 72, 128)'s 64 groups
    torch.manual_seed(0)
    if layout == "fm":
        B, C, F, H, W = shape
        make = lambda t: frames_major(t.reshape(B, F, C, H, W))  # noqa: E731
    else:
        C = shape[1]
        make = (lambda t: channels_last(t.reshape(shape))) if layout == "cl" else (lambda t: t.reshape(shape))
    n = torch.Size(shape).numel()
    w, b = torch.randn(C, device=device, dtype=dtype), torch.randn(C, device=device, dtype=dtype)
    g = make(torch.randn(n, device=device).to(dtype))
    eps16 = 2.0 ** -8 if dtype == torch.bfloat16 else 2.0 ** -11
    for loc, scale in ((1.0, 3.0), (6.0, 0.5)):
        x = make((torch.randn(n, device=device) * scale + loc).to(dtype))
        for silu in (True, False):
            xr, wr, br = (t.double().requires_grad_() for t in (x, w, b))
            ref = torch.autograd.grad(reference_group_norm_silu(xr, 32, wr, br, 1e-5, silu), (xr, wr, br), g.double())
            _, stats = torch.ops.vd.group_norm_silu_forward(x, 32, w, b, 1e-5, silu)

            def run():
                return torch.ops.vd.group_norm_silu_backward(g, x, 32, w, b, 1e-5, silu, stats)
            errs = {}
            for lean, end in zip(("1", "0"), ends_silu if silu else ends_plain):
                monkeypatch.setenv("VD_GROUP_NORM_BACKWARD_LEAN", lean)
                names = cuda_kernels_run(run)
                assert launched(names, kernel, end), (layout, lean, silu, sorted(set(names)))
                errs[lean] = [((u.double() - r).abs().max() / r.abs().max()).item() for u, r in zip(run(), ref)]
            what = f"{layout} {tuple(shape)} {dtype} loc={loc} silu={silu}: lean {errs['1']} vs {errs['0']}"
            for e_lean, e_plain in zip(errs["1"], errs["0"]):
                assert e_lean <= 1.5 * e_plain + eps16, what
    if ends_silu[0].endswith("384, true>"):
        monkeypatch.setenv("VD_GROUP_NORM_BACKWARD_LEAN", "1")
        monkeypatch.setenv("VD_GROUP_NORM_BACKWARD_THREADS", "256")
        names = cuda_kernels_run(lambda: torch.ops.vd.group_norm_silu_backward(g, x, 32, w, b, 1e-5, True))
        assert launched(names, kernel, "2, 1, 256, true>"), sorted(set(names))


# Version 10 (channels_last backward on chip, sm_90): (shape, groups, taken in 16-bit, taken in fp32). Comments give
# the plan in 16-bit (fp32 blocks have half the channels, the same bytes): blocks of gb groups (version 8's, or fewer
# where x and dy of a block would not fit 16 CTAs), the smallest cluster whose rows fit one stage, larger ones while
# there are fewer than two CTAs an SM.
BACKWARD_COLS_ON_CHIP_CASES = [
    ((40, 1280, 9, 16), 32, True, True),    # 46 KB stages: K 1, two stages, 640 blocks (stages reused)
    ((20, 640, 36, 64), 32, True, True),    # K 8 by size, then 16: 144-row boxes
    # Blocks needing 16 CTAs go to version 1 in every dtype: gb 4 (version 8's 8 would not fit), K 16, one 90 KB stage
    ((2, 320, 72, 128), 32, False, False),
    ((1, 512, 72, 128), 32, False, False),  # gb 2: 64-byte rows, one 74 KB stage at K 16
    ((2, 1280, 18, 32), 32, True, True),    # K 2 by size, then 8
    ((2, 24, 5, 7), 3, True, True),         # 35 rows in a box of 40 (past the sample: zeros), K 1
    ((2, 40, 4, 4, 3), 4, True, True),      # 5-D channels_last_3d
    ((2, 48, 6, 6), 16, False, True),       # cpg 3: a 16-bit vector would span three groups
    ((2, 960, 72, 128), 32, False, False),  # 30 channels a group: no block of whole vectors fits
    ((1, 64, 256, 256), 8, False, False),   # 1 MB of x a group
]


@pytest.mark.parametrize("device", CUDA)
@pytest.mark.parametrize("dtype", DTYPES)
def test_backward_channels_last_on_chip(device, dtype, monkeypatch):
    # dx, grad_weight, grad_bias of channels_last input against the float64 reference, with and without SiLU and
    # affine; pins which kernel serves each case, and that VD_GROUP_NORM_BACKWARD=twopass keeps version 1.
    if torch.cuda.get_device_capability(device)[0] < 9:
        pytest.skip("version 10 needs tensor copies and clusters (sm_90+)")
    torch.manual_seed(0)
    for shape, groups, want16, want32 in BACKWARD_COLS_ON_CHIP_CASES:
        want = want32 if dtype == torch.float32 else want16
        C = shape[1]
        x = channels_last((torch.randn(shape, device=device) * 3 + 1).to(dtype))
        g = channels_last(torch.randn(shape, device=device, dtype=dtype))
        w, b = torch.randn(C, device=device, dtype=dtype), torch.randn(C, device=device, dtype=dtype)
        check_backward_kernel("smem_cols_grad_kernel", want, g, x, groups, w, b)
    monkeypatch.setenv("VD_GROUP_NORM_BACKWARD", "twopass")
    x = channels_last(torch.randn(2, 320, 72, 128, device=device, dtype=dtype))
    names = cuda_kernels_run(lambda: torch.ops.vd.group_norm_silu_backward(x, x, 32, None, None, 1e-5, True))
    assert not any("smem_cols_grad_kernel" in n for n in names)


@pytest.mark.parametrize("device", CUDA)
@pytest.mark.parametrize("dtype", DTYPES)
def test_backward_two_pass_channels_last(device, dtype, monkeypatch):
    # Version 1's channels_last backward (VD_GROUP_NORM_BACKWARD=twopass) as chosen: eight rows of x and dy a load for
    # 16-bit input (8-byte vectors), four for float; threads with fewer rows than a load and a remainder, blocks
    # shorter than the others, 5-D input, at 32 and 128 rows a thread (VD_GROUP_NORM_BACKWARD_COL_ROWS); against the
    # float64 reference, and the same bits as one row a load (VD_GROUP_NORM_BACKWARD_COL_BATCH=1: the sums in the
    # same order).
    monkeypatch.setenv("VD_GROUP_NORM_BACKWARD", "twopass")
    monkeypatch.delenv("VD_GROUP_NORM_BACKWARD_LEAN", raising=False)
    rows_a_load = ", 4, 8, true>" if dtype.itemsize == 2 else ", 4, 4, false>"  # 16-bit: the lean kernels
    torch.manual_seed(0)
    for shape, groups in [((2, 64, 7, 9), 8), ((1, 320, 33, 17), 32), ((2, 40, 3, 5, 7), 4), ((3, 1280, 5, 61), 32)]:
        C = shape[1]
        x = layout_input(shape, "channels_last", dtype, device)
        g = channels_last(torch.randn(shape, device=device, dtype=dtype))
        w, b = torch.randn(C, device=device, dtype=dtype), torch.randn(C, device=device, dtype=dtype)
        _, stats = FORWARD_WITH_STATS(x, groups, w, b, 1e-5, True)
        for rows in ("32", "128"):
            monkeypatch.setenv("VD_GROUP_NORM_BACKWARD_COL_ROWS", rows)
            check_backward_kernel("dx_cols_kernel", True, g, x, groups, w, b)
            batched = torch.ops.vd.group_norm_silu_backward(g, x, groups, w, b, 1e-5, True, stats)
            names = cuda_kernels_run(
                lambda: torch.ops.vd.group_norm_silu_backward(g, x, groups, w, b, 1e-5, True, stats))
            assert any(rows_a_load in n for n in names if "dx_cols" in n), sorted(set(names))
            with monkeypatch.context() as m:
                m.setenv("VD_GROUP_NORM_BACKWARD_COL_BATCH", "1")
                single = torch.ops.vd.group_norm_silu_backward(g, x, groups, w, b, 1e-5, True, stats)
            for got, want, name in zip(batched, single, ("dx", "dw", "db")):
                assert torch.equal(got, want), f"{name} {shape} {dtype} rows {rows}: batched loads differ from one row"


@pytest.mark.parametrize("device", CUDA)
@pytest.mark.parametrize("dtype", DTYPES)
def test_forward_two_pass_channels_last(device, dtype, monkeypatch):
    # Version 1's channels_last forward (VD_GROUP_NORM_KERNEL=twopass) as chosen: the apply loads eight rows at a time
    # for 16-bit input (8-byte vectors), one 16-byte row for float; threads with fewer rows than a load and a
    # remainder, blocks shorter than the others, two column tiles, 5-D input; with and without SiLU; against the
    # float64 reference, and the same bits as one 16-byte row a load (VD_GROUP_NORM_APPLY_COL_BATCH=1).
    monkeypatch.setenv("VD_GROUP_NORM_KERNEL", "twopass")
    chosen = ", 4, 8, 4>" if dtype.itemsize == 2 else ", 4, 1, 6>"
    torch.manual_seed(0)
    for shape, groups in [((2, 64, 7, 9), 8), ((1, 320, 33, 17), 32), ((2, 40, 3, 5, 7), 4), ((3, 1280, 5, 61), 32),
                          ((2, 2560, 3, 5), 32)]:
        C = shape[1]
        x = layout_input(shape, "channels_last", dtype, device)
        w, b = torch.randn(C, device=device, dtype=dtype), torch.randn(C, device=device, dtype=dtype)
        for silu in (True, False):
            out = check_kernel_serves("apply_cols_kernel", True, x, groups, w, b, silu, what=f"{shape}")
            names = cuda_kernels_run(lambda: group_norm_silu(x, groups, w, b, 1e-5, silu))
            assert any(chosen in n for n in names if "apply_cols" in n), sorted(set(names))
            with monkeypatch.context() as m:
                m.setenv("VD_GROUP_NORM_APPLY_COL_BATCH", "1")
                single = group_norm_silu(x, groups, w, b, 1e-5, silu)
            assert torch.equal(out, single), f"{shape} {dtype} silu={silu}: batched rows differ from one row a load"


@pytest.mark.parametrize("device", CUDA)
@pytest.mark.parametrize("dtype", DTYPES)
def test_forward_cols_statistics_rows(device, dtype, monkeypatch):
    # The channels_last statistics of the two-pass kernels at the rows a thread the op picks (blocks filling whole
    # rounds of the device's slots, not under 32 rows: the small shapes keep 32), at the power of two
    # (VD_GROUP_NORM_STATS_COL_FILL=0) and at pinned odd counts (VD_GROUP_NORM_STATS_COL_ROWS: one row a thread,
    # blocks ending mid-batch), against the float64 reference. (2, 1280, 14, 18, 32) on a 132-SM device: 252 blocks
    # at the power of two (16-bit 64 rows a thread, fp32 128 in two column tiles), filled at 41 / 82 rows.
    monkeypatch.setenv("VD_GROUP_NORM_KERNEL", "twopass")
    torch.manual_seed(0)
    for shape, groups in [((3, 320, 19, 23), 32), ((2, 40, 3, 5, 7), 4), ((2, 2560, 3, 5), 32),
                          ((2, 1280, 14, 18, 32), 32)]:
        C = shape[1]
        x = layout_input(shape, "channels_last", dtype, device)
        w, b = torch.randn(C, device=device, dtype=dtype), torch.randn(C, device=device, dtype=dtype)
        ref = reference_group_norm_silu(x.double(), groups, w.double(), b.double(), 1e-5, True)
        for setting in ({}, {"VD_GROUP_NORM_STATS_COL_FILL": "0"}, {"VD_GROUP_NORM_STATS_COL_ROWS": "1"},
                        {"VD_GROUP_NORM_STATS_COL_ROWS": "7"}, {"VD_GROUP_NORM_STATS_COL_ROWS": "77"}):
            what = f"{shape} {dtype} {setting}"
            with monkeypatch.context() as m:
                for k, v in setting.items():
                    m.setenv(k, v)
                out, stats = FORWARD_WITH_STATS(x, groups, w, b, 1e-5, True)
            check_stats(stats, x, groups, 1e-5, what)
            assert_close_to(out, ref, x.dtype, what=what)


def stats_cols_depths(fn):
    """The ring depth (the last template argument) of each cols statistics kernel ``fn()`` launches."""
    names = [n for n in cuda_kernels_run(fn) if "stats_cols_kernel" in n]
    return [int(re.search(r"stats_cols_kernel<([^>]*)>", n).group(1).split(",")[-1]) for n in names]


@pytest.mark.parametrize("device", CUDA)
@pytest.mark.parametrize("dtype", DTYPES)
def test_forward_cols_statistics_ring(device, dtype, monkeypatch):
    # The channels_last statistics with each thread's rows copied into a ring of shared memory
    # (VD_GROUP_NORM_STATS_COL_DEPTH batches a thread) sum the same rows in the same order as plain loads (depth 0):
    # the same bits, at the power-of-two rows (VD_GROUP_NORM_STATS_COL_FILL=0: the fill depends on the kernel's
    # resident blocks) and at pinned counts (one row a thread; blocks ending mid-batch; more batches than the ring
    # holds).
    monkeypatch.setenv("VD_GROUP_NORM_KERNEL", "twopass")
    torch.manual_seed(0)
    for shape, groups in [((3, 320, 19, 23), 32), ((2, 40, 3, 5, 7), 4), ((2, 960, 14, 18, 32), 32)]:
        x = layout_input(shape, "channels_last", dtype, device)
        ref = reference_group_norm_silu(x.double(), groups, None, None, 1e-5, True)
        for rows in (None, "1", "7", "77"):
            with monkeypatch.context() as m:
                if rows:
                    m.setenv("VD_GROUP_NORM_STATS_COL_ROWS", rows)
                else:
                    m.setenv("VD_GROUP_NORM_STATS_COL_FILL", "0")
                m.setenv("VD_GROUP_NORM_STATS_COL_DEPTH", "0")
                plain_out, plain = FORWARD_WITH_STATS(x, groups, None, None, 1e-5, True)
                for depth in (3, 4):
                    what = f"{shape} {dtype} rows={rows} depth={depth}"
                    m.setenv("VD_GROUP_NORM_STATS_COL_DEPTH", str(depth))
                    ran = stats_cols_depths(lambda: FORWARD_WITH_STATS(x, groups, None, None, 1e-5, True))
                    assert ran == [depth], f"{what}: {ran}"
                    out, stats = FORWARD_WITH_STATS(x, groups, None, None, 1e-5, True)
                    assert torch.equal(stats, plain), f"{what}: statistics differ from plain loads"
                    assert torch.equal(out, plain_out), f"{what}: output differs from plain loads"
            check_stats(plain, x, groups, 1e-5, f"{shape} {dtype} rows={rows}")
            assert_close_to(plain_out, ref, x.dtype, what=f"{shape} {dtype} rows={rows}")


@pytest.mark.parametrize("device", CUDA)
@pytest.mark.parametrize("dtype", DTYPES)
def test_forward_cols_statistics_ring_rule(device, dtype, monkeypatch):
    # The op takes the ring (3 batches a thread for 16-bit input, 4 for float) where the blocks make at least a round
    # of the device's slots (three blocks an SM on sm_90), plain loads under it. 960 channels: 36 blocks a sample of
    # 72 x 128 at 128 rows a thread in 16-bit (72 in float); N samples for ~1.6 rounds (18 on 132 SMs: 0.3 GB of
    # bf16), and 2 samples of 14 x 18 x 32 (0.6 rounds at 32 rows).
    monkeypatch.setenv("VD_GROUP_NORM_KERNEL", "twopass")
    torch.manual_seed(0)
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    big = (math.ceil(1.6 * 3 * sms / 36), 960, 72, 128)
    for shape, depth in [(big, 3 if dtype.itemsize == 2 else 4), ((2, 960, 14, 18, 32), 0)]:
        x = layout_input(shape, "channels_last", dtype, device)
        ran = stats_cols_depths(lambda: FORWARD_WITH_STATS(x, 32, None, None, 1e-5, True))
        assert ran == [depth], f"{shape} {dtype}: {ran}"
        out, stats = FORWARD_WITH_STATS(x, 32, None, None, 1e-5, True)
        with monkeypatch.context() as m:
            m.setenv("VD_GROUP_NORM_STATS_COL_DEPTH", "3" if depth == 0 else "0")
            other_out, other = FORWARD_WITH_STATS(x, 32, None, None, 1e-5, True)
        assert torch.equal(stats, other) and torch.equal(out, other_out), f"{shape} {dtype}: ring and plain differ"
        del x, out, other_out


# The forward's statistics (group_norm_silu_forward; autograd saves them for the backward, as eager GroupNorm saves
# its mean and rstd): (3, N, G) of mean high part, mean low part, rstd.
FORWARD_WITH_STATS = torch.ops.vd.group_norm_silu_forward.default
test_opcheck_forward_with_stats = opcheck_test(FORWARD_WITH_STATS, sample_inputs, DEVICES)


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck_backward_with_stats(device):
    from tests.common import run_opcheck
    for x, groups, w, b, eps, silu in sample_inputs(device, False):
        _, stats = FORWARD_WITH_STATS(x, groups, w, b, eps, silu)
        run_opcheck(torch.ops.vd.group_norm_silu_backward.default,
                    (torch.randn_like(x), x, groups, w, b, eps, silu, stats))


def check_stats(stats, x, groups, eps, what):
    """stats against the float64 group mean and 1 / sqrt(var + eps) of x."""
    N = x.shape[0]
    assert stats.shape == (3, N, groups) and stats.is_contiguous(), what
    assert stats.dtype == (torch.float64 if x.dtype == torch.float64 else torch.float32), what
    xg = x.double().reshape(N, groups, -1)
    mean, var = xg.mean(-1), xg.var(-1, unbiased=False)
    got_mean = stats[0].double() + stats[1].double()
    # Each statistic within 1e-4 of the group's spread (a wrong group or a lost low part is off by far more).
    std = var.sqrt()
    assert ((got_mean - mean).abs() <= 1e-4 * std + 1e-7 * mean.abs()).all(), (what, (got_mean - mean).abs().max())
    # rstd within 1e-4 relative; 1e-3 where the mean dwarfs the spread 2e4-fold (the two-pass kernels' float
    # per-thread states hold deviations from a float running mean there: what the backward computing them gets).
    rel = (stats[2].double() * (var + eps).sqrt() - 1).abs()
    assert (rel <= (1e-3 if (mean.abs() > 1e3 * std).any() else 1e-4)).all(), (what, rel.max())


@pytest.mark.parametrize("device", CUDA)
@pytest.mark.parametrize("dtype", DTYPES)
def test_forward_statistics(device, family, dtype):
    # Every kernel family (pinned by VD_GROUP_NORM_KERNEL) on every layout writes the statistics; the output is the
    # one group_norm_silu gives bit for bit. float32 also on a mean that dwarfs the spread (the low part kept).
    torch.manual_seed(0)
    for shape, groups, layout in family_cases():
        C = shape[1]
        for scale, shift in ((3, 1), (0.05, 1000)) if dtype == torch.float32 else ((3, 1),):
            x = layout_input(shape, layout, dtype, device, scale, shift)
            w, b = torch.randn(C, device=device, dtype=dtype), torch.randn(C, device=device, dtype=dtype)
            what = f"{family} {layout} {shape} {dtype} shift={shift}"
            out, stats = FORWARD_WITH_STATS(x, groups, w, b, 1e-5, True)
            assert torch.equal(out, group_norm_silu(x, groups, w, b, 1e-5, True)), what
            assert out.stride() == group_norm_silu(x, groups, w, b, 1e-5, True).stride(), what
            check_stats(stats, x, groups, 1e-5, what)


def test_forward_statistics_cpu():
    torch.manual_seed(0)
    for dtype in DTYPES:
        for x in (torch.randn(2, 12, 5, 7) * 3 + 1, channels_last(torch.randn(2, 12, 5, 7) * 0.05 + 1000),
                  frames_major(torch.randn(2, 3, 12, 4, 5))):
            x = x.to(dtype)
            out, stats = FORWARD_WITH_STATS(x, 4, None, None, 1e-5, False)
            assert torch.equal(out, group_norm_silu(x, 4, None, None, 1e-5, False))
            check_stats(stats, x, 4, 1e-5, f"cpu {dtype} {tuple(x.shape)}")
    out, stats = FORWARD_WITH_STATS(torch.randn(0, 4, 3, 3), 2)
    assert out.shape == (0, 4, 3, 3) and stats.shape == (3, 0, 2)


STATS_KERNELS = ("stats_rows_kernel", "stats_cols_kernel", "stats_finalize_kernel")


@pytest.mark.parametrize("device", CUDA)
@pytest.mark.parametrize("dtype", DTYPES)
def test_two_pass_second_pass_order(device, dtype, monkeypatch):
    # The two-pass kernels' second pass (forward apply, backward dx) walks its blocks last to first, or first to
    # last under VD_GROUP_NORM_APPLY_ORDER=memory: each block's work is the same either way, so the outputs must be
    # bitwise equal, and match the reference; on every layout, with a short last block (items not a multiple of a
    # block's) and vectors straddling channels; the second-pass kernels are the ones that ran.
    monkeypatch.setenv("VD_GROUP_NORM_KERNEL", "twopass")
    monkeypatch.setenv("VD_GROUP_NORM_BACKWARD", "twopass")
    torch.manual_seed(0)
    for shape, groups, layout in [((2, 64, 40, 33), 8, "contiguous"), ((2, 320, 14, 9, 16), 32, "frames-major"),
                                  ((2, 96, 17, 19), 32, "channels_last"), ((2, 24, 5, 7), 3, "contiguous")]:
        C = shape[1]
        x = layout_input(shape, layout, dtype, device)
        w, b = torch.randn(C, device=device, dtype=dtype), torch.randn(C, device=device, dtype=dtype)
        g = torch.randn_like(x)
        outs = {}
        for order in ("", "memory"):
            monkeypatch.setenv("VD_GROUP_NORM_APPLY_ORDER", order)
            y = group_norm_silu(x, groups, w, b, 1e-5, True)
            dx = torch.ops.vd.group_norm_silu_backward(g, x, groups, w, b, 1e-5, True)[0]
            outs[order] = (y, dx)
        names = cuda_kernels_run(lambda: (group_norm_silu(x, groups, w, b, 1e-5, True),
                                          torch.ops.vd.group_norm_silu_backward(g, x, groups, w, b, 1e-5, True)))
        kind = "cols" if layout == "channels_last" else "rows"
        assert any(f"apply_{kind}_kernel" in n for n in names) and any(f"dx_{kind}_kernel" in n for n in names), names
        what = f"{layout} {shape} {dtype}"
        assert torch.equal(outs[""][0], outs["memory"][0]), what
        assert torch.equal(outs[""][1], outs["memory"][1]), what
        ref = reference_group_norm_silu(x.double(), groups, w.double(), b.double(), 1e-5, True)
        assert_close_to(outs[""][0], ref, dtype, what=what)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", ["contiguous", "channels_last", "frames-major"])
def test_backward_with_saved_statistics(device, dtype, layout, monkeypatch):
    # The backward given the forward's statistics: against the float64 reference and against the backward computing
    # them itself; through autograd it is what runs (the same bits). On CUDA also version 1's kernels
    # (VD_GROUP_NORM_BACKWARD=twopass), which then launch no statistics kernels: x is read twice, not three times.
    torch.manual_seed(0)
    shape, groups = (2, 64, 12, 20), 8
    if layout == "frames-major":
        x = frames_major((torch.randn(2, 12, 64, 4, 5, device=device) * 3 + 1).to(dtype))
        g = frames_major(torch.randn(2, 12, 64, 4, 5, device=device, dtype=dtype))
    else:
        x = (torch.randn(shape, device=device) * 3 + 1).to(dtype)
        g = torch.randn(shape, device=device, dtype=dtype)
        if layout == "channels_last":
            x, g = channels_last(x), channels_last(g)
    C = x.shape[1]
    w, b = torch.randn(C, device=device, dtype=dtype), torch.randn(C, device=device, dtype=dtype)
    xr, wr, br = (t.double().requires_grad_() for t in (x, w, b))
    ref = torch.autograd.grad(reference_group_norm_silu(xr, groups, wr, br), (xr, wr, br), g.double())
    for variant in ("default", "twopass") if device == "cuda" else ("default",):
        if variant == "twopass":
            monkeypatch.setenv("VD_GROUP_NORM_BACKWARD", "twopass")
        _, stats = FORWARD_WITH_STATS(x, groups, w, b, 1e-5, True)
        got = torch.ops.vd.group_norm_silu_backward(g, x, groups, w, b, 1e-5, True, stats)
        own = torch.ops.vd.group_norm_silu_backward(g, x, groups, w, b, 1e-5, True)
        for t, o, want, name, factor in zip(got, own, ref, "xwb", (1, 4, 4)):
            what = f"grad {name} {variant} {layout} {dtype}"
            assert_close_to(t, want, dtype, factor=factor, what=what)
            assert_close_to(t, o.double(), dtype, factor=factor, what=what + " vs statistics recomputed")
        xa, wa, ba = (t.detach().requires_grad_() for t in (x, w, b))
        y = group_norm_silu(xa, groups, wa, ba)
        assert "GroupNormSiluFn" in y.grad_fn.name(), y.grad_fn.name()
        for t, a in zip(got, torch.autograd.grad(y, (xa, wa, ba), g)):
            assert torch.equal(t, a)
        if variant == "twopass":
            with_stats = cuda_kernels_run(
                lambda: torch.ops.vd.group_norm_silu_backward(g, x, groups, w, b, 1e-5, True, stats))
            without = cuda_kernels_run(lambda: torch.ops.vd.group_norm_silu_backward(g, x, groups, w, b, 1e-5, True))
            assert not any(k in n for n in with_stats for k in STATS_KERNELS), sorted(set(with_stats))
            assert any(k in n for n in without for k in STATS_KERNELS), sorted(set(without))
    with torch.no_grad():  # no gradient asked for: the op's own kernel, nothing saved
        assert group_norm_silu(x.requires_grad_(), groups, w, b).grad_fn is None


@pytest.mark.parametrize("device", DEVICES)
def test_bad_statistics(device):
    x = torch.randn(2, 8, 4, 4, device=device)
    g = torch.randn_like(x)
    _, stats = FORWARD_WITH_STATS(x, 4)
    bwd = torch.ops.vd.group_norm_silu_backward
    with pytest.raises(RuntimeError, match="stats must have shape \\(3, 2, 4\\)"):
        bwd(g, x, 4, None, None, 1e-5, True, stats[:, :, :2])
    with pytest.raises(RuntimeError, match="stats must have shape \\(3, 2, 2\\)"):
        bwd(g, x, 2, None, None, 1e-5, True, stats)
    with pytest.raises(TypeError, match="stats must be Float for x of dtype Float, got Double"):
        bwd(g, x, 4, None, None, 1e-5, True, stats.double())
    with pytest.raises(RuntimeError, match="stats must be contiguous"):
        bwd(g, x, 4, None, None, 1e-5, True, stats.transpose(1, 2).contiguous().transpose(1, 2))
    if device == "cpu" and torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="stats is on"):
            bwd(g, x, 4, None, None, 1e-5, True, stats.cuda())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("op", ["group_norm_silu", "group_norm_silu_forward"])
def test_autograd_kernel(device, op):
    # With a gradient: one C++ node whose backward runs group_norm_silu_backward on the saved statistics.
    torch.manual_seed(0)
    x = torch.randn(2, 16, 5, 6, device=device)
    w, b = torch.randn(16, device=device), torch.randn(16, device=device)
    # Trailing defaults left out; the bias needs no gradient.
    xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
    out = check_cpp_autograd(op, (x, 4, w, b), (xg, 4, wg, b), "GroupNormSiluFn")
    if op == "group_norm_silu_forward":
        assert not getattr(torch.ops.vd, op)(x, 4, w, b)[1].requires_grad  # the statistics are not differentiable
    g = torch.randn_like(out)
    dx, dw = torch.autograd.grad(out, (xg, wg), g)
    stats = FORWARD_WITH_STATS(x.detach(), 4, w.detach(), b)[1]
    want = torch.ops.vd.group_norm_silu_backward(g, x.detach(), 4, w.detach(), b, 1e-5, True, stats)
    assert torch.equal(dx, want[0]) and torch.equal(dw, want[1])

    class DropFirst(torch.autograd.Function):  # hands back no gradient for its first input
        @staticmethod
        def forward(ctx, a, c):
            return c.clone()

        @staticmethod
        def backward(ctx, g):
            return None, g
    c = torch.randn(3, device=device, requires_grad=True)
    got = torch.autograd.grad(DropFirst.apply(out, c).sum(), (xg, wg, c), allow_unused=True)
    assert got[0] is None and got[1] is None and torch.equal(got[2], torch.ones_like(c))
