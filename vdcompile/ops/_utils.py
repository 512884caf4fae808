"""Helpers shared by the op modules: the layout rule the kernels follow, mirrored for fake kernels."""
from __future__ import annotations

import torch


def channels_last_layout(x: torch.Tensor) -> bool:
    """Same rule as csrc/layout.h: channels_last 4-D/5-D inputs (not plain contiguous) stay so."""
    if x.is_contiguous():
        return False
    if x.dim() == 4:
        return x.is_contiguous(memory_format=torch.channels_last)
    if x.dim() == 5:
        return x.is_contiguous(memory_format=torch.channels_last_3d)
    return False


def frames_major_layout(x: torch.Tensor) -> bool:
    """Same rule as csrc/layout.h: a 5-D (B, C, F, H, W) view of contiguous (B, F, C, H, W) memory."""
    return (x.dim() == 5 and not x.is_contiguous() and not channels_last_layout(x)
            and x.transpose(1, 2).is_contiguous())


def empty_frames_major(shape, like: torch.Tensor, dtype=None) -> torch.Tensor:
    """An empty (B, C, F, H, W) tensor with frames-major memory."""
    B, C, F, H, W = shape
    return like.new_empty((B, F, C, H, W), dtype=dtype or like.dtype).transpose(1, 2)


def layout_memory_format(x: torch.Tensor) -> torch.memory_format:
    if channels_last_layout(x):
        return torch.channels_last if x.dim() == 4 else torch.channels_last_3d
    return torch.contiguous_format


def empty_in_layout(x: torch.Tensor, shape=None, dtype=None) -> torch.Tensor:
    """An empty tensor with x's layout rule applied (the fake-kernel twin of the C++ kernels)."""
    shape = x.shape if shape is None else shape
    return torch.empty(shape, dtype=dtype or x.dtype, device=x.device,
                       memory_format=layout_memory_format(x))


FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The kernels' accumulation dtype (and that of their float side outputs such as attention's
    lse): float32, float64 for float64 inputs."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def grads_for(ctx, *grads):
    """Backward return value: one entry per input actually passed (an op called without its trailing
    defaults sees fewer inputs), None where the input needs no gradient."""
    need = ctx.needs_input_grad
    return tuple(g if n else None for g, n in zip(grads, need))


def pad_inputs(inputs, n_required, defaults):
    """The op's full argument tuple: ``inputs`` as passed, plus the schema defaults of the trailing
    arguments the caller left out (``defaults`` are the values of the args after the required ones)."""
    given_optional = len(inputs) - n_required
    return tuple(inputs) + tuple(defaults[given_optional:])
