"""The official format's FP8-block decode GEMV (``dsv4lab.kernels.linear_fp8_tma``) against the tiled
kernel it replaces at M = 1 (``official_matmul(..., config={"TMA": False})``), on V4-Pro's FP8
projection shapes and wo_a's grouped use, as CUDA-graph replays over enough weight copies to defeat
the L2 (the decode condition), with the copy ceiling measured in the same run. ``--sweep`` also
times tile variants (BN, stages, warps, split multiplier) per shape.

    python3 benchmarks/fp8_gemv.py --json $OUT/fp8_gemv.json [--sweep]
"""
from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch
from triton.testing import do_bench

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.kernels import copy_ceiling, graph_time_us  # noqa: E402
from dsv4lab.kernels.host import cdiv, num_sms  # noqa: E402
from dsv4lab.kernels.linear_fp8_tma import BK, fp8_gemv, fp8_tma_config  # noqa: E402
from dsv4lab.kernels.linear_official import official_matmul  # noqa: E402
from dsv4lab.quant.weights import quantize_fp8_block  # noqa: E402

SHAPES = {  # name: (K, N, groups) of V4-Pro's FP8-block projections
    "q_a": (7168, 1536, 1), "wkv": (7168, 512, 1), "q_b": (1536, 65536, 1), "wo_a": (4096, 16384, 16),
    "wo_b": (16384, 7168, 1),
}


def copies_of(N: int, K: int, target: int = 400_000_000) -> list:
    w0 = quantize_fp8_block(torch.randn(N, K, device="cuda") * K ** -0.5)
    n = max(2, min(32, -(-target // (N * K))))
    return [w0] + [quantize_fp8_block(torch.randn(N, K, device="cuda") * K ** -0.5) for _ in range(n - 1)]


def sweep_configs(N: int, K: int, groups: int) -> list[dict]:
    rows = N // groups if groups > 1 else 0
    sms = num_sms(torch.device("cuda"))
    out = []
    for bn, stages, warps, mult in itertools.product((32, 64, 128), (3, 5), (4, 8), (1, 2)):
        if rows and rows % bn:
            continue
        split = max(1, min(cdiv(mult * sms, cdiv(N, bn)), K // (2 * BK), 64))
        out.append({"BN": bn, "STAGES": stages, "num_warps": warps, "SPLIT": split, "PDL": True})
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--sweep", action="store_true", help="also time tile variants per shape")
    args = ap.parse_args()
    names = args.shapes.split(",")
    bad = [n for n in names if n not in SHAPES]
    if bad:
        sys.exit(f"--shapes: unknown {bad}; choose from {list(SHAPES)}")
    dev = torch.device("cuda")
    ceil = copy_ceiling(do_bench) * 1e9  # bytes read + written per second (the floor convention of kernels.py)
    print(f"{torch.cuda.get_device_name()}  copy ceiling {ceil / 1e9:.0f} GB/s", flush=True)
    rows = []
    for name in names:
        K, N, G = SHAPES[name]
        copies = copies_of(N, K)
        x = torch.randn(1, G, K, device="cuda").to(torch.bfloat16)
        y = torch.empty(1, N, device="cuda", dtype=torch.bfloat16)
        nbytes = N * K + 4 * cdiv(N, 128) * cdiv(K, 128)
        floor_us = nbytes / ceil * 1e6

        def new(cfg=None):
            return graph_time_us([lambda c=c: fp8_gemv(x, c, y, G, cfg) for c in copies])

        if G > 1:  # the tiled kernel per row block: what the grouped use ran before (16 launches)
            blocks = [[c.row_block(g * (N // G), N // G) for g in range(G)] for c in copies]
            old = graph_time_us([lambda b=b: [official_matmul(x[0, g:g + 1], bg, config={"TMA": False})
                                              for g, bg in enumerate(b)] for b in blocks])
        else:
            old = graph_time_us([lambda c=c: official_matmul(x[0], c, config={"TMA": False}) for c in copies])
        t = new()
        cfg = fp8_tma_config(N, K, dev, N // G if G > 1 else 0)
        row = {"shape": name, "K": K, "N": N, "groups": G, "floor_us": floor_us, "gemv_us": t, "tiled_us": old,
               "gemv_frac_copy": floor_us / t, "tiled_frac_copy": floor_us / old, "config": cfg}
        print(f"{name:5s} {K:6d}->{N:6d} x{G:2d}  floor {floor_us:6.1f} us  gemv {t:6.1f} us ({floor_us / t:5.1%})  "
              f"tiled {old:6.1f} us ({floor_us / old:5.1%})  {cfg}", flush=True)
        if args.sweep:
            swept = []
            for c in sweep_configs(N, K, G):
                try:
                    swept.append({**c, "us": new(c)})
                except Exception as e:  # noqa: BLE001 - e.g. shared memory exhausted: record and go on
                    swept.append({**c, "error": str(e)[:120]})
            ok = sorted((s for s in swept if "us" in s), key=lambda s: s["us"])
            row["sweep"] = swept
            for s in ok[:5]:
                print(f"      {s['us']:6.1f} us ({floor_us / s['us']:5.1%})  {s}", flush=True)
        rows.append(row)
        del copies
        torch.cuda.empty_cache()
    if args.json:
        args.json.write_text(json.dumps({"device": torch.cuda.get_device_name(), "copy_ceiling_GBps": ceil / 1e9,
                                         "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
