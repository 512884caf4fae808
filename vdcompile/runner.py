"""Video pipeline runner: generate a video, report total time, time per frame, FPS and peak memory,
and save the frames as mp4 or gif.

Also holds :class:`SVDPipeline`, Stable Video Diffusion's sampling algorithm (as in diffusers'
StableVideoDiffusionPipeline) on the same diffusers components, for machines without
``transformers`` (diffusers only provides a placeholder class for the real pipeline there).
"""
from __future__ import annotations

import dataclasses
import os
import time
from types import SimpleNamespace
from typing import Any, Callable

import numpy as np
import torch
import torch.nn.functional as F

from vdcompile.models import CLIP_MEAN, CLIP_STD, UserError

SVD_KINDS = ("StableVideoDiffusionPipeline", "SVDPipeline")


class SVDPipeline:
    """Image-to-video sampling of Stable Video Diffusion with diffusers' UNetSpatioTemporalConditionModel,
    AutoencoderKLTemporalDecoder and EulerDiscreteScheduler, and any image encoder returning
    ``.image_embeds`` (CLIPVisionModelWithProjection or :class:`vdcompile.models.StubImageEncoder`).

    Call signature and output (``.frames``) follow diffusers' pipeline."""

    def __init__(self, unet, vae, image_encoder, scheduler):
        from diffusers.video_processor import VideoProcessor

        self.unet, self.vae, self.image_encoder, self.scheduler = unet, vae, image_encoder, scheduler
        self.vae_scale_factor = 2 ** (len(vae.config.block_out_channels) - 1)
        self.video_processor = VideoProcessor(do_resize=True, vae_scale_factor=self.vae_scale_factor)

    @property
    def components(self) -> dict:
        return dict(unet=self.unet, vae=self.vae, image_encoder=self.image_encoder, scheduler=self.scheduler)

    @property
    def device(self) -> torch.device:
        return next(self.vae.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.vae.parameters()).dtype

    def to(self, device=None, dtype=None) -> "SVDPipeline":
        for m in (self.unet, self.vae, self.image_encoder):
            m.to(device=device, dtype=dtype)
        return self

    def _encode_image(self, image: torch.Tensor, cfg: bool) -> torch.Tensor:
        enc = self.image_encoder
        size = getattr(getattr(enc, "config", None), "image_size", 224)
        # [0, 1] images -> CLIP's input resolution and normalisation.
        x = F.interpolate(image, size=(size, size), mode="bicubic", align_corners=True, antialias=True)
        mean = torch.tensor(CLIP_MEAN, device=x.device, dtype=x.dtype).view(1, 3, 1, 1)
        std = torch.tensor(CLIP_STD, device=x.device, dtype=x.dtype).view(1, 3, 1, 1)
        x = ((x.clamp(0, 1) - mean) / std).to(dtype=next(enc.parameters()).dtype)
        emb = enc(x).image_embeds.unsqueeze(1)
        return torch.cat([torch.zeros_like(emb), emb]) if cfg else emb

    @torch.no_grad()
    def __call__(self, image, height: int = 576, width: int = 1024, num_frames: int | None = None,
                 num_inference_steps: int = 25, min_guidance_scale: float = 1.0, max_guidance_scale: float = 3.0,
                 fps: int = 7, motion_bucket_id: int = 127, noise_aug_strength: float = 0.02,
                 decode_chunk_size: int | None = None, generator: torch.Generator | None = None,
                 latents: torch.Tensor | None = None, output_type: str = "pil",
                 callback_on_step_end: Callable | None = None, **_unused: Any):
        from diffusers.utils.torch_utils import randn_tensor

        device, dtype = self.device, self.unet.dtype if hasattr(self.unet, "dtype") else self.dtype
        num_frames = num_frames or self.unet.config.num_frames
        decode_chunk_size = decode_chunk_size or num_frames
        cfg = max_guidance_scale > 1.0
        if not isinstance(image, torch.Tensor):
            image = self.video_processor.numpy_to_pt(self.video_processor.pil_to_numpy(image))
        image = image.to(device=device, dtype=torch.float32)
        if image.dim() == 3:
            image = image.unsqueeze(0)
        batch = image.shape[0]
        emb = self._encode_image(image, cfg).to(dtype)

        cond = self.video_processor.preprocess(image, height=height, width=width).to(device)
        cond = cond + noise_aug_strength * randn_tensor(cond.shape, generator=generator, device=device,
                                                        dtype=cond.dtype)
        img_lat = self.vae.encode(cond.to(self.vae.dtype)).latent_dist.mode()
        if cfg:
            img_lat = torch.cat([torch.zeros_like(img_lat), img_lat])
        img_lat = img_lat.to(dtype).unsqueeze(1).repeat(1, num_frames, 1, 1, 1)

        time_ids = torch.tensor([[fps - 1, motion_bucket_id, noise_aug_strength]], dtype=dtype, device=device)
        time_ids = time_ids.repeat(batch * (2 if cfg else 1), 1)

        self.scheduler.set_timesteps(num_inference_steps, device=device)
        shape = (batch, num_frames, self.unet.config.in_channels // 2, height // self.vae_scale_factor,
                 width // self.vae_scale_factor)
        if latents is None:
            latents = randn_tensor(shape, generator=generator, device=device, dtype=dtype)
        latents = latents.to(device) * self.scheduler.init_noise_sigma

        guidance = torch.linspace(min_guidance_scale, max_guidance_scale, num_frames, device=device, dtype=dtype)
        guidance = guidance.view(1, num_frames, 1, 1, 1)
        for i, t in enumerate(self.scheduler.timesteps):
            inp = torch.cat([latents] * 2) if cfg else latents
            inp = self.scheduler.scale_model_input(inp, t)
            inp = torch.cat([inp, img_lat], dim=2)
            noise = self.unet(inp, t, encoder_hidden_states=emb, added_time_ids=time_ids, return_dict=False)[0]
            if cfg:
                uncond, condn = noise.chunk(2)
                noise = uncond + guidance * (condn - uncond)
            latents = self.scheduler.step(noise, t, latents).prev_sample
            if callback_on_step_end is not None:
                out = callback_on_step_end(self, i, t, {"latents": latents}) or {}
                latents = out.get("latents", latents)

        if output_type == "latent":
            return SimpleNamespace(frames=latents)
        frames = self.decode_latents(latents, num_frames, decode_chunk_size)
        return SimpleNamespace(frames=self.video_processor.postprocess_video(video=frames, output_type=output_type))

    def decode_latents(self, latents: torch.Tensor, num_frames: int, chunk: int) -> torch.Tensor:
        latents = latents.flatten(0, 1) / self.vae.config.scaling_factor
        out = []
        for i in range(0, latents.shape[0], chunk):
            part = latents[i:i + chunk]
            out.append(self.vae.decode(part.to(self.vae.dtype), num_frames=part.shape[0]).sample)
        frames = torch.cat(out)
        return frames.reshape(-1, num_frames, *frames.shape[1:]).permute(0, 2, 1, 3, 4).float()


def pipeline_kind(pipe: Any) -> str:
    """'svd', 'animatediff', 't2v' or 'unknown', from the pipeline's class or its UNet's."""
    name = type(pipe).__name__
    unet = getattr(pipe, "unet", None)
    unet_name = type(getattr(unet, "_orig_mod", unet)).__name__ if unet is not None else ""
    if name in SVD_KINDS or unet_name == "UNetSpatioTemporalConditionModel":
        return "svd"
    if name.startswith("AnimateDiff") or unet_name == "UNetMotionModel":
        return "animatediff"
    if name in ("TextToVideoSDPipeline", "VideoToVideoSDPipeline", "TextToVideoZeroPipeline") \
            or unet_name == "UNet3DConditionModel":
        return "t2v"
    return "unknown"


def demo_image(width: int, height: int, seed: int = 0):
    """A synthetic conditioning image (colour gradients and a disc), so no file is needed."""
    from PIL import Image

    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    r = x / max(width - 1, 1)
    g = y / max(height - 1, 1)
    cx, cy = width * (0.3 + 0.4 * ((seed * 37) % 10) / 10), height / 2
    disc = ((x - cx) ** 2 + (y - cy) ** 2) < (min(width, height) / 4) ** 2
    b = np.where(disc, 1.0, 0.25)
    rgb = (np.stack([r, g, b], axis=-1) * 255).astype(np.uint8)
    return Image.fromarray(rgb)


@dataclasses.dataclass
class RunResult:
    frames: list  # PIL images of the first video
    total_s: float
    steps: int
    device: str
    peak_mem_mb: float | None

    @property
    def num_frames(self) -> int:
        return len(self.frames)

    @property
    def per_frame_ms(self) -> float:
        return 1e3 * self.total_s / max(self.num_frames, 1)

    @property
    def fps(self) -> float:
        return self.num_frames / self.total_s if self.total_s > 0 else float("inf")

    def summary(self) -> str:
        mem = f", peak GPU memory {self.peak_mem_mb:.0f} MB" if self.peak_mem_mb is not None else ""
        return (f"{self.num_frames} frames, {self.steps} steps in {self.total_s:.2f} s: "
                f"{self.per_frame_ms:.1f} ms/frame, {self.fps:.2f} frames/s on {self.device}{mem}")

    def to_dict(self) -> dict:
        return {"frames": self.num_frames, "steps": self.steps, "total_s": self.total_s,
                "per_frame_ms": self.per_frame_ms, "fps": self.fps, "device": self.device,
                "peak_mem_mb": self.peak_mem_mb}


def _pipe_device(pipe) -> torch.device:
    dev = getattr(pipe, "device", None)
    if isinstance(dev, torch.device):
        return dev
    unet = getattr(pipe, "unet", None)
    return next(unet.parameters()).device if unet is not None else torch.device("cpu")


def run_video(pipe, *, num_frames: int = 8, height: int = 64, width: int = 64, steps: int = 4,
              seed: int = 0, image=None, prompt: str = "a corgi running on the beach", decode_chunk_size=None,
              **call_kwargs) -> RunResult:
    """Generate one video with ``pipe`` and time it end to end (synchronised on a GPU)."""
    device = _pipe_device(pipe)
    kind = pipeline_kind(pipe)
    gen = torch.Generator(device="cpu").manual_seed(seed)
    kw: dict[str, Any] = dict(height=height, width=width, num_frames=num_frames, num_inference_steps=steps,
                              generator=gen, output_type="pil")
    if kind == "svd":
        kw.update(image=image if image is not None else demo_image(width, height, seed),
                  decode_chunk_size=decode_chunk_size)
    else:
        kw.update(prompt=prompt)
    kw.update(call_kwargs)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    t = time.perf_counter()
    with torch.no_grad():
        out = pipe(**kw)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    total = time.perf_counter() - t
    peak = torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else None
    frames = out.frames[0] if isinstance(out.frames, (list, tuple)) or getattr(out.frames, "ndim", 0) > 4 \
        else out.frames
    return RunResult(list(_as_pil_frames(frames)), total, steps, str(device), peak)


def _as_pil_frames(frames):
    from PIL import Image

    if isinstance(frames, torch.Tensor):
        frames = frames.detach().float().cpu().numpy()
        if frames.shape[0] in (1, 3) and frames.ndim == 4:  # (C, F, H, W)
            frames = frames.transpose(1, 2, 3, 0)
    for f in frames:
        if isinstance(f, Image.Image):
            yield f.convert("RGB")
        else:
            a = np.asarray(f)
            if a.dtype != np.uint8:
                a = (np.clip(a, 0, 1) * 255).round().astype(np.uint8)
            yield Image.fromarray(a)


def _even(a: np.ndarray) -> np.ndarray:
    """Pad H and W to even sizes by repeating the last row/column: H.264 in yuv420p needs them."""
    ph, pw = a.shape[0] % 2, a.shape[1] % 2
    return np.pad(a, ((0, ph), (0, pw), (0, 0)), mode="edge") if ph or pw else a


def save_video(frames, path: str, fps: int = 7) -> str:
    """Write frames (PIL images or HxWx3 arrays) as .mp4 (imageio with its ffmpeg plugin) or .gif
    (imageio, else Pillow). Returns the path written: an mp4 that cannot be encoded here becomes a
    gif next to it, with a message saying why."""
    frames = list(_as_pil_frames(frames))
    if not frames:
        raise UserError("no frames to save")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    ext = os.path.splitext(path)[1].lower()
    if ext not in (".mp4", ".gif"):
        raise UserError(f"cannot save video as {ext or 'a file without extension'}; use .mp4 or .gif")
    if ext == ".mp4":
        try:
            import imageio.v2 as imageio

            with imageio.get_writer(path, fps=fps, codec="libx264", quality=8, macro_block_size=1) as w:
                for f in frames:
                    w.append_data(_even(np.asarray(f)))
            if os.path.getsize(path) == 0:  # ffmpeg reports some failures only on its stderr
                raise RuntimeError("the encoder wrote nothing")
            return path
        except Exception as e:  # imageio or its ffmpeg plugin missing, or no encoder
            gif = os.path.splitext(path)[0] + ".gif"
            why = "imageio is not installed" if isinstance(e, ImportError) else f"imageio could not write it ({e})"
            print(f"note: mp4 needs imageio with ffmpeg (pip install imageio imageio-ffmpeg); {why}. "
                  f"Writing {gif} instead.")
            path = gif
    try:
        import imageio.v2 as imageio

        imageio.mimsave(path, [np.asarray(f) for f in frames], duration=1000 / fps, loop=0)
    except ImportError:
        frames[0].save(path, save_all=True, append_images=frames[1:], duration=int(1000 / fps), loop=0)
    return path
