"""plain_gemv tiles at V4-Pro bf16 decode shapes: device us per call (graph replay over 24 weight
copies, L2 defeated) against F.linear (cuBLAS: GEMV + reduce) on the same copies."""
import json, sys, itertools, torch, torch.nn.functional as F
sys.path.insert(0, "."); sys.path.insert(0, "benchmarks")
from benchmarks.kernels import graph_time_us
from dsv4lab.kernels.linear_plain import plain_gemv
dev = "cuda"; n = 24
x = torch.randn(1, 1, 7168, device=dev).bfloat16()
out = {}
for N in (1024, 256, 64, 384):
    ws = [torch.randn(N, 7168, device=dev).bfloat16() for _ in range(n)]
    ref = F.linear(x, ws[0])
    row = {"cublas_us": graph_time_us([lambda w=w: F.linear(x, w) for w in ws]), "MB": N * 7168 * 2 / 1e6}
    for bn, bk, prog, wp in itertools.product((8, 16, 32), (256, 512, 1024), (128, 256, 512), (4, 8)):
        if bn * bk > 16384: continue
        cfg = {"BN": bn, "BK": bk, "PROGRAMS": prog, "WARPS": wp}
        try:
            us = graph_time_us([lambda w=w: plain_gemv(x, w, config=cfg) for w in ws])
            row[f"{bn}x{bk}/p{prog}/w{wp}"] = round(us, 2)
        except Exception as e:
            row[f"{bn}x{bk}/p{prog}/w{wp}"] = str(e)[:80]
    best = min((v, k) for k, v in row.items() if "x" in k and isinstance(v, float))
    row["best"] = best
    print(N, "cublas", round(row["cublas_us"], 2), "best", best, "default", row.get("16x256/p256/w4"), flush=True)
    out[N] = row
json.dump(out, open(__import__("os").environ.get("OUT", "/tmp") + "/plain_gemv_sweep.json", "w"), indent=1)
