"""Error of Winograd F(2 x 2, 3 x 3) against the direct 3 x 3 convolution, emulated on the CPU, before any kernel:
operands rounded as a tensor-core kernel would round them (bf16 / fp16, or TF32 for float32), products summed in
float64 (the kernels' float32 accumulators add less error than the operands' rounding), transforms in float32.

    python bench/winograd_error.py [--channels 320,1280] [--size 32] [--seed 0]

Per dtype and channel count: relative RMS and max error of each against a float64 convolution of the unrounded
operands, and Winograd's over direct's. x is silu(N(0, 1)) (what a GroupNorm + SiLU hands the convolution), plus a
case with a mean of 4; w is N(0, 1 / (9 C)). JSON goes to bench/results/.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import environment, write_json  # noqa: E402

BT = torch.tensor([[1, 0, -1, 0], [0, 1, 1, 0], [0, -1, 1, 0], [0, 1, 0, -1]], dtype=torch.float32)
G = torch.tensor([[1, 0, 0], [0.5, 0.5, 0.5], [0.5, -0.5, 0.5], [0, 0, 1]], dtype=torch.float32)
AT = torch.tensor([[1, 1, 1, 0], [0, 1, -1, -1]], dtype=torch.float32)


def round_to(t: torch.Tensor, kind: str) -> torch.Tensor:
    """t (float32) as the tensor cores read it, returned in float64."""
    if kind == "tf32":  # 10 mantissa bits, round to nearest (the cached weights are rounded; x is truncated on
        bits = t.view(torch.int32)  # the GPU, a smaller difference than this emulation resolves)
        r = ((bits + 0x1000) & ~0x1FFF).view(torch.float32)
        return r.double()
    return t.to(getattr(torch, kind)).double()


def direct(x, w, kind):
    return F.conv2d(round_to(x, kind), round_to(w, kind), padding=1)


def winograd(x, w, kind):
    n, c, h, wd = x.shape
    k = w.shape[0]
    xp = F.pad(x, (1, 1, 1, 1))
    # 4 x 4 patches with stride 2: (n, c, th, tw, 4, 4)
    d = xp.unfold(2, 4, 2).unfold(3, 4, 2)
    v = round_to(BT @ d @ BT.T, kind)                  # input transform in float32, rounded for the products
    u = round_to(G @ w.float() @ G.T, kind)            # (k, c, 4, 4)
    m = torch.einsum("kcij,ncabij->nkabij", u, v)      # 16 GEMMs over c, summed in float64
    y = AT.double() @ m @ AT.double().T                # output transform: (n, k, th, tw, 2, 2)
    return y.permute(0, 1, 2, 4, 3, 5).reshape(n, k, h, wd)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--channels", default="320,1280")
    p.add_argument("--size", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    torch.manual_seed(args.seed)
    rows = []
    for c in map(int, args.channels.split(",")):
        for mean in (0.0, 4.0):
            x = F.silu(torch.randn(1, c, args.size, args.size)) + mean
            w = torch.randn(c, c, 3, 3) / (9 * c) ** 0.5
            ref = F.conv2d(x.double(), w.double(), padding=1)
            scale = ref.pow(2).mean().sqrt()
            for kind in ("bfloat16", "float16", "tf32"):
                e = {}
                for name, fn in (("direct", direct), ("winograd", winograd)):
                    diff = fn(x, w, kind) - ref
                    e[name] = ((diff.pow(2).mean().sqrt() / scale).item(), (diff.abs().max() / scale).item())
                row = dict(channels=c, x_mean=mean, operands=kind, direct_rel_rms=e["direct"][0],
                           direct_rel_max=e["direct"][1], winograd_rel_rms=e["winograd"][0],
                           winograd_rel_max=e["winograd"][1], rms_ratio=e["winograd"][0] / e["direct"][0])
                rows.append(row)
                print(f"C={c:5d} mean={mean:3.1f} {kind:9s} direct rms {row['direct_rel_rms']:.2e} max "
                      f"{row['direct_rel_max']:.2e} | winograd rms {row['winograd_rel_rms']:.2e} max "
                      f"{row['winograd_rel_max']:.2e} | rms x{row['rms_ratio']:.2f}")
    print("wrote", write_json("winograd_error", {"environment": environment(torch.device("cpu")), "size": args.size,
                                                  "seed": args.seed, "rows": rows}))


if __name__ == "__main__":
    main()
