"""Per-kernel device time of eager decode steps of one V4-Pro layer (torch.profiler, CUDA activity):
name -> (count a step, us a step, max us), sorted by time; to find a kernel slow only in eager mode.
Usage (device): python3 benchmarks/results/decode/eager_kernel_trace.py $OUT/eager_kernel_trace.json"""
import collections, json, sys
sys.path.insert(0, "."); sys.path.insert(0, "benchmarks")
import torch
from torch.profiler import profile, ProfilerActivity
import launch_inventory as inventory
from dsv4lab.kernels.install import install_kernels
from dsv4lab.model.state import DecodeState

out = {}
dev = torch.device("cuda")
for lt in ("hca", "csa"):
    with torch.no_grad():
        layer, cfg, _ = inventory.build(inventory.LAYERS[lt], dev, 8)
        install_kernels(layer)
        st = DecodeState.allocate(cfg, 1, 4096, torch.bfloat16, dev)
        h = torch.randn(1, 1, cfg.hc_mult, cfg.hidden_size, device=dev, dtype=torch.bfloat16)
        ids = torch.zeros(1, 1, dtype=torch.long, device=dev)
        pos = st.pos_on(dev); pos.fill_(1000)
        for _ in range(5):
            layer.decode(h, ids, pos, st.layers[0])
        torch.cuda.synchronize()
        n = 10
        with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
            for _ in range(n):
                layer.decode(h, ids, pos, st.layers[0])
            torch.cuda.synchronize()
        agg = collections.defaultdict(lambda: [0, 0.0, 0.0])
        for e in prof.events():
            if e.device_type == torch.autograd.DeviceType.CUDA:
                a = agg[e.name[:70]]
                a[0] += 1; a[1] += e.device_time; a[2] = max(a[2], e.device_time)
        rows = sorted(((k, v[0] / n, v[1] / n, v[2]) for k, v in agg.items()), key=lambda r: -r[2])
        out[lt] = rows
        print(lt, "device us a step:", round(sum(r[2] for r in rows), 1))
        for r in rows[:25]:
            print(f"  {r[2]:9.1f} us  x{r[1]:4.1f}  max {r[3]:8.1f}  {r[0]}")
        del layer, st
        torch.cuda.empty_cache()
if len(sys.argv) > 1:
    json.dump(out, open(sys.argv[1], "w"), indent=1)
