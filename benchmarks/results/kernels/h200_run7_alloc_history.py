import sys, torch
sys.path.insert(0, ".")
from benchmarks.kernels import graph_time_us, rand_nvfp4
from kernels.nvfp4_matmul import nvfp4_matmul
from kernels.nvfp4_gemv_tma import tma_default_config
N, K = 129280, 7168
copies = [rand_nvfp4(N, K, seed=i) for i in range(2)]
x = torch.randn(1, K, device="cuda", dtype=torch.bfloat16)
cfg = tma_default_config(N, K, x.device, 1)
for label, kw in (("no-config", {}), ("explicit", {"config": cfg}), ("no-config", {})):
    for reps in (10, 20):
        t = graph_time_us([lambda c=c: nvfp4_matmul(x, c.packed, c.block_scale, c.global_scale, **kw) for c in copies], reps=reps)
        print(label, reps, f"{t:.1f}", flush=True)
ref = torch.nn.functional.linear(x, copies[0].dequantize(torch.bfloat16)); del ref
t = graph_time_us([lambda c=c: nvfp4_matmul(x, c.packed, c.block_scale, c.global_scale) for c in copies]); print("after ref", f"{t:.1f}")
copies4 = copies + [rand_nvfp4(N, K, seed=i) for i in range(2, 4)]
t = graph_time_us([lambda c=c: nvfp4_matmul(x, c.packed, c.block_scale, c.global_scale) for c in copies4]); print("4 copies", f"{t:.1f}")
t = graph_time_us([lambda c=c: nvfp4_matmul(x, c.packed, c.block_scale, c.global_scale) for c in copies4[::-1]]); print("4 copies reversed", f"{t:.1f}")
t = graph_time_us([lambda c=c: nvfp4_matmul(x, c.packed, c.block_scale, c.global_scale) for c in copies4[2:]]); print("2 fresh copies", f"{t:.1f}")
