"""Conv3d with a (k, 1, 1) kernel => vd::temporal_conv."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from diffusers.models.resnet import TemporalConvLayer
from expecttest import TestCase

from tests.backend_checks import assert_fired, assert_rejected, code, compare_with_eager, leaf, rewrite
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
    v0 = vd.temporal_conv(args_0, weight, bias, 1)
    return (v0,)""")

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
