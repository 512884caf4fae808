"""A whole SVD denoising loop with the UNet compiled by vdcompile.optimize and the scheduler step
compiled with backend="vdcompile": the same frames as eager, the Euler update rewritten in-graph,
and no recompile across steps."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch._dynamo

from tests.backend_checks import BACKEND, capture_rewrites
from vdcompile import built_backends, models, runner
from vdcompile.optimize import backend_status, optimize

pytestmark = pytest.mark.skipif("CPU" not in built_backends("scheduler_step") or not backend_status()[0],
                                reason="needs the vdcompile backend and vd::scheduler_step's CPU kernel")


@pytest.fixture(autouse=True)
def _one_thread_fresh_dynamo(one_thread):  # one_thread: tests/conftest.py
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _frames(r) -> np.ndarray:
    return np.stack([np.asarray(f, dtype=np.int16) for f in r.frames])


def test_svd_loop_with_compiled_unet_and_scheduler_step():
    pipe = models.build_svd_pipeline("tiny")
    assert pipe.scheduler.config.prediction_type == "v_prediction"  # SVD's Euler
    kw = dict(num_frames=4, height=32, width=32, steps=4, seed=0)
    ref = runner.run_video(pipe, **kw)

    options = {"inner_compiler": "eager"}  # rewrites only: keeps the test short on a CPU
    optimize(pipe, options=options, fuse_scheduler=False)
    # dynamic=True: the step index is symbolic from the first call, so one compile serves every step.
    pipe.scheduler.step = torch.compile(pipe.scheduler.step, backend=BACKEND, dynamic=True, options=options)
    with capture_rewrites() as sink:
        # Every frame dynamo compiles is compiled once: a recompile at a later step raises.
        with torch._dynamo.config.patch(error_on_recompile=True):
            out = runner.run_video(pipe, **kw)
            n_graphs = len(sink)
            again = runner.run_video(pipe, **kw)  # the same compiled code serves another video

    fired = [r.fired.get("scheduler_step", 0) for r, _ in sink]
    assert sum(fired) == 1, f"the Euler update should be rewritten in exactly one graph: {fired}"
    assert len(sink) == n_graphs, "the second video compiled new graphs"
    # uint8 frames, fp32 on a CPU: at most two levels from reordered float math.
    for r in (out, again):
        diff = np.abs(_frames(r) - _frames(ref)).max()
        assert diff <= 2, f"frames differ from eager by {diff} levels"
