"""Call every vd op directly and compare it with its plain-PyTorch reference (exit status 1 if one
disagrees).

    python examples/ops_demo.py [--device cuda]
"""
from __future__ import annotations

import argparse
import sys

import torch

import vdcompile  # noqa: F401  (registers torch.ops.vd)
from vdcompile import ops


# Largest |ours - reference| allowed, relative to the reference's largest magnitude (float32 inputs;
# the references compute in float64).
TOLERANCE = 1e-4


def _err(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b|."""
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-12)).item()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu")
    args = p.parse_args()
    dev = torch.device(args.device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("CUDA was asked for but no CUDA device is visible; run with --device cpu")
    torch.manual_seed(0)
    rows = []

    # Temporal self-attention over 14 frames, as video UNets do it: (B*H*W, heads, frames, head_dim).
    q, k, v = (torch.randn(64, 5, 14, 64, device=dev) for _ in range(3))
    out = ops.fused_attention(q, k, v)
    rows.append(("fused_attention", tuple(out.shape), _err(out, ops.reference_fused_attention(q, k, v)[0])))

    out = ops.strided_attention(q, k, v, stride=2)
    rows.append(("strided_attention", tuple(out.shape), _err(out, ops.reference_strided_attention(q, k, v, 2)[0])))

    x = torch.randn(2, 64, 16, 16, device=dev)
    w = torch.randn(64, 64, 3, 3, device=dev) * 0.05
    bn = [torch.rand(64, device=dev) + 0.5, torch.randn(64, device=dev), torch.randn(64, device=dev),
          torch.rand(64, device=dev) + 0.5]
    out = ops.conv_bn_silu(x, w, None, *bn, 1e-5, (1, 1), (1, 1), (1, 1), 1)
    ref = ops.reference_conv_bn_silu(x, w, None, *bn, 1e-5, (1, 1), (1, 1), (1, 1), 1)
    rows.append(("conv_bn_silu", tuple(out.shape), _err(out, ref)))

    gw, gb = torch.randn(64, device=dev), torch.randn(64, device=dev)
    out = ops.group_norm_silu(x, 32, gw, gb, 1e-5)
    rows.append(("group_norm_silu", tuple(out.shape), _err(out, ops.reference_group_norm_silu(x, 32, gw, gb, 1e-5))))

    xv = torch.randn(1, 32, 14, 8, 8, device=dev)
    wt = torch.randn(32, 32, 3, 1, 1, device=dev) * 0.1
    out = ops.temporal_conv(xv, wt, None, 1)
    rows.append(("temporal_conv", tuple(out.shape), _err(out, ops.reference_temporal_conv(xv, wt, None, 1))))

    lat = torch.randn(2, 14, 4, 16, 16, device=dev)
    eps = torch.randn_like(lat)
    from diffusers import EulerDiscreteScheduler

    from vdcompile import schedulers

    sched = EulerDiscreteScheduler(prediction_type="v_prediction", use_karras_sigmas=True)
    sched.set_timesteps(25)
    coeffs = schedulers.step_coeffs(sched, 3, device=dev)  # SVD's sampler, step 3
    prev, x0 = ops.scheduler_step(eps, lat, coeffs)
    ref_prev, _ = ops.reference_scheduler_step(eps, lat, coeffs)
    rows.append(("scheduler_step", tuple(prev.shape), _err(prev, ref_prev)))

    print(f"{'op':<20}{'output shape':<24}{'max rel. difference':>22}")
    bad = []
    for name, shape, err in rows:
        good = err <= TOLERANCE
        print(f"{name:<20}{str(shape):<24}{err:>22.2e}  {'ok' if good else 'FAIL'}")
        if not good:
            bad.append(name)
    print(f"tolerance {TOLERANCE:g} (max |ours - reference| / max |reference|)")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
