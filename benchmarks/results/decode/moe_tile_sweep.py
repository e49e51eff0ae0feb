"""MoE decode tiles on V4-Pro's experts: (rows a CTA, TMA stages, warps) of the up and the down
launch of ``moe_decode_tma``, each swept with the other at its default, one token, 6 routed
experts of 64 + the shared one, graph replay. Prints each config's us and its fraction of the
copy ceiling measured in the same run (read bytes: the 7 experts' words and scales), and checks
the output is bitwise the default's (the tile changes no summation order within a row: each CTA
owns whole rows; the down partials are summed in expert order either way).

Usage (device): python3 benchmarks/results/decode/moe_tile_sweep.py $OUT/moe_tiles.json [fmt]
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
from benchmarks.kernels import graph_time_us  # noqa: E402
from benchmarks.measure import copy_ceiling  # noqa: E402
from dsv4lab.kernels import moe_decode_tma as m  # noqa: E402
from dsv4lab.quant.stacked import StackedMXFP4, StackedNVFP4, stack_one  # noqa: E402

H, I, E, K = 7168, 3072, 64, 6


def rand_stack(fmt: str, e: int, n: int, k: int, seed: int):
    g = torch.Generator(device="cuda").manual_seed(seed)
    packed = torch.randint(0, 256, (e, n, k // 2), dtype=torch.uint8, device="cuda", generator=g)
    if fmt == "mxfp4":
        scale = torch.randint(118, 124, (e, n, k // 32), dtype=torch.uint8, device="cuda", generator=g)
        return StackedMXFP4(packed, scale.view(torch.float8_e8m0fnu))
    bs = (torch.rand(e, n, k // 16, device="cuda", generator=g) * 2 + 0.5).to(torch.float8_e4m3fn)
    return StackedNVFP4(packed, bs, torch.full((e,), 1e-3, device="cuda"))


def case(fmt: str, T: int = 1):
    """V4-Pro's expert stacks (E of them and a shared one-expert stack each) and T tokens' inputs:
    (run, bytes per weight element), where run() is one ``moe_decode_tma`` call with the shared expert."""
    dev = torch.device("cuda")
    w1, w3, w2 = rand_stack(fmt, E, I, H, 1), rand_stack(fmt, E, I, H, 2), rand_stack(fmt, E, H, I, 3)
    sh = tuple(stack_one(s.weight(0)) for s in (rand_stack(fmt, 1, I, H, 4), rand_stack(fmt, 1, I, H, 5),
                                                 rand_stack(fmt, 1, H, I, 6)))
    x = torch.randn(T, H, device=dev, dtype=torch.bfloat16)
    ids = torch.stack([torch.randperm(E, device=dev)[:K] for _ in range(T)]).reshape(-1).to(torch.int32)
    wts = torch.rand(T * K, device=dev)

    def run():
        return m.moe_decode_tma(x, ids, wts, w1, w3, w2, 10.0, K, shared=sh)

    return run, 0.5 + (1 / 16 if fmt == "nvfp4" else 1 / 32)


def graph_us(fn) -> float:
    """Device us a call, 10 calls captured in one graph and replayed (``benchmarks.kernels``)."""
    return graph_time_us([fn] * 10, reps=50)


def main() -> None:
    out = Path(sys.argv[1])
    fmt = sys.argv[2] if len(sys.argv) > 2 else "nvfp4"
    dev = torch.device("cuda")
    ceil = copy_ceiling(dev)
    run, per = case(fmt)   # per: bytes per weight element
    up_bytes, down_bytes = (K + 1) * 2 * I * H * per, (K + 1) * I * H * per

    m.SCHEDULE = "two"   # these tiles are the two-launch schedule's (the fused one: moe_schedule/ --sweep)
    mx, downs0 = fmt == "mxfp4", dict(m.DOWN_TILES)
    default_up, default_down = m.UP_TILE, downs0[mx]
    ref = run().clone()
    base = graph_us(run)
    rows = [dict(which="default", up=default_up, down=default_down, us=base, bitwise=True)]
    print(f"{fmt} ceiling {ceil:.0f} GB/s  default up {default_up} down {default_down}: {base:.1f} us "
          f"({(up_bytes + down_bytes) / base / 1e3 / ceil:.1%} of copy)", flush=True)
    cands = [(bn, st, wp) for bn in (32, 64, 128, 256) for st in (2, 3, 4, 6) for wp in (2, 4, 8)
             if not (bn == 256 and st == 6) and not (bn == 32 and wp == 8)]
    for which in ("up", "down"):
        for cfg in cands:
            m.UP_TILE, m.DOWN_TILES = (cfg, downs0) if which == "up" else (default_up, {**downs0, mx: cfg})
            try:
                y = run()
                t = graph_us(run)
            except Exception as e:  # noqa: BLE001 - too much shared memory etc.: record and go on
                print(which, cfg, "failed", type(e).__name__, str(e)[:80], flush=True)
                rows.append(dict(which=which, cfg=cfg, error=str(e)[:200]))
                continue
            same = bool(torch.equal(y, ref))
            byts = up_bytes if which == "up" else down_bytes
            rows.append(dict(which=which, cfg=cfg, us=t, delta_us=t - base, bitwise=same))
            print(f"{which:4s} {cfg}  {t:7.1f} us  {t - base:+6.1f}  bitwise {same}", flush=True)
    m.UP_TILE, m.DOWN_TILES = default_up, downs0
    out.write_text(json.dumps(dict(device=torch.cuda.get_device_name(), fmt=fmt, copy_GBps=ceil,
                                   up_bytes=up_bytes, down_bytes=down_bytes, rows=rows), indent=1))


if __name__ == "__main__":
    main()
