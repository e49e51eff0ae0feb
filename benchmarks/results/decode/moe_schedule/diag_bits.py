# Written for moe_decode_tma's FUSED_TILES ((up, down) tiles per format), which stop 57 replaced by
# FUSED_UP_TILES + DOWN_TILES (one down tile per format for every schedule): rerun at commit 244f746.
import sys, torch
sys.path.insert(0, "benchmarks/results/decode")
sys.path.insert(0, ".")
from moe_tile_sweep import E, H, I, K, rand_stack
from dsv4lab.kernels import moe_decode_tma as m
from dsv4lab.kernels.moe_decode_ref import moe_decode_ref
from dsv4lab.quant.stacked import stack_one
dev = torch.device("cuda")
for fmt in ("nvfp4",):
    w1, w3, w2 = rand_stack(fmt, E, I, H, 1), rand_stack(fmt, E, I, H, 2), rand_stack(fmt, E, H, I, 3)
    sh = tuple(stack_one(s.weight(0)) for s in (rand_stack(fmt, 1, I, H, 4), rand_stack(fmt, 1, I, H, 5), rand_stack(fmt, 1, H, I, 6)))
    x = torch.randn(1, H, device=dev, dtype=torch.bfloat16)
    ids = torch.randperm(E, device=dev)[:K].to(torch.int32)
    wts = torch.rand(K, device=dev)
    run = lambda: m.moe_decode_tma(x, ids, wts, w1, w3, w2, 10.0, K, shared=sh).clone()
    one = torch.zeros(1, 1, dtype=torch.long, device=dev)
    ref = moe_decode_ref(x, ids.view(1, K).long(), wts.view(1, K), w1, w3, w2, 10.0) + moe_decode_ref(x, one, torch.ones(1, 1, device=dev), *sh, 10.0)
    out = {}
    m.SCHEDULE = "two"; out["two64"] = [run() for _ in range(3)]
    m.DOWN_TILE = (128, 3, 4); out["two128"] = [run() for _ in range(3)]; m.DOWN_TILE = (64, 3, 4)
    m.SCHEDULE = "fused"; out["fused_default"] = [run() for _ in range(3)]
    t0 = dict(m.FUSED_TILES); m.FUSED_TILES = {**t0, False: ((64, 3, 4), (64, 3, 4))}; out["fused64"] = [run() for _ in range(3)]
    m.FUSED_TILES = {**t0, False: ((64, 3, 4), (128, 3, 4))}; out["fused_up643_down128"] = [run() for _ in range(3)]
    m.FUSED_TILES = t0
    base = out["two64"][0]
    for k, v in out.items():
        print(fmt, k, "self-equal", all(torch.equal(a, v[0]) for a in v), "eq two64", torch.equal(v[0], base),
              "maxdiff two64 %.3g" % (v[0].float() - base.float()).abs().max().item(),
              "rel err vs ref %.3g" % ((v[0].float() - ref.float()).abs().max() / ref.float().abs().max()).item(),
              "ndiff", int((v[0] != base).sum()))

# the microbench's order: each variant's eager call, then its graph timing; counters after each
from moe_tile_sweep import graph_us
from dsv4lab.kernels.host import counters
print("--- microbench order")
m.SCHEDULE = "two"
base = run()
for label, sched, tiles in (("two", "two", None), ("pdl", "pdl", None), ("fused", "fused", None), ("fused", "fused", None),
                            ("fused64", "fused", ((64, 3, 4), (64, 3, 4))), ("two", "two", None), ("fused", "fused", None)):
    m.SCHEDULE = sched
    m.FUSED_TILES = {**t0, False: tiles} if tiles else t0
    y = run()
    nz0 = counters(dev, 1)[:256].nonzero().flatten().tolist()
    t = graph_us(run)
    torch.cuda.synchronize()
    nz = counters(dev, 1)[:256].nonzero().flatten().tolist()
    y2 = run()
    print(label, "%.1f us" % t, "eager eq", torch.equal(y, base), "after graph eq", torch.equal(y2, base),
          "ndiff", int((y != base).sum()), "counters nonzero before/after graph", nz0[:8], nz[:8], flush=True)
