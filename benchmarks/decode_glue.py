"""The decode glue around the quantised matmuls at V4-Pro shapes, batch 1, PyTorch reference vs the
fused launches (dsv4lab/kernels/norm_rope.py, router_topk.py, the grouped TMA GEMV), each timed as
CUDA-graph replays (what decode runs) with its launch count. Prints JSON; ratios, not asserts.

* q/kv/output glue: q_norm, per-head norm + RoPE of q [128 x 512, rope 64], kv_norm + RoPE + kv_fp8
  of kv [512], inverse RoPE of the output (reference: the model's own functions, angles from
  ``rope_angles``; kernels: 4 launches, angles on the device);
* router: scores (sqrtsoftplus) + bias + top-6 of 384 + weights after the gate, and hash routing;
* wo_a: 16 groups of 1024 rows over K = 4096 (NVFP4), one GEMV per group vs the grouped GEMV.

    python3 benchmarks/decode_glue.py --json
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.kernels import graph_time_us  # noqa: E402
from benchmarks.measure import kernels_per_call  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


def timed(fn) -> tuple[float, int]:
    """(us per call as CUDA-graph replays, ``kernels.graph_time_us``; kernels one eager call launches)."""
    return graph_time_us([fn], reps=200), int(kernels_per_call(fn, reps=1)["kernels"])


@torch.no_grad()
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", type=Path, nargs="?", default=None, const=RESULTS / "decode_glue.json",
                    help="also write the results here (default benchmarks/results/decode_glue.json)")
    args = ap.parse_args()
    from dsv4lab.kernels.dispatch import grouped_quant_linear, norm_rope, rms_norm, route
    from dsv4lab.kernels.norm_rope_ref import norm_rope_ref
    from dsv4lab.model.linear import grouped_linear
    from dsv4lab.model.moe import route as route_ref
    from dsv4lab.model.norms import rms_norm as rms_ref
    from dsv4lab.quant.weights import NVFP4Weight

    dev, bf = torch.device("cuda"), torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(0)
    H, D, RD, QL, E, K6, V = 128, 512, 64, 1536, 384, 6, 129280
    inv = 1.0 / (160000.0 ** (torch.arange(0, RD, 2, dtype=torch.float, device=dev) / RD))
    pos = torch.tensor([1000], device=dev)
    a = torch.randn(1, 1, QL, device=dev, generator=g).to(bf)
    wq = torch.ones(QL, device=dev, dtype=bf)
    q = torch.randn(1, 1, H, D, device=dev, generator=g).to(bf)
    kv = torch.randn(1, 1, 1, D, device=dev, generator=g).to(bf)
    wkv = torch.ones(D, device=dev, dtype=bf)

    def glue(norm_fn, rope_fn):
        def run():
            norm_fn(a, wq, 1e-6)
            rope_fn(q, pos, inv, 1e-6)
            rope_fn(kv, pos, inv, 1e-6, wkv, fp8_nope=True)
            rope_fn(q, pos, inv, inverse=True)
        return run

    logits = torch.randn(1, E, device=dev, generator=g).to(bf)
    bias = torch.randn(E, device=dev, generator=g) * 0.01
    tid = torch.randint(0, E, (V, K6), device=dev, generator=g)
    tok = torch.zeros(1, 1, dtype=torch.long, device=dev)
    G, R, K = 16, 1024, 4096
    w = NVFP4Weight(torch.randint(0, 256, (G * R, K // 2), generator=g, dtype=torch.uint8, device=dev),
                    (torch.rand(G * R, K // 16, generator=g, device=dev) * 4 + 2 ** -9).to(torch.float8_e4m3fn),
                    torch.tensor(0.021, device=dev))
    blocks = [NVFP4Weight(w.packed[i * R:(i + 1) * R], w.block_scale[i * R:(i + 1) * R], w.global_scale) for i in range(G)]
    xo = torch.randn(1, 1, G, K, device=dev, generator=g).to(bf)
    from dsv4lab.kernels.dispatch import quant_linear

    def per_block():
        xg = xo.movedim(-2, 0).contiguous()
        return torch.stack([quant_linear(xg[i], blocks[i]) for i in range(G)], dim=-2)

    cases = {
        "qkv_out_glue": (glue(rms_ref, norm_rope_ref), glue(rms_norm, norm_rope)),
        "router_topk": (lambda: route_ref(logits, K6, "sqrtsoftplus", 1.5, bias),
                        lambda: route(logits, K6, "sqrtsoftplus", 1.5, bias)),
        "router_hash": (lambda: route_ref(logits, K6, "sqrtsoftplus", 1.5, None, tid, tok),
                        lambda: route(logits, K6, "sqrtsoftplus", 1.5, None, tid, tok)),
        "wo_a_grouped": (per_block, lambda: grouped_quant_linear(xo, w, G)),
    }
    res = {}
    for name, (ref_fn, kern_fn) in cases.items():
        (rt, rn), (kt, kn) = timed(ref_fn), timed(kern_fn)
        res[name] = {"reference_us": rt, "reference_launches": rn, "kernel_us": kt, "kernel_launches": kn,
                     "speedup": rt / kt}
    res["wo_a_grouped"]["reference"] = "one TMA GEMV per group (today's QLinear.grouped with kernels)"
    ref_dense = grouped_linear(xo, w.dequantize(bf), G)
    res["wo_a_grouped"]["max_err_over_max_ref"] = ((grouped_quant_linear(xo, w, G).float() - ref_dense.float()).abs().max()
                                                   / ref_dense.float().abs().max()).item()
    res["device"] = torch.cuda.get_device_name()
    print(json.dumps(res, indent=1))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
