"""Attention over every stride-th key => vd::strided_attention."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from expecttest import TestCase

from tests.backend_checks import assert_fired, assert_rejected, code, compare_with_eager
from vdcompile import built_backends

pytestmark = pytest.mark.skipif("CPU" not in built_backends("strided_attention"),
                                reason="vd::strided_attention was built without a CPU kernel")


def _qkv(lk=9):
    torch.manual_seed(0)
    return (torch.randn(2, 3, 5, 8).requires_grad_(), torch.randn(2, 3, lk, 8).requires_grad_(),
            torch.randn(2, 3, lk, 8).requires_grad_())


class SliceKeys(nn.Module):
    def __init__(self, stride=2, k_stride=None):
        super().__init__()
        self.stride, self.k_stride = stride, k_stride or stride

    def forward(self, q, k, v):
        return F.scaled_dot_product_attention(q, k[:, :, ::self.k_stride], v[:, :, ::self.stride])


class ModuloMask(nn.Module):
    def __init__(self, stride=3, sdpa=True):
        super().__init__()
        self.stride, self.sdpa = stride, sdpa

    def forward(self, q, k, v):
        keep = torch.arange(k.shape[2], device=k.device) % self.stride == 0
        if self.sdpa:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=keep.view(1, 1, 1, -1))
        s = torch.matmul(q, k.transpose(-2, -1)) * q.shape[-1] ** -0.5
        s = s.masked_fill(~keep, float("-inf"))
        return torch.matmul(s.softmax(dim=-1), v)


class TestStridedAttention(TestCase):
    def test_step_slice(self):
        out = compare_with_eager(SliceKeys(2), *_qkv())
        assert_fired(out, {"strided_attention": 1})
        self.assertExpectedInline(code(out), """\
def forward(k, q, v):
    v0 = vd.strided_attention(q, k, v, 2, None)
    v1 = operator.getitem(v0, 0)
    return (v1,)""")

    def test_modulo_masks(self):
        assert_fired(compare_with_eager(ModuloMask(3), *_qkv()), {"strided_attention": 1})
        assert_fired(compare_with_eager(ModuloMask(4, sdpa=False), *_qkv(10)), {"strided_attention": 1})

    def test_inductor(self):
        assert_fired(compare_with_eager(SliceKeys(3), *_qkv(7), inner="inductor"), {"strided_attention": 1})

    def test_different_strides_for_k_and_v(self):
        out = compare_with_eager(SliceKeys(2, k_stride=4), *_qkv(16)[:2], torch.randn(2, 3, 8, 8).requires_grad_())
        self.assertEqual(out.fired.get("strided_attention", 0), 0)

    def test_sliced_keys_escape(self):
        class Leak(nn.Module):
            def forward(self, q, k, v):
                ks = k[:, :, ::2]
                return F.scaled_dot_product_attention(q, ks, v[:, :, ::2]), ks.sum()

        out = compare_with_eager(Leak(), *_qkv())
        assert_fired(out, {"attention": 1} if "CPU" in built_backends("fused_attention") else {})
        assert_rejected(out, "strided_attention", "also used by")

    def test_causal_refused(self):
        class Causal(SliceKeys):
            def forward(self, q, k, v):
                return F.scaled_dot_product_attention(q, k[:, :, ::2], v[:, :, ::2], is_causal=True)

        out = compare_with_eager(Causal(), *_qkv(), grad=False)
        assert_rejected(out, "strided_attention", "is_causal")
