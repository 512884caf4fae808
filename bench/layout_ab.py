"""A/B of the vd ops' layout constraint inside inductor, without a rebuild.

    python bench/layout_ab.py OPS -- <vdcompile bench arguments>

OPS: comma-separated vd ops (e.g. group_norm_silu,temporal_conv) whose inductor lowering is registered
with no layout constraint before the first compile, so inductor hands them its own (channels_last)
layouts instead of copying to the traced strides; "none" keeps the default.
"""
import sys

import torch

import vdcompile  # noqa: F401  (registers the ops)
from vdcompile.cli import main

if __name__ == "__main__":
    ops, rest = sys.argv[1], sys.argv[2:]
    if rest and rest[0] == "--":
        rest = rest[1:]
    if ops != "none":
        from torch._inductor.lowering import make_fallback
        for name in ops.split(","):
            make_fallback(getattr(torch.ops.vd, name).default, layout_constraint=None)
            print(f"flexible layout: vd::{name}", flush=True)
    sys.exit(main(rest))
