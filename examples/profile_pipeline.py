"""Profile a video pipeline: time of each named region (image encoder, VAE encode, UNet forward,
scheduler step, VAE decode), time per op family from torch.profiler, and a bottleneck ranking;
prints a table and writes a PNG chart.

    python examples/profile_pipeline.py                      # tiny random-weight SVD pipeline, CPU
    python examples/profile_pipeline.py --preset small --compile vdcompile
"""
from __future__ import annotations

import argparse
import os
import sys

from vdcompile import models
from vdcompile.profiler import Profiler
from vdcompile.runner import run_video


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="tiny", choices=sorted(models.PRESETS))
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="fp32")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--compile", default="none", help="none, vdcompile or inductor")
    p.add_argument("--out", default="vdcompile-out")
    args = p.parse_args()
    try:
        device = models.resolve_device(args.device)
        dtype = models.resolve_dtype(args.dtype, device)
    except models.UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    preset = models.get_preset(args.preset)
    pipe = models.build_svd_pipeline(preset, dtype=dtype, device=device)
    kw = dict(num_frames=preset.frames, height=preset.height, width=preset.width, steps=args.steps)
    if args.compile != "none":
        from vdcompile.optimize import optimize

        optimize(pipe, backend=args.compile)
        run_video(pipe, **kw)  # compile outside the profiled run

    prof = Profiler(device).instrument(pipe)
    with prof.ops(), prof.wall():
        result = run_video(pipe, **kw)
    prof.remove()
    report = prof.report()
    print(result.summary())
    print(report.table())
    os.makedirs(args.out, exist_ok=True)
    chart = report.save_chart(os.path.join(args.out, "profile_pipeline.png"))
    print("wrote", chart)
    return 0


if __name__ == "__main__":
    sys.exit(main())
