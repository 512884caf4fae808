"""Same-process A/B of group_norm_silu's forward (or --backward) under kernel switches (environment settings the
op reads on every call), beside eager and inductor on the same tensors.

    python bench/gn_env_ab.py --env VD_GROUP_NORM_THREE_CTAS=0 [--env NAME=VALUE[,NAME=VALUE] ...] [--dtype fp32,bf16]
                              [--shapes 14x512x72x128,...] [--nchw | --frames-major] [--rounds 4]
                              [--no-inductor] [--backward]

Per shape and dtype: device µs a call (torch.profiler, inputs rotated over sets larger than the L2) of the op as
built ("default") and under each variant (one or more settings, comma-separated), the median of --rounds rounds
that alternate the variants, and µs a call by events; the CUDA kernel that served each variant; eager and inductor
(events a call) and the ratios (events a call, as bench/ops.py reports them). Input is channels_last unless --nchw, or --frames-major (5-D shapes as
(B, C, F, H, W) views of (B, F, C, H, W) memory). --backward times the backward op alone (dx, dgamma, dbeta from
dy and the statistics the forward saved; eager and inductor: autograd through their graphs, kept); its copy
figure counts x and dy read once, dx written once; the forward runs once, before the rounds, outside the switches
(a switch of the forward alone changes nothing timed there), and the error is dx's. JSON goes to bench/results/.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (DTYPES, device_time_per_call, env_vars, environment, measure_ceilings,  # noqa: E402
                    rotation_sets, time_cuda, write_json)

import vdcompile  # noqa: E402,F401


def kernel_name(name: str) -> str:
    """A profiler's CUDA kernel name without the vd namespace and the argument list."""
    return name.replace("void vd::(anonymous namespace)::", "").split("(")[0]


def served_by(fn) -> str:
    """The CUDA kernels named like "...kernel..." that one call launches, vd namespace dropped, "; "-joined."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    names = sorted({e.name for e in prof.events() if e.device_time > 0 and "kernel" in e.name})
    return "; ".join(kernel_name(n) for n in names)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--env", action="append", default=[],
                   help="NAME=VALUE[,NAME=VALUE...]: a variant beside the default")
    p.add_argument("--dtype", default="fp32")
    p.add_argument("--shapes", default="14x512x72x128")
    p.add_argument("--groups", type=int, default=32)
    p.add_argument("--nchw", action="store_true")
    p.add_argument("--frames-major", action="store_true",
                   help="5-D shapes BxCxFxHxW as frames-major views of (B, F, C, H, W) memory")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--no-inductor", action="store_true")
    p.add_argument("--backward", action="store_true")
    args = p.parse_args(argv)
    dev = torch.device("cuda")
    # (key, settings): the key names the settings too, so two settings of one variable are two variants.
    variants = [("default", "")] + [(e, e) for e in args.env]

    ceil = measure_ceilings(dev)
    rows = []
    for dname in args.dtype.split(","):
        dtype = DTYPES[dname]
        for spec in args.shapes.split(","):
            shape = tuple(int(v) for v in spec.split("x"))
            numel = torch.Size(shape).numel()
            per = (3 if args.backward else 2) * numel * dtype.itemsize  # the copy figure's bytes
            n_sets = rotation_sets(per // 2, dev)
            fmt = torch.channels_last if len(shape) == 4 else torch.channels_last_3d
            if args.frames_major:
                B, C_, F_, H, W = shape
                xs = [(torch.randn(B, F_, C_, H, W, device=dev, dtype=dtype) * 3 + 1).transpose(1, 2)
                      for _ in range(n_sets)]
            else:
                xs = [torch.randn(shape, device=dev, dtype=dtype) * 3 + 1 for _ in range(n_sets)]
            if not args.nchw and not args.frames_major:
                xs = [x.to(memory_format=fmt) for x in xs]
            C, G = shape[1], args.groups
            w, b = torch.randn(C, device=dev, dtype=dtype), torch.randn(C, device=dev, dtype=dtype)

            def eager_x(x, w=w, b=b):
                return F.silu(F.group_norm(x, G, w, b, 1e-5))

            if args.backward:
                dys = [torch.randn_like(x) for x in xs]

                def through(fn):  # autograd through fn's graph, kept: the backward alone a call, dx first
                    ins = [(x.detach().requires_grad_(), w.detach().requires_grad_(), b.detach().requires_grad_())
                           for x in xs]
                    ys = [fn(*a) for a in ins]
                    return lambda i: torch.autograd.grad(ys[i], ins[i], dys[i], retain_graph=True)

                # Ours reads the statistics its forward saved, as in training.
                ours = through(lambda x, w, b: torch.ops.vd.group_norm_silu(x, G, w, b, 1e-5, True))
                eager = through(eager_x)
                xd = xs[0].double().requires_grad_()
                ref = torch.autograd.grad(eager_x(xd, w.double(), b.double()), xd, dys[0].double())[0]
            else:
                def ours(i):
                    return torch.ops.vd.group_norm_silu(xs[i], G, w, b, 1e-5, True)

                def eager(i):
                    return eager_x(xs[i])

                ref = F.silu(F.group_norm(xs[0].double(), G, w.double(), b.double(), 1e-5))
            layout = "frames-major" if args.frames_major else "NCHW" if args.nchw else "channels_last"
            r = {"shape": spec, "dtype": dname, "layout": layout,
                 "pass": "backward" if args.backward else "forward", "eager_ms": time_cuda(eager, n_sets)}
            if not args.no_inductor:
                # Compiled on the tensor, not the set index: dynamo specializes on an int argument, so each index
                # would recompile and past its limit (8) the calls would silently run eager.
                torch._dynamo.reset()
                ind = torch.compile(eager_x, dynamic=False)
                r["inductor_ms"] = time_cuda(through(ind) if args.backward else lambda i: ind(xs[i]), n_sets)
            times = {key: [] for key, _ in variants}
            for _ in range(args.rounds):
                for key, settings in variants:
                    with env_vars(settings):
                        times[key].append(device_time_per_call(ours, n_sets))
            for key, settings in variants:
                ms = statistics.median(times[key])
                with env_vars(settings):
                    kern, out = served_by(lambda: ours(0)), ours(0)
                    out = out[0] if isinstance(out, tuple) else out
                    call_ms = time_cuda(ours, n_sets)  # events a call, as eager and inductor are timed
                err = ((out.double() - ref).norm() / ref.norm()).item()
                r[key] = {"device_ms": ms, "rounds_ms": times[key], "call_ms": call_ms, "kernel": kern,
                          "rel_err": err, "pct_copy": 100 * per / ms / 1e6 / ceil["copy_GBps"],
                          "x_eager": r["eager_ms"] / call_ms}
                if "inductor_ms" in r:
                    r[key]["x_inductor"] = r["inductor_ms"] / call_ms
            rows.append(r)
            del xs, eager, ours, out, ref
            dys = xd = None
            torch.cuda.empty_cache()
    print(f"{'shape':>18} {'dtype':>5} {'variant':>32} {'dev us':>8} {'call us':>8} {'%copy':>6} {'x eager':>8} "
          f"{'x ind':>6} {'rel err':>8}  kernel")
    for r in rows:
        for k, v in r.items():
            if isinstance(v, dict):
                print(f"{r['shape']:>18} {r['dtype']:>5} {k:>32} {1e3 * v['device_ms']:8.1f} {1e3 * v['call_ms']:8.1f} "
                      f"{v['pct_copy']:6.1f} "
                      f"{v['x_eager']:8.2f} {v.get('x_inductor', float('nan')):6.2f} {v['rel_err']:8.1e}  "
                      f"{v['kernel']}")
        print(f"{'':>18} {'':>5} {'eager / inductor (events)':>32} {1e3 * r['eager_ms']:8.1f} "
              f"{1e3 * r.get('inductor_ms', float('nan')):8.1f}")
    path = write_json("gn_env_ab", {"environment": environment(dev), "ceilings": ceil, "variants": args.env,
                                    "backward": args.backward, "rows": rows})
    print("wrote", path)


if __name__ == "__main__":
    main()
