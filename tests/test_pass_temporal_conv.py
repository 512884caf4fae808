"""Conv3d with a (k, 1, 1) kernel => vd::temporal_conv."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from diffusers.models.resnet import SpatioTemporalResBlock, TemporalConvLayer
from expecttest import TestCase

from tests.backend_checks import (BACKEND, FORCE_VD, assert_fired, assert_rejected, code, compare_with_eager, leaf,
                                  rewrite)
from tests.common import cuda_kernels_run
from vdcompile import built_backends

pytestmark = pytest.mark.skipif("CPU" not in built_backends("temporal_conv"),
                                reason="vd::temporal_conv was built without a CPU kernel")



class TestTemporalConv(TestCase):
    def test_conv3d_k11(self):
        torch.manual_seed(0)
        m, x = nn.Conv3d(8, 6, (3, 1, 1), padding=(1, 0, 0)), leaf(2, 8, 5, 4, 3)
        out = compare_with_eager(m, x)
        assert_fired(out, {"temporal_conv": 1})
        self.assertExpectedInline(code(out), """\
def forward(args_0, bias, weight):
    v0 = vd.temporal_conv(args_0, weight, None, 1)
    v1 = bias.view(1, -1, 1, 1, 1)
    v2 = operator.add(v0, v1)
    return (v2,)""")

    def test_diffusers_temporal_conv_layer(self):
        # UNet3DConditionModel's TemporalConvLayer: four (3, 1, 1) convs after group_norm + silu.
        torch.manual_seed(0)
        m, x = TemporalConvLayer(16, 16, norm_num_groups=4), leaf(6, 16, 4, 4)
        out = compare_with_eager(m, x, num_frames=3)
        assert_fired(out, {"temporal_conv": 4, "group_norm_silu": 4})

    def test_no_bias_no_padding_inductor(self):
        torch.manual_seed(0)
        m, x = nn.Conv3d(4, 4, (2, 1, 1), bias=False), leaf(1, 4, 6, 3, 3)
        assert_fired(compare_with_eager(m, x, inner="inductor"), {"temporal_conv": 1})

    def test_refused(self):
        torch.manual_seed(0)
        x = torch.randn(1, 4, 6, 5, 5)
        cases = [
            (nn.Conv3d(4, 4, (3, 1, 1), stride=(2, 1, 1)), "stride or dilation"),
            (nn.Conv3d(4, 4, (3, 1, 1), dilation=(2, 1, 1)), "stride or dilation"),
            (nn.Conv3d(4, 4, (3, 1, 1), groups=2), "groups"),
            (nn.Conv3d(4, 4, (3, 1, 1), padding=1), "padding is not (p, 0, 0)"),
        ]
        for m, reason in cases:
            out, graphs = rewrite(m, x)
            assert_fired(out, {})
            assert_rejected(out, "temporal_conv", reason)
            self.assertIn("torch.conv3d", graphs[0])

    def test_spatial_kernel_is_no_candidate(self):
        out = compare_with_eager(nn.Conv3d(4, 4, 3, padding=1), leaf(1, 4, 3, 5, 5))
        assert_fired(out, {})
        self.assertEqual(out.rejected, {})


def _vd_input_strides(fn):
    """(op name, strides of its first input) of every vd op that fn() calls, from the profiler."""
    with torch.profiler.profile(record_shapes=True) as prof:
        fn()
    events = [e for e in prof.profiler.kineto_results.events() if e.name().startswith("vd::")]
    # The accessor's name differs between torch versions (structured_input_strides in 2.13, strides before).
    for attr in ("structured_input_strides", "strides"):
        if events and hasattr(events[0], attr):
            return [(e.name(), list(getattr(e, attr)()[0])) for e in events]
    pytest.skip("this torch's profiler events carry no input strides")


def test_svd_temporal_block_stays_frames_major():
    # SVD's SpatioTemporalResBlock hands its temporal half a (B, C, F, H, W) view of (B, F, C, H, W)
    # memory. group_norm_silu and temporal_conv keep that layout, so every vd op of the temporal half
    # reads frames-major memory in place (a contiguous answer would make each temporal_conv copy its
    # input back to frames-major).
    torch.manual_seed(0)
    F = 3
    m = SpatioTemporalResBlock(32, 32, temb_channels=16).eval()
    x, temb = torch.randn(2 * F, 32, 4, 5), torch.randn(2 * F, 16)
    indicator = torch.zeros(2, F)
    compiled = torch.compile(m, backend=BACKEND, fullgraph=True,
                             options={"inner_compiler": "inductor", **FORCE_VD})
    torch._dynamo.reset()
    with torch.no_grad():
        ref = m(x, temb, image_only_indicator=indicator)
        out = compiled(x, temb, image_only_indicator=indicator)
        calls = _vd_input_strides(lambda: compiled(x, temb, image_only_indicator=indicator))
    torch._dynamo.reset()
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
    fm = list(torch.empty(2, F, 32, 4, 5).transpose(1, 2).stride())
    temporal = [c for c in calls if c[0] == "vd::temporal_conv"]
    norms_5d = [c for c in calls if c[0] == "vd::group_norm_silu" and len(c[1]) == 5]
    assert len(temporal) == 2 and len(norms_5d) == 2, calls
    for name, stride in temporal + norms_5d:
        assert stride == fm, (name, stride, calls)


@pytest.mark.skipif("CUDA" not in built_backends("temporal_conv"), reason="vd::temporal_conv has no CUDA kernel")
def test_float32_cuda_follows_the_tf32_settings(monkeypatch):
    # A float32 Conv3d runs TF32 on cuDNN by default. The op's TF32 Hopper kernels follow the same switch in the
    # forward, on the inputs they take (sm_90a; contiguous or frames-major x, H*W and C_in multiples of 8); elsewhere,
    # and in the backward, the op's float32 GEMMs follow the matmul flag (IEEE by default, 3-5x slower than the
    # convolution): the pass leaves those to cuDNN, and rewrites them when both run TF32 or both IEEE.
    from vdcompile.passes._common import hopper_kernels
    torch.manual_seed(0)
    m = nn.Conv3d(8, 8, (3, 1, 1), padding=(1, 0, 0)).cuda()
    hopper = hopper_kernels(torch.device("cuda"))
    for x, grad, kernel_takes in [
            (torch.randn(1, 8, 5, 4, 4, device="cuda"), False, hopper),  # H*W 16, inference: the TF32 kernel's
            (torch.randn(1, 8, 5, 4, 4, device="cuda"), True, False),  # the weight needs a gradient: cuBLAS's backward
            (torch.randn(1, 8, 5, 3, 5, device="cuda"), False, False),  # H*W 15: cuBLAS only
            # H 1 with its pixel row's stride not W (contiguous by is_contiguous(), not to the kernel): cuBLAS
            (torch.randn(1, 8, 5, 16, 1, device="cuda").transpose(3, 4), False, False),
            (torch.randn(1, 8, 5, 4, 4, device="cuda"), False, "gemm")]:  # VD_TEMPORAL_CONV_KERNEL=gemm: cuBLAS
        if kernel_takes == "gemm":
            monkeypatch.setenv("VD_TEMPORAL_CONV_KERNEL", "gemm")
            kernel_takes = False
        for cudnn_tf32, matmul_tf32, fires in [(True, False, kernel_takes), (True, True, True), (False, False, True)]:
            monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", cudnn_tf32)
            monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", matmul_tf32)
            torch._dynamo.reset()
            with torch.set_grad_enabled(grad):
                out, _ = rewrite(m, x)
            assert_fired(out, {"temporal_conv": 1} if fires else {})
            if not fires:
                assert_rejected(out, "temporal_conv", "runs TF32")
            if hopper and cudnn_tf32 and not matmul_tf32 and not grad:  # the op agrees on the input: its TF32
                with torch.no_grad():                                       # kernel runs exactly where taken
                    ran = " ".join(cuda_kernels_run(lambda: torch.ops.vd.temporal_conv(x, m.weight, m.bias, 1)))
                takes = "temporal_conv_tf32_kernel" in ran or "temporal_conv_tf32_wino_kernel" in ran
                assert takes == kernel_takes, (x.shape, x.stride(), ran)
    monkeypatch.delenv("VD_TEMPORAL_CONV_KERNEL", raising=False)
    if hopper:  # the whole chain under the default switches: the compiled graph runs the TF32 kernel
        monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", True)
        monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
        torch._dynamo.reset()
        compiled = torch.compile(m, backend=BACKEND)
        x16 = torch.randn(1, 8, 5, 4, 4, device="cuda")
        with torch.no_grad():
            compiled(x16)
            ran = " ".join(cuda_kernels_run(lambda: compiled(x16)))
        assert "temporal_conv_tf32_wino_kernel" in ran, ran  # k = 3, padding 1: the Winograd TF32 kernel
    # Half precision is not affected.
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", True)
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    torch._dynamo.reset()
    out, _ = rewrite(m.half(), x.half())
    assert_fired(out, {"temporal_conv": 1})
