"""Video runner: tiny random-weight SVD pipeline end to end, timing fields, saving videos."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from vdcompile import models, runner


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def pipe():
    return models.build_svd_pipeline("tiny")


def test_run_video_reports_consistent_timings(pipe):
    r = runner.run_video(pipe, num_frames=4, height=32, width=32, steps=2, seed=0)
    assert r.num_frames == 4
    assert all(f.size == (32, 32) for f in r.frames)
    assert r.total_s > 0
    assert r.fps == pytest.approx(4 / r.total_s)
    assert r.per_frame_ms == pytest.approx(1e3 * r.total_s / 4)
    assert r.peak_mem_mb is None  # CPU: no GPU memory to report
    assert "4 frames, 2 steps" in r.summary()
    assert set(r.to_dict()) >= {"frames", "total_s", "per_frame_ms", "fps", "peak_mem_mb"}


def test_run_video_is_seeded(pipe):
    a = runner.run_video(pipe, num_frames=2, height=32, width=32, steps=1, seed=3)
    b = runner.run_video(pipe, num_frames=2, height=32, width=32, steps=1, seed=3)
    c = runner.run_video(pipe, num_frames=2, height=32, width=32, steps=1, seed=4)
    arr = lambda r: np.stack([np.asarray(f) for f in r.frames])  # noqa: E731
    assert np.array_equal(arr(a), arr(b))
    assert not np.array_equal(arr(a), arr(c))


def test_svd_pipeline_follows_the_guidance_and_step_count(pipe):
    calls = []
    out = pipe(runner.demo_image(32, 32), height=32, width=32, num_frames=2, num_inference_steps=3,
               output_type="latent", callback_on_step_end=lambda p, i, t, kw: calls.append(i) or kw)
    assert calls == [0, 1, 2]
    assert out.frames.shape == (1, 2, 4, 16, 16)  # (B, F, C, H/2, W/2) with the tiny VAE
    assert torch.isfinite(out.frames).all()


def test_pipeline_kind():
    assert runner.pipeline_kind(models.build_svd_pipeline("tiny")) == "svd"

    def fake(cls_name, unet_name):
        unet = type(unet_name, (torch.nn.Linear,), {})(1, 1)
        return type(cls_name, (), {"unet": unet})()

    assert runner.pipeline_kind(fake("AnimateDiffPipeline", "UNetMotionModel")) == "animatediff"
    assert runner.pipeline_kind(fake("Whatever", "UNetMotionModel")) == "animatediff"
    assert runner.pipeline_kind(fake("TextToVideoSDPipeline", "UNet3DConditionModel")) == "t2v"
    assert runner.pipeline_kind(fake("StableDiffusionPipeline", "UNet2DConditionModel")) == "unknown"


def _frames(n=3, size=(24, 16)):
    return [Image.new("RGB", size, (40 * i, 100, 200)) for i in range(n)]


def test_save_gif_roundtrip(tmp_path):
    path = runner.save_video(_frames(), str(tmp_path / "sub" / "v.gif"), fps=5)
    with Image.open(path) as im:
        assert im.n_frames == 3
        assert im.size == (24, 16)


@pytest.mark.parametrize("size", [(24, 16), (33, 17)])  # odd sizes: H.264 needs even ones
def test_save_mp4_or_clear_fallback(tmp_path, capsys, size):
    path = runner.save_video(_frames(size=size), str(tmp_path / "v.mp4"))
    try:
        import imageio.v2
        import imageio_ffmpeg  # noqa: F401
        assert path.endswith(".mp4")
        frames = imageio.v2.mimread(path)
        assert len(frames) == 3 and frames[0].shape[0] >= size[1] and frames[0].shape[1] >= size[0]
    except ImportError:
        # Without an mp4 encoder the frames still land on disk, as a gif, and the user is told how.
        assert path.endswith(".gif")
        assert "pip install imageio imageio-ffmpeg" in capsys.readouterr().out
    assert (tmp_path / path.split("/")[-1]).stat().st_size > 0


def test_save_video_rejects_unknown_extension(tmp_path):
    with pytest.raises(models.UserError, match="use .mp4 or .gif"):
        runner.save_video(_frames(), str(tmp_path / "v.avi"))
    with pytest.raises(models.UserError, match="no frames"):
        runner.save_video([], str(tmp_path / "v.gif"))
