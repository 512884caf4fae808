"""Shared machinery of the rewrites: canonical forms of Torch-IR calls, a tree matcher for patterns
written as eager PyTorch, the safety checks every rewrite needs, and the counters.

The graphs are dynamo's (Torch IR, before AOTAutograd). The same computation shows up under several
spellings there (``F.softmax(x, -1)``, ``torch.softmax(x, -1)``, ``x.softmax(dim=-1)``; ``view`` or
``reshape``; positional or keyword arguments; ``torch._C._nn.X`` or ``torch.nn.functional.X``), and
the spelling differs between torch versions. Every call is therefore reduced to a canonical form
(a name plus its arguments bound to one signature, defaults filled in) before it is compared, so
one pattern covers all spellings.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import operator
from collections import Counter
from typing import Any, Callable

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch.fx.experimental.symbolic_shapes import statically_known_true

# ---------------------------------------------------------------------------------------------------
# Canonical forms
# ---------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Form:
    name: str
    sig: inspect.Signature
    # Arguments that never change the result (F.softmax's _stacklevel).
    drop: tuple[str, ...] = ()
    # Arguments that hold a tensor dim (normalised against the input's rank before comparing).
    dims: tuple[str, ...] = ()
    # Argument collected from *varargs into one tuple (x.view(2, 3) == x.view((2, 3))).
    varargs: str | None = None


_BY_FUNCTION: dict[Any, _Form] = {}
_BY_METHOD: dict[str, _Form] = {}


def hopper_kernels(device) -> bool:
    """The build carries the sm_90a kernels (attention's forward, conv_bn_silu's and temporal_conv's) and the device
    is compute capability 9.0."""
    from vdcompile import _C
    return (bool(getattr(_C, "HOPPER_ATTENTION", 0)) and torch.cuda.is_available()
            and torch.cuda.get_device_capability(device) == (9, 0))


def _sig(text: str) -> inspect.Signature:
    return inspect.signature(eval(f"lambda {text}: None"))  # noqa: S307 (constant strings below)


def _functions(name, text, targets, **kw):
    form = _Form(name, _sig(text), **kw)
    for t in targets:
        if t is not None:
            _BY_FUNCTION[t] = form


def _methods(name, text, methods, **kw):
    form = _Form(name, _sig(text), **kw)
    for m in methods:
        _BY_METHOD[m] = form


def _get(mod, attr):
    return getattr(mod, attr, None)


_nn = torch._C._nn
# Ops whose results are fresh tensors (or views) with no side effect: dead ones may be removed.
_functions("linear", "input, weight, bias=None", [F.linear, _get(_nn, "linear")])
_functions("sdpa", "query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False",
           [F.scaled_dot_product_attention, _get(_nn, "scaled_dot_product_attention")])
_functions("group_norm", "input, num_groups, weight=None, bias=None, eps=1e-05", [F.group_norm])
_functions("group_norm", "input, num_groups, weight=None, bias=None, eps=1e-05, cudnn_enabled=True",
           [torch.group_norm], drop=("cudnn_enabled",))
_functions("silu", "input, inplace=False", [F.silu, _get(_nn, "silu")])
_functions("softmax", "input, dim=None, _stacklevel=3, dtype=None", [F.softmax], drop=("_stacklevel",), dims=("dim",))
_functions("softmax", "input, dim, dtype=None", [torch.softmax], dims=("dim",))
_methods("softmax", "input, dim, dtype=None", ["softmax"], dims=("dim",))
_functions("bmm", "input, mat2", [torch.bmm])
_methods("bmm", "input, mat2", ["bmm"])
_functions("matmul", "input, other", [torch.matmul, operator.matmul])
_methods("matmul", "input, other", ["matmul", "__matmul__"])
_functions("baddbmm", "input, batch1, batch2, *, beta=1, alpha=1", [torch.baddbmm])
_methods("baddbmm", "input, batch1, batch2, *, beta=1, alpha=1", ["baddbmm"])
_functions("mul", "input, other", [operator.mul, torch.mul])
_methods("mul", "input, other", ["mul", "__mul__"])
_functions("div", "input, other, *, rounding_mode=None", [operator.truediv, torch.div])
_methods("div", "input, other, *, rounding_mode=None", ["div", "__truediv__"])
_functions("add", "input, other, *, alpha=1", [operator.add, torch.add])
_methods("add", "input, other, *, alpha=1", ["add", "__add__"])
_functions("sub", "input, other, *, alpha=1", [operator.sub, torch.sub])
_methods("sub", "input, other, *, alpha=1", ["sub", "__sub__"])
_functions("neg", "input", [operator.neg, torch.neg])
_methods("neg", "input", ["neg", "__neg__"])
_functions("transpose", "input, dim0, dim1", [torch.transpose], dims=("dim0", "dim1"))
_methods("transpose", "input, dim0, dim1", ["transpose"], dims=("dim0", "dim1"))
_functions("permute", "input, dims", [torch.permute], dims=("dims",))
_methods("permute", "input, *dims", ["permute"], dims=("dims",), varargs="dims")
# view and reshape compute the same values; a pattern written with one matches the other.
_functions("reshape", "input, shape", [torch.reshape])
_methods("reshape", "input, *shape", ["view", "reshape"], varargs="shape")
_methods("expand", "input, *size", ["expand"], varargs="size")
_functions("unsqueeze", "input, dim", [torch.unsqueeze])
_methods("unsqueeze", "input, dim", ["unsqueeze"])
_functions("getitem", "input, index", [operator.getitem])
_methods("contiguous", "input, memory_format=torch.contiguous_format", ["contiguous"])
_functions("conv2d", "input, weight, bias=None, stride=1, padding=0, dilation=1, groups=1", [torch.conv2d, F.conv2d])
_functions("conv3d", "input, weight, bias=None, stride=1, padding=0, dilation=1, groups=1", [torch.conv3d, F.conv3d])
_functions("batch_norm", "input, running_mean, running_var, weight=None, bias=None, training=False, momentum=0.1, "
           "eps=1e-05", [F.batch_norm])
_functions("batch_norm", "input, weight, bias, running_mean, running_var, training, momentum, eps, cudnn_enabled",
           [torch.batch_norm], drop=("cudnn_enabled",))
_functions("clamp", "input, min=None, max=None", [torch.clamp])
_methods("clamp", "input, min=None, max=None", ["clamp"])
_functions("sqrt", "input", [torch.sqrt])
_methods("sqrt", "input", ["sqrt"])
_functions("exp", "input", [torch.exp])
_methods("exp", "input", ["exp"])
_functions("pow", "input, exponent", [operator.pow, torch.pow])
_methods("pow", "input, exponent", ["pow", "__pow__"])
_functions("split", "tensor, split_size_or_sections, dim=0", [torch.split])
_methods("split", "tensor, split_size_or_sections, dim=0", ["split"])
_functions("cat", "tensors, dim=0", [torch.cat])
_functions("arange", "end, *, out=None, dtype=None, layout=None, device=None, pin_memory=None, requires_grad=False",
           [torch.arange])
_functions("remainder", "input, other", [operator.mod, torch.remainder])
_methods("remainder", "input, other", ["remainder", "__mod__"])
_functions("eq", "input, other", [operator.eq, torch.eq])
_methods("eq", "input, other", ["eq", "__eq__"])
_functions("bitwise_not", "input", [operator.invert, torch.bitwise_not])
_methods("bitwise_not", "input", ["bitwise_not", "__invert__"])
_functions("masked_fill", "input, mask, value", [torch.masked_fill])
_methods("masked_fill", "input, mask, value", ["masked_fill"])


def _to_dtype(args, kwargs):
    """x.to(dtype) only (the other overloads of Tensor.to are not canonicalised)."""
    if kwargs.keys() - {"dtype"}:
        return None
    rest = list(args[1:]) + ([kwargs["dtype"]] if "dtype" in kwargs else [])
    if len(rest) == 1 and isinstance(rest[0], (torch.dtype, fx.Node)):  # a Node: a pattern's wildcard
        return {"input": args[0], "dtype": rest[0]}
    return None


_SPECIAL_METHODS = {"to": ("to_dtype", _to_dtype)}

# Targets of calls that mutate an argument although neither name nor kwargs say so.
_MUTATING_FUNCTIONS = {operator.setitem, operator.iadd, operator.isub, operator.imul, operator.itruediv,
                       operator.imatmul, operator.ipow}


def _rank(value) -> int | None:
    v = value_of(value)
    return v.dim() if isinstance(v, torch.Tensor) else None


def _norm_dim(d, rank):
    if isinstance(d, int) and not isinstance(d, bool) and rank is not None and -rank <= d < 0:
        return d + rank
    return d


def canonical(node: fx.Node, rank: int | None = None) -> tuple[str, dict[str, Any]] | None:
    """(name, arguments) of a call in canonical form, or None for a call this module does not know.
    Dims are normalised against the input's rank; ``rank`` stands in for it on a pattern node, whose
    input has no example value (the rank of the graph node it is matched against)."""
    if node.op == "call_function":
        form = _BY_FUNCTION.get(node.target)
    elif node.op == "call_method":
        special = _SPECIAL_METHODS.get(node.target)
        if special is not None:
            bound = special[1](node.args, node.kwargs)
            return None if bound is None else (special[0], bound)
        form = _BY_METHOD.get(node.target)
    else:
        return None
    if form is None:
        return None
    args = node.args
    if form.varargs is not None and len(args) == 2 and isinstance(args[1], (tuple, list, torch.Size)):
        args = (args[0], *args[1])
    try:
        bound = form.sig.bind(*args, **node.kwargs)
    except TypeError:
        return None
    bound.apply_defaults()
    out = {}
    for k, v in bound.arguments.items():
        if k in form.drop:
            continue
        if form.varargs == k:
            v = tuple(v)
        out[k] = v
    if form.dims:
        if rank is None:
            first = next(iter(out.values()))
            rank = _rank(first) if isinstance(first, fx.Node) else None
        for k in form.dims:
            v = out[k]
            out[k] = tuple(_norm_dim(d, rank) for d in v) if isinstance(v, (tuple, list)) else _norm_dim(v, rank)
    if form.name == "transpose":  # transpose(a, b) == transpose(b, a)
        a, b = out["dim0"], out["dim1"]
        if isinstance(a, int) and isinstance(b, int) and a > b:
            out["dim0"], out["dim1"] = b, a
    return form.name, out


def canonical_name(node: fx.Node) -> str | None:
    c = canonical(node)
    return None if c is None else c[0]


def value_of(x):
    """The example value (a fake tensor, a SymInt, ...) dynamo recorded for a node; x itself otherwise."""
    if isinstance(x, fx.Node):
        if "example_value" in x.meta:
            return x.meta["example_value"]
        if "val" in x.meta:
            return x.meta["val"]
        if x.op == "get_attr":
            return _get_attr(x)
        return None
    return x


def _get_attr(node: fx.Node):
    obj = node.graph.owning_module
    for part in node.target.split("."):
        obj = getattr(obj, part)
    return obj


@functools.lru_cache(maxsize=None)
def _signature(fn):
    try:
        return inspect.signature(fn)
    except (TypeError, ValueError):  # builtins without one
        return None


def _inplace_flag(node: fx.Node) -> bool:
    """inplace=True given by keyword or by position (F.dropout(x, 0.1, True, True), F.silu(x, True))."""
    if node.kwargs.get("inplace") is True:
        return True
    sig = _signature(node.target) if callable(node.target) else None
    if sig is None or "inplace" not in sig.parameters:
        return False
    try:
        bound = sig.bind(*node.args, **node.kwargs)
    except TypeError:
        return False
    return bound.arguments.get("inplace") is True


def is_mutating(node: fx.Node) -> bool:
    """Conservative: does this call write into one of its arguments?"""
    if node.op == "call_method":
        name = node.target
        return (name.endswith("_") and not name.startswith("__")) or name.startswith("__i") or "out" in node.kwargs
    if node.op == "call_function":
        t = node.target
        if t in _MUTATING_FUNCTIONS or _inplace_flag(node) or "out" in node.kwargs:
            return True
        if isinstance(t, torch._ops.OpOverload):
            return t._schema.is_mutable
        if isinstance(t, torch._ops.OpOverloadPacket):
            return any(getattr(t, o)._schema.is_mutable for o in t.overloads())
        name = getattr(t, "__name__", "")
        return name.endswith("_") and not name.startswith("__")
    return False


# ---------------------------------------------------------------------------------------------------
# Patterns
# ---------------------------------------------------------------------------------------------------

SKIP = object()
"""Returned by a check when the match is not a candidate at all (nothing to report)."""


@dataclasses.dataclass
class Rewrite:
    """One pattern/replacement pair of a family.

    ``pattern`` and ``replacement`` are eager PyTorch functions. Every argument of ``pattern`` is a
    wildcard bound by the match (a node or a literal); the literals written inside it must match.
    ``replacement`` takes any of the pattern's argument names plus the names ``check`` put into
    ``match.extra``. ``check(match)`` returns None to accept, a reason string to refuse (recorded),
    or SKIP when the match is not a candidate of this rewrite."""

    family: str
    name: str
    pattern: Callable
    replacement: Callable
    check: Callable[["Match"], Any]

    @functools.cached_property
    def pattern_graph(self) -> fx.Graph:
        return fx.symbolic_trace(self.pattern).graph

    # Cached: read at every match attempt of the sweep.
    @functools.cached_property
    def outputs(self) -> list[fx.Node]:
        """The pattern's results: its root, then any intermediate it also returns (such an
        intermediate may be used outside the match; the replacement returns a value for it)."""
        out = next(n for n in self.pattern_graph.nodes if n.op == "output").args[0]
        return list(out) if isinstance(out, (tuple, list)) else [out]

    @property
    def root(self) -> fx.Node:
        return self.outputs[0]

    @property
    def anchor(self) -> str:
        return canonical_name(self.root)


class Match:
    def __init__(self, root: fx.Node):
        self.root = root
        self.bindings: dict[str, Any] = {}
        self.nodes: dict[fx.Node, fx.Node] = {}  # pattern node -> graph node
        self.extra: dict[str, Any] = {}
        self.outputs: list[fx.Node] = [root]
        self.ctx: Context | None = None  # set by run_rewrites before the check

    def __getitem__(self, name):
        return self.bindings[name]

    def val(self, name):
        """Example value of a binding (fake tensor for a node, the literal otherwise)."""
        return value_of(self.bindings[name])

    def node(self, pattern_name: str) -> fx.Node:
        """The graph node matched by the pattern node that was named ``pattern_name`` when traced."""
        for p, g in self.nodes.items():
            if p.name == pattern_name:
                return g
        raise KeyError(pattern_name)

    @property
    def graph_nodes(self) -> list[fx.Node]:
        return list(self.nodes.values())


def _match_value(pv, gv, m: Match) -> bool:
    if isinstance(pv, fx.Node):
        if pv.op == "placeholder":
            if pv.name in m.bindings:
                prev = m.bindings[pv.name]
                return prev is gv if isinstance(prev, fx.Node) or isinstance(gv, fx.Node) else _same_literal(prev, gv)
            m.bindings[pv.name] = gv
            return True
        if not isinstance(gv, fx.Node):
            return False
        return _match_node(pv, gv, m)
    if isinstance(gv, fx.Node):
        return False
    if isinstance(pv, (tuple, list)):
        return (isinstance(gv, (tuple, list, torch.Size)) and len(pv) == len(gv)
                and all(_match_value(a, b, m) for a, b in zip(pv, gv)))
    if isinstance(pv, slice):
        return (isinstance(gv, slice) and _match_value(pv.start, gv.start, m) and _match_value(pv.stop, gv.stop, m)
                and _match_value(pv.step, gv.step, m))
    return _same_literal(pv, gv)


def _same_literal(a, b) -> bool:
    if isinstance(a, bool) != isinstance(b, bool):
        return False
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return len(a) == len(b) and all(_same_literal(x, y) for x, y in zip(a, b))
    try:
        return type(a) is type(b) and a == b or (isinstance(a, (int, float)) and isinstance(b, (int, float))
                                                  and a == b)
    except Exception:  # e.g. SymInt comparisons
        return False


def _match_node(pn: fx.Node, gn: fx.Node, m: Match) -> bool:
    if pn in m.nodes:
        return m.nodes[pn] is gn
    if gn in m.nodes.values():
        return False
    gc = canonical(gn)
    if gc is None:
        return False
    # The pattern's dims are normalised against the rank of the graph's input.
    pc = canonical(pn, rank=_rank(next(iter(gc[1].values()), None)))
    if pc is None or pc[0] != gc[0]:
        return False
    pargs, gargs = pc[1], gc[1]
    if pargs.keys() != gargs.keys():
        return False
    m.nodes[pn] = gn
    for k, pv in pargs.items():
        if not _match_value(pv, gargs[k], m):
            return False
    return True


def match(rewrite: Rewrite, node: fx.Node) -> Match | None:
    m = Match(node)
    if not _match_node(rewrite.root, node, m):
        return None
    m.outputs = [m.nodes.get(p) for p in rewrite.outputs]
    if any(o is None for o in m.outputs):
        return None
    return m


# ---------------------------------------------------------------------------------------------------
# Checks every rewrite shares
# ---------------------------------------------------------------------------------------------------


def escaping_intermediate(m: Match) -> str | None:
    """An intermediate of the match that is also used outside it (the rewrite would drop it)."""
    inner = set(m.nodes.values())
    for g in inner:
        if g is m.root:
            continue
        for u in g.users:
            if u not in inner:
                if g in m.outputs:  # a returned intermediate: its users must follow the root
                    if _before(u, m.root):
                        return f"{u.name} uses the returned {g.name} before the root"
                    continue
                return f"intermediate {g.name} ({canonical_name(g)}) is also used by {u.name}"
    return None


def _before(a: fx.Node, b: fx.Node) -> bool:
    """a comes before b in the graph (walks back from b)."""
    n = b.prev
    while n.op != "root":
        if n is a:
            return True
        n = n.prev
    return False


def mutation_between(m: Match) -> str | None:
    """A mutating call between the first matched node and the root: the replacement reads its inputs
    at the root, so any write in between could change what it reads."""
    inner = set(m.nodes.values())
    remaining = len(inner) - 1
    n = m.root.prev
    while remaining > 0 and n.op != "root":
        if n in inner:
            remaining -= 1
        elif is_mutating(n):
            return f"{n.name} mutates a tensor between the matched nodes"
        n = n.prev
    return None


def kernel_missing(op: str, *tensors, dtypes=None) -> str | None:
    """Reason the vd op cannot take these example tensors (no kernel built for their device, a dtype
    it does not take, mixed devices or dtypes), or None."""
    from vdcompile import built_backends

    ts = [t for t in tensors if t is not None]
    if not ts or not all(isinstance(t, torch.Tensor) for t in ts):
        return "an input is not a tensor"
    devices = {t.device for t in ts}
    if len(devices) != 1:
        return f"inputs on several devices {sorted(map(str, devices))}"
    dev = next(iter(devices))
    key = {"cpu": "CPU", "cuda": "CUDA"}.get(dev.type)
    if key is None or key not in built_backends(op):
        return f"vd::{op} has no {dev.type} kernel in this build"
    dts = {t.dtype for t in ts}
    if len(dts) != 1:
        return f"mixed dtypes {sorted(map(str, dts))}"
    dt = next(iter(dts))
    allowed = dtypes if dtypes is not None else (torch.float32, torch.float16, torch.bfloat16, torch.float64)
    if dt not in allowed:
        return f"dtype {dt} not supported by vd::{op}"
    return None


def static_int(x) -> int | None:
    """x as a Python int when it is known without adding a guard, else None."""
    v = value_of(x)
    if isinstance(v, bool):
        return None
    if isinstance(v, int):
        return v
    if isinstance(v, torch.SymInt):
        try:
            hint = v.node.maybe_as_int()
        except Exception:
            hint = None
        return hint
    return None


def known_equal(a, b) -> bool:
    """a == b holds for every shape the graph can see (never adds a guard)."""
    if isinstance(a, int) and isinstance(b, int):
        return a == b
    try:
        return bool(statically_known_true(a == b))
    except Exception:
        return False


def requires_grad(x) -> bool:
    v = value_of(x)
    return isinstance(v, torch.Tensor) and v.requires_grad


# ---------------------------------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Report:
    """What the rewrites did to the graphs of one compile (or of several, merged)."""

    fired: Counter = dataclasses.field(default_factory=Counter)  # family -> count
    rejected: dict = dataclasses.field(default_factory=dict)  # family -> Counter(reason)
    notes: list = dataclasses.field(default_factory=list)  # graph-level events (validation fallbacks)

    def fire(self, family: str):
        self.fired[family] += 1

    def reject(self, family: str, reason: str):
        self.rejected.setdefault(family, Counter())[reason] += 1

    def merge(self, other: "Report"):
        self.fired.update(other.fired)
        for fam, c in other.rejected.items():
            self.rejected.setdefault(fam, Counter()).update(c)
        self.notes.extend(other.notes)

    def table(self, families=None) -> str:
        fams = list(families or [])
        for f in list(self.fired) + list(self.rejected):
            if f not in fams:
                fams.append(f)
        rows = [("rewrite", "fired", "rejected", "reasons")]
        for f in fams:
            rej = self.rejected.get(f, Counter())
            reasons = "; ".join(f"{r} (x{c})" for r, c in rej.most_common())
            rows.append((f, str(self.fired.get(f, 0)), str(sum(rej.values())), reasons or "-"))
        w = [max(len(r[i]) for r in rows) for i in range(3)]
        lines = [f"{r[0]:<{w[0]}}  {r[1]:>{w[1]}}  {r[2]:>{w[2]}}  {r[3]}" for r in rows]
        lines.insert(1, "-" * max(len(line) for line in lines))
        lines.extend(f"note: {n}" for n in self.notes)
        return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------
# Applying rewrites
# ---------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Context:
    """What the passes know about the compile."""

    fake_mode: Any = None
    # Weights may be treated as constants (inductor's freezing): concatenations of them are folded.
    freezing: bool = False
    # Grad mode of the compile (inductor freezes, and folds constants, only without grad).
    grad_enabled: bool = True
    # Families whose replacements gave a value other strides than the call it replaced; the whole
    # graph is then re-checked on the example values before it is used.
    layout_families: set = dataclasses.field(default_factory=set)
    autocast_reason: str | None = None
    # "auto": keep SDPA where its own kernels are measured faster than vd's; "vd": always vd's.
    attention_kernels: str = "auto"


def graph_fake_mode(gm: fx.GraphModule, example_inputs=()):
    """The fake mode of the graph's example values (the one its metadata was computed in)."""
    for n in gm.graph.nodes:
        v = n.meta.get("example_value")
        if isinstance(v, torch._subclasses.FakeTensor):
            return v.fake_mode
    return torch._guards.detect_fake_mode(example_inputs)


def autocast_reason(graph: fx.Graph) -> str | None:
    """The vd ops have no autocast rule: under autocast they would see other dtypes than the calls
    they replace, so graphs that run under autocast are not rewritten."""
    for dev in ("cpu", "cuda"):
        try:
            if torch.is_autocast_enabled(dev):
                return f"autocast is enabled for {dev} (the vd ops have no autocast rule)"
        except Exception:  # a device type this torch does not know
            pass
    for n in graph.nodes:
        if n.op == "call_function" and "autocast" in getattr(n.target, "__name__", ""):
            return "the graph has an autocast region (the vd ops have no autocast rule)"
    return None


def _fake(v, fake_mode):
    if isinstance(v, torch.Tensor) and fake_mode is not None and not isinstance(v, torch._subclasses.FakeTensor):
        return fake_mode.from_tensor(v)
    return v


def run_node(n: fx.Node, fake_mode):
    """Computes n's example value from its inputs' example values."""
    def arg(a):
        return _fake(value_of(a), fake_mode)

    args = fx.node.map_arg(n.args, arg)
    kwargs = fx.node.map_arg(n.kwargs, arg)
    ctx = fake_mode if fake_mode is not None else contextlib.nullcontext()
    with ctx:
        if n.op == "call_function":
            return n.target(*args, **kwargs)
        if n.op == "call_method":
            return getattr(args[0], n.target)(*args[1:], **kwargs)
        if n.op == "get_attr":
            return _fake(_get_attr(n), fake_mode)
    raise RuntimeError(f"cannot compute the value of {n.op} {n.name}")


def _same_meta(a, b) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return (a.dtype == b.dtype and a.device == b.device and a.dim() == b.dim()
                and all(known_equal(x, y) for x, y in zip(a.shape, b.shape)))
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return len(a) == len(b) and all(_same_meta(x, y) for x, y in zip(a, b))
    return type(a) is type(b)


def _same_strides(a, b) -> bool:
    return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
            and all(known_equal(x, y) for x, y in zip(a.stride(), b.stride())))


_COPIED_META = ("stack_trace", "nn_module_stack", "source_fn_stack")


def _proxify(v, tracer):
    return fx.node.map_aggregate(v, lambda x: fx.Proxy(x, tracer) if isinstance(x, fx.Node) else x)


# Factories that matched subgraphs may leave dead (diffusers' baddbmm input when there is no mask).
_PURE_FACTORIES = {torch.empty, torch.zeros, torch.ones, torch.empty_like, torch.zeros_like}


def _erase_dead(nodes):
    """Erases nodes left without users, and then their producers that are known pure calls."""
    work = list(nodes)
    while work:
        n = work.pop()
        if getattr(n, "_erased", False) or n.users or n.op not in ("call_function", "call_method"):
            continue
        if (canonical(n) is None and n.target not in _PURE_FACTORIES) or is_mutating(n):
            continue
        inputs = list(n.all_input_nodes)
        n.graph.erase_node(n)
        work.extend(inputs)


def replace(gm: fx.GraphModule, rw: Rewrite, m: Match, ctx: Context) -> str | None:
    """Inserts rw's replacement for m before the root and reroutes the root's users to it.
    Returns a reason (and leaves the graph as it was) if the replacement does not reproduce the
    root's shape, dtype and device on the example values."""
    graph = gm.graph
    tracer = fx.proxy.GraphAppendingTracer(graph)
    kwargs = {}
    for name in inspect.signature(rw.replacement).parameters:
        v = m.extra[name] if name in m.extra else m.bindings[name]
        kwargs[name] = _proxify(v, tracer)
    before = m.root.prev
    with graph.inserting_before(m.root):
        out = rw.replacement(**kwargs)
    new_nodes = []
    n = before.next
    while n is not m.root:
        new_nodes.append(n)
        n = n.next
    outs = list(out) if isinstance(out, (tuple, list)) else [out]
    out_nodes = [o.node if isinstance(o, fx.Proxy) else o for o in outs]

    def undo(reason):
        for x in reversed(new_nodes):
            graph.erase_node(x)
        return reason

    if len(out_nodes) != len(m.outputs) or not all(isinstance(o, fx.Node) for o in out_nodes):
        return undo("replacement produced no node")
    for x in new_nodes:  # a factory call without graph inputs would have run at rewrite time
        if any(isinstance(a, torch.Tensor) for a in torch.utils._pytree.tree_leaves((x.args, x.kwargs))):
            return undo("replacement captured a tensor constant")
    try:
        for x in new_nodes:
            for k in _COPIED_META:
                if k in m.root.meta:
                    x.meta[k] = m.root.meta[k]
            x.meta["example_value"] = run_node(x, ctx.fake_mode)
    except Exception as e:  # the op's fake kernel refused the inputs
        return undo(f"replacement fails on the example inputs: {type(e).__name__}: {str(e).splitlines()[0][:200]}")
    for old_node, out_node in zip(m.outputs, out_nodes):
        old, new = value_of(old_node), value_of(out_node)
        if not _same_meta(old, new):
            return undo("replacement would change the output's shape, dtype or device")
        if isinstance(old, torch.Tensor) and not _same_strides(old, new):
            ctx.layout_families.add(rw.family)
    for old_node, out_node in zip(m.outputs, out_nodes):
        old_node.replace_all_uses_with(out_node)
    _erase_dead(m.graph_nodes)
    return None


def run_rewrites(gm: fx.GraphModule, rewrites: list[Rewrite], report: Report, ctx: Context) -> None:
    """One sweep over the graph: at each node, the rewrites anchored on its op are tried in order.
    The sweep runs from the output backwards, so a pattern's root is met before the smaller
    patterns inside it (conv -> bn -> silu before conv -> bn)."""
    by_anchor: dict[str, list[Rewrite]] = {}
    for rw in rewrites:
        by_anchor.setdefault(rw.anchor, []).append(rw)
    for node in reversed(list(gm.graph.nodes)):
        if getattr(node, "_erased", False):
            continue
        cands = by_anchor.get(canonical_name(node))
        if not cands:
            continue
        reasons: dict[str, str] = {}
        done = False
        for rw in cands:
            m = match(rw, node)
            if m is None:
                continue
            m.ctx = ctx
            reason = rw.check(m)
            if reason is SKIP:
                continue
            # Autocast is the root cause of any dtype refusal it brings: it is reported first.
            reason = ctx.autocast_reason or reason
            if reason is None:
                reason = escaping_intermediate(m) or mutation_between(m)
            if reason is None:
                reason = replace(gm, rw, m, ctx)
            if reason is None:
                report.fire(rw.family)
                done = True
                break
            reasons.setdefault(rw.family, reason)
        if not done:
            for fam, r in reasons.items():
                report.reject(fam, r)


def revalidate(gm: fx.GraphModule, ctx: Context) -> str | None:
    """Recomputes every example value of the rewritten graph from its inputs. A replacement whose
    output has other strides than the call it replaced can make a later view invalid; this finds it
    (and any change of shape or dtype further down) before the graph is compiled."""
    for n in gm.graph.nodes:
        if n.op in ("placeholder", "output"):
            continue
        try:
            new = run_node(n, ctx.fake_mode)
        except Exception as e:
            return f"{n.name} fails on the rewritten graph: {type(e).__name__}: {str(e).splitlines()[0][:200]}"
        old = value_of(n)
        if old is not None and not _same_meta(old, new) and not isinstance(old, (int, float, bool, torch.SymInt)):
            return f"{n.name} changes shape or dtype on the rewritten graph"
        n.meta["example_value"] = new
    return None
