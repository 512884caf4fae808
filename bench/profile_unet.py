"""Where one UNet step spends its GPU time, kernel by kernel, for each backend in one run:
    python bench/profile_unet.py --preset svd --backends inductor vdcompile [--top 30]
Prints the top kernels by total device time and, per backend, the ATen copy ops (with their input
shapes) that run outside compiled code: the layout copies a custom op or a graph break costs.
"""
from __future__ import annotations

import argparse
from collections import defaultdict

import torch

import vdcompile  # noqa: F401
from vdcompile.models import build_unet, get_preset, unet_inputs, vae_scale_factor_of
from vdcompile.profiler import op_family


def profile(fn, iters: int):
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts, record_shapes=True) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    return prof


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="svd")
    ap.add_argument("--backends", nargs="+", default=["inductor", "vdcompile"])
    ap.add_argument("--frames", type=int)
    ap.add_argument("--height", type=int)
    ap.add_argument("--width", type=int)
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--iters", type=int, default=2)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--no-cfg", action="store_true", help="UNet batch = --batch (no CFG doubling)")
    args = ap.parse_args()
    preset = get_preset(args.preset)
    dev, dtype = torch.device("cuda"), torch.bfloat16
    unet = build_unet(preset, dtype=dtype, device=dev).eval()
    inputs = unet_inputs(unet, batch=args.batch, cfg=not args.no_cfg, frames=args.frames or preset.frames,
                         height=args.height or preset.height, width=args.width or preset.width,
                         vae_scale_factor=vae_scale_factor_of(preset), dtype=dtype, device=dev)
    for backend in args.backends:
        torch._dynamo.reset()
        fn = vdcompile.vdcompile_backend if backend == "vdcompile" else backend  # also without the entry point
        model = unet if backend == "eager" else torch.compile(unet, backend=fn)
        with torch.inference_mode():
            for _ in range(2):
                model(**inputs)
            torch.cuda.synchronize()
            prof = profile(lambda: model(**inputs), args.iters)
        kernels = defaultdict(lambda: [0.0, 0])
        for ev in prof.events():
            if ev.device_type == torch.autograd.DeviceType.CUDA:
                k = kernels[ev.name[:110]]
                k[0] += ev.device_time / 1000 / args.iters
                k[1] += 1
        total = sum(v[0] for v in kernels.values())
        print(f"\n=== {backend}: {total:.2f} ms of kernels per step, {sum(v[1] for v in kernels.values()) // args.iters}"
              f" launches ===")
        fams = defaultdict(lambda: [0.0, 0])
        for name, (ms, n) in kernels.items():
            f = fams["triton (inductor)" if name.startswith("triton") else op_family(name)]
            f[0] += ms
            f[1] += n // args.iters
        print("by family: " + ", ".join(f"{k} {v[0]:.2f} ms ({v[1]})" for k, v in
                                         sorted(fams.items(), key=lambda kv: -kv[1][0])))
        for name, (ms, n) in sorted(kernels.items(), key=lambda kv: -kv[1][0])[:args.top]:
            print(f"{ms:8.3f} ms {n // args.iters:5d}x  {name}")
        print(f"--- {backend}: ATen copies (device ms per step, by input shape) ---")
        for e in sorted(prof.key_averages(group_by_input_shape=True), key=lambda e: -e.device_time_total):
            if e.key in ("aten::copy_", "aten::clone", "aten::contiguous", "aten::_to_copy", "aten::cat",
                         "aten::fill_", "aten::zero_") and e.device_time_total > 0:
                print(f"{e.device_time_total / 1000 / args.iters:8.3f} ms {e.count // args.iters:4d}x "
                      f"{e.key} {str(e.input_shapes)[:150]}")


if __name__ == "__main__":
    main()
