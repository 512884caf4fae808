"""The ``vdcompile`` command line.

    vdcompile bench [--preset tiny|small|svd | --model DIR] [--frames N] [--height H] [--width W]
                    [--batch B] [--dtype fp32|bf16|fp16] [--device auto|cpu|cuda]
                    [--steps S] [--warmup W] [--iters I] [--out DIR]
    vdcompile bench attention|...       kernel benchmarks from the checkout's bench/ directory
    vdcompile explain [--preset ...]    what the vdcompile backend rewrites in a model
    vdcompile generate [--preset ... | --model DIR] [--compile vdcompile|inductor|none]
                                        a whole video pipeline run, profiled, video saved

``bench`` runs eager, inductor and vdcompile side by side in one process on the same UNet and
inputs: each denoising step is one UNet call (batch doubled for classifier-free guidance), the
guidance combine and the scheduler step.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import json
import os
import platform
import resource
import runpy
import statistics
import sys
import time
import warnings
from typing import Any, Callable

DEFAULT_BACKENDS = ("eager", "inductor", "vdcompile")
# Max error of a compiled UNet output against eager, relative to the largest eager output value.
DEFAULT_RTOL = {"float32": 1e-3, "bfloat16": 5e-2, "float16": 1e-2}
TF32_RTOL = 1e-2


def _err(msg: str) -> None:
    print(f"vdcompile: error: {msg}", file=sys.stderr)


def _repo_bench_dir() -> str | None:
    """bench/ of the source checkout this package runs from (kernel benchmarks are not installed)."""
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for root in (os.getcwd(), here):
        d = os.path.join(root, "bench")
        if os.path.isdir(d):
            return d
    return None


def kernel_benchmarks() -> dict[str, str]:
    d = _repo_bench_dir()
    if d is None:
        return {}
    return {f[:-3]: os.path.join(d, f) for f in sorted(os.listdir(d))
            if f.endswith(".py") and f not in ("common.py", "__init__.py") and not f.startswith("_")}


# ---------------------------------------------------------------------------------------------
# Progress: rich, else tqdm, else one line per stage.


class _Progress:
    def __init__(self, total: int, enabled: bool = True):
        self.bar = None
        self.rich = None
        self.enabled = enabled and total > 0
        if not self.enabled:
            return
        try:
            from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

            self.rich = Progress(TextColumn("{task.description:<28}"), BarColumn(), TimeElapsedColumn(),
                                 transient=True, console=None)
            self.rich.start()
            self.task = self.rich.add_task("", total=total)
            return
        except ImportError:
            pass
        try:
            from tqdm import tqdm

            self.bar = tqdm(total=total, file=sys.stderr, leave=False, dynamic_ncols=True,
                            bar_format="{desc:<28} {bar} {n_fmt}/{total_fmt} [{elapsed}]")
        except ImportError:
            pass

    def stage(self, text: str) -> None:
        if not self.enabled:
            return
        if self.rich is not None:
            self.rich.update(self.task, description=text)
        elif self.bar is not None:
            self.bar.set_description_str(text)
        else:
            print(f"  {text} ...", file=sys.stderr, flush=True)

    def advance(self, n: int = 1) -> None:
        if self.rich is not None:
            self.rich.advance(self.task, n)
        elif self.bar is not None:
            self.bar.update(n)

    def close(self) -> None:
        if self.rich is not None:
            self.rich.stop()
        elif self.bar is not None:
            self.bar.close()


# ---------------------------------------------------------------------------------------------
# bench


class _Sync:
    def __init__(self, device):
        import torch

        self.fn = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)

    def __call__(self):
        self.fn()


class DenoiseLoop:
    """The sampling loop of a video pipeline around a UNet: CFG batch, UNet call, guidance, scheduler step."""

    def __init__(self, unet, inputs: dict, steps: int, scheduler_step: Callable | None = None, seed: int = 0,
                 cfg: bool = True):
        import torch

        from vdcompile.models import build_scheduler

        self.svd = type(unet).__name__ == "UNetSpatioTemporalConditionModel"
        self.sched = build_scheduler()
        self.steps = steps
        self.step_fn = scheduler_step
        x = inputs["sample"]
        g = torch.Generator().manual_seed(seed + 1)
        self.cfg = cfg
        b = x.shape[0] // 2 if cfg else x.shape[0]
        if self.svd:  # half the channels are the repeated conditioning-image latents
            c = x.shape[2] // 2
            self.latents0 = torch.randn(b, *x.shape[1:2], c, *x.shape[3:], generator=g).to(x)
            self.cond = x[:, :, c:]
            self.frame_axis = 1
        else:
            self.latents0 = torch.randn(b, *x.shape[1:], generator=g).to(x)
            self.cond = None
            self.frame_axis = 2
        self.kw = {k: v for k, v in inputs.items() if k not in ("sample", "timestep")}
        frames = x.shape[self.frame_axis]
        shape = [1] * x.dim()
        shape[self.frame_axis] = frames
        self.guidance = torch.linspace(1.0, 3.0, frames, device=x.device, dtype=x.dtype).view(shape)

    def run(self, unet) -> Any:
        import torch

        sched = self.sched
        sched.set_timesteps(self.steps, device=self.latents0.device)
        step = self.step_fn or sched.step
        lat = self.latents0 * sched.init_noise_sigma
        for t in sched.timesteps:
            inp = sched.scale_model_input(torch.cat([lat, lat]) if self.cfg else lat, t)
            if self.cond is not None:
                inp = torch.cat([inp, self.cond], dim=2)
            out = unet(inp, t, **self.kw, return_dict=False)[0]
            if self.cfg:
                u, c = out.chunk(2)
                out = u + self.guidance * (c - u)
            lat = step(out, t, lat).prev_sample
        return lat


def _max_rel_err(a, ref) -> float:
    ref64 = ref.double()
    return ((a.double() - ref64).abs().max() / ref64.abs().max().clamp_min(1e-12)).item()


def _rewrite_counters() -> dict[str, int]:
    """Snapshot of the vdcompile backend's rewrite counters (empty when it has none)."""
    try:
        from torch._dynamo.utils import counters
    except ImportError:
        return {}
    return {str(k): int(v) for k, v in counters.get("vdcompile", {}).items()}


def _bench_one(name: str, unet, inputs: dict, ref_out, args, device, progress: _Progress, options: dict,
               fused_step=None) -> dict:
    import functools

    import torch

    from vdcompile.optimize import compile_module

    sync = _Sync(device)
    row: dict[str, Any] = {"backend": name}
    torch._dynamo.reset()  # each row compiles from scratch (inductor's on-disk kernel cache aside)
    before = _rewrite_counters()
    # CUDA graphs (reduce-overhead) for the backends that implement that mode.
    mode = "reduce-overhead" if args.cuda_graphs and name in ("inductor", "vdcompile") else None
    module = unet if name == "eager" else compile_module(
        unet, name, mode=mode, options=options if name == "vdcompile" else None, dynamic=False)
    loop = DenoiseLoop(unet, inputs, args.steps, seed=args.seed, cfg=not args.no_cfg)
    if fused_step is not None:  # bound to the loop's own scheduler, as optimize() does
        loop.step_fn = functools.partial(fused_step, loop.sched)

    progress.stage(f"{name}: compile + check" if name != "eager" else "eager: reference")
    sync()
    t0 = time.perf_counter()
    with torch.no_grad():
        out = module(**inputs, return_dict=False)[0]
    sync()
    first_s = time.perf_counter() - t0
    row["first_call_s"] = first_s
    row["max_rel_err"] = 0.0 if ref_out is None else _max_rel_err(out, ref_out)
    progress.advance()

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    progress.stage(f"{name}: warmup")
    with torch.no_grad():
        for _ in range(args.warmup):
            loop.run(module)
            progress.advance()
        sync()
        progress.stage(f"{name}: timing")
        per_step = []
        lat = None
        for _ in range(args.iters):
            t = time.perf_counter()
            lat = loop.run(module)
            sync()
            per_step.append((time.perf_counter() - t) * 1e3 / args.steps)
            progress.advance()
    row["latents"] = lat
    row["out"] = out if name == "eager" else None  # the reference for the rows after it
    row["ms_per_step"] = statistics.median(per_step)
    row["ms_per_step_min"] = min(per_step)
    row["ms_per_step_all"] = per_step
    # First call = compile + one UNet call; the UNet's share of a step is an upper bound on that call.
    row["compile_s"] = None if name == "eager" else max(0.0, first_s - row["ms_per_step"] / 1e3)
    row["peak_mem_mb"] = torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else None
    after = _rewrite_counters()
    fired = {k: after.get(k, 0) - before.get(k, 0) for k in after if after.get(k, 0) != before.get(k, 0)}
    row["rewrites"] = fired if name == "vdcompile" else None
    return row


def _environment(device) -> dict:
    import torch

    env = {
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else
        (platform.processor() or platform.machine() or "cpu"),
        "cpu_threads": torch.get_num_threads(),
    }
    if device.type == "cuda":
        env["cuda"] = torch.version.cuda
    with contextlib.suppress(Exception):
        import diffusers

        env["diffusers"] = diffusers.__version__
    return env


def _fmt(v, spec: str, none: str = "-") -> str:
    return none if v is None else format(v, spec)


def print_bench_table(rows: list[dict], rtol: float) -> str:
    base = {r["backend"]: r["ms_per_step"] for r in rows if r.get("ms_per_step")}
    eager, ind = base.get("eager"), base.get("inductor")
    hdr = (f"{'backend':<12}{'ms/step':>10}{'x eager':>9}{'x inductor':>11}{'compile s':>11}"
           f"{'peak MB':>9}{'max rel err':>13}  rewrites")
    lines = [hdr, "-" * len(hdr)]
    for r in rows:
        if r.get("error"):
            lines.append(f"{r['backend']:<12}  {r['error']}")
            continue
        ms = r["ms_per_step"]
        rw = r.get("rewrites")
        rw_s = "-" if rw is None else (", ".join(f"{k} {v}" for k, v in sorted(rw.items())) or "none counted")
        lines.append(
            f"{r['backend']:<12}{ms:>10.2f}{_fmt(eager / ms if eager else None, '.2f'):>9}"
            f"{_fmt(ind / ms if ind else None, '.2f'):>11}{_fmt(r.get('compile_s'), '.1f'):>11}"
            f"{_fmt(r.get('peak_mem_mb'), '.0f'):>9}{r['max_rel_err']:>13.2e}  {rw_s}")
    lines.append(f"max rel err: max |out - eager| / max |eager| of one UNet call "
                 f"(and of the final latents); tolerance {rtol:g}")
    lines.append("compile s: first UNet call minus one steady-state step; ms/step: median of the timed runs, "
                 "each step = UNet (CFG batch) + guidance + scheduler step")
    return "\n".join(lines)


def _bench_chart(path: str, rows: list[dict], title: str) -> str | None:
    from vdcompile.profiler import bar_chart

    ok = [r for r in rows if r.get("ms_per_step")]
    eager = next((r["ms_per_step"] for r in ok if r["backend"] == "eager"), None)
    groups = [("ms per denoising step (lower is better)", [(r["backend"], r["ms_per_step"]) for r in ok])]
    if eager:
        groups.append(("speed-up vs eager", [(r["backend"], eager / r["ms_per_step"]) for r in ok]))
    return bar_chart(path, title, groups)


def cmd_bench(args) -> int:
    if args.kernel:
        return _bench_kernel(args.kernel, args.kernel_args)
    import torch

    from vdcompile import models
    from vdcompile.optimize import backend_status, fused_scheduler_step

    if args.steps < 1 or args.iters < 1 or args.warmup < 0:
        raise models.UserError("--steps and --iters must be >= 1 and --warmup >= 0")
    if not args.model and args.preset not in (None, "auto"):
        models.get_preset(args.preset)  # cheap checks before the slow ones
    device = models.resolve_device(args.device)
    dtype = models.resolve_dtype(args.dtype, device)
    preset = None if args.model else models.get_preset(_default_preset(args.preset, device))
    if args.cuda_graphs and device.type != "cuda":
        raise models.UserError("--cuda-graphs needs a CUDA device; drop it or use --device cuda")
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    known = set(torch._dynamo.list_backends(exclude_tags=())) | {"eager", "inductor", "vdcompile", "aot_eager"}
    for b in backends:
        if b not in known:
            raise models.UserError(f"unknown backend {b!r}; choose from: {', '.join(sorted(known))}")
    # eager runs first: the reference every other row is checked against
    backends = ["eager"] + [b for b in dict.fromkeys(backends) if b != "eager"]
    options = {}
    for kv in args.backend_option or []:
        k, sep, v = kv.partition("=")
        if not sep:
            raise models.UserError(f"--backend-option {kv!r}: expected KEY=VALUE")
        if v.lower() in ("true", "false"):  # Python's spelling too: temporal_conv=False
            options[k] = v.lower() == "true"
            continue
        try:  # numbers, lists as JSON; anything else is a string
            options[k] = json.loads(v)
        except ValueError:
            options[k] = v
    try:  # a bad option is one line now, not a failed row after the eager run
        from vdcompile.backend import parse_options

        parse_options(None, options)
    except (ValueError, RuntimeError) as e:
        raise models.UserError(f"--backend-option: {e}") from None

    if args.model:
        what = f"model {args.model}"
        unet = models.load_unet(args.model, dtype=dtype, device=device)
        vsf = models.vae_scale_factor_of_dir(args.model)
        frames = args.frames or getattr(unet.config, "num_frames", None) or 14
        height = args.height or 8 * 64
        width = args.width or 8 * 64
    else:
        what = f"preset {preset.name}"
        vsf = models.vae_scale_factor_of(preset)
        frames, height, width = args.frames or preset.frames, args.height or preset.height, args.width or preset.width
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # diffusers' note on casting with .to()
            unet = models.build_unet(preset, seed=args.seed, dtype=dtype, device=device)
    if args.channels_last:
        models.conv_weights_channels_last(unet)
    inputs = models.unet_inputs(unet, batch=args.batch, frames=frames, height=height, width=width,
                                vae_scale_factor=vsf, dtype=dtype, device=device, seed=args.seed,
                                cfg=not args.no_cfg)
    n_params = sum(p.numel() for p in unet.parameters())
    shape = tuple(inputs["sample"].shape)
    print(f"vdcompile bench: {what} ({type(unet).__name__}, {n_params / 1e6:.1f} M params), "
          f"{frames} frames {height}x{width}, batch {args.batch}{'' if args.no_cfg else ' (x2 CFG)'}, {dtype_name(dtype)} on {device}; "
          f"UNet input {shape}; {args.steps} steps x {args.iters} iters after {args.warmup} warmup"
          + ("; 2-D conv weights channels_last" if args.channels_last else ""))

    vd_ok, vd_why = backend_status()
    fused = fused_scheduler_step()
    vd_channels_last = device.type == "cuda" and not args.channels_last and not args.vd_nchw
    rtol = args.tol if args.tol is not None else DEFAULT_RTOL[dtype_name(dtype)]
    tf32 = (device.type == "cuda" and dtype == torch.float32
            and (torch.backends.cudnn.allow_tf32 or torch.backends.cuda.matmul.allow_tf32))
    if tf32 and args.tol is None:
        # cuDNN's float32 convolutions run in TF32 by default (10-bit mantissa), exact float32
        # kernels do not: their outputs legitimately differ by more than float32 rounding.
        rtol = TF32_RTOL
    progress = _Progress(total=len(backends) * (1 + args.warmup + args.iters), enabled=not args.no_progress and sys.stderr.isatty())
    rows: list[dict] = []
    ref_out = None
    failures = []
    t_all = time.perf_counter()
    try:
        for b in backends:
            if b == "vdcompile" and not vd_ok:
                rows.append({"backend": b, "error": f"skipped: {vd_why}"})
                progress.advance(1 + args.warmup + args.iters)
                continue
            use_fused = b == "vdcompile" and fused is not None and not args.no_fused_scheduler
            # The vdcompile row gets the model as optimize() leaves it: on a GPU, 2-D conv weights
            # channels_last (put back afterwards, so the rows after it see the model as built).
            relaid = (models.conv_weights_channels_last(unet)
                      if b == "vdcompile" and vd_channels_last else [])
            try:
                row = _bench_one(b, unet, inputs, ref_out, args, device, progress, options,
                                 fused_step=fused if use_fused else None)
            except Exception as e:
                if b == "eager":
                    raise
                msg = str(e).strip().splitlines()[0][:200] if str(e).strip() else ""
                rows.append({"backend": b, "error": f"failed: {type(e).__name__}: {msg}"})
                failures.append(f"{b} failed to run: {type(e).__name__}: {msg}")
                continue
            finally:
                models.restore_conv_weights(relaid)
            if b == "eager":
                ref_out, ref_lat = row["out"], row["latents"]
            else:
                row["latents_max_rel_err"] = _max_rel_err(row["latents"], ref_lat)
                worst = max(row["max_rel_err"], row["latents_max_rel_err"])
                if not worst <= rtol:  # also catches NaN
                    failures.append(f"{b} disagrees with eager: max rel err {worst:.3e} > tolerance {rtol:g}")
            row["fused_scheduler"] = use_fused
            rows.append(row)
    finally:
        progress.close()
    total_s = time.perf_counter() - t_all

    print(print_bench_table(rows, rtol))
    notes = []
    if not vd_ok:
        notes.append(f"vdcompile row skipped: {vd_why}")
    if tf32 and args.tol is None:
        notes.append(f"float32 with TF32 enabled on this GPU: tolerance {TF32_RTOL:g}")
    if any(r.get("fused_scheduler") for r in rows):
        notes.append("vdcompile row uses the fused scheduler step")
    if vd_channels_last and any(r["backend"] == "vdcompile" and "error" not in r for r in rows):
        notes.append("vdcompile row stores the 2-D conv weights channels_last, as optimize() does on a GPU "
                     "(--channels-last: every row; --vd-nchw: none)")
    if device.type == "cpu":
        notes.append("peak memory is reported for CUDA devices only")
    noisy = [r["backend"] for r in rows if r.get("ms_per_step_all") and len(r["ms_per_step_all"]) > 1
             and max(r["ms_per_step_all"]) > 1.5 * min(r["ms_per_step_all"])]
    if noisy:
        notes.append(f"timings of {', '.join(noisy)} varied by more than 1.5x between runs (a busy machine?); "
                     "more --iters" + (", or --threads 1 on a shared CPU," if device.type == "cpu" else "")
                     + " give steadier numbers")
    for n in notes:
        print("note:", n)
    print(f"bench total {total_s:.1f} s")

    os.makedirs(args.out, exist_ok=True)
    stamp = _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%dT%H%M%S")
    stem = os.path.join(args.out, f"bench_{preset.name if preset else 'model'}_{device.type}_{stamp}")
    config = {
        "preset": preset.name if preset else None, "model": args.model, "unet_class": type(unet).__name__,
        "unet_params": n_params, "frames": frames, "height": height, "width": width, "batch": args.batch,
        "cfg": not args.no_cfg, "unet_input_shape": list(shape), "dtype": dtype_name(dtype), "steps": args.steps,
        "warmup": args.warmup, "iters": args.iters, "backends": backends, "backend_options": options,
        "tolerance": rtol, "seed": args.seed, "cuda_graphs": args.cuda_graphs, "channels_last": args.channels_last,
        "vdcompile_row_channels_last": vd_channels_last,
        "fused_scheduler_in_vdcompile_row": fused is not None and not args.no_fused_scheduler,
    }
    payload = {
        "environment": _environment(device), "config": config,
        "results": [{k: v for k, v in r.items() if k not in ("latents", "out")} for r in rows],
        "ok": not failures, "failures": failures, "notes": notes, "total_s": total_s,
        "process_max_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }
    with open(stem + ".json", "w") as f:
        json.dump(payload, f, indent=1)
    print("wrote", stem + ".json")
    png = _bench_chart(stem + ".png", rows, f"vdcompile bench: {what}, {dtype_name(dtype)}, {device}")
    if png:
        print("wrote", png)
    else:
        print("note: no chart (needs matplotlib or Pillow)")
    for f in failures:
        print("FAIL:", f, file=sys.stderr)
    return 1 if failures else 0


def dtype_name(dtype) -> str:
    return str(dtype).replace("torch.", "")


def _ops_bench_names(path: str) -> list[str]:
    """The op names bench/ops.py takes in --ops (read from its default), e.g. group_norm_silu."""
    import re

    with open(path) as f:
        m = re.search(r"""["']--ops["']\s*,\s*default\s*=\s*["']([\w,]+)["']""", f.read())
    return m.group(1).split(",") if m else []


def _bench_kernel(name: str, rest: list[str]) -> int:
    from vdcompile.models import UserError

    avail = kernel_benchmarks()
    if name in avail:
        return _run_script(avail[name], rest)
    ops = _ops_bench_names(avail["ops"]) if "ops" in avail else []
    if name in ops:  # per-op benchmarks live in bench/ops.py
        return _run_script(avail["ops"], ["--ops", name, *rest])
    where = _repo_bench_dir()
    if where is None:
        raise UserError(f"kernel benchmark {name!r}: the bench/ directory of a source checkout is needed "
                        "(it is not installed with the package); run from the repository root")
    raise UserError(f"no kernel benchmark {name!r} in {where}; available: {', '.join([*avail, *ops]) or 'none'}")


def _run_script(path: str, argv: list[str]) -> int:
    old = sys.argv
    sys.argv = [path, *argv]
    try:
        runpy.run_path(path, run_name="__main__")
    except SystemExit as e:
        if isinstance(e.code, str):
            print(e.code, file=sys.stderr)
            return 1
        return int(e.code or 0)
    finally:
        sys.argv = old
    return 0


# ---------------------------------------------------------------------------------------------
# explain


def cmd_explain(args) -> int:
    import importlib.util

    import torch

    from vdcompile import models

    if importlib.util.find_spec("vdcompile.explain") is None:
        raise models.UserError("the rewrite report needs vdcompile.explain (the vdcompile backend), "
                               "which is not part of this build")
    from vdcompile.explain import explain

    device = models.resolve_device(args.device)
    dtype = models.resolve_dtype(args.dtype, device)
    if args.model:
        unet, vsf = models.load_unet(args.model, dtype=dtype, device=device), models.vae_scale_factor_of_dir(args.model)
        frames, height, width = args.frames or 14, args.height or 512, args.width or 512
    else:
        p = models.get_preset(_default_preset(args.preset, device))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            unet = models.build_unet(p, dtype=dtype, device=device)
        vsf = models.vae_scale_factor_of(p)
        frames, height, width = args.frames or p.frames, args.height or p.height, args.width or p.width
    inputs = models.unet_inputs(unet, frames=frames, height=height, width=width, vae_scale_factor=vsf,
                                dtype=dtype, device=device)
    print(f"vdcompile explain: {type(unet).__name__}, UNet input {tuple(inputs['sample'].shape)}, "
          f"{dtype_name(dtype)} on {device}")
    with torch.no_grad():
        result = explain(unet, verbose=False, **inputs, return_dict=False)
    print(result)
    if args.json:
        data = {"graphs": result.graph_count, "fired": result.fired, "rejected": result.rejected,
                "notes": list(getattr(result.report, "notes", []))}
        with open(args.json, "w") as f:
            json.dump(data, f, indent=1, default=str)
        print("wrote", args.json)
    return 0


# ---------------------------------------------------------------------------------------------
# generate


def cmd_generate(args) -> int:
    import torch

    from vdcompile import models
    from vdcompile.profiler import Profiler, safe_name
    from vdcompile.runner import run_video, save_video

    device = models.resolve_device(args.device)
    dtype = models.resolve_dtype(args.dtype, device)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if args.model:
            pipe = _load_pipeline(args.model, dtype, device)
            frames = args.frames or getattr(pipe.unet.config, "num_frames", None) or 14
            height, width = args.height or 576, args.width or 1024
            label = os.path.basename(os.path.normpath(args.model))
        else:
            p = models.get_preset(_default_preset(args.preset, device))
            pipe = models.build_svd_pipeline(p, dtype=dtype, device=device, seed=args.seed)
            frames, height, width = args.frames or p.frames, args.height or p.height, args.width or p.width
            label = p.name
    print(f"vdcompile generate: {label} ({type(pipe).__name__}), {frames} frames {height}x{width}, "
          f"{args.steps} steps, {dtype_name(dtype)} on {device}, compile={args.compile}")
    if args.compile != "none":
        from vdcompile.optimize import optimize

        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if args.compile == "inductor-unet":  # what a user writes without vdcompile
                optimize(pipe, backend="inductor", cuda_graphs=args.cuda_graphs, compile_vae=False,
                         fuse_scheduler=False)
            else:
                optimize(pipe, backend=args.compile, cuda_graphs=args.cuda_graphs)
        for w in caught:
            print("note:", w.message)
        print("optimize:", json.dumps(pipe.vdcompile_info))
    run_kw = dict(num_frames=frames, height=height, width=width, steps=args.steps, seed=args.seed,
                  decode_chunk_size=args.decode_chunk_size)
    for i in range(args.warmup if args.warmup is not None else (1 if args.compile != "none" else 0)):
        t = time.perf_counter()
        run_video(pipe, **run_kw)
        print(f"warmup run {i + 1}: {time.perf_counter() - t:.1f} s (includes compiles)")
    prof = Profiler(device).instrument(pipe)
    try:
        if args.no_op_profile:
            with prof.wall():
                result = run_video(pipe, **run_kw)
        else:
            with prof.ops(), prof.wall():  # wall inside: the profiler's start and stop are not the run's
                result = run_video(pipe, **run_kw)
    finally:
        prof.remove()
    report = prof.report()
    print(result.summary())
    if not args.no_op_profile:
        print("(timed under torch.profiler, which adds overhead; --no-op-profile for clean timings)")
    print(report.table())
    os.makedirs(args.out, exist_ok=True)
    stem = os.path.join(args.out, f"generate_{safe_name(label)}_{device.type}")
    video = save_video(result.frames, args.output or stem + "." + args.format, fps=args.fps)
    print("wrote", video)
    chart = report.save_chart(stem + "_profile.png")
    if chart:
        print("wrote", chart)
    with open(stem + ".json", "w") as f:
        json.dump({"environment": _environment(device), "run": result.to_dict(), "profile": report.to_dict(),
                   "optimize": getattr(pipe, "vdcompile_info", None), "compile": args.compile,
                   "label": label}, f, indent=1)
    print("wrote", stem + ".json")
    return 0


def _load_pipeline(path: str, dtype, device):
    from vdcompile.models import UserError

    if not os.path.isdir(path):
        raise UserError(f"--model {path}: no such directory")
    if not os.path.isfile(os.path.join(path, "model_index.json")):
        raise UserError(f"--model {path}: no model_index.json; generate needs a whole diffusers pipeline "
                        "directory (bench accepts a UNet directory)")
    from diffusers import DiffusionPipeline

    try:
        pipe = DiffusionPipeline.from_pretrained(path, torch_dtype=dtype, local_files_only=True)
    except Exception as e:  # missing files, or a pipeline class that needs transformers
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UserError(f"--model {path}: cannot load the pipeline: {first}") from None
    pipe.set_progress_bar_config(disable=True)
    return pipe.to(device)


# ---------------------------------------------------------------------------------------------


def _default_preset(name: str | None, device) -> str:
    """'auto': tiny on a CPU (eager + two compiles in a minute or two on 2 cores), small on a GPU."""
    if name in (None, "auto"):
        return "tiny" if device.type == "cpu" else "small"
    return name


def _model_args(p: argparse.ArgumentParser, *, bench: bool) -> None:
    from vdcompile.models import PRESETS

    g = p.add_mutually_exclusive_group()
    g.add_argument("--preset", default="auto", help=f"built-in config with random weights: {', '.join(PRESETS)} "
                   "(default auto: tiny on a CPU, small on a GPU)")
    g.add_argument("--model", metavar="DIR", help="local diffusers checkpoint directory"
                   + (" (UNet folder or pipeline folder)" if bench else " (whole pipeline)"))
    p.add_argument("--frames", type=int, help="video frames (default: the preset's)")
    p.add_argument("--height", type=int, help="video height in pixels (default: the preset's)")
    p.add_argument("--width", type=int, help="video width in pixels (default: the preset's)")
    p.add_argument("--dtype", default="fp32", help="fp32, bf16 or fp16 (default: fp32)")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N (default: auto)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, help="CPU threads for torch (default: torch's own choice); "
                   "1 is often fastest on a busy machine")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="vdcompile", description="vdcompile: torch.compile for video diffusion")
    sub = p.add_subparsers(dest="cmd", metavar="{bench,explain,generate}")

    b = sub.add_parser("bench", help="eager vs inductor vs vdcompile on a video UNet (or a kernel benchmark)",
                       description="Eager vs inductor vs vdcompile on a video UNet, in one process. "
                       "'vdcompile bench NAME [ARGS]' runs the kernel benchmark bench/NAME.py instead.")
    b.add_argument("kernel", nargs="?", help="kernel benchmark to run instead (e.g. attention)")
    b.add_argument("kernel_args", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    _model_args(b, bench=True)
    b.add_argument("--batch", type=int, default=1, help="videos per step (doubled for CFG; default 1)")
    b.add_argument("--no-cfg", action="store_true",
                   help="no classifier-free guidance: the UNet sees --batch samples, not twice that")
    b.add_argument("--steps", type=int, default=4, help="denoising steps per timed run (default 4)")
    b.add_argument("--warmup", type=int, default=1, help="untimed runs after the compile (default 1)")
    b.add_argument("--iters", type=int, default=3, help="timed runs; the median is reported (default 3)")
    b.add_argument("--backends", default=",".join(DEFAULT_BACKENDS),
                   help="comma-separated torch.compile backends (default: eager,inductor,vdcompile)")
    b.add_argument("--backend-option", action="append", metavar="KEY=VALUE",
                   help="option for the vdcompile backend (repeatable)")
    b.add_argument("--tol", type=float, help="max relative error vs eager (default: 1e-3 fp32 (1e-2 with TF32 "
                   "on a GPU), 5e-2 bf16, 1e-2 fp16)")
    b.add_argument("--no-fused-scheduler", action="store_true", help="vdcompile row: plain scheduler.step")
    b.add_argument("--cuda-graphs", action="store_true",
                   help="inductor and vdcompile rows with CUDA graphs (mode=reduce-overhead); CUDA only")
    b.add_argument("--channels-last", action="store_true",
                   help="store the UNet's 2-D conv weights channels_last for every row, eager and inductor "
                        "too (by default only the vdcompile row has them so on a GPU, as optimize() does)")
    b.add_argument("--vd-nchw", action="store_true",
                   help="vdcompile row: keep the model's NCHW conv weights (no channels_last preparation)")
    b.add_argument("--no-progress", action="store_true")
    b.add_argument("--out", default="vdcompile-bench", help="directory for the JSON and PNG (default ./vdcompile-bench)")
    b.set_defaults(fn=cmd_bench)

    e = sub.add_parser("explain", help="what the vdcompile backend rewrites in a model")
    _model_args(e, bench=True)
    e.add_argument("--json", metavar="FILE", help="also write the report as JSON")
    e.set_defaults(fn=cmd_explain)

    g = sub.add_parser("generate", help="run a whole video pipeline, profile it, save the video")
    _model_args(g, bench=False)
    g.add_argument("--steps", type=int, default=4, help="denoising steps (default 4)")
    g.add_argument("--compile", default="vdcompile", choices=["vdcompile", "inductor", "inductor-unet", "none"],
                   help="vdcompile.optimize backend; inductor-unet: only torch.compile(pipe.unet), the "
                        "one-line baseline (plain scheduler step, eager VAE); none (default vdcompile)")
    g.add_argument("--cuda-graphs", action="store_true", help="capture CUDA graphs (mode=reduce-overhead)")
    g.add_argument("--warmup", type=int, help="untimed runs first (default 1 when compiling, else 0)")
    g.add_argument("--decode-chunk-size", type=int, help="frames decoded at once by the VAE")
    g.add_argument("--no-op-profile", action="store_true", help="skip torch.profiler (regions only)")
    g.add_argument("--format", default="mp4", choices=["mp4", "gif"])
    g.add_argument("--fps", type=int, default=7)
    g.add_argument("--output", metavar="FILE", help="video path (default: OUT/generate_<name>_<device>.<format>)")
    g.add_argument("--out", default="vdcompile-out", help="directory for video, chart and JSON")
    g.set_defaults(fn=cmd_generate)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "fn", None):
        parser.print_help()
        return 2
    from vdcompile.models import UserError

    if getattr(args, "threads", None) is not None:
        if args.threads < 1:
            _err("--threads must be >= 1")
            return 2
        import torch

        torch.set_num_threads(args.threads)
    try:
        return int(args.fn(args) or 0)
    except UserError as e:
        _err(str(e))
        return 2
    except KeyboardInterrupt:
        _err("interrupted")
        return 130


if __name__ == "__main__":
    sys.exit(main())
