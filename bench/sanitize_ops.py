"""A representative set of CUDA calls of every vd op (forward and backward), small enough to run under
compute-sanitizer (memcheck, racecheck):

    compute-sanitizer --tool memcheck python bench/sanitize_ops.py [FAMILY ...] [--dtypes=bf16,fp16,fp32]

FAMILY (attention, group_norm_silu, conv_bn_silu, temporal_conv, scheduler_step) limits the run to those
families; default: all (in bf16 and fp32, or the --dtypes given). attention_backward (not in the default set) is a small masked bf16 backward at head
dims 64 and 128 (the default kernels and the deterministic pair), small enough for racecheck (the full
attention set takes it several minutes). group_norm_silu_three_ctas (not in the default set either) is version 8 at
three CTAs an SM alone (racecheck over the whole group_norm_silu set runs past ten minutes);
group_norm_silu_stream is versions 12 and 13 alone, group_norm_silu_backward the backward's cases alone (both also
run with group_norm_silu), group_norm_silu_version_7 those of version 7 (the backward on chip, NC*) alone.
"""
from __future__ import annotations

import contextlib
import itertools
import os
import sys

import torch

import vdcompile  # noqa: F401
from vdcompile import has_cuda_kernels

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import env_var  # noqa: E402


@contextlib.contextmanager
def tf32_conv(on: bool):
    """cuDNN's TF32 switch (torch.backends.cudnn.allow_tf32) set to on inside, as it was after."""
    old = torch.backends.cudnn.allow_tf32
    torch.backends.cudnn.allow_tf32 = on
    try:
        yield
    finally:
        torch.backends.cudnn.allow_tf32 = old


def _grad(fn, *inputs):
    inputs = [t.detach().requires_grad_() for t in inputs]
    out = fn(*inputs)
    out = out[0] if isinstance(out, tuple) else out
    torch.autograd.grad(out, inputs, torch.randn_like(out))


def gn_backward_cases(dev, dtype, version_7_only=False):
    """group_norm_silu's backward kernels: frames-major rows, versions 7 and 10, version 1's channels_last (or
    version 7 alone)."""
    if not version_7_only:
        gn_backward_rows_cases(dev, dtype)
    # The backward on chip (version 7), as chosen and at two CTAs an SM: one CTA with runs shorter than
    # 32 and stages reused (three CTAs an SM as chosen), clusters of 2 to 16 each in one stage of 69-92 KB
    # (parts straddling channels, a short last rank), without SiLU or affine; 64 groups that fill more SMs at three
    # CTAs an SM and twice the cluster (the round-fill rule, 16-bit). In 16-bit with SiLU, two CTAs an SM take 384
    # threads.
    for variant in ("", "smem2"):
        with env_var("VD_GROUP_NORM_BACKWARD", variant):  # "": as chosen
            for shape, silu in [((40, 256, 9, 16), True), ((4, 640, 36, 64), True), ((2, 320, 70, 100), False),
                                ((1, 512, 72, 128), True), ((1, 960, 72, 128), True), ((2, 1280, 18, 32), True)]:
                x = torch.randn(shape, device=dev, dtype=dtype)
                g = torch.randn(shape, device=dev, dtype=dtype)
                w = torch.randn(shape[1], device=dev, dtype=dtype)
                torch.ops.vd.group_norm_silu_backward(g, x, 32, w, w, 1e-5, silu)
                torch.ops.vd.group_norm_silu_backward(g, x, 32, None, None, 1e-5, silu)
                _, stats = torch.ops.vd.group_norm_silu_forward(x, 32, w, w, 1e-5, silu)  # the forward's
                torch.ops.vd.group_norm_silu_backward(g, x, 32, w, w, 1e-5, silu, stats)
    if not version_7_only:
        gn_backward_cols_cases(dev, dtype)


def gn_backward_rows_cases(dev, dtype):
    # The backward on frames-major x and grad_out, read in place (vector and scalar rows; rows of whole
    # batches of loads and a rest, two chunks a row).
    for (B, C, F, H, W) in [(2, 64, 3, 4, 8), (1, 32, 3, 5, 7), (1, 16, 2, 40, 65)]:
        x = torch.randn(B, F, C, H, W, device=dev, dtype=dtype).transpose(1, 2)
        g = torch.randn(B, F, C, H, W, device=dev, dtype=dtype).transpose(1, 2)
        w = torch.randn(C, device=dev, dtype=dtype)
        torch.ops.vd.group_norm_silu_backward(g, x, 8, w, w, 1e-5, True)
        _, stats = torch.ops.vd.group_norm_silu_forward(x, 8, w, w, 1e-5, True)
        torch.ops.vd.group_norm_silu_backward(g, x, 8, w, w, 1e-5, True, stats)


def gn_backward_cols_cases(dev, dtype):
    # The channels_last backward on chip (version 10): K 1 with stages reused, K 16 in one 90 KB stage (gb 4),
    # K 8 after growing, 64-byte rows (gb 2 / 1), a box past the sample, 5-D; without SiLU or affine.
    for shape, groups, silu in [((40, 1280, 9, 16), 32, True), ((2, 320, 72, 128), 32, True),
                                ((2, 1280, 18, 32), 32, False), ((1, 512, 72, 128), 32, True),
                                ((2, 24, 5, 7), 3, True), ((2, 40, 4, 4, 3), 4, True)]:
        fmt = torch.channels_last if len(shape) == 4 else torch.channels_last_3d
        x = torch.randn(shape, device=dev, dtype=dtype).to(memory_format=fmt)
        g = torch.randn(shape, device=dev, dtype=dtype).to(memory_format=fmt)
        w = torch.randn(shape[1], device=dev, dtype=dtype)
        torch.ops.vd.group_norm_silu_backward(g, x, groups, w, w, 1e-5, silu)
        torch.ops.vd.group_norm_silu_backward(g, x, groups, None, None, 1e-5, silu)
        _, stats = torch.ops.vd.group_norm_silu_forward(x, groups, w, w, 1e-5, silu)  # the forward's
        torch.ops.vd.group_norm_silu_backward(g, x, groups, w, w, 1e-5, silu, stats)
    # Version 1's channels_last backward, one row of x and dy a load and the dtype's batch, 32 and 128 rows a
    # thread: threads with fewer rows than a batch and a remainder, two column tiles, 5-D.
    for batch, rows in (("1", "32"), ("0", "32"), ("0", "128")):
        with env_var("VD_GROUP_NORM_BACKWARD", "twopass"), env_var("VD_GROUP_NORM_BACKWARD_COL_BATCH", batch), \
                env_var("VD_GROUP_NORM_BACKWARD_COL_ROWS", rows):
            for shape, groups in [((2, 64, 7, 9), 8), ((1, 320, 33, 17), 32), ((2, 40, 3, 5, 7), 4),
                                  ((3, 1280, 5, 61), 32)]:
                fmt = torch.channels_last if len(shape) == 4 else torch.channels_last_3d
                x = torch.randn(shape, device=dev, dtype=dtype).to(memory_format=fmt)
                g = torch.randn(shape, device=dev, dtype=dtype).to(memory_format=fmt)
                w = torch.randn(shape[1], device=dev, dtype=dtype)
                _, stats = torch.ops.vd.group_norm_silu_forward(x, groups, w, w, 1e-5, True)
                torch.ops.vd.group_norm_silu_backward(g, x, groups, w, w, 1e-5, True, stats)


def main():
    # --dtypes=bf16,fp16,fp32 picks the dtypes (default bf16 and fp32).
    names = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
    picked = [a.split("=", 1)[1] for a in sys.argv[1:] if a.startswith("--dtypes=")]
    dtypes = [names[d] for d in picked[-1].split(",")] if picked else [torch.bfloat16, torch.float32]
    only = {a for a in sys.argv[1:] if not a.startswith("--dtypes=")}

    def want(family):
        return (not only or family in only) and has_cuda_kernels("fused_attention" if family == "attention" else family)

    dev = "cuda"
    torch.manual_seed(0)
    ran = []
    for dtype in dtypes:
        if want("attention"):
            for B, H, Lq, Lk, D in [(3, 2, 14, 14, 64), (700, 2, 25, 25, 40), (5, 3, 32, 17, 128), (1, 2, 77, 131, 40), (2, 1, 300, 1, 128), (1, 1, 257, 257, 256),
                                    (1, 2, 200, 300, 128)]:
                q = torch.randn(B, H, Lq, D, device=dev, dtype=dtype)
                k = torch.randn(B, H, Lk, D, device=dev, dtype=dtype)
                v = torch.randn(B, H, Lk, D, device=dev, dtype=dtype)
                mask = torch.rand(1, 1, Lq, Lk, device=dev) > 0.3
                torch.ops.vd.fused_attention(q, k, v, mask, None)
                if dtype == torch.bfloat16 and Lq >= 64 and D > 64:  # the Hopper forward without its P V overlap
                    with env_var("VD_ATTENTION_OVERLAP", "0"):
                        torch.ops.vd.fused_attention(q, k, v, mask, None)
                if dtype == torch.float32 and Lq <= 32 and Lk <= 32 and max(Lq, Lk) > 16:
                    with env_var("VD_ATTENTION_FP32_SHORT", "tf32"):  # the 3xTF32 kernel the FMA one replaced here
                        torch.ops.vd.fused_attention(q, k, v, mask, None)
                _grad(lambda q, k, v: torch.ops.vd.fused_attention(q, k, v, None, None), q, k, v)
                _grad(lambda q, k, v: torch.ops.vd.fused_attention(q, k, v, mask, None), q, k, v)
                with env_var("VD_ATTENTION_BACKWARD", "mma"):  # the mma.sync pair where Hopper has its own
                    _grad(lambda q, k, v: torch.ops.vd.fused_attention(q, k, v, mask, None), q, k, v)
                _grad(lambda q, k, v: torch.ops.vd.strided_attention(q, k, v, 3, None), q, k, v)
                qt = torch.randn(B, Lq, H, D, device=dev, dtype=dtype).transpose(1, 2)
                torch.ops.vd.fused_attention(qt, k, v, None, None)
            if dtype == torch.bfloat16:  # the copy-engine short kernel over several problems a warp (both tile
                # heights, queries and keys in different tiles), and the cp.async kernel it replaces there
                for B, H, Lq, Lk, D in [(300, 7, 25, 25, 64), (700, 3, 14, 14, 64), (90, 5, 14, 25, 56)]:
                    q = torch.randn(B, H, Lq, D, device=dev, dtype=dtype)
                    k, v = (torch.randn(B, H, Lk, D, device=dev, dtype=dtype) for _ in range(2))
                    torch.ops.vd.fused_attention(q, k, v, None, None)
                    torch.ops.vd.fused_attention(q, k, v, None, None, False)  # without the lse stores
                    with env_var("VD_ATTENTION_SHORT", "cpasync"):
                        torch.ops.vd.fused_attention(q, k, v, None, None)
                        torch.ops.vd.fused_attention(q, k, v, None, None, False)
            if dtype == torch.float32:  # the fp32 FMA short kernel: head_dim % 8 == 4, a last key group of one key
                q, k, v = (torch.randn(300, 3, n, 36, device=dev, dtype=dtype) for n in (29, 17, 17))
                torch.ops.vd.fused_attention(q, k, v, torch.rand(29, 17, device=dev) > 0.3, None)
                # and its other row buckets: 20, 24, 28 (head_dim 64 and 128), 25 with fewer queries
                for Lq, Lk, D in [(19, 20, 64), (23, 22, 64), (27, 26, 128), (25, 19, 64), (19, 25, 64)]:
                    q = torch.randn(200, 3, Lq, D, device=dev, dtype=dtype)
                    k, v = (torch.randn(200, 3, Lk, D, device=dev, dtype=dtype) for _ in range(2))
                    torch.ops.vd.fused_attention(q, k, v, torch.rand(Lq, Lk, device=dev) > 0.3, None)
            ran.append("attention")
        if "attention_backward" in only and dtype == torch.bfloat16 and has_cuda_kernels("fused_attention"):
            for B, H, Lq, Lk, D in [(1, 1, 130, 200, 64), (1, 1, 100, 70, 128)]:
                q, k, v = (torch.randn(B, H, n, D, device=dev, dtype=dtype) for n in (Lq, Lk, Lk))
                mask = torch.rand(1, 1, Lq, Lk, device=dev) > 0.3
                _grad(lambda q, k, v: torch.ops.vd.fused_attention(q, k, v, mask, None), q, k, v)
                for choice in ("fused192", "fused128", "pair"):  # both tiles of the fused kernel; the deterministic pair
                    with env_var("VD_ATTENTION_BACKWARD", choice):
                        _grad(lambda q, k, v: torch.ops.vd.fused_attention(q, k, v, mask, None), q, k, v)
            ran.append("attention_backward")
        if want("group_norm_silu"):
            for shape in [(2, 64, 9, 11), (1, 32, 3, 5, 7), (2, 16, 33)]:
                x = torch.randn(shape, device=dev, dtype=dtype)
                w = torch.randn(shape[1], device=dev, dtype=dtype)
                _grad(lambda x, w: torch.ops.vd.group_norm_silu(x, 8, w, None, 1e-5, True), x, w)
                if x.dim() == 4:
                    _grad(lambda x: torch.ops.vd.group_norm_silu(x, 8, None, None, 1e-5, True),
                          x.to(memory_format=torch.channels_last))
            # Frames-major 5-D (B, C, F, H, W) views: on chip (cluster of 2), segments of 70 (two-pass),
            # and a group over the on-chip limit (two-pass, frames-major runs).
            for (B, C, F, H, W), groups in [((2, 320, 14, 9, 16), 32), ((2, 6, 3, 5, 7), 3),
                                            ((1, 64, 14, 32, 64), 8)]:
                x = torch.randn(B, F, C, H, W, device=dev, dtype=dtype).transpose(1, 2)
                torch.ops.vd.group_norm_silu(x, groups, None, None, 1e-5, True)
            gn_backward_cases(dev, dtype)
            # channels_last two-pass statistics over two column tiles (a group in both, groups in one only).
            for shape, groups in [((2, 2560, 3, 5), 32), ((1, 2112, 4, 4), 3)]:
                x = torch.randn(shape, device=dev, dtype=dtype).to(memory_format=torch.channels_last)
                with env_var("VD_GROUP_NORM_KERNEL", "twopass"):
                    torch.ops.vd.group_norm_silu(x, groups, None, None, 1e-5, True)
            # Version 1's channels_last apply: the dtype's rows a load (threads with fewer rows than a load and a
            # remainder, 5-D, two column tiles) and one row a load.
            for batch in ("0", "1"):
                with env_var("VD_GROUP_NORM_KERNEL", "twopass"), env_var("VD_GROUP_NORM_APPLY_COL_BATCH", batch):
                    for shape, groups in [((1, 320, 33, 17), 32), ((2, 40, 3, 5, 7), 4), ((3, 1280, 5, 61), 32),
                                          ((2, 2560, 3, 5), 32)]:
                        fmt = torch.channels_last if len(shape) == 4 else torch.channels_last_3d
                        x = torch.randn(shape, device=dev, dtype=dtype).to(memory_format=fmt)
                        w = torch.randn(shape[1], device=dev, dtype=dtype)
                        torch.ops.vd.group_norm_silu_forward(x, groups, w, w, 1e-5, True)
            # Version 1's channels_last statistics at the rows a thread the op picks (whole rounds of blocks) and at
            # pinned odd counts (one row a thread; blocks ending mid-batch), with plain loads and with the copies'
            # ring of 3 and 4 batches a thread (77 rows: the ring wraps several times).
            for rows, depth in itertools.product(("", "1", "7", "77"), ("0", "3", "4")):
                with env_var("VD_GROUP_NORM_KERNEL", "twopass"), env_var("VD_GROUP_NORM_STATS_COL_ROWS", rows), \
                        env_var("VD_GROUP_NORM_STATS_COL_DEPTH", depth):
                    for shape, groups in [((3, 320, 19, 23), 32), ((2, 40, 3, 5, 7), 4), ((2, 2560, 3, 5), 32),
                                          ((2, 1280, 14, 18, 32), 32)]:  # filled past the power of two (132 SMs)
                        fmt = torch.channels_last if len(shape) == 4 else torch.channels_last_3d
                        x = torch.randn(shape, device=dev, dtype=dtype).to(memory_format=fmt)
                        torch.ops.vd.group_norm_silu_forward(x, groups, None, None, 1e-5, True)
            # NC* two-pass statistics: whole chunks (groups of 512 K elements), and groups of 8 * 2050 elements
            # (most start off a 16-byte boundary; short last chunks of single vectors).
            for shape, groups in [((1, 64, 256, 256), 8), ((2, 64, 50, 41), 8)]:
                x = torch.randn(shape, device=dev, dtype=dtype)
                with env_var("VD_GROUP_NORM_KERNEL", "twopass"):
                    torch.ops.vd.group_norm_silu(x, groups, None, None, 1e-5, True)
            # Each forward kernel family on its own, writing the statistics too (group_norm_silu_forward: the same
            # kernels, plus one store a group): one block, a cluster of 4, a cluster of 16 (bf16;
            # two-pass in fp32), version 6 on clusters of 16 (fp32 / bf16; fp32 (1, 960, 72, 128) and the frames-major
            # call below in one stage of over 48 KB a CTA), frames-major over a cluster of 8 / 16.
            for family in ("smem", "l2", "onchip"):
                with env_var("VD_GROUP_NORM_KERNEL", family):
                    for shape, groups in [((2, 64, 9, 11), 8), ((2, 640, 36, 64), 32), ((1, 64, 256, 256), 8),
                                          ((1, 512, 72, 128), 32), ((1, 960, 72, 128), 32)]:
                        x = torch.randn(shape, device=dev, dtype=dtype)
                        w, b = torch.randn(shape[1], device=dev, dtype=dtype), torch.randn(shape[1], device=dev, dtype=dtype)
                        torch.ops.vd.group_norm_silu_forward(x, groups, w, b, 1e-5, True)
                    x = torch.randn(1, 14, 64, 32, 64, device=dev, dtype=dtype).transpose(1, 2)
                    torch.ops.vd.group_norm_silu_forward(x, 8, None, None, 1e-5, True)
                    # channels_last (version 5 under "l2", 8 under "smem"): clusters of 8 and 1-4, groups straddled
                    # by vectors, a 5-D channels_last_3d input, a block narrower than 128 bytes.
                    # Under "smem" version 8: also one 90 KB stage a CTA at K 16, K 1 with stages reused, and 24
                    # blocks of one 51 KB stage (2 boxes) at K 16 over fewer clusters (16-bit: refilled box by box).
                    cl_shapes = [((14, 320, 32, 32), 32), ((2, 1280, 18, 32), 32), ((2, 48, 6, 6), 16),
                                 ((2, 40, 4, 4, 3), 4), ((2, 24, 5, 7), 3)]
                    if family == "smem":
                        cl_shapes += [((1, 320, 72, 128), 32), ((600, 1280, 2, 4), 32), ((6, 320, 50, 100), 32)]
                    for shape, groups in cl_shapes:
                        fmt = torch.channels_last if len(shape) == 4 else torch.channels_last_3d
                        x = torch.randn(shape, device=dev, dtype=dtype).to(memory_format=fmt)
                        w, b = torch.randn(shape[1], device=dev, dtype=dtype), torch.randn(shape[1], device=dev, dtype=dtype)
                        torch.ops.vd.group_norm_silu_forward(x, groups, w, b, 1e-5, True)
            ran.append("group_norm_silu")
        for family in ("group_norm_silu_backward", "group_norm_silu_version_7"):
            if family in only and has_cuda_kernels("group_norm_silu"):
                gn_backward_cases(dev, dtype, version_7_only=family.endswith("7"))
                ran.append(family)
        if (want("group_norm_silu") or "group_norm_silu_stream" in only) and has_cuda_kernels("group_norm_silu"):
            # Version 12 pinned: one tile a group; more tiles than the rings hold (float32: stages and channel
            # tables reused); frames-major segments of two tiles (one in 16-bit); without SiLU; statistics written.
            with env_var("VD_GROUP_NORM_KERNEL", "stream"):
                for shape, groups in [((2, 64, 16, 16), 32), ((4, 64, 128, 256), 8)]:
                    x = torch.randn(shape, device=dev, dtype=dtype)
                    torch.ops.vd.group_norm_silu_forward(x, groups, None, None, 1e-5, True)
                    torch.ops.vd.group_norm_silu(x, groups, None, None, 1e-5, False)
                x = torch.randn(1, 6, 32, 30, 40, device=dev, dtype=dtype).transpose(1, 2)
                torch.ops.vd.group_norm_silu_forward(x, 4, None, None, 1e-5, True)
                # The ring filling the shared memory in seven and in eight stages (tiles under 32 KB).
                for stages in ("7", "8"):
                    with env_var("VD_GROUP_NORM_STREAM_RING_KB", "999"), env_var("VD_GROUP_NORM_STREAM_STAGES", stages):
                        x = torch.randn(4, 64, 128, 256, device=dev, dtype=dtype)
                        torch.ops.vd.group_norm_silu_forward(x, 8, None, None, 1e-5, True)
                # Version 13 (channels_last): more tiles than the rings hold (stages and tables reused; each block's
                # last box past the sample), one tile a block, 5-D; vectors straddling groups; 16-byte rows (float32:
                # 13 boxes a tile).
                for shape, groups in [((4, 960, 40, 60), 32), ((2, 64, 5, 7), 32), ((2, 320, 3, 10, 12), 32),
                                      ((1, 192, 40, 40), 32), ((1, 32, 256, 512), 32)]:
                    fmt = torch.channels_last if len(shape) == 4 else torch.channels_last_3d
                    x = torch.randn(shape, device=dev, dtype=dtype).to(memory_format=fmt)
                    w = torch.randn(shape[1], device=dev, dtype=dtype)
                    torch.ops.vd.group_norm_silu_forward(x, groups, w, w, 1e-5, True)
                    torch.ops.vd.group_norm_silu(x, groups, None, None, 1e-5, False)
                # Version 13 with ~18 one-tile blocks a CTA (one CTA an SM), so each CTA's ring of 8 fold jobs wraps
                # (its job slots reused).
                x = torch.randn(2400, 64, 5, 7, device=dev, dtype=dtype).to(memory_format=torch.channels_last)
                torch.ops.vd.group_norm_silu_forward(x, 32, None, None, 1e-5, True)
            ran.append("group_norm_silu_stream")
        if "group_norm_silu_three_ctas" in only and has_cuda_kernels("group_norm_silu"):
            # Version 8 at three CTAs an SM (one stage of <= ~72 KB, group states folded over warps): a last rank
            # with fewer rows and a box partly past the sample; 64 KB parts in two boxes with more blocks than
            # resident clusters (16-bit: refilled box by box); with and without SiLU, statistics written. 320
            # channels: the states unfolded (10 vector columns), a short last rank, the stage reused.
            for shape in [(3, 512, 72, 125), (5, 512, 64, 128), (3, 320, 48, 125), (12, 320, 48, 128)]:
                x = torch.randn(shape, device=dev, dtype=dtype).to(memory_format=torch.channels_last)
                w, b = torch.randn(shape[1], device=dev, dtype=dtype), torch.randn(shape[1], device=dev, dtype=dtype)
                with env_var("VD_GROUP_NORM_KERNEL", "smem"):
                    torch.ops.vd.group_norm_silu_forward(x, 32, w, b, 1e-5, True)
                    torch.ops.vd.group_norm_silu(x, 32, None, None, 1e-5, False)
            ran.append("group_norm_silu_three_ctas")
        if want("conv_bn_silu"):
            x = torch.randn(2, 16, 9, 13, device=dev, dtype=dtype)
            w = torch.randn(24, 16, 3, 3, device=dev, dtype=dtype)
            bn = [torch.rand(24, device=dev, dtype=dtype) + 0.5 for _ in range(4)]
            _grad(lambda x, w: torch.ops.vd.conv_bn_silu(x, w, None, *bn, 1e-5, [1, 1], [1, 1], [1, 1], 1, True), x, w)
            with torch.no_grad(), env_var("VD_CONV_BN_SILU_KERNEL", "cudnn"):
                # the vector epilogue (s and b'): 8 x 16 NCHW planes, then channels_last rows of 24; the fold's
                # vectors with a bias, from NCHW, channels_last and strided weights
                wcl = w.contiguous(memory_format=torch.channels_last)
                wv = torch.randn(24, 32, 3, 3, device=dev, dtype=dtype)[:, ::2]
                for fmt in (torch.contiguous_format, torch.channels_last):
                    xv = torch.randn(2, 16, 8, 16, device=dev, dtype=dtype).to(memory_format=fmt)
                    for wt in (w, wcl, wv):
                        torch.ops.vd.conv_bn_silu(xv, wt, bn[0], *bn, 1e-5, [1, 1], [1, 1], [1, 1], 1, True)
            # the Hopper kernel (float32 as TF32, under cuDNN's switch, on by default): every tile cut between CTAs,
            # partial tiles
            if dtype != torch.float32 or torch.backends.cudnn.allow_tf32:
                cl = torch.channels_last
                xh = torch.randn(1, 72, 9, 16, device=dev, dtype=dtype).to(memory_format=cl)
                wh = torch.randn(200, 72, 3, 3, device=dev, dtype=dtype)
                bh = [torch.rand(200, device=dev, dtype=dtype) + 0.5 for _ in range(4)]
                with torch.no_grad(), env_var("VD_CONV_BN_SILU_KERNEL", "wgmma"):  # small: pinned to the kernel
                    torch.ops.vd.conv_bn_silu(xh, wh, None, *bh, 1e-5, [1, 1], [1, 1], [1, 1], 1, True)
                    # 256 channels (64-pixel tiles here)
                    w256 = torch.randn(256, 64, 3, 3, device=dev, dtype=dtype)
                    b256 = [torch.rand(256, device=dev, dtype=dtype) + 0.5 for _ in range(4)]
                    torch.ops.vd.conv_bn_silu(xh[:, :64].contiguous(memory_format=cl), w256, None, *b256, 1e-5,
                                              [1, 1], [1, 1], [1, 1], 1, True)
                    # 160-channel tiles (a 32-channel block in the epilogue)
                    x160 = torch.randn(1, 64, 32, 32, device=dev, dtype=dtype).to(memory_format=cl)
                    w160 = torch.randn(320, 64, 3, 3, device=dev, dtype=dtype)
                    b160 = [torch.rand(320, device=dev, dtype=dtype) + 0.5 for _ in range(4)]
                    torch.ops.vd.conv_bn_silu(x160, w160, None, *b160, 1e-5, [1, 1], [1, 1], [1, 1], 1, True)
                    # no padding: 7 x 8 output, 8-pixel row segments
                    torch.ops.vd.conv_bn_silu(xh[..., :10].contiguous(memory_format=cl), wh, None, *bh, 1e-5,
                                              [1, 1], [0, 0], [1, 1], 1, False)
                    # pinned, small problems take 64-pixel tiles (above: 64 x 128); 128-pixel tiles with a partial
                    # last pixel tile at 128 and 256 channels, 64 x 256 (the second warpgroup's channels partly
                    # absent) and 256 x 128 (144 pixels: the second warpgroup has 16 of its 128)
                    for tile in ("128", "256", "64x256", "256x128"):
                        with env_var("VD_CONV_BN_SILU_TILE", tile):
                            torch.ops.vd.conv_bn_silu(xh, wh, None, *bh, 1e-5, [1, 1], [1, 1], [1, 1], 1, True)
                    # 64-pixel tiles run in clusters above (3 of them: 144 pixels); 5 (288 pixels, the weight in 4
                    # multicast slices, the last tile half full), and outside clusters
                    x5 = torch.randn(2, 64, 9, 16, device=dev, dtype=dtype).to(memory_format=cl)
                    torch.ops.vd.conv_bn_silu(x5, w256, None, *b256, 1e-5, [1, 1], [1, 1], [1, 1], 1, True)
                    with env_var("VD_CONV_BN_SILU_CLUSTER", "0"):
                        torch.ops.vd.conv_bn_silu(x5, w256, None, *b256, 1e-5, [1, 1], [1, 1], [1, 1], 1, True)
                    # 128-pixel tiles in clusters of 3 (8 tiles: the last group one tile past the pixels; 160
                    # channels in 2 weight slices), of 2 at 256 channels, of 4 at 160 (4 slices of 40 rows)
                    for cm, tile, wa, ba in (("3", "160", w160, b160), ("2", "256", w256, b256),
                                             ("4", "160", w160, b160)):
                        with env_var("VD_CONV_BN_SILU_CLUSTER", cm), env_var("VD_CONV_BN_SILU_TILE", tile):
                            torch.ops.vd.conv_bn_silu(x160, wa, None, *ba, 1e-5, [1, 1], [1, 1], [1, 1], 1, True)
                    # whole tiles data-parallel, then stream-K: 36864 pixels, 576 tiles of 128 x 128 (4.4 waves),
                    # alone and in pairs; 288 of 128 x 256 (2.2 waves; 16-bit: the epilogue in two rounds) and of
                    # 256 x 128 (two m64 products a warpgroup), alone and in pairs
                    xw = torch.randn(4, 16, 96, 96, device=dev, dtype=dtype).to(memory_format=cl)
                    ww = torch.randn(256, 16, 3, 3, device=dev, dtype=dtype)
                    for cm, tile in (("0", "128"), ("2", "128"), ("0", "256"), ("0", "256x128"), ("2", "256x128")):
                        with env_var("VD_CONV_BN_SILU_CLUSTER", cm), env_var("VD_CONV_BN_SILU_TILE", tile):
                            torch.ops.vd.conv_bn_silu(xw, ww, None, *b256, 1e-5, [1, 1], [1, 1], [1, 1], 1, True)
                # Winograd F(2x2, 3x3): odd H and W (outputs past them not stored, the patches' padding), tile
                # rows padded to the GEMM's tiles (V's zero rows), 256-channel tiles alone and 256 x 128 tiles
                # (C_out 384); 256 tile rows: 256-channel tiles in pairs; then 1920 tile rows a product: whole
                # tiles, then stream-K
                with torch.no_grad(), env_var("VD_CONV_BN_SILU_ALGO", "winograd"):
                    xo = torch.randn(2, 64, 9, 13, device=dev, dtype=dtype).to(memory_format=cl)
                    xp = torch.randn(2, 64, 16, 24, device=dev, dtype=dtype).to(memory_format=cl)
                    for xi, c_out in ((xo, 256), (xo, 384), (xp, 256)):
                        wo = torch.randn(c_out, 64, 3, 3, device=dev, dtype=dtype) / 24
                        bo = [torch.rand(c_out, device=dev, dtype=dtype) + 0.5 for _ in range(4)]
                        torch.ops.vd.conv_bn_silu(xi, wo, None, *bo, 1e-5, [1, 1], [1, 1], [1, 1], 1, True)
                    xb = torch.randn(4, 128, 40, 48, device=dev, dtype=dtype).to(memory_format=cl)
                    wb = torch.randn(256, 128, 3, 3, device=dev, dtype=dtype) / 32
                    torch.ops.vd.conv_bn_silu(xb, wb, None, *b256, 1e-5, [1, 1], [1, 1], [1, 1], 1, True)
                # the fused variant: odd H and W, a partial last tile; 320 channels (5 channel tiles: no clusters),
                # 384 (6: clusters of 4 asked, pairs run), 256 (4: clusters of 4, 2 and none); C_in not a multiple of
                # the K step (in clusters of 4)
                with torch.no_grad(), env_var("VD_CONV_BN_SILU_ALGO", "winograd_fused"):
                    for xi, c_out, cm in ((xo, 320, "4"), (xo, 384, "4"), (xp, 256, "4"), (xp, 256, "1"),
                                          (xp, 256, "2"), (xo[:, :40].contiguous(memory_format=cl), 256, "4")):
                        wo = torch.randn(c_out, xi.shape[1], 3, 3, device=dev, dtype=dtype) / 24
                        bo = [torch.rand(c_out, device=dev, dtype=dtype) + 0.5 for _ in range(4)]
                        with env_var("VD_CONV_WINO_FUSED_CLUSTER", cm):
                            torch.ops.vd.conv_bn_silu(xi, wo, None, *bo, 1e-5, [1, 1], [1, 1], [1, 1], 1, True)
                            with env_var("VD_CONV_WINO_FUSED_SPLIT", "0"):  # whole tiles (the above: halves of K)
                                torch.ops.vd.conv_bn_silu(xi, wo, None, *bo, 1e-5, [1, 1], [1, 1], [1, 1], 1, True)
                    # 160 tiles: a round of whole tiles, then halves of K (in pairs)
                    xw = torch.randn(4, 128, 40, 64, device=dev, dtype=dtype).to(memory_format=cl)
                    ww = torch.randn(512, 128, 3, 3, device=dev, dtype=dtype) / 32
                    bw = [torch.rand(512, device=dev, dtype=dtype) + 0.5 for _ in range(4)]
                    with env_var("VD_CONV_WINO_FUSED_CLUSTER", "2"):
                        torch.ops.vd.conv_bn_silu(xw, ww, None, *bw, 1e-5, [1, 1], [1, 1], [1, 1], 1, True)
            ran.append("conv_bn_silu")
        if want("temporal_conv"):
            x = torch.randn(2, 8, 7, 5, 6, device=dev, dtype=dtype)
            w = torch.randn(12, 8, 3, 1, 1, device=dev, dtype=dtype)
            _grad(lambda x, w: torch.ops.vd.temporal_conv(x, w, None, 1), x, w)
            # the Hopper kernels (float32: the TF32 ones, under cuDNN's TF32 switch, on by default; the direct one
            # pinned here, the Winograd one below): partial channel / pixel tiles, padding-only frames
            with tf32_conv(dtype == torch.float32), env_var("VD_TEMPORAL_CONV_TF32_ALGO", "direct"):
                xf = torch.randn(2, 5, 72, 4, 26, device=dev, dtype=dtype).transpose(1, 2)
                torch.ops.vd.temporal_conv(xf, torch.randn(200, 72, 3, 1, 1, device=dev, dtype=dtype),
                                           torch.randn(200, device=dev, dtype=dtype), 1)
                torch.ops.vd.temporal_conv(torch.randn(1, 40, 2, 8, 8, device=dev, dtype=dtype),
                                           torch.randn(64, 40, 3, 1, 1, device=dev, dtype=dtype), None, 3)
                # 192 pixels: a 128-pixel tile and a last block of 64 (run last, at N = 64) per frame
                torch.ops.vd.temporal_conv(torch.randn(1, 64, 3, 12, 16, device=dev, dtype=dtype),
                                           torch.randn(200, 64, 3, 1, 1, device=dev, dtype=dtype),
                                           torch.randn(200, device=dev, dtype=dtype), 1)
            with tf32_conv(dtype == torch.float32):
                # float32: the direct TF32 kernel at both channel tiles (the rule picks 128 above, 160 at 320
                # channels), 320 pixels (a second 192-pixel tile with its third warpgroup idle); the Winograd one
                # (k = 3, padding 1) alone and in clusters of two: 10 units of 64 pixels (5 pairs: the last
                # cluster's second CTA idle), an odd frame count, C_in 72 (a zero-filled chunk), 200 channels
                # (weight rows past C_out), a partial pixel block, and 336 items (168 in clusters), more than a
                # CTA each
                xt = torch.randn(1, 64, 3, 16, 20, device=dev, dtype=dtype)
                wt = torch.randn(320, 64, 3, 1, 1, device=dev, dtype=dtype)
                for tile in ("128", "160"):
                    with env_var("VD_TEMPORAL_CONV_TF32_TILE", tile), env_var("VD_TEMPORAL_CONV_TF32_ALGO", "direct"):
                        torch.ops.vd.temporal_conv(xt, wt, None, 1)
                if dtype == torch.float32:
                    for cm in ("1", "2"):
                        with env_var("VD_TEMPORAL_CONV_WINO_CLUSTER", cm):
                            torch.ops.vd.temporal_conv(xt, wt, None, 1)
                            torch.ops.vd.temporal_conv(xf, torch.randn(200, 72, 3, 1, 1, device=dev, dtype=dtype),
                                                       torch.randn(200, device=dev, dtype=dtype), 1)
                            torch.ops.vd.temporal_conv(torch.randn(2, 32, 14, 24, 32, device=dev, dtype=dtype),
                                                       torch.randn(640, 32, 3, 1, 1, device=dev, dtype=dtype), None, 1)
                # float32: more tiles than a round of the grid (192 at 132 SMs), in both tile orders
                xo = torch.randn(32, 16, 3, 8, 24, device=dev, dtype=dtype)
                wo = torch.randn(320, 16, 5, 1, 1, device=dev, dtype=dtype)
                for order in ("rr", "edges"):
                    with env_var("VD_TEMPORAL_CONV_TF32_ORDER", order):
                        torch.ops.vd.temporal_conv(xo, wo, None, 2)
            ran.append("temporal_conv")
        if want("scheduler_step"):
            s = torch.randn(2, 3, 4, 9, 7, device=dev, dtype=dtype)
            m = torch.randn_like(s)
            c = torch.randn(2, 6, device=dev)
            torch.ops.vd.scheduler_step(m, s, c, torch.randn_like(s), torch.randn_like(s),
                                        torch.rand(2, device=dev), 1.0)
            ran.append("scheduler_step")
    torch.cuda.synchronize()
    print("sanitize_ops: ran", sorted(set(ran)))


if __name__ == "__main__":
    main()
