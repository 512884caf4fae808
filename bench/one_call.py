"""One warm call of a vd op on a benchmark shape, for profilers (ncu, nsys, compute-sanitizer):
    ncu --set full -k regex:attn_fwd python bench/one_call.py attention temporal-14a
    ncu --set full -k regex:fused_rows python bench/one_call.py group_norm_silu 28,320,72,128
    ncu --set full -k regex:smem_cols python bench/one_call.py group_norm_silu 32,640,64,96 --fp32 --channels-last
"""
from __future__ import annotations

import sys

import torch

import vdcompile  # noqa: F401  (registers torch.ops.vd)
from bench.attention import SHAPES


def main():
    what, name = sys.argv[1], sys.argv[2]
    dtype = torch.float16 if "--fp16" in sys.argv else torch.float32 if "--fp32" in sys.argv else torch.bfloat16
    if what == "group_norm_silu":
        x = torch.randn(*map(int, name.split(",")), device="cuda", dtype=dtype)
        if "--channels-last" in sys.argv:
            x = x.contiguous(memory_format=torch.channels_last if x.dim() == 4 else torch.channels_last_3d)
        w, b = (torch.randn(x.shape[1], device="cuda", dtype=dtype) for _ in range(2))
        for _ in range(2):
            torch.ops.vd.group_norm_silu(x, 32, w, b, 1e-5, True)
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
