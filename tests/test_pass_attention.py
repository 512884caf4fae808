"""Attention => vd::fused_attention; single-key attention => V broadcast."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from diffusers.models.attention_processor import Attention, AttnProcessor, AttnProcessor2_0
from expecttest import TestCase

from tests.backend_checks import (BACKEND, assert_fired, assert_rejected, capture_rewrites, code, compare_with_eager,
                                  leaf, rewrite)
from vdcompile import built_backends

pytestmark = pytest.mark.skipif("CPU" not in built_backends("fused_attention"),
                                reason="vd::fused_attention was built without a CPU kernel")


def _attn(processor=None, cross=None, heads=4, dim_head=8):
    torch.manual_seed(0)
    return Attention(32, cross_attention_dim=cross, heads=heads, dim_head=dim_head,
                     processor=processor or AttnProcessor2_0())



def _plain_bmm(q, k, v):
    """Attention.get_attention_scores and bmm on (B*H, L, D) tensors, without the head split."""
    bias = torch.empty(q.shape[0], q.shape[1], k.shape[1])
    s = torch.baddbmm(bias, q, k.transpose(-1, -2), beta=0, alpha=0.25)
    return torch.bmm(s.softmax(dim=-1).to(q.dtype), v)


class SDPA(nn.Module):
    """An SDPA call with the flags the op must refuse."""

    def __init__(self, **flags):
        super().__init__()
        self.flags = flags

    def forward(self, q, k, v, mask=None):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, **self.flags)


class Naive(nn.Module):
    """Textbook attention as some AnimateDiff motion modules write it."""

    def __init__(self, form="mul", masked=False, leak=False):
        super().__init__()
        self.form, self.masked, self.leak = form, masked, leak

    def forward(self, q, k, v, mask=None):
        d = q.shape[-1]
        if self.form == "q_mul":
            s = (q * d ** -0.5) @ k.transpose(-2, -1)
        elif self.form == "div":
            s = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(d)
        else:
            s = torch.matmul(q, k.transpose(-2, -1)) * d ** -0.5
        if self.masked:
            s = s + mask
        p = F.softmax(s, dim=-1)
        out = p @ v
        return (out, p) if self.leak else out


class TestSDPA(TestCase):
    def test_self_attention_processor2_0(self):
        a, x = _attn(), leaf(2, 10, 32)
        out = compare_with_eager(a, x)
        assert_fired(out, {"attention": 1})
        self.assertExpectedInline(code(out), """\
def forward(hidden_states, to_k.weight, to_out.0.bias, to_out.0.weight, to_q.weight, to_v.weight):
    v0 = F.linear(hidden_states, to_q.weight, None)
    v1 = F.linear(hidden_states, to_k.weight, None)
    v2 = F.linear(hidden_states, to_v.weight, None)
    v3 = v0.view(2, -1, 4, 8)
    v4 = v3.transpose(1, 2)
    v5 = v1.view(2, -1, 4, 8)
    v6 = v5.transpose(1, 2)
    v7 = v2.view(2, -1, 4, 8)
    v8 = v7.transpose(1, 2)
    v9 = vd.fused_attention(v4, v6, v8, None, None, True)
    v10 = operator.getitem(v9, 0)
    v11 = v10.transpose(1, 2)
    v12 = v11.reshape(2, -1, 32)
    v13 = v12.to(torch.float32)
    v14 = F.linear(v13, to_out.0.weight, to_out.0.bias)
    v15 = F.dropout(v14, 0.0, True, False)
    v16 = operator.truediv(v15, 1.0)
    return (v16,)""")

    def test_masked_and_cross_attention(self):
        a, x = _attn(), leaf(2, 10, 32)
        mask = torch.randn(2, 1, 10)
        assert_fired(compare_with_eager(a, x, attention_mask=mask), {"attention": 1})
        a, ctx = _attn(cross=16), leaf(2, 7, 16)
        assert_fired(compare_with_eager(a, x, ctx), {"attention": 1})

    def test_inductor(self):
        a, x = _attn(), leaf(2, 9, 32)
        assert_fired(compare_with_eager(a, x, inner="inductor"), {"attention": 1})

    def test_refused_flags(self):
        q, k, v = (torch.randn(2, 3, 6, 8) for _ in range(3))
        cases = [({"is_causal": True}, "is_causal=True"), ({"enable_gqa": True}, "enable_gqa"),
                 ({"dropout_p": 0.1}, "dropout_p != 0")]
        for flags, reason in cases:
            out, graphs = rewrite(SDPA(**flags), q, k, v, fullgraph=True)
            assert_fired(out, {})
            assert_rejected(out, "attention", reason)
            self.assertIn("F.scaled_dot_product_attention", graphs[0])
        compare_with_eager(SDPA(is_causal=True), q, k, v, grad=False)

    def test_masks(self):
        # SDPA's masks carry over: bool (True = keep) and additive float, broadcast, even a row
        # with every key masked out (0 from both), and a trainable float mask.
        q, k, v = (leaf(2, 3, 6, 8) for _ in range(3))
        keep = torch.rand(6, 6) > 0.3
        keep[1] = False
        assert_fired(compare_with_eager(SDPA(), q, k, v, keep), {"attention": 1})
        additive = torch.randn(2, 1, 1, 6)
        additive[0, 0, 0, 2] = float("-inf")
        assert_fired(compare_with_eager(SDPA(), q, k, v, additive), {"attention": 1})
        learned = torch.randn(1, 3, 6, 6).requires_grad_()
        assert_fired(compare_with_eager(SDPA(), q, k, v, learned), {"attention": 1})

    def test_refused_masks_and_shapes(self):
        q, k, v = (torch.randn(2, 3, 6, 8) for _ in range(3))
        out, _ = rewrite(SDPA(), q, k, torch.randn(2, 3, 6, 4))
        assert_rejected(out, "attention", "head dim")
        out, _ = rewrite(SDPA(), *(torch.randn(3, 6, 8) for _ in range(3)))
        assert_rejected(out, "attention", "not all 4-D")
        big = torch.randn(1, 1, 4, 264)
        out, _ = rewrite(SDPA(), big, big, big)
        assert_rejected(out, "attention", "1..256")


class TestAttnProcessor(TestCase):
    """diffusers' AttnProcessor: head_to_batch_dim, baddbmm, softmax, to, bmm."""

    def test_self_attention(self):
        a, x = _attn(AttnProcessor()), leaf(2, 10, 32)
        out = compare_with_eager(a, x)
        assert_fired(out, {"attention": 1})
        self.assertExpectedInline(code(out), """\
def forward(hidden_states, to_k.weight, to_out.0.bias, to_out.0.weight, to_q.weight, to_v.weight):
    v0 = F.linear(hidden_states, to_q.weight, None)
    v1 = F.linear(hidden_states, to_k.weight, None)
    v2 = F.linear(hidden_states, to_v.weight, None)
    v3 = v0.view(2, 10, 4, 8)
    v4 = v3.transpose(1, 2)
    v5 = v1.view(2, 10, 4, 8)
    v6 = v5.transpose(1, 2)
    v7 = v2.view(2, 10, 4, 8)
    v8 = v7.transpose(1, 2)
    v9 = vd.fused_attention(v4, v6, v8, None, 0.3535533905932738, True)
    v10 = operator.getitem(v9, 0)
    v11 = v10.reshape(8, 10, 8)
    v12 = v11.reshape(2, 4, 10, 8)
    v13 = v12.permute(0, 2, 1, 3)
    v14 = v13.reshape(2, 10, 32)
    v15 = F.linear(v14, to_out.0.weight, to_out.0.bias)
    v16 = F.dropout(v15, 0.0, True, False)
    v17 = operator.truediv(v16, 1.0)
    return (v17,)""")

    def test_cross_attention_and_refused_mask(self):
        a, x = _attn(AttnProcessor(), cross=16), leaf(2, 10, 32)
        assert_fired(compare_with_eager(a, x, leaf(2, 5, 16)), {"attention": 1})
        # An additive mask before softmax: NaN rows in eager where the op gives 0.
        a = _attn(AttnProcessor())
        out = compare_with_eager(a, x, attention_mask=torch.randn(2, 1, 10))
        assert_fired(out, {})
        assert_rejected(out, "attention", "NaN in eager")

    def test_upcast_softmax_refused(self):
        a = _attn(AttnProcessor())
        a.upcast_softmax = True
        x = torch.randn(2, 10, 32, dtype=torch.bfloat16)
        a = a.to(torch.bfloat16)
        out, _ = rewrite(a, x)
        assert_fired(out, {})

    def test_plain_bmm_without_head_split(self):
        args = (leaf(6, 5, 16), leaf(6, 7, 16), leaf(6, 7, 16))
        assert_fired(compare_with_eager(_plain_bmm, *args), {"attention": 1})


class TestNaive(TestCase):
    @staticmethod
    def _qkv(rank):
        shape = (2, 3, 6, 8) if rank == 4 else (6, 6, 8)
        return [leaf(*shape) for _ in range(3)]

    def test_spellings(self):
        for form in ("mul", "div", "q_mul"):
            for rank in (3, 4):
                q, k, v = self._qkv(rank)
                assert_fired(compare_with_eager(Naive(form), q, k, v), {"attention": 1})

    def test_masked_refused(self):
        q, k, v = self._qkv(4)
        out = compare_with_eager(Naive(masked=True), q, k, v, torch.randn(2, 1, 6, 6))
        assert_fired(out, {})
        assert_rejected(out, "attention", "NaN in eager")

    def test_snapshot(self):
        q, k, v = self._qkv(4)
        out = compare_with_eager(Naive("div"), q, k, v)
        assert_fired(out, {"attention": 1})
        self.assertExpectedInline(code(out), """\
def forward(k, q, v):
    v0 = vd.fused_attention(q, k, v, None, 0.35355339059327373, True)
    v1 = operator.getitem(v0, 0)
    return (v1,)""")

    def test_lse_only_where_a_gradient_can_flow(self):
        # No input of the op requires grad in dynamo's graph: no backward can run through it, so the
        # rewrite asks it for no lse (the short kernels then skip its writes); with a gradient, it does.
        # Under no_grad the projections' outputs require no grad although the weights do.
        q, k, v = (torch.randn(2, 3, 6, 8) for _ in range(3))
        for model in (Naive("div"), SDPA()):
            out, graphs = rewrite(model, q, k, v)
            assert_fired(out, {"attention": 1})
            self.assertRegex(graphs[0], r"vd\.fused_attention\(.*, False\)")
            out, graphs = rewrite(model, q, k, v.requires_grad_())
            v.requires_grad_(False)
            assert_fired(out, {"attention": 1})
            self.assertRegex(graphs[0], r"vd\.fused_attention\(.*, True\)")
        out, graphs = rewrite(SDPA(), q, k, v, torch.randn(1, 3, 6, 6).requires_grad_())  # only the mask
        assert_fired(out, {"attention": 1})
        self.assertRegex(graphs[0], r"vd\.fused_attention\(.*, True\)")
        a = _attn(AttnProcessor()).eval()
        with torch.no_grad():
            out, graphs = rewrite(a, torch.randn(2, 10, 32))
        assert_fired(out, {"attention": 1})
        self.assertRegex(graphs[0], r"vd\.fused_attention\(.*, False\)")

    def test_probabilities_escape(self):
        q, k, v = self._qkv(4)
        out = compare_with_eager(Naive(leak=True), q, k, v)
        assert_fired(out, {})
        assert_rejected(out, "attention", "also used by")
        self.assertNotIn("vd.fused_attention", code(out))


class TestSingleKey(TestCase):
    """SVD's cross-attention on the one CLIP image token."""

    def test_inference(self):
        a = _attn(cross=16).eval()
        x, ctx = torch.randn(2, 10, 32), torch.randn(2, 1, 16)
        out = compare_with_eager(a, x, ctx, grad=False, atol=0, rtol=0)  # exact
        assert_fired(out, {"single_key_attention": 1})
        # The query projection (and the key's) is gone: only to_v and to_out remain.
        self.assertExpectedInline(code(out), """\
def forward(encoder_hidden_states, hidden_states, to_k.weight, to_out.0.bias, to_out.0.weight, to_q.weight, to_v.weight):
    v0 = F.linear(encoder_hidden_states, to_v.weight, None)
    v1 = v0.view(2, -1, 4, 8)
    v2 = v1.transpose(1, 2)
    v3 = v2.expand(-1, -1, 10, -1)
    v4 = v3.contiguous()
    v5 = v4.transpose(1, 2)
    v6 = v5.reshape(2, -1, 32)
    v7 = v6.to(torch.float32)
    v8 = F.linear(v7, to_out.0.weight, to_out.0.bias)
    v9 = F.dropout(v8, 0.0, False, False)
    v10 = operator.truediv(v9, 1.0)
    return (v10,)""")
        compare_with_eager(a, x, ctx, grad=False, inner="inductor", atol=1e-6, rtol=1e-6)

    def test_training_keeps_attention(self):
        # Eager gives to_q/to_k exactly zero gradients; the rewrite would leave them unset.
        a, x, ctx = _attn(cross=16), leaf(2, 10, 32), leaf(2, 1, 16)
        out = compare_with_eager(a, x, ctx)
        assert_fired(out, {"attention": 1})
        assert_rejected(out, "single_key_attention", "requires grad")

    def test_mask_refused(self):
        a = _attn(cross=16).eval()
        x, ctx = torch.randn(2, 10, 32), torch.randn(2, 1, 16)
        with torch.no_grad():
            out, _ = rewrite(a, x, ctx, attention_mask=torch.zeros(2, 1, 1))
        assert_rejected(out, "single_key_attention", "mask")


class TestDynamicShapes(TestCase):
    def test_symbolic_lengths(self):
        # Sequence lengths are symbolic: the checks use what holds for every shape, and the single
        # key rewrite reads the query length from q in the graph.
        for cross, family in ((None, "attention"), (16, "single_key_attention")):
            a = _attn(cross=cross).eval()
            torch._dynamo.reset()
            with capture_rewrites() as sink:
                c = torch.compile(a, backend=BACKEND, dynamic=True, fullgraph=True,
                                  options={"inner_compiler": "aot_eager", "attention_kernels": "vd"})
                with torch.no_grad():
                    for n in (10, 13, 17):
                        args = (torch.randn(2, n, 32),) + (() if cross is None else (torch.randn(2, 1, 16),))
                        torch.testing.assert_close(c(*args), a(*args), atol=1e-5, rtol=1e-5)
            self.assertTrue(sink)
            for report, gm in sink:
                self.assertEqual(report.fired[family], 1, family)
                self.assertTrue(any(isinstance(n.meta.get("example_value"), torch.SymInt) for n in gm.graph.nodes))
        torch._dynamo.reset()


_CUDA = "CUDA" in built_backends("fused_attention") and torch.cuda.is_available()
AUTO = {"attention_kernels": "auto"}  # the backend's default (backend_checks forces "vd")


def check_auto_rule(q, k, v, fires, reason):
    """SDPA under attention_kernels="auto": rewritten to vd when `fires`, else kept with `reason` in the
    explain report; "vd" forces the rewrite either way."""
    out, _ = rewrite(SDPA(), q, k, v, options=AUTO)
    if fires:
        assert_fired(out, {"attention": 1})
    else:
        assert_rejected(out, "attention", reason)
    assert_fired(rewrite(SDPA(), q, k, v, options={"attention_kernels": "vd"})[0], {"attention": 1})


@pytest.mark.skipif(not _CUDA, reason="vd::fused_attention has no CUDA kernel in this build, or no GPU")
@pytest.mark.parametrize("length, dim, fires", [(14, 64, True), (32, 64, True), (33, 64, False), (256, 64, False),
                                               (2048, 64, "hopper"), (2048, 128, False)])
def test_cuda_sdpa_kept_where_vendor_is_faster(length, dim, fires):
    # Default attention_kernels="auto": on CUDA in bf16 short sequences go to vd (its short kernel is
    # faster there), and on Hopper long ones at head_dim <= 64 (the sm_90a kernel beats cuDNN);
    # "vd" forces the rewrite for every length.
    if fires == "hopper":
        from vdcompile import _C
        fires = bool(_C.HOPPER_ATTENTION) and torch.cuda.get_device_capability() == (9, 0)
    q, k, v = (torch.randn(1, 2, length, dim, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    check_auto_rule(q, k, v, fires, "SDPA kept")
    compare_with_eager(SDPA(), q, k, v, options=AUTO, grad=False, atol=2e-2, rtol=2e-2)


@pytest.mark.skipif(not _CUDA, reason="vd::fused_attention has no CUDA kernel in this build, or no GPU")
@pytest.mark.parametrize("length, dim, fires", [(14, 128, True), (256, 64, True), (256, 128, False), (256, 30, False)])
def test_cuda_fp32_sdpa_goes_to_vd_where_measured_faster(length, dim, fires):
    # fp32 without gradients: vd's 3xTF32 kernels up to 32 tokens and at head_dim <= 64 (a multiple of 4);
    # at head_dim 128 beyond 32 tokens SDPA's fp32 kernel is faster and "auto" keeps it, as where vd would
    # fall back to its CUDA-core kernel.
    q, k, v = (torch.randn(1, 2, length, dim, device="cuda") for _ in range(3))
    check_auto_rule(q, k, v, fires, "SDPA kept: in fp32")
    compare_with_eager(SDPA(), q, k, v, options=AUTO, grad=False, atol=1e-4, rtol=1e-4)


@pytest.mark.skipif(not _CUDA, reason="vd::fused_attention has no CUDA kernel in this build, or no GPU")
@pytest.mark.parametrize("dtype, length, dim, fires", [
    (torch.bfloat16, 14, 64, True), (torch.bfloat16, 25, 40, True), (torch.bfloat16, 2048, 64, False),
    (torch.bfloat16, 256, 64, False), (torch.float32, 14, 64, True), (torch.float32, 25, 64, False),
    (torch.float32, 256, 64, False)])
def test_cuda_sdpa_training_keeps_vendor_where_its_backward_wins(dtype, length, dim, fires):
    # With q, k, v requiring grad, "auto" goes to vd only where forward + backward are faster: fp16 /
    # bf16 up to 32 tokens (the short kernels), fp32 up to 16 (its backward runs on the CUDA cores);
    # "vd" forces the rewrite.
    q, k, v = (torch.randn(2, 3, length, dim, device="cuda", dtype=dtype, requires_grad=True) for _ in range(3))
    check_auto_rule(q, k, v, fires, "requires grad and vd's")
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    compare_with_eager(SDPA(), q, k, v, options=AUTO, atol=tol, rtol=tol)


@pytest.mark.skipif(not _CUDA, reason="vd::fused_attention has no CUDA kernel in this build, or no GPU")
def test_cuda_textbook_fp32_training_keeps_matmuls():
    # Autograd through the matmuls beats vd's CUDA-core fp32 backward: kept in training, rewritten
    # without gradients and in bf16.
    q, k, v = (torch.randn(2, 3, 14, 64, device="cuda", requires_grad=True) for _ in range(3))
    out, _ = rewrite(Naive(), q, k, v, options=AUTO)
    assert_fired(out, {})
    assert_rejected(out, "attention", "autograd through the matmuls")
    assert_fired(rewrite(Naive(), q, k, v, options={"attention_kernels": "vd"})[0], {"attention": 1})
    assert_fired(rewrite(Naive(), *(t.detach() for t in (q, k, v)), options=AUTO)[0], {"attention": 1})
    assert_fired(rewrite(Naive(), *(t.detach().bfloat16().requires_grad_() for t in (q, k, v)), options=AUTO)[0],
                 {"attention": 1})


def test_cpu_sdpa_kept_by_default():
    # vd's CPU kernel is slower than PyTorch's CPU SDPA: "auto" (the backend's default) keeps the call,
    # with the reason in the report; the textbook form has no faster PyTorch kernel and is rewritten.
    q, k, v = (torch.randn(2, 4, 14, 16) for _ in range(3))
    out, _ = rewrite(SDPA(), q, k, v, options=AUTO)
    assert_fired(out, {})
    assert_rejected(out, "attention", "SDPA kept: PyTorch's CPU kernel is faster")
    assert_fired(rewrite(Naive(), q, k, v, options=AUTO)[0], {"attention": 1})
    compare_with_eager(SDPA(), q, k, v, options=AUTO, grad=False)


class TestSingleKeyAttnProcessor(TestCase):
    """The same single-key cross-attention through AttnProcessor (baddbmm, softmax, bmm)."""

    def test_inference(self):
        a = _attn(AttnProcessor(), cross=16).eval()
        x, ctx = torch.randn(2, 10, 32), torch.randn(2, 1, 16)
        out = compare_with_eager(a, x, ctx, grad=False, atol=0, rtol=0)  # exact
        assert_fired(out, {"single_key_attention": 1})
        self.assertExpectedInline(code(out), """\
def forward(encoder_hidden_states, hidden_states, to_k.weight, to_out.0.bias, to_out.0.weight, to_q.weight, to_v.weight):
    v0 = F.linear(encoder_hidden_states, to_v.weight, None)
    v1 = v0.reshape(2, 1, 4, 8)
    v2 = v1.permute(0, 2, 1, 3)
    v3 = v2.reshape(8, 1, 8)
    v4 = v3.expand(8, 10, 8)
    v5 = v4.contiguous()
    v6 = v5.reshape(2, 4, 10, 8)
    v7 = v6.permute(0, 2, 1, 3)
    v8 = v7.reshape(2, 10, 32)
    v9 = F.linear(v8, to_out.0.weight, to_out.0.bias)
    v10 = F.dropout(v9, 0.0, False, False)
    v11 = operator.truediv(v10, 1.0)
    return (v11,)""")

    def test_backward_through_v(self):
        # Only v's side trains (to_q, to_k frozen): gradients match eager's.
        a = _attn(AttnProcessor(), cross=16)
        a.to_q.requires_grad_(False)
        a.to_k.requires_grad_(False)
        out = compare_with_eager(a, torch.randn(2, 10, 32), torch.randn(2, 1, 16))
        assert_fired(out, {"single_key_attention": 1})
        # With q or k trainable, eager's exact zero gradients are kept by not rewriting.
        out = compare_with_eager(_attn(AttnProcessor(), cross=16), leaf(2, 10, 32), leaf(2, 1, 16))
        assert_fired(out, {"attention": 1})
        assert_rejected(out, "single_key_attention", "requires grad")

    def test_plain_bmm(self):
        out = compare_with_eager(_plain_bmm, torch.randn(6, 5, 16), torch.randn(6, 1, 16), leaf(6, 1, 16))
        assert_fired(out, {"single_key_attention": 1})
        self.assertNotIn("baddbmm", code(out))

    def test_two_keys_is_attention(self):
        a = _attn(AttnProcessor(), cross=16).eval()
        out = compare_with_eager(a, torch.randn(2, 10, 32), torch.randn(2, 2, 16), grad=False)
        assert_fired(out, {"attention": 1})

    def test_mask_refused(self):
        a = _attn(AttnProcessor(), cross=16).eval()
        with torch.no_grad():
            out, _ = rewrite(a, torch.randn(2, 10, 32), torch.randn(2, 1, 16), attention_mask=torch.zeros(2, 1, 1))
        assert_rejected(out, "single_key_attention", "mask")
