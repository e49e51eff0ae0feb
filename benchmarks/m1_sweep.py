"""Sweep the batch-1 NVFP4 GEMV's tile space on the device machine (CUDA + triton).

The tuner in ``dsv4lab.kernels.linear_nvfp4`` picks from a small candidate list with ``do_bench``; this
script times a wider space (the TMA GEMV's tiles/stages/splits; ``--pointer`` adds the pointer-load
GEMV's) as CUDA-graph replays over enough weight copies to defeat the L2
(the decode condition) and prints the best configs per shape with their fraction of a copy
ceiling measured in the same run. Use it to choose the candidate list.

    python3 benchmarks/m1_sweep.py --shapes lm_head,o_b --json
"""
from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.kernels import SHAPES, copy_ceiling, graph_time_us, rand_nvfp4, rel_err  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"  # default --json location


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="lm_head,o_b,q_b")
    ap.add_argument("--json", type=Path, nargs="?", default=None, const=RESULTS / "m1_sweep.json",
                    help="write the results here (bare --json: benchmarks/results/m1_sweep.json)")
    ap.add_argument("--top", type=int, default=5)
    ap.add_argument("--pointer", action="store_true", help="also sweep the pointer-load GEMV (pre-Hopper path)")
    ap.add_argument("--batch", type=int, default=1, help="decode batch M (<= 16)")
    ap.add_argument("--stages", type=lambda v: [int(a) for a in v.split(",")], default=[2, 3, 4, 6])
    ap.add_argument("--warps", type=lambda v: [int(a) for a in v.split(",")], default=[4, 8])
    ap.add_argument("--bn", type=lambda v: [int(a) for a in v.split(",")], default=[64, 128, 256])
    ap.add_argument("--mult", type=lambda v: [int(a) for a in v.split(",")], default=[1, 2, 4],
                    help="K splits so that tiles x splits ~ mult x SMs")
    ap.add_argument("--g", type=lambda v: [int(a) for a in v.split(",")], default=[16],
                    help="16-groups per TMA box along K (16: 128-byte rows of weight words)")
    ap.add_argument("--xinv", type=lambda v: [bool(int(a)) for a in v.split(",")], default=[None],
                    help="1/xs in the x-pair rows (1, the default) or by its own pointer (0)")
    ap.add_argument("--splits", type=lambda v: [int(a) for a in v.split(",")], default=None,
                    help="explicit K split counts (instead of --mult)")
    ap.add_argument("--pdl", type=lambda v: [bool(int(a)) for a in v.split(",")], default=[False],
                    help="programmatic dependent launch prelude -> GEMV (0,1 sweeps both)")
    args = ap.parse_args()
    import triton
    from triton.testing import do_bench

    from dsv4lab.kernels.linear_nvfp4 import nvfp4_matmul

    ceil = copy_ceiling(do_bench)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(f"copy ceiling {ceil:.0f} GB/s, {sms} SMs", flush=True)
    out = {}
    for name, K, N in SHAPES:
        if name not in args.shapes.split(","):
            continue
        w = rand_nvfp4(N, K)
        wbytes = w.packed.numel() + w.block_scale.numel()
        ncopy = max(2, min(32, -(-400_000_000 // wbytes)))  # >= 2 calls: a one-call graph adds the replay gap
        x = torch.randn(args.batch, K, device="cuda", dtype=torch.bfloat16)
        ref = torch.nn.functional.linear(x, w.dequantize(torch.bfloat16))
        # timed copies after the reference's temporary (benchmarks/kernels.py says why)
        del w
        copies = [rand_nvfp4(N, K, seed=i) for i in range(ncopy)]
        w = copies[0]
        res = []
        KG = K // 16
        space = []
        for bn, g, stages, warps, mult, pdl, xinv in itertools.product(args.bn, args.g, args.stages, args.warps,
                                                                       args.splits or args.mult, args.pdl, args.xinv):
            n_tiles = triton.cdiv(N, bn)
            split = mult if args.splits else max(1, min(triton.cdiv(mult * sms, n_tiles), max(1, KG // g), 64))
            cfg = ({"TMA": True, "BN": bn, "STAGES": stages, "SPLIT": split, "num_warps": warps}
                   | ({"G": g} if g != 16 else {}) | ({"XINV": xinv} if xinv is not None else {}))
            space.append(cfg | ({"PDL": True} if pdl else {}))
        if args.pointer:
            for bn, g, warps, mult, pf, (h2, xp) in itertools.product((64, 128, 256), (8, 16), (4, 8), (1, 2, 4), (1, 2),
                                                                      ((True, True), (True, False))):
                if not 2 <= bn * g // (32 * warps) <= 32:  # int64 words per thread per tile
                    continue
                n_tiles = triton.cdiv(N, bn)
                split = max(1, min(triton.cdiv(mult * sms, n_tiles), max(1, KG // g), 64))
                space.append({"BN": bn, "G": g, "SPLIT": split, "num_warps": warps, "H2": h2, "XP": xp, "PF": pf})
        for cfg in space:
            if any(r["config"] == cfg for r in res):
                continue
            try:
                y = nvfp4_matmul(x, w.packed, w.block_scale, w.global_scale, config=cfg)
                err = rel_err(y, ref)
                t = graph_time_us([lambda c=c: nvfp4_matmul(x, c.packed, c.block_scale, c.global_scale, config=cfg)
                                   for c in copies], reps=10)
            except Exception as e:  # noqa: BLE001 - a tile that does not fit is skipped
                print(f"  skip {cfg}: {type(e).__name__}", flush=True)
                continue
            gbs = (wbytes + args.batch * (K + N) * 2) / (t * 1e-6) / 1e9
            res.append({"config": cfg, "us": t, "GBps": gbs, "frac_copy": gbs / ceil, "err": err})
        res.sort(key=lambda r: r["us"])
        out[name] = res
        print(f"{name} {K}->{N}: {len(res)} configs", flush=True)
        for r in res[: args.top]:
            print(f"   {r['us']:8.1f} us  {r['GBps']:6.0f} GB/s  {r['frac_copy']:5.1%}  err {r['err']:.1e}  {r['config']}", flush=True)
        for label, pick in (("TMA", lambda c: c.get("TMA", False)), ("pointer", lambda c: not c.get("TMA", False))):
            best = next((r for r in res if pick(r["config"])), None)
            if best:
                print(f"   best {label}: {best['us']:.1f} us ({best['frac_copy']:.1%}) {best['config']}", flush=True)
        del copies, w
        torch.cuda.empty_cache()
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"copy_GBps": ceil, "sweep": out}, indent=1))


if __name__ == "__main__":
    main()
