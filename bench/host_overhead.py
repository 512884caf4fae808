"""Host time of one call of vd::group_norm_silu against eager's ops, on the short rows where the call, not the
kernel, sets the time (ops.py's unet256 / temporal256 rows): microseconds a call back to back (one synchronize at
the end; the host's time a call wherever it outlasts the kernel), the same calls timed one at a time with events (as
ops.py times "a call"; once on one input, once exactly as ops.py, inputs rotated over sets larger than the L2 and the
op through its overload packet), and the profiler's CPU breakdown of our call.
    python bench/host_overhead.py [--dtype bf16] [--iters 2000]

--backward: the backward through autograd (torch.autograd.grad on a kept graph, as ops.py and gn_env_ab.py time "a
call"), ours against eager on the UNet rows whose backward kernel is shorter than a call's host time, beside the
backward op called alone and autograd.grad through x * 2 on 64 floats (the engine's own cost a call); at most 500
calls a batch (eager's backward is device-bound there).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import DTYPES, environment, print_table, rotation_sets, time_cuda, write_json  # noqa: E402

import vdcompile  # noqa: E402,F401  (registers torch.ops.vd)

SHAPES = [("unet256-320", (14, 320, 32, 32), 0), ("temporal256-320", (1, 320, 14, 32, 32), 14)]


def host_us(fn, iters):
    """Microseconds a call over `iters` back-to-back calls (median of 5 batches)."""
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        out.append((t1 - t0) / iters * 1e6)
    return sorted(out)[2]


def breakdown(fn, top=12):
    """The profiler's CPU self time a call (µs) of the top entries."""
    from torch.profiler import ProfilerActivity, profile
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    n = 200
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
    rows = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:top]
    return [{"name": e.key, "self_us": e.self_cpu_time_total / n, "total_us": e.cpu_time_total / n,
             "calls": e.count / n} for e in rows]


BACKWARD_SHAPES = [("unet-640", (28, 640, 36, 64), False), ("unet-1280", (28, 1280, 18, 32), False),
                   ("unet-1280-cl", (28, 1280, 18, 32), True), ("tiny", (2, 64, 4, 4), False)]


def backward_rows(dtype, dev, iters):
    """Host µs a backward call back to back, ours and eager through autograd, the op alone, and the engine's own."""
    def grad_of(fn, ins, dy):  # autograd.grad on a kept graph: the backward alone a call
        y = fn(*ins)
        return lambda: torch.autograd.grad(y, ins, dy, retain_graph=True)

    t = torch.randn(64, device=dev, requires_grad=True)
    trivial = host_us(grad_of(lambda a: a * 2, (t,), torch.ones_like(t)), iters)
    rows = []
    for name, shape, cl in BACKWARD_SHAPES:
        x = torch.randn(shape, device=dev, dtype=dtype)
        if cl:
            x = x.to(memory_format=torch.channels_last)
        C = shape[1]
        w, b = torch.randn(C, device=dev, dtype=dtype), torch.randn(C, device=dev, dtype=dtype)
        dy = torch.randn_like(x)
        ins = tuple(v.detach().requires_grad_() for v in (x, w, b))
        _, stats = torch.ops.vd.group_norm_silu_forward(x, 32, w, b, 1e-5, True)
        fns = {
            "ours_autograd": grad_of(lambda x, w, b: torch.ops.vd.group_norm_silu(x, 32, w, b, 1e-5, True), ins, dy),
            "eager_autograd": grad_of(lambda x, w, b: F.silu(F.group_norm(x, 32, w, b, 1e-5)), ins, dy),
            "ours_op": lambda: torch.ops.vd.group_norm_silu_backward(dy, x, 32, w, b, 1e-5, True, stats),
        }
        r = {"shape": name}
        for k, fn in fns.items():
            r[k + "_us"] = host_us(fn, iters)
        r["engine_x2_us"] = trivial
        r["x_eager"] = r["eager_autograd_us"] / r["ours_autograd_us"]
        for k in ("ours_autograd", "eager_autograd"):
            r[k + "_events_us"] = 1e3 * time_cuda(lambda i, fn=fns[k]: fn())
        r["x_eager_events"] = r["eager_autograd_events_us"] / r["ours_autograd_events_us"]
        rows.append(r)
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", default="bf16", choices=list(DTYPES))
    ap.add_argument("--iters", type=int, default=2000)
    ap.add_argument("--backward", action="store_true")
    args = ap.parse_args()
    dtype, dev = DTYPES[args.dtype], torch.device("cuda")
    if args.backward:
        rows = backward_rows(dtype, dev, min(args.iters, 500))
        print_table(rows, [("shape", "shape", "")] + [(k, k, ".1f") for k in rows[0] if k != "shape"])
        print(write_json(f"host_overhead_backward_{args.dtype}",
                         {"environment": environment(dev), "dtype": args.dtype, "rows": rows}))
        return
    rows, detail = [], {}
    for cl in (False, True):
        for name, shape, frames in SHAPES:
            if frames and not cl:
                B, C, F_, H, W = shape
                x = torch.randn(B, F_, C, H, W, device=dev, dtype=dtype).transpose(1, 2)
            else:
                x = torch.randn(shape, device=dev, dtype=dtype)
                if cl:
                    x = x.to(memory_format=torch.channels_last_3d if x.dim() == 5 else torch.channels_last)
            C = shape[1]
            w, b = torch.randn(C, device=dev, dtype=dtype), torch.randn(C, device=dev, dtype=dtype)
            op = torch.ops.vd.group_norm_silu.default
            fns = {
                "ours": lambda: op(x, 32, w, b, 1e-5, True),
                "ours_no_affine": lambda: op(x, 32, None, None, 1e-5, True),
                "eager": lambda: F.silu(F.group_norm(x, 32, w, b, 1e-5)),
                "aten_group_norm": lambda: F.group_norm(x, 32, w, b, 1e-5),
                "aten_silu": lambda: F.silu(x),
                "aten_empty_like": lambda: torch.empty_like(x),
            }
            r = {"shape": name + ("-cl" if cl else "")}
            for k, fn in fns.items():
                r[k + "_us"] = host_us(fn, args.iters)
            with torch.inference_mode():
                r["ours_inference_us"] = host_us(fns["ours"], args.iters)
            r["x_eager"] = r["eager_us"] / r["ours_us"]
            # As bench/ops.py times a call: events around each call on its own (the host's time, the launch's
            # latency and the kernel, one call at a time).
            for k in ("ours", "eager"):
                r[k + "_events_us"] = 1e3 * time_cuda(lambda i, fn=fns[k]: fn())
            r["x_eager_events"] = r["eager_events_us"] / r["ours_events_us"]
            # Exactly as ops.py: inputs rotated over sets larger than the L2, the op through its overload packet.
            n_sets = rotation_sets(x.numel() * x.element_size(), dev)
            xs = [x.clone(memory_format=torch.preserve_format) for _ in range(n_sets)]
            r["ours_events_rotated_us"] = 1e3 * time_cuda(
                lambda i: torch.ops.vd.group_norm_silu(xs[i], 32, w, b, 1e-5, True), n_sets)
            r["eager_events_rotated_us"] = 1e3 * time_cuda(
                lambda i: F.silu(F.group_norm(xs[i], 32, w, b, 1e-5)), n_sets)
            r["x_eager_events_rotated"] = r["eager_events_rotated_us"] / r["ours_events_rotated_us"]
            del xs
            rows.append(r)
            detail[r["shape"]] = breakdown(fns["ours"])
    print_table(rows, [("shape", "shape", "")] + [(k, k, ".1f") for k in rows[0] if k != "shape"])
    for k, v in detail.items():
        print(f"\n{k}: CPU self time a call")
        print_table(v, [("name", "name", ""), ("self_us", "self us", ".2f"), ("total_us", "total us", ".2f"),
                        ("calls", "calls", ".1f")])
    path = write_json(f"host_overhead_{args.dtype}",
                      {"environment": environment(dev), "dtype": args.dtype, "rows": rows, "breakdown": detail})
    print(path)


if __name__ == "__main__":
    main()
