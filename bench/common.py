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


def env_vars(settings: str):
    """env_var for each NAME=VALUE of "NAME=VALUE[,NAME=VALUE...]" (a benchmark's variant; "" sets none), as one
    context."""
    stack = contextlib.ExitStack()
    for pair in filter(None, settings.split(",")):
        stack.enter_context(env_var(*pair.split("=", 1)))
    return stack


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


def cuda_kernel_times(fn: Callable[[int], object], iters: int = 20, warmup: int = 3,
                      window: list | None = None) -> dict[str, list[float]]:
    """Device microseconds of every CUDA kernel (and memset) that ``fn(i)`` launches over ``iters`` calls,
    by name (torch.profiler): device time without the host's time between launches. ``window``: gets the
    (start, end) perf_counter of the profiled calls (without the profiler's own start and stop)."""
    import time
    from torch.profiler import ProfilerActivity, profile
    for i in range(warmup):
        fn(i)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        for i in range(iters):
            fn(i)
        torch.cuda.synchronize()
        if window is not None:
            window.append((t0, time.perf_counter()))
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


def device_time_per_call(fn: Callable[[int], object], n_sets: int = 1, iters: int = 20,
                         window: list | None = None) -> float:
    """Device milliseconds per call of ``fn(i)`` (i cycles over ``n_sets`` input sets): the summed time of
    every CUDA kernel and memset it launches, without the host time between them. For ops too short to
    keep the GPU busy from Python, where per-call CUDA events measure the host's dispatch rate instead.
    ``window``: as cuda_kernel_times'."""
    total = sum(sum(ts) for ts in cuda_kernel_times(lambda i: fn(i % n_sets), iters, window=window).values())
    if total <= 0:
        raise RuntimeError("no CUDA kernel ran")
    return total / iters / 1e3


def capture_graph(fns: Sequence[Callable[[], object]]) -> "torch.cuda.CUDAGraph":
    """The calls ``fns`` captured in one CUDA graph (each run once before, outside the capture)."""
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
    return graph


def time_cuda_graph(fns: Sequence[Callable[[], object]], iters: int = 20) -> float:
    """Milliseconds per call when the calls ``fns`` are captured in one CUDA graph and replayed
    (median over replays, divided by the number of calls): device time with no host work between them."""
    graph = capture_graph(fns)
    return time_cuda(lambda i: graph.replay(), iters=iters) / len(fns)


class GpuClocks:
    """The SM clock (MHz) and whether the power cap holds it down, sampled every ``period`` seconds by a
    thread through NVML (libnvidia-ml, loaded with ctypes: no package needed); no samples where NVML is
    missing. Under a sustained tensor-core load the H100 / H200 run at their power limit, the clock falls,
    and a variant timed right after another reads faster or slower by its place alone: the samples say
    which clock each measurement ran at."""

    SW_POWER_CAP = 0x4  # nvmlClocksEventReasonSwPowerCap

    def __init__(self, device: torch.device, period: float = 0.002):
        import ctypes
        import threading
        self.samples: list[tuple[float, int, bool]] = []  # (perf_counter, SM MHz, power-capped)
        self._stop = threading.Event()
        self._thread = None
        self._nvml = None
        try:
            nvml = ctypes.CDLL("libnvidia-ml.so.1")
            if nvml.nvmlInit_v2() != 0:
                return
            self._nvml = nvml  # initialised: close() shuts it down
            handle = ctypes.c_void_p()
            p = torch.cuda.get_device_properties(device)
            bus = f"{p.pci_domain_id:08x}:{p.pci_bus_id:02x}:{p.pci_device_id:02x}.0".encode()
            if nvml.nvmlDeviceGetHandleByPciBusId_v2(bus, ctypes.byref(handle)) != 0:
                return
            # (named ClocksThrottleReasons before driver 535)
            get_reasons = getattr(nvml, "nvmlDeviceGetCurrentClocksEventReasons", None) or \
                nvml.nvmlDeviceGetCurrentClocksThrottleReasons
        except (OSError, AttributeError):
            return
        clock, reasons = ctypes.c_uint(), ctypes.c_ulonglong()

        def sample():
            import time
            while not self._stop.is_set():
                if nvml.nvmlDeviceGetClockInfo(handle, 1, ctypes.byref(clock)) == 0:  # NVML_CLOCK_SM
                    ok = get_reasons(handle, ctypes.byref(reasons)) == 0
                    capped = ok and bool(reasons.value & self.SW_POWER_CAP)
                    self.samples.append((time.perf_counter(), clock.value, capped))
                time.sleep(period)
        self._thread = threading.Thread(target=sample, daemon=True)
        self._thread.start()

    def window(self, t0: float, t1: float) -> dict:
        """Median SM MHz and the fraction of samples under the power cap between perf_counter t0 and t1."""
        got = [(mhz, capped) for t, mhz, capped in self.samples if t0 <= t <= t1]
        if not got:
            return {}
        return {"sm_mhz": statistics.median(m for m, _ in got), "power_capped": sum(c for _, c in got) / len(got)}

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if self._nvml is not None:
            self._nvml.nvmlShutdown()
            self._nvml = None


def rotated(names: Sequence[str], r: int) -> list[str]:
    """The order of round r: names starting at the r-th (each takes every place over len(names) rounds)."""
    return list(names[r % len(names):]) + list(names[:r % len(names)])


def alternate(fns: dict[str, Callable[[], object]], device: torch.device, rounds: int = 8, how: str = "profiler",
              target_ms: float = 4.0) -> dict[str, dict]:
    """Device milliseconds per call of each variant, and the SM clock it ran at, the variants measured in turn
    over ``rounds`` rounds, round r starting at variant r (with rounds >= variants every variant takes every
    place in the order; none always follows the same one), medians over the rounds; a settling round first.
    Each measurement covers about ``target_ms`` of calls:
    - how="profiler": the summed time of the kernels each call launches (torch.profiler; no host time);
    - how="graph": the calls captured in one CUDA graph and replayed (what a model under CUDA graphs runs:
      no host time, but what the op does differently under capture, e.g. no fold cache, counts).
    Each variant's ``ms``, ``rounds_ms``, and where NVML answers its median ``sm_mhz`` and ``power_capped``
    over the samples taken while its calls ran (profiler: the profiled calls, not the warm-up or the
    profiler's start and stop)."""
    import time
    if how not in ("profiler", "graph"):
        raise ValueError(f"how must be 'profiler' or 'graph', got {how!r}")
    runs = {}
    for k, f in fns.items():
        if how == "graph":
            one = time_cuda_graph([f], iters=5)
            n = max(1, min(500, round(target_ms / max(one, 1e-3))))
            graph = capture_graph([f] * n)

            def run(graph=graph, n=n, reps=3):
                s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                t0 = time.perf_counter()
                s.record()
                for _ in range(reps):
                    graph.replay()
                e.record()
                e.synchronize()
                return s.elapsed_time(e) / (reps * n), (t0, time.perf_counter())
        else:
            one = device_time_per_call(lambda i, f=f: f(), iters=3)
            n = max(3, min(200, round(target_ms / max(one, 1e-3))))

            def run(f=f, n=n):
                window = []
                ms = device_time_per_call(lambda i: f(), iters=n, window=window)
                return ms, window[0]
        runs[k] = run
    names = list(runs)
    clocks = GpuClocks(device)
    got: dict[str, list] = {k: [] for k in names}
    try:
        for k in names:  # settle the clocks under load
            runs[k]()
        for r in range(rounds):
            for k in rotated(names, r):
                ms, (t0, t1) = runs[k]()
                got[k].append((ms, clocks.window(t0, t1)))
    finally:
        clocks.close()
    out = {}
    for k, ms_clk in got.items():
        res = {"ms": statistics.median(m for m, _ in ms_clk), "rounds_ms": [m for m, _ in ms_clk]}
        mhz = [c["sm_mhz"] for _, c in ms_clk if c]
        if mhz:
            res["sm_mhz"] = statistics.median(mhz)
            res["power_capped"] = statistics.mean(c["power_capped"] for _, c in ms_clk if c)
        out[k] = res
    return out


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
