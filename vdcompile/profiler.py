"""Profiling video pipelines: named-region timing, time per op family, memory, bottleneck ranking.

    prof = Profiler(device)
    prof.instrument(pipe)            # times UNet forward, VAE decode/encode, scheduler step, image encoder
    with prof.ops():                 # optional: torch.profiler, aggregated per op family
        pipe(...)
    report = prof.report()
    print(report.table())
    report.save_chart("profile.png")

Regions are timed with CUDA events on a GPU (no synchronisation inside the loop; read once at the
end) and with ``time.perf_counter`` on the CPU.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import re
import time
from collections import defaultdict
from typing import Any, Callable, Iterable

import torch

# Op families, tried in order on the lower-cased kernel / aten op name. The first match wins.
OP_FAMILIES: list[tuple[str, tuple[str, ...]]] = [
    ("vd ops", ("vd::", "vd_")),
    ("compiled kernels", ("triton_", "cpp_fused", "compiledfunction", "torch-compiled region", "inductor")),
    ("attention", ("attention", "sdpa", "flash", "fmha", "softmax")),
    ("conv", ("conv", "cudnn", "mkldnn_convolution", "implicit_gemm", "winograd")),
    ("norm", ("norm", "welford")),
    ("matmul", ("mm", "matmul", "linear", "gemm", "cutlass", "sm90_xmma", "sm80_xmma", "ampere_", "nvjet")),
    ("copy/layout", ("copy", "contiguous", "cat", "clone", "to_copy", "permute", "transpose", "stack",
                     "index", "pad", "memcpy", "memset", "fill", "_to_", "view", "reshape", "slice",
                     "interpolate", "upsample")),
    ("elementwise", ("add", "mul", "sub", "div", "silu", "gelu", "sigmoid", "exp", "pow", "sqrt", "rsqrt",
                     "tanh", "where", "clamp", "elementwise", "vectorized", "unrolled", "neg", "sin", "cos",
                     "mean", "sum", "reduce")),
]


def op_family(name: str) -> str:
    n = name.lower()
    for fam, keys in OP_FAMILIES:
        if any(k in n for k in keys):
            return fam
    return "other"


@dataclasses.dataclass
class RegionStats:
    name: str
    calls: int = 0
    total_ms: float = 0.0
    peak_mem_mb: float | None = None

    @property
    def mean_ms(self) -> float:
        return self.total_ms / self.calls if self.calls else 0.0


class _Timer:
    """Pending timings of one device; CUDA events are resolved only when asked (one sync)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.device = device
        self.pending: list[tuple[str, Any, Any]] = []
        self.done: dict[str, RegionStats] = {}
        self.depth = 0

    def start(self):
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return e
        return time.perf_counter()

    def stop(self, name: str, start) -> None:
        st = self.done.setdefault(name, RegionStats(name))
        st.calls += 1
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            self.pending.append((name, start, e))
        else:
            st.total_ms += (time.perf_counter() - start) * 1e3

    def resolve(self) -> dict[str, RegionStats]:
        if self.pending:
            torch.cuda.synchronize(self.device)
            for name, s, e in self.pending:
                self.done[name].total_ms += s.elapsed_time(e)
            self.pending.clear()
        return self.done


@dataclasses.dataclass
class ProfileReport:
    device: str
    wall_ms: float | None
    regions: list[RegionStats]
    families: dict[str, float]  # family -> self time (ms) from torch.profiler
    top_ops: list[tuple[str, float, int]]  # (name, self ms, calls)
    peak_mem_mb: float | None

    def bottlenecks(self) -> tuple[list[tuple[str, float, float]], list[tuple[str, float, float]]]:
        """(regions, op families), each ranked as (name, ms, share): a region's share of the run's
        wall time (of the timed regions' sum when no wall time was taken), a family's share of
        the op self time profiled."""
        tot = max(sum(r.total_ms for r in self.regions), self.wall_ms or 0.0)
        regions = sorted(((r.name, r.total_ms, r.total_ms / tot if tot else 0.0) for r in self.regions),
                         key=lambda x: -x[1])
        ftot = sum(self.families.values())
        fams = sorted(((f, ms, ms / ftot if ftot else 0.0) for f, ms in self.families.items()), key=lambda x: -x[1])
        return regions, fams

    def to_dict(self) -> dict:
        return {
            "device": self.device,
            "wall_ms": self.wall_ms,
            "regions": [dataclasses.asdict(r) | {"mean_ms": r.mean_ms} for r in self.regions],
            "op_families_ms": self.families,
            "top_ops": [{"name": n, "self_ms": ms, "calls": c} for n, ms, c in self.top_ops],
            "peak_mem_mb": self.peak_mem_mb,
        }

    def table(self) -> str:
        lines = []
        if self.wall_ms is not None:
            lines.append(f"wall time {self.wall_ms:.1f} ms on {self.device}"
                         + (f", peak memory {self.peak_mem_mb:.0f} MB" if self.peak_mem_mb is not None else ""))
        timed = sum(r.total_ms for r in self.regions)
        base = max(timed, self.wall_ms or 0.0)
        if self.regions:
            lines.append(f"{'region':<22}{'calls':>7}{'total ms':>12}{'mean ms':>11}{'share':>8}{'peak MB':>10}")
            for r in sorted(self.regions, key=lambda r: -r.total_ms):
                mem = f"{r.peak_mem_mb:.0f}" if r.peak_mem_mb is not None else "-"
                share = f"{100 * r.total_ms / base:.1f}%" if base else "-"
                lines.append(f"{r.name:<22}{r.calls:>7}{r.total_ms:>12.1f}{r.mean_ms:>11.2f}{share:>8}{mem:>10}")
            if self.wall_ms:
                rest = self.wall_ms - timed
                lines.append(f"{'(outside regions)':<22}{'':>7}{rest:>12.1f}{'':>11}{100 * rest / base:>7.1f}%")
        if self.families:
            ftot = sum(self.families.values())
            lines.append("")
            lines.append(f"{'op family (self time)':<22}{'ms':>12}{'share':>8}")
            for f, ms in sorted(self.families.items(), key=lambda x: -x[1]):
                lines.append(f"{f:<22}{ms:>12.1f}{100 * ms / ftot:>7.1f}%")
        if self.top_ops:
            lines.append("")
            lines.append(f"{'top ops (self time)':<50}{'ms':>10}{'calls':>7}")
            for n, ms, c in self.top_ops:
                lines.append(f"{n[:49]:<50}{ms:>10.1f}{c:>7}")
        regions, fams = self.bottlenecks()
        if regions or fams:
            lines.append("")
            parts = []
            if regions:
                parts.append(", ".join(f"{n} {100 * s:.0f}%" for n, _, s in regions[:3]) + " of the run")
            if fams:
                parts.append("by op family: " + ", ".join(f"{n} {100 * s:.0f}%" for n, _, s in fams[:3]))
            lines.append("bottlenecks: " + "; ".join(parts))
        return "\n".join(lines)

    def save_chart(self, path: str) -> str | None:
        """Horizontal bars of region times and op-family shares; None when no plotting is possible."""
        bars = [(f"{r.name}", r.total_ms) for r in sorted(self.regions, key=lambda r: -r.total_ms)]
        fam = sorted(self.families.items(), key=lambda x: -x[1])
        groups = [("regions (ms)", bars)]
        if fam:
            groups.append(("op families, self time (ms)", fam))
        return bar_chart(path, f"vdcompile profile ({self.device})", groups)


class Profiler:
    """Times named regions of a pipeline and, inside :meth:`ops`, op families via torch.profiler."""

    def __init__(self, device: torch.device | str = "cpu", *, region_memory: bool = True):
        self.device = torch.device(device)
        self._timer = _Timer(self.device)
        self._undo: list[Callable[[], None]] = []
        self._families: dict[str, float] = {}
        self._top: list[tuple[str, float, int]] = []
        self._wall_ms: float | None = None
        self._region_memory = region_memory and self.device.type == "cuda"
        self._peak: dict[str, float] = {}
        self._pending_prof = None

    # -- regions -------------------------------------------------------------------------------

    @contextlib.contextmanager
    def region(self, name: str):
        """Time a block of code (nested regions each get their own total)."""
        if self._region_memory and self._timer.depth == 0:
            torch.cuda.reset_peak_memory_stats(self.device)
        self._timer.depth += 1
        s = self._timer.start()
        try:
            yield
        finally:
            self._timer.stop(name, s)
            self._timer.depth -= 1
            if self._region_memory and self._timer.depth == 0:
                mb = torch.cuda.max_memory_allocated(self.device) / 2**20
                self._peak[name] = max(self._peak.get(name, 0.0), mb)

    def wrap(self, fn: Callable, name: str) -> Callable:
        @functools.wraps(fn)
        def timed(*args, **kwargs):
            with self.region(name):
                return fn(*args, **kwargs)
        return timed

    def patch(self, obj: Any, attr: str, name: str) -> None:
        """Replace ``obj.attr`` (a method) by a timed wrapper, undone by :meth:`remove`."""
        had_own = attr in vars(obj)
        orig = getattr(obj, attr)
        setattr(obj, attr, self.wrap(orig, name))

        def undo():
            if had_own:
                setattr(obj, attr, orig)
            else:
                delattr(obj, attr)
        self._undo.append(undo)

    def time_module(self, module: torch.nn.Module, name: str) -> None:
        """Forward hooks around ``module`` (works on torch.compile'd modules too)."""
        state: list[Any] = []

        def pre(_m, _a):
            if self._region_memory and self._timer.depth == 0:
                torch.cuda.reset_peak_memory_stats(self.device)
            self._timer.depth += 1
            state.append(self._timer.start())

        def post(_m, _a, _o):
            self._timer.stop(name, state.pop())
            self._timer.depth -= 1
            if self._region_memory and self._timer.depth == 0:
                mb = torch.cuda.max_memory_allocated(self.device) / 2**20
                self._peak[name] = max(self._peak.get(name, 0.0), mb)

        h1 = module.register_forward_pre_hook(pre)
        h2 = module.register_forward_hook(post)
        self._undo.append(h1.remove)
        self._undo.append(h2.remove)

    def instrument(self, pipe: Any) -> "Profiler":
        """Time the parts of a video pipeline that exist: ``unet`` forward, ``vae.decode``,
        ``vae.encode``, ``scheduler.step`` and the image/text encoder."""
        if getattr(pipe, "unet", None) is not None:
            self.time_module(pipe.unet, "unet forward")
        vae = getattr(pipe, "vae", None)
        if vae is not None:
            self.patch(vae, "decode", "vae decode")
            self.patch(vae, "encode", "vae encode")
        if getattr(pipe, "scheduler", None) is not None:
            self.patch(pipe.scheduler, "step", "scheduler step")
        for enc in ("image_encoder", "text_encoder"):
            m = getattr(pipe, enc, None)
            if isinstance(m, torch.nn.Module):
                self.time_module(m, enc.replace("_", " "))
        return self

    def remove(self) -> None:
        while self._undo:
            self._undo.pop()()

    @contextlib.contextmanager
    def wall(self):
        """The run's total wall time (regions are shares of it)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        t = time.perf_counter()
        try:
            yield
        finally:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            self._wall_ms = (time.perf_counter() - t) * 1e3

    # -- op families ---------------------------------------------------------------------------

    @contextlib.contextmanager
    def ops(self, top: int = 12):
        """Run the block under torch.profiler and aggregate self time per op family."""
        from torch.profiler import ProfilerActivity, profile

        acts = [ProfilerActivity.CPU]
        on_gpu = self.device.type == "cuda"
        if on_gpu:
            acts.append(ProfilerActivity.CUDA)
        with profile(activities=acts, record_shapes=False) as prof:
            try:
                yield
            finally:
                if on_gpu:  # kernels still in flight when the profiler stops would be lost
                    torch.cuda.synchronize(self.device)
        # Aggregated in report(): key_averages() is slow and must not count as run time.
        self._pending_prof = (prof, on_gpu, top)

    def _aggregate(self) -> None:
        pending, self._pending_prof = self._pending_prof, None
        if pending is None:
            return
        prof, on_gpu, top = pending
        fam: dict[str, float] = defaultdict(float)
        rows = []
        for ev in prof.key_averages():
            # GPU time on a GPU (kernels), CPU self time on the CPU (aten ops).
            us = _self_device_us(ev) if on_gpu else ev.self_cpu_time_total
            if us <= 0 or ev.key.startswith("ProfilerStep"):
                continue
            fam[op_family(ev.key)] += us / 1e3
            rows.append((ev.key, us / 1e3, ev.count))
        self._families = dict(fam)
        self._top = sorted(rows, key=lambda r: -r[1])[:top]

    # -- results -------------------------------------------------------------------------------

    def report(self) -> ProfileReport:
        self._aggregate()
        done = self._timer.resolve()
        regions = []
        for name, st in done.items():
            regions.append(RegionStats(name, st.calls, st.total_ms, self._peak.get(name)))
        peak = None
        if self.device.type == "cuda":
            peak = torch.cuda.max_memory_allocated(self.device) / 2**20
            if self._peak:
                peak = max(peak, *self._peak.values())
        return ProfileReport(str(self.device), self._wall_ms, regions, self._families, self._top, peak)


def _self_device_us(ev) -> float:
    # Named self_cuda_time_total in older torch releases.
    for attr in ("self_device_time_total", "self_cuda_time_total"):
        v = getattr(ev, attr, None)
        if v is not None:
            return float(v)
    return 0.0


# ---------------------------------------------------------------------------------------------
# Charts: matplotlib when installed, else a plain bar chart drawn with Pillow.


def bar_chart(path: str, title: str, groups: Iterable[tuple[str, list[tuple[str, float]]]]) -> str | None:
    groups = [(t, [(str(k), float(v)) for k, v in bars]) for t, bars in groups if bars]
    if not groups:
        return None
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return _pil_bar_chart(path, title, groups)
    fig, axes = plt.subplots(len(groups), 1, figsize=(9, 1.2 + sum(0.45 * len(b) + 0.8 for _, b in groups)),
                             squeeze=False)
    for ax, (sub, bars) in zip(axes[:, 0], groups):
        names = [b[0] for b in bars][::-1]
        vals = [b[1] for b in bars][::-1]
        ax.barh(names, vals, color="#4c72b0")
        for y, v in enumerate(vals):
            ax.text(v, y, f" {v:.3g}", va="center", fontsize=8)
        ax.set_title(sub, fontsize=10)
        ax.margins(x=0.15)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _pil_bar_chart(path: str, title: str, groups) -> str | None:
    try:
        from PIL import Image, ImageDraw
    except ImportError:
        return None
    row, label_w, bar_w, pad = 22, 260, 420, 12
    height = 40 + sum(28 + row * len(b) + pad for _, b in groups)
    img = Image.new("RGB", (label_w + bar_w + 110, height), "white")
    d = ImageDraw.Draw(img)
    d.text((pad, 10), title, fill="black")
    y = 40
    for sub, bars in groups:
        d.text((pad, y), sub, fill="black")
        y += 24
        top = max((v for _, v in bars), default=0.0) or 1.0
        for name, v in bars:
            d.text((pad, y + 4), name[:40], fill="black")
            w = int(bar_w * max(v, 0.0) / top)
            d.rectangle([label_w, y + 2, label_w + max(w, 1), y + row - 4], fill=(76, 114, 176))
            d.text((label_w + w + 6, y + 4), f"{v:.3g}", fill="black")
            y += row
        y += pad
    img.save(path)
    return path


_SANITIZE = re.compile(r"[^A-Za-z0-9_.-]+")


def safe_name(s: str) -> str:
    return _SANITIZE.sub("_", s).strip("_") or "x"
