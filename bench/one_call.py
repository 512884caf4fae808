"""One warm call of a vd op on a benchmark shape, for profilers (ncu, nsys, compute-sanitizer):
    ncu --set full -k regex:attn_fwd python bench/one_call.py attention temporal-14a
    ncu --set full -k regex:fused_rows python bench/one_call.py group_norm_silu 28,320,72,128
    ncu --set full -k regex:smem_cols python bench/one_call.py group_norm_silu 32,640,64,96 --fp32 --channels-last
    ncu --set full -k regex:smem_grad python bench/one_call.py group_norm_silu_backward 28,320,72,128
    ncu --set full -k regex:conv_bn_silu python bench/one_call.py conv_bn_silu 28,1280,18,32 [--fp32]
    ncu --set full -k regex:temporal_conv python bench/one_call.py temporal_conv 2,1280,14,18,32 [--fp32] [--frames-major]
(group_norm_silu_backward: dx, dgamma, dbeta from the forward's statistics, as autograd calls it;
conv_bn_silu: a 3x3 convolution, C_in = C_out, channels_last; the VD_CONV_BN_SILU_* switches apply;
temporal_conv: k = 3, padding 1, C_in = C_out, contiguous x or frames-major; float32 runs TF32, as eager's default)
"""
from __future__ import annotations

import sys

import torch

import vdcompile  # noqa: F401  (registers torch.ops.vd)
from bench.attention import SHAPES


def main():
    what, name = sys.argv[1], sys.argv[2]
    dtype = torch.float16 if "--fp16" in sys.argv else torch.float32 if "--fp32" in sys.argv else torch.bfloat16
    if what in ("group_norm_silu", "group_norm_silu_backward"):
        x = torch.randn(*map(int, name.split(",")), device="cuda", dtype=dtype)
        if "--channels-last" in sys.argv:
            x = x.contiguous(memory_format=torch.channels_last if x.dim() == 4 else torch.channels_last_3d)
        w, b = (torch.randn(x.shape[1], device="cuda", dtype=dtype) for _ in range(2))
        if what == "group_norm_silu":
            for _ in range(2):
                torch.ops.vd.group_norm_silu(x, 32, w, b, 1e-5, True)
        else:
            _, stats = torch.ops.vd.group_norm_silu_forward(x, 32, w, b, 1e-5, True)
            g = torch.randn_like(x)
            for _ in range(2):
                torch.ops.vd.group_norm_silu_backward(g, x, 32, w, b, 1e-5, True, stats)
        torch.cuda.synchronize()
        return
    if what == "conv_bn_silu":
        n, c, h, w = map(int, name.split(","))
        torch.backends.cudnn.allow_tf32 = True  # float32 on the tensor cores, as eager's default
        x = torch.randn(n, c, h, w, device="cuda", dtype=dtype).contiguous(memory_format=torch.channels_last)
        weight = (torch.randn(c, c, 3, 3, device="cuda", dtype=dtype) / (3 * c**0.5)).contiguous(
            memory_format=torch.channels_last)
        bias, bn_w, bn_b, mean = (torch.randn(c, device="cuda", dtype=dtype) for _ in range(4))
        var = torch.rand(c, device="cuda", dtype=dtype) + 0.5
        for _ in range(2):
            torch.ops.vd.conv_bn_silu(x, weight, bias, bn_w, bn_b, mean, var, 1e-5, [1, 1], [1, 1], [1, 1], 1, True)
        torch.cuda.synchronize()
        return
    if what == "temporal_conv":
        b, c, f, h, w = map(int, name.split(","))
        torch.backends.cudnn.allow_tf32 = True
        if "--frames-major" in sys.argv:
            x = torch.randn(b, f, c, h, w, device="cuda", dtype=dtype).transpose(1, 2)
        else:
            x = torch.randn(b, c, f, h, w, device="cuda", dtype=dtype)
        weight = torch.randn(c, c, 3, 1, 1, device="cuda", dtype=dtype) / (3 * c) ** 0.5
        for _ in range(2):
            torch.ops.vd.temporal_conv(x, weight, None, 1)
        torch.cuda.synchronize()
        return
    if what != "attention":
        raise SystemExit(f"unknown op family {what!r}")
    shape = {s[0]: s[1:] for s in SHAPES}[name]
    B, H, L, D = shape
    q, k, v = (torch.randn(B, H, L, D, device="cuda", dtype=dtype) for _ in range(3))
    for _ in range(2):
        torch.ops.vd.fused_attention(q, k, v, None, None)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
