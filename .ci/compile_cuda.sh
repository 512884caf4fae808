#!/usr/bin/env bash
# Compile-only check of every csrc/cuda/*.cu for sm_90a against the installed torch's headers, so CUDA
# compile errors show up on machines without a GPU or a CUDA build of torch.
set -euo pipefail
cd "$(dirname "$0")/.."
if ! command -v nvcc >/dev/null 2>&1; then
  echo "compile_cuda: nvcc not found, skipping the CUDA compile check"
  exit 0
fi
shopt -s nullglob
files=(csrc/cuda/*.cu)
if [ ${#files[@]} -eq 0 ]; then
  echo "compile_cuda: no .cu files"
  exit 0
fi
TI=$(python -c "import torch, os; print(os.path.join(os.path.dirname(torch.__file__), 'include'))")
PI=$(python -c "import sysconfig; print(sysconfig.get_paths()['include'])")
shim=$(mktemp -d)
trap 'rm -rf "$shim"' EXIT
# A CPU wheel of torch ships the c10/cuda headers but not the one its CMake build generates.
if [ ! -f "$TI/c10/cuda/impl/cuda_cmake_macros.h" ]; then
  mkdir -p "$shim/c10/cuda/impl"
  printf '#pragma once\n#define C10_CUDA_BUILD_SHARED_LIBS\n' > "$shim/c10/cuda/impl/cuda_cmake_macros.h"
fi
jobs=${MAX_JOBS:-$(nproc)}
printf '%s\n' "${files[@]}" | xargs -P "$jobs" -I{} sh -c '
  echo "nvcc sm_90a: {}"
  nvcc -c -std=c++20 -O1 -gencode=arch=compute_90a,code=sm_90a -DVD_WITH_CUDA -DVD_SM90A \
    -I"$0" -I"$1" -I"$1/torch/csrc/api/include" -I"$2" --expt-relaxed-constexpr \
    -U__CUDA_NO_HALF_OPERATORS__ -U__CUDA_NO_HALF_CONVERSIONS__ -U__CUDA_NO_BFLOAT16_CONVERSIONS__ \
    -Xcompiler -w {} -o "$0/$(basename {}).o"
' "$shim" "$TI" "$PI"
echo "compile_cuda: ${#files[@]} file(s) compiled for sm_90a"
