"""Where conv_bn_silu's time goes: device time per kernel of eager conv + BatchNorm + SiLU and of
vd::conv_bn_silu (torch.profiler over 20 calls), with the per-call and CUDA-graph times beside them.

    python bench/conv_breakdown.py
"""
import os
import statistics
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import cuda_kernel_times, time_cuda, time_cuda_graph  # noqa: E402

import vdcompile  # noqa: E402,F401

CALLS = 20


def kernels_per_call(fn):
    """{kernel name: median device ms} and the summed device ms per call."""
    times = cuda_kernel_times(lambda i: fn(), CALLS)
    total = sum(sum(ts) for ts in times.values()) / CALLS / 1e3
    return {k[:60]: statistics.median(ts) / 1e3 for k, ts in times.items()}, total


def main():
    dev, dtype = "cuda", torch.bfloat16
    for N, C, H, W in [(2, 320, 72, 128), (2, 640, 36, 64), (2, 1280, 18, 32), (2, 1280, 9, 16)]:
        x = torch.randn(N, C, H, W, device=dev, dtype=dtype).to(memory_format=torch.channels_last)
        conv = torch.nn.Conv2d(C, C, 3, padding=1).to(dev, dtype).to(memory_format=torch.channels_last)
        bn = torch.nn.BatchNorm2d(C).to(dev, dtype).eval()
        args = (conv.weight, conv.bias, bn.weight, bn.bias, bn.running_mean, bn.running_var, bn.eps,
                [1, 1], [1, 1], [1, 1], 1, True)
        with torch.no_grad():
            runs = (("eager", lambda: F.silu(bn(conv(x)))), ("vd", lambda: torch.ops.vd.conv_bn_silu(x, *args)))
            for name, fn in runs:
                kernels, total = kernels_per_call(fn)
                graph = time_cuda_graph([fn] * 4)
                call = time_cuda(lambda i: fn())
                print(f"{N}x{C}x{H}x{W} {name}: device {total:.4f} ms/call, graph {graph:.4f}, call {call:.4f}; "
                      + "; ".join(f"{k} {v:.4f}" for k, v in kernels.items()))


if __name__ == "__main__":
    main()
