"""Same-process A/B of temporal_conv under kernel switches (environment settings the op reads on every call),
beside eager nn.Conv3d on the same tensors.

    python bench/tc_env_ab.py --env VD_TEMPORAL_CONV_TF32_ORDER=rr [--env NAME=VALUE ...] [--dtype fp32]
                              [--shapes 2x1280x14x18x32,...] [--frames-major] [--rounds 5]

Per shape: ms a call by CUDA events (bench/common.py's time_cuda, as bench/ops.py reports) of eager and of the op
as built ("default") and under each setting, in --rounds rounds that alternate them (the GPU's clock moves with its
power draw, so a variant timed once, apart from the others, carries the moment's clock); the medians, the ratios
to eager's median, the CUDA kernel that served each variant and its largest error against a float64 reference.
JSON goes to bench/results/.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import DTYPES, env_var, environment, time_cuda, write_json  # noqa: E402
from gn_env_ab import served_by  # noqa: E402

import vdcompile  # noqa: E402,F401


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--env", action="append", default=[], help="NAME=VALUE: a variant beside the default")
    p.add_argument("--dtype", default="fp32")
    p.add_argument("--shapes", default="2x1280x14x18x32")
    p.add_argument("--frames-major", action="store_true", help="x as a transposed view of (B, F, C, H, W)")
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args(argv)
    dev = torch.device("cuda")
    dtype = DTYPES[args.dtype]
    variants = [("default", None, None)] + [(e, *e.split("=", 1)) for e in args.env]
    rows = []
    for spec in args.shapes.split(","):
        B, C, F_, H, W = (int(v) for v in spec.split("x"))
        conv = torch.nn.Conv3d(C, C, (3, 1, 1), padding=(1, 0, 0)).to(dev, dtype)
        if args.frames_major:
            x = torch.randn(B, F_, C, H, W, device=dev, dtype=dtype).transpose(1, 2)
        else:
            x = torch.randn(B, C, F_, H, W, device=dev, dtype=dtype)
        with torch.no_grad():
            ref = F.conv3d(x.double(), conv.weight.double(), conv.bias.double(), padding=(1, 0, 0))

            def ours(i):
                return torch.ops.vd.temporal_conv(x, conv.weight, conv.bias, 1)

            times = {"eager": [], **{key: [] for key, _, _ in variants}}
            for _ in range(args.rounds):
                times["eager"].append(time_cuda(lambda i: conv(x)))
                for key, name, setting in variants:
                    with env_var(name, setting) if setting is not None else contextlib.nullcontext():
                        times[key].append(time_cuda(ours))
            eager = statistics.median(times["eager"])
            r = {"shape": spec, "dtype": args.dtype, "layout": "frames-major" if args.frames_major else "contiguous",
                 "eager_ms": eager, "eager_rounds_ms": times["eager"]}
            for key, name, setting in variants:
                with env_var(name, setting) if setting is not None else contextlib.nullcontext():
                    kern = served_by(lambda: ours(0))
                    err = (ours(0).double() - ref).abs().max().item()
                ms = statistics.median(times[key])
                r[key] = {"ms": ms, "rounds_ms": times[key], "x_eager": eager / ms, "kernel": kern, "max_err": err}
        rows.append(r)
        del x, ref, conv
        torch.cuda.empty_cache()
    print(f"{'shape':>18} {'variant':>36} {'ms':>8} {'x eager':>8} {'max err':>8}  kernel")
    for r in rows:
        print(f"{r['shape']:>18} {'eager (cuDNN)':>36} {r['eager_ms']:8.4f}")
        for k, v in r.items():
            if isinstance(v, dict):
                print(f"{r['shape']:>18} {k:>36} {v['ms']:8.4f} {v['x_eager']:8.3f} {v['max_err']:8.1e}  {v['kernel']}")
    path = write_json("tc_env_ab", {"environment": environment(dev), "variants": args.env,
                                    "frames_major": args.frames_major, "rows": rows})
    print("wrote", path)


if __name__ == "__main__":
    main()
