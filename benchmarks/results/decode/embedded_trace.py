"""Per-launch trace of one embedded-model decode step under graph replay (name, grid-free us, in
order), the step's kernel count, device time and the gaps between kernels; eager host time a step.

    python3 benchmarks/results/decode/embedded_trace.py $OUT/embedded_trace.json
"""
import collections
import json
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, ".")
import dsv4lab  # noqa: E402
from dsv4lab.decode.graphs import GraphDecoder  # noqa: E402

out_path = sys.argv[1]
m = dsv4lab.load(device="cuda", dtype=torch.float32, progress=False)
ids = torch.randint(2, m.config.vocab_size, (1, 48), generator=torch.Generator().manual_seed(0)).cuda()
st = m.new_state(1, 512)
m.prefill(ids, st)
tok = ids[:, -1:]
with torch.no_grad():
    for _ in range(5):
        m.decode_step(tok, st)
    torch.cuda.synchronize()
    ts = []
    for _ in range(60):
        t = time.perf_counter()
        m.decode_step(tok, st)
        torch.cuda.synchronize()
        ts.append(time.perf_counter() - t)
    eager_ms = sorted(ts)[len(ts) // 2] * 1e3
    gd = GraphDecoder(m, st)
    for _ in range(20):
        gd.step(tok)
    torch.cuda.synchronize()
    ts = []
    for _ in range(200):
        t = time.perf_counter()
        gd.step(tok)
        torch.cuda.synchronize()
        ts.append(time.perf_counter() - t)
    graph_ms = sorted(ts)[len(ts) // 2] * 1e3
    seg = gd.segments[0]
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            seg.graph.replay()
        torch.cuda.synchronize()
prof.export_chrome_trace("/tmp/embedded_trace.json")
ev = [e for e in json.load(open("/tmp/embedded_trace.json"))["traceEvents"] if e.get("cat") == "kernel"]
ev.sort(key=lambda e: e["ts"])
n = len(ev) // 5
rows, gaps = [], []
for i in range(n):
    reps = [ev[i + r * n] for r in range(5)]
    rows.append({"name": reps[0]["name"][:90], "us": sorted(e["dur"] for e in reps)[2]})
for i in range(1, n):
    gaps.append(ev[i]["ts"] - (ev[i - 1]["ts"] + ev[i - 1]["dur"]))
span = ev[n - 1]["ts"] + ev[n - 1]["dur"] - ev[0]["ts"]
by = collections.Counter()
cnt = collections.Counter()
for r in rows:
    key = r["name"].split("(")[0][:60]
    by[key] += r["us"]
    cnt[key] += 1
res = {"eager_ms": eager_ms, "graph_ms": graph_ms, "kernels_per_step": n, "kernel_us_sum": sum(r["us"] for r in rows),
       "span_us": span, "gap_us_sum": sum(gaps), "by_kernel_us": by.most_common(), "count_by_kernel": cnt.most_common(),
       "rows": rows}
json.dump(res, open(out_path, "w"), indent=1)
print(json.dumps({k: v for k, v in res.items() if k not in ("rows",)}, indent=0)[:6000])
