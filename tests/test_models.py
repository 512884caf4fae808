"""Real diffusers video UNets (small random configs, built in code): compiled with the vdcompile
backend (fullgraph, inner compiler "eager" to keep CI short; the rewritten graph is what is under
test), outputs match eager, each rewrite fired the expected number of times, and three calls with
different timesteps cause no recompilation.

Tolerance: float32, atol = rtol = 1e-4 on outputs of magnitude ~1 (the vd kernels accumulate in
float32/float64 in another order than eager: observed differences are ~1e-6).
"""
from __future__ import annotations

import copy

import pytest
import torch
from diffusers import (AutoencoderKLTemporalDecoder, UNet2DConditionModel, UNet3DConditionModel, UNetMotionModel,
                       UNetSpatioTemporalConditionModel)

import vdcompile  # noqa: F401
from tests.backend_checks import BACKEND, capture_rewrites
from vdcompile import built_backends
from vdcompile.passes import FAMILIES
from vdcompile.passes._common import Report

ATOL = RTOL = 1e-4
# bf16 on CUDA: eager bf16 is no exact reference either. Both are measured against the float32
# model on the same inputs; the compiled model's relative error (||out - ref32|| / ||ref32||) must
# stay within BF16_FACTOR times eager bf16's own, plus BF16_SLACK.
BF16_FACTOR, BF16_SLACK = 2.0, 1e-3


def _cuda_reason():
    if "CUDA" not in built_backends("group_norm_silu"):
        return "the vd ops were built without CUDA kernels"
    return "" if torch.cuda.is_available() else "no CUDA device visible"


# (device, dtype): the float32 CPU run in CI, the bf16 CUDA run where a CUDA build and a GPU exist.
DD = pytest.mark.parametrize("dd", [
    pytest.param(("cpu", torch.float32), id="cpu-fp32"),
    pytest.param(("cuda", torch.bfloat16), id="cuda-bf16",
                 marks=pytest.mark.skipif(bool(_cuda_reason()), reason=_cuda_reason() or "-")),
])

# The op each family emits; a family whose op has no CPU kernel in this build must refuse every
# candidate with that reason instead of firing.
_OP = {"attention": "fused_attention", "group_norm_silu": "group_norm_silu", "temporal_conv": "temporal_conv",
       "conv_bn_silu": "conv_bn_silu", "strided_attention": "strided_attention", "scheduler_step": "scheduler_step"}


def _check_report(report: Report, expected: dict, device: str = "cpu"):
    key = device.upper()
    for fam in FAMILIES:
        n = expected.get(fam, 0)
        op = _OP.get(fam)
        if op is not None and key not in built_backends(op):
            assert report.fired.get(fam, 0) == 0, fam
            missing = sum(c for r, c in report.rejected.get(fam, {}).items() if f"no {device} kernel" in r)
            assert missing == n, f"{fam}: {missing} refused for the missing kernel, expected {n}"
        else:
            assert report.fired.get(fam, 0) == n, (
                f"{fam} fired {report.fired.get(fam, 0)}, expected {n}; rejected {report.rejected.get(fam)}")


def _sample(out):
    return out.sample if hasattr(out, "sample") else out


def _to(x, device, dtype):
    if isinstance(x, torch.Tensor):
        return x.to(device, dtype) if x.is_floating_point() and x.dim() > 0 else x.to(device)
    return x


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def _run(model, make_args, expected: dict, steps=(999.0, 500.0, 1.0), dd=("cpu", torch.float32), model32=None):
    """Compiles once, calls with three timesteps, compares each call with eager (and, in bf16, both
    with the float32 model ``model32``: by default a float32 copy of ``model``)."""
    device, dtype = dd
    if isinstance(model, torch.nn.Module):
        if dtype != torch.float32 and model32 is None:
            model32 = copy.deepcopy(model).to(device)
        model.to(device, dtype)
    with capture_rewrites(reset=True) as sink:
        # attention_kernels="vd": every attention goes to the vd op, on CUDA too, so the counts and
        # the kernels under test are the same on both devices.
        compiled = torch.compile(model, backend=BACKEND, fullgraph=True,
                                 options={"inner_compiler": "eager", "attention_kernels": "vd"})
        with torch.no_grad(), torch._dynamo.config.patch(error_on_recompile=True):
            for i, t in enumerate(steps):
                args, kwargs = make_args(torch.tensor(t), seed=i)
                args = tuple(_to(a, device, dtype) for a in args)
                out = _sample(compiled(*args, **kwargs))
                ref = _sample(model(*args, **kwargs))
                if dtype == torch.float32:
                    torch.testing.assert_close(out, ref, atol=ATOL, rtol=RTOL)
                else:
                    assert out.dtype == ref.dtype and torch.isfinite(out).all()
                    args32 = tuple(_to(a, device, torch.float32) for a in args)
                    ref32 = _sample(model32(*args32, **kwargs))
                    ours, theirs = _rel(out, ref32), _rel(ref, ref32)
                    assert ours <= BF16_FACTOR * theirs + BF16_SLACK, (
                        f"bf16 relative error vs float32: compiled {ours:.3e}, eager {theirs:.3e}")
    assert len(sink) == 1, f"{len(sink)} graphs: a graph break or a recompilation"
    _check_report(sink[0][0], expected, device)


def _gen(seed):
    return torch.Generator().manual_seed(seed)


@DD
def test_svd_unet_spatio_temporal(dd):
    torch.manual_seed(0)
    unet = UNetSpatioTemporalConditionModel(
        sample_size=8, in_channels=8, out_channels=4,
        down_block_types=("CrossAttnDownBlockSpatioTemporal", "DownBlockSpatioTemporal"),
        up_block_types=("UpBlockSpatioTemporal", "CrossAttnUpBlockSpatioTemporal"),
        block_out_channels=(32, 64), addition_time_embed_dim=8, projection_class_embeddings_input_dim=24,
        layers_per_block=1, cross_attention_dim=32, num_attention_heads=(2, 4), num_frames=3).eval()

    def args(t, seed):
        g = _gen(seed)
        # One CLIP image token per video: every cross-attention has a single key.
        return (torch.randn(1, 3, 8, 8, 8, generator=g), t, torch.randn(1, 1, 32, generator=g),
                torch.randn(1, 3, generator=g)), {}

    # 4 transformer blocks (spatial + temporal, down and up) x (self, cross); cross has one key.
    _run(unet, args, {"attention": 8, "single_key_attention": 8, "group_norm_silu": 33, "temporal_conv": 16,
                      "qkv_projection": 6}, dd=dd)


@DD
def test_unet3d_text_to_video(dd):
    torch.manual_seed(0)
    unet = UNet3DConditionModel(
        sample_size=8, in_channels=4, out_channels=4,
        down_block_types=("CrossAttnDownBlock3D", "DownBlock3D"), up_block_types=("UpBlock3D", "CrossAttnUpBlock3D"),
        block_out_channels=(32, 64), layers_per_block=1, norm_num_groups=8, cross_attention_dim=32,
        attention_head_dim=8).eval()

    def args(t, seed):
        g = _gen(seed)
        return (torch.randn(1, 4, 3, 8, 8, generator=g), t, torch.randn(1, 5, 32, generator=g)), {}

    _run(unet, args, {"attention": 18, "group_norm_silu": 49, "temporal_conv": 32, "qkv_projection": 9}, dd=dd)


@DD
def test_unet_motion_animatediff(dd):
    torch.manual_seed(0)
    unet = UNetMotionModel(
        block_out_channels=(32, 64), norm_num_groups=8, in_channels=4, out_channels=4, sample_size=8,
        down_block_types=("CrossAttnDownBlockMotion", "DownBlockMotion"),
        up_block_types=("UpBlockMotion", "CrossAttnUpBlockMotion"),
        cross_attention_dim=32, num_attention_heads=2, layers_per_block=1).eval()

    def args(t, seed):
        g = _gen(seed)
        # AnimateDiff's pipeline repeats the prompt embedding per frame.
        return (torch.randn(1, 4, 3, 8, 8, generator=g), t, torch.randn(3, 5, 32, generator=g)), {}

    _run(unet, args, {"attention": 22, "group_norm_silu": 17, "qkv_projection": 9}, dd=dd)


@DD
def test_unet2d_condition(dd):
    torch.manual_seed(0)
    unet = UNet2DConditionModel(
        sample_size=8, in_channels=4, out_channels=4,
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"), up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        block_out_channels=(32, 64), layers_per_block=1, norm_num_groups=8, cross_attention_dim=32,
        attention_head_dim=8).eval()

    def args(t, seed):
        g = _gen(seed)
        return (torch.randn(2, 4, 8, 8, generator=g), t, torch.randn(2, 5, 32, generator=g)), {}

    _run(unet, args, {"attention": 8, "group_norm_silu": 17, "qkv_projection": 3}, dd=dd)


@DD
def test_svd_temporal_vae_decoder(dd):
    torch.manual_seed(0)
    vae = AutoencoderKLTemporalDecoder(
        in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 2, block_out_channels=(32, 64),
        layers_per_block=1, latent_channels=4).eval()

    vae32 = copy.deepcopy(vae).to(dd[0])
    vae.to(*dd)

    def decode(z, scale):
        return vae.decode(z * scale, num_frames=3).sample

    def decode32(z, scale):
        return vae32.decode(z * scale, num_frames=3).sample

    def args(t, seed):
        # No timestep in a VAE: the scalar argument plays its part (a 0-d tensor changing per call).
        return (torch.randn(3, 4, 4, 4, generator=_gen(seed)), t / 1000), {}

    _run(decode, args, {"group_norm_silu": 21, "temporal_conv": 11}, dd=dd, model32=decode32)


@pytest.mark.skipif("CPU" not in built_backends("fused_attention"), reason="no CPU fused_attention kernel")
def test_unet2d_training_gradients():
    """Training: forward and parameter gradients through the vd ops' autograd formulas (AOTAutograd)."""
    torch.manual_seed(0)
    unet = UNet2DConditionModel(
        sample_size=8, in_channels=4, out_channels=4, down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"), block_out_channels=(32, 64), layers_per_block=1,
        norm_num_groups=8, cross_attention_dim=32, attention_head_dim=8)
    g = _gen(0)
    x, ehs = torch.randn(2, 4, 8, 8, generator=g), torch.randn(2, 5, 32, generator=g)
    seed = torch.randn(2, 4, 8, 8, generator=g)
    with capture_rewrites(reset=True) as sink:
        compiled = torch.compile(unet, backend=BACKEND, fullgraph=True,
                                 options={"inner_compiler": "aot_eager", "attention_kernels": "vd"})
        out = compiled(x, torch.tensor(10.0), ehs).sample
        grads = torch.autograd.grad(out, list(unet.parameters()), seed)
    ref = unet(x, torch.tensor(10.0), ehs).sample
    ref_grads = torch.autograd.grad(ref, list(unet.parameters()), seed)
    torch.testing.assert_close(out, ref, atol=ATOL, rtol=RTOL)
    for (name, _), a, b in zip(unet.named_parameters(), grads, ref_grads):
        torch.testing.assert_close(a, b, atol=1e-3, rtol=1e-3, msg=lambda m: f"{name}: {m}")
    fired = sink[0][0].fired
    assert fired["attention"] == 8 and fired["group_norm_silu"] == 17, fired


def test_conv_weights_channels_last_leaves_temporal_convs_and_values():
    from vdcompile.models import conv_weights_channels_last, restore_conv_weights

    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3, padding=1), torch.nn.Conv3d(4, 4, (3, 1, 1)),
                            torch.nn.Linear(4, 4))
    x = torch.randn(1, 3, 8, 8)
    ref = m[0](x)
    w3d = m[1].weight.data.clone()
    assert conv_weights_channels_last(m) == [m[0]]  # Module.to(memory_format=channels_last) raises on the Conv3d
    assert m[0].weight.is_contiguous(memory_format=torch.channels_last) and not m[0].weight.is_contiguous()
    assert m[1].weight.is_contiguous() and torch.equal(m[1].weight, w3d)
    y = m[0](x)
    assert y.is_contiguous(memory_format=torch.channels_last)  # the activations follow the weight
    torch.testing.assert_close(y, ref)
    assert conv_weights_channels_last(m) == []  # already channels_last: nothing to change
    restore_conv_weights([m[0]])
    assert m[0].weight.is_contiguous() and m[0](x).is_contiguous()
    torch.testing.assert_close(m[0](x), ref)


@pytest.mark.skipif(not torch.cuda.is_available() or "CUDA" not in built_backends("group_norm_silu"),
                    reason="needs a GPU and the CUDA kernels")
@pytest.mark.parametrize("weights_channels_last", [False, True])
def test_svd_unet_on_cuda_matches_eager(weights_channels_last):
    """Inductor's own layouts around the vd ops on a GPU (channels_last convolutions, group_norm_silu
    tagged flexible_layout), with and without channels_last conv weights: the compiled UNet must agree
    with eager in float32 (TF32 off on both sides)."""
    from vdcompile.models import build_unet, conv_weights_channels_last, unet_inputs

    old = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        unet = build_unet("tiny", device="cuda")
        if weights_channels_last:
            assert conv_weights_channels_last(unet)
        inputs = unet_inputs(unet, frames=4, height=64, width=64, device="cuda")
        with torch.no_grad():
            ref = unet(**inputs).sample
            with capture_rewrites(reset=True) as sink:
                out = torch.compile(unet, backend=BACKEND)(**inputs).sample
        assert sink[0][0].fired.get("group_norm_silu", 0) > 0
        torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old
        torch._dynamo.reset()


def test_conv_weights_channels_last_undoes_a_partial_conversion():
    from vdcompile.models import conv_weights_channels_last

    convs = [torch.nn.Conv2d(3, 4, 3), torch.nn.Conv2d(4, 4, 3)]

    class Failing(torch.nn.Module):  # fails after the first convolution was converted (say, out of memory)
        def modules(self):
            yield convs[0]
            raise RuntimeError("out of memory")

    with pytest.raises(RuntimeError, match="out of memory"):
        conv_weights_channels_last(Failing())
    assert convs[0].weight.is_contiguous() and not convs[0].weight.is_contiguous(memory_format=torch.channels_last)
