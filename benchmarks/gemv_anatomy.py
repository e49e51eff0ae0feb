"""Where the batch-1 NVFP4 GEMV's time goes, per shape, on the device machine (CUDA + triton).

For each shape: the full call (x-pair prelude + TMA GEMV) as graph replays, the same with
programmatic dependent launch (PDL) between the launches, the GEMV kernel alone (pairs computed
once), the prelude alone, the kernels' own durations from the CUDA profiler (what the graph
replay adds on top is launch gaps), cuBLAS bf16 over the same bytes, and the GEMV at 2x and 4x
the rows (time = fixed cost + bytes / asymptotic bandwidth, fitted). ``--splits`` adds an
explicit (BN, STAGES, SPLIT) sweep for the named shapes. All as fractions of a copy ceiling
measured in the same run.

    python3 benchmarks/gemv_anatomy.py --json --splits o_b,q_b
"""
from __future__ import annotations

import argparse
import itertools
import json
import sys
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.kernels import SHAPES, copy_ceiling, graph_time_us, rand_nvfp4, rel_err  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"  # default --json location


def copies_for(N: int, K: int) -> list:
    wbytes = N * K // 2 + N * K // 16
    n = max(2, min(32, -(-400_000_000 // wbytes)))
    return [rand_nvfp4(N, K, seed=i) for i in range(n)]


def kernel_durations_us(calls, reps: int = 10) -> dict[str, float]:
    """Mean device duration per call of each kernel name, from the CUDA profiler, over graph replays."""
    from torch.profiler import ProfilerActivity, profile

    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s), torch.cuda.graph(g, stream=s):
        for c in calls:
            c()
    torch.cuda.current_stream().wait_stream(s)
    g.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            g.replay()
        torch.cuda.synchronize()
    tot: dict[str, float] = defaultdict(float)
    for e in prof.events():
        if e.device_type.name == "CUDA":
            tot[e.name[:40]] += e.device_time
    return {k: v / (reps * len(calls)) for k, v in tot.items()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="q_b,o_b,lm_head,expert_w1/w3")
    ap.add_argument("--splits", default="", help="shapes to sweep (BN, STAGES, SPLIT) explicitly")
    ap.add_argument("--json", type=Path, nargs="?", default=None, const=RESULTS / "gemv_anatomy.json",
                    help="write the results here (bare --json: benchmarks/results/gemv_anatomy.json)")
    args = ap.parse_args()
    from triton.testing import do_bench

    from dsv4lab.kernels.linear_nvfp4_tma import launch_gemv_tma, tma_default_config, x_pairs
    from dsv4lab.kernels.linear_nvfp4 import nvfp4_matmul

    dev = torch.device("cuda")
    ceil = copy_ceiling(do_bench)
    print(f"copy ceiling {ceil:.0f} GB/s", flush=True)
    out: dict = {"copy_GBps": ceil, "shapes": {}, "splits": {}}
    frac = lambda nbytes, us: nbytes / (us * 1e-6) / 1e9 / ceil  # noqa: E731
    for name, K, N in SHAPES:
        if name not in args.shapes.split(","):
            continue
        rec: dict = {}
        x = torch.randn(1, K, device=dev, dtype=torch.bfloat16)
        for mult in (1, 2, 4) if name != "lm_head" else (1,):
            n = N * mult
            ws = copies_for(n, K)
            nbytes = n * K // 2 + n * K // 16
            cfg = tma_default_config(n, K, dev, 1)
            y = torch.empty(1, n, device=dev, dtype=torch.bfloat16)
            pairs = x_pairs(x[0])
            full = [lambda c=c: nvfp4_matmul(x, c.packed, c.block_scale, c.global_scale, config=cfg) for c in ws]
            gemv = [lambda c=c: launch_gemv_tma(x, c.packed, c.block_scale, c.global_scale, y, cfg, pairs=pairs)
                    for c in ws]
            r = {"cfg": cfg, "bytes": nbytes, "full_us": graph_time_us(full), "gemv_us": graph_time_us(gemv)}
            if mult == 1:
                pdl = {**cfg, "PDL": True}
                ref = torch.nn.functional.linear(x, ws[0].dequantize(torch.bfloat16))
                r["pdl_err"] = rel_err(nvfp4_matmul(x, ws[0].packed, ws[0].block_scale, ws[0].global_scale, config=pdl), ref)
                r["full_pdl_us"] = graph_time_us([lambda c=c: nvfp4_matmul(x, c.packed, c.block_scale, c.global_scale,
                                                                           config=pdl) for c in ws])
                r["prelude_us"] = graph_time_us([lambda: x_pairs(x[0])] * 8)
                r["kernels_us"] = kernel_durations_us(full)
                r["kernels_pdl_us"] = kernel_durations_us([lambda c=c: nvfp4_matmul(
                    x, c.packed, c.block_scale, c.global_scale, config=pdl) for c in ws])
                kb = (K * 9 // 32 + 7) // 8 * 8
                wb = [torch.randn(N, kb, device=dev, dtype=torch.bfloat16) for _ in range(len(ws))]
                xb = torch.randn(1, kb, device=dev, dtype=torch.bfloat16)
                cb = [lambda w=w: torch.nn.functional.linear(xb, w) for w in wb]
                r["cublas_us"] = graph_time_us(cb)
                r["cublas_kernels_us"] = kernel_durations_us(cb)
                del wb
                nl2 = max(64, (24_000_000 // (K * 9 // 16)) // 64 * 64)  # rows whose weights stay in the 50 MB L2
                l2 = rand_nvfp4(nl2, K)
                yl2 = torch.empty(1, nl2, device=dev, dtype=torch.bfloat16)
                cl2 = tma_default_config(nl2, K, dev, 1)
                t = graph_time_us([lambda: launch_gemv_tma(x, l2.packed, l2.block_scale, l2.global_scale, yl2, cl2,
                                                           pairs=pairs)] * 16)
                r["l2_resident"] = {"rows": nl2, "us": t, "cfg": cl2,
                                    "frac": frac(nl2 * K // 2 + nl2 * K // 16, t)}
                del l2
            for k in ("full_us", "gemv_us", "full_pdl_us", "cublas_us"):
                if k in r:
                    r[k.replace("_us", "_frac")] = frac(nbytes, r[k])
            rec[f"x{mult}"] = r
            print(f"{name} x{mult} N={n}: " + "  ".join(f"{k} {v:.1f}" if isinstance(v, float) and k.endswith("_us")
                                                        else (f"{k} {v:.1%}" if k.endswith("_frac") else "")
                                                        for k, v in r.items()).replace("    ", " "), flush=True)
            if mult == 1:
                print("   kernels:", {k: round(v, 1) for k, v in r["kernels_us"].items()},
                      "\n   kernels PDL:", {k: round(v, 1) for k, v in r["kernels_pdl_us"].items()},
                      "\n   cuBLAS kernels:", {k: round(v, 1) for k, v in r["cublas_kernels_us"].items()},
                      f"\n   pdl err {r['pdl_err']:.1e}  L2-resident ({r['l2_resident']['rows']} rows):"
                      f" {r['l2_resident']['us']:.1f} us = {r['l2_resident']['frac']:.1%} of the DRAM copy ceiling",
                      flush=True)
            del ws
            torch.cuda.empty_cache()
        if len(rec) > 1:  # fit time = a + bytes / bw over the row multiples (GEMV alone)
            b = torch.tensor([float(v["bytes"]) for v in rec.values()], dtype=torch.float64)
            t = torch.tensor([v["gemv_us"] for v in rec.values()], dtype=torch.float64)
            A = torch.stack([torch.ones_like(b), b], 1)
            a, slope = torch.linalg.lstsq(A, t[:, None]).solution.flatten().tolist()
            rec["fit"] = {"fixed_us": a, "asymptotic_frac": (1 / (slope * 1e-6) / 1e9) / ceil}
            print(f"   fit: fixed {a:.1f} us, asymptotic {rec['fit']['asymptotic_frac']:.1%}", flush=True)
        out["shapes"][name] = rec
    import triton

    for name, K, N in SHAPES:
        if name not in args.splits.split(","):
            continue
        ws = copies_for(N, K)
        nbytes = N * K // 2 + N * K // 16
        x = torch.randn(1, K, device=dev, dtype=torch.bfloat16)
        ref = torch.nn.functional.linear(x, ws[0].dequantize(torch.bfloat16))
        res = []
        kg = K // 16
        for bn, g, stages, split in itertools.product((16, 32, 64, 128, 256), (16, 32, 64), (4, 8), (1, 2, 4, 10)):
            stage_bytes = bn * g * 9 + g * 32
            warps = 4 if bn * g >= 512 else 2
            if (triton.cdiv(N, bn) * split < 64 or split > kg // g or (stages - 1) * stage_bytes > 200_000
                    or bn * g > 8192):
                continue
            cfg = {"TMA": True, "BN": bn, "G": g, "STAGES": stages, "SPLIT": split, "num_warps": warps}
            try:
                err = rel_err(nvfp4_matmul(x, ws[0].packed, ws[0].block_scale, ws[0].global_scale, config=cfg), ref)
                us = graph_time_us([lambda c=c: nvfp4_matmul(x, c.packed, c.block_scale, c.global_scale, config=cfg)
                                    for c in ws], reps=10)
            except Exception as e:  # noqa: BLE001 - a tile that does not fit is reported and skipped
                print(f"  skip {cfg}: {type(e).__name__}", flush=True)
                continue
            res.append({"cfg": cfg, "us": us, "frac": frac(nbytes, us), "err": err})
        res.sort(key=lambda r: r["us"])
        out["splits"][name] = res
        print(f"{name}: {len(res)} configs; best:", flush=True)
        for r in res[:8]:
            print(f"   {r['us']:7.1f} us {r['frac']:6.1%} err {r['err']:.1e} {r['cfg']}", flush=True)
        del ws
        torch.cuda.empty_cache()
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
