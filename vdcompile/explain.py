"""vdcompile.explain: what the backend's rewrites do to a model."""
from __future__ import annotations

import dataclasses
import re
from typing import Any

import torch

__all__ = ["explain", "ExplainOutput", "graph_code"]


@dataclasses.dataclass
class ExplainOutput:
    report: Any  # vdcompile.passes._common.Report, merged over all graphs
    graphs: list  # the rewritten GraphModules, one per graph dynamo produced
    output: Any  # the model's output on the example inputs

    @property
    def fired(self) -> dict:
        return dict(self.report.fired)

    @property
    def rejected(self) -> dict:
        return {k: dict(v) for k, v in self.report.rejected.items()}

    @property
    def graph_count(self) -> int:
        return len(self.graphs)

    def __str__(self) -> str:
        from vdcompile.passes import FAMILIES

        return f"vdcompile: {self.graph_count} graph(s)\n{self.report.table(FAMILIES)}"


def explain(model, *args, options: dict | None = None, verbose: bool = True, fullgraph: bool = False,
            **kwargs) -> ExplainOutput:
    """Compiles ``model`` with the vdcompile backend, runs it once on ``args``/``kwargs`` and returns,
    per rewrite, how often it fired and why candidates were refused (printed as a table unless
    ``verbose=False``).

    ``options`` are the backend's options; the inner compiler defaults to "eager" here since only
    the rewrites are of interest. Like torch._dynamo.explain, this resets dynamo's caches first."""
    from vdcompile import backend
    from vdcompile.passes._common import Report

    opts = {"inner_compiler": "eager", **(options or {})}
    torch._dynamo.reset()
    sink: list = []
    backend._SINKS.append(sink)
    try:
        compiled = torch.compile(model, backend=backend.vdcompile_backend, options=opts, fullgraph=fullgraph)
        out = compiled(*args, **kwargs)
    finally:
        backend._SINKS.remove(sink)
        torch._dynamo.reset()
    merged = Report()
    for report, _ in sink:
        merged.merge(report)
    result = ExplainOutput(merged, [gm for _, gm in sink], out)
    if verbose:
        print(result)
    return result


def graph_code(gm) -> str:
    """The graph as short, torch-version-independent code (for reading and for snapshots): dynamo's
    input names shortened (``L_self_modules_norm1_parameters_weight_`` -> ``norm1.weight``), values
    numbered in order, targets written the way the model code calls them."""
    names: dict = {}
    lines, inputs = [], []
    k = 0
    for n in gm.graph.nodes:
        if n.op == "placeholder":
            names[n] = _input_name(n.name)
            inputs.append(names[n])
        elif n.op == "get_attr":
            names[n] = f"self.{n.target}"
        elif n.op == "output":
            lines.append(f"return {_fmt(n.args[0], names)}")
        else:
            names[n] = f"v{k}"
            k += 1
            args = [_fmt(a, names) for a in n.args] + [f"{key}={_fmt(v, names)}" for key, v in n.kwargs.items()]
            if n.op == "call_method":
                lines.append(f"{names[n]} = {args[0]}.{n.target}({', '.join(args[1:])})")
            else:
                lines.append(f"{names[n]} = {_target_name(n.target)}({', '.join(args)})")
    # Inputs sorted: their order differs between torch versions.
    return "\n".join([f"def forward({', '.join(sorted(inputs))}):"] + ["    " + line for line in lines])


def _input_name(name: str) -> str:
    name = re.sub(r"^[Ll]_", "", name).rstrip("_")
    name = re.sub(r"^(self|fn)_", "", name)
    name = re.sub(r"_(modules|parameters|buffers)_", ".", name)
    return re.sub(r"^(modules|parameters|buffers)_", "", name)


def _target_name(t) -> str:
    import operator

    if isinstance(t, torch._ops.OpOverload):
        ns, op = t.name().split("::")
        return f"{ns}.{op}" if t._overloadname == "default" else f"{ns}.{op}.{t._overloadname}"
    mod = getattr(t, "__module__", None) or ""
    name = getattr(t, "__name__", repr(t))
    if mod in ("torch.nn.functional", "torch._C._nn") or t is getattr(torch._C._nn, name, None):
        return f"F.{name}"
    if t is getattr(operator, name, None):
        return f"operator.{name}"
    if mod.startswith("torch") and t is getattr(torch, name, None):
        return f"torch.{name}"
    return f"{mod}.{name}" if mod else name


def _fmt(a, names) -> str:
    import torch.fx as fx

    if isinstance(a, fx.Node):
        return names[a]
    if isinstance(a, tuple):
        inner = ", ".join(_fmt(x, names) for x in a)
        return f"({inner},)" if len(a) == 1 else f"({inner})"
    if isinstance(a, list):
        return "[" + ", ".join(_fmt(x, names) for x in a) + "]"
    if isinstance(a, slice):
        parts = ["" if v is None else _fmt(v, names) for v in (a.start, a.stop, a.step)]
        return ":".join(parts[:2]) + (f":{parts[2]}" if parts[2] else "")
    if isinstance(a, dict):
        return "{" + ", ".join(f"{k!r}: {_fmt(v, names)}" for k, v in a.items()) + "}"
    return repr(a)
