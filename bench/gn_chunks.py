"""group_norm_silu over chunks of whole groups small enough to stay in L2 between the two passes: the op called per
chunk (a slice of samples / channels with its groups), against the op on the whole tensor and inductor, same process.

    python bench/gn_chunks.py [--cases cl960,fm320,vae] [--chunk-groups 4,8]

Per case: ms a call by CUDA events (host included, as bench/ops.py) and inside one CUDA graph (device time with the
kernels' gaps), the kernels each variant launched, and the largest difference between the chunked and whole outputs.
JSON goes to bench/results/.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import environment, time_cuda, time_cuda_graph, write_json  # noqa: E402
from gn_env_ab import served_by  # noqa: E402

import vdcompile  # noqa: E402,F401

CASES = {  # name: (shape, layout, groups); chunks split samples first, then channels by whole groups
    "cl960": ((28, 960, 72, 128), "channels_last", 32),
    "fm320": ((2, 320, 14, 72, 128), "frames_major", 32),
    "vae": ((14, 128, 576, 1024), "nchw", 32),
}


def make(shape, layout, dev):
    if layout == "frames_major":
        B, C, Fr, H, W = shape
        return (torch.randn(B, Fr, C, H, W, device=dev) * 3 + 1).transpose(1, 2)
    x = torch.randn(shape, device=dev) * 3 + 1
    return x.to(memory_format=torch.channels_last) if layout == "channels_last" else x


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cases", default="cl960,fm320,vae")
    p.add_argument("--chunk-groups", default="32,8,4", help="groups a chunk (32: one sample per chunk)")
    args = p.parse_args(argv)
    dev = torch.device("cuda")
    rows = []
    for name in args.cases.split(","):
        shape, layout, G = CASES[name]
        x = make(shape, layout, dev)
        C = shape[1]
        w, b = torch.randn(C, device=dev), torch.randn(C, device=dev)
        def whole():
            return torch.ops.vd.group_norm_silu(x, G, w, b, 1e-5, True)

        full = whole()
        ind = torch.compile(lambda t: F.silu(F.group_norm(t, G, w, b, 1e-5)), dynamic=False)
        r = {"case": name, "shape": list(shape), "layout": layout, "bytes_x": x.numel() * 4,
             "whole_ms": time_cuda(lambda i: whole()), "whole_graph_ms": time_cuda_graph([whole]),
             "whole_kernels": served_by(whole), "inductor_ms": time_cuda(lambda i: ind(x)), "chunks": {}}
        cpg = C // G
        for cg in (int(v) for v in args.chunk_groups.split(",")):
            if G % cg:
                continue
            width = cg * cpg  # channels a chunk
            parts = [(s, c0) for s in range(shape[0]) for c0 in range(0, C, width)]
            outs = [None] * len(parts)

            def chunk(s, c0, cg=cg, width=width):
                return torch.ops.vd.group_norm_silu(x[s:s + 1, c0:c0 + width], cg, w[c0:c0 + width],
                                                    b[c0:c0 + width], 1e-5, True)

            def chunked(parts=parts, outs=outs, chunk=chunk):
                for k, (s, c0) in enumerate(parts):
                    outs[k] = chunk(s, c0)
            chunked()
            diff = max((outs[k] - full[s:s + 1, c0:c0 + width]).abs().max().item()
                       for k, (s, c0) in enumerate(parts))
            mb = x.numel() * 4 / len(parts) / 1e6
            r["chunks"][str(cg)] = {"n": len(parts), "chunk_MB": mb, "ms": time_cuda(lambda i: chunked()),
                                    "graph_ms": time_cuda_graph([chunked]), "max_diff": diff,
                                    "kernels": served_by(lambda: chunk(0, 0))}
        rows.append(r)
        print(f"{name} {shape} {layout}: whole {r['whole_ms']:.4f} ms (graph {r['whole_graph_ms']:.4f}), inductor "
              f"{r['inductor_ms']:.4f}; kernels {r['whole_kernels']}")
        for cg, c in r["chunks"].items():
            print(f"   {cg:>2} groups a chunk ({c['n']} chunks of {c['chunk_MB']:.1f} MB): {c['ms']:.4f} ms (graph "
                  f"{c['graph_ms']:.4f}), x inductor {r['inductor_ms'] / c['ms']:.3f} (graph "
                  f"{r['inductor_ms'] / c['graph_ms']:.3f}), max diff {c['max_diff']:.2e}; {c['kernels']}")
        x = full = ind = None  # free the case's tensors before the next
        torch.cuda.empty_cache()
    print("wrote", write_json("gn_chunks", {"environment": environment(dev), "rows": rows}))


if __name__ == "__main__":
    main()
