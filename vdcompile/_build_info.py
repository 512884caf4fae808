"""What the installed extension was built with, read from the dispatcher (not from the hardware)."""
from __future__ import annotations

import functools

import torch


@functools.lru_cache(maxsize=None)
def built_backends(op: str) -> frozenset[str]:
    """Dispatch keys with a kernel for ``vd::<op>`` (e.g. {"CPU", "CUDA"})."""
    dump = torch._C._dispatch_dump(f"vd::{op}")
    keys = set()
    for line in dump.splitlines():
        key = line.split(":", 1)[0].strip()
        if key in ("CPU", "CUDA"):
            keys.add(key)
    return frozenset(keys)


def has_cuda_kernels(op: str = "fused_attention") -> bool:
    """True when the extension was built with a CUDA kernel for ``vd::<op>``."""
    return "CUDA" in built_backends(op)
