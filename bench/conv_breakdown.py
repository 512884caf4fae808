"""Where conv_bn_silu's time goes: device time per kernel of eager conv + BatchNorm + SiLU, of inductor's code
for it (with freezing), of vd::conv_bn_silu and of its cuDNN path (torch.profiler over 20 calls, the runs
alternating over 3 rounds, medians), with the per-call and CUDA-graph times beside them.

    python bench/conv_breakdown.py [--dtype bf16|fp16|fp32] [--shapes 2x320x72x128,28x1280x18x32]
"""
import argparse
import os
import statistics
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import DTYPES, cuda_kernel_times, env_var, time_cuda, time_cuda_graph  # noqa: E402

import vdcompile  # noqa: E402,F401

CALLS = 20


def kernels_per_call(fn):
    """{kernel name: median device ms} and the summed device ms per call."""
    times = cuda_kernel_times(lambda i: fn(), CALLS)
    total = sum(sum(ts) for ts in times.values()) / CALLS / 1e3
    return {k[:90]: statistics.median(ts) / 1e3 for k, ts in times.items()}, total


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    ap.add_argument("--shapes", default="2x320x72x128,2x640x36x64,2x1280x18x32,2x1280x9x16")
    args_ = ap.parse_args()
    dev = "cuda"
    dtype = DTYPES[args_.dtype]
    torch.backends.cudnn.allow_tf32 = True  # float32 on the tensor cores (eager's default for convolutions)
    for shape in args_.shapes.split(","):
        N, C, H, W = map(int, shape.split("x"))
        x = torch.randn(N, C, H, W, device=dev, dtype=dtype).to(memory_format=torch.channels_last)
        conv = torch.nn.Conv2d(C, C, 3, padding=1).to(dev, dtype).to(memory_format=torch.channels_last)
        bn = torch.nn.BatchNorm2d(C).to(dev, dtype).eval()
        args = (conv.weight, conv.bias, bn.weight, bn.bias, bn.running_mean, bn.running_var, bn.eps,
                [1, 1], [1, 1], [1, 1], 1, True)

        def eager():
            return F.silu(bn(conv(x)))

        def cudnn():
            with env_var("VD_CONV_BN_SILU_KERNEL", "cudnn"):
                return torch.ops.vd.conv_bn_silu(x, *args)
        with torch.no_grad():
            import torch._inductor.config as icfg
            torch._dynamo.reset()
            with icfg.patch(freezing=True):
                ind = torch.compile(eager, dynamic=False)
                ind()
            runs = {"eager": eager, "inductor": ind, "vd": lambda: torch.ops.vd.conv_bn_silu(x, *args),
                    "vd cuDNN path": cudnn}
            got = {name: [] for name in runs}
            for _ in range(3):
                for name, fn in runs.items():
                    got[name].append(kernels_per_call(fn))
            for name, fn in runs.items():
                kernels = {k: statistics.median(r[0].get(k, 0.0) for r in got[name]) for k in got[name][0][0]}
                total = statistics.median(r[1] for r in got[name])
                graph = time_cuda_graph([fn] * 4)
                call = time_cuda(lambda i: fn())
                print(f"{N}x{C}x{H}x{W} {name}: device {total:.4f} ms/call, graph {graph:.4f}, call {call:.4f}; "
                      + "; ".join(f"{k} {v:.4f}" for k, v in kernels.items()))


if __name__ == "__main__":
    main()
