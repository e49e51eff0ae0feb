"""Why a full-depth eager decode step costs more host time per layer than one layer alone
(``eager_layer.py``): wall vs thread CPU time of ``decode_step``, with Python's GC on and off,
and each layer's host time inside the 61-layer loop vs the same layer looped alone.
Usage (device): python3 benchmarks/results/decode/full_eager_depth.py [ROOT] > out.txt"""
import gc, statistics, sys, time
import depth_util
depth_util.use_root(sys.argv)
import torch

model, state, step_ids = depth_util.full_depth(1200)
torch.no_grad().__enter__()
dev = step_ids.device
print(f"gc thresholds {gc.get_threshold()} tracked objects {len(gc.get_objects())}", flush=True)


def tokens(n, label):
    torch.cuda.synchronize()
    t, c = time.perf_counter(), time.thread_time()
    for _ in range(n):
        model.decode_step(step_ids, state)
    host, cpu = time.perf_counter() - t, time.thread_time() - c
    torch.cuda.synchronize()
    wall = time.perf_counter() - t
    print(f"{label}: wall {wall / n * 1e3:.1f} host {host / n * 1e3:.1f} thread CPU {cpu / n * 1e3:.1f} ms/token", flush=True)


tokens(10, "gc on ")
gc.disable()
tokens(10, "gc off")
gc.enable()
gc.freeze()
tokens(10, "gc frozen")
gc.unfreeze()

kinds = ["csa" if getattr(l.attn, "indexer", None) is not None else ("hca" if getattr(l.attn, "compressor", None) is not None else "swa")
         for l in model.layers]
pos = state.pos_on(dev)
h0 = model._embed(step_ids)
per = [[] for _ in model.layers]
for _ in range(10):
    h = h0
    for i, layer in enumerate(model.layers):
        t = time.perf_counter()
        h = layer.decode(h, step_ids, pos, state.layers[i])
        per[i].append(time.perf_counter() - t)
torch.cuda.synchronize()
med = [statistics.median(x) * 1e6 for x in per]
for k in sorted(set(kinds)):
    xs = [m for m, kk in zip(med, kinds) if kk == k]
    print(f"in the loop, {k}: {len(xs)} layers, host us median {statistics.median(xs):.0f} min {min(xs):.0f} max {max(xs):.0f}")
print("per layer us:", " ".join(f"{i}{kinds[i][0]}:{m:.0f}" for i, m in enumerate(med)))
for i in (kinds.index("csa"), kinds.index("hca"), len(kinds) - 1):
    xs = []
    for _ in range(40):
        t = time.perf_counter()
        model.layers[i].decode(h0, step_ids, pos, state.layers[i])
        xs.append(time.perf_counter() - t)
    torch.cuda.synchronize()
    print(f"layer {i} ({kinds[i]}) looped alone: host us median {statistics.median(xs[5:]) * 1e6:.0f}")
# serialised: sync after each layer (host + device per layer, no overlap)
ser = [[] for _ in model.layers]
for _ in range(5):
    h = h0
    for i, layer in enumerate(model.layers):
        torch.cuda.synchronize()
        t = time.perf_counter()
        h = layer.decode(h, step_ids, pos, state.layers[i])
        torch.cuda.synchronize()
        ser[i].append(time.perf_counter() - t)
sm = [statistics.median(x) * 1e6 for x in ser]
for k in sorted(set(kinds)):
    xs = [m for m, kk in zip(sm, kinds) if kk == k]
    print(f"synchronised per layer, {k}: median {statistics.median(xs):.0f} us")
