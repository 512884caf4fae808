"""A small transformer whose self-attention looks at every STRIDE-th token (strided attention, a
cheap way to attend over long video token sequences), run with plain PyTorch and with the
vd::strided_attention op.

    python examples/strided_transformer.py --mode check    # outputs and gradients agree
    python examples/strided_transformer.py --mode bench    # eager vs vd op vs torch.compile backends

The two implementations share their weights: only the attention call differs.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn

import vdcompile  # noqa: F401  (registers torch.ops.vd)
from vdcompile import built_backends


class StridedSelfAttention(nn.Module):
    def __init__(self, dim: int, heads: int, stride: int):
        super().__init__()
        self.heads, self.stride = heads, stride
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.impl = "eager"

    def forward(self, x):
        b, n, d = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        if self.impl == "vd":
            out = torch.ops.vd.strided_attention(q, k, v, self.stride)[0]
        else:  # keys 0, stride, 2*stride, ... : the same math, with the kept keys gathered first
            out = F.scaled_dot_product_attention(q, k[:, :, ::self.stride], v[:, :, ::self.stride])
        return self.proj(out.transpose(1, 2).reshape(b, n, d))


class Block(nn.Module):
    def __init__(self, dim, heads, stride):
        super().__init__()
        self.n1, self.n2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = StridedSelfAttention(dim, heads, stride)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x):
        x = x + self.attn(self.n1(x))
        return x + self.mlp(self.n2(x))


class StridedTransformer(nn.Module):
    def __init__(self, dim=128, heads=4, depth=2, stride=4):
        super().__init__()
        self.blocks = nn.ModuleList(Block(dim, heads, stride) for _ in range(depth))

    def set_impl(self, impl: str) -> "StridedTransformer":
        for b in self.blocks:
            b.attn.impl = impl
        return self

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x


def _time(fn, device, warmup=2, iters=10) -> float:
    """Median ms of fn() (CUDA events on a GPU, perf_counter on the CPU)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            fn()
            e.record()
            torch.cuda.synchronize()
            times.append(s.elapsed_time(e))
        else:
            t = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def check(model, x, dtype) -> bool:
    tol = {torch.float32: 1e-4, torch.bfloat16: 3e-2, torch.float16: 5e-3}[dtype]
    ok = True
    results = {}
    for impl in ("eager", "vd"):
        model.set_impl(impl).zero_grad()
        xi = x.clone().requires_grad_(True)
        out = model(xi)
        out.float().square().mean().backward()
        grads = [xi.grad] + [p.grad for p in model.parameters()]
        results[impl] = (out.detach(), [g.detach().clone() for g in grads])
    (o_e, g_e), (o_v, g_v) = results["eager"], results["vd"]

    def rel(a, b):
        return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-12)).item()

    err_out = rel(o_v, o_e)
    err_grad = max(rel(a, b) for a, b in zip(g_v, g_e))
    for what, err in (("output", err_out), ("gradients (input and every weight)", err_grad)):
        good = err <= tol
        ok &= good
        print(f"{what:<36} max rel err {err:.2e}  {'ok' if good else 'FAIL'} (tolerance {tol:g})")
    return ok


def bench(model, x, device, backward: bool) -> None:
    from vdcompile.optimize import backend_status

    rows = []

    def run(m):
        if backward:
            m(x.requires_grad_(True)).float().sum().backward()
        else:
            with torch.no_grad():
                m(x)

    rows.append(("eager (SDPA on gathered keys)", _time(lambda: run(model.set_impl("eager")), device)))
    rows.append(("vd::strided_attention", _time(lambda: run(model.set_impl("vd")), device)))
    model.set_impl("eager")
    backends = ["inductor"] + (["vdcompile"] if backend_status()[0] else [])
    from torch._dynamo.utils import counters

    for b in backends:
        torch._dynamo.reset()
        before = dict(counters["vdcompile"])
        c = torch.compile(model, backend=b)
        t = time.perf_counter()
        run(c)
        compile_s = time.perf_counter() - t
        rows.append((f"torch.compile {b} (compile {compile_s:.1f} s)", _time(lambda: run(c), device)))
        if b == "vdcompile":
            fired = {k: v - before.get(k, 0) for k, v in counters["vdcompile"].items() if v != before.get(k, 0)}
            print("vdcompile rewrites fired:", ", ".join(f"{k} {v}" for k, v in sorted(fired.items())) or "none")
    base = rows[0][1]
    print(f"{'implementation':<44}{'ms':>10}{'x eager':>9}")
    for name, ms in rows:
        print(f"{name:<44}{ms:>10.3f}{base / ms:>9.2f}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mode", choices=["check", "bench"], default="check")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16", "fp16"])
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--depth", type=int, default=2)
    p.add_argument("--stride", type=int, default=4)
    p.add_argument("--backward", action="store_true", help="bench: time forward + backward")
    args = p.parse_args()

    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("CUDA was asked for but no CUDA device is visible; run with --device cpu", file=sys.stderr)
        return 2
    key = "CUDA" if device.type == "cuda" else "CPU"
    if key not in built_backends("strided_attention"):
        print(f"vd::strided_attention has no {key} kernel in this build; rebuild the extension "
              "(python setup.py build_ext --inplace) from a version that has it", file=sys.stderr)
        return 2
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    if args.dim % args.heads:
        print("--dim must be a multiple of --heads", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    model = StridedTransformer(args.dim, args.heads, args.depth, args.stride).to(device, dtype)
    x = torch.randn(args.batch, args.tokens, args.dim, device=device, dtype=dtype)
    print(f"strided transformer: {args.depth} blocks, dim {args.dim}, {args.heads} heads, stride {args.stride}, "
          f"{args.batch}x{args.tokens} tokens, {args.dtype} on {device}")
    if args.mode == "check":
        return 0 if check(model, x, dtype) else 1
    bench(model, x, device, args.backward)
    return 0


if __name__ == "__main__":
    sys.exit(main())
