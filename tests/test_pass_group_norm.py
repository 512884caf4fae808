"""group_norm -> silu => vd::group_norm_silu."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from expecttest import TestCase

import vdcompile
from tests.backend_checks import assert_fired, assert_rejected, code, compare_with_eager, leaf, rewrite


class NormAct(nn.Module):
    """diffusers ResnetBlock2D's prologue: norm1 -> nonlinearity."""

    def __init__(self, c=32, groups=8, eps=1e-6, inplace=False, affine=True):
        super().__init__()
        self.norm = nn.GroupNorm(groups, c, eps=eps, affine=affine)
        self.act = nn.SiLU(inplace=inplace)

    def forward(self, x):
        return self.act(self.norm(x))


class Escapes(NormAct):
    def forward(self, x):
        h = self.norm(x)
        return self.act(h), h


class MutatedInBetween(nn.Module):
    def forward(self, x, w, b):
        h = F.group_norm(x, 4, w, b)
        x.mul_(2)
        return F.silu(h) + x



class TestGroupNormSilu(TestCase):
    def test_resnet_prologue(self):
        m, x = NormAct(), leaf(2, 32, 6, 5)
        out = compare_with_eager(m, x)
        assert_fired(out, {"group_norm_silu": 1})
        self.assertExpectedInline(code(out), """\
def forward(norm.bias, norm.weight, x):
    v0 = vd.group_norm_silu(x, 8, norm.weight, norm.bias, 1e-06, True)
    return (v0,)""")

    def test_functional_spellings_and_ranks(self):
        # torch.group_norm / F.silu(inplace=True) on 3-D and 5-D (temporal blocks) inputs.
        def f(x, y, w, b):
            a = F.silu(torch.group_norm(x, 4, w, b, 1e-5), inplace=True)
            return a, F.silu(F.group_norm(y, 2, w, None))

        args = (leaf(2, 8, 7), leaf(1, 8, 3, 4, 5), leaf(8), leaf(8))
        assert_fired(compare_with_eager(f, *args), {"group_norm_silu": 2})

    def test_no_affine_channels_last_inductor(self):
        m = NormAct(affine=False)
        x = torch.randn(2, 32, 6, 6).to(memory_format=torch.channels_last).requires_grad_()
        assert_fired(compare_with_eager(m, x, inner="inductor"), {"group_norm_silu": 1})

    def test_reduced_precision(self):
        for dtype in (torch.float16, torch.bfloat16):
            m = NormAct(c=16, groups=4).to(dtype)
            x = leaf(2, 16, 4, 4, dtype=dtype)
            assert_fired(compare_with_eager(m, x, atol=2e-2, rtol=2e-2), {"group_norm_silu": 1})

    def test_plain_group_norm_is_left_alone(self):
        m, x = nn.GroupNorm(4, 16), leaf(2, 16, 3)
        out = compare_with_eager(m, x)
        assert_fired(out, {})
        self.assertEqual(out.rejected, {})

    def test_intermediate_escapes(self):
        m, x = Escapes(), leaf(2, 32, 4, 4)
        out = compare_with_eager(m, x)
        assert_fired(out, {})
        assert_rejected(out, "group_norm_silu", "also used by")
        self.assertNotIn("vd.group_norm_silu", code(out))

    def test_mutation_in_between(self):
        m = MutatedInBetween()
        args = (torch.randn(2, 8, 5), torch.randn(8), torch.randn(8))
        out = compare_with_eager(m, *args, grad=False)
        assert_fired(out, {})
        assert_rejected(out, "group_norm_silu", "mutates")

    def test_unsupported_rank(self):
        m, x = NormAct(), leaf(4, 32)  # (N, C): the op takes 3-D to 5-D
        out, _ = rewrite(m, x)
        assert_fired(out, {})
        assert_rejected(out, "group_norm_silu", "2-D input")

    def test_no_kernel_for_device(self):
        # What was built decides: a build without this device's kernel is refused, not run.
        m, x = NormAct(), leaf(2, 32, 4, 4)
        orig = vdcompile.built_backends
        try:
            vdcompile.built_backends = lambda op: frozenset({"CUDA"})
            out, _ = rewrite(m, x)
        finally:
            vdcompile.built_backends = orig
        assert_fired(out, {})
        assert_rejected(out, "group_norm_silu", "no cpu kernel")

    def test_switched_off(self):
        m, x = NormAct(), leaf(2, 32, 4, 4)
        out, _ = rewrite(m, x, options={"group_norm_silu": False})
        assert_fired(out, {})

    def test_autocast_refused(self):
        # Under autocast group_norm runs in float32 while the op would keep bfloat16.
        m, x = NormAct(c=16, groups=4), torch.randn(2, 16, 4, 4)

        def f(x):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return m(torch.nn.functional.linear(x.transpose(1, 3), torch.eye(16)).transpose(1, 3))

        out = compare_with_eager(f, x, grad=False)
        assert_fired(out, {})
        assert_rejected(out, "group_norm_silu", "autocast")

    def test_dynamic_shapes(self):
        m, x = NormAct(), leaf(2, 32, 6, 5)
        from tests.backend_checks import BACKEND

        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
        c = torch.compile(m, backend=BACKEND, dynamic=True, fullgraph=True, options={"inner_compiler": "aot_eager"})
        for shape in ((2, 32, 6, 5), (3, 32, 4, 7)):
            x = torch.randn(*shape)
            torch.testing.assert_close(c(x), m(x), atol=1e-5, rtol=1e-5)
        self.assertEqual(torch._dynamo.utils.counters["vdcompile"]["group_norm_silu"], 1)  # one graph, both shapes
        torch._dynamo.reset()

    def test_positional_inplace_between(self):
        # F.relu_(x) / F.dropout(x, p, training, True) mutate x: a write between the matched nodes.
        def f(x, w):
            h = F.group_norm(x, 4, w)
            F.dropout(x, 0.0, True, True)
            F.hardtanh(x, -1.0, 1.0, True)
            return F.silu(h) + x

        out = compare_with_eager(f, torch.randn(2, 8, 5) * 3, torch.randn(8), grad=False)
        assert_fired(out, {})
        assert_rejected(out, "group_norm_silu", "mutates")
