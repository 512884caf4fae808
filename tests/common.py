"""Shared test helpers: which devices have kernels, tolerances per dtype, opcheck wrappers."""
from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.library import opcheck

import vdcompile  # noqa: F401  (registers torch.ops.vd)
from vdcompile import built_backends

# Tolerances against a float64 reference, per input dtype (max abs error, relative to the
# reference's max magnitude + 1): fp32 arithmetic and the reduced precisions' rounding.
TOL = {
    torch.float64: 1e-10,
    torch.float32: 2e-5,
    torch.float16: 4e-3,
    torch.bfloat16: 3e-2,
}

DTYPES = [torch.float32, torch.float16, torch.bfloat16]

# opcheck's own default; test_aot_dispatch_dynamic also compares gradients.
OPCHECK_UTILS = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")


def device_params(op: str):
    """pytest params for the devices the installed extension has kernels for.

    The CUDA case is decided by what was built (the dispatcher), and skipped with the reason when
    the build has no CUDA kernel or no GPU is visible."""
    cuda_built = "CUDA" in built_backends(op)
    cuda_reason = (
        f"vd::{op} was built without CUDA kernels" if not cuda_built
        else "no CUDA device visible" if not torch.cuda.is_available() else ""
    )
    return [
        pytest.param("cpu", id="cpu"),
        pytest.param("cuda", id="cuda", marks=pytest.mark.skipif(bool(cuda_reason), reason=cuda_reason or "-")),
    ]


def assert_close_to(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, factor: float = 1.0, what: str = ""):
    """Max abs error of ``out`` against a high-precision ``ref``, scaled by ref's magnitude."""
    assert out.shape == ref.shape, f"{what} shape {tuple(out.shape)} != {tuple(ref.shape)}"
    out64, ref64 = out.double(), ref.double()
    assert torch.isfinite(out64).all() == torch.isfinite(ref64).all(), f"{what} non-finite values differ"
    err = (out64 - ref64).abs().max().item() if out.numel() else 0.0
    bound = factor * TOL[dtype] * (1.0 + ref64.abs().max().item() if ref.numel() else 1.0)
    assert err <= bound, f"{what} max abs error {err:.3e} > {bound:.3e} ({dtype})"


def run_opcheck(op, args, kwargs=None):
    result = opcheck(op, args, kwargs or {}, test_utils=OPCHECK_UTILS)
    assert all(v == "SUCCESS" for v in result.values()), result


def opcheck_test(op, sample_inputs, devices):
    """Every op file's ``test_opcheck = opcheck_test(...)``: run_opcheck on each of
    ``sample_inputs(device, requires_grad)``, per device, with and without requires_grad."""
    @pytest.mark.parametrize("device", devices)
    @pytest.mark.parametrize("requires_grad", [False, True])
    def test_opcheck(device, requires_grad):
        for args in sample_inputs(device, requires_grad):
            run_opcheck(op, args)

    return test_opcheck


def sample_tensor(*shape, device, requires_grad, memory_format=None):
    """A randn sample input of an op, optionally in ``memory_format``."""
    x = torch.randn(*shape, device=device)
    if memory_format is not None:
        x = x.to(memory_format=memory_format)
    return x.requires_grad_(requires_grad)


def assert_fake_matches_real(op, args):
    """Shape, dtype, device and strides of every output agree between the kernel and the fake kernel
    (opcheck compares strides on CUDA only). Strides of size-1 dims carry no meaning and are skipped."""
    real = op(*args)
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fake = op(*(mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args))
    real, fake = (real, fake) if isinstance(real, tuple) else ((real,), (fake,))
    for i, (r, f) in enumerate(zip(real, fake)):
        assert (r.shape, r.dtype, r.device) == (f.shape, f.dtype, f.device), f"output {i}"
        dims = [d for d in range(r.dim()) if r.shape[d] > 1]
        assert [r.stride(d) for d in dims] == [f.stride(d) for d in dims], f"output {i}: {r.stride()} vs {f.stride()}"


def set_env(monkeypatch, key: str, value: str | None) -> None:
    """Sets the kernel-choice variable ``key`` for this test, or unsets it where ``value`` is None."""
    if value is None:
        monkeypatch.delenv(key, raising=False)
    else:
        monkeypatch.setenv(key, value)


def cuda_kernels_run(fn) -> list[str]:
    """Names of the CUDA kernels ``fn()`` launches (tests pin which kernel serves a case)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [e.name for e in prof.events()]


def check_cpp_autograd(op: str, args_no_grad, args_grad, node: str) -> torch.Tensor:
    """vd::<op>'s Autograd-key kernel is csrc/autograd.cpp's: a call hands on to the backend by redispatch (one
    dispatcher event, with or without a gradient), makes no graph under no_grad or without inputs that require
    grad, and otherwise one C++ node named ``node``. Returns the op's (first) output of a call with ``args_grad``."""
    line = next(ln for ln in torch._C._dispatch_dump(f"vd::{op}").splitlines() if ln.startswith("Autograd"))
    assert "csrc/autograd.cpp" in line, line
    overload = getattr(torch.ops.vd, op).default

    def first(out):
        return out[0] if isinstance(out, tuple) else out

    def events(args):
        with torch.profiler.profile() as prof:
            overload(*args)
        return [e.name for e in prof.events() if e.name == f"vd::{op}"]
    for args in (args_no_grad, args_grad):
        assert len(events(args)) == 1
        with torch.no_grad():
            assert first(overload(*args)).grad_fn is None
    assert first(overload(*args_no_grad)).grad_fn is None
    out = first(overload(*args_grad))
    assert node in out.grad_fn.name(), out.grad_fn.name()
    return out
