"""Model presets and builders: video UNets (and whole Stable Video Diffusion pipelines) from configs
written in code, with random weights, or from a local diffusers checkpoint directory. Nothing is
downloaded.

Presets (``PRESETS``):

* ``tiny``  -- a one-level SVD-architecture UNet: spatio-temporal resnets, spatial and temporal
  attention, image and time conditioning. Tests, and ``vdcompile bench``'s default on a CPU
  (eager plus two compiles in a minute or two on 2 cores).
* ``small`` -- a three-level SVD-architecture UNet with every block type of the real model
  (down/upsampling included) at small widths; ``vdcompile bench``'s default on a GPU.
* ``svd``   -- the Stable Video Diffusion (img2vid / img2vid-xt) UNet, VAE and image encoder
  configs, at full size (random weights; about 1.5 B UNet parameters).
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import os
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn


class UserError(Exception):
    """A problem the user can fix (bad flag, missing file or device); printed as one line."""


# Stable Video Diffusion's configs (stabilityai/stable-video-diffusion-img2vid{,-xt}), as published
# in their config.json files. The UNet's values are also diffusers' constructor defaults.
SVD_UNET = dict(
    sample_size=96,
    in_channels=8,
    out_channels=4,
    down_block_types=("CrossAttnDownBlockSpatioTemporal",) * 3 + ("DownBlockSpatioTemporal",),
    up_block_types=("UpBlockSpatioTemporal",) + ("CrossAttnUpBlockSpatioTemporal",) * 3,
    block_out_channels=(320, 640, 1280, 1280),
    addition_time_embed_dim=256,
    projection_class_embeddings_input_dim=768,
    layers_per_block=2,
    cross_attention_dim=1024,
    transformer_layers_per_block=1,
    num_attention_heads=(5, 10, 20, 20),
    num_frames=25,
)
SVD_VAE = dict(
    in_channels=3,
    out_channels=3,
    down_block_types=("DownEncoderBlock2D",) * 4,
    block_out_channels=(128, 256, 512, 512),
    layers_per_block=2,
    latent_channels=4,
    sample_size=768,
    scaling_factor=0.18215,
    force_upcast=True,
)
# CLIP ViT-H/14 vision tower with a 1024-d projection.
SVD_IMAGE_ENCODER = dict(
    hidden_size=1280, intermediate_size=5120, projection_dim=1024, num_hidden_layers=32,
    num_attention_heads=16, image_size=224, patch_size=14, hidden_act="gelu", layer_norm_eps=1e-5,
)
SVD_SCHEDULER = dict(
    num_train_timesteps=1000, beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear",
    prediction_type="v_prediction", interpolation_type="linear", use_karras_sigmas=True,
    sigma_min=0.002, sigma_max=700.0, timestep_spacing="leading", timestep_type="continuous",
    steps_offset=1,
)
CLIP_MEAN = [0.48145466, 0.4578275, 0.40821073]
CLIP_STD = [0.26862954, 0.26130258, 0.27577711]


@dataclasses.dataclass(frozen=True)
class Preset:
    name: str
    description: str
    unet: dict
    vae: dict
    image_encoder: dict
    # Default video shape for bench/generate (pixels; latents are 1/vae_scale_factor of it).
    frames: int
    height: int
    width: int


def _small_unet(widths, heads, cross_dim, time_dim, layers=1):
    n = len(widths)
    return dict(
        sample_size=None, in_channels=8, out_channels=4,
        down_block_types=("CrossAttnDownBlockSpatioTemporal",) * (n - 1) + ("DownBlockSpatioTemporal",),
        up_block_types=("UpBlockSpatioTemporal",) + ("CrossAttnUpBlockSpatioTemporal",) * (n - 1),
        block_out_channels=tuple(widths), addition_time_embed_dim=time_dim,
        projection_class_embeddings_input_dim=3 * time_dim, layers_per_block=layers,
        cross_attention_dim=cross_dim, transformer_layers_per_block=1, num_attention_heads=tuple(heads),
        num_frames=8,
    )


PRESETS: dict[str, Preset] = {
    "tiny": Preset(
        # One level (no down/upsampling) keeps compile tests short: tracing time grows with the
        # number of blocks, not with their width.
        "tiny", "1-level SVD-architecture UNet, width 32: spatio-temporal resnets and attention (tests)",
        unet=dict(_small_unet((32,), (1,), cross_dim=32, time_dim=8),
                  down_block_types=("CrossAttnDownBlockSpatioTemporal",),
                  up_block_types=("CrossAttnUpBlockSpatioTemporal",)),
        vae=dict(SVD_VAE, block_out_channels=(32, 32), down_block_types=("DownEncoderBlock2D",) * 2,
                 layers_per_block=1, sample_size=32),
        # SVD pipelines resize the conditioning image to 224 for the image encoder, whatever its size.
        image_encoder=dict(projection_dim=32, image_size=224, patch_size=32, hidden_size=32),
        frames=4, height=32, width=32,
    ),
    "small": Preset(
        "small", "3-level SVD-architecture UNet, widths 64/128/128 (GPU default)",
        unet=_small_unet((64, 128, 128), (2, 4, 4), cross_dim=64, time_dim=32),
        vae=dict(SVD_VAE, block_out_channels=(32, 64), down_block_types=("DownEncoderBlock2D",) * 2,
                 layers_per_block=1, sample_size=64),
        image_encoder=dict(projection_dim=64, image_size=224, patch_size=32, hidden_size=64),
        frames=8, height=64, width=64,
    ),
    "svd": Preset(
        "svd", "Stable Video Diffusion img2vid-xt UNet/VAE at full size (random weights)",
        unet=SVD_UNET, vae=SVD_VAE, image_encoder=SVD_IMAGE_ENCODER,
        frames=14, height=576, width=1024,
    ),
}


def get_preset(name: str | Preset) -> Preset:
    """The preset of that name (a Preset is returned as is, so builders take either)."""
    if isinstance(name, Preset):
        return name
    try:
        return PRESETS[name]
    except KeyError:
        raise UserError(f"unknown preset {name!r}; choose one of: {', '.join(PRESETS)}") from None


# ---------------------------------------------------------------------------------------------
# Devices and dtypes


DTYPES = {"fp32": torch.float32, "float32": torch.float32, "fp16": torch.float16, "float16": torch.float16,
          "bf16": torch.bfloat16, "bfloat16": torch.bfloat16}


def resolve_device(name: str | None) -> torch.device:
    """``auto`` (or None) picks CUDA when visible; an explicit CUDA request without CUDA is an error."""
    if name in (None, "", "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(name)
    except RuntimeError:
        raise UserError(f"unknown device {name!r}; use cpu, cuda or cuda:N") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            why = "this torch build has no CUDA" if torch.version.cuda is None else "no CUDA device is visible"
            raise UserError(f"--device {name} was asked for but {why}; run with --device cpu")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise UserError(f"--device {name}: only {torch.cuda.device_count()} CUDA device(s) visible")
    elif dev.type != "cpu":
        raise UserError(f"unsupported device {name!r}; use cpu, cuda or cuda:N")
    return dev


def resolve_dtype(name: str | torch.dtype, device: torch.device) -> torch.dtype:
    if isinstance(name, torch.dtype):
        dtype = name
    else:
        try:
            dtype = DTYPES[name.lower()]
        except KeyError:
            raise UserError(f"unknown dtype {name!r}; choose one of: fp32, fp16, bf16") from None
    if device.type == "cuda" and dtype == torch.bfloat16 and not torch.cuda.is_bf16_supported():
        raise UserError(f"{torch.cuda.get_device_name(device)} cannot run bf16; use --dtype fp16 or fp32")
    if device.type == "cpu" and dtype == torch.float16:
        # CPU half-precision convolutions are slow or missing in many builds; bf16 is the CPU format.
        raise UserError("fp16 is not supported on the CPU here; use --dtype fp32 or bf16 (or --device cuda)")
    return dtype


# ---------------------------------------------------------------------------------------------
# Builders


@contextlib.contextmanager
def quiet_diffusers():
    """Silence diffusers' info/warning logs (e.g. its note on casting a model with .to())."""
    from diffusers.utils import logging as dlog

    old = dlog.get_verbosity()
    dlog.set_verbosity_error()
    try:
        yield
    finally:
        dlog.set_verbosity(old)


def _build_diffusers_model(cls, config: dict, seed: int, dtype, device):
    torch.manual_seed(seed)
    # Built on the target device: initialising the full SVD UNet on a CPU first takes a while.
    with quiet_diffusers(), torch.device(device):
        return cls(**config).to(device=device, dtype=dtype).eval().requires_grad_(False)


def build_unet(preset: str | Preset = "small", *, seed: int = 0, dtype=torch.float32, device="cpu"):
    """A UNetSpatioTemporalConditionModel from a preset's config, with seeded random weights."""
    from diffusers import UNetSpatioTemporalConditionModel

    return _build_diffusers_model(UNetSpatioTemporalConditionModel, get_preset(preset).unet, seed, dtype, device)


def build_vae(preset: str | Preset = "small", *, seed: int = 1, dtype=torch.float32, device="cpu"):
    from diffusers import AutoencoderKLTemporalDecoder

    return _build_diffusers_model(AutoencoderKLTemporalDecoder, get_preset(preset).vae, seed, dtype, device)


def build_scheduler():
    from diffusers import EulerDiscreteScheduler

    return EulerDiscreteScheduler(**SVD_SCHEDULER)


def transformers_available() -> bool:
    try:
        import transformers  # noqa: F401
    except ImportError:
        return False
    return True


class StubImageEncoderOutput(SimpleNamespace):
    pass


class StubImageEncoder(nn.Module):
    """Stands in for CLIPVisionModelWithProjection when ``transformers`` is not installed.

    Same interface as the part of it that video pipelines use: ``forward(pixel_values)`` on
    (B, 3, S, S) images normalised with CLIP's mean/std returns an object with ``image_embeds`` of
    shape (B, projection_dim). Inside: a patchify conv, a GELU MLP, mean pooling and a projection,
    with random weights. It is cheap next to the UNet, so timings of the denoising loop are not
    affected; its embeddings carry no meaning (nor do a random-weight CLIP's)."""

    def __init__(self, projection_dim: int, image_size: int = 224, patch_size: int = 14, hidden_size: int = 64,
                 **_unused: Any):
        super().__init__()
        self.config = SimpleNamespace(projection_dim=projection_dim, image_size=image_size,
                                      patch_size=patch_size, hidden_size=hidden_size)
        self.patch = nn.Conv2d(3, hidden_size, patch_size, stride=patch_size)
        self.mlp = nn.Sequential(nn.LayerNorm(hidden_size), nn.Linear(hidden_size, 4 * hidden_size), nn.GELU(),
                                 nn.Linear(4 * hidden_size, hidden_size))
        self.proj = nn.Linear(hidden_size, projection_dim, bias=False)

    @property
    def dtype(self) -> torch.dtype:
        return self.proj.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.proj.weight.device

    def forward(self, pixel_values: torch.Tensor, **_unused: Any) -> StubImageEncoderOutput:
        h = self.patch(pixel_values).flatten(2).transpose(1, 2)  # (B, patches, hidden)
        h = h + self.mlp(h)
        return StubImageEncoderOutput(image_embeds=self.proj(h.mean(dim=1)))


def build_image_encoder(preset: str | Preset = "small", *, seed: int = 2, dtype=torch.float32, device="cpu",
                        stub: bool | None = None):
    """CLIPVisionModelWithProjection from the preset's config when transformers is installed (and
    ``stub`` is not True), else a :class:`StubImageEncoder` with the same output shape."""
    p = get_preset(preset)
    cfg = p.image_encoder
    torch.manual_seed(seed)
    if stub is None:
        stub = not transformers_available()
    if stub:
        enc = StubImageEncoder(**cfg)
    else:
        from transformers import CLIPVisionConfig, CLIPVisionModelWithProjection

        full = dict(intermediate_size=4 * cfg["hidden_size"], num_hidden_layers=2, num_attention_heads=2,
                    hidden_act="gelu", layer_norm_eps=1e-5)
        full.update(cfg)
        enc = CLIPVisionModelWithProjection(CLIPVisionConfig(**full))
    return enc.to(device=device, dtype=dtype).eval().requires_grad_(False)


def build_feature_extractor(preset: str | Preset = "small"):
    """CLIPImageProcessor for the preset's image size (None without transformers: the built-in
    pipeline then resizes and normalises with torch)."""
    p = get_preset(preset)
    if not transformers_available():
        return None
    from transformers import CLIPImageProcessor

    s = p.image_encoder["image_size"]
    return CLIPImageProcessor(size={"shortest_edge": s}, crop_size={"height": s, "width": s},
                              image_mean=CLIP_MEAN, image_std=CLIP_STD, do_convert_rgb=True)


def build_svd_pipeline(preset: str | Preset = "small", *, dtype=torch.float32, device="cpu", seed: int = 0,
                       stub_encoder: bool | None = None):
    """A random-weight Stable Video Diffusion pipeline: diffusers' StableVideoDiffusionPipeline when
    transformers is installed, else :class:`vdcompile.runner.SVDPipeline` (the same sampling
    algorithm on the same diffusers components, with the stub image encoder)."""
    p = get_preset(preset)
    unet = build_unet(p, seed=seed, dtype=dtype, device=device)
    vae = build_vae(p, seed=seed + 1, dtype=dtype, device=device)
    enc = build_image_encoder(p, seed=seed + 2, dtype=dtype, device=device, stub=stub_encoder)
    sched = build_scheduler()
    if isinstance(enc, StubImageEncoder):
        from vdcompile.runner import SVDPipeline

        return SVDPipeline(unet=unet, vae=vae, image_encoder=enc, scheduler=sched)
    from diffusers import StableVideoDiffusionPipeline

    pipe = StableVideoDiffusionPipeline(vae=vae, image_encoder=enc, unet=unet, scheduler=sched,
                                        feature_extractor=build_feature_extractor(p))
    pipe.set_progress_bar_config(disable=True)
    return pipe


# ---------------------------------------------------------------------------------------------
# Local checkpoints


def _read_config(path: str) -> dict:
    with open(path) as f:
        return json.load(f)


def load_unet(path: str, *, dtype=torch.float32, device="cpu"):
    """A video UNet from a local diffusers directory: either the UNet folder itself (config.json) or
    a pipeline folder with a ``unet/`` subfolder. The class is read from the config."""
    import diffusers

    if not os.path.exists(path):
        raise UserError(f"--model {path}: no such directory")
    folder = path
    if os.path.isdir(os.path.join(path, "unet")) and not os.path.isfile(os.path.join(path, "config.json")):
        folder = os.path.join(path, "unet")
    cfg_path = os.path.join(folder, "config.json")
    if not os.path.isfile(cfg_path):
        raise UserError(f"--model {path}: no config.json (nor unet/config.json); "
                        "point it at a diffusers UNet or pipeline directory")
    try:
        cls_name = _read_config(cfg_path).get("_class_name", "UNetSpatioTemporalConditionModel")
    except (OSError, ValueError) as e:
        raise UserError(f"--model {path}: cannot read {cfg_path}: {e}") from None
    cls = getattr(diffusers, cls_name, None)
    if cls is None:
        raise UserError(f"--model {path}: unknown model class {cls_name!r} in config.json")
    try:
        with quiet_diffusers():
            model = cls.from_pretrained(folder, torch_dtype=dtype, local_files_only=True)
    except (OSError, ValueError, EnvironmentError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UserError(f"--model {path}: cannot load {cls_name}: {first}") from None
    return model.to(device).eval().requires_grad_(False)


# ---------------------------------------------------------------------------------------------
# Weight layout


def conv_weights_channels_last(module: nn.Module) -> list[nn.Conv2d]:
    """Stores the weight of every Conv2d in ``module`` channels_last, in place (values unchanged);
    returns the convolutions whose weight changed layout (``restore_conv_weights`` undoes it).
    PyTorch's convolutions answer channels_last when their weight is, even for NCHW input, so the
    activations between convolutions follow (what ``module.to(memory_format=torch.channels_last)``
    aims at, without its failure on the 5-D weights of temporal Conv3d layers). Under torch.compile this
    also spares inductor, which runs convolutions channels_last on GPUs, a relayout copy of every conv
    weight on every call (the weights are graph inputs, not constants)."""
    changed = []
    try:
        with torch.no_grad():
            for m in module.modules():
                if isinstance(m, nn.Conv2d) and not m.weight.is_contiguous(memory_format=torch.channels_last):
                    m.weight.data = m.weight.data.contiguous(memory_format=torch.channels_last)
                    changed.append(m)
    except BaseException:  # e.g. out of memory halfway: leave the module as it was
        restore_conv_weights(changed)
        raise
    return changed


def restore_conv_weights(convs: list[nn.Conv2d]) -> None:
    """Puts the weights changed by ``conv_weights_channels_last`` back in the default (NCHW) layout."""
    with torch.no_grad():
        for m in convs:
            m.weight.data = m.weight.data.contiguous()


# ---------------------------------------------------------------------------------------------
# Example inputs


def unet_inputs(unet, *, batch: int = 1, frames: int | None = None, height: int = 64, width: int = 64,
                vae_scale_factor: int = 8, dtype=torch.float32, device="cpu", seed: int = 0,
                cfg: bool = True) -> dict:
    """Keyword inputs for one denoising step of a video UNet, shaped as its pipeline calls it
    (classifier-free guidance doubles the batch). Supports the SVD UNet, UNet3DConditionModel
    (text-to-video) and UNetMotionModel (AnimateDiff)."""
    cfg_u = unet.config
    frames = frames or getattr(cfg_u, "num_frames", 8) or 8
    h, w = height // vae_scale_factor, width // vae_scale_factor
    if h < 1 or w < 1:
        raise UserError(f"--height/--width {height}x{width} is smaller than one latent pixel "
                        f"(the VAE downsamples by {vae_scale_factor})")
    b = 2 * batch if cfg else batch
    g = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=g).to(device=device, dtype=dtype)

    name = type(unet).__name__
    cross = cfg_u.cross_attention_dim
    cross = cross[0] if isinstance(cross, (list, tuple)) else cross
    t = torch.tensor(500.0 if name == "UNetSpatioTemporalConditionModel" else 500, device=device)
    if name == "UNetSpatioTemporalConditionModel":
        time_ids = torch.tensor([[6.0, 127.0, 0.02]], device=device, dtype=dtype).repeat(b, 1)
        return dict(sample=randn(b, frames, cfg_u.in_channels, h, w), timestep=t,
                    encoder_hidden_states=randn(b, 1, cross), added_time_ids=time_ids)
    # UNet3DConditionModel / UNetMotionModel: (B, C, F, H, W) with per-frame-shared text states.
    return dict(sample=randn(b, cfg_u.in_channels, frames, h, w), timestep=t,
                encoder_hidden_states=randn(b, 77, cross))


def vae_scale_factor_of_dir(path: str) -> int:
    """The VAE's downsampling of a local pipeline directory (vae/config.json), else SVD's 8."""
    cfg = os.path.join(path, "vae", "config.json")
    try:
        return 2 ** (len(_read_config(cfg)["block_out_channels"]) - 1)
    except (OSError, ValueError, KeyError, TypeError):
        return 8


def vae_scale_factor_of(preset: Preset | None) -> int:
    if preset is None:
        return 8
    return 2 ** (len(preset.vae["block_out_channels"]) - 1)
