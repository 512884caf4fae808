"""The built extension itself: what it registered, and that its C++ errors reach Python."""
from __future__ import annotations

import subprocess
import sys

import torch

import vdcompile

OPS = ["fused_attention", "strided_attention", "conv_bn_silu", "group_norm_silu", "temporal_conv", "scheduler_step"]


def test_every_op_has_a_cpu_kernel_and_python_side():
    for op in OPS:
        assert "CPU" in vdcompile.built_backends(op), op
        assert callable(getattr(vdcompile.ops, op))
        assert hasattr(torch.ops.vd, op)


def test_kernel_errors_reach_python_in_a_fresh_process():
    # A build whose C++ runtime differs from libtorch's (e.g. libstdc++ linked statically) turns every
    # failed argument check into a crash of the process; this shows it as one clear failure.
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() and vdcompile.has_cuda_kernels("group_norm_silu") else [])
    for dev in devices:
        code = (
            "import torch, vdcompile\n"
            "try:\n"
            f"    vdcompile.ops.group_norm_silu(torch.randn(2, 6, 4, 4, device='{dev}'), 4)\n"
            "except RuntimeError as e:\n"
            "    print('raised:', e)\n"
        )
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, f"{dev}: process died with {r.returncode}: {r.stderr[-2000:]}"
        assert "num_groups (4) must divide" in r.stdout, r.stdout
