"""MoE decode schedules on V4-Pro's experts (H = 7168, I = 3072, 6 routed of 64 + the shared one,
one token): ``moe_decode_tma.SCHEDULE`` two / pdl / fused (``VARIANTS``), alternating over rounds, each a graph of
10 calls replayed 50 times. Prints us a call and the fraction of the copy ceiling measured in the
same run (bytes: the 7 experts' words and scales), and checks every output bitwise the two-launch one.

Usage (device): python3 benchmarks/results/decode/moe_schedule/moe_schedule.py $OUT/moe_schedule.json [--sweep]
(``--sweep``: the fused launch over up x down tiles against the two launches, and the two launches'
per-kernel device time)
"""
# Written for moe_decode_tma's FUSED_TILES ((up, down) tiles per format), which stop 57 replaced by
# FUSED_UP_TILES + DOWN_TILES (one down tile per format for every schedule): rerun at commit 244f746.
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[4]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.measure import copy_ceiling  # noqa: E402
from dsv4lab.kernels import moe_decode_tma as m  # noqa: E402
from moe_tile_sweep import H, I, K, case, graph_us  # noqa: E402

ROUNDS = 2
# (label, schedule, fused (up, down) tiles or None for FUSED_TILES): the two launches, the PDL'd
# down launch, the fused launch at its tiles and with 128-row down tiles (faster on NVFP4, other
# bits). (The h100/spin_* runs also had a nanosleep back-off between polls, since removed: no gain.)
VARIANTS = [("two", "two", None), ("pdl", "pdl", None), ("fused", "fused", None),
            ("fused_64x4_128", "fused", ((64, 4, 4), (128, 3, 4)))]


SWEEP_UP = [(64, 3, 4), (32, 3, 4), (128, 3, 4), (64, 4, 4), (64, 2, 4), (32, 4, 2)]
SWEEP_DOWN = [(64, 3, 4), (128, 3, 4), (32, 3, 4), (64, 4, 4), (128, 2, 4), (32, 3, 2)]


def kernel_us(fn, calls: int = 20) -> dict:
    """Mean device us a call per kernel name, from the profiler over ``calls`` eager calls."""
    from torch.profiler import ProfilerActivity, profile
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    return {e.key: round(e.device_time_total / calls, 2) for e in prof.key_averages() if e.device_time_total > 0}


def sweep(out: Path) -> None:
    """The fused launch over up x down tiles, both formats, against the two launches, plus the
    two launches' per-kernel device time (profiler)."""
    dev = torch.device("cuda")
    ceil = copy_ceiling(dev)
    rows = []
    for fmt in ("nvfp4", "mxfp4"):
        run, per = case(fmt)
        byts = (K + 1) * 3 * I * H * per

        tiles0, mx = dict(m.FUSED_TILES), fmt == "mxfp4"
        m.SCHEDULE = "two"
        ref = run().clone()
        prof = kernel_us(run)
        print(fmt, "two, per kernel us:", prof, flush=True)
        cfgs = [("two", None, None)] + [("fused", u, d) for u in SWEEP_UP for d in SWEEP_DOWN] + [("two", None, None)]
        for sched, u, d in cfgs:
            m.SCHEDULE, m.FUSED_TILES = sched, {**tiles0, mx: (u, d)}
            try:
                y = run()
                t = graph_us(run)
            except Exception as e:  # noqa: BLE001 - too much shared memory etc.: record and go on
                rows.append(dict(fmt=fmt, schedule=sched, up=u, down=d, error=str(e)[:200]))
                print(fmt, sched, u, d, "failed", type(e).__name__, flush=True)
                continue
            same = bool(torch.equal(y, ref))
            frac = byts / (t * 1e-6) / ceil
            rows.append(dict(fmt=fmt, schedule=sched, up=u, down=d, us=t, bitwise=same, of_copy=frac))
            print(f"{fmt} {sched:5s} up {u} down {d} {t:7.1f} us  bitwise {same}  {frac:.1%}", flush=True)
        m.SCHEDULE, m.FUSED_TILES = None, tiles0
        rows.append(dict(fmt=fmt, two_kernel_us=prof))
    out.write_text(json.dumps(dict(device=torch.cuda.get_device_name(), copy_Bps=ceil, rows=rows), indent=1))


def main() -> None:
    out = Path(sys.argv[1])
    if "--sweep" in sys.argv:
        return sweep(out)
    dev = torch.device("cuda")
    ceil = copy_ceiling(dev)
    rows = []
    for fmt in ("nvfp4", "mxfp4"):
        for T in (1,):
            run, per = case(fmt, T)
            byts = (T * K + 1) * 3 * I * H * per   # upper bound: distinct experts per token

            m.SCHEDULE = "two"
            ref = run().clone()
            tiles0 = dict(m.FUSED_TILES)
            for r in range(ROUNDS):
                for label, sched, tiles in VARIANTS:
                    m.SCHEDULE = sched
                    m.FUSED_TILES = {**tiles0, fmt == "mxfp4": tiles} if tiles else tiles0
                    y = run()
                    same = bool(torch.equal(y, ref))   # before the graph timing's calls
                    t = graph_us(run)
                    kept = bool(torch.equal(y, ref))   # y untouched by them
                    frac = byts / (t * 1e-6) / ceil
                    rows.append(dict(fmt=fmt, T=T, variant=label, round=r, us=t, bitwise=same, kept=kept,
                                     max_diff=(y.float() - ref.float()).abs().max().item(), of_copy=frac))
                    print(f"{fmt} T={T} {label:22s} r{r} {t:7.1f} us  bitwise {same} kept {kept}  {frac:.1%} of copy", flush=True)
            m.SCHEDULE, m.FUSED_TILES = None, tiles0
    out.write_text(json.dumps(dict(device=torch.cuda.get_device_name(), copy_Bps=ceil, rows=rows), indent=1))


if __name__ == "__main__":
    main()
