"""Repeat each MoE decode schedule / tile many times on one set of V4-Pro-shaped inputs and count
outputs that are not bitwise the two-launch one: y right after its call, y after later calls (an
out-of-bounds write would change it), and the outputs of a replayed graph of 10 calls.

Usage (device): python3 benchmarks/results/decode/moe_schedule/stress.py [iterations] [tokens]
"""
# Written for moe_decode_tma's FUSED_TILES ((up, down) tiles per format), which stop 57 replaced by
# FUSED_UP_TILES + DOWN_TILES (one down tile per format for every schedule): rerun at commit 244f746.
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[4]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from dsv4lab.kernels import moe_decode_tma as m  # noqa: E402
from moe_tile_sweep import case  # noqa: E402

N = int(sys.argv[1]) if len(sys.argv) > 1 else 100
T = int(sys.argv[2]) if len(sys.argv) > 2 else 1
for fmt in ("nvfp4", "mxfp4"):
    run, _ = case(fmt, T)
    m.SCHEDULE = "two"
    base = run().clone()
    t0 = dict(m.FUSED_TILES)
    for label, sched, tiles in (("fused_64_64", "fused", ((64, 3, 4), (64, 3, 4))),
                                ("fused_64x4_128", "fused", ((64, 4, 4), (128, 3, 4))), ("pdl", "pdl", None),
                                ("two", "two", None)):
        m.SCHEDULE, m.FUSED_TILES = sched, ({**t0, fmt == "mxfp4": tiles} if tiles else t0)
        bad_now = bad_kept = bad_graph = 0
        for i in range(N):
            y = run()
            bad_now += not torch.equal(y, base)
            for _ in range(3):
                run()
            bad_kept += not torch.equal(y, base)
        outs = []
        g = torch.cuda.CUDAGraph()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s), torch.cuda.graph(g, stream=s):
            for _ in range(10):
                outs.append(run())
        torch.cuda.current_stream().wait_stream(s)
        for i in range(N // 5):
            g.replay()
            torch.cuda.synchronize()
            bad_graph += sum(not torch.equal(o, base) for o in outs)
        del g
        print(f"{fmt} {label:15s} eager mismatches {bad_now}/{N}, kept {bad_kept}/{N}, graph {bad_graph}/{10 * (N // 5)}",
              flush=True)
    m.SCHEDULE, m.FUSED_TILES = None, t0
