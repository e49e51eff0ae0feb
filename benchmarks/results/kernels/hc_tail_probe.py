"""hc_pre at T=1 (V4-Pro site): graph us per call over 24 copies, per collapse tile / warps, and
with 1 Sinkhorn iteration (its share of the tail)."""
import json, sys, torch
sys.path.insert(0, "."); sys.path.insert(0, "benchmarks")
from benchmarks.kernels import graph_time_us
from dsv4lab.kernels import mhc_fused as M
from dsv4lab.checkpoint.synth import preset_config
cfg = preset_config("v4-pro"); hc, D = cfg.hc_mult, cfg.hidden_size
dev = "cuda"; n = 24
fns = [torch.randn(24, hc * D, device=dev) * 0.02 for _ in range(n)]
base = torch.randn(24, device=dev); scale = torch.rand(3, device=dev) + 0.5
xs = [torch.randn(1, 1, hc, D, device=dev).bfloat16() for _ in range(n)]
ref = M.hc_pre(xs[0], fns[0], base, scale, 20, 1e-6, 1e-6)
for coll, warps, iters in [(2048, 4, 20), (2048, 4, 1), (8192, 4, 20), (8192, 8, 20), (4096, 8, 20), (2048, 8, 20),
                           (8192, 16, 20), (2048, 4, 20)]:
    M.COLLAPSE_ELEMS, M.PRE_WARPS = coll, warps
    try:
        calls = [lambda x=x, f=f: M.hc_pre(x, f, base, scale, iters, 1e-6, 1e-6) for x, f in zip(xs, fns)]
        us = graph_time_us(calls)
        got = M.hc_pre(xs[0], fns[0], base, scale, iters, 1e-6, 1e-6)
        same = [bool(torch.equal(a, b)) for a, b in zip(got, ref)]
        print(json.dumps({"collapse": coll, "warps": warps, "iters": iters, "us": round(us, 2), "bitwise_same": same}))
    except Exception as e:
        print(json.dumps({"collapse": coll, "warps": warps, "error": str(e)[:300]}))
