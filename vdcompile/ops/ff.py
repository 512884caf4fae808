"""vd::linear_geglu: a GEGLU feed-forward's input projection and gate in one GEMM.

diffusers' GEGLU computes ``h, gate = linear(x, W, b).chunk(2, -1); out = h * gelu(gate)``: the GEMM
writes a (tokens, 2N) intermediate that an elementwise pass reads back to write (tokens, N). Here one
GEMM program accumulates the hidden and the gate columns of the same output tile side by side and
applies bias, GELU and the product in its epilogue: the intermediate never reaches memory (on SVD's
first level that is 1.3 GB written and read again per call).

The CUDA kernel is a Triton GEMM (tensor cores through Triton's dot); elsewhere, or without Triton, the
op runs the same math in PyTorch.
"""
from __future__ import annotations

import contextlib
import functools

import torch
import torch.nn.functional as F

from vdcompile.ops._utils import grads_for

__all__ = ["linear_geglu", "reference_linear_geglu", "triton_kernel_available"]

_OP = "vd::linear_geglu"
APPROXIMATE = ("none", "tanh")
KERNEL_DTYPES = (torch.float16, torch.bfloat16)


@functools.cache
def _triton():
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return None
    return triton, tl


def triton_kernel_available() -> bool:
    """Whether CUDA calls in float16/bfloat16 run the fused Triton kernel (else the PyTorch math)."""
    return torch.cuda.is_available() and _triton() is not None


def linear_geglu(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                 approximate: str = "none") -> torch.Tensor:
    """``h * gelu(gate)`` with ``h, gate = F.linear(x, weight, bias).chunk(2, dim=-1)``.

    x: (..., K); weight: (2N, K), its first N rows the hidden projection and its last N the gate's;
    bias: (2N,) or None. Returns (..., N) in x's dtype, contiguous. ``approximate`` is GELU's
    ("none": erf, or "tanh"). The CUDA kernel accumulates in float32 and rounds once (the unfused
    chain rounds the projection, the GELU and the product each to x's dtype).
    """
    return torch.ops.vd.linear_geglu.default(x, weight, bias, approximate)


def reference_linear_geglu(x, weight, bias=None, approximate="none"):
    """The unfused math in plain PyTorch (what the pass replaces)."""
    h, gate = F.linear(x, weight, bias).chunk(2, dim=-1)
    return h * F.gelu(gate, approximate=approximate)


def _check_args(x, weight, bias, approximate):
    torch._check(approximate in APPROXIMATE,
                 lambda: f"{_OP}: approximate must be 'none' or 'tanh', got {approximate!r}")
    torch._check(x.dim() >= 1, lambda: f"{_OP}: x must have at least 1 dim (..., K), got a 0-D tensor")
    torch._check(weight.dim() == 2, lambda: f"{_OP}: weight must be 2-D (2N, K), got {weight.dim()}-D")
    torch._check(weight.shape[0] % 2 == 0,
                 lambda: f"{_OP}: weight must have an even number of rows (hidden and gate), got {weight.shape[0]}")
    torch._check(weight.shape[1] == x.shape[-1],
                 lambda: f"{_OP}: weight is {tuple(weight.shape)} but x's last dim is {x.shape[-1]}")
    torch._check(weight.dtype == x.dtype, lambda: f"{_OP}: weight is {weight.dtype} but x is {x.dtype}")
    torch._check(weight.device == x.device, lambda: f"{_OP}: weight is on {weight.device} but x is on {x.device}")
    torch._check(x.dtype.is_floating_point, lambda: f"{_OP}: x must be a floating-point tensor, got {x.dtype}")
    if bias is not None:
        torch._check(bias.shape == (weight.shape[0],),
                     lambda: f"{_OP}: bias must be ({weight.shape[0]},), got {tuple(bias.shape)}")
        torch._check(bias.dtype == x.dtype, lambda: f"{_OP}: bias is {bias.dtype} but x is {x.dtype}")
        torch._check(bias.device == x.device, lambda: f"{_OP}: bias is on {bias.device} but x is on {x.device}")


@torch.library.custom_op(_OP, mutates_args=(), device_types=("cpu", "cuda"))
def _linear_geglu(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                  approximate: str) -> torch.Tensor:
    _check_args(x, weight, bias, approximate)
    if x.is_cuda and x.dtype in KERNEL_DTYPES and _triton() is not None and x.numel() > 0:
        return _triton_forward(x, weight, bias, approximate)
    return reference_linear_geglu(x, weight, bias, approximate).contiguous()


@_linear_geglu.register_fake
def _(x, weight, bias, approximate):
    _check_args(x, weight, bias, approximate)
    return x.new_empty((*x.shape[:-1], weight.shape[0] // 2))


def _setup_context(ctx, inputs, output):
    x, weight, bias, approximate = inputs
    ctx.save_for_backward(x, weight, bias)
    ctx.approximate = approximate


def _backward(ctx, grad):
    # The projection is recomputed (not saved): saving it would keep the 2N-wide intermediate alive,
    # which the fusion exists to avoid.
    x, weight, bias = ctx.saved_tensors
    with torch.enable_grad():
        xd = x.detach().requires_grad_(ctx.needs_input_grad[0])
        wd = weight.detach().requires_grad_(ctx.needs_input_grad[1])
        bd = None if bias is None else bias.detach().requires_grad_(ctx.needs_input_grad[2])
        out = reference_linear_geglu(xd, wd, bd, ctx.approximate)
        wants = [t for t in (xd, wd, bd) if t is not None and t.requires_grad]
        got = iter(torch.autograd.grad(out, wants, grad)) if wants else iter(())
    grads = [next(got) if t is not None and t.requires_grad else None for t in (xd, wd, bd)]
    return grads_for(ctx, *grads, None)


_linear_geglu.register_autograd(_backward, setup_context=_setup_context)


# ---------------------------------------------------------------------------------------------------
# The Triton kernel
# ---------------------------------------------------------------------------------------------------

# (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages). BLOCK_N is per half: a program computes a
# BLOCK_M x BLOCK_N tile of both the hidden and the gate projection (two accumulators).
Config = tuple[int, int, int, int, int]
DEFAULT_CONFIG: Config = (128, 128, 64, 8, 3)


def pick_config(M: int, N: int, K: int) -> Config:
    return DEFAULT_CONFIG


@functools.cache
def _kernel():
    triton, tl = _triton()

    @triton.jit
    def geglu_kernel(x_ptr, w_ptr, b_ptr, o_ptr, M, N, K, sxm, sxk, swn, swk, som,
                     HAS_BIAS: tl.constexpr, TANH: tl.constexpr, EVEN_K: tl.constexpr,
                     BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr):
        # Grouped tile order: GROUP_M row blocks sweep the columns together, so their x rows and the
        # weight columns stay in L2.
        pid = tl.program_id(0)
        num_m = tl.cdiv(M, BM)
        num_n = tl.cdiv(N, BN)
        width = GROUP_M * num_n
        first_m = (pid // width) * GROUP_M
        size_m = tl.minimum(num_m - first_m, GROUP_M)
        pid_m = first_m + (pid % width) % size_m
        pid_n = (pid % width) // size_m
        rm = pid_m.to(tl.int64) * BM + tl.arange(0, BM)
        rn = pid_n * BN + tl.arange(0, BN)
        rk = tl.arange(0, BK)
        mask_m = rm < M
        mask_n = rn < N
        x_ptrs = x_ptr + rm[:, None] * sxm + rk[None, :] * sxk
        wh_ptrs = w_ptr + rn[None, :].to(tl.int64) * swn + rk[:, None] * swk
        wg_ptrs = wh_ptrs + N * swn
        acc_h = tl.zeros((BM, BN), dtype=tl.float32)
        acc_g = tl.zeros((BM, BN), dtype=tl.float32)
        for kb in range(0, tl.cdiv(K, BK)):
            if EVEN_K:
                a = tl.load(x_ptrs, mask=mask_m[:, None], other=0.0)
                bh = tl.load(wh_ptrs, mask=mask_n[None, :], other=0.0)
                bg = tl.load(wg_ptrs, mask=mask_n[None, :], other=0.0)
            else:
                mk = (rk + kb * BK) < K
                a = tl.load(x_ptrs, mask=mask_m[:, None] & mk[None, :], other=0.0)
                bh = tl.load(wh_ptrs, mask=mk[:, None] & mask_n[None, :], other=0.0)
                bg = tl.load(wg_ptrs, mask=mk[:, None] & mask_n[None, :], other=0.0)
            acc_h = tl.dot(a, bh, acc_h)
            acc_g = tl.dot(a, bg, acc_g)
            x_ptrs += BK * sxk
            wh_ptrs += BK * swk
            wg_ptrs += BK * swk
        if HAS_BIAS:
            acc_h += tl.load(b_ptr + rn, mask=mask_n, other=0.0).to(tl.float32)[None, :]
            acc_g += tl.load(b_ptr + N + rn, mask=mask_n, other=0.0).to(tl.float32)[None, :]
        if TANH:  # tanh(u) = 2 sigmoid(2u) - 1
            u = 0.7978845608028654 * (acc_g + 0.044715 * acc_g * acc_g * acc_g)
            gelu = acc_g * tl.sigmoid(2.0 * u)
        else:
            gelu = 0.5 * acc_g * (1.0 + tl.math.erf(acc_g * 0.7071067811865476))
        out = acc_h * gelu
        o_ptrs = o_ptr + rm[:, None] * som + rn[None, :]
        tl.store(o_ptrs, out.to(o_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])

    return geglu_kernel


def _triton_forward(x, weight, bias, approximate, config: Config | None = None):
    K = x.shape[-1]
    N = weight.shape[0] // 2
    x2 = x.reshape(-1, K)  # a view for any x whose leading dims merge; a copy otherwise
    M = x2.shape[0]
    out = torch.empty((M, N), dtype=x.dtype, device=x.device)
    bm, bn, bk, warps, stages = config or pick_config(M, N, K)
    grid = (triton_cdiv(M, bm) * triton_cdiv(N, bn),)
    with torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext():
        _kernel()[grid](x2, weight, bias if bias is not None else weight, out, M, N, K,
                        x2.stride(0), x2.stride(1), weight.stride(0), weight.stride(1), out.stride(0),
                        HAS_BIAS=bias is not None, TANH=approximate == "tanh", EVEN_K=K % bk == 0,
                        BM=bm, BN=bn, BK=bk, GROUP_M=8, num_warps=warps, num_stages=stages)
    return out.view(*x.shape[:-1], N)


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)
