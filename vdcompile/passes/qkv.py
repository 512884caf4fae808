"""Projection fusion: linears reading the same input => one linear over concatenated weights + split.

diffusers Attention: `query = attn.to_q(hidden_states)`, `key = attn.to_k(hidden_states)`,
`value = attn.to_v(hidden_states)` (self-attention), and to_k/to_v on encoder_hidden_states
(cross-attention). One GEMM reads the input once instead of once per projection.

Cost: the concatenated weight is built in the graph with torch.cat, which inductor folds into a
constant when weights are frozen (freezing=True, inference). Otherwise the cat runs every call:
it reads and writes sum(out_i) * in elements, while the fusion saves (n - 1) reads of the
N x in input. The fusion is done only where N * (n - 1) > 2 * sum(out_i), e.g. N > 3 * dim for
q/k/v: the spatial self-attentions of video UNets (N = frames * H * W tokens), not the deep,
small-N levels nor cross-attention over a few dozen text tokens.
"""
from __future__ import annotations

import torch
import torch.fx as fx
import torch.nn.functional as F

from vdcompile.passes._common import (Context, Report, canonical, is_mutating, run_node, static_int,
                                      value_of)

FAMILY = "qkv_projection"
# Linears farther apart than this are not grouped (their results would be held alive longer).
_MAX_SPAN = 64


def _fused(x, weights, biases, sizes):
    w = torch.cat(weights, dim=0)
    b = None if biases is None else torch.cat(biases, dim=0)
    return F.linear(x, w, b).split(sizes, dim=-1)


def _groups(graph: fx.Graph):
    """Linears grouped by (input node, has bias), in graph order."""
    pos = {n: i for i, n in enumerate(graph.nodes)}
    groups: dict = {}
    for n in graph.nodes:
        c = canonical(n)
        if c is None or c[0] != "linear" or not isinstance(c[1]["input"], fx.Node):
            continue
        args = c[1]
        if not isinstance(args["weight"], fx.Node):
            continue
        groups.setdefault((args["input"], args["bias"] is not None), []).append((n, args))
    return [g for g in groups.values() if len(g) >= 2], pos


def _refuse_reason(group, pos, ctx: Context) -> str | None:
    first, last = group[0][0], group[-1][0]
    if pos[last] - pos[first] > _MAX_SPAN:
        return "projections too far apart"
    w0 = value_of(group[0][1]["weight"])
    for _, a in group:
        for key in ("weight", "bias"):
            t = a[key]
            if t is None:
                continue
            v = value_of(t)
            if not isinstance(v, torch.Tensor) or v.dtype != w0.dtype or v.device != w0.device:
                return "weights differ in dtype or device"
            if v.dim() != (2 if key == "weight" else 1):
                return "weight is not 2-D"
            if pos[t] > pos[first]:
                return "a weight is computed after the first projection"
    n = first.next
    while n is not last:
        if is_mutating(n):
            return f"{n.name} mutates a tensor between the projections"
        n = n.next
    if ctx.autocast_reason:
        return ctx.autocast_reason
    folded = ctx.freezing and not ctx.grad_enabled
    if folded:
        return None
    x = value_of(group[0][1]["input"])
    d_in = static_int(x.shape[-1]) if isinstance(x, torch.Tensor) else None
    numel = static_int(x.numel()) if isinstance(x, torch.Tensor) else None
    outs = [static_int(value_of(a["weight"]).shape[0]) for _, a in group]
    if d_in is None or numel is None or None in outs:
        return "dynamic sizes (the cost cannot be weighed)"
    tokens = numel // d_in
    if tokens * (len(group) - 1) <= 2 * sum(outs):
        return "the weight concatenation would cost more than it saves (few tokens; freezing folds it)"
    return None


def run(gm: fx.GraphModule, report: Report, ctx: Context) -> None:
    graph = gm.graph
    decided: set = set()
    while True:  # regroup after each fusion: a fused projection can be another group's input
        groups, pos = _groups(graph)
        todo = [g for g in groups if frozenset(n for n, _ in g) not in decided]
        if not todo:
            return
        group = todo[0]
        decided.add(frozenset(n for n, _ in group))
        reason = _refuse_reason(group, pos, ctx) or _fuse(graph, group, ctx)
        if reason:
            report.reject(FAMILY, reason)
        else:
            report.fire(FAMILY)


def _fuse(graph: fx.Graph, group, ctx: Context) -> str | None:
    first = group[0][0]
    tracer = fx.proxy.GraphAppendingTracer(graph)

    def proxy(v):
        return None if v is None else fx.Proxy(v, tracer)

    sizes = [static_int(value_of(a["weight"]).shape[0]) for _, a in group]
    biases = None if group[0][1]["bias"] is None else [proxy(a["bias"]) for _, a in group]
    before = first.prev
    with graph.inserting_before(first):
        parts = _fused(proxy(group[0][1]["input"]), [proxy(a["weight"]) for _, a in group], biases, sizes)
        outs = [parts[i].node for i in range(len(group))]
    new_nodes = []
    n = before.next
    while n is not first:
        new_nodes.append(n)
        n = n.next
    try:
        for x in new_nodes:
            x.meta["example_value"] = run_node(x, ctx.fake_mode)
            for k in ("stack_trace", "nn_module_stack"):
                if k in first.meta:
                    x.meta[k] = first.meta[k]
    except Exception as e:  # leave the graph as it was
        for x in reversed(new_nodes):
            graph.erase_node(x)
        return f"fused projection fails on the example inputs: {type(e).__name__}"
    for (lin, _), out in zip(group, outs):
        lin.replace_all_uses_with(out)
        graph.erase_node(lin)
    # The splits are strided views where the linears gave dense tensors: re-check the graph.
    ctx.layout_families.add(FAMILY)
    return None


RUN = {FAMILY: run}
