"""Attention benchmark on video-diffusion shapes: every SDPA backend, the naive matmul-softmax-matmul,
SageAttention (when installed) and vd.fused_attention / vd.strided_attention, side by side in one run.

    python bench/attention.py [--dtype bf16] [--quick] [--backward]

Prints ms, TFLOP/s, GB/s and the ratio to the default SDPA per shape, and writes JSON under bench/results/.
"""
from __future__ import annotations

import argparse
import math
import sys
import os

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import env_var, environment, measure_ceilings, print_table, rotation_sets, time_cuda, write_json  # noqa: E402

import vdcompile  # noqa: E402,F401

# (name, B, H, L, D): SVD at 576x1024, 14 frames, batch 2 (CFG); DiT-style long d128.
SHAPES = [
    ("spatial-9216", 28, 5, 9216, 64),
    ("spatial-2304", 28, 10, 2304, 64),
    ("spatial-576", 28, 20, 576, 64),
    ("temporal-14a", 18432, 5, 14, 64),
    ("temporal-14b", 4608, 10, 14, 64),
    ("temporal-14c", 1152, 20, 14, 64),
    ("temporal-25", 18432, 5, 25, 64),
    ("dit-8192-d128", 4, 16, 8192, 128),
]
QUICK = {"spatial-2304", "temporal-14a", "dit-8192-d128"}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def naive(q, k, v, scale):
    return torch.softmax((q @ k.transpose(-1, -2)) * scale, dim=-1) @ v


def sdpa_with(backend):
    from torch.nn.attention import sdpa_kernel

    def run(q, k, v, scale):
        with sdpa_kernel([backend]):
            return F.scaled_dot_product_attention(q, k, v, scale=scale)
    return run


def peers():
    from torch.nn.attention import SDPBackend
    fns = {
        "sdpa_default": lambda q, k, v, s: F.scaled_dot_product_attention(q, k, v, scale=s),
        "cudnn": sdpa_with(SDPBackend.CUDNN_ATTENTION),
        "flash": sdpa_with(SDPBackend.FLASH_ATTENTION),
        "efficient": sdpa_with(SDPBackend.EFFICIENT_ATTENTION),
        "naive": naive,
    }
    try:
        from sageattention import sageattn
        fns["sage"] = lambda q, k, v, s: sageattn(q, k, v, tensor_layout="HND", is_causal=False, sm_scale=s)
    except Exception:  # not installed, or no kernel for this GPU
        pass
    fns["vd"] = lambda q, k, v, s: torch.ops.vd.fused_attention(q, k, v, None, s)[0]
    fns["vd_mma"] = with_env("VD_ATTENTION_KERNEL", "mma", fns["vd"])  # the mma.sync kernel, also on Hopper
    return fns


def with_env(key, value, fn):
    """fn with the environment variable key set to value during each call (the op reads it per call)."""
    def run(*args):
        with env_var(key, value):
            return fn(*args)
    return run


def check_close(fn, q, k, v, scale, ref):
    out = fn(q, k, v, scale)
    return ((out.float() - ref).abs().max() / (ref.abs().max() + 1e-6)).item()


def bench_forward(shapes, dtype, dev, budget_bytes):
    rows = []
    fns = peers()
    for name, B, H, L, D in shapes:
        scale = 1 / math.sqrt(D)
        per = 4 * B * H * L * D * torch.finfo(dtype).bits // 8
        n_sets = min(rotation_sets(per, dev), max(1, budget_bytes // per))
        sets = [[torch.randn(B, H, L, D, device=dev, dtype=dtype) for _ in range(3)] for _ in range(n_sets)]
        flops = 4 * B * H * L * L * D
        # Reference on a slice, in float32 math, to report each path's error.
        q0, k0, v0 = (t[:2] for t in sets[0])
        ref = naive(q0.float(), k0.float(), v0.float(), scale)
        row = {"shape": name, "B": B, "H": H, "L": L, "D": D, "bytes": per, "flops": flops}
        for pname, fn in fns.items():
            if pname == "naive" and B * H * L * L * 4 > 8 * 2**30:
                continue  # the score matrix alone would not fit
            try:
                err = check_close(fn, q0, k0, v0, scale, ref)
                ms = time_cuda(lambda i: fn(*sets[i], scale), n_sets=n_sets)
            except Exception as e:  # a backend without a kernel for this shape/dtype
                row[f"{pname}_error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"
                continue
            row[f"{pname}_ms"] = ms
            row[f"{pname}_relerr"] = err
        base = row.get("sdpa_default_ms")
        for pname in fns:
            ms = row.get(f"{pname}_ms")
            if ms:
                row[f"{pname}_tflops"] = flops / ms / 1e9
                row[f"{pname}_gbps"] = per / ms / 1e6
                if base:
                    row[f"{pname}_x_default"] = base / ms
                if row.get("cudnn_ms"):
                    row[f"{pname}_x_cudnn"] = row["cudnn_ms"] / ms
                if row.get("naive_ms"):
                    row[f"{pname}_x_naive"] = row["naive_ms"] / ms
        rows.append(row)
        del sets
        torch.cuda.empty_cache()
    return rows


def bench_backward(shapes, dtype, dev):
    rows = []
    for name, B, H, L, D in shapes:
        if L < 512:
            continue
        scale = 1 / math.sqrt(D)
        q, k, v = (torch.randn(B, H, L, D, device=dev, dtype=dtype, requires_grad=True) for _ in range(3))
        go = torch.randn(B, H, L, D, device=dev, dtype=dtype)
        row = {"shape": name}
        out_sdpa = F.scaled_dot_product_attention(q, k, v, scale=scale)
        row["sdpa_bwd_ms"] = time_cuda(lambda i: torch.autograd.grad(out_sdpa, (q, k, v), go, retain_graph=True))
        out_vd = torch.ops.vd.fused_attention(q, k, v, None, scale)[0]
        row["vd_bwd_ms"] = time_cuda(lambda i: torch.autograd.grad(out_vd, (q, k, v), go, retain_graph=True))
        row["vd_bwd_x_sdpa"] = row["sdpa_bwd_ms"] / row["vd_bwd_ms"]
        rows.append(row)
        del q, k, v, go, out_sdpa, out_vd
        torch.cuda.empty_cache()
    return rows


def bench_strided(dtype, dev):
    """vd.strided_attention vs the naive strided reference, and vs our dense kernel on the kept keys."""
    rows = []
    for B, H, L, D, stride in [(28, 10, 2304, 64, 2), (28, 5, 9216, 64, 4), (8, 16, 4096, 64, 2)]:
        scale = 1 / math.sqrt(D)
        q, k, v = (torch.randn(B, H, L, D, device=dev, dtype=dtype) for _ in range(3))

        def naive_strided(i):
            s = (q @ k.transpose(-1, -2)) * scale
            keep = (torch.arange(L, device=dev) % stride) == 0
            s = s.masked_fill(~keep, float("-inf"))
            return torch.softmax(s, -1) @ v

        ks, vs = k[:, :, ::stride].contiguous(), v[:, :, ::stride].contiguous()
        row = {"shape": f"{B}x{H}x{L}x{D}/s{stride}"}
        row["naive_ms"] = time_cuda(naive_strided, iters=10)
        row["vd_strided_ms"] = time_cuda(lambda i: torch.ops.vd.strided_attention(q, k, v, stride, scale))
        row["vd_dense_kept_ms"] = time_cuda(lambda i: torch.ops.vd.fused_attention(q, ks, vs, None, scale))
        row["x_naive"] = row["naive_ms"] / row["vd_strided_ms"]
        row["strided_over_dense"] = row["vd_strided_ms"] / row["vd_dense_kept_ms"]
        rows.append(row)
        del q, k, v, ks, vs
        torch.cuda.empty_cache()
    return rows


def main():
    p = argparse.ArgumentParser(description="attention benchmark")
    p.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    p.add_argument("--quick", action="store_true", help="three representative shapes")
    p.add_argument("--backward", action="store_true")
    p.add_argument("--strided", action="store_true")
    p.add_argument("--no-ceilings", action="store_true")
    p.add_argument("--shapes", default="", help="comma-separated name prefixes, e.g. temporal,spatial-2304")
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench/attention.py needs a CUDA device")
    dev = torch.device("cuda")
    dtype = DTYPES[args.dtype]
    shapes = [s for s in SHAPES if not args.quick or s[0] in QUICK]
    if args.shapes:
        shapes = [s for s in shapes if any(s[0].startswith(pre) for pre in args.shapes.split(","))]
    env = environment(dev)
    ceilings = {} if args.no_ceilings else measure_ceilings(dev)
    print(env, ceilings)
    fwd = bench_forward(shapes, dtype, dev, budget_bytes=8 * 2**30)
    if ceilings.get("copy_GBps"):
        for row in fwd:
            if row.get("vd_gbps"):
                row["vd_pct_copy"] = 100 * row["vd_gbps"] / ceilings["copy_GBps"]
    cols = [("shape", "shape", "")]
    for pname in ["sdpa_default", "cudnn", "flash", "efficient", "naive", "sage", "vd_mma", "vd"]:
        cols.append((f"{pname}_ms", f"{pname} ms", ".3f"))
    cols += [("vd_tflops", "vd TFLOP/s", ".0f"), ("vd_x_cudnn", "vd x cudnn", ".2f"), ("vd_gbps", "vd GB/s", ".0f"),
             ("vd_pct_copy", "vd % copy", ".0f"),
             ("vd_x_default", "vd x default", ".2f"), ("vd_x_naive", "vd x naive", ".2f")]
    print_table(fwd, cols)
    # float32 peers (naive's matmuls, SDPA) run in full float32 unless TF32 is switched on: record which.
    payload = {"environment": env, "ceilings": ceilings, "dtype": args.dtype, "forward": fwd,
               "tf32_matmul": torch.backends.cuda.matmul.allow_tf32}
    if args.backward:
        bwd = bench_backward(shapes, dtype, dev)
        print_table(bwd, [("shape", "shape", ""), ("sdpa_bwd_ms", "sdpa bwd ms", ".3f"),
                          ("vd_bwd_ms", "vd bwd ms", ".3f"), ("vd_bwd_x_sdpa", "vd x sdpa", ".2f")])
        payload["backward"] = bwd
    if args.strided:
        st = bench_strided(dtype, dev)
        print_table(st, [("shape", "shape", ""), ("naive_ms", "naive ms", ".3f"), ("vd_strided_ms", "vd strided", ".3f"),
                         ("vd_dense_kept_ms", "vd dense kept", ".3f"), ("x_naive", "x naive", ".1f"),
                         ("strided_over_dense", "strided/dense", ".2f")])
        payload["strided"] = st
    print("wrote", write_json(f"attention_{args.dtype}", payload))


if __name__ == "__main__":
    main()
