"""o_b steady-state inefficiency: is it the power-of-two row stride? Time the TMA GEMV alone on
weights whose rows are padded (packed and/or scales), for o_b and 4x o_b rows."""
import sys, torch
sys.path.insert(0, ".")
from benchmarks.kernels import copy_ceiling, graph_time_us
from triton.testing import do_bench
from kernels.nvfp4_gemv_tma import launch_gemv_tma, tma_default_config, x_pairs
ceil = copy_ceiling(do_bench); print(f"ceil {ceil:.0f}", flush=True)
dev = torch.device("cuda")
def mk(N, K, wpad, spad, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    p = torch.randint(0, 256, (N, K // 2 + wpad), generator=g, dtype=torch.uint8, device="cuda")[:, :K // 2]
    s = (torch.rand(N, K // 16 + spad, generator=g, device="cuda") * 4 + 2 ** -9).to(torch.float8_e4m3fn)[:, :K // 16]
    return p, s
gs = torch.tensor(0.021, device="cuda")
for K, N in ((16384, 7168), (16384, 28672), (15872, 7168), (7168, 129280 // 4), (1536, 65536)):
    x = torch.randn(1, K, device=dev, dtype=torch.bfloat16)
    pairs = x_pairs(x[0])
    y = torch.empty(1, N, device=dev, dtype=torch.bfloat16)
    nbytes = N * K // 2 + N * K // 16
    ncopy = max(2, min(16, -(-400_000_000 // nbytes)))
    for wpad, spad in ((0, 0), (128, 0), (0, 16), (128, 16), (256, 32), (1024, 128), (64, 16)):
        ws = [mk(N, K, wpad, spad, i) for i in range(ncopy)]
        for extra in ({}, {"SPLIT": 1, "BN": 64, "STAGES": 4}, {"SPLIT": 4, "BN": 128, "STAGES": 4}):
            cfg = {**tma_default_config(N, K, dev, 1), **extra}
            t = graph_time_us([lambda c=c: launch_gemv_tma(x, c[0], c[1], gs, y, cfg, pairs=pairs) for c in ws], reps=10)
            print(f"K={K} N={N} wpad={wpad} spad={spad} {cfg['BN']}/{cfg['STAGES']}/{cfg['SPLIT']}: {t:.1f} us {nbytes/(t*1e-6)/1e9/ceil:.1%}", flush=True)
        del ws; torch.cuda.empty_cache()
