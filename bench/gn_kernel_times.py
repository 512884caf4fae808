"""Device µs of each CUDA kernel of group_norm_silu's forward, per call, under kernel switches (environment settings
the op reads on every call), and whether each variant's output is the same bits as the first variant's.

    python bench/gn_kernel_times.py "SHAPE:LAYOUT:DTYPE;..." ["VARIANT;VARIANT;..."]

SHAPE as 28x960x72x128; LAYOUT nchw, cl (channels_last), cl3 (channels_last_3d) or fm (frames-major: (B, C, F, H, W)
views of (B, F, C, H, W) memory); DTYPE bf16, fp16 or fp32. A variant is NAME=VALUE[,NAME=VALUE...]; the empty
variant (the default) is the op as built: "" or a leading ";" lists it first. Three rounds alternate the variants;
each kernel's time is the median of the rounds (torch.profiler over 20 calls a round, inputs rotated). Shows where
a two-pass call spends its time (statistics, finalize, apply), which bench/gn_env_ab.py sums. JSON goes to
bench/results/.
"""
from __future__ import annotations

import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import DTYPES, cuda_kernel_times, env_vars, environment, rotation_sets, write_json  # noqa: E402
from gn_env_ab import kernel_name  # noqa: E402

import vdcompile  # noqa: E402,F401

ITERS = 20


def inputs(shape, layout, dtype, dev):
    if layout == "fm":
        B, C, F, H, W = shape
        return [torch.randn(B, F, C, H, W, device=dev, dtype=dtype).transpose(1, 2) for _ in range(4)]
    fmt = {"cl": torch.channels_last, "cl3": torch.channels_last_3d, "nchw": torch.contiguous_format}[layout]
    n = rotation_sets(torch.Size(shape).numel() * dtype.itemsize, dev)
    return [torch.randn(shape, device=dev, dtype=dtype).contiguous(memory_format=fmt) for _ in range(max(n, 2))]


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if not argv:
        raise SystemExit(__doc__)
    dev = torch.device("cuda")
    cases = [c.split(":") for c in argv[0].split(";")]
    variants = argv[1].split(";") if len(argv) > 1 else [""]
    rows = []
    for spec, layout, dname in cases:
        shape = tuple(int(v) for v in spec.split("x"))
        dtype = DTYPES[dname]
        xs = inputs(shape, layout, dtype, dev)
        C = shape[1]
        w, b = torch.randn(C, device=dev, dtype=dtype), torch.randn(C, device=dev, dtype=dtype)

        def call(i):
            return torch.ops.vd.group_norm_silu(xs[i % len(xs)], 32, w, b, 1e-5, True)

        first = None
        times: dict[str, dict[str, list[float]]] = {}
        same: dict[str, bool] = {}
        for _ in range(3):
            for v in variants:
                with env_vars(v):
                    t = cuda_kernel_times(call, iters=ITERS)
                    out = call(0)
                if first is None:
                    first = out.clone()
                same[v] = same.get(v, True) and torch.equal(out, first)
                for k, ts in t.items():
                    times.setdefault(v, {}).setdefault(kernel_name(k), []).append(sum(ts) / ITERS)
        for v in variants:
            kernels = {k: statistics.median(ts) for k, ts in times[v].items()}
            total = sum(kernels.values())
            listed = "; ".join(f"{k} {us:.1f}" for k, us in sorted(kernels.items(), key=lambda kv: -kv[1]))
            print(f"{dname} {layout} {shape} [{v or 'default'}] total {total:.1f} us same={same[v]} :: {listed}",
                  flush=True)
            rows.append({"shape": list(shape), "layout": layout, "dtype": dname, "variant": v or "default",
                         "total_us": total, "kernels_us": kernels, "same_bits_as_first": same[v]})
    path = write_json("gn_kernel_times", {"environment": environment(dev), "cases": argv[0], "rows": rows})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
