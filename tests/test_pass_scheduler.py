"""The updates of diffusers' Euler, DDIM and DPM-Solver++ steps => vd::scheduler_step, in compiled loops."""
from __future__ import annotations

import pytest
import torch
from diffusers import DDIMScheduler, DPMSolverMultistepScheduler, EulerDiscreteScheduler
from expecttest import TestCase

from tests.backend_checks import BACKEND, assert_fired, assert_rejected, capture_rewrites, compare_with_eager
from vdcompile import built_backends
from vdcompile.explain import graph_code

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
        with capture_rewrites(reset=True) as sink:
            step = torch.compile(lambda mo, t, x: s.step(mo, t, x, return_dict=False), backend=BACKEND,
                                 options={"inner_compiler": "eager"})
            for i in range(3):
                t = s.timesteps[i]
                out = step(mo, t, x)
                want = ref.step(mo, t, x, return_dict=False)
                for a, b in zip(out, want):
                    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
                x = want[0]
        fired = [r.fired.get("scheduler_step", 0) for r, _ in sink]
        # The update sits in one graph per compile of step (recompiled once, when the step index
        # becomes dynamic); every other graph is scheduler bookkeeping.
        self.assertEqual(sum(fired), expected_per_graph * sum(1 for f in fired if f))
        self.assertGreaterEqual(sum(fired), 1)
        return [g for r, g in sink if r.fired.get("scheduler_step")]

    def test_epsilon(self):
        graphs = self._steps("epsilon", 1)
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


def _loop(make, steps, timestep=lambda t: t, tol=1e-5):
    """Compiles ``scheduler.step(...).prev_sample`` and runs ``steps`` steps of a loop against a
    second scheduler run eagerly (same inputs each step). Returns per step (graphs compiled,
    scheduler_step rewrites fired) and the rewritten graphs in which the rewrite fired."""
    s, ref = make(steps), make(steps)
    torch.manual_seed(0)
    x = torch.randn(2, 4, 6, 6)
    per_step = []
    with capture_rewrites(reset=True) as sink:
        step = torch.compile(lambda mo, t, x: s.step(mo, t, x).prev_sample, backend=BACKEND,
                             options={"inner_compiler": "eager"})
        for i in range(steps):
            t = timestep(s.timesteps[i])
            mo = torch.sin(3 * x + i)  # a stand-in for the model's output
            n = len(sink)
            out, want = step(mo, t, x), ref.step(mo, t, x).prev_sample
            # Relative to the values' scale: DPM's epsilon x0 reaches |x| / alpha, in the tens.
            torch.testing.assert_close(out, want, atol=tol * (1 + want.abs().max().item()), rtol=tol)
            per_step.append((len(sink) - n, sum(r.fired.get("scheduler_step", 0) for r, _ in sink[n:])))
            x = want
    for r, _ in sink:
        assert not r.rejected.get("scheduler_step"), r.rejected
    return per_step, [g for r, g in sink if r.fired.get("scheduler_step")]


def _ddim(pred, clip=False):
    def make(steps):
        s = DDIMScheduler(prediction_type=pred, clip_sample=clip)
        s.set_timesteps(steps)
        return s
    return make


def _dpm(pred, solver_type="midpoint"):
    def make(steps):
        s = DPMSolverMultistepScheduler(prediction_type=pred, solver_type=solver_type, solver_order=2)
        s.set_timesteps(steps)
        return s
    return make


def _op_calls(gm) -> int:
    return sum(1 for n in gm.graph.nodes if n.target is torch.ops.vd.scheduler_step.default)


class TestDDIMStep(TestCase):
    """DDIMScheduler, eta = 0."""

    def _int_timesteps(self, make, steps=6):
        # An int timestep keeps the step in one graph; it is compiled static at step 0, with a
        # dynamic timestep at step 1, and once more at the last step (prev_timestep < 0).
        per_step, graphs = _loop(make, steps, timestep=int)
        self.assertEqual(per_step, [(1, 1), (1, 1)] + [(0, 0)] * (steps - 3) + [(1, 1)])
        for g in graphs:  # x0, pred_epsilon and the update: one op, nothing else elementwise on tensors
            self.assertEqual(_op_calls(g), 1)
        return graphs

    def test_epsilon(self):
        graphs = self._int_timesteps(_ddim("epsilon"))
        self.assertExpectedInline(graph_code(graphs[1]), """\
def forward(mo, s_alphas_cumprod, t, x):
    v0 = operator.sub(t, 166)
    v1 = torch.select(s_alphas_cumprod, 0, t)
    v2 = torch.select(s_alphas_cumprod, 0, v0)
    v3 = operator.sub(1, v1)
    v4 = torch.select(s_alphas_cumprod, 0, t)
    v5 = torch.select(s_alphas_cumprod, 0, v0)
    v6 = operator.sub(1, v4)
    v7 = operator.sub(1, v5)
    v8 = operator.truediv(v7, v6)
    v9 = operator.truediv(v4, v5)
    v10 = operator.sub(1, v9)
    v11 = operator.mul(v8, v10)
    v12 = operator.pow(v11, 0.5)
    v13 = operator.mul(0.0, v12)
    v14 = operator.pow(v1, 0.5)
    v15 = operator.pow(v3, 0.5)
    v16 = torch.zeros_like(v14)
    v17 = torch.ones_like(v14)
    v18 = operator.truediv(1, v14)
    v19 = operator.neg(v15)
    v20 = operator.truediv(v19, v14)
    v21 = operator.sub(1, v2)
    v22 = operator.pow(v13, 2)
    v23 = operator.sub(v21, v22)
    v24 = operator.pow(v23, 0.5)
    v25 = operator.mul(v24, v16)
    v26 = operator.mul(v24, v17)
    v27 = operator.pow(v2, 0.5)
    v28 = torch.stack([v18, v20, v25, v26, v27, v16])
    v29 = vd.scheduler_step(mo, x, v28, None, None, None, None)
    v30 = operator.getitem(v29, 0)
    return (v30,)""")

    def test_v_prediction(self):
        self._int_timesteps(_ddim("v_prediction"))

    def test_clip_sample(self):  # diffusers' default: x0 clamped to [-1, 1], the op's clip_x0
        graphs = self._int_timesteps(_ddim("epsilon", clip=True))
        self.assertIn("1.0)", [ln for ln in str(graphs[1].code).splitlines() if "scheduler_step" in ln][0])
        self._int_timesteps(_ddim("v_prediction", clip=True))

    def test_tensor_timesteps(self):
        # `for t in scheduler.timesteps`: the step splits at `prev_timestep >= 0` and the graphs
        # before the split are recompiled per step (dynamo specialises on the timestep's value in
        # diffusers' alphas_cumprod[timestep]). The update's graph is compiled once and rewritten.
        per_step, graphs = _loop(_ddim("v_prediction"), 5)
        self.assertEqual([f for _, f in per_step], [1, 0, 0, 0, 0])
        self.assertExpectedInline(graph_code(graphs[0]), """\
def forward(alpha_prod_t_prev, pred_epsilon, pred_original_sample, stack0):
    v0 = operator.pow(stack0, 0.5)
    v1 = operator.mul(0.0, v0)
    v2 = operator.pow(alpha_prod_t_prev, 0.5)
    v3 = torch.zeros_like(v2)
    v4 = torch.ones_like(v2)
    v5 = operator.sub(1, alpha_prod_t_prev)
    v6 = operator.pow(v1, 2)
    v7 = operator.sub(v5, v6)
    v8 = operator.pow(v7, 0.5)
    v9 = torch.stack([v4, v3, v2, v8, v3, v3])
    v10 = vd.scheduler_step(pred_epsilon, pred_original_sample, v9)
    v11 = operator.getitem(v10, 0)
    return (v11,)""")


class TestDPMSolverStep(TestCase):
    """DPMSolverMultistepScheduler, dpmsolver++, solver_order 2."""

    def _steps(self, make, steps=8):
        # Compiled at step 0 (first order, step index unset), 1 (static index), 2 (dynamic index)
        # and at the last two steps (diffusers branches on the index there); none in between.
        per_step, graphs = _loop(make, steps)
        self.assertEqual([c > 0 for c, _ in per_step], [True] * 3 + [False] * (steps - 5) + [True] * 2)
        self.assertEqual([f for _, f in per_step], [1] * 3 + [0] * (steps - 5) + [1] * 2)
        for g in graphs:
            self.assertEqual(_op_calls(g), 1)
        return graphs

    def test_epsilon_first_and_second_order(self):
        graphs = self._steps(_dpm("epsilon"))
        # First order at the first and last steps (lower_order_final): no previous x0; second order: the previous x0 is the op's prev_x0.
        ops = [next(n for n in g.graph.nodes if n.target is torch.ops.vd.scheduler_step.default) for g in graphs]
        self.assertEqual([len(op.args) > 3 and op.args[3] is not None for op in ops], [False, True, True, True, False])
        self.assertExpectedInline(graph_code(graphs[2]), """\
def forward(model_output, model_outputs_1, sample, sigmas, step_index):
    v0 = torch.select(sigmas, 0, step_index)
    v1 = operator.pow(v0, 2)
    v2 = operator.add(v1, 1)
    v3 = operator.pow(v2, 0.5)
    v4 = operator.truediv(1, v3)
    v5 = operator.mul(v0, v4)
    v6 = operator.add(step_index, 1)
    v7 = torch.select(sigmas, 0, v6)
    v8 = torch.select(sigmas, 0, step_index)
    v9 = operator.sub(step_index, 1)
    v10 = torch.select(sigmas, 0, v9)
    v11 = operator.pow(v7, 2)
    v12 = operator.add(v11, 1)
    v13 = operator.pow(v12, 0.5)
    v14 = operator.truediv(1, v13)
    v15 = operator.mul(v7, v14)
    v16 = operator.pow(v8, 2)
    v17 = operator.add(v16, 1)
    v18 = operator.pow(v17, 0.5)
    v19 = operator.truediv(1, v18)
    v20 = operator.mul(v8, v19)
    v21 = operator.pow(v10, 2)
    v22 = operator.add(v21, 1)
    v23 = operator.pow(v22, 0.5)
    v24 = operator.truediv(1, v23)
    v25 = operator.mul(v10, v24)
    v26 = torch.log(v14)
    v27 = torch.log(v15)
    v28 = operator.sub(v26, v27)
    v29 = torch.log(v19)
    v30 = torch.log(v20)
    v31 = operator.sub(v29, v30)
    v32 = torch.log(v24)
    v33 = torch.log(v25)
    v34 = operator.sub(v32, v33)
    v35 = operator.sub(v28, v31)
    v36 = operator.sub(v31, v34)
    v37 = operator.truediv(v36, v35)
    v38 = operator.neg(v35)
    v39 = torch.exp(v38)
    v40 = operator.sub(v39, 1.0)
    v41 = operator.mul(v14, v40)
    v42 = torch.zeros_like(v41)
    v43 = torch.ones_like(v41)
    v44 = operator.truediv(1, v4)
    v45 = operator.neg(v5)
    v46 = operator.truediv(v45, v4)
    v47 = operator.mul(0.5, v41)
    v48 = operator.truediv(v47, v37)
    v49 = operator.truediv(v15, v20)
    v50 = operator.add(v41, v48)
    v51 = operator.neg(v50)
    v52 = torch.stack([v44, v46, v49, v42, v51, v48])
    v53 = vd.scheduler_step(model_output, sample, v52, model_outputs_1)
    v54 = operator.getitem(v53, 0)
    v55 = operator.getitem(v53, 1)
    v56 = v54.to(torch.float32)
    return (v6, v55, v56)""")

    def test_v_prediction(self):
        self._steps(_dpm("v_prediction"))

    def test_heun(self):
        self._steps(_dpm("epsilon", "heun"))

    def test_sample_prediction_update_only(self):
        # x0 is the model output itself: the update alone is rewritten, x0 passed as the op's input.
        graphs = self._steps(_dpm("sample"))
        op = next(n for n in graphs[2].graph.nodes if n.target is torch.ops.vd.scheduler_step.default)
        self.assertIn("model_output", op.args[0].name)
        self.assertEqual((op.args[1].op, op.args[1].target), ("call_method", "to"))  # the upcast sample

    def test_upcast_sample_refused(self):
        def update(sample, mo, alpha_0, sigma_0, sigma_t, sigma_s, alpha_t, h):
            x0 = (sample - sigma_0 * mo) / alpha_0
            s = sample.to(torch.float64)
            return (sigma_t / sigma_s) * s - (alpha_t * (torch.exp(-h) - 1.0)) * x0, x0

        scalars = [torch.tensor(v) for v in (0.9, 0.4, 0.3, 0.5, 0.95, 0.7)]
        out = compare_with_eager(update, torch.randn(2, 3), torch.randn(2, 3), *scalars, grad=False)
        assert_fired(out, {})
        assert_rejected(out, "scheduler_step", "upcast")
