"""Where a V4-Pro decode hc_pre site's ~12 us go (one token, hc = 4, D = 7168, 20 Sinkhorn
iterations): the fused kernel timed in a replayed graph against variants that drop one part,
beside an empty Triton launch (the per-launch floor) and hc_post. The variants' outputs differ
(iters = 1, the head site); only their times are compared.

Usage (device): python3 benchmarks/results/decode/hc_pre_probe.py $OUT/hc_pre_probe.json
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
from benchmarks.kernels import graph_time_us  # noqa: E402
from dsv4lab.kernels import mhc_fused as mf  # noqa: E402

HC, D, ITERS, REPS = 4, 7168, 20, 20


@triton.jit
def _empty_kernel(p):
    pass


def graph_us(fn) -> float:
    """Device us a call, REPS calls captured in one graph and replayed (``benchmarks.kernels``)."""
    return graph_time_us([fn] * REPS, reps=50)


def main() -> None:
    out = Path(sys.argv[1])
    dev = torch.device("cuda")
    mix = (2 + HC) * HC
    x = torch.randn(1, 1, HC, D, device=dev, dtype=torch.bfloat16)
    fn = torch.randn(mix, HC * D, device=dev) * 0.01
    base, scale = torch.randn(mix, device=dev) * 0.1, torch.ones(3, device=dev)
    o = torch.randn(1, 1, D, device=dev, dtype=torch.bfloat16)
    flag = torch.zeros(1, device=dev)
    pre, post, comb, _ = mf.hc_pre(x, fn, base, scale, ITERS, 1e-6, 1e-6)
    rows = {"empty_launch": graph_us(lambda: _empty_kernel[(1,)](flag)),
            "empty_launch_112": graph_us(lambda: _empty_kernel[(112,)](flag)),
            "hc_pre": graph_us(lambda: mf.hc_pre(x, fn, base, scale, ITERS, 1e-6, 1e-6)),
            "hc_pre_iters1": graph_us(lambda: mf.hc_pre(x, fn, base, scale, 1, 1e-6, 1e-6)),
            "hc_head_pre": graph_us(lambda: mf.hc_head_pre(x, fn[:HC], base[:HC], scale, 1e-6, 1e-6)),
            "hc_post": graph_us(lambda: mf.hc_post(x, o, post, comb))}
    for split, bk in ((14, 256), (28, 256), (56, 256), (224, 128)):
        rows[f"hc_pre_split{split}_bk{bk}"] = graph_us(
            lambda: mf.hc_pre(x, fn, base, scale, ITERS, 1e-6, 1e-6, split=split, block_k=bk))
    for name, val in (("DECODE_COLLAPSE_ELEMS", 2048), ("PRE_WARPS", 8), ("PRE_WARPS", 2)):
        old = getattr(mf, name)
        setattr(mf, name, val)
        mf._SITES.clear()
        rows[f"hc_pre_{name}_{val}"] = graph_us(lambda: mf.hc_pre(x, fn, base, scale, ITERS, 1e-6, 1e-6))
        setattr(mf, name, old)
        mf._SITES.clear()
    for k, v in rows.items():
        print(f"{k:32s} {v:7.2f} us", flush=True)
    out.write_text(json.dumps(dict(device=torch.cuda.get_device_name(), us=rows), indent=1))


if __name__ == "__main__":
    main()
