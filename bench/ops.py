"""Benchmarks of the non-attention vd ops against eager PyTorch and inductor, on video UNet/VAE shapes.

    python bench/ops.py [--ops group_norm_silu,group_norm_silu_backward,scheduler_step,conv_bn_silu,temporal_conv]
                        [--dtype bf16] [--gn-variants]

Per shape: eager, inductor (torch.compile of the same eager code), ours — ms, GB/s or TFLOP/s, % of the
measured ceiling, ratios. JSON goes to bench/results/.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (DTYPES, alternate, device_time_per_call, env_var, environment,  # noqa: E402
                    kernel_time_cuda, measure_ceilings, print_table, rotated, rotation_sets, time_cuda,
                    time_cuda_graph, write_json)

import vdcompile  # noqa: E402,F401


def _elt(dtype):
    return torch.finfo(dtype).bits // 8


def _compiled(fn):
    # Each benchmark row compiles the same Python function for another shape or layout: past dynamo's
    # recompile limit (8) it would silently run eager, so every row starts from a fresh cache.
    torch._dynamo.reset()
    return torch.compile(fn, dynamic=False)


def _row(name, eager_ms, inductor_ms, ours_ms, work, unit, ceiling):
    r = {"shape": name, "eager_ms": eager_ms, "inductor_ms": inductor_ms, "ours_ms": ours_ms}
    if ours_ms:
        r[f"ours_{unit}"] = work / ours_ms / 1e6 if unit == "GBps" else work / ours_ms / 1e9
        if ceiling:
            r["pct_ceiling"] = 100 * r[f"ours_{unit}"] / ceiling
        if eager_ms:
            r["x_eager"] = eager_ms / ours_ms
        if inductor_ms:
            r["x_inductor"] = inductor_ms / ours_ms
    return r


# group_norm_silu's forward kernel families (VD_GROUP_NORM_KERNEL, read by the op on every call):
# "smem" (version 6; version 8 for channels_last), "l2" (version 4; version 5 for channels_last), "onchip"
# (version 3) and "twopass" (version 1), each where it applies.
GN_VARIANTS = ("smem", "l2", "onchip", "twopass")
# The backward's variants beside the default, each an environment setting the op reads on every call.
GN_BWD_VARIANTS = {"twopass": ("VD_GROUP_NORM_BACKWARD", "twopass"),        # version 1
                   "recompute": ("VD_GROUP_NORM_BACKWARD_DZ", "recompute")}  # version 7 evaluating dz twice


def bench_group_norm_silu(dtype, dev, ceil, variants=False):
    # (name, shape, frames): frames > 0 is a frames-major (B, C, F, H, W) view of (B, F, C, H, W) memory,
    # what SVD's temporal res blocks pass (shape is then (B, C, F, H, W)).
    shapes = [("unet-320", (28, 320, 72, 128), 0), ("unet-640", (28, 640, 36, 64), 0),
              ("unet-1280", (28, 1280, 18, 32), 0), ("unet-960", (28, 960, 72, 128), 0),
              ("vae-512", (14, 512, 72, 128), 0), ("vae-256-half", (14, 256, 288, 512), 0),
              ("vae-128-full", (14, 128, 576, 1024), 0),
              ("temporal-320", (2, 320, 14, 72, 128), 14), ("temporal-640", (2, 640, 14, 36, 64), 14),
              ("temporal-1280", (2, 1280, 14, 18, 32), 14), ("unet256-320", (14, 320, 32, 32), 0),
              ("temporal256-320", (1, 320, 14, 32, 32), 14)]
    rows = []
    for cl in (False, True):
        for name, shape, frames in shapes:
            numel = torch.Size(shape).numel()
            per = 2 * numel * _elt(dtype)
            n_sets = rotation_sets(per // 2, dev) if per < 2**30 else 1
            if frames and not cl:
                B, C, F_, H, W = shape
                xs = [torch.randn(B, F_, C, H, W, device=dev, dtype=dtype).transpose(1, 2) for _ in range(n_sets)]
            else:  # channels_last: what the temporal blocks see of channels_last conv outputs is channels_last_3d
                fmt = torch.channels_last_3d if len(shape) == 5 else torch.channels_last
                xs = [torch.randn(shape, device=dev, dtype=dtype) for _ in range(n_sets)]
                xs = [x.to(memory_format=fmt) if cl else x for x in xs]
            C = shape[1]
            w, b = torch.randn(C, device=dev, dtype=dtype), torch.randn(C, device=dev, dtype=dtype)

            def eager(x):
                return F.silu(F.group_norm(x, 32, w, b, 1e-5))
            ind = _compiled(eager)
            e = time_cuda(lambda i: eager(xs[i]), n_sets)
            n = time_cuda(lambda i: ind(xs[i]), n_sets)
            o = time_cuda(lambda i: torch.ops.vd.group_norm_silu(xs[i], 32, w, b, 1e-5, True), n_sets)
            ref = F.silu(F.group_norm(xs[0].float(), 32, w.float(), b.float(), 1e-5))
            err = (torch.ops.vd.group_norm_silu(xs[0], 32, w, b, 1e-5, True).float() - ref).abs().max().item()
            r = _row(name + ("-cl" if cl else ""), e, n, o, per, "GBps", ceil)
            r["max_err"] = err
            # Kernel time alone (the call above includes host dispatch where the kernel is short).
            dev_ms = device_time_per_call(lambda i: torch.ops.vd.group_norm_silu(xs[i], 32, w, b, 1e-5, True), n_sets)
            r["ours_device_ms"] = dev_ms
            if ceil:
                r["device_pct_ceiling"] = 100 * per / dev_ms / 1e6 / ceil
            if variants:
                for v in GN_VARIANTS:
                    with env_var("VD_GROUP_NORM_KERNEL", v):
                        r[f"{v}_ms"] = time_cuda(lambda i: torch.ops.vd.group_norm_silu(xs[i], 32, w, b, 1e-5, True),
                                                 n_sets)
                        r[f"{v}_device_ms"] = device_time_per_call(
                            lambda i: torch.ops.vd.group_norm_silu(xs[i], 32, w, b, 1e-5, True), n_sets)
                        got = torch.ops.vd.group_norm_silu(xs[0], 32, w, b, 1e-5, True).float()
                        r[f"{v}_max_err"] = (got - ref).abs().max().item()
            rows.append(r)
            del xs
            torch.cuda.empty_cache()
    return rows


def bench_group_norm_silu_backward(dtype, dev, ceil, variants=False):
    """The backward alone (dx, dgamma, dbeta from dy), each side through autograd with the graph kept
    (retain_graph): eager F.group_norm + F.silu (native_group_norm_backward with the saved statistics, and
    SiLU's backward on the saved pre-activation), inductor's compiled training graph, and ours, whose
    backward op reads the statistics its forward saved (with --gn-variants also the backward op computing
    them itself, "own_stats"). "% ceiling" counts x and dy read once and dx written once
    (what a kernel holding each group on chip would move); the two-pass floor reads x three times (the
    statistics, the sums, dx) and dy twice."""
    shapes = [("unet-320", (28, 320, 72, 128), 0), ("unet-640", (28, 640, 36, 64), 0),
              ("unet-1280", (28, 1280, 18, 32), 0), ("unet-960", (28, 960, 72, 128), 0),
              ("vae-512", (14, 512, 72, 128), 0), ("temporal-320", (2, 320, 14, 72, 128), 14)]
    rows = []
    for cl in (False, True):
        for name, shape, frames in shapes:
            numel = torch.Size(shape).numel()
            per = 3 * numel * _elt(dtype)
            if frames and not cl:
                B, C, F_, H, W = shape
                x = torch.randn(B, F_, C, H, W, device=dev, dtype=dtype).transpose(1, 2)
            else:
                fmt = torch.channels_last_3d if len(shape) == 5 else torch.channels_last
                x = torch.randn(shape, device=dev, dtype=dtype)
                x = x.to(memory_format=fmt) if cl else x
            C = shape[1]
            x.requires_grad_()
            w = torch.randn(C, device=dev, dtype=dtype, requires_grad=True)
            b = torch.randn(C, device=dev, dtype=dtype, requires_grad=True)
            dy = torch.randn_like(x)

            def eager(x, w, b):
                return F.silu(F.group_norm(x, 32, w, b, 1e-5))

            def ours(x, w, b):
                return torch.ops.vd.group_norm_silu(x, 32, w, b, 1e-5, True)
            ind = _compiled(eager)
            times = {}
            grads = {}
            for key, fn in (("eager", eager), ("inductor", ind), ("ours", ours)):
                y = fn(x, w, b)

                def bwd(i, y=y):
                    return torch.autograd.grad(y, (x, w, b), dy, retain_graph=True)
                grads[key] = bwd(0)
                times[key] = time_cuda(bwd)
                if key == "ours":
                    times["ours_device"] = device_time_per_call(bwd)
                    if variants:
                        times["own_stats_device"] = device_time_per_call(
                            lambda i: torch.ops.vd.group_norm_silu_backward(dy, x.detach(), 32, w.detach(), b.detach(),
                                                                            1e-5, True))
                    for v in GN_BWD_VARIANTS if variants else ():
                        with env_var(*GN_BWD_VARIANTS[v]):
                            times[f"{v}_device"] = device_time_per_call(bwd)
                            times[v] = time_cuda(bwd)
                del y
            r = _row(name + ("-cl" if cl else ""), times["eager"], times["inductor"], times["ours"], per, "GBps", ceil)
            r["ours_device_ms"] = times["ours_device"]
            if variants:
                r["own_stats_device_ms"] = times["own_stats_device"]
            for v in GN_BWD_VARIANTS if variants else ():
                r[f"{v}_device_ms"] = times[f"{v}_device"]
                r[f"{v}_ms"] = times[v]
            if ceil:
                r["device_pct_ceiling"] = 100 * per / times["ours_device"] / 1e6 / ceil
            # Against the eager gradients (both in bf16 arithmetic on the inputs; not a float64 reference).
            r["max_err_dx"] = (grads["ours"][0].float() - grads["eager"][0].float()).abs().max().item()
            rows.append(r)
            del x, dy, grads
            torch.cuda.empty_cache()
    return rows


def bench_scheduler_step(dtype, dev, ceil):
    # Three timings of ours: the kernel's device time (torch.profiler; what "% ceiling" and GB/s use),
    # a step inside a CUDA graph of several steps (device time per step, graph launch gaps included),
    # and a plain call timed with CUDA events (host dispatch included: what x eager compares, since
    # diffusers' eager step is host-bound too). Inputs rotate over sets that together exceed the L2.
    from diffusers import EulerDiscreteScheduler
    from vdcompile import schedulers

    rows = []
    for name, shape in [("svd-latent", (2, 14, 4, 72, 128)), ("large", (8, 25, 4, 128, 128)),
                        ("larger", (16, 25, 4, 128, 128))]:
        sched = EulerDiscreteScheduler(prediction_type="v_prediction", use_karras_sigmas=True,
                                       timestep_spacing="leading", steps_offset=1)
        sched.set_timesteps(25, device=dev)
        per = 4 * torch.Size(shape).numel() * _elt(dtype)  # read model_output, sample; write prev, x0
        n_sets = rotation_sets(per, dev)
        sets = [(torch.randn(shape, device=dev, dtype=dtype), torch.randn(shape, device=dev, dtype=dtype))
                for _ in range(n_sets)]
        t = sched.timesteps[3]

        def eager(i):
            sched._step_index = 3
            return sched.step(sets[i][0], t, sets[i][1], return_dict=False)
        coeffs = schedulers.step_coeffs(sched, 3, device=dev)

        def ours(i):
            return torch.ops.vd.scheduler_step(sets[i][0], sets[i][1], coeffs)
        kernel = kernel_time_cuda(ours, "scheduler_step", n_sets)
        graph = time_cuda_graph([lambda i=i: ours(i) for i in range(n_sets)])
        call = time_cuda(ours, n_sets)
        e = time_cuda(eager, n_sets)
        r = _row(name, e, None, kernel, per, "GBps", ceil)
        r.update(ours_graph_ms=graph, ours_call_ms=call, x_eager=e / call)
        if ceil:
            r["graph_pct_ceiling"] = 100 * per / graph / 1e6 / ceil
        rows.append(r)
    return rows


def bench_conv_bn_silu(dtype, dev, mm_ceil):
    rows = []
    # 2 images, and the 28 of one SVD UNet step (14 frames, classifier-free guidance): a choice tuned on
    # 2 images must not hide a loss at the size the model runs.
    sizes = [(320, 72, 128), (640, 36, 64), (1280, 18, 32), (1280, 9, 16)]
    shapes = [(n, *chw) for n in (2, 28) for chw in sizes]
    for N, C, H, W in shapes:
        x = torch.randn(N, C, H, W, device=dev, dtype=dtype).to(memory_format=torch.channels_last)
        conv = torch.nn.Conv2d(C, C, 3, padding=1).to(dev, dtype).to(memory_format=torch.channels_last)
        bn = torch.nn.BatchNorm2d(C).to(dev, dtype).eval()
        bn.running_mean.normal_()
        bn.running_var.uniform_(0.5, 2)

        def eager(x):
            return F.silu(bn(conv(x)))
        with torch.no_grad():
            import torch._inductor.config as icfg
            with icfg.patch(freezing=True):
                ind = _compiled(eager)
                ind(x)
            args = (conv.weight, conv.bias, bn.weight, bn.bias, bn.running_mean, bn.running_var, bn.eps,
                    [1, 1], [1, 1], [1, 1], 1, True)

            def ours(i=0):
                return torch.ops.vd.conv_bn_silu(x, *args)

            def cudnn(i=0):  # the cuDNN convolution and the bias + SiLU pass (what non-Hopper GPUs run)
                with env_var("VD_CONV_BN_SILU_KERNEL", "cudnn"):
                    return ours()
            d = [t.double() for t in (conv.weight, conv.bias, bn.running_mean, bn.running_var, bn.weight, bn.bias)]
            ref = F.silu(F.batch_norm(F.conv2d(x.double(), d[0], d[1], padding=1), *d[2:], False, 0.0, bn.eps))
            err, err_c = ((f().double() - ref).abs().max().item() for f in (ours, cudnn))
            # Device time (the kernels' time, torch.profiler: bursts of ~4 ms) and the time a call in a CUDA
            # graph (~12 ms of replays a measurement: at 28 images the GPU reaches its power limit there and the
            # clock falls), the variants in turn over rounds whose order rotates (in a
            # fixed order a variant read up to 9 % slower or faster by its place alone), medians, with the SM
            # clock of each. Per call (CUDA events, host dispatch included; eager and the op are host-bound at
            # 2 images): the same rotation.
            fns = {"eager": lambda i=0: eager(x), "inductor": lambda i=0: ind(x), "ours": ours, "cudnn": cudnn}
            g = alternate(fns, dev)
            gg = alternate(fns, dev, how="graph")
            names = list(fns)
            call = {k: [] for k in names}
            for r in range(5):
                for k in rotated(names, r):
                    call[k].append(time_cuda(fns[k], warmup=2, iters=10, min_ms=20))
            (e, n, o, oc), (e_dev, n_dev, o_dev, oc_dev) = (
                [statistics.median(call[k]) for k in names], [g[k]["ms"] for k in names])
        flops = 2 * N * C * C * 9 * H * W
        r = _row(f"{N}x{C}x{H}x{W}", e, n, o, flops, "TFLOPs", mm_ceil)
        r.update(eager_device_ms=e_dev, inductor_device_ms=n_dev, ours_device_ms=o_dev, x_eager_device=e_dev / o_dev,
                 x_inductor_device=n_dev / o_dev, max_err=err, cudnn_ms=oc, cudnn_device_ms=oc_dev,
                 cudnn_max_err=err_c, x_cudnn_device=oc_dev / o_dev, device_rounds=g, graph_rounds=gg)
        for k in names:
            r[f"{k}_graph_ms"] = gg[k]["ms"]
            for key, res in ((f"{k}_mhz", g[k]), (f"{k}_graph_mhz", gg[k])):
                if "sm_mhz" in res:
                    r[key] = res["sm_mhz"]
        if mm_ceil:
            r["device_pct_ceiling"] = 100 * flops / o_dev / 1e9 / mm_ceil
        rows.append(r)
    return rows


def bench_temporal_conv(dtype, dev, ceil):
    """Contiguous (B, C, F, H, W) input, and the frames-major one that diffusers' temporal blocks pass
    (a permuted view of contiguous (B, F, C, H, W)): eager, inductor and ours all get the same tensor."""
    rows = []
    for B, C, F_, H, W in [(2, 320, 14, 72, 128), (2, 640, 14, 36, 64), (2, 1280, 14, 18, 32)]:
        conv = torch.nn.Conv3d(C, C, (3, 1, 1), padding=(1, 0, 0)).to(dev, dtype)
        for layout in ("contiguous", "frames-major"):
            if layout == "frames-major":
                x = torch.randn(B, F_, C, H, W, device=dev, dtype=dtype).transpose(1, 2)
            else:
                x = torch.randn(B, C, F_, H, W, device=dev, dtype=dtype)
            with torch.no_grad():
                ind = _compiled(conv)  # a fresh compile per layout: the strides are baked in
                e = time_cuda(lambda i: conv(x))
                n = time_cuda(lambda i: ind(x))
                ref = F.conv3d(x.float(), conv.weight.float(), conv.bias.float(), padding=(1, 0, 0))

                def ours(i):
                    return torch.ops.vd.temporal_conv(x, conv.weight, conv.bias, 1)
                o = time_cuda(ours)
                err = (ours(0).float() - ref).abs().max().item()
                # The cuBLAS path (what non-Hopper GPUs run), side by side with the default.
                with env_var("VD_TEMPORAL_CONV_KERNEL", "gemm"):
                    og = time_cuda(ours)
                    err_g = (ours(0).float() - ref).abs().max().item()
            # The direct convolution's FLOPs (3 taps a frame), the same count for every variant: float32's Winograd
            # kernel does 2 / 3 of these products, so its "% ceiling" is an effective rate and can pass 100.
            flops = 2 * B * C * C * 3 * F_ * H * W
            r = _row(f"{B}x{C}x{F_}x{H}x{W}" + ("-fm" if layout == "frames-major" else ""), e, n, o, flops,
                     "TFLOPs", ceil)
            r.update(max_err=err, cublas_ms=og, cublas_max_err=err_g, x_cublas=og / o,
                     flops_counted="direct convolution, 3 taps a frame")
            rows.append(r)
    return rows


def main():
    p = argparse.ArgumentParser(description="vd op benchmarks vs eager and inductor")
    p.add_argument("--ops", default="group_norm_silu,group_norm_silu_backward,scheduler_step,conv_bn_silu,temporal_conv")
    p.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    p.add_argument("--gn-variants", action="store_true",
                   help="also time each group_norm_silu forward kernel family on its own, and the backward's variants")
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench/ops.py needs a CUDA device")
    dev = torch.device("cuda")
    dtype = DTYPES[args.dtype]
    env = environment(dev)
    ceil = measure_ceilings(dev)
    print(env, ceil)
    payload = {"environment": env, "ceilings": ceil, "dtype": args.dtype}
    cols = [("shape", "shape", ""), ("eager_ms", "eager ms", ".3f"), ("inductor_ms", "inductor ms", ".3f"),
            ("ours_ms", "ours ms", ".3f"), ("pct_ceiling", "% ceiling", ".0f"), ("x_eager", "x eager", ".2f"),
            ("x_inductor", "x inductor", ".2f"), ("max_err", "max err", ".1e")]
    for op in args.ops.split(","):
        try:
            if op == "group_norm_silu":
                rows = bench_group_norm_silu(dtype, dev, ceil.get("copy_GBps"), args.gn_variants)
            elif op == "group_norm_silu_backward":
                rows = bench_group_norm_silu_backward(dtype, dev, ceil.get("copy_GBps"), args.gn_variants)
            elif op == "scheduler_step":
                rows = bench_scheduler_step(dtype, dev, ceil.get("copy_GBps"))
            elif op in ("conv_bn_silu", "temporal_conv"):
                # float32: TF32 on the tensor cores (cuDNN's switch, on by default), so the TF32 rate
                tf32 = dtype == torch.float32 and torch.backends.cudnn.allow_tf32
                rate = ceil.get("tf32_matmul_TFLOPs" if tf32 else "bf16_matmul_TFLOPs")
                rows = (bench_conv_bn_silu if op == "conv_bn_silu" else bench_temporal_conv)(dtype, dev, rate)
            else:
                raise SystemExit(f"unknown op {op!r}")
        except Exception as e:  # keep the other ops' numbers if one op fails
            print(f"{op}: FAILED {type(e).__name__}: {e}")
            payload[op] = {"error": f"{type(e).__name__}: {e}"}
            continue
        print(f"\n{op} ({args.dtype})")
        print_table(rows, cols)
        if op == "scheduler_step":  # ours ms above is the kernel's device time
            print_table(rows, [("shape", "shape", ""), ("ours_graph_ms", "graph ms/step", ".4f"),
                               ("graph_pct_ceiling", "graph % ceil", ".0f"), ("ours_call_ms", "call ms", ".4f")])
        if op in ("group_norm_silu", "group_norm_silu_backward"):
            print_table(rows, [("shape", "shape", ""), ("ours_device_ms", "ours device ms", ".4f"),
                               ("device_pct_ceiling", "device % ceil", ".0f")])
        if op == "group_norm_silu_backward" and args.gn_variants:
            print_table(rows, [("shape", "shape", "")] + [(f"{v}_ms", f"{v} ms", ".3f") for v in GN_BWD_VARIANTS]
                        + [(f"{v}_device_ms", f"{v} dev ms", ".4f") for v in GN_BWD_VARIANTS])
        if op == "group_norm_silu" and args.gn_variants:
            print_table(rows, [("shape", "shape", "")] + [(f"{v}_ms", f"{v} ms", ".3f") for v in GN_VARIANTS]
                        + [(f"{v}_device_ms", f"{v} dev ms", ".4f") for v in GN_VARIANTS]
                        + [(f"{v}_max_err", f"{v} err", ".1e") for v in GN_VARIANTS])
        if op == "conv_bn_silu":
            print_table(rows, [("shape", "shape", ""), ("eager_device_ms", "eager device ms", ".4f"),
                               ("inductor_device_ms", "inductor device ms", ".4f"),
                               ("ours_device_ms", "ours device ms", ".4f"),
                               ("device_pct_ceiling", "device % ceil", ".0f"),
                               ("x_eager_device", "x eager (device)", ".2f"),
                               ("x_inductor_device", "x inductor (device)", ".2f"), ("max_err", "err", ".1e"),
                               ("cudnn_device_ms", "vd cuDNN device ms", ".4f"), ("cudnn_max_err", "cuDNN err", ".1e"),
                               ("x_cudnn_device", "x cuDNN (device)", ".2f")])
            print_table(rows, [("shape", "shape", "")] + [(f"{k}_mhz", f"{k} SM MHz", ".0f")
                                                           for k in ("eager", "inductor", "ours", "cudnn")]
                        + [(f"{k}_graph_ms", f"{k} graph ms", ".4f") for k in ("eager", "inductor", "ours", "cudnn")])
        if op == "temporal_conv":
            print_table(rows, [("shape", "shape", ""), ("cublas_ms", "vd cuBLAS ms", ".3f"),
                               ("cublas_max_err", "cuBLAS err", ".1e"), ("x_cublas", "x cuBLAS", ".2f")])
        payload[op] = rows
    print("wrote", write_json(f"ops_{args.dtype}", payload))


if __name__ == "__main__":
    main()
