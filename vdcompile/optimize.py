"""``vdcompile.optimize(pipe)``: compile a video-diffusion pipeline's hot parts in place.

* the UNet with ``torch.compile(backend="vdcompile")`` (CUDA graphs with ``cuda_graphs=True``);
* the VAE decoder on a GPU, where decoding every frame is a large share of the run (on a CPU the
  compile costs more than it saves for one video);
* the scheduler step replaced by ``vdcompile.schedulers.fused_step`` when that module is present.

Known pipelines: StableVideoDiffusionPipeline (and :class:`vdcompile.runner.SVDPipeline`),
AnimateDiff pipelines, text-to-video UNet3D pipelines. Anything else with a ``unet`` (or a
``transformer``) is compiled with the generic backend (inductor), with a warning.
"""
from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.util
import warnings
from typing import Any

import torch

from vdcompile.models import conv_weights_channels_last
from vdcompile.runner import pipeline_kind

GENERIC_BACKEND = "inductor"


def backend_status() -> tuple[bool, str]:
    """(available, why not): whether ``torch.compile(backend="vdcompile")`` resolves here.

    An installed package registers the backend through its entry point; a source checkout that was
    only built in place has none, so the backend is registered here by name."""
    import torch._dynamo

    if "vdcompile" in torch._dynamo.list_backends(exclude_tags=()):
        return True, ""
    if importlib.util.find_spec("vdcompile.backend") is None:
        return False, "the vdcompile torch.compile backend is not part of this build"
    try:
        from vdcompile.backend import vdcompile_backend
    except Exception as e:  # a broken backend must not take the CLI down with it
        return False, f"vdcompile.backend failed to import: {type(e).__name__}: {e}"
    from torch._dynamo.backends.registry import register_backend

    with contextlib.suppress(Exception):  # registered meanwhile (entry point loaded lazily)
        register_backend(name="vdcompile")(vdcompile_backend)
    if "vdcompile" in torch._dynamo.list_backends(exclude_tags=()):
        return True, ""
    return False, "the vdcompile backend could not be registered with torch.compile"


def fused_scheduler_step():
    """``vdcompile.schedulers.fused_step`` or None when this build has no fused scheduler."""
    if importlib.util.find_spec("vdcompile.schedulers") is None:
        return None
    mod = importlib.import_module("vdcompile.schedulers")
    return getattr(mod, "fused_step", None)


def compile_module(module, backend: str, *, mode: str | None = None, options: dict | None = None,
                   fullgraph: bool = False, dynamic: bool | None = False):
    """torch.compile with the arguments each backend accepts: inductor takes ``mode``/``options``;
    another backend gets ``options`` (and ``mode``) handed through to it."""
    kw: dict[str, Any] = dict(backend=backend, fullgraph=fullgraph, dynamic=dynamic)
    if mode and options:
        # torch.compile refuses both at once; the mode's settings go into options instead.
        options = {**options, **({"triton.cudagraphs": True} if mode == "reduce-overhead" else {})}
        mode = None
    if mode:
        kw["mode"] = mode
    if options:
        kw["options"] = options
    return torch.compile(module, **kw)


def _device_of(module) -> torch.device:
    for p in module.parameters():
        return p.device
    return torch.device("cpu")


def optimize(pipe, *, backend: str = "vdcompile", cuda_graphs: bool = False, compile_vae: bool | None = None,
             fuse_scheduler: bool = True, channels_last: bool | None = None, fullgraph: bool = False,
             dynamic: bool | None = False, options: dict | None = None, fallback: bool = True):
    """Compile ``pipe`` in place and return it.

    backend: the torch.compile backend for the UNet and VAE decoder ("vdcompile", or any other
        registered name, e.g. "inductor" to compare).
    cuda_graphs: capture CUDA graphs (mode="reduce-overhead"); ignored with a warning on a CPU.
    compile_vae: compile ``vae.decoder``; default: on a GPU only.
    fuse_scheduler: use vdcompile's fused scheduler step when this build has it.
    channels_last: store the denoiser's 2-D conv weights channels_last (values unchanged), so the
        compiled convolutions need no per-call weight relayout and their activations stay
        channels_last; default: with the vdcompile backend on a GPU.
    options: handed to the backend (``torch.compile(options=...)``).
    fallback: when the vdcompile backend is not available, compile with inductor and warn
        (False: raise instead).

    What was done is recorded in ``pipe.vdcompile_info``.
    """
    if getattr(pipe, "vdcompile_info", None):
        warnings.warn("pipeline already optimized by vdcompile; left as is", stacklevel=2)
        return pipe
    kind = pipeline_kind(pipe)
    denoiser_name = "unet" if getattr(pipe, "unet", None) is not None else "transformer"
    denoiser = getattr(pipe, denoiser_name, None)
    if denoiser is None:
        raise TypeError(f"{type(pipe).__name__} has no unet or transformer to compile")
    device = _device_of(denoiser)

    info: dict[str, Any] = {"kind": kind, "requested_backend": backend}
    if kind == "unknown":
        warnings.warn(f"vdcompile does not know {type(pipe).__name__}; compiling its {denoiser_name} "
                      f"with the generic {GENERIC_BACKEND} backend", stacklevel=2)
        backend = GENERIC_BACKEND
    elif backend == "vdcompile":
        ok, why = backend_status()
        if not ok:
            if not fallback:
                raise RuntimeError(why)
            warnings.warn(f"{why}; compiling with {GENERIC_BACKEND} instead", stacklevel=2)
            backend = GENERIC_BACKEND
    info["backend"] = backend

    mode = None
    if cuda_graphs:
        if device.type == "cuda":
            mode = "reduce-overhead"
        else:
            warnings.warn("CUDA graphs need a CUDA device; ignored on " + device.type, stacklevel=2)
    info["cuda_graphs"] = mode is not None

    if channels_last is None:
        channels_last = backend == "vdcompile" and device.type == "cuda"
    info["conv_weights_channels_last"] = len(conv_weights_channels_last(denoiser)) if channels_last else 0

    setattr(pipe, denoiser_name, compile_module(denoiser, backend, mode=mode, options=options,
                                                fullgraph=fullgraph, dynamic=dynamic))
    info[denoiser_name] = True

    vae = getattr(pipe, "vae", None)
    if compile_vae is None:
        compile_vae = device.type == "cuda"
    if compile_vae and vae is not None and getattr(vae, "decoder", None) is not None:
        # The decoder sees a different number of frames in its last chunk; dynamic shapes avoid
        # one recompile per chunk size. No CUDA graphs here: it runs once per video.
        vae.decoder = compile_module(vae.decoder, backend, options=options, dynamic=None)
        info["vae_decoder"] = True
    else:
        info["vae_decoder"] = False

    info["fused_scheduler"] = False
    sched = getattr(pipe, "scheduler", None)
    step = fused_scheduler_step() if fuse_scheduler else None
    if fuse_scheduler and step is None:
        info["fused_scheduler_why_not"] = "vdcompile.schedulers is not part of this build"
    if step is not None and sched is not None:
        from vdcompile.schedulers import unsupported_reason

        why = unsupported_reason(sched)
        if why is None:
            # Bound to this scheduler instance: the pipeline keeps calling scheduler.step(...).
            sched.step = functools.partial(step, sched)
            info["fused_scheduler"] = True
        else:
            info["fused_scheduler_why_not"] = why
    pipe.vdcompile_info = info
    return pipe
