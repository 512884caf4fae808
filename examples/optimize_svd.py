"""Compile a Stable Video Diffusion pipeline with vdcompile.optimize and compare it with the
uncompiled one: same seed, same frames (within rounding), time per video before and after.

    python examples/optimize_svd.py                       # tiny random-weight pipeline on the CPU
    python examples/optimize_svd.py --inner-compiler eager  # rewrites only: compiles in seconds
    python examples/optimize_svd.py --preset small --backend inductor
    python examples/optimize_svd.py --model /path/to/stable-video-diffusion-img2vid --device cuda \\
        --frames 14 --height 576 --width 1024 --steps 25 --dtype fp16 --cuda-graphs

Random-weight pipelines produce noise-like videos: the point is the speed and the agreement.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
import warnings

import numpy as np
import torch

from vdcompile import models
from vdcompile.optimize import optimize
from vdcompile.runner import run_video, save_video


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="tiny", choices=sorted(models.PRESETS))
    p.add_argument("--model", help="local diffusers StableVideoDiffusionPipeline directory")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="fp32")
    p.add_argument("--frames", type=int)
    p.add_argument("--height", type=int)
    p.add_argument("--width", type=int)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--backend", default="vdcompile", help="vdcompile (default) or any torch.compile backend")
    p.add_argument("--inner-compiler", choices=["inductor", "aot_eager", "eager"],
                   help="vdcompile backend: compiler after the rewrites (aot_eager/eager compile fast on a CPU)")
    p.add_argument("--cuda-graphs", action="store_true")
    p.add_argument("--out", default="vdcompile-out")
    args = p.parse_args()
    try:
        device = models.resolve_device(args.device)
        dtype = models.resolve_dtype(args.dtype, device)
        if args.model:
            from vdcompile.cli import _load_pipeline

            pipe = _load_pipeline(args.model, dtype, device)
            frames, height, width = args.frames or 14, args.height or 576, args.width or 1024
        else:
            preset = models.get_preset(args.preset)
            pipe = models.build_svd_pipeline(preset, dtype=dtype, device=device)
            frames = args.frames or preset.frames
            height, width = args.height or preset.height, args.width or preset.width
    except models.UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    kw = dict(num_frames=frames, height=height, width=width, steps=args.steps, seed=0)

    ref = run_video(pipe, **kw)
    print("uncompiled:           ", ref.summary())

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opts = {"inner_compiler": args.inner_compiler} if args.inner_compiler else None
        optimize(pipe, backend=args.backend, cuda_graphs=args.cuda_graphs, options=opts)
    for w in caught:
        print("note:", w.message)
    print("optimize:", pipe.vdcompile_info)

    t = time.perf_counter()
    run_video(pipe, **kw)  # compiles
    print(f"first optimized run:   {time.perf_counter() - t:.1f} s (includes compiling)")
    out = run_video(pipe, **kw)
    print("optimized:            ", out.summary())
    print(f"speed-up: {ref.total_s / out.total_s:.2f}x")

    a = np.stack([np.asarray(f, dtype=np.int16) for f in ref.frames])
    b = np.stack([np.asarray(f, dtype=np.int16) for f in out.frames])
    diff = int(np.abs(a - b).max())
    print(f"max pixel difference (0-255): {diff}")
    path = save_video(out.frames, os.path.join(args.out, "optimize_svd.gif"), fps=7)
    print("wrote", path)
    return 0 if diff <= 2 else 1


if __name__ == "__main__":
    sys.exit(main())
