"""Graph rewrites of the vdcompile backend, one module per family, applied to dynamo's Torch-IR graph.

Each family module exports ``REWRITES`` (pattern/replacement pairs, see ``_common.Rewrite``) or, for
rewrites that are not a tree of calls, a ``run(gm, report, ctx)`` function.
"""
from __future__ import annotations

import copy
import importlib

import torch.fx as fx

from vdcompile.passes._common import Context, Report, autocast_reason, revalidate, run_rewrites

# Option names, in the order the rewrites are listed to users.
FAMILIES = (
    "attention",
    "single_key_attention",
    "group_norm_silu",
    "temporal_conv",
    "conv_bn_silu",
    "qkv_projection",
    "strided_attention",
    "scheduler_step",
)

# Order of application: a more specific rewrite runs before a general one anchored on the same call
# (one key before any key, strided before dense attention), and the projection fusion runs last so
# that the projections attention rewrites make dead are gone before linears are grouped.
_ORDER = (
    ("scheduler_step", "scheduler"),
    ("single_key_attention", "attention"),
    ("strided_attention", "strided_attention"),
    ("attention", "attention"),
    ("group_norm_silu", "group_norm"),
    ("temporal_conv", "temporal_conv"),
    ("conv_bn_silu", "conv_bn"),
    ("qkv_projection", "qkv"),
)


def _family_pass(family: str, module: str):
    mod = importlib.import_module(f"vdcompile.passes.{module}")
    custom = getattr(mod, "RUN", {}).get(family)
    if custom is not None:
        return custom
    rewrites = [rw for rw in mod.REWRITES if rw.family == family]
    return lambda gm, report, ctx: run_rewrites(gm, rewrites, report, ctx)


def apply(gm: fx.GraphModule, enabled, ctx: Context, report: Report) -> fx.GraphModule:
    """Rewrites a copy of gm's graph and installs it in gm.

    When a rewrite changed a value's strides, the whole rewritten graph is re-run on the example
    values first; if that fails (a later view no longer fits), the families that changed strides
    are dropped for this graph, with the reason in the report, and the others applied again."""
    enabled = set(enabled)
    ctx.autocast_reason = autocast_reason(gm.graph)
    abandoned = Report()
    while True:
        work = fx.GraphModule(gm, _copy_graph(gm))
        ctx.layout_families = set()
        local = Report()
        for family, module in _ORDER:
            if family in enabled:
                _family_pass(family, module)(work, local, ctx)
        err = revalidate(work, ctx) if ctx.layout_families and sum(local.fired.values()) else None
        if err is None:
            break
        dropped = sorted(ctx.layout_families)
        abandoned.notes.append(f"{', '.join(dropped)} dropped for this graph: {err}")
        for fam in dropped:
            for _ in range(local.fired.get(fam, 0)):
                abandoned.reject(fam, "the rewritten graph failed re-validation (strides)")
        enabled -= ctx.layout_families
    report.merge(local)
    report.merge(abandoned)
    if sum(local.fired.values()) == 0:
        return gm
    work.graph.lint()
    gm.graph = work.graph
    gm.recompile()
    return gm


def _copy_graph(gm: fx.GraphModule) -> fx.Graph:
    # Node metas are copied shallowly: the example values are shared, not cloned.
    g = copy.deepcopy(gm.graph)
    fresh = set(fx.Node.__dict__) | {"__dict__"}
    for old, new in zip(gm.graph.nodes, g.nodes):
        # Attributes set on nodes by their producer (dynamo's _dynamo_source on placeholders).
        for k, v in old.__dict__.items():
            if k not in new.__dict__ and k not in fresh:
                setattr(new, k, v)
    return g
