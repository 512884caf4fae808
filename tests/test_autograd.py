"""The C++ autograd layer (csrc/autograd.cpp) shared by five ops: the formulas themselves are checked by each
op's gradcheck and opcheck tests; here, that calls go through it as intended."""
from __future__ import annotations

import pytest
import torch

from tests import (test_op_conv_bn_silu, test_op_fused_attention, test_op_group_norm_silu, test_op_strided_attention,
                   test_op_temporal_conv)
from tests.common import device_params

MODULES = {
    "group_norm_silu": (test_op_group_norm_silu, "GroupNormSiluFn"),
    "temporal_conv": (test_op_temporal_conv, "TemporalConvFn"),
    "conv_bn_silu": (test_op_conv_bn_silu, "ConvBnSiluFn"),
    "fused_attention": (test_op_fused_attention, "FusedAttentionFn"),
    "strided_attention": (test_op_strided_attention, "StridedAttentionFn"),
}
CASES = [pytest.param(op, d.values[0], marks=d.marks, id=f"{op}-{d.id}") for op in MODULES for d in device_params(op)]


def _first_output(out):
    return out[0] if isinstance(out, tuple) else out


def _vd_events(fn, name):
    with torch.profiler.profile() as prof:
        fn()
    return [e.name for e in prof.events() if e.name == f"vd::{name}"]


@pytest.mark.parametrize("op,device", CASES)
def test_autograd_kernel_is_cpp(op, device):
    text = torch._C._dispatch_dump(f"vd::{op}")
    line = next(ln for ln in text.splitlines() if ln.startswith("Autograd"))
    assert "csrc/autograd.cpp" in line, line


@pytest.mark.parametrize("op,device", CASES)
def test_grad_and_no_grad_calls(op, device):
    module, fn_name = MODULES[op]
    overload = getattr(torch.ops.vd, op).default
    args = module.sample_inputs(device, requires_grad=False)[0]
    out = _first_output(overload(*args))
    assert out.grad_fn is None and not out.requires_grad
    # One dispatcher call per op call: the autograd kernel hands on to the backend by redispatch.
    assert len(_vd_events(lambda: overload(*args), op)) == 1

    args = module.sample_inputs(device, requires_grad=True)[0]
    out = _first_output(overload(*args))
    assert fn_name in out.grad_fn.name(), out.grad_fn.name()
    assert len(_vd_events(lambda: overload(*args), op)) == 1
    with torch.no_grad():
        assert _first_output(overload(*args)).grad_fn is None
    tensors = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
    grads = torch.autograd.grad(out.float().square().sum(), tensors, allow_unused=True)
    for t, g in zip(tensors, grads):
        assert g is not None and g.shape == t.shape and g.dtype == t.dtype and bool(torch.isfinite(g).all())
