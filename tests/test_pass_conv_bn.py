"""conv2d -> batch_norm(eval) -> silu, conv -> bn, conv -> silu => vd::conv_bn_silu."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from expecttest import TestCase

from tests.backend_checks import assert_fired, assert_rejected, code, compare_with_eager, leaf
from vdcompile import built_backends

pytestmark = pytest.mark.skipif("CPU" not in built_backends("conv_bn_silu"),
                                reason="vd::conv_bn_silu was built without a CPU kernel")



def _conv_bn(act=True, **conv):
    torch.manual_seed(0)
    layers = [nn.Conv2d(4, 6, 3, **conv), nn.BatchNorm2d(6)] + ([nn.SiLU()] if act else [])
    m = nn.Sequential(*layers)
    with torch.no_grad():  # non-trivial running statistics
        m[1].running_mean.uniform_(-1, 1)
        m[1].running_var.uniform_(0.5, 2)
        m[1].weight.uniform_(0.5, 1.5)
        m[1].bias.uniform_(-0.5, 0.5)
    return m.eval()


class TestConvBnSilu(TestCase):
    def test_conv_bn_silu(self):
        m, x = _conv_bn(padding=1), leaf(2, 4, 7, 6)
        out = compare_with_eager(m, x)
        assert_fired(out, {"conv_bn_silu": 1})
        self.assertExpectedInline(code(out), """\
def forward(0.bias, 0.weight, 1.bias, 1.running_mean, 1.running_var, 1.weight, args_0):
    v0 = vd.conv_bn_silu(args_0, 0.weight, 0.bias, 1.weight, 1.bias, 1.running_mean, 1.running_var, 1e-05, [1, 1], [1, 1], [1, 1], 1, True)
    return (v0,)""")

    def test_conv_bn_strided_grouped(self):
        m, x = _conv_bn(act=False, stride=2, padding=(1, 0), groups=2), leaf(1, 4, 9, 8)
        assert_fired(compare_with_eager(m, x), {"conv_bn_silu": 1})

    def test_conv_silu_identity_bn(self):
        # ControlNetConditioningEmbedding: F.silu(conv(x)).
        torch.manual_seed(0)
        conv = nn.Conv2d(3, 8, 3, padding="same", dilation=2)

        def f(x):
            return F.silu(conv(x))

        out = compare_with_eager(f, leaf(2, 3, 8, 8), inner="inductor", atol=1e-5)
        assert_fired(out, {"conv_bn_silu": 1})

    def test_training_bn_refused(self):
        m, x = _conv_bn(padding=1).train(), leaf(2, 4, 5, 5)
        out = compare_with_eager(m, x)
        assert_fired(out, {})
        assert_rejected(out, "conv_bn_silu", "training mode")

    def test_bn_without_running_stats_refused(self):
        torch.manual_seed(0)
        m = nn.Sequential(nn.Conv2d(4, 4, 1), nn.BatchNorm2d(4, track_running_stats=False), nn.SiLU()).eval()
        out = compare_with_eager(m, leaf(2, 4, 3, 3))
        assert_fired(out, {})
        assert_rejected(out, "conv_bn_silu", "batch statistics")

    def test_conv_output_escapes(self):
        m, x = _conv_bn(padding=1), leaf(1, 4, 5, 5)

        def f(x):
            y = m[0](x)
            return m[2](m[1](y)), y

        out = compare_with_eager(f, x)
        assert_fired(out, {})
        assert_rejected(out, "conv_bn_silu", "also used by")
