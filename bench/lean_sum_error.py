"""Error of the 16-bit backward's per-channel sum of dz * (x - mean), emulated on the CPU: the earlier form (each
element's x - mean, then the product summed in float32) against the lean form (dz * x summed in float32, then
mean * sum(dz) subtracted once), as version 1's rows kernel orders them: each lane adds its elements one after
another, the warp adds the 32 lanes' sums by xor butterflies, the lean correction comes after the warp's sum.

    python bench/lean_sum_error.py [--dtype fp16] [--per-lane 128] [--trials 400] [--seed 0]

Per (mean, spread) of x (rounded to the dtype; dz is N(0, 1) in float32): the median and largest error of each form
against the float64 sum over the same rounded x, relative to that sum's RMS over the trials. JSON goes to
bench/results/.
"""
from __future__ import annotations

import argparse
import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import environment, print_table, write_json  # noqa: E402

CASES = [(1.0, 3.0), (6.0, 0.5), (50.0, 1.0), (1000.0, 4.0), (1000.0, 1.0)]


def warp_sum(v: np.ndarray) -> np.ndarray:
    """Sum over the last axis (32 lanes) by xor butterflies in float32: every lane ends with lane 0's bits."""
    v = v.copy()
    lanes = np.arange(32)
    for o in (16, 8, 4, 2, 1):
        v = (v + v[..., lanes ^ o]).astype(np.float32)
    return v[..., 0]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", default="fp16", choices=["fp16", "bf16"])
    ap.add_argument("--per-lane", type=int, default=128)
    ap.add_argument("--trials", type=int, default=400)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    tdt = torch.float16 if args.dtype == "fp16" else torch.bfloat16
    rng = np.random.default_rng(args.seed)
    rows = []
    for mean, spread in CASES:
        shape = (args.trials, args.per_lane, 32)
        x = torch.from_numpy(rng.standard_normal(shape) * spread + mean).to(tdt).double().numpy()
        dz = rng.standard_normal(shape).astype(np.float32)
        m = x.mean(axis=(1, 2), keepdims=True)  # the group mean, float64 (the kernels' high + low parts)
        exact = (dz.astype(np.float64) * (x - m)).sum(axis=(1, 2))
        m32 = m.astype(np.float32)
        x32 = x.astype(np.float32)
        old = np.zeros((args.trials, 32), np.float32)
        raw = np.zeros((args.trials, 32), np.float32)
        sdz = np.zeros((args.trials, 32), np.float32)
        for k in range(args.per_lane):  # one element after another, as a lane adds them
            old = (old + dz[:, k] * (x32[:, k] - m32[:, 0])).astype(np.float32)
            raw = (raw + dz[:, k] * x32[:, k]).astype(np.float32)
            sdz = (sdz + dz[:, k]).astype(np.float32)
        old_sum = warp_sum(old)
        lean_sum = (warp_sum(raw) - m32[:, 0, 0] * warp_sum(sdz)).astype(np.float32)
        scale = np.sqrt(np.mean(exact ** 2))  # the sum's typical size (a single trial's can be near zero)
        e_old = np.abs(old_sum - exact) / scale
        e_lean = np.abs(lean_sum - exact) / scale
        rows.append({"mean": mean, "spread": spread, "old_median": float(np.median(e_old)),
                     "lean_median": float(np.median(e_lean)), "old_max": float(e_old.max()),
                     "lean_max": float(e_lean.max())})
    print_table(rows, [("mean", "mean", ".0f"), ("spread", "spread", ".1f"), ("old_median", "earlier, median", ".1e"),
                       ("lean_median", "lean, median", ".1e"), ("old_max", "earlier, max", ".1e"),
                       ("lean_max", "lean, max", ".1e")])
    print(write_json(f"lean_sum_error_{args.dtype}", {"environment": environment(torch.device("cpu")),
                                                       "args": vars(args), "rows": rows}))


if __name__ == "__main__":
    main()
