"""Conv3d with a (k, 1, 1) kernel => vd::temporal_conv (a convolution over the frame axis only)."""
from __future__ import annotations

import os

import torch

from vdcompile.passes._common import SKIP, Match, Rewrite, hopper_kernels, kernel_missing, requires_grad, static_int

FAMILY = "temporal_conv"


# diffusers TemporalConvLayer (UNet3DConditionModel, text-to-video): nn.Conv3d(c, c, (3, 1, 1),
# padding=(1, 0, 0)); TemporalResnetBlock (SVD's SpatioTemporalResBlock): nn.Conv3d(c, c,
# kernel_size=(3, 1, 1), padding=(1, 0, 0)).
def _pattern_1(x, weight, bias, stride, padding, dilation, groups):
    return torch.conv3d(x, weight, bias, stride, padding, dilation, groups)


def _replacement_1(x, weight, bias, pad):
    # The bias is left to the graph: inductor folds the add into the pointwise op that follows (the
    # time-embedding add or the residual add of a temporal res block), where inside the op it costs
    # a pass over the output (cuBLAS reads it back as the GEMM's beta = 1 input).
    y = torch.ops.vd.temporal_conv.default(x, weight, None, pad)
    return y if bias is None else y + bias.view(1, -1, 1, 1, 1)


def _triple(v):
    if isinstance(v, int) and not isinstance(v, bool):
        return (v, v, v)
    if isinstance(v, (tuple, list)) and len(v) == 1:
        return tuple(v) * 3
    return tuple(v) if isinstance(v, (tuple, list)) else None


def _check(m: Match):
    x, w, b = m.val("x"), m.val("weight"), m.val("bias")
    if not isinstance(x, torch.Tensor) or not isinstance(w, torch.Tensor) or w.dim() != 5:
        return "weight is not a 5-D tensor"
    if (static_int(w.shape[3]), static_int(w.shape[4])) != (1, 1):
        return SKIP  # a conv3d with a spatial extent is no candidate: nothing to report
    k = static_int(w.shape[2])
    if x.dim() != 5:
        return "input is not 5-D (B, C, F, H, W)"
    if _triple(m["stride"]) != (1, 1, 1) or _triple(m["dilation"]) != (1, 1, 1):
        return "stride or dilation is not 1"
    if m["groups"] != 1:
        return "groups != 1"
    padding = m["padding"]
    if padding == "valid":
        padding = 0
    elif padding == "same":
        if k is None or k % 2 == 0:
            return "padding='same' with an even kernel (asymmetric)"
        padding = (k // 2, 0, 0)
    pad = _triple(padding)
    if pad is None or not all(isinstance(p, int) for p in pad) or pad[1:] != (0, 0):
        return "padding is not (p, 0, 0)"
    m.extra["pad"] = pad[0]
    return kernel_missing("temporal_conv", x, w, b) or _tf32_mismatch(m, x)


def _tf32_mismatch(m: Match, x) -> str | None:
    # Eager's float32 Conv3d runs TF32 on cuDNN (its default). So does the op's forward where its Hopper kernel
    # takes the input (its TF32 build follows cuDNN's switch); elsewhere, and in the backward, its float32 GEMMs
    # follow the matmul flag (IEEE by default): 3-5x slower than the convolution it would replace (H200,
    # bench/notes/conv.md).
    if (x.device.type == "cuda" and x.dtype == torch.float32 and torch.backends.cudnn.allow_tf32
            and not torch.backends.cuda.matmul.allow_tf32 and not _tf32_kernel_takes(m, x)):
        return ("float32 on CUDA: the Conv3d runs TF32 (torch.backends.cudnn.allow_tf32) but the op's GEMMs "
                "would not (torch.backends.cuda.matmul.allow_tf32 is off; the op's TF32 kernel is forward only and "
                "takes sm_90a, contiguous or frames-major x with pixel rows W apart, H*W and C_in multiples of 8, and "
                "not VD_TEMPORAL_CONV_KERNEL=gemm)")
    return None


def _tf32_kernel_takes(m: Match, x) -> bool:
    """The op's TF32 Hopper kernel serves the whole call (csrc/cuda/temporal_conv.cu, temporal_conv_wgmma): no
    gradient needed (compiled under no_grad, or nothing requires grad: the backward's GEMMs are cuBLAS's), an sm_90a
    build on a compute-capability 9.0 device, VD_TEMPORAL_CONV_KERNEL not "gemm" (read as the op reads it, at
    compile time here), x contiguous or frames-major ((B, F, C, H, W) memory) with its pixel rows W elements apart
    (also where H is 1: is_contiguous() ignores a size-1 dimension's stride, the kernel's tensor map does not),
    H * W and C_in multiples of 8."""
    grad = m.ctx.grad_enabled if m.ctx is not None else torch.is_grad_enabled()
    if grad and any(requires_grad(m[name]) for name in ("x", "weight", "bias")):
        return False
    if os.environ.get("VD_TEMPORAL_CONV_KERNEL") == "gemm":
        return False
    c, h, w = (static_int(x.shape[i]) for i in (1, 3, 4))
    if c is None or h is None or w is None or (h * w) % 8 != 0 or c % 8 != 0 or not hopper_kernels(x.device):
        return False
    if static_int(x.stride(4)) != 1 or static_int(x.stride(3)) != w:
        return False
    return x.is_contiguous() or x.transpose(1, 2).is_contiguous()


REWRITES = [Rewrite(FAMILY, "conv3d_k11", _pattern_1, _replacement_1, _check)]
