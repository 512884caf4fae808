"""conv_bn_silu's Hopper kernel at each tile against the cuDNN path, in one process: device time a call
(torch.profiler, each variant measured in turn over rounds whose order rotates, the median kept, with the
SM clock each ran at: common.alternate), % of the
measured matmul rate (TF32's for float32), max error against float64. The op's own choice ("auto") beside
them. Square 3x3 convolutions, C_in = C_out.

    python bench/conv_tiles.py [--dtype bf16|fp16|fp32] [--shapes 2x1280x9x16,2x1280x16x24]
                               [--tiles 128,160,256,64x128,64x256,256x128,256-c3]

A tile "T-cN" runs T in clusters of N pixel tiles (VD_CONV_BN_SILU_CLUSTER=N; "-c0": outside clusters).
--env NAME=VALUE (repeatable) adds each variant again with that variable set, e.g. VD_CONV_BN_SILU_DP=0
(several at once: NAME=VALUE;NAME2=VALUE2).
"""
from __future__ import annotations

import argparse
import contextlib
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (DTYPES, alternate, env_var, environment, measure_ceilings,  # noqa: E402
                    print_table, write_json)

import vdcompile  # noqa: E402,F401
from vdcompile.ops import reference_conv_bn_silu  # noqa: E402

SHAPES = "2x320x72x128,2x640x36x64,2x1280x18x32,2x1280x9x16"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    ap.add_argument("--shapes", default=SHAPES)
    ap.add_argument("--tiles", default="128,160,256,64x128,64x256")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--env", action="append", default=[], metavar="NAME=VALUE")
    ap.add_argument("--no-check", action="store_true", help="skip the float64 reference (slow at 28 images)")
    args = ap.parse_args()
    dev, dtype = torch.device("cuda"), DTYPES[args.dtype]
    ceil = measure_ceilings(dev)
    rate = ceil["tf32_matmul_TFLOPs" if dtype == torch.float32 else "bf16_matmul_TFLOPs"]
    variants = [("auto", {}), ("cudnn", {"VD_CONV_BN_SILU_KERNEL": "cudnn"})]
    for t in filter(None, args.tiles.split(",")):  # --tiles "": the op's choice and cuDNN only
        tile, _, cm = t.partition("-c")
        env = {"VD_CONV_BN_SILU_KERNEL": "wgmma", "VD_CONV_BN_SILU_TILE": tile}
        variants.append((t, {**env, "VD_CONV_BN_SILU_CLUSTER": cm} if cm else env))
    for assignment in args.env:  # NAME=VALUE, or several joined by ";"
        extra = dict(a.split("=", 1) for a in assignment.split(";"))
        variants += [(f"{name}+{assignment}", {**env, **extra}) for name, env in variants
                     if "+" not in name and name != "cudnn"]
    rows = []
    for shape in args.shapes.split(","):
        n, c, h, w = map(int, shape.split("x"))
        torch.manual_seed(0)
        x = torch.randn(n, c, h, w, device=dev).to(dtype).contiguous(memory_format=torch.channels_last)
        wt = (torch.randn(c, c, 3, 3, device=dev) / (9 * c) ** 0.5).to(dtype)
        bn = [torch.rand(c, device=dev) + 0.5, torch.randn(c, device=dev), torch.randn(c, device=dev) * 0.5,
              torch.rand(c, device=dev) + 0.5]
        call = (wt, None, *bn, 1e-5, [1, 1], [1, 1], [1, 1], 1, True)
        with torch.no_grad():
            ref = None if args.no_check else reference_conv_bn_silu(x.double(), wt.double(), None,
                                                                    *(t.double() for t in bn), *call[6:])
            row = {"shape": shape}

            def variant(env):
                def call_with_env():
                    with contextlib.ExitStack() as stack:
                        for k, v in env.items():
                            stack.enter_context(env_var(k, v))
                        return torch.ops.vd.conv_bn_silu(x, *call)
                return call_with_env
            fns = {name: variant(env) for name, env in variants}
            if ref is not None:
                for name, f in fns.items():
                    row[f"{name}_err"] = (f().double() - ref).abs().max().item()
            for name, got in alternate(fns, dev, rounds=args.rounds).items():
                us = row[f"{name}_us"] = got["ms"] * 1e3
                row[f"{name}_rounds_us"] = [m * 1e3 for m in got["rounds_ms"]]
                row[f"{name}_mhz"] = got.get("sm_mhz")
                row[f"{name}_pct"] = 100 * 2 * n * c * c * 9 * h * w / us / 1e6 / rate
        rows.append(row)
    print_table(rows, [("shape", "shape", "")] + [(f"{v}_us", f"{v} us", ".1f") for v, _ in variants])
    print_table(rows, [("shape", "shape", "")] + [(f"{v}_mhz", f"{v} MHz", ".0f") for v, _ in variants])
    if not args.no_check:
        print_table(rows, [("shape", "shape", "")] + [(f"{v}_err", f"{v} max err", ".1e") for v, _ in variants])
    payload = {"environment": environment(dev), "ceilings": ceil, "dtype": args.dtype, "conv_tiles": rows}
    print("wrote", write_json(f"conv_tiles_{args.dtype}", payload))


if __name__ == "__main__":
    main()
