"""Helpers of the backend tests: compile a module with backend="vdcompile", check which rewrites
fired, snapshot the rewritten graph, compare outputs and gradients with eager."""
from __future__ import annotations

import contextlib
import copy

import torch

import vdcompile
from vdcompile import backend
from vdcompile.explain import ExplainOutput, graph_code
from vdcompile.passes._common import Report
from vdcompile.passes import FAMILIES

# The name when the package is installed (the entry point; test_backend checks it resolves), else
# the same function the entry point names, for a checkout that is only built in place.
BACKEND = "vdcompile" if "vdcompile" in torch._dynamo.list_backends() else vdcompile.vdcompile_backend


# The pass tests check the rewrites themselves: vd's kernels are forced for every matched attention
# (by default SDPA is kept where PyTorch's kernel is faster, e.g. always on the CPU; that policy has
# its own tests in test_pass_attention.py).
FORCE_VD = {"attention_kernels": "vd"}


def rewrite(model, *args, options=None, **kwargs):
    """(report, [graph code]) of compiling ``model`` and running it once (inner compiler eager)."""
    out = vdcompile.explain(model, *args, options={**FORCE_VD, **(options or {})}, verbose=False, **kwargs)
    return out, [graph_code(g) for g in out.graphs]


def leaf(*shape, dtype=torch.float32):
    """A random input that requires grad (compare_with_eager then checks its gradient)."""
    return torch.randn(*shape, dtype=dtype).requires_grad_()


def assert_fired(out, expected: dict):
    """Exactly ``expected`` fired (every other rewrite fired zero times)."""
    got = {f: out.fired.get(f, 0) for f in FAMILIES}
    want = {f: expected.get(f, 0) for f in FAMILIES}
    assert got == want, f"fired {got}, expected {want}; rejected: {out.rejected}"


def assert_rejected(out, family: str, fragment: str):
    reasons = out.rejected.get(family, {})
    assert any(fragment in r for r in reasons), f"no {family} rejection mentioning {fragment!r}: {reasons}"


@contextlib.contextmanager
def capture_rewrites(reset: bool = False):
    """Yields a list that collects (report, rewritten graph) of every graph the backend compiles
    inside the block; with ``reset``, dynamo's caches are cleared on entry and on exit."""
    if reset:
        torch._dynamo.reset()
    sink: list = []
    backend._SINKS.append(sink)
    try:
        yield sink
    finally:
        backend._SINKS.remove(sink)
        if reset:
            torch._dynamo.reset()


def _grad_leaves(model, args):
    leaves = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
    if isinstance(model, torch.nn.Module):
        leaves += [p for p in model.parameters() if p.requires_grad]
    return leaves


def _flat(out):
    if isinstance(out, torch.Tensor):
        return [out]
    if hasattr(out, "to_tuple"):
        out = out.to_tuple()
    if isinstance(out, (tuple, list)):
        return [t for o in out for t in _flat(o)]
    return []


def compare_with_eager(model, *args, options=None, inner="aot_eager", grad=True, atol=1e-5, rtol=1e-5, **kwargs):
    """Compiles with the vdcompile backend (fullgraph) and checks outputs, and with ``grad`` the
    gradients of every input and parameter that requires grad, against eager on copies.
    Returns what the rewrites did (like vdcompile.explain)."""
    ref_model = copy.deepcopy(model) if isinstance(model, torch.nn.Module) else model
    ref_args = [a.detach().clone().requires_grad_(a.requires_grad) if isinstance(a, torch.Tensor) else a
                for a in args]
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=BACKEND, fullgraph=True,
                             options={"inner_compiler": inner, **FORCE_VD, **(options or {})})
    with capture_rewrites() as sink:
        with torch.set_grad_enabled(grad):
            out = _flat(compiled(*args, **kwargs))
            ref = _flat(ref_model(*ref_args, **kwargs))
    assert len(out) == len(ref)
    for o, r in zip(out, ref):
        torch.testing.assert_close(o, r, atol=atol, rtol=rtol)
    if grad:
        leaves, ref_leaves = _grad_leaves(model, args), _grad_leaves(ref_model, ref_args)
        assert leaves, "nothing requires grad"
        seeds = [torch.randn_like(r) for r in ref]
        g = torch.autograd.grad(out, leaves, seeds, allow_unused=True)
        g_ref = torch.autograd.grad(ref, ref_leaves, seeds, allow_unused=True)
        for a, b in zip(g, g_ref):
            assert (a is None) == (b is None), "a gradient is missing on one side"
            if a is not None:
                torch.testing.assert_close(a, b, atol=atol * 10, rtol=rtol * 10)
    torch._dynamo.reset()
    report = Report()
    for r, _ in sink:
        report.merge(r)
    return ExplainOutput(report, [gm for _, gm in sink], out)


def code(out, i: int = 0) -> str:
    """The i-th rewritten graph of a compile, as vdcompile.explain.graph_code prints it."""
    return graph_code(out.graphs[i])
