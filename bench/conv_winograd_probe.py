"""What a non-fused Winograd F(2x2, 3x3) convolution would cost on this GPU, before writing its kernels.

For each 3x3 UNet shape (channels_last) it times, in one process:
- cuDNN's convolution as eager runs it (torch.backends.cudnn.benchmark off) and with benchmark on
  (cuDNN's own search, which may pick its Winograd kernels);
- the 16 batched products of F(2x2, 3x3): V (16, P, C_in) @ U (16, C_in, C_out), P = N * ceil(H/2) * ceil(W/2),
  through cuBLAS (torch.bmm) with float32 output for 16-bit operands, and TF32 for float32;
- the transforms' floor: bytes moved (x in, V out; M in, y out) over the measured copy bandwidth.
and checks a torch-op prototype of the whole algorithm against F.conv2d (max error over max |y|).

    python bench/conv_winograd_probe.py [--dtypes bf16,fp16,fp32]
"""
from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from common import DTYPES, environment, measure_ceilings, print_table, time_cuda, write_json
from winograd_error import AT, BT, G  # F(2x2, 3x3)'s transforms

SHAPES = [(28, 1280, 18, 32), (28, 1280, 9, 16), (28, 640, 36, 64), (2, 1280, 18, 32)]


def wino_prototype(x: torch.Tensor, w: torch.Tensor, op_dtype: torch.dtype) -> torch.Tensor:
    """F(2x2, 3x3), padding 1, in torch ops: transforms in float32, operands rounded to op_dtype."""
    N, C, H, W = x.shape
    TH, TW = (H + 1) // 2, (W + 1) // 2
    xp = F.pad(x.float(), (1, 2 * TW - W + 1, 1, 2 * TH - H + 1))  # (N, C, 2TH + 2, 2TW + 2)
    d = xp.unfold(2, 4, 2).unfold(3, 4, 2)  # (N, C, TH, TW, 4, 4)
    bt, g, at = BT.float().to(x.device), G.float().to(x.device), AT.float().to(x.device)
    v = torch.einsum("ij,nctkjl,ml->ntkcim", bt, d, bt).reshape(N * TH * TW, C, 16)
    v = v.permute(2, 0, 1).to(op_dtype)  # (16, P, C)
    u = torch.einsum("ij,ocjl,ml->ocim", g, w.float(), g).reshape(w.shape[0], C, 16)
    u = u.permute(2, 1, 0).to(op_dtype)  # (16, C_in, C_out)
    m = torch.bmm(v, u, out_dtype=torch.float32) if op_dtype != torch.float32 else torch.bmm(v, u)
    m = m.reshape(4, 4, N, TH, TW, -1)
    y = torch.einsum("ai,ijntkc,bj->nctakb", at, m, at).reshape(N, -1, 2 * TH, 2 * TW)
    return y[:, :, :H, :W]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtypes", default="bf16,fp16,fp32")
    args = ap.parse_args()
    dev = torch.device("cuda")
    ceil = measure_ceilings(dev)
    bw = ceil["copy_GBps"] * 1e9
    rows = []
    for dname in args.dtypes.split(","):
        dt = DTYPES[dname]
        for N, C, H, W in SHAPES:
            torch.manual_seed(0)
            x = torch.randn(N, C, H, W, device=dev, dtype=dt).contiguous(memory_format=torch.channels_last)
            w = (torch.randn(C, C, 3, 3, device=dev) / (3 * C ** 0.5)).to(dt).contiguous(
                memory_format=torch.channels_last)
            torch.backends.cudnn.benchmark = False
            t_eager = time_cuda(lambda i: F.conv2d(x, w, padding=1))
            torch.backends.cudnn.benchmark = True
            F.conv2d(x, w, padding=1)
            t_bench = time_cuda(lambda i: F.conv2d(x, w, padding=1))
            torch.backends.cudnn.benchmark = False
            P = N * ((H + 1) // 2) * ((W + 1) // 2)
            v = torch.randn(16, P, C, device=dev, dtype=dt)
            u = torch.randn(16, C, C, device=dev, dtype=dt)
            ut = u.transpose(1, 2).contiguous().transpose(1, 2)  # K-major weight, as the op would cache it
            if dt == torch.float32:
                old = torch.backends.cuda.matmul.allow_tf32
                torch.backends.cuda.matmul.allow_tf32 = True
                t_gemm = time_cuda(lambda i: torch.bmm(v, ut))
                torch.backends.cuda.matmul.allow_tf32 = old
                t_gemm16 = float("nan")
            else:
                t_gemm = time_cuda(lambda i: torch.bmm(v, ut, out_dtype=torch.float32))
                t_gemm16 = time_cuda(lambda i: torch.bmm(v, ut))
            es = x.element_size()
            in_bytes = x.numel() * es + 16 * P * C * es
            out_bytes = 16 * P * C * 4 + x.numel() * es
            t_in, t_out = in_bytes / bw * 1e3, out_bytes / bw * 1e3
            ref = F.conv2d(x.double(), w.double(), padding=1)
            with torch.backends.cudnn.flags(allow_tf32=True):
                direct = F.conv2d(x, w, padding=1).double()
            if dt == torch.float32:
                torch.backends.cuda.matmul.allow_tf32 = True
            wino = wino_prototype(x, w, dt).double()
            torch.backends.cuda.matmul.allow_tf32 = False
            scale = ref.abs().max().item()
            flops_wino = 2 * 16 * P * C * C
            rows.append(dict(shape=f"{N}x{C}x{H}x{W}", dtype=dname, eager_ms=t_eager, cudnn_benchmark_ms=t_bench,
                             gemm_ms=t_gemm, gemm_out16_ms=t_gemm16, gemm_TFLOPs=flops_wino / t_gemm / 1e9,
                             transforms_floor_ms=t_in + t_out, wino_est_ms=t_gemm + t_in + t_out,
                             est_x_eager=t_eager / (t_gemm + t_in + t_out),
                             err_direct=(direct - ref).abs().max().item() / scale,
                             err_wino=(wino - ref).abs().max().item() / scale))
            print(rows[-1], flush=True)
    print_table(rows, [("shape", "shape", "s"), ("dtype", "dtype", "s"), ("eager_ms", "eager", ".4f"),
                       ("cudnn_benchmark_ms", "cudnn bench", ".4f"), ("gemm_ms", "gemm", ".4f"),
                       ("gemm_out16_ms", "gemm out16", ".4f"), ("gemm_TFLOPs", "TFLOP/s", ".0f"),
                       ("transforms_floor_ms", "transforms", ".4f"), ("wino_est_ms", "est", ".4f"),
                       ("est_x_eager", "est x eager", ".2f"), ("err_direct", "err direct", ".2e"),
                       ("err_wino", "err wino", ".2e")])
    print(write_json("conv_winograd_probe", {"environment": environment(dev), "ceilings": ceil, "rows": rows}))


if __name__ == "__main__":
    main()
