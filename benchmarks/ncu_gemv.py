"""A few batch-1 GEMV calls per shape (ours, then cuBLAS bf16 over the same bytes) for Nsight Compute.

Graph-replay timing (benchmarks/kernels.py) says how fast; ncu says why: SM active cycles against
elapsed (ramp and tail), issue-slot use, the stall reasons per issued instruction. On the device
machine (ncu ships in /usr/local/cuda/bin there):

    /usr/local/cuda/bin/ncu --clock-control none --cache-control all -k regex:"gemv_tma|nvjet" -s 2 -c 40 \\
        --section SpeedOfLight --section SchedulerStats --section WarpStateStats --section Occupancy \\
        python3 benchmarks/ncu_gemv.py --shapes o_b,q_b,lm_head
    /usr/local/cuda/bin/ncu --clock-control none -k regex:gemv_tma -s 2 -c 9 \\
        --metrics regex:smsp__average_warps_issue_stalled_.*_per_issue_active\\.ratio,smsp__inst_executed.sum \\
        python3 benchmarks/ncu_gemv.py

``-s 2`` skips the two warm-up launches of the first shape (the x-pair prelude is not matched).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    from benchmarks.kernels import SHAPES, rand_nvfp4

    names = [n for n, _, _ in SHAPES]
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="o_b,q_b,lm_head", help=f"comma-separated, from {names}")
    ap.add_argument("--calls", type=int, default=3, help="calls of our kernel per shape (cuBLAS: 2)")
    args = ap.parse_args()
    from dsv4lab.kernels.linear_nvfp4 import nvfp4_matmul

    shapes = {n: (K, N) for n, K, N in SHAPES}
    for name in args.shapes.split(","):
        if name not in shapes:
            ap.error(f"unknown shape {name!r}; choose from {names}")
        K, N = shapes[name]
        w = rand_nvfp4(N, K)
        x = torch.randn(1, K, device="cuda", dtype=torch.bfloat16)
        for _ in range(args.calls):
            nvfp4_matmul(x, w.packed, w.block_scale, w.global_scale)
        wb = torch.randn(N, K * 9 // 32, device="cuda", dtype=torch.bfloat16)  # the same bytes in bf16
        xb = torch.randn(1, K * 9 // 32, device="cuda", dtype=torch.bfloat16)
        for _ in range(2):
            torch.nn.functional.linear(xb, wb)
        torch.cuda.synchronize()
        del w, wb


if __name__ == "__main__":
    main()
