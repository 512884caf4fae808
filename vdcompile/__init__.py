"""vdcompile: fused kernels and a torch.compile backend for video-diffusion models.

Importing the package loads the compiled extension ``vdcompile._C``, which registers the ``vd``
operator library (``torch.ops.vd.*``), and the Python side of every op (fake kernels, autograd).
"""
from __future__ import annotations

import torch  # noqa: F401  (loads libtorch before the extension)

from vdcompile import _C  # noqa: F401  (registers the vd schemas and kernels)
from vdcompile import ops  # noqa: F401  (fake kernels and autograd formulas)
from vdcompile._build_info import built_backends, has_cuda_kernels
from vdcompile.backend import vdcompile_backend
# Binds the name to the function (the submodule vdcompile.explain stays in sys.modules).
from vdcompile.explain import explain
from vdcompile.optimize import optimize

__version__ = "0.1.0"

__all__ = ["ops", "built_backends", "has_cuda_kernels", "vdcompile_backend", "explain", "optimize", "__version__"]
