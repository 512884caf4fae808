"""Profiler: region timing, op families from torch.profiler, report, chart, pipeline instrumentation."""
from __future__ import annotations

import time

import pytest
import torch
from torch import nn

from vdcompile import models, runner
from vdcompile.profiler import Profiler, bar_chart, op_family


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.mark.parametrize("name,family", [
    ("aten::_scaled_dot_product_flash_attention_for_cpu", "attention"),
    ("flash_fwd_kernel", "attention"),
    ("aten::mkldnn_convolution", "conv"),
    ("aten::native_group_norm", "norm"),
    ("aten::addmm", "matmul"),
    ("sm90_xmma_gemm_bf16bf16", "matmul"),
    ("nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_bias_TNT", "matmul"),  # cuBLAS 13's GEMM kernels
    ("aten::silu", "elementwise"),
    ("aten::copy_", "copy/layout"),
    ("vd::group_norm_silu", "vd ops"),
    ("triton_poi_fused_add_0", "compiled kernels"),
    ("cpp_fused_mul_1", "compiled kernels"),
    ("aten::something_new", "other"),
])
def test_op_family(name, family):
    assert op_family(name) == family


def test_regions_time_and_count():
    prof = Profiler("cpu")
    for _ in range(3):
        with prof.region("outer"):
            time.sleep(0.01)
            with prof.region("inner"):
                time.sleep(0.005)
    rep = prof.report()
    by = {r.name: r for r in rep.regions}
    assert by["outer"].calls == 3 and by["inner"].calls == 3
    assert by["outer"].total_ms >= 45 and by["inner"].total_ms >= 15
    assert by["outer"].total_ms > by["inner"].total_ms
    assert by["inner"].mean_ms == pytest.approx(by["inner"].total_ms / 3)


class _Toy(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(4, 8, 3, padding=1)
        self.norm = nn.GroupNorm(2, 8)
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        h = self.norm(self.conv(x)).flatten(2).transpose(1, 2)
        q = self.lin(h).unsqueeze(1)
        return torch.nn.functional.scaled_dot_product_attention(q, q, q)


def test_op_families_and_report(tmp_path):
    m, x = _Toy().eval(), torch.randn(2, 4, 16, 16)
    prof = Profiler("cpu")
    prof.time_module(m, "toy forward")
    with torch.no_grad(), prof.ops(), prof.wall():
        for _ in range(2):
            m(x)
    rep = prof.report()
    for fam in ("conv", "norm", "matmul", "attention"):
        assert rep.families.get(fam, 0) > 0, (fam, rep.families)
    assert rep.regions[0].name == "toy forward" and rep.regions[0].calls == 2
    assert rep.wall_ms >= rep.regions[0].total_ms
    text = rep.table()
    assert "toy forward" in text and "op family" in text and "bottlenecks:" in text
    regions, fams = rep.bottlenecks()
    assert [r[0] for r in regions] == ["toy forward"] and 0 < regions[0][2] <= 1
    assert [f[1] for f in fams] == sorted((f[1] for f in fams), reverse=True)
    assert sum(f[2] for f in fams) == pytest.approx(1.0)
    d = rep.to_dict()
    assert d["regions"][0]["calls"] == 2 and d["op_families_ms"]
    png = rep.save_chart(str(tmp_path / "p.png"))
    with open(png, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_bar_chart_empty_is_none(tmp_path):
    assert bar_chart(str(tmp_path / "x.png"), "t", [("nothing", [])]) is None


def test_instrument_pipeline_and_remove():
    pipe = models.build_svd_pipeline("tiny")
    prof = Profiler("cpu").instrument(pipe)
    runner.run_video(pipe, num_frames=2, height=32, width=32, steps=3)
    prof.remove()
    by = {r.name: r for r in prof.report().regions}
    assert by["unet forward"].calls == 3
    assert by["scheduler step"].calls == 3
    assert by["vae decode"].calls == 1 and by["vae encode"].calls == 1
    assert by["image encoder"].calls == 1
    # remove() undoes every patch and hook
    assert "step" not in vars(pipe.scheduler) and "decode" not in vars(pipe.vae)
    assert not pipe.unet._forward_hooks and not pipe.unet._forward_pre_hooks
    runner.run_video(pipe, num_frames=2, height=32, width=32, steps=1)
    assert {r.name: r.calls for r in prof.report().regions}["unet forward"] == 3
