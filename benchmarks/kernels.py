"""Benchmark the NVFP4 kernels on the device machine (CUDA + triton).

For the V4-Pro linear shapes at batch 1, 4, 16 (+ one prefill batch): time of our kernel
(``dsv4lab.kernels.linear_nvfp4``, tuned on first call; timed as CUDA-graph replays over enough weight
copies to defeat the L2, plus the eager per-call time for reference), time of the PyTorch path it replaces
(``NVFP4Weight.dequantize(bf16)`` then ``F.linear``), achieved bandwidth (packed weights + e4m3
scales + x + y bytes / time) and its fraction of a copy ceiling measured in the same run
(device-to-device copy of 2 GiB, bytes read + written / time). Every timed kernel output is also
checked against the reference. At batch 1 also: the pointer-load GEMV (what M=1 used before the
TMA kernel) with its f16x2 and fp32-FMA inner loops, and cuBLAS's bf16 GEMV over a matrix of the
same N holding the same bytes (what a vendor kernel reaches at that size: the calibration for the
fraction-of-ceiling figures). Also times the MoE decode path (6 experts, 7168->3072->7168), the
official-format matmuls (MXFP4 expert shapes, FP8-block projections) and the activation quantiser.

    python3 benchmarks/kernels.py --json
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

RESULTS = Path(__file__).resolve().parent / "results"  # default --json location

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SHAPES = [  # name, K (in), N (out)
    ("expert_w1/w3", 7168, 3072), ("expert_w2", 3072, 7168), ("q_a", 7168, 1536), ("q_b", 1536, 65536),
    ("wkv", 7168, 512), ("o_b", 16384, 7168), ("lm_head", 7168, 129280),
]
LARGE = {"q_b", "o_b", "lm_head"}  # >= 50 MB of NVFP4 weights; the 12 MB expert shapes are launch/latency-bound
                                   # (cuBLAS bf16 reads 12 MB at ~45% of the ceiling, see m1 "cublas" column)


def rand_nvfp4(n, k, seed=0):
    from dsv4lab.quant.weights import NVFP4Weight

    g = torch.Generator(device="cuda").manual_seed(seed)
    packed = torch.randint(0, 256, (n, k // 2), generator=g, dtype=torch.uint8, device="cuda")
    sc = (torch.rand(n, k // 16, generator=g, device="cuda") * 4 + 2 ** -9).to(torch.float8_e4m3fn)
    return NVFP4Weight(packed, sc, torch.tensor(0.021, device="cuda"))


def copy_ceiling(do_bench) -> float:
    n = 1 << 30  # 1 GiB each way (bf16 elements * 2 bytes = 2 GiB src)
    src = torch.empty(n, dtype=torch.bfloat16, device="cuda").normal_()
    dst = torch.empty_like(src)
    t = do_bench(lambda: dst.copy_(src), warmup=25, rep=200)
    bytes_ = 2 * src.numel() * src.element_size()
    del src, dst
    torch.cuda.empty_cache()
    return bytes_ / (t * 1e-3) / 1e9


def graph_time_us(calls, reps=20) -> float:
    """Mean GPU time (us) per call of ``calls`` (a list of zero-arg callables, each on a different
    weight copy so the working set exceeds the 50 MB L2), captured once in a CUDA graph and
    replayed: decode runs as graph replays, so this excludes Python launch overhead but not
    the kernels' own launch latency."""
    for c in calls:  # warm up / compile / tune outside capture
        c()
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    g = torch.cuda.CUDAGraph()
    with torch.cuda.stream(s):
        with torch.cuda.graph(g, stream=s):
            for c in calls:
                c()
    torch.cuda.current_stream().wait_stream(s)
    g.replay()
    torch.cuda.synchronize()
    st, en = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    st.record()
    for _ in range(reps):
        g.replay()
    en.record()
    torch.cuda.synchronize()
    t = st.elapsed_time(en) * 1e3 / (reps * len(calls))
    del g
    return t


def rel_err(y, r):
    return ((y.float() - r.float()).abs().max() / r.float().abs().max()).item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", type=Path, nargs="?", default=None, const=RESULTS / "kernels.json",
                    help="write the results here (bare --json: benchmarks/results/kernels.json)")
    ap.add_argument("--batches", default="1,4,16")
    ap.add_argument("--prefill", type=int, default=128)
    ap.add_argument("--shapes", default=None, help="comma-separated subset of shape names")
    ap.add_argument("--skip-moe", action="store_true")
    args = ap.parse_args()
    from triton.testing import do_bench

    from dsv4lab.kernels.moe_decode import moe_decode_triton
    from dsv4lab.kernels.moe_decode_ref import moe_decode_ref
    from dsv4lab.quant.stacked import StackedNVFP4
    from dsv4lab.kernels.act_quant_nvfp4 import nvfp4_act_quant
    from dsv4lab.kernels.linear_nvfp4 import _TUNED, gemm_config, nvfp4_matmul, tune_key

    def cfg_of(M, N, K, x):
        return next((_TUNED[k] for tma in (True, False) if (k := tune_key(M, N, K, x.dtype, x.device, tma)) in _TUNED), None)

    def pointer_gemv_cfg(x, w):
        """The do_bench-tuned config of the pointer-load GEMV (what M=1 used before the TMA kernel)."""
        os.environ["DSV4LAB_KERNEL_TMA"], os.environ["DSV4LAB_KERNEL_TUNE"] = "0", "1"
        try:
            nvfp4_matmul(x, w.packed, w.block_scale, w.global_scale)
            return _TUNED[tune_key(1, w.packed.shape[0], x.shape[-1], x.dtype, x.device, False)]
        finally:
            os.environ.pop("DSV4LAB_KERNEL_TMA")
            os.environ.pop("DSV4LAB_KERNEL_TUNE")

    dev = torch.cuda.get_device_name()
    ceil = copy_ceiling(do_bench)
    print(f"device: {dev}  torch {torch.__version__}  copy ceiling {ceil:.0f} GB/s", flush=True)
    rows = []
    batches = [int(b) for b in args.batches.split(",")] + ([args.prefill] if args.prefill else [])
    t0 = time.time()
    for name, K, N in SHAPES:
        if args.shapes and name not in args.shapes.split(","):
            continue
        w = rand_nvfp4(N, K)
        wbytes = w.packed.numel() + w.block_scale.numel()
        xs = {M: torch.randn(M, K, device="cuda", dtype=torch.bfloat16) for M in batches
              if not (M > 16 and name == "lm_head")}
        # references first, timing copies after: a large temporary allocated and freed after the
        # copies exist slows their later reads (lm_head 140 -> 158 us, same kernel and config), so
        # every big temporary (dequantised weights, cuBLAS's bf16 matrices) comes after our timings
        refs = {M: F.linear(x, w.dequantize(torch.bfloat16)) for M, x in xs.items()}
        del w
        torch.cuda.empty_cache()
        # >= 400 MB of weights and >= 2 calls per replay (a one-call graph adds the replay gap to the call)
        ncopy = max(2, min(32, -(-400_000_000 // wbytes)))
        copies = [rand_nvfp4(N, K, seed=i) for i in range(ncopy)]
        w = copies[0]  # the same weights as the references' (seed 0), allocated after them
        recs = {}
        for M, x in xs.items():
            y = nvfp4_matmul(x, w.packed, w.block_scale, w.global_scale)  # tunes (M <= 16)
            err = rel_err(y, refs[M])
            t_k = graph_time_us([lambda c=c: nvfp4_matmul(x, c.packed, c.block_scale, c.global_scale) for c in copies])
            t_e = do_bench(lambda: nvfp4_matmul(x, w.packed, w.block_scale, w.global_scale), warmup=10, rep=50) * 1e3
            ablation = {}
            if M == 1:  # the pointer-load GEMV (tuned) with each inner loop
                pc = pointer_gemv_cfg(x, w)
                for h2 in (True, False):
                    c2 = {**pc, "H2": h2}
                    ablation["pointer_f16x2" if h2 else "pointer_fp32_fma"] = graph_time_us(
                        [lambda c=c: nvfp4_matmul(x, c.packed, c.block_scale, c.global_scale, config=c2) for c in copies])
            recs[M] = (err, t_k, t_e, ablation)
        for M, x in xs.items():
            err, t_k, t_e, ablation = recs[M]
            try:
                nt = min(ncopy, 4)
                t_t = graph_time_us([lambda c=c: F.linear(x, c.dequantize(torch.bfloat16)) for c in copies[:nt]], reps=5)
            except Exception as exc:  # fall back to eager timing
                print("torch path not capturable:", repr(exc)[:200])
                t_t = do_bench(lambda: F.linear(x, w.dequantize(torch.bfloat16)), warmup=3, rep=20) * 1e3
            cublas = None
            if M == 1:  # cuBLAS bf16 at the same bytes
                kb = (K * 9 // 32 + 7) // 8 * 8  # bf16 columns holding the same bytes as K NVFP4 columns + scales
                wb = [torch.randn(N, kb, device="cuda", dtype=torch.bfloat16) for _ in range(ncopy)]
                xb = torch.randn(1, kb, device="cuda", dtype=torch.bfloat16)
                t_cb = graph_time_us([lambda c=c: F.linear(xb, c) for c in wb])
                cublas = dict(us=t_cb, frac_copy=(N * kb * 2) / (t_cb * 1e-6) / 1e9 / ceil)
                del wb
            t_k, t_t = t_k * 1e-3, t_t * 1e-3  # ms, as below
            byts = wbytes + x.numel() * 2 + M * N * 2
            gbs = byts / (t_k * 1e-3) / 1e9
            cfg = cfg_of(M, N, K, x) if M <= 16 else gemm_config(M, N, K, x.device)
            r = dict(shape=name, K=K, N=N, batch=M, kernel_us=t_k * 1e3, kernel_eager_us=t_e, torch_us=t_t * 1e3, GBps=gbs,
                     frac_copy=gbs / ceil, speedup=t_t / t_k, max_rel_err=err, config=cfg,
                     m1_inner_loop_us=ablation or None, cublas_bf16_same_bytes=cublas)
            rows.append(r)
            print(f"{name:13s} {K:6d}->{N:6d} M={M:4d}  ours {t_k*1e3:9.1f} us  torch {t_t*1e3:9.1f} us  "
                  f"{gbs:7.0f} GB/s  {gbs/ceil:5.1%} of copy  x{t_t/t_k:6.1f}  err {err:.2e}  eager {t_e:7.1f} us  {cfg}"
                  + (f"  ablation(us) {ablation}" if ablation else "")
                  + (f"  cuBLAS bf16 same bytes {cublas['us']:.1f} us {cublas['frac_copy']:.1%}" if cublas else ""), flush=True)
        del w, copies
        torch.cuda.empty_cache()
    print(f"matmul sweep {time.time()-t0:.0f} s", flush=True)

    if args.skip_moe:
        print(json.dumps(dict(matmul=rows)), flush=True)
        if args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(dict(device=dev, torch=torch.__version__, copy_GBps=ceil, matmul=rows), indent=1))
        return
    # MoE decode: 6 of 16 stacked experts, V4-Pro expert shapes
    H, I, E, k = 7168, 3072, 16, 6
    w1 = StackedNVFP4.from_weights([rand_nvfp4(I, H, 100 + e) for e in range(E)])
    w3 = StackedNVFP4.from_weights([rand_nvfp4(I, H, 200 + e) for e in range(E)])
    w2 = StackedNVFP4.from_weights([rand_nvfp4(H, I, 300 + e) for e in range(E)])
    moe = []
    for T in (1, 4, 16):
        x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16) * 0.05
        ids = torch.stack([torch.randperm(E, device="cuda")[:k] for _ in range(T)])
        wt = torch.rand(T, k, device="cuda")
        y = moe_decode_triton(x, ids, wt, w1, w3, w2, 10.0)
        err = rel_err(y, moe_decode_ref(x, ids, wt, w1, w3, w2, 10.0))
        t_k = graph_time_us([lambda: moe_decode_triton(x, ids, wt, w1, w3, w2, 10.0)]) * 1e-3
        t_p = graph_time_us([lambda: moe_decode_triton(x, ids, wt, w1, w3, w2, 10.0, tma=False)]) * 1e-3
        t_r = do_bench(lambda: moe_decode_ref(x, ids, wt, w1, w3, w2, 10.0), warmup=2, rep=20)
        uniq = len(set(ids.flatten().tolist()))
        byts = uniq * 3 * (I * H // 2 + I * H // 16)
        gbs = byts / (t_k * 1e-3) / 1e9
        moe.append(dict(T=T, kernel_us=t_k * 1e3, pointer_kernel_us=t_p * 1e3, torch_ref_us=t_r * 1e3,
                        unique_experts=uniq, GBps=gbs, frac_copy=gbs / ceil, max_rel_err=err))
        print(f"moe_decode T={T:2d} k=6 ({uniq} distinct experts)  ours {t_k*1e3:8.1f} us  pointer-load path "
              f"{t_p*1e3:8.1f} us  ref {t_r*1e3:9.1f} us  {gbs:6.0f} GB/s {gbs/ceil:5.1%}  err {err:.2e}", flush=True)

    # the same MoE decode on MXFP4 experts (the official checkpoint's format; TMA path only)
    from dsv4lab.quant.weights import quantize_fp8_block, quantize_mxfp4
    from dsv4lab.quant.stacked import StackedMXFP4

    del w1, w3, w2
    torch.cuda.empty_cache()
    mx = [StackedMXFP4.from_weights([quantize_mxfp4(torch.randn(n, kk, device="cuda") * 0.02) for _ in range(E)])
          for n, kk in ((I, H), (I, H), (H, I))]
    moe_mx = []
    for T in (1, 4):
        x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16) * 0.05
        ids = torch.stack([torch.randperm(E, device="cuda")[:k] for _ in range(T)])
        wt = torch.rand(T, k, device="cuda")
        err = rel_err(moe_decode_triton(x, ids, wt, *mx, 10.0), moe_decode_ref(x, ids, wt, *mx, 10.0))
        t_k = graph_time_us([lambda: moe_decode_triton(x, ids, wt, *mx, 10.0)])
        t_r = do_bench(lambda: moe_decode_ref(x, ids, wt, *mx, 10.0), warmup=2, rep=20) * 1e3
        uniq = len(set(ids.flatten().tolist()))
        gbs = uniq * 3 * (I * H // 2 + I * H // 32) / (t_k * 1e-6) / 1e9
        moe_mx.append(dict(T=T, kernel_us=t_k, torch_ref_us=t_r, unique_experts=uniq, GBps=gbs, frac_copy=gbs / ceil,
                           max_rel_err=err))
        print(f"moe_decode MXFP4 T={T:2d} k=6 ({uniq} distinct experts)  ours {t_k:8.1f} us  ref {t_r:9.1f} us  "
              f"{gbs:6.0f} GB/s {gbs/ceil:5.1%}  err {err:.2e}", flush=True)
    del mx
    torch.cuda.empty_cache()

    # official formats (MXFP4 experts, FP8-block projections): kernel vs dequantise-then-matmul
    from dsv4lab.kernels.linear_official import official_matmul

    official = []
    for fmt, K, N in (("mxfp4", 7168, 3072), ("mxfp4", 3072, 7168), ("fp8_block", 7168, 1536), ("fp8_block", 16384, 7168)):
        mk_w = quantize_mxfp4 if fmt == "mxfp4" else quantize_fp8_block
        w0 = mk_w(torch.randn(N, K, device="cuda") * 0.02)
        nb = w0.nbytes
        copies = [w0] + [mk_w(torch.randn(N, K, device="cuda") * 0.02) for _ in range(max(1, min(31, -(-400_000_000 // nb) - 1)))]
        xs = {M: torch.randn(M, K, device="cuda", dtype=torch.bfloat16) for M in (1, 16, 128)}
        errs = {M: rel_err(official_matmul(x, w0), F.linear(x, w0.dequantize(torch.bfloat16))) for M, x in xs.items()}
        timed = {}
        for M, x in xs.items():  # ours first, before the dequantised temporaries of the torch path
            t_k = graph_time_us([lambda c=c: official_matmul(x, c) for c in copies])
            t_tiled = (graph_time_us([lambda c=c: official_matmul(x, c, config={"TMA": False}) for c in copies])
                       if fmt == "mxfp4" and M <= 16 else None)  # the tiled kernel the TMA GEMV replaces there
            timed[M] = (t_k, t_tiled)
        for M, x in xs.items():
            t_k, t_tiled = timed[M]
            t_t = graph_time_us([lambda c=c: F.linear(x, c.dequantize(torch.bfloat16)) for c in copies[:4]], reps=5)
            gbs = (nb + M * (K + N) * 2) / (t_k * 1e-6) / 1e9
            official.append(dict(format=fmt, K=K, N=N, batch=M, kernel_us=t_k, torch_us=t_t, GBps=gbs, frac_copy=gbs / ceil,
                                 speedup=t_t / t_k, max_rel_err=errs[M], tiled_us=t_tiled))
            print(f"{fmt:9s} {K:6d}->{N:6d} M={M:4d}  ours {t_k:8.1f} us  torch {t_t:9.1f} us  {gbs:6.0f} GB/s "
                  f"{gbs/ceil:5.1%}  x{t_t/t_k:6.1f}  err {errs[M]:.2e}"
                  + (f"  tiled kernel {t_tiled:.1f} us" if t_tiled else ""), flush=True)
        del copies, w0
        torch.cuda.empty_cache()

    # activation quant
    from dsv4lab.quant.activations import fake_quant_nvfp4, nvfp4_global_scale

    act = []
    for T in (1, 16, 4096):
        x = torch.randn(T, 7168, device="cuda", dtype=torch.bfloat16)
        gs = torch.tensor(0.002, device="cuda")
        exact = torch.equal(nvfp4_act_quant(x, gs)[0], fake_quant_nvfp4(x, gs)) and \
            torch.equal(nvfp4_act_quant(x)[0], fake_quant_nvfp4(x, nvfp4_global_scale(x)))
        t_k = graph_time_us([lambda: nvfp4_act_quant(x, gs)]) * 1e-3
        t_r = do_bench(lambda: fake_quant_nvfp4(x, gs), warmup=3, rep=20)
        act.append(dict(T=T, kernel_us=t_k * 1e3, torch_us=t_r * 1e3, bit_exact=exact))
        print(f"act_quant T={T:5d} x7168  ours {t_k*1e3:8.1f} us  torch {t_r*1e3:9.1f} us  bit-exact {exact}", flush=True)

    b1 = [r for r in rows if r["batch"] == 1 and r["shape"] in LARGE]
    dec = [r for r in rows if r["batch"] <= 16]
    summary = dict(  # over the matmul rows measured (--shapes may select none)
        batch1_large_min_frac=min((r["frac_copy"] for r in b1), default=None),
        batch1_large_ok=all(r["frac_copy"] >= 0.70 for r in b1) if b1 else None,
        faster_than_torch_everywhere=all(r["speedup"] > 1 for r in rows + official),
        decode_faster_than_torch=all(r["speedup"] > 1 for r in dec),
        max_rel_err=max((r["max_rel_err"] for r in rows + official + moe + moe_mx), default=None),
    )
    print(json.dumps(summary), flush=True)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(dict(device=dev, torch=torch.__version__, copy_GBps=ceil,
                                                   matmul=rows, moe=moe, moe_mxfp4=moe_mx, official=official, act_quant=act,
                                                   summary=summary), indent=1))


if __name__ == "__main__":
    main()
