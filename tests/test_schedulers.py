"""vdcompile.schedulers: fused steps against diffusers' own scheduler.step, step by step.

Each loop runs two independent trajectories from the same noise, one with ``scheduler.step`` and
one with ``fused_step``, and compares every step's outputs and the scheduler state. Tolerance
(float32): max abs error <= 2e-5 * (1 + max |diffusers output|) (tests/common.py TOL); the
trajectories do not re-synchronise, so this also bounds the drift over the whole loop.
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch._dynamo
import torch._dynamo.testing
from diffusers import DDIMScheduler, DPMSolverMultistepScheduler, EulerDiscreteScheduler, PNDMScheduler

from tests.common import assert_close_to
from vdcompile.ops import scheduler_step
from vdcompile.schedulers import UnsupportedSchedulerError, fused_step, step_coeffs, unsupported_reason, x0_clip

SHAPE = (2, 4, 3, 8, 8)  # (B, C, F, H, W) latents

# Stable Video Diffusion's scheduler config (img2vid-xt).
SVD_EULER = dict(beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear", prediction_type="v_prediction",
                 interpolation_type="linear", sigma_min=0.002, sigma_max=700.0, steps_offset=1,
                 timestep_spacing="leading", timestep_type="continuous", use_karras_sigmas=True)

CONFIGS = {
    "euler_epsilon": (EulerDiscreteScheduler, {}, 15),
    "euler_v": (EulerDiscreteScheduler, dict(prediction_type="v_prediction"), 12),
    "euler_sample": (EulerDiscreteScheduler, dict(prediction_type="sample"), 10),
    "euler_svd": (EulerDiscreteScheduler, SVD_EULER, 25),
    "euler_sigma_min_exp": (EulerDiscreteScheduler, dict(use_exponential_sigmas=True, final_sigmas_type="sigma_min"), 10),
    "ddim_epsilon_clip": (DDIMScheduler, {}, 15),  # diffusers' default: clip_sample=True
    "ddim_epsilon": (DDIMScheduler, dict(clip_sample=False, timestep_spacing="trailing", set_alpha_to_one=False), 10),
    "ddim_v": (DDIMScheduler, dict(prediction_type="v_prediction", clip_sample=False, rescale_betas_zero_snr=True,
                                   timestep_spacing="trailing"), 12),
    "ddim_sample_clip": (DDIMScheduler, dict(prediction_type="sample", clip_sample_range=0.8), 10),
    "dpm_epsilon": (DPMSolverMultistepScheduler, {}, 20),
    "dpm_v_short": (DPMSolverMultistepScheduler, dict(prediction_type="v_prediction", final_sigmas_type="sigma_min"), 12),
    "dpm_v_long": (DPMSolverMultistepScheduler, dict(prediction_type="v_prediction", final_sigmas_type="sigma_min"), 16),
    "dpm_sample_heun": (DPMSolverMultistepScheduler, dict(prediction_type="sample", solver_type="heun"), 10),
    "dpm_karras": (DPMSolverMultistepScheduler, dict(use_karras_sigmas=True), 15),
    "dpm_euler_at_final": (DPMSolverMultistepScheduler, dict(euler_at_final=True, final_sigmas_type="sigma_min",
                                                             lower_order_final=False), 16),
    "dpm_order1": (DPMSolverMultistepScheduler, dict(solver_order=1), 10),
    "dpm_flow": (DPMSolverMultistepScheduler, dict(prediction_type="flow_prediction", use_flow_sigmas=True,
                                                   flow_shift=3.0), 12),
}


# Configurations fused_step does not fuse: it must behave exactly as scheduler.step.
FALLBACK_CONFIGS = {
    "dpm_order3": (DPMSolverMultistepScheduler, dict(solver_order=3), 10),
    "dpm_sde": (DPMSolverMultistepScheduler, dict(algorithm_type="sde-dpmsolver++"), 10),
}


def make(name):
    cls, cfg, steps = {**CONFIGS, **FALLBACK_CONFIGS}[name]
    s = cls(**cfg)
    s.set_timesteps(steps)
    return s


def fake_model(x, t, seed=0):
    """A fixed deterministic 'denoiser': a linear function of the input plus a timestep-dependent pattern."""
    g = torch.Generator().manual_seed(seed)
    pattern = torch.randn(x.shape, generator=g)
    t = torch.as_tensor(t, dtype=torch.float32)
    return (0.4 * x.float() + torch.sin(t / 300 + pattern)).to(x.dtype)


def model_input(s, x, t):
    return s.scale_model_input(x, t)


def assert_state_equal(a, b, dtype):
    assert getattr(a, "_step_index", None) == getattr(b, "_step_index", None)
    if isinstance(a, DPMSolverMultistepScheduler):
        assert a.lower_order_nums == b.lower_order_nums
        for ma, mb in zip(a.model_outputs, b.model_outputs):
            assert (ma is None) == (mb is None)
            if ma is not None:
                assert ma.dtype == mb.dtype
                assert_close_to(mb, ma, dtype, what="model_outputs")


def assert_outputs_close(ref, got, dtype, what):
    assert type(ref) is type(got)
    assert list(ref.keys()) == list(got.keys())
    for k in ref.keys():
        assert ref[k].dtype == got[k].dtype, f"{what} {k}"
        assert_close_to(got[k], ref[k], dtype, what=f"{what} {k}")


def run_loop(name, step_a, step_b, dtype=torch.float32, options=None, seed=0):
    """Two trajectories: ``step_a`` on one scheduler, ``step_b`` on a copy; compared every step."""
    a = make(name)
    b = copy.deepcopy(a)
    torch.manual_seed(seed)
    x = (torch.randn(SHAPE) * a.init_noise_sigma).to(dtype)
    xa, xb = x.clone(), x.clone()
    for i, t in enumerate(a.timesteps):
        oa = step_a(a, fake_model(model_input(a, xa, t), t), t, xa, **(options or {}))
        ob = step_b(b, fake_model(model_input(b, xb, t), t), t, xb, **(options or {}))
        assert_outputs_close(oa, ob, dtype, f"{name} step {i}")
        assert_state_equal(a, b, dtype)
        xa, xb = oa.prev_sample, ob.prev_sample
    return a, b


def diffusers_step(s, *args, **kw):
    return s.step(*args, **kw)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_loop_matches_diffusers(name):
    run_loop(name, diffusers_step, fused_step)


def test_ddim_use_clipped_model_output():
    run_loop("ddim_epsilon_clip", diffusers_step, fused_step, options=dict(use_clipped_model_output=True))
    run_loop("ddim_sample_clip", diffusers_step, fused_step, options=dict(use_clipped_model_output=True))


def test_mixed_fused_and_plain_steps():
    """State is advanced identically, so fused and plain steps interleave in one DPM-Solver loop."""
    calls = []

    def alternate(s, *args, **kw):
        calls.append(len(calls) % 2)
        return fused_step(s, *args, **kw) if calls[-1] else s.step(*args, **kw)

    run_loop("dpm_epsilon", diffusers_step, alternate)
    assert set(calls) == {0, 1}


@pytest.mark.parametrize("name", ["euler_v", "ddim_epsilon_clip", "dpm_epsilon"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision_follows_diffusers(name, dtype):
    """Lockstep on one low-precision trajectory: output dtypes equal those of diffusers' step in that
    dtype (e.g. Euler's float32 pred_original_sample), values are within the dtype's tolerance of
    diffusers' step on the same inputs upcast to float32. (diffusers' own low-precision result is no
    reference: DDIM does its arithmetic in float16, amplified by 1/sqrt(alpha_bar) early on.)"""
    low = make(name)
    exact, fused = copy.deepcopy(low), copy.deepcopy(low)
    torch.manual_seed(0)
    x = (torch.randn(SHAPE) * low.init_noise_sigma).to(dtype)
    for i, t in enumerate(low.timesteps):
        mo = fake_model(model_input(low, x, t), t)
        model_input(exact, x, t), model_input(fused, x, t)
        want_dtypes = low.step(mo, t, x)
        want = exact.step(mo.float(), t, x.float())
        got = fused_step(fused, mo, t, x)
        for k in want.keys():
            assert got[k].dtype == want_dtypes[k].dtype, f"{name} step {i} {k}"
            assert_close_to(got[k], want[k], dtype, what=f"{name} step {i} {k}")
        if isinstance(low, DPMSolverMultistepScheduler):  # the stored converted output too
            assert fused.model_outputs[-1].dtype == low.model_outputs[-1].dtype
            assert_close_to(fused.model_outputs[-1], exact.model_outputs[-1], dtype, what=f"{name} x0 {i}")
        x = got.prev_sample


def test_return_dict_false():
    for name, n in (("euler_epsilon", 2), ("ddim_epsilon", 2), ("dpm_epsilon", 1)):
        s = make(name)
        t = s.timesteps[0]
        x = torch.randn(SHAPE)
        out = fused_step(s, fake_model(model_input(s, x, t), t), t, x, return_dict=False)
        assert isinstance(out, tuple) and len(out) == n


# --- temporal blending ------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["euler_svd", "ddim_epsilon_clip", "dpm_epsilon"])
@pytest.mark.parametrize("weight", ["float", "scalar", "per_batch"])
def test_blend_matches_diffusers_then_blend(name, weight):
    torch.manual_seed(3)
    prev_frame = torch.randn(SHAPE)
    w = {"float": 0.7, "scalar": torch.tensor(0.7), "per_batch": torch.tensor([0.2, 0.9])}[weight]
    w_b = torch.as_tensor(w).reshape(-1, 1, 1, 1, 1)

    def blended_reference(s, *args, **kw):
        out = s.step(*args, **kw)
        out.prev_sample = w_b * out.prev_sample + (1 - w_b) * prev_frame
        return out

    def fused(s, *args, **kw):
        return fused_step(s, *args, prev_frame=prev_frame, blend_weight=w, **kw)

    run_loop(name, blended_reference, fused)


def test_blend_on_fallback_path():
    """An unsupported option (s_churn > 0) falls back to scheduler.step and still blends."""
    prev_frame = torch.randn(SHAPE)
    options = dict(s_churn=0.5)

    def reference(s, *args, **kw):
        out = s.step(*args, generator=torch.Generator().manual_seed(s.step_index or 0), **kw)
        out.prev_sample = 0.6 * out.prev_sample + 0.4 * prev_frame
        return out

    def fused(s, *args, **kw):
        return fused_step(s, *args, prev_frame=prev_frame, blend_weight=0.6,
                          generator=torch.Generator().manual_seed(s.step_index or 0), **kw)

    run_loop("euler_epsilon", reference, fused, options=options)


def test_blend_arguments_together():
    s = make("euler_epsilon")
    x = torch.randn(SHAPE)
    with pytest.raises(ValueError, match="prev_frame and blend_weight must be given together"):
        fused_step(s, x, s.timesteps[0], x, prev_frame=x)


# --- unsupported configurations ---------------------------------------------------------------


class _EulerSubclass(EulerDiscreteScheduler):
    pass


@pytest.mark.parametrize("factory,match", [
    (lambda: DDIMScheduler(thresholding=True), "thresholding"),
    (lambda: DPMSolverMultistepScheduler(thresholding=True), "thresholding"),
    (lambda: DPMSolverMultistepScheduler(algorithm_type="sde-dpmsolver++"), "algorithm_type 'sde-dpmsolver\\+\\+'"),
    (lambda: DPMSolverMultistepScheduler(algorithm_type="dpmsolver", final_sigmas_type="sigma_min"), "algorithm_type 'dpmsolver'"),
    (lambda: DPMSolverMultistepScheduler(solver_order=3), "solver_order 3"),
    (lambda: DPMSolverMultistepScheduler(variance_type="learned_range"), "learned variance"),
    (lambda: PNDMScheduler(), "PNDMScheduler is not supported"),
    (lambda: _EulerSubclass(), "_EulerSubclass is not supported"),
])
def test_unsupported_configs_raise_or_fall_back(factory, match):
    s = factory()
    s.set_timesteps(10)
    assert unsupported_reason(s) is not None
    with pytest.raises(UnsupportedSchedulerError, match=match):
        step_coeffs(s, 0)
    x = torch.randn(SHAPE)
    t = s.timesteps[0]
    with pytest.raises(UnsupportedSchedulerError, match=match):
        fused_step(s, fake_model(x, t), t, x, fallback=False)


@pytest.mark.parametrize("name", ["dpm_order3", "dpm_sde"])
def test_fallback_loop_matches_diffusers(name):
    """fused_step on an unsupported scheduler is scheduler.step itself (noise made deterministic)."""
    noise = torch.randn(SHAPE)
    run_loop(name, diffusers_step, fused_step, options=dict(variance_noise=noise))


def test_unsupported_step_options():
    x = torch.randn(SHAPE)
    s = make("euler_epsilon")
    t = s.timesteps[0]
    with pytest.raises(UnsupportedSchedulerError, match="s_churn > 0"):
        fused_step(s, x, t, x, s_churn=1.0, fallback=False)
    s = make("ddim_epsilon")
    t = s.timesteps[0]
    with pytest.raises(UnsupportedSchedulerError, match="eta > 0"):
        fused_step(s, x, t, x, eta=0.5, fallback=False)
    noise = torch.randn(SHAPE)
    ref = copy.deepcopy(s).step(fake_model(x, t), t, x, eta=0.5, variance_noise=noise)
    got = fused_step(s, fake_model(x, t), t, x, eta=0.5, variance_noise=noise)  # falls back
    torch.testing.assert_close(got.prev_sample, ref.prev_sample, rtol=0, atol=0)
    with pytest.raises(TypeError, match="unexpected arguments \\['s_churn'\\]"):
        fused_step(s, x, t, x, s_churn=0.0)


def test_euler_integer_timestep_rejected_like_diffusers():
    s = make("euler_epsilon")
    x = torch.randn(SHAPE)
    with pytest.raises(ValueError, match="integer indices"):
        fused_step(s, x, 5, x)


# --- step_coeffs --------------------------------------------------------------------------------


def test_step_coeffs_bad_index():
    s = make("euler_epsilon")
    with pytest.raises(IndexError, match="step_index 15 is out of range for 15 steps"):
        step_coeffs(s, 15)
    with pytest.raises(TypeError, match="step_index must be an int or an integer tensor"):
        step_coeffs(s, 1.0)
    with pytest.raises(TypeError, match="step_index must be an int or an integer tensor"):
        step_coeffs(s, True)
    with pytest.raises(TypeError, match="integer dtype"):
        step_coeffs(s, torch.tensor(1.0))
    with pytest.raises(ValueError, match="0-D or \\(N,\\)"):
        step_coeffs(s, torch.zeros(2, 2, dtype=torch.long))
    with pytest.raises(ValueError, match="set_timesteps"):
        step_coeffs(EulerDiscreteScheduler(), 0)


@pytest.mark.parametrize("name", ["euler_svd", "ddim_epsilon_clip", "dpm_v_short", "dpm_v_long"])
def test_step_coeffs_index_forms_agree(name):
    """int / 0-D tensor step index, int / tensor lower_order_nums (default: the scheduler's state):
    the same coefficients, bit for bit."""
    s = make(name)
    is_dpm = isinstance(s, DPMSolverMultistepScheduler)
    for k in range(len(s.timesteps)):
        for lon in ((0, 1, 2) if is_dpm else (None,)):
            if is_dpm:
                s.lower_order_nums = lon
            want = step_coeffs(s, k)
            forms = [step_coeffs(s, torch.tensor(k))]
            if is_dpm:
                forms += [step_coeffs(s, torch.tensor(k), lower_order_nums=torch.tensor(lon)),
                          step_coeffs(s, k, lower_order_nums=torch.tensor(lon)),
                          step_coeffs(s, k, lower_order_nums=lon)]
            for got in forms:
                assert got.shape == (6,)
                torch.testing.assert_close(got, want, rtol=0, atol=0)
            assert torch.isfinite(want).all()


@pytest.mark.parametrize("name", ["euler_svd", "ddim_epsilon_clip", "dpm_v_short"])
def test_step_coeffs_per_batch_index(name):
    """An (N,) index gives one row per batch entry, equal to the coefficients of each index alone."""
    s = make(name)
    idx = torch.tensor([0, 3, len(s.timesteps) - 1])
    lon = torch.tensor([0, 2, 2]) if isinstance(s, DPMSolverMultistepScheduler) else None
    got = step_coeffs(s, idx, lower_order_nums=lon)
    assert got.shape == (3, 6) and got.dtype == torch.float32
    for row, i in enumerate(idx.tolist()):
        want = step_coeffs(s, i, lower_order_nums=None if lon is None else int(lon[row]))
        torch.testing.assert_close(got[row], want, rtol=0, atol=0)
    assert torch.isfinite(got).all()


@pytest.mark.parametrize("name", ["euler_svd", "ddim_epsilon_clip", "dpm_epsilon", "dpm_v_long"])
def test_compiled_loop_no_host_sync_no_recompile(name):
    """step_coeffs + the op under torch.compile(fullgraph=True): a host read (.item(), a Python
    float from a tensor, indexing by a 0-D tensor) would break the graph and fail; the step index
    and DPM's lower_order_nums are tensors, so one graph serves every step. The loop keeps its own
    prev_x0, as a compiled loop would, and still matches diffusers step by step."""
    ref = make(name)
    s = copy.deepcopy(ref)
    is_dpm = isinstance(s, DPMSolverMultistepScheduler)
    clip = x0_clip(s)
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")

    @torch.compile(fullgraph=True, backend=counter)
    def compiled_step(model_output, sample, prev_x0, i, lower_order_nums):
        coeffs = step_coeffs(s, i, lower_order_nums=lower_order_nums if is_dpm else None)
        return scheduler_step(model_output, sample, coeffs, prev_x0, clip_x0=clip)

    torch._dynamo.reset()
    torch.manual_seed(0)
    x = torch.randn(SHAPE) * ref.init_noise_sigma
    xa, xb = x.clone(), x.clone()
    prev_x0 = torch.zeros(SHAPE)  # d_p is 0 on first-order steps, so any finite tensor will do
    with torch._dynamo.config.patch(error_on_recompile=True):
        for k, t in enumerate(ref.timesteps):
            model_b = fake_model(model_input(ref, xb, t), t)  # the input scaling of step k
            out = ref.step(fake_model(model_input(ref, xa, t), t), t, xa)
            i = torch.tensor(k)
            prev, x0 = compiled_step(model_b, xb, prev_x0, i, torch.clamp(i, max=2))
            assert_close_to(prev, out.prev_sample, torch.float32, what=f"{name} step {k}")
            if is_dpm:
                assert_close_to(x0, ref.model_outputs[-1], torch.float32, what=f"{name} x0 {k}")
            else:
                assert_close_to(x0, out.pred_original_sample, torch.float32, what=f"{name} x0 {k}")
            xa, xb, prev_x0 = out.prev_sample, prev, x0
    assert counter.frame_count == 1
