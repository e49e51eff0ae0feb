"""Tiles of the plain (bf16) decode GEMVs on the device: the batched launch of a V4-Pro CSA layer's five
projections of x (compressor wkv / wgate 1024 rows each, the indexer compressor's 256 each, weights_proj
64; K 7168), an HCA layer's two (512 each) and the router alone (384 rows), per (BN, BK, programs,
warps): device us per launch from a CUDA graph of 24 launches over 24 weight copies (no L2
reuse between them), the read rate, and whether the outputs equal F.linear's within bf16 rounding.

    python3 benchmarks/results/decode/plain_batch_sweep.py $OUT/plain_batch_sweep.json
"""
import itertools, json, sys
sys.path.insert(0, ".")
import torch
import torch.nn.functional as F
from dsv4lab.kernels import linear_plain as lp

COPIES = 24
SHAPES = {"csa_batch": (1024, 1024, 256, 256, 64), "hca_batch": (512, 512), "router": (384,)}
K = 7168
dev = torch.device("cuda")
g = torch.Generator(dev).manual_seed(0)
x = torch.randn(1, 1, K, device=dev, generator=g).to(torch.bfloat16)
weights = {name: [[(torch.randn(n, K, device=dev, generator=g) * K ** -0.5).to(torch.bfloat16) for n in ns]
                  for _ in range(COPIES)] for name, ns in SHAPES.items()}


def run(name, ws):
    if name == "router":
        return [lp.launch_plain_gemv(x, ws[0], config={"BN": lp.BN, "BK": lp.BK, "PROGRAMS": lp.TARGET_PROGRAMS,
                                                          "WARPS": lp.BATCH_WARPS})]
    return lp.launch_plain_gemv_batch(x, tuple(ws))


def measure(name):
    lp._BATCH_PLANS.clear()
    outs = run(name, weights[name][0])
    ok = all(torch.allclose(o.float().view(-1), F.linear(x, w).float().view(-1), rtol=1e-2, atol=1e-2)
             for o, w in zip(outs, weights[name][0]))
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for ws in weights[name]:
            run(name, ws)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=s):
        for ws in weights[name]:
            run(name, ws)
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    reps = 20
    a.record()
    for _ in range(reps):
        graph.replay()
    b.record()
    torch.cuda.synchronize()
    us = a.elapsed_time(b) * 1e3 / reps / COPIES
    nbytes = sum(w.numel() * 2 for w in weights[name][0])
    return {"us": round(us, 2), "GBps": round(nbytes / us / 1e3, 1), "ok": ok}


rows = []
base = (lp.BN, lp.BK, lp.TARGET_PROGRAMS, lp.BATCH_WARPS)
grid = [base] + [c for c in itertools.product((8, 16, 32), (1024,), (132, 264, 1024), (4, 8)) if c != base]
grid += [(16, 512, 264, 8), (8, 2048, 264, 4)]
# the recorded run (h100_plain_batch_sweep.json, at ed1c00c) also tried num_stages 3 at (16, 1024, 264, 8)
# and (32, 1024, 132, 8): no faster than Triton's default, so the knob is gone
for bn, bk, progs, warps in grid:
    lp.BN, lp.BK, lp.TARGET_PROGRAMS, lp.BATCH_WARPS = bn, bk, progs, warps
    r = {"BN": bn, "BK": bk, "programs": progs, "warps": warps}
    for name in SHAPES:
        try:
            r[name] = measure(name)
        except Exception as e:  # a tile that does not compile must not lose the others
            r[name] = {"error": f"{type(e).__name__}: {str(e)[:120]}"}
    rows.append(r)
    print(json.dumps(r), flush=True)
json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, open(sys.argv[1], "w"), indent=1)
for name in SHAPES:
    good = [r for r in rows if "us" in r[name] and r[name]["ok"]]
    best = min(good, key=lambda r: r[name]["us"])
    print(f"{name}: default {rows[0][name]}, best {best[name]} at BN {best['BN']} BK {best['BK']} "
          f"programs {best['programs']} warps {best['warps']}")
