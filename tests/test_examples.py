"""The examples run as documented (CPU, their smallest settings) and report agreement.

Each runs in its own process, as a user would start it; the checks are on the exit status (every
example exits non-zero when its comparison fails) and on what it prints and writes.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from vdcompile import built_backends

ROOT = Path(__file__).resolve().parent.parent
ALL_OPS = ("fused_attention", "strided_attention", "conv_bn_silu", "group_norm_silu", "temporal_conv",
           "scheduler_step")


def _run(script: str, *args: str, timeout: int = 600) -> str:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    p = subprocess.run([sys.executable, str(ROOT / "examples" / script), *args], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=timeout)
    assert p.returncode == 0, f"{script} {' '.join(args)} exited {p.returncode}:\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
    return p.stdout


def _need_cpu(*ops):
    missing = [op for op in ops if "CPU" not in built_backends(op)]
    if missing:
        pytest.skip(f"no CPU kernel built for {', '.join(missing)}")


def test_ops_demo():
    _need_cpu(*ALL_OPS)
    out = _run("ops_demo.py", "--device", "cpu")
    for op in ALL_OPS:
        assert any(line.startswith(op) and line.rstrip().endswith("ok") for line in out.splitlines()), out
    assert "FAIL" not in out


def test_strided_transformer_check_and_bench():
    _need_cpu("strided_attention")
    out = _run("strided_transformer.py", "--mode", "check")
    assert out.count(" ok (tolerance") == 2 and "FAIL" not in out
    out = _run("strided_transformer.py", "--mode", "bench", "--tokens", "64", "--depth", "1")
    assert "vd::strided_attention" in out and "eager" in out


def test_optimize_svd(tmp_path):
    # The rewrites with the eager inner compiler: the pipeline's path through optimize() without
    # inductor's code generation (the tests of optimize() and the CLI cover the inductor path).
    out = _run("optimize_svd.py", "--inner-compiler", "eager", "--out", str(tmp_path))
    assert "max pixel difference (0-255):" in out and "speed-up:" in out
    assert (tmp_path / "optimize_svd.gif").stat().st_size > 0


def test_profile_pipeline(tmp_path):
    out = _run("profile_pipeline.py", "--out", str(tmp_path))
    assert "bottlenecks:" in out and "unet forward" in out
    assert (tmp_path / "profile_pipeline.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
