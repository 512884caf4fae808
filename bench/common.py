"""Benchmark helpers: CUDA-event timing (median of many runs, inputs rotated so the L2 does not flatter),
the device's measured ceilings (copy bandwidth, bf16 matmul rate), and JSON results with device, torch
version and date."""
from __future__ import annotations

import contextlib
import datetime as _dt
import json
import os
import platform
import statistics
from typing import Callable, Sequence

import torch

RESULTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
# The benchmarks' --dtype names.
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@contextlib.contextmanager
def env_var(key: str, value: str):
    """The environment variable key set to value inside the block (the vd ops read their kernel
    choices, e.g. VD_ATTENTION_KERNEL, on every call), restored after it."""
    old = os.environ.get(key)
    os.environ[key] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = old


def time_cuda(fn: Callable[[int], object], n_sets: int = 1, warmup: int = 5, iters: int = 50,
              min_ms: float = 200.0) -> float:
    """Median milliseconds of ``fn(i)`` (i cycles over ``n_sets`` input sets) timed with CUDA events."""
    for i in range(warmup):
        fn(i % n_sets)
    torch.cuda.synchronize()
    # Enough repetitions to cover ``min_ms`` of device time, at least ``iters``.
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn(0)
    end.record()
    torch.cuda.synchronize()
    est = max(start.elapsed_time(end), 1e-3)
    n = max(iters, min(2000, int(min_ms / est)))
    times = []
    for i in range(n):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn(i % n_sets)
        e.record()
        times.append((s, e))
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in times)


def cuda_kernel_times(fn: Callable[[int], object], iters: int = 20, warmup: int = 3) -> dict[str, list[float]]:
    """Device microseconds of every CUDA kernel (and memset) that ``fn(i)`` launches over ``iters`` calls,
    by name (torch.profiler): device time without the host's time between launches."""
    from torch.profiler import ProfilerActivity, profile
    for i in range(warmup):
        fn(i)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for i in range(iters):
            fn(i)
        torch.cuda.synchronize()
    times: dict[str, list[float]] = {}
    for e in prof.events():
        if e.device_time > 0:
            times.setdefault(e.name, []).append(e.device_time)
    return times


def kernel_time_cuda(fn: Callable[[int], object], name: str, n_sets: int = 1, iters: int = 30) -> float:
    """Median device milliseconds of the CUDA kernels whose name contains ``name``, launched by ``fn(i)``
    (torch.profiler): the kernel alone, without the host time of a call that is too short to hide it."""
    times = [t for k, ts in cuda_kernel_times(lambda i: fn(i % n_sets), iters).items() if name in k for t in ts]
    if not times:
        raise RuntimeError(f"no CUDA kernel named like {name!r} ran")
    return statistics.median(times) / 1e3


def device_time_per_call(fn: Callable[[int], object], n_sets: int = 1, iters: int = 20) -> float:
    """Device milliseconds per call of ``fn(i)`` (i cycles over ``n_sets`` input sets): the summed time of
    every CUDA kernel and memset it launches, without the host time between them. For ops too short to
    keep the GPU busy from Python, where per-call CUDA events measure the host's dispatch rate instead."""
    total = sum(sum(ts) for ts in cuda_kernel_times(lambda i: fn(i % n_sets), iters).values())
    if total <= 0:
        raise RuntimeError("no CUDA kernel ran")
    return total / iters / 1e3


def time_cuda_graph(fns: Sequence[Callable[[], object]], iters: int = 20) -> float:
    """Milliseconds per call when the calls ``fns`` are captured in one CUDA graph and replayed
    (median over replays, divided by the number of calls): device time with no host work between them."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up outside the capture (allocations, lazy initialisation)
        for f in fns:
            f()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for f in fns:
            f()
    return time_cuda(lambda i: graph.replay(), iters=iters) / len(fns)


def time_cpu(fn: Callable[[int], object], n_sets: int = 1, warmup: int = 2, iters: int = 10) -> float:
    import time
    for i in range(warmup):
        fn(i % n_sets)
    ts = []
    for i in range(iters):
        t = time.perf_counter()
        fn(i % n_sets)
        ts.append((time.perf_counter() - t) * 1e3)
    return statistics.median(ts)


def rotation_sets(bytes_per_set: int, device: torch.device) -> int:
    """How many input sets to rotate through so their total is several times the L2 cache."""
    if device.type != "cuda":
        return 1
    l2 = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 50 * 2**20)
    return max(1, min(16, (4 * l2) // max(1, bytes_per_set) + 1))


def measure_ceilings(device: torch.device) -> dict:
    """Device-to-device copy bandwidth (bytes read + written), bf16 and TF32 matmul rates, measured here."""
    if device.type != "cuda":
        return {}
    n = 1 << 30  # 1 GiB each way
    a = torch.empty(n, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    a.random_(0, 255)
    ms = time_cuda(lambda i: b.copy_(a), iters=20)
    copy_gbs = 2 * n / ms / 1e6
    del a, b
    m = 8192
    x = torch.randn(m, m, device=device, dtype=torch.bfloat16)
    y = torch.randn(m, m, device=device, dtype=torch.bfloat16)
    ms_mm = time_cuda(lambda i: x @ y, iters=20)
    tflops = 2 * m**3 / ms_mm / 1e9
    # float32 on the tensor cores (TF32): the ceiling of float32 convolutions, which run TF32 by default
    x, y = x.float(), y.float()
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = True
    try:
        ms_tf32 = time_cuda(lambda i: x @ y, iters=20)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
    return {"copy_GBps": copy_gbs, "bf16_matmul_TFLOPs": tflops, "tf32_matmul_TFLOPs": 2 * m**3 / ms_tf32 / 1e9}


def environment(device: torch.device) -> dict:
    env = {
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
    }
    if device.type == "cuda":
        env["cuda"] = torch.version.cuda
        try:
            import triton
            env["triton"] = triton.__version__
        except ImportError:
            pass
    return env


def write_json(name: str, payload: dict) -> str:
    os.makedirs(RESULTS_DIR, exist_ok=True)
    stamp = _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%dT%H%M%S")
    dev = payload.get("environment", {}).get("device", "cpu").replace(" ", "_")
    path = os.path.join(RESULTS_DIR, f"{name}_{dev}_{stamp}.json")
    with open(path, "w") as f:
        json.dump(payload, f, indent=1)
    return path


def print_table(rows: Sequence[dict], columns: Sequence[tuple[str, str, str]]) -> None:
    """columns: (key, header, format spec)."""
    widths = [max(len(h), 10) for _, h, _ in columns]
    print("  ".join(h.rjust(w) for (_, h, _), w in zip(columns, widths)))
    for r in rows:
        cells = []
        for (k, _, fmt), w in zip(columns, widths):
            v = r.get(k)
            cells.append(("-" if v is None else format(v, fmt)).rjust(w))
        print("  ".join(cells))
