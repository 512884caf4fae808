"""The ``vdcompile`` torch.compile backend.

``torch.compile(model, backend="vdcompile")`` finds this module through the ``torch_dynamo_backends``
entry point (no ``import vdcompile`` needed). The backend receives dynamo's graph (Torch IR, before
AOTAutograd), rewrites the subgraphs the vd ops fuse (see vdcompile.passes), and hands the result to
inductor's ``compile_fx`` (or runs it eagerly), so AOTAutograd traces the vd ops through their
registered autograd formulas and training works as well as inference.

Options (``torch.compile(..., options={...})``):
  - one boolean per rewrite family (vdcompile.passes.FAMILIES), all on by default;
  - ``inner_compiler``: "inductor" (default), "aot_eager" (AOTAutograd without inductor) or "eager"
    (the rewritten graph run as is: for debugging);
  - ``attention_kernels``: "auto" (default: F.scaled_dot_product_attention calls are kept where
    PyTorch's own kernels are measured faster than vd's: on the CPU, and on CUDA beyond 32 tokens
    except long sequences at head_dim <= 64 on Hopper when no gradient is needed; see
    vdcompile.passes.attention) or
    "vd" (every matched attention goes to vd::fused_attention);
  - any other key must be an inductor option (torch._inductor.list_options()) and is applied as a
    config patch of this compile, like backend="inductor" does.
``mode`` maps to inductor's modes (torch._inductor.list_mode_options: reduce-overhead = CUDA graphs).

Set VDCOMPILE_LOG=1 to print, at each compile, how often each rewrite fired and why candidates were
refused (vdcompile.explain returns the same as a value).
"""
from __future__ import annotations

import functools
import hashlib
import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.fx as fx

__all__ = ["vdcompile_backend", "INNER_COMPILERS", "parse_options"]

INNER_COMPILERS = ("inductor", "aot_eager", "eager")
ATTENTION_KERNELS = ("auto", "vd")

# Collectors of (report, rewritten graph) pairs, installed by vdcompile.explain.
_SINKS: list[list] = []


def _families():
    from vdcompile.passes import FAMILIES

    return FAMILIES


def parse_options(mode: str | None, options: dict | None):
    """(enabled families, inner compiler, inductor config patches, attention kernels); raises
    ValueError on a bad option."""
    families = _families()
    enabled = set(families)
    inner = "inductor"
    attention_kernels = "auto"
    inductor_opts: dict[str, Any] = {}
    valid_inductor = set(torch._inductor.list_options())
    for key, val in (options or {}).items():
        if key in families:
            if not isinstance(val, bool):
                raise ValueError(f"vdcompile option {key!r} takes a bool, got {val!r}")
            if not val:
                enabled.discard(key)
        elif key == "inner_compiler":
            if val not in INNER_COMPILERS:
                raise ValueError(f"vdcompile option inner_compiler must be one of {INNER_COMPILERS}, got {val!r}")
            inner = val
        elif key == "attention_kernels":
            if val not in ATTENTION_KERNELS:
                raise ValueError(f"vdcompile option attention_kernels must be one of {ATTENTION_KERNELS}, got {val!r}")
            attention_kernels = val
        elif key.replace("-", "_") in valid_inductor:
            inductor_opts[key.replace("-", "_")] = val
        else:
            raise ValueError(
                f"unknown vdcompile option {key!r}. Valid options: the rewrites {', '.join(families)} (bool); "
                f"inner_compiler ({' | '.join(INNER_COMPILERS)}); attention_kernels ({' | '.join(ATTENTION_KERNELS)}); "
                "or an inductor option "
                "(see torch._inductor.list_options())")
    if inner != "inductor" and (inductor_opts or (mode and mode != "default")):
        raise ValueError(f"mode and inductor options need inner_compiler='inductor', got {inner!r}")
    patches: dict[str, Any] = {}
    if mode and mode != "default":
        from torch._inductor import list_mode_options

        patches.update(list_mode_options(mode))  # raises on an unknown mode, listing the valid ones
    patches.update(inductor_opts)
    return enabled, inner, patches, attention_kernels


def vdcompile_backend(gm: fx.GraphModule, example_inputs, mode: str | None = None, options: dict | None = None):
    """torch.compile backend: rewrite to the vd ops, then compile with the inner compiler."""
    import vdcompile  # noqa: F401  (registers torch.ops.vd: the rewrites emit them)
    from vdcompile.passes import _common, apply

    enabled, inner, patches, attention_kernels = parse_options(mode, options)
    # Inductor folds weights into constants only when freezing is set globally (dynamo then treats
    # parameters as constants); an options={"freezing": True} patch alone folds nothing.
    freezing = inner == "inductor" and bool(torch._inductor.config.freezing)
    ctx = _common.Context(fake_mode=_common.graph_fake_mode(gm, example_inputs), freezing=freezing,
                          grad_enabled=torch.is_grad_enabled(), attention_kernels=attention_kernels)
    report = _common.Report()
    gm = apply(gm, enabled, ctx, report)
    _publish(report, gm)

    if inner == "eager":
        return gm.forward
    if inner == "aot_eager":
        from torch._dynamo.backends.debugging import aot_eager

        return aot_eager(gm, example_inputs)
    from torch._inductor.compile_fx import compile_fx

    key_pass = _with_cache_key(
        patches.get("post_grad_custom_post_pass", torch._inductor.config.post_grad_custom_post_pass))
    patches["post_grad_custom_post_pass"] = key_pass
    if not isinstance(key_pass, list) and key_pass.uuid() is None:
        patches["fx_graph_cache"] = False  # a user pass without uuid: never cache (all versions)
    return compile_fx(gm, example_inputs, config_patches=patches)


def _reset():
    # Like backend="inductor": drop CUDA-graph trees recorded by reduce-overhead compiles.
    try:
        from torch._inductor.cudagraph_trees import reset_cudagraph_trees

        reset_cudagraph_trees()
    except Exception:
        pass


vdcompile_backend.reset = _reset  # called by torch._dynamo.reset()


def _publish(report, gm):
    from torch._dynamo.utils import counters

    for fam, n in report.fired.items():
        counters["vdcompile"][fam] += n
    for sink in _SINKS:
        sink.append((report, gm))
    if os.environ.get("VDCOMPILE_LOG", "") not in ("", "0"):
        sys.stderr.write(f"[vdcompile] rewrites of graph {getattr(gm, '_get_name', lambda: '')()}:\n"
                         f"{report.table(_families())}\n")


# ---------------------------------------------------------------------------------------------------
# Inductor's caches
# ---------------------------------------------------------------------------------------------------
# The FX graph cache and the AOTAutograd cache key on the graph they are given, which already holds
# the rewrites' output, so a changed pass that emits another graph never hits a stale entry. What the
# key does not see is the vd ops themselves: custom ops are hashed by name, yet their fake kernels
# decide the compiled code's shapes and strides and their autograd formulas are traced into the
# cached backward. A no-op post-grad pass whose uuid hashes vdcompile's Python sources and the built
# extension puts both into the key; inductor hashes configured passes by uuid in 2.11 and 2.13 alike.


@functools.lru_cache(maxsize=None)
def source_hash() -> str:
    """Hash of every Python file of the package and of the loaded extension binary."""
    import vdcompile._C as ext

    return _hash_files(Path(__file__).resolve().parent, Path(ext.__file__))


def _hash_files(root: Path, extension: Path) -> str:
    h = hashlib.sha256()
    for p in sorted(root.rglob("*.py")) + [extension]:
        h.update(str(p.relative_to(root) if p.is_relative_to(root) else p.name).encode())
        h.update(p.read_bytes())
    return h.hexdigest()


@functools.lru_cache(maxsize=None)
def _cache_key_pass_cls():
    from torch._inductor.custom_graph_pass import CustomGraphPass

    class VdCacheKey(CustomGraphPass):
        """Runs the user's post-grad pass (if any); its uuid adds vdcompile's identity to the key."""

        def __init__(self, inner=None):
            self.inner = inner

        def __call__(self, graph):
            if self.inner is not None:
                return self.inner(graph)

        def uuid(self):
            if self.inner is None:
                return source_hash()  # looked up at call time (tests replace it)
            inner_uuid = self.inner.uuid() if isinstance(self.inner, CustomGraphPass) else None
            # A user pass without uuid makes the graph uncacheable, as it would without vdcompile.
            return None if inner_uuid is None else (source_hash(), inner_uuid)

    return VdCacheKey


def _with_cache_key(existing):
    cls = _cache_key_pass_cls()
    if isinstance(existing, cls):
        return existing
    if isinstance(existing, (list, tuple)):  # torch versions that take a list of passes
        return [*existing, cls()]
    return cls(existing)
