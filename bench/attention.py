"""Attention benchmark on video-diffusion shapes: every SDPA backend, the naive matmul-softmax-matmul,
SageAttention (when installed) and vd.fused_attention / vd.strided_attention, side by side in one run.

    python bench/attention.py [--dtype bf16] [--quick] [--backward | --backward-only]

Prints ms, TFLOP/s, GB/s and the ratio to the default SDPA per shape, and writes JSON under bench/results/.
"""
from __future__ import annotations

import argparse
import contextlib
import math
import sys
import os

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (DTYPES, env_var, environment, measure_ceilings, print_table, rotation_sets,  # noqa: E402
                    time_cuda, write_json)

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
    # Inference calls, as the backend's pass makes them where no gradient can flow (and as SDPA itself skips
    # its log-sum-exp then): no lse. vd_lse: with the lse, as a training forward (short shapes only: only the
    # fp16 / bf16 short kernels skip it, the others write it either way).
    fns["vd"] = lambda q, k, v, s: torch.ops.vd.fused_attention(q, k, v, None, s, compute_lse=False)[0]
    fns["vd_lse"] = lambda q, k, v, s: torch.ops.vd.fused_attention(q, k, v, None, s)[0]
    fns["vd_mma"] = with_env("VD_ATTENTION_KERNEL", "mma", fns["vd"])  # the mma.sync kernel, also on Hopper
    # Up to 32 tokens: the cp.async short kernel, which the copy-engine one replaces on Hopper.
    fns["vd_cpasync"] = with_env("VD_ATTENTION_SHORT", "cpasync", fns["vd"])
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
        if L <= 32:
            # The memory-bound shapes' practical floor: an elementwise kernel moving the same bytes (reads q,
            # k, v, writes one output), torch.addcmul.
            outs = [torch.empty_like(st[0]) for st in sets]
            row["traffic_ms"] = time_cuda(lambda i: torch.addcmul(*sets[i], out=outs[i]), n_sets=n_sets)
            del outs
        for pname, fn in fns.items():
            if pname == "naive" and B * H * L * L * 4 > 8 * 2**30:
                continue  # the score matrix alone would not fit
            if pname in ("vd_cpasync", "vd_lse") and L > 32:
                continue
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
                if row.get("traffic_ms"):
                    row[f"{pname}_pct_traffic"] = 100 * row["traffic_ms"] / ms
        rows.append(row)
        del sets
        torch.cuda.empty_cache()
    return rows


def bench_backward(shapes, dtype, dev, rows_max_flops=4e11):
    """dq, dk, dv from one output gradient: every SDPA backend's backward, the naive path's (autograd
    through matmul-softmax-matmul), vd's (default kernels), vd's fused Hopper kernel with each of its
    tiles (VD_ATTENTION_BACKWARD=fused192 / fused128; head_dim <= 64), vd's deterministic Hopper pair
    (VD_ATTENTION_BACKWARD=pair; what torch.use_deterministic_algorithms gets), vd's mma.sync pair
    (VD_ATTENTION_BACKWARD=mma; the default off Hopper) and vd's CUDA-core kernels (VD_ATTENTION_BACKWARD=rows; only up to
    rows_max_flops, they are slow). FLOPs are counted as
    FlashAttention does: five L x L x D products, 2.5x the forward; bytes: q, k, v, dO read, dq, dk,
    dv written (the least a backward moves: out is not needed, delta can come from P and dP)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    rows = []
    backends = {"sdpa_default": None, "cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
                "efficient": SDPBackend.EFFICIENT_ATTENTION}
    for name, B, H, L, D in shapes:
        scale = 1 / math.sqrt(D)
        q, k, v = (torch.randn(B, H, L, D, device=dev, dtype=dtype, requires_grad=True) for _ in range(3))
        go = torch.randn(B, H, L, D, device=dev, dtype=dtype)
        flops = 10 * B * H * L * L * D
        nbytes = 7 * B * H * L * D * torch.finfo(dtype).bits // 8
        row = {"shape": name, "B": B, "H": H, "L": L, "D": D, "flops": flops, "bytes": nbytes}
        # Reference gradients on a slice (float32 naive path) to report each path's error.
        sl = [t[:1].detach().float().requires_grad_() for t in (q, k, v)]
        ref = torch.autograd.grad(naive(*sl, scale), sl, go[:1].float())
        paths = {}
        for pname, backend in backends.items():
            def fwd(q, k, v, backend=backend):
                if backend is None:
                    return F.scaled_dot_product_attention(q, k, v, scale=scale)
                with sdpa_kernel([backend]):
                    return F.scaled_dot_product_attention(q, k, v, scale=scale)
            paths[pname] = (fwd, None)
        if B * H * L * L * 4 * 3 <= 40 * 2**30:  # scores, probabilities and their gradients
            paths["naive"] = (lambda q, k, v: naive(q, k, v, scale), None)
        vd = lambda q, k, v: torch.ops.vd.fused_attention(q, k, v, None, scale)[0]  # noqa: E731
        paths["vd"] = (vd, None)
        if L > 32:  # the short kernel serves every setting up to 32 tokens
            if D <= 64:
                paths["vd_fused192"] = (vd, ("VD_ATTENTION_BACKWARD", "fused192"))
                paths["vd_fused128"] = (vd, ("VD_ATTENTION_BACKWARD", "fused128"))
            paths["vd_pair"] = (vd, ("VD_ATTENTION_BACKWARD", "pair"))
            paths["vd_mma"] = (vd, ("VD_ATTENTION_BACKWARD", "mma"))
        if 4 * B * H * L * L * D <= rows_max_flops:
            paths["vd_rows"] = (vd, ("VD_ATTENTION_BACKWARD", "rows"))
        for pname, (fwd, env) in paths.items():
            ctx = env_var(*env) if env else contextlib.nullcontext()
            try:
                with ctx:
                    sq = [t.detach().requires_grad_() for t in sl]
                    got = torch.autograd.grad(fwd(*(t.to(dtype) for t in sq)), sq, go[:1])
                    err = max(((g.float() - r).abs().max() / (r.abs().max() + 1e-6)).item() for g, r in zip(got, ref))
                    out = fwd(q, k, v)
                    iters = 50 if pname != "vd_rows" else 5
                    ms = time_cuda(lambda i: torch.autograd.grad(out, (q, k, v), go, retain_graph=True), iters=iters,
                                   min_ms=200.0 if pname != "vd_rows" else 0.0)
                del out
            except Exception as e:  # a backend without a kernel for this shape/dtype
                row[f"{pname}_error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"
                continue
            row[f"{pname}_bwd_ms"] = ms
            row[f"{pname}_bwd_relerr"] = err
            row[f"{pname}_bwd_tflops"] = flops / ms / 1e9
            row[f"{pname}_bwd_gbps"] = nbytes / ms / 1e6
        for pname in paths:
            if row.get(f"{pname}_bwd_ms") and row.get("sdpa_default_bwd_ms"):
                row[f"{pname}_bwd_x_default"] = row["sdpa_default_bwd_ms"] / row[f"{pname}_bwd_ms"]
        best = min((row[f"{p}_bwd_ms"] for p in backends if row.get(f"{p}_bwd_ms")), default=None)
        if best and row.get("vd_bwd_ms"):
            row["vd_bwd_x_best_sdpa"] = best / row["vd_bwd_ms"]
        rows.append(row)
        del q, k, v, go
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
    p.add_argument("--backward-only", action="store_true", help="the backward table alone")
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
    fwd = [] if args.backward_only else bench_forward(shapes, dtype, dev, budget_bytes=8 * 2**30)
    if ceilings.get("copy_GBps"):
        for row in fwd:
            if row.get("vd_gbps"):
                row["vd_pct_copy"] = 100 * row["vd_gbps"] / ceilings["copy_GBps"]
    cols = [("shape", "shape", "")]
    for pname in ["sdpa_default", "cudnn", "flash", "efficient", "naive", "sage", "vd_mma", "vd_cpasync", "vd_lse", "vd"]:
        cols.append((f"{pname}_ms", f"{pname} ms", ".3f"))
    cols += [("vd_tflops", "vd TFLOP/s", ".0f"), ("vd_x_cudnn", "vd x cudnn", ".2f"), ("vd_gbps", "vd GB/s", ".0f"),
             ("vd_pct_copy", "vd % copy", ".0f"), ("traffic_ms", "addcmul ms", ".3f"),
             ("vd_pct_traffic", "vd % addcmul", ".0f"),
             ("vd_x_default", "vd x default", ".2f"), ("vd_x_naive", "vd x naive", ".2f")]
    if fwd:
        print_table(fwd, cols)
    # float32 peers (naive's matmuls, SDPA) run in full float32 unless TF32 is switched on: record which.
    payload = {"environment": env, "ceilings": ceilings, "dtype": args.dtype, "forward": fwd,
               "tf32_matmul": torch.backends.cuda.matmul.allow_tf32}
    if args.backward or args.backward_only:
        bwd = bench_backward(shapes, dtype, dev)
        cols = [("shape", "shape", "")]
        for pname in ["sdpa_default", "cudnn", "flash", "efficient", "naive", "vd_rows", "vd_mma", "vd_pair", "vd_fused192", "vd_fused128", "vd"]:
            cols.append((f"{pname}_bwd_ms", f"{pname} ms", ".3f"))
        cols += [("vd_bwd_tflops", "vd TFLOP/s", ".0f"), ("vd_bwd_gbps", "vd GB/s", ".0f"),
                 ("vd_bwd_x_default", "vd x default", ".2f"), ("vd_bwd_x_best_sdpa", "vd x best SDPA", ".2f"),
                 ("vd_bwd_relerr", "vd relerr", ".1e")]
        print_table(bwd, cols)
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
