"""The update of EulerDiscreteScheduler.step => vd::scheduler_step."""
from __future__ import annotations

import pytest
import torch
from diffusers import EulerDiscreteScheduler
from expecttest import TestCase

from tests.backend_checks import BACKEND, assert_fired, assert_rejected, code, compare_with_eager
from vdcompile import backend, built_backends

pytestmark = pytest.mark.skipif("CPU" not in built_backends("scheduler_step"),
                                reason="vd::scheduler_step was built without a CPU kernel")


def _euler(pred):
    s = EulerDiscreteScheduler(prediction_type=pred)
    s.set_timesteps(10)
    return s


class TestEulerStep(TestCase):
    def _steps(self, pred, expected_per_graph):
        """Compiles scheduler.step and runs 3 steps against a second scheduler run eagerly."""
        torch.manual_seed(0)
        s, ref = _euler(pred), _euler(pred)
        x, mo = torch.randn(2, 4, 6, 6), torch.randn(2, 4, 6, 6)
        torch._dynamo.reset()
        sink: list = []
        backend._SINKS.append(sink)
        try:
            step = torch.compile(lambda mo, t, x: s.step(mo, t, x, return_dict=False), backend=BACKEND,
                                 options={"inner_compiler": "eager"})
            for i in range(3):
                t = s.timesteps[i]
                out = step(mo, t, x)
                want = ref.step(mo, t, x, return_dict=False)
                for a, b in zip(out, want):
                    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
                x = want[0]
        finally:
            backend._SINKS.remove(sink)
            torch._dynamo.reset()
        fired = [r.fired.get("scheduler_step", 0) for r, _ in sink]
        # The update sits in one graph per compile of step (recompiled once, when the step index
        # becomes dynamic); every other graph is scheduler bookkeeping.
        self.assertEqual(sum(fired), expected_per_graph * sum(1 for f in fired if f))
        self.assertGreaterEqual(sum(fired), 1)
        return [g for r, g in sink if r.fired.get("scheduler_step")]

    def test_epsilon(self):
        graphs = self._steps("epsilon", 1)
        from vdcompile.explain import graph_code

        self.assertExpectedInline(graph_code(graphs[0]), """\
def forward(model_output, sample, sigma, sigmas):
    v0 = operator.mul(sigma, 1.0)
    v1 = operator.getitem(sigmas, 1)
    v2 = operator.sub(v1, v0)
    v3 = operator.truediv(v2, v0)
    v4 = torch.ones_like(v0)
    v5 = torch.zeros_like(v0)
    v6 = operator.neg(v0)
    v7 = operator.add(1, v3)
    v8 = operator.neg(v3)
    v9 = torch.stack([v4, v6, v7, v5, v8, v5])
    v10 = vd.scheduler_step(model_output, sample, v9)
    v11 = operator.getitem(v10, 0)
    v12 = operator.getitem(v10, 1)
    v13 = v11.to(torch.float32)
    return (v13, v12)""")

    def test_v_prediction(self):  # Stable Video Diffusion's scheduler
        self._steps("v_prediction", 1)

    def test_sample_prediction(self):
        self._steps("sample", 1)

    def test_gradients(self):
        def update(sample, mo, sigma_hat, sigma_next):
            x0 = sample - sigma_hat * mo
            return sample + (sample - x0) / sigma_hat * (sigma_next - sigma_hat), x0

        args = (torch.randn(2, 3, 4).requires_grad_(), torch.randn(2, 3, 4).requires_grad_(),
                torch.tensor(2.5, requires_grad=True), torch.tensor(1.5))
        assert_fired(compare_with_eager(update, *args), {"scheduler_step": 1})

    def test_python_float_sigma_refused(self):
        def update(sample, x0, sigma_hat, sigma_next):
            return sample + (sample - x0) / sigma_hat * (sigma_next - sigma_hat)

        # A float sigma would be burned into the graph (a recompile per step).
        out = compare_with_eager(update, torch.randn(2, 3), torch.randn(2, 3), 2.5, torch.tensor(1.5), grad=False)
        assert_fired(out, {})
        assert_rejected(out, "scheduler_step", "not a tensor")

    def test_derivative_escapes(self):
        def update(sample, x0, sigma_hat, sigma_next):
            d = (sample - x0) / sigma_hat
            return sample + d * (sigma_next - sigma_hat), d

        out = compare_with_eager(update, torch.randn(2, 3), torch.randn(2, 3), torch.tensor(2.0),
                                 torch.tensor(1.0), grad=False)
        assert_fired(out, {})
        assert_rejected(out, "scheduler_step", "also used by")
