"""Linears reading one input => one linear over concatenated weights, split."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from diffusers.models.attention_processor import Attention
from expecttest import TestCase

from tests.backend_checks import assert_fired, assert_rejected, code, compare_with_eager, leaf

# The attention rewrite is switched off: these tests are about the projections only.
NO_ATTN = {"attention": False, "single_key_attention": False}



class Proj(nn.Module):
    def __init__(self, n=3, bias=True, mutate=False):
        super().__init__()
        torch.manual_seed(0)
        self.lins = nn.ModuleList(nn.Linear(8, 4 + i, bias=bias) for i in range(n))
        self.mutate = mutate

    def forward(self, x):
        outs = []
        for lin in self.lins:
            outs.append(lin(x))
            if self.mutate:
                x.mul_(2)
        return [o * (i + 1) for i, o in enumerate(outs)]


class TestQKV(TestCase):
    def test_self_attention_many_tokens(self):
        torch.manual_seed(0)
        a, x = Attention(32, heads=4, dim_head=8), leaf(2, 64, 32)  # 128 tokens > 3 * 32
        out = compare_with_eager(a, x, options=NO_ATTN)
        assert_fired(out, {"qkv_projection": 1})
        self.assertExpectedInline(code(out), """\
def forward(hidden_states, to_k.weight, to_out.0.bias, to_out.0.weight, to_q.weight, to_v.weight):
    v0 = torch.cat([to_q.weight, to_k.weight, to_v.weight], dim=0)
    v1 = F.linear(hidden_states, v0, None)
    v2 = v1.split([32, 32, 32], dim=-1)
    v3 = operator.getitem(v2, 0)
    v4 = operator.getitem(v2, 1)
    v5 = operator.getitem(v2, 2)
    v6 = v3.view(2, -1, 4, 8)
    v7 = v6.transpose(1, 2)
    v8 = v4.view(2, -1, 4, 8)
    v9 = v8.transpose(1, 2)
    v10 = v5.view(2, -1, 4, 8)
    v11 = v10.transpose(1, 2)
    v12 = F.scaled_dot_product_attention(v7, v9, v11, attn_mask=None, dropout_p=0.0, is_causal=False)
    v13 = v12.transpose(1, 2)
    v14 = v13.reshape(2, -1, 32)
    v15 = v14.to(torch.float32)
    v16 = F.linear(v15, to_out.0.weight, to_out.0.bias)
    v17 = F.dropout(v16, 0.0, True, False)
    v18 = operator.truediv(v17, 1.0)
    return (v18,)""")

    def test_biases_and_unequal_widths(self):
        m, x = Proj(), leaf(5, 9, 8)
        assert_fired(compare_with_eager(m, x), {"qkv_projection": 1})

    def test_few_tokens_refused(self):
        torch.manual_seed(0)
        a, x = Attention(32, heads=4, dim_head=8), leaf(2, 10, 32)
        out = compare_with_eager(a, x, options=NO_ATTN)
        assert_fired(out, {})
        assert_rejected(out, "qkv_projection", "cost more than it saves")
        # Cross-attention: k/v over 16 encoder tokens.
        a = Attention(32, cross_attention_dim=16, heads=4, dim_head=8)
        out = compare_with_eager(a, x, leaf(2, 8, 16), options=NO_ATTN)
        assert_rejected(out, "qkv_projection", "cost more than it saves")

    def test_frozen_weights_fold_the_concatenation(self):
        # With inductor's freezing the cat is folded into a constant, so even few tokens pay.
        from torch._inductor.utils import run_and_get_code

        from tests.backend_checks import BACKEND

        torch.manual_seed(0)
        a, x = Attention(32, heads=4, dim_head=8).eval(), torch.randn(2, 10, 32)
        old = torch._inductor.config.freezing
        torch._inductor.config.freezing = True
        try:
            torch._dynamo.reset()
            with torch.no_grad():
                compiled = torch.compile(a, backend=BACKEND, options=NO_ATTN, fullgraph=True)
                out, sources = run_and_get_code(compiled, x)
                torch.testing.assert_close(out, a(x), atol=1e-5, rtol=1e-5)
        finally:
            torch._inductor.config.freezing = old
            torch._dynamo.reset()
        src = "\n".join(sources)
        self.assertEqual(torch._dynamo.utils.counters["vdcompile"]["qkv_projection"] >= 1, True)
        self.assertNotIn("cat", src)  # no concatenation left at run time

    def test_mutation_between_refused(self):
        m = Proj(mutate=True)
        x = torch.randn(300, 8)
        out = compare_with_eager(m, x, grad=False)
        assert_fired(out, {})
        assert_rejected(out, "qkv_projection", "mutates")

    def test_strides_break_a_later_view(self):
        # The fused projections are strided slices; merging their last two dims with .view fails
        # on them (it worked on the dense linear outputs): the rewrite is dropped for the graph
        # after re-validation, the other rewrites stay.
        lins = Proj(n=2)

        def f(x):
            a, b = lins.lins[0](x), lins.lins[1](x)
            return a.view(a.shape[0], -1), F.silu(F.group_norm(b, 1))

        out = compare_with_eager(f, leaf(300, 2, 8))
        assert_fired(out, {"group_norm_silu": 1})
        assert_rejected(out, "qkv_projection", "re-validation")
        self.assertTrue(any("qkv_projection dropped" in n for n in out.report.notes))
