"""Every vd CUDA kernel captured in a CUDA graph: no host sync, current stream, no allocation outside
the caching allocator. A replay after new data is copied into the captured inputs must equal a direct
call on that data: bit for bit for vd's own kernels; the ops that run cuBLAS/cuDNN (conv_bn_silu,
temporal_conv) within bf16 rounding, since the library may pick another algorithm under capture."""
from __future__ import annotations

import pytest
import torch

import vdcompile  # noqa: F401  (registers torch.ops.vd)
from vdcompile import built_backends

OPS = ["fused_attention", "strided_attention", "group_norm_silu", "conv_bn_silu", "temporal_conv", "scheduler_step"]
_MISSING = [op for op in OPS if "CUDA" not in built_backends(op)]
pytestmark = pytest.mark.skipif(bool(_MISSING) or not torch.cuda.is_available(),
                                reason=f"no CUDA kernels for {_MISSING} in this build, or no GPU")


def _rand(*shape, dtype=torch.bfloat16, channels_last=False):
    t = torch.randn(*shape, device="cuda", dtype=dtype)
    return t.contiguous(memory_format=torch.channels_last) if channels_last else t


def _bn(c):
    return (torch.rand(c, device="cuda") + 0.5, torch.randn(c, device="cuda"), torch.randn(c, device="cuda"),
            torch.rand(c, device="cuda") + 0.5)


def _forward_backward(g, x, w):
    out, stats = torch.ops.vd.group_norm_silu_forward(x, 32, w, w, 1e-5, True)
    return (out, stats, *torch.ops.vd.group_norm_silu_backward(g, x, 32, w, w, 1e-5, True, stats))


# name -> (input builder, function of the inputs). Each case picks a kernel path of its op.
CASES = {
    "attention_short": (lambda: [_rand(6, 5, 14, 64) for _ in range(3)],
                        lambda q, k, v: torch.ops.vd.fused_attention(q, k, v, None, None)),
    "attention_long": (lambda: [_rand(2, 2, 200, 64) for _ in range(3)],
                       lambda q, k, v: torch.ops.vd.fused_attention(q, k, v, None, None)),
    "attention_fp32_masked": (lambda: [_rand(2, 2, 40, 24, dtype=torch.float32) for _ in range(3)]
                              + [torch.rand(40, 40, device="cuda") > 0.2],
                              lambda q, k, v, m: torch.ops.vd.fused_attention(q, k, v, m, None)),
    "strided_attention": (lambda: [_rand(2, 2, 96, 64) for _ in range(3)],
                          lambda q, k, v: torch.ops.vd.strided_attention(q, k, v, 3, None)),
    "group_norm_silu_on_chip": (lambda: [_rand(4, 320, 18, 32)],
                                lambda x: torch.ops.vd.group_norm_silu(x, 32, None, None, 1e-5, True)),
    "group_norm_silu_channels_last": (lambda: [_rand(2, 64, 9, 11, channels_last=True)],
                                      lambda x: torch.ops.vd.group_norm_silu(x, 8, None, None, 1e-5, True)),
    # sm_90: version 8 (tensor copies into a ring of stages, clusters of 4 exchanging through st.async).
    "group_norm_silu_channels_last_on_chip": (lambda: [_rand(4, 320, 18, 32, channels_last=True)],
                                              lambda x: torch.ops.vd.group_norm_silu(x, 32, None, None, 1e-5, True)),
    # sm_90: version 12 (float32 groups over 1.5 MB: a tile counter and the tiles' slots zeroed on the stream, a
    # cooperative launch).
    "group_norm_silu_stream": (lambda: [_rand(1, 64, 256, 256, dtype=torch.float32)],
                               lambda x: torch.ops.vd.group_norm_silu(x, 8, None, None, 1e-5, True)),
    # sm_90: version 13 (channels_last float32 past the L2 that version 8 declines: the tile and block counters and
    # the groups' slots and records zeroed on the stream, a tensor map passed by value, a cooperative launch).
    "group_norm_silu_stream_cols": (lambda: [_rand(2, 960, 72, 128, dtype=torch.float32, channels_last=True)],
                                    lambda x: torch.ops.vd.group_norm_silu(x, 32, None, None, 1e-5, True)),
    # The backward on chip: version 7 (NCHW, bulk copies, two cluster exchanges a group) and version 10
    # (channels_last, tensor copies), each with grad_params_kernel after it.
    "group_norm_silu_backward_on_chip": (lambda: [_rand(4, 320, 18, 32), _rand(4, 320, 18, 32), _rand(320)],
                                         lambda g, x, w: torch.ops.vd.group_norm_silu_backward(g, x, 32, w, w, 1e-5, True)),
    "group_norm_silu_backward_channels_last_on_chip": (
        lambda: [_rand(4, 320, 18, 32, channels_last=True), _rand(4, 320, 18, 32, channels_last=True), _rand(320)],
        lambda g, x, w: torch.ops.vd.group_norm_silu_backward(g, x, 32, w, w, 1e-5, True)),
    # What autograd runs: the forward writing the statistics, the backward reading them (version 1: 960 channels
    # channels_last take no on-chip backward).
    "group_norm_silu_saved_statistics": (
        lambda: [_rand(2, 960, 9, 11, channels_last=True), _rand(2, 960, 9, 11, channels_last=True), _rand(960)],
        lambda g, x, w: _forward_backward(g, x, w)),
    "conv_bn_silu": (lambda: [_rand(2, 32, 18, 20, channels_last=True),
                              _rand(48, 32, 3, 3, channels_last=True)],
                     None),  # built below: the BatchNorm tensors are constants of the graph
    # The Hopper kernel (W_out % 8 == 0), its tiles cut between CTAs (stream-K: partial sums and flags).
    "conv_bn_silu_stream_k": (lambda: [_rand(2, 256, 32, 16, channels_last=True),
                                       _rand(200, 256, 3, 3, channels_last=True) / 48],
                              None),
    # Its float32 build (TF32, where cuDNN's switch allows it: set in the test).
    "conv_bn_silu_stream_k_fp32": (lambda: [_rand(2, 256, 32, 16, dtype=torch.float32, channels_last=True),
                                            _rand(200, 256, 3, 3, dtype=torch.float32, channels_last=True) / 48],
                                   None),
    # 64-pixel tiles in a cluster of 5 (288 pixels), the weight multicast, a channel tile cut between clusters.
    "conv_bn_silu_cluster_fp32": (lambda: [_rand(2, 512, 9, 16, dtype=torch.float32, channels_last=True),
                                           _rand(256, 512, 3, 3, dtype=torch.float32, channels_last=True) / 64],
                                  None),
    # 128 x 256 tiles in pairs (clusters of 2), 2.2 waves of them: whole tiles data-parallel, then stream-K.
    "conv_bn_silu_data_parallel": (lambda: [_rand(4, 16, 96, 96, channels_last=True),
                                            _rand(256, 16, 3, 3, channels_last=True) / 12],
                                   None),
    # Winograd F(2x2, 3x3) on Hopper (pinned in the test): the weight transform runs in every replay (no cache
    # under capture), the products in 256-channel tiles (alone: 288 tile rows padded to 384); odd H.
    "conv_bn_silu_winograd": (lambda: [_rand(2, 64, 17, 32, channels_last=True),
                                       _rand(256, 64, 3, 3, channels_last=True) / 24],
                              None),
    "conv_bn_silu_winograd_fp32": (lambda: [_rand(2, 64, 17, 32, dtype=torch.float32, channels_last=True),
                                            _rand(256, 64, 3, 3, dtype=torch.float32, channels_last=True) / 24],
                                   None),
    "temporal_conv": (lambda: [_rand(2, 32, 7, 9, 10), _rand(48, 32, 3, 1, 1), _rand(48)],
                      lambda x, w, b: torch.ops.vd.temporal_conv(x, w, b, 1)),
    # The Hopper kernel's float32 build (TF32, where cuDNN's switch allows it: set in the test), frames-major x
    # (one 192-pixel tile), padding-only frames.
    "temporal_conv_fp32": (lambda: [_rand(2, 5, 32, 12, 16, dtype=torch.float32).transpose(1, 2),
                                    _rand(48, 32, 3, 1, 1, dtype=torch.float32) / 8, _rand(48, dtype=torch.float32)],
                           lambda x, w, b: torch.ops.vd.temporal_conv(x, w, b, 3)),
    # k = 3, padding 1: the Winograd TF32 kernel on Hopper, contiguous x, 3 units of 64 pixels a frame pair.
    "temporal_conv_winograd_fp32": (lambda: [_rand(1, 32, 6, 12, 16, dtype=torch.float32),
                                             _rand(200, 32, 3, 1, 1, dtype=torch.float32) / 8,
                                             _rand(200, dtype=torch.float32)],
                                    lambda x, w, b: torch.ops.vd.temporal_conv(x, w, b, 1)),
    "scheduler_step": (lambda: [_rand(2, 14, 4, 9, 16, dtype=torch.float32), _rand(2, 14, 4, 9, 16, dtype=torch.float32),
                                torch.tensor([1.0, -0.5, 0.9, 0.0, 0.1, 0.0], device="cuda")],
                       lambda m, x, c: torch.ops.vd.scheduler_step(m, x, c)),
}


LIBRARY_GEMMS = {"conv_bn_silu", "temporal_conv"}


def _flat(out):
    return list(out) if isinstance(out, (tuple, list)) else [out]


@pytest.mark.parametrize("case", sorted(CASES))
def test_cuda_graph_capture_and_replay(case, monkeypatch):
    torch.manual_seed(0)
    if case.endswith("_fp32"):
        monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", True)
    make, fn = CASES[case]
    if case.startswith("conv_bn_silu_winograd"):
        monkeypatch.setenv("VD_CONV_BN_SILU_ALGO", "winograd")
    if case.startswith("conv_bn_silu"):
        channels = {"conv_bn_silu": 48, "conv_bn_silu_cluster_fp32": 256, "conv_bn_silu_data_parallel": 256,
                    "conv_bn_silu_winograd": 256, "conv_bn_silu_winograd_fp32": 256}
        bn = _bn(channels.get(case, 200))
        fn = lambda x, w: torch.ops.vd.conv_bn_silu(x, w, None, *bn, 1e-5, [1, 1], [1, 1], [1, 1], 1, True)  # noqa: E731
    static = make()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warm-up off the capture: lazy init, cuBLAS handles, kernel attributes
        for _ in range(2):
            fn(*static)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        captured = _flat(fn(*static))
    fresh = make()
    for dst, src in zip(static, fresh):
        dst.copy_(src)
    g.replay()
    torch.cuda.synchronize()
    expected = _flat(fn(*fresh))
    assert len(captured) == len(expected)
    for got, want in zip(captured, expected):
        # The Hopper conv kernels are vd's own (a fixed summation order); elsewhere those cases run cuDNN / cuBLAS.
        library = case in LIBRARY_GEMMS or (
            (case.startswith("conv_bn_silu_stream_k") or case.startswith("conv_bn_silu_winograd")
             or case.startswith("temporal_conv") and case.endswith("_fp32"))
            and torch.cuda.get_device_capability() != (9, 0))
        if library:
            torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)
        else:
            assert torch.equal(got, want), f"{case}: replay differs from a direct call (max {(got.float() - want.float()).abs().max()})"


def test_compiled_with_cuda_graph_trees():
    """torch.compile(mode="reduce-overhead"): the CUDA-graph trees warm each graph up with this thread's
    allocations in the graph's private pool, and fail a pool that holds tensors nothing tracks. The weight
    caches (conv_bn_silu's fold, temporal_conv's tap-major weight copy) fill during that warm-up, with a
    module's parameters under no_grad (the cacheable case): what they keep must live outside the pool. The
    compiled calls must also equal direct ones (the caches hit on the later calls)."""
    torch.manual_seed(0)
    conv_w = torch.nn.Parameter(_rand(64, 64, 3, 3, channels_last=True) / 24)
    bn = [torch.nn.Parameter(t) for t in _bn(64)]
    tw = torch.nn.Parameter(_rand(96, 64, 3, 1, 1) / 8)
    tb = torch.nn.Parameter(_rand(96))

    def f(x, v):
        y = torch.ops.vd.conv_bn_silu(x, conv_w, None, *bn, 1e-5, [1, 1], [1, 1], [1, 1], 1, True)
        return y, torch.ops.vd.temporal_conv(v, tw, tb, 1)

    torch._dynamo.reset()
    compiled = torch.compile(f, backend="inductor", mode="reduce-overhead")
    x, v = _rand(2, 64, 32, 16, channels_last=True), _rand(2, 64, 6, 8, 16)
    with torch.no_grad():
        want = [t.clone() for t in f(x, v)]
        for _ in range(4):  # warm-up, recording, replays
            got = [t.clone() for t in compiled(x, v)]
            for g, w in zip(got, want):
                torch.testing.assert_close(g, w, atol=2e-2, rtol=2e-2)
    torch._dynamo.reset()
