"""Per-launch trace of one V4-Pro layer decode step under graph replay: name, grid, us, start
(us from the step's first launch) and stream (decode lanes: the side lane is a second stream), in
start order. Usage: python3 benchmarks/results/decode/decode_trace.py [bf16|quantised] (helpers);
writes $OUT/decode_trace.json."""
import json, os, sys
sys.path.insert(0, "."); sys.path.insert(0, "benchmarks")
import torch
from torch.profiler import profile, ProfilerActivity
from decode import build_layer
from dsv4lab import lanes
from dsv4lab.kernels.install import install_kernels
from dsv4lab.model.state import DecodeState

out = {}
helpers = sys.argv[1] if len(sys.argv) > 1 else "bf16"
dev = torch.device("cuda")
for lt in ("compressed_sparse_attention", "heavily_compressed_attention"):
    with torch.no_grad():
        layer, cfg, active = build_layer(lt, dev, helpers=helpers)
        install_kernels(layer)
        st = DecodeState.allocate(cfg, 1, 4096, torch.bfloat16, dev)
        h = torch.randn(1, 1, cfg.hc_mult, cfg.hidden_size, device=dev, dtype=torch.bfloat16)
        ids = torch.zeros(1, 1, dtype=torch.long, device=dev)
        pos = st.pos_on(dev); pos.fill_(1000)
        step = lambda: layer.decode(h, ids, pos, st.layers[0])
        s = torch.cuda.Stream(device=dev); s.wait_stream(torch.cuda.current_stream(dev))
        with lanes.capturing():
            with torch.cuda.stream(s):
                for _ in range(3): step()
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, stream=s):
                step()
        for _ in range(20): g.replay()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(5): g.replay()
            torch.cuda.synchronize()
        path = f"/tmp/trace_{lt}.json"
        prof.export_chrome_trace(path)
        ev = [e for e in json.load(open(path))["traceEvents"] if e.get("cat") == "kernel"]
        ev.sort(key=lambda e: e["ts"])
        n = len(ev) // 5
        rows = []
        for i in range(n):
            reps = [ev[i + r * n] for r in range(5)]
            rows.append({"name": reps[2]["name"][:60], "grid": reps[2]["args"].get("grid"), "block": reps[2]["args"].get("block"),
                         "us": sorted(e["dur"] for e in reps)[2], "stream": reps[2]["args"].get("stream"),
                         "start_us": round(reps[2]["ts"] - ev[2 * n]["ts"], 2),
                         "gap_us": (ev[i + 2 * n]["ts"] - (ev[i + 2 * n - 1]["ts"] + ev[i + 2 * n - 1]["dur"])) if i else 0})
        span = max(e["ts"] + e["dur"] for e in ev[2 * n:3 * n]) - ev[2 * n]["ts"]
        out[lt] = {"kernels": n, "span_us": span, "sum_us": sum(r["us"] for r in rows), "rows": rows}
        print(lt, n, "span", span, "sum", out[lt]["sum_us"])
        for r in rows: print(f'{r["start_us"]:8.2f} {r["us"]:8.2f} {r["gap_us"]:6.2f} {str(r["stream"]):4s} {str(r["grid"]):16s} {r["name"]}')
        del layer, st, g
        torch.cuda.empty_cache()
os.makedirs(os.environ.get("OUT", "/tmp"), exist_ok=True)
json.dump(out, open(os.path.join(os.environ.get("OUT", "/tmp"), "decode_trace.json"), "w"), indent=1)
