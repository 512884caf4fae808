"""Builds vdcompile._C: CPU sources always, CUDA sources when torch has CUDA and a toolkit is found."""
import glob
import os

import torch
from setuptools import setup
from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension

ROOT = os.path.dirname(os.path.abspath(__file__))


def _want_cuda() -> bool:
    # Decided by the installed torch and toolkit, not by a visible GPU: a build box needs none.
    if os.environ.get("VDCOMPILE_NO_CUDA") == "1":
        return False
    return torch.version.cuda is not None and CUDA_HOME is not None


def _cuda_arch_flags() -> list[str]:
    """-gencode flags: TORCH_CUDA_ARCH_LIST if set, else the visible GPU's; Hopper gets sm_90a."""
    archs = os.environ.get("TORCH_CUDA_ARCH_LIST")
    if archs:
        archs = archs.replace(";", " ").replace(",", " ").split()
    elif torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability()
        archs = [f"{major}.{minor}"]
    else:
        archs = ["8.0", "9.0"]
    flags = []
    for a in archs:
        a = a.replace("+PTX", "")
        num = a.replace(".", "").lower()
        if num == "90":
            num = "90a"  # wgmma / TMA need the arch-specific target
        flags.append(f"-gencode=arch=compute_{num},code=sm_{num}")
    return flags


def _extension():
    sources = [os.path.relpath(p, ROOT) for p in ["csrc/ops.cpp", "csrc/autograd.cpp",
                                                        *sorted(glob.glob("csrc/cpu/*.cpp"))]]
    # No -std flag: torch adds the standard it was built with (C++17 for 2.11, C++20 for 2.13).
    cxx = ["-O3", "-fopenmp"] if os.name != "nt" else ["/O2"]
    define_macros = []
    if _want_cuda():
        sources += [os.path.relpath(p, ROOT) for p in sorted(glob.glob("csrc/cuda/*.cu"))]
        nvcc = ["-O3", "-lineinfo", "--expt-relaxed-constexpr",
                "-U__CUDA_NO_HALF_OPERATORS__", "-U__CUDA_NO_HALF_CONVERSIONS__",
                "-U__CUDA_NO_BFLOAT16_CONVERSIONS__", *_cuda_arch_flags()]
        define_macros.append(("VD_WITH_CUDA", None))
        if any("sm_90a" in f for f in nvcc):
            define_macros.append(("VD_SM90A", None))  # the Hopper kernels (wgmma, TMA) are in this build
        # torch adds no arch flags of its own when nvcc's flags already carry -gencode.
        return CUDAExtension("vdcompile._C", sources, define_macros=define_macros,
                             extra_compile_args={"cxx": cxx, "nvcc": nvcc}, extra_link_args=["-fopenmp"])
    return CppExtension("vdcompile._C", sources, define_macros=define_macros,
                        extra_compile_args={"cxx": cxx}, extra_link_args=["-fopenmp"])


setup(
    ext_modules=[_extension()],
    cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)},
)
