"""The vdcompile CLI: bench on the tiny preset (table, JSON, chart, disagreement detection) and the
one-line errors for bad presets, paths, devices and dtypes."""
from __future__ import annotations

import glob
import json
import os
import subprocess
import sys

import pytest
import torch
import torch._dynamo

from vdcompile import cli
from vdcompile.optimize import backend_status

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(autouse=True)
def _one_thread_fresh_dynamo(one_thread):  # one_thread: tests/conftest.py
    yield
    torch._dynamo.reset()


def _perturbing_backend(gm, example_inputs):
    """Runs the captured graph and nudges its first output: a compiler that gets the math wrong."""
    def run(*args):
        out = list(gm(*args))
        out[0] = out[0] * 1.01 + 0.01
        return tuple(out)
    return run


torch._dynamo.register_backend(name="vdtest_perturb")(_perturbing_backend)
torch._dynamo.register_backend(name="vdtest_exact")(lambda gm, example_inputs: gm.forward)


def _bench(tmp_path, *extra):
    return cli.main(["bench", "--preset", "tiny", "--device", "cpu", "--frames", "2", "--steps", "2",
                     "--warmup", "0", "--iters", "1", "--no-progress", "--out", str(tmp_path), *extra])


def test_bench_table_json_chart_and_disagreement(tmp_path, capsys):
    have_vd = backend_status()[0]
    ok_backend = "vdcompile" if have_vd else "vdtest_exact"
    # vdcompile's rewrites without code generation (eager inner compiler): a short compile.
    rc = _bench(tmp_path, "--backends", f"eager,{ok_backend},vdtest_perturb",
                "--backend-option", "inner_compiler=eager", "--backend-option", "conv_bn_silu=False")
    out, err = capsys.readouterr()
    assert rc == 1, "a backend disagreeing with eager must fail the run"
    assert "FAIL: vdtest_perturb disagrees with eager" in err
    assert ok_backend not in err
    for col in ("backend", "ms/step", "x eager", "x inductor", "compile s", "max rel err", "rewrites"):
        assert col in out
    (js,) = glob.glob(str(tmp_path / "bench_tiny_cpu_*.json"))
    data = json.load(open(js))
    assert set(data["environment"]) >= {"date", "torch", "device", "python"}
    assert data["environment"]["torch"] == torch.__version__
    assert data["config"]["preset"] == "tiny" and data["config"]["frames"] == 2
    assert data["config"]["unet_input_shape"] == [2, 2, 8, 16, 16]  # CFG batch, frames, 4+4 channels
    assert data["ok"] is False and len(data["failures"]) == 1
    rows = {r["backend"]: r for r in data["results"]}
    assert list(rows) == ["eager", ok_backend, "vdtest_perturb"]
    assert rows["eager"]["max_rel_err"] == 0.0
    assert rows[ok_backend]["max_rel_err"] < 1e-3 and rows[ok_backend]["latents_max_rel_err"] < 1e-3
    assert rows["vdtest_perturb"]["max_rel_err"] > 5e-3
    for r in rows.values():
        assert r["ms_per_step"] > 0 and len(r["ms_per_step_all"]) == 1
    assert rows[ok_backend]["compile_s"] > 0 and rows["eager"]["compile_s"] is None
    if have_vd:
        # The backend's counters reach the table: the tiny UNet has GroupNorm+SiLU pairs to fuse.
        assert rows["vdcompile"]["rewrites"].get("group_norm_silu", 0) > 0
        assert "group_norm_silu" in out
        assert data["config"]["backend_options"] == {"inner_compiler": "eager", "conv_bn_silu": False}
    png = js[:-5] + ".png"
    with open(png, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_bench_without_cfg_runs_the_unet_on_the_plain_batch(tmp_path, capsys):
    rc = _bench(tmp_path, "--no-cfg", "--backends", "eager,vdtest_exact")
    out, _ = capsys.readouterr()
    assert rc == 0 and "x2 CFG" not in out
    (js,) = glob.glob(str(tmp_path / "bench_tiny_cpu_*.json"))
    data = json.load(open(js))
    assert data["config"]["cfg"] is False
    assert data["config"]["unet_input_shape"] == [1, 2, 8, 16, 16]
    rows = {r["backend"]: r for r in data["results"]}
    assert rows["vdtest_exact"]["latents_max_rel_err"] == 0.0


def test_bench_channels_last_weights_for_every_row(tmp_path, capsys):
    have_vd = backend_status()[0]
    ok_backend = "vdcompile" if have_vd else "vdtest_exact"
    fast = ["--backend-option", "inner_compiler=eager"] if have_vd else []  # the rewrites, no codegen
    rc = _bench(tmp_path, "--channels-last", "--backends", f"eager,{ok_backend}", *fast)
    out, _ = capsys.readouterr()
    assert rc == 0 and "2-D conv weights channels_last" in out
    (js,) = glob.glob(str(tmp_path / "bench_tiny_cpu_*.json"))
    data = json.load(open(js))
    assert data["config"]["channels_last"] is True
    assert data["config"]["vdcompile_row_channels_last"] is False  # the vdcompile row's own preparation: GPU only
    rows = {r["backend"]: r for r in data["results"]}
    assert rows[ok_backend]["max_rel_err"] < 1e-3 and rows[ok_backend]["latents_max_rel_err"] < 1e-3
    if have_vd:  # the vd ops take the channels_last activations
        assert rows["vdcompile"]["rewrites"].get("group_norm_silu", 0) > 0


def test_generate_profiles_and_saves(tmp_path, capsys):
    rc = cli.main(["generate", "--preset", "tiny", "--device", "cpu", "--compile", "none", "--steps", "2",
                   "--frames", "3", "--format", "gif", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert rc == 0
    assert "3 frames, 2 steps in" in out and "frames/s" in out
    for region in ("unet forward", "vae decode", "scheduler step"):
        assert region in out
    assert "op family" in out and "bottlenecks:" in out
    from PIL import Image
    with Image.open(tmp_path / "generate_tiny_cpu.gif") as im:
        assert im.n_frames == 3 and im.size == (32, 32)
    data = json.load(open(tmp_path / "generate_tiny_cpu.json"))
    assert data["run"]["frames"] == 3 and data["run"]["steps"] == 2
    regions = {r["name"]: r for r in data["profile"]["regions"]}
    assert regions["unet forward"]["calls"] == 2 and regions["scheduler step"]["calls"] == 2
    assert regions["unet forward"]["total_ms"] <= data["profile"]["wall_ms"]
    assert (tmp_path / "generate_tiny_cpu_profile.png").stat().st_size > 0


def test_generate_inductor_unet_is_the_one_line_baseline(tmp_path, monkeypatch, capsys):
    """--compile inductor-unet compiles the UNet alone: no VAE compile, diffusers' own scheduler step."""
    import importlib

    opt = importlib.import_module("vdcompile.optimize")  # the module (vdcompile.optimize is also the function)
    seen = {}

    def fake_optimize(pipe, **kw):
        seen.update(kw)
        pipe.vdcompile_info = {"backend": kw["backend"]}
        return pipe

    monkeypatch.setattr(opt, "optimize", fake_optimize)
    rc = cli.main(["generate", "--preset", "tiny", "--device", "cpu", "--compile", "inductor-unet", "--steps", "1",
                   "--frames", "2", "--warmup", "0", "--no-op-profile", "--format", "gif", "--out", str(tmp_path)])
    capsys.readouterr()
    assert rc == 0
    assert seen == {"backend": "inductor", "cuda_graphs": False, "compile_vae": False, "fuse_scheduler": False}
    assert json.load(open(tmp_path / "generate_tiny_cpu.json"))["compile"] == "inductor-unet"


@pytest.mark.parametrize("argv,msg", [
    (["bench", "--preset", "nope"], "unknown preset 'nope'; choose one of: tiny, small, svd"),
    (["bench", "--model", "/no/such/dir"], "--model /no/such/dir: no such directory"),
    (["bench", "--dtype", "fp8"], "unknown dtype 'fp8'"),
    (["bench", "--device", "cpu", "--dtype", "fp16"], "fp16 is not supported on the CPU"),
    (["bench", "--device", "tpu"], "unknown device 'tpu'"),
    (["bench", "--backends", "eager,nonsense"], "unknown backend 'nonsense'"),
    (["bench", "--steps", "0"], "--steps and --iters must be >= 1"),
    (["bench", "--threads", "0"], "--threads must be >= 1"),
    (["bench", "--device", "cpu", "--cuda-graphs"], "--cuda-graphs needs a CUDA device"),
    (["generate", "--model", "/no/such/dir"], "--model /no/such/dir: no such directory"),
    (["bench", "no_such_kernel"], "no kernel benchmark 'no_such_kernel'"),
    (["bench", "--device", "cpu", "--backend-option", "bogus=1"], "unknown vdcompile option 'bogus'"),
    (["bench", "--device", "cpu", "--backend-option", "attention=maybe"], "takes a bool"),
])
def test_errors_are_one_actionable_line(argv, msg, capsys):
    rc = cli.main(argv)
    err = capsys.readouterr().err
    assert rc == 2
    assert msg in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is visible")
def test_cuda_requested_without_cuda(capsys):
    assert cli.main(["bench", "--device", "cuda"]) == 2
    err = capsys.readouterr().err
    assert "--device cuda was asked for but" in err and "run with --device cpu" in err


@pytest.mark.parametrize("layout", ["unet_dir", "pipeline_dir"])
def test_bench_local_checkpoint(tmp_path, capsys, layout):
    from vdcompile import models

    ckpt = tmp_path / "ckpt"
    models.build_unet("tiny").save_pretrained(ckpt if layout == "unet_dir" else ckpt / "unet")
    if layout == "pipeline_dir":
        models.build_vae("tiny").save_pretrained(ckpt / "vae")  # 2 levels: downsamples by 2
    rc = cli.main(["bench", "--model", str(ckpt), "--device", "cpu", "--backends", "eager", "--frames", "2",
                   "--height", "64", "--width", "64", "--steps", "1", "--iters", "1", "--warmup", "0",
                   "--no-progress", "--out", str(tmp_path / "out")])
    out = capsys.readouterr().out
    assert rc == 0
    assert f"model {ckpt}" in out and "UNetSpatioTemporalConditionModel" in out
    (js,) = glob.glob(str(tmp_path / "out" / "bench_model_cpu_*.json"))
    data = json.load(open(js))
    assert data["config"]["model"] == str(ckpt)
    latent = 8 if layout == "unet_dir" else 32  # no VAE to ask: SVD's factor 8
    assert data["config"]["unet_input_shape"] == [2, 2, 8, latent, latent]


def test_model_dir_without_config(tmp_path, capsys):
    assert cli.main(["bench", "--model", str(tmp_path)]) == 2
    assert "no config.json" in capsys.readouterr().err
    assert cli.main(["generate", "--model", str(tmp_path)]) == 2
    assert "no model_index.json" in capsys.readouterr().err


def test_bench_dispatches_to_kernel_benchmarks(tmp_path, monkeypatch, capsys):
    (tmp_path / "bench").mkdir()
    (tmp_path / "bench" / "hello.py").write_text(
        "import sys\nprint('hello bench', sys.argv[1:])\nsys.exit(3 if '--fail' in sys.argv else 0)\n")
    monkeypatch.chdir(tmp_path)
    assert cli.main(["bench", "hello", "--quick"]) == 0
    assert "hello bench ['--quick']" in capsys.readouterr().out
    assert cli.main(["bench", "hello", "--fail"]) == 3
    (tmp_path / "bench" / "ops.py").write_text(
        "import argparse\np = argparse.ArgumentParser()\n"
        "p.add_argument('--ops', default='norm_op,conv_op')\nprint('ops bench', p.parse_args().ops)\n")
    assert cli.main(["bench", "conv_op"]) == 0  # an op of bench/ops.py
    assert "ops bench conv_op" in capsys.readouterr().out
    assert cli.main(["bench", "missing"]) == 2
    assert "available: hello, ops, norm_op, conv_op" in capsys.readouterr().err


def test_explain_reports_rewrites(tmp_path, capsys):
    if not backend_status()[0]:
        pytest.skip("this build has no vdcompile backend")
    js = tmp_path / "explain.json"
    assert cli.main(["explain", "--preset", "tiny", "--device", "cpu", "--frames", "2", "--json", str(js)]) == 0
    out = capsys.readouterr().out
    assert "group_norm_silu" in out and "fired" in out
    data = json.load(open(js))
    assert data["graphs"] >= 1 and data["fired"].get("group_norm_silu", 0) > 0


def test_explain_without_backend_is_a_clear_error(capsys):
    import importlib.util
    if importlib.util.find_spec("vdcompile.explain") is not None:
        pytest.skip("this build has vdcompile.explain")
    assert cli.main(["explain", "--preset", "tiny", "--device", "cpu"]) == 2
    assert "needs vdcompile.explain" in capsys.readouterr().err


def test_module_entry_point_no_traceback():
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run([sys.executable, "-m", "vdcompile", "bench", "--preset", "svd2"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 2
    assert r.stderr.strip() == "vdcompile: error: unknown preset 'svd2'; choose one of: tiny, small, svd"


def test_help_lists_the_commands(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert all(c in out for c in ("bench", "explain", "generate"))
    assert cli.main([]) == 2  # no command: usage, not a crash
