"""vdcompile.optimize: what it compiles for each pipeline kind, and unchanged frames on a tiny SVD pipeline."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch._dynamo
from torch import nn

from vdcompile import models, runner
from vdcompile.optimize import backend_status, fused_scheduler_step, optimize


@pytest.fixture(autouse=True)
def _one_thread_fresh_dynamo(one_thread):  # one_thread: tests/conftest.py
    yield
    torch._dynamo.reset()


def _compiled(m) -> bool:
    return isinstance(m, torch._dynamo.eval_frame.OptimizedModule)


def _backend():
    """The vdcompile backend (rewrites only, no code generation: the eager inner compiler keeps the
    test short) when this build has it, else aot_eager."""
    ok, _ = backend_status()
    return ("vdcompile", {"inner_compiler": "eager"}) if ok else ("aot_eager", None)


def _frames(r) -> np.ndarray:
    return np.stack([np.asarray(f, dtype=np.int16) for f in r.frames])


@pytest.mark.parametrize("channels_last", [None, True])
def test_optimized_svd_pipeline_gives_the_same_frames(channels_last):
    pipe = models.build_svd_pipeline("tiny")
    kw = dict(num_frames=4, height=32, width=32, steps=2, seed=0)
    ref = runner.run_video(pipe, **kw)
    backend, options = _backend()
    convs = [m for m in pipe.unet.modules() if isinstance(m, nn.Conv2d)]
    nchw = [m for m in convs if not m.weight.is_contiguous(memory_format=torch.channels_last)]  # 1x1: both
    assert optimize(pipe, backend=backend, options=options, channels_last=channels_last) is pipe
    info = pipe.vdcompile_info
    assert info["kind"] == "svd" and info["backend"] == backend and info["unet"]
    # Default: channels_last conv weights on a GPU only; asked for, every 2-D conv weight of the UNet.
    assert info["conv_weights_channels_last"] == (len(nchw) if channels_last else 0) and nchw
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    assert all(m.weight.is_contiguous(memory_format=fmt) for m in convs)
    assert _compiled(pipe.unet)
    assert not info["vae_decoder"] and not _compiled(pipe.vae.decoder)  # CPU: not worth its compile
    assert info["fused_scheduler"] == (fused_scheduler_step() is not None)
    if info["fused_scheduler"]:
        assert "step" in vars(pipe.scheduler)  # bound on the instance: the pipeline calls scheduler.step
    out = runner.run_video(pipe, **kw)
    assert out.num_frames == ref.num_frames
    # uint8 frames: allow one or two levels of rounding difference from reordered float math.
    diff = np.abs(_frames(out) - _frames(ref)).max()
    assert diff <= 2, f"optimized frames differ from eager by {diff} levels"


def _fake_pipe(cls_name: str, unet_name: str):
    unet = type(unet_name, (nn.Linear,), {})(4, 4)
    pipe = type(cls_name, (), {})()
    pipe.unet = unet
    return pipe


@pytest.mark.parametrize("cls_name,unet_name,kind", [
    ("AnimateDiffPipeline", "UNetMotionModel", "animatediff"),
    ("TextToVideoSDPipeline", "UNet3DConditionModel", "t2v"),
    ("StableVideoDiffusionPipeline", "UNetSpatioTemporalConditionModel", "svd"),
])
def test_known_pipelines_use_the_requested_backend(cls_name, unet_name, kind):
    pipe = optimize(_fake_pipe(cls_name, unet_name), backend="aot_eager")
    assert pipe.vdcompile_info["kind"] == kind
    assert pipe.vdcompile_info["backend"] == "aot_eager"
    assert _compiled(pipe.unet)
    x = torch.randn(2, 4)
    torch.testing.assert_close(pipe.unet(x), pipe.unet._orig_mod(x))


def test_unknown_pipeline_gets_generic_backend_with_warning():
    with pytest.warns(UserWarning, match="does not know MyPipeline.*generic inductor"):
        pipe = optimize(_fake_pipe("MyPipeline", "UNet2DConditionModel"))
    assert pipe.vdcompile_info["backend"] == "inductor"
    assert _compiled(pipe.unet)


def test_missing_vdcompile_backend_falls_back_or_raises():
    ok, why = backend_status()
    if ok:
        pytest.skip("this build has the vdcompile backend")
    with pytest.warns(UserWarning, match="not part of this build.*inductor instead"):
        pipe = optimize(_fake_pipe("AnimateDiffPipeline", "UNetMotionModel"))
    assert pipe.vdcompile_info["backend"] == "inductor"
    with pytest.raises(RuntimeError, match="not part of this build"):
        optimize(_fake_pipe("AnimateDiffPipeline", "UNetMotionModel"), fallback=False)


def test_options_cuda_graphs_vae_and_idempotence():
    pipe = models.build_svd_pipeline("tiny")
    with pytest.warns(UserWarning, match="CUDA graphs need a CUDA device"):
        optimize(pipe, backend="aot_eager", cuda_graphs=True, compile_vae=True, fuse_scheduler=False)
    info = pipe.vdcompile_info
    assert not info["cuda_graphs"] and info["vae_decoder"] and _compiled(pipe.vae.decoder)
    assert not info["fused_scheduler"] and "step" not in vars(pipe.scheduler)
    unet = pipe.unet
    with pytest.warns(UserWarning, match="already optimized"):
        optimize(pipe)
    assert pipe.unet is unet


def test_pipeline_without_denoiser_is_a_clear_error():
    with pytest.raises(TypeError, match="has no unet or transformer"):
        optimize(type("Empty", (), {})())
