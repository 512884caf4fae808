"""vd::linear_geglu (GEGLU feed-forward input projection) vs eager and inductor, on the feed-forward
shapes of the SVD UNet (tokens = frames * H * W per level):
    python bench/ff.py [--dtype bf16] [--sweep]
--sweep also times every candidate tile config of the Triton kernel (to choose pick_config's table).
Floor per shape: FLOPs / the measured bf16 matmul rate, and bytes (x, W, out) / copy bandwidth.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.common import environment, measure_ceilings, print_table, time_cuda, write_json  # noqa: E402
from vdcompile.ops import ff  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
# (label, tokens M, dim K, inner N): SVD at 576x1024 with CFG (28 images) and at 256x256 batch 1 (14).
SHAPES = [
    ("svd576 L1", 28 * 9216, 320, 1280),
    ("svd576 L2", 28 * 2304, 640, 2560),
    ("svd576 L3", 28 * 576, 1280, 5120),
    ("svd576 mid", 28 * 144, 1280, 5120),
    ("svd256 L1", 14 * 1024, 320, 1280),
    ("svd256 L2", 14 * 256, 640, 2560),
    ("svd256 L3", 14 * 64, 1280, 5120),
]
SWEEP = [(128, 128, 64, 8, 3), (128, 128, 64, 8, 4), (128, 64, 64, 4, 4), (128, 64, 64, 8, 4),
         (64, 128, 64, 4, 4), (256, 64, 64, 8, 3), (64, 64, 64, 4, 4), (128, 128, 32, 8, 4)]


def unfused(x, w, b):
    h, gate = F.linear(x, w, b).chunk(2, dim=-1)
    return h * F.gelu(gate)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    ap.add_argument("--sweep", action="store_true")
    args = ap.parse_args()
    if not torch.cuda.is_available() or not ff.triton_kernel_available():
        raise SystemExit("bench/ff.py needs a CUDA device and Triton")
    dev, dtype = torch.device("cuda"), DTYPES[args.dtype]
    env, ceil = environment(dev), measure_ceilings(dev)
    print(env, ceil)
    ind = torch.compile(unfused, dynamic=False)
    rows, sweep = [], {}
    for label, M, K, N in SHAPES:
        x = torch.randn(M, K, device=dev, dtype=dtype)
        w = torch.randn(2 * N, K, device=dev, dtype=dtype) / K**0.5
        b = torch.randn(2 * N, device=dev, dtype=dtype) * 0.1
        with torch.no_grad():
            ref = unfused(x.double(), w.double(), b.double())
            out = ff.linear_geglu(x, w, b)
            err = ((out.double() - ref).abs().max() / ref.abs().max()).item()
            eager_err = ((unfused(x, w, b).double() - ref).abs().max() / ref.abs().max()).item()
            e = time_cuda(lambda i: unfused(x, w, b))
            n = time_cuda(lambda i: ind(x, w, b))
            o = time_cuda(lambda i: ff.linear_geglu(x, w, b))
            mm = time_cuda(lambda i: F.linear(x, w, b))  # the unfused chain's GEMM alone
            if args.sweep:
                for cfg in SWEEP:
                    try:
                        t = time_cuda(lambda i: ff._triton_forward(x, w, b, "none", cfg))
                    except Exception as ex:  # a config that does not fit (shared memory, registers)
                        t = None
                        print(f"{label} {cfg}: {type(ex).__name__}: {str(ex)[:100]}")
                    sweep.setdefault(label, {})[str(cfg)] = t
        flops = 2 * M * K * 2 * N
        nbytes = (M * K + 2 * N * K + M * N) * x.element_size()
        floor = max(flops / (ceil["bf16_matmul_TFLOPs"] * 1e9), nbytes / (ceil["copy_GBps"] * 1e6))
        rows.append({"shape": f"{label} {M}x{K}->{N}", "eager_ms": e, "inductor_ms": n, "ours_ms": o,
                     "gemm_ms": mm, "tflops": flops / o / 1e9, "pct_floor": 100 * floor / o,
                     "x_eager": e / o, "x_inductor": n / o, "err": err, "eager_err": eager_err,
                     "config": str(ff.pick_config(M, N, K))})
    cols = [("shape", "shape", ""), ("eager_ms", "eager ms", ".3f"), ("inductor_ms", "inductor ms", ".3f"),
            ("gemm_ms", "GEMM ms", ".3f"), ("ours_ms", "ours ms", ".3f"), ("tflops", "TFLOP/s", ".0f"),
            ("pct_floor", "% floor", ".0f"), ("x_eager", "x eager", ".2f"), ("x_inductor", "x inductor", ".2f"),
            ("err", "rel err", ".1e"), ("eager_err", "eager err", ".1e")]
    print_table(rows, cols)
    if sweep:
        for label, res in sweep.items():
            best = min((v, k) for k, v in res.items() if v is not None)
            print(f"{label}: " + ", ".join(f"{k} {v:.3f}" if v else f"{k} -" for k, v in res.items())
                  + f"  best {best[1]}")
    path = write_json(f"ff_{args.dtype}", {"environment": env, "ceilings": ceil, "dtype": args.dtype,
                                           "rows": rows, "sweep": sweep})
    print("wrote", path)


if __name__ == "__main__":
    main()
