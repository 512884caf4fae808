"""The vdcompile backend: entry point, options, modes, inner compilers, cache key, logging."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import vdcompile
from vdcompile import backend
from vdcompile.passes import FAMILIES
from tests.backend_checks import BACKEND, assert_fired

ROOT = Path(__file__).resolve().parents[1]


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.GroupNorm(4, 16)
        self.proj = nn.Linear(16, 16)

    def forward(self, x):
        return self.proj(F.silu(self.norm(x)).transpose(1, 2))


def _inputs():
    torch.manual_seed(0)
    return Block(), torch.randn(2, 16, 5)


def _dist_info(tmp_path: Path) -> Path:
    """A dist-info carrying the entry points pyproject.toml declares (what pip install writes)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    eps = project["entry-points"]["torch_dynamo_backends"]
    d = tmp_path / f"vdcompile-{project['version']}.dist-info"
    d.mkdir()
    (d / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vdcompile\nVersion: {project['version']}\n")
    (d / "entry_points.txt").write_text(
        "[torch_dynamo_backends]\n" + "".join(f"{k} = {v}\n" for k, v in eps.items()))
    return tmp_path


def test_entry_point_resolves_without_import(tmp_path):
    code = textwrap.dedent("""
        import sys, torch
        assert "vdcompile" in torch._dynamo.list_backends(), torch._dynamo.list_backends()
        assert "vdcompile" not in sys.modules
        f = torch.compile(lambda x: torch.nn.functional.silu(torch.nn.functional.group_norm(x, 2)),
                          backend="vdcompile", options={"inner_compiler": "eager"}, fullgraph=True)
        x = torch.randn(2, 4, 3)
        ref = torch.nn.functional.silu(torch.nn.functional.group_norm(x, 2))
        torch.testing.assert_close(f(x), ref)
        fn = torch._dynamo.lookup_backend("vdcompile")
        assert fn.__module__ == "vdcompile.backend", fn.__module__
        assert torch._dynamo.utils.counters["vdcompile"]["group_norm_silu"] == 1
        print("OK")
    """)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(_dist_info(tmp_path))]))
    r = subprocess.run([sys.executable, "-c", code], env=env, cwd=tmp_path, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0 and r.stdout.strip().endswith("OK"), r.stderr[-3000:]


def test_unknown_option_lists_valid_ones():
    with pytest.raises(ValueError) as e:
        backend.parse_options(None, {"atention": True})
    msg = str(e.value)
    assert "'atention'" in msg and "inner_compiler" in msg and "attention_kernels" in msg and all(f in msg for f in FAMILIES)
    # Raised at compile time through torch.compile as well.
    m, x = _inputs()
    with pytest.raises(Exception, match="unknown vdcompile option 'atention'"):
        torch.compile(m, backend=BACKEND, options={"atention": True})(x)


@pytest.mark.parametrize("opts, fragment", [
    ({"attention": "yes"}, "takes a bool"),
    ({"inner_compiler": "tvm"}, "inner_compiler must be one of"),
    ({"attention_kernels": "cudnn"}, "attention_kernels must be one of"),
    ({"inner_compiler": "eager", "max_autotune": True}, "need inner_compiler='inductor'"),
])
def test_bad_option_values(opts, fragment):
    with pytest.raises(ValueError, match=fragment):
        backend.parse_options(None, opts)


def test_modes_map_to_inductor_modes():
    _, inner, patches, _ = backend.parse_options("reduce-overhead", None)
    assert inner == "inductor" and patches == {"triton.cudagraphs": True}
    _, _, patches, _ = backend.parse_options("max-autotune-no-cudagraphs", {"epilogue_fusion": False})
    assert patches["max_autotune"] is True and patches["epilogue_fusion"] is False
    assert "triton.cudagraphs" not in patches
    assert backend.parse_options("default", None)[2] == {}
    with pytest.raises(RuntimeError, match="Unrecognized mode"):
        backend.parse_options("fastest", None)
    with pytest.raises(ValueError, match="need inner_compiler='inductor'"):
        backend.parse_options("reduce-overhead", {"inner_compiler": "eager"})


def test_switches(monkeypatch):
    enabled, _, _, kernels = backend.parse_options(None, {"attention": False, "qkv_projection": False})
    assert enabled == set(FAMILIES) - {"attention", "qkv_projection"} and kernels == "auto"
    assert backend.parse_options(None, {"attention_kernels": "vd"})[3] == "vd"


def test_inductor_receives_mode_options_and_cache_key(monkeypatch):
    seen = {}

    def fake_compile_fx(gm, example_inputs, config_patches=None, **kw):
        seen["patches"] = config_patches
        seen["code"] = gm.code
        return gm.forward

    import torch._inductor.compile_fx as cfx

    monkeypatch.setattr(cfx, "compile_fx", fake_compile_fx)
    m, x = _inputs()
    torch._dynamo.reset()
    # torch.compile takes mode or options, not both; the backend called directly takes both.
    out = torch.compile(m, backend=BACKEND, mode="max-autotune-no-cudagraphs")(x)
    torch.testing.assert_close(out, m(x))
    assert seen["patches"]["max_autotune"] is True
    torch._dynamo.reset()
    out = torch.compile(m, backend=BACKEND, options={"epilogue_fusion": False})(x)
    p = seen["patches"]
    assert p["epilogue_fusion"] is False and "max_autotune" not in p
    key = p["post_grad_custom_post_pass"]
    assert key.uuid() == backend.source_hash()
    assert "vd.group_norm_silu" in seen["code"]  # inductor gets the rewritten graph
    torch._dynamo.reset()


def test_inner_compilers(monkeypatch):
    m, x = _inputs()
    ref = m(x)
    import torch._inductor.compile_fx as cfx

    def no_inductor(*a, **k):
        raise AssertionError("inductor must not run")

    monkeypatch.setattr(cfx, "compile_fx", no_inductor)
    for inner in ("eager", "aot_eager"):
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
        out = torch.compile(m, backend=BACKEND, options={"inner_compiler": inner}, fullgraph=True)(x)
        torch.testing.assert_close(out, ref)
        assert torch._dynamo.utils.counters["vdcompile"]["group_norm_silu"] == 1
        ran_aot = torch._dynamo.utils.counters["aot_autograd"]["total"] > 0
        assert ran_aot == (inner == "aot_eager"), inner
    monkeypatch.undo()
    torch._dynamo.reset()
    x.requires_grad_()
    out = torch.compile(m, backend=BACKEND, fullgraph=True)(x)
    torch.testing.assert_close(out, ref)
    g, = torch.autograd.grad(out.sum(), x)
    g_ref, = torch.autograd.grad(m(x).sum(), x)
    torch.testing.assert_close(g, g_ref, atol=1e-5, rtol=1e-5)
    torch._dynamo.reset()


def test_cache_key_pass_composes_with_user_pass():
    from torch._inductor.custom_graph_pass import CustomGraphPass

    calls = []

    class UserPass(CustomGraphPass):
        def __call__(self, graph):
            calls.append(graph)

        def uuid(self):
            return "user-1"

    wrapped = backend._with_cache_key(UserPass())
    assert wrapped.uuid() == (backend.source_hash(), "user-1")
    wrapped("g")
    assert calls == ["g"]
    # A plain callable has no uuid: the result must not be cacheable.
    assert backend._with_cache_key(lambda g: None).uuid() is None
    assert backend._with_cache_key(None).uuid() == backend.source_hash()


def test_source_hash_covers_sources_and_extension(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "passes").mkdir(parents=True)
    (pkg / "passes" / "a.py").write_text("x = 1\n")
    so = tmp_path / "_C.so"
    so.write_bytes(b"\0kernel-v1")
    h1 = backend._hash_files(pkg, so)
    (pkg / "passes" / "a.py").write_text("x = 2\n")
    h2 = backend._hash_files(pkg, so)
    so.write_bytes(b"\0kernel-v2")
    h3 = backend._hash_files(pkg, so)
    assert len({h1, h2, h3}) == 3
    assert backend._hash_files(pkg, so) == h3


def test_fx_graph_cache_keyed_on_vdcompile(monkeypatch, tmp_path):
    """Same graph and same vdcompile: a cache hit. Same graph, changed vdcompile: a miss."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    from torch._inductor import config as iconfig
    from torch._dynamo.utils import counters

    # iconfig.patch, not monkeypatch.setattr: under pytest 9.2 monkeypatch restored these entries with
    # delattr, which hides an inductor config entry for the rest of the session (later compiles failed).
    torch.manual_seed(0)
    x = torch.randn(2, 8, 3)

    def f(x):
        return F.silu(F.group_norm(x, 2)) * 2

    def run():
        torch._dynamo.reset()
        counters.clear()
        torch.testing.assert_close(torch.compile(f, backend=BACKEND, fullgraph=True)(x), f(x))
        return counters["inductor"]["fxgraph_cache_hit"], counters["inductor"]["fxgraph_cache_miss"]

    with iconfig.patch(fx_graph_cache=True, fx_graph_remote_cache=False):
        assert run() == (0, 1)
        assert run() == (1, 0)
        monkeypatch.setattr(backend, "source_hash", lambda: "a-changed-vdcompile")
        assert run() == (0, 1)
    torch._dynamo.reset()


def test_log_env_prints_report(monkeypatch, capfd):
    monkeypatch.setenv("VDCOMPILE_LOG", "1")
    m, x = _inputs()
    torch._dynamo.reset()
    torch.compile(m, backend=BACKEND, options={"inner_compiler": "eager"})(x)
    err = capfd.readouterr().err
    assert "[vdcompile]" in err and "group_norm_silu" in err
    line = next(ln for ln in err.splitlines() if ln.startswith("group_norm_silu"))
    assert line.split()[1] == "1"
    torch._dynamo.reset()


def test_explain_table(capsys):
    m, x = _inputs()
    out = vdcompile.explain(m, x)
    printed = capsys.readouterr().out
    assert_fired(out, {"group_norm_silu": 1})
    assert out.graph_count == 1
    torch.testing.assert_close(out.output, m(x))
    for fam in FAMILIES:
        assert fam in printed


def test_parameters_as_get_attr():
    """Graphs whose parameters are get_attr nodes (not placeholders) are rewritten the same way."""
    from torch._subclasses import FakeTensorMode
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    from vdcompile.passes import apply
    from vdcompile.passes._common import Context, Report

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.w, self.b = nn.Parameter(torch.randn(8)), nn.Parameter(torch.randn(8))

        def forward(self, x):
            return F.silu(F.group_norm(x, 4, self.w, self.b))

    m = M()
    gm = torch.fx.symbolic_trace(m)
    assert any(n.op == "get_attr" for n in gm.graph.nodes)
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    x = torch.randn(2, 8, 5)
    FakeTensorProp(gm, mode).propagate(mode.from_tensor(x))
    report = Report()
    apply(gm, {"group_norm_silu"}, Context(fake_mode=mode), report)
    assert report.fired["group_norm_silu"] == 1
    assert "vd.group_norm_silu" in gm.code
    torch.testing.assert_close(gm(x), m(x), atol=1e-5, rtol=1e-5)
