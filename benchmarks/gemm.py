"""Prefill GEMM benchmark (CUDA): the W4A16 GEMM of ``dsv4lab.kernels.linear_gemm`` per V4-Pro
shape and weight format at M = 128 and 4096 (its two tiers apart at M >= 64: the Triton GEMM and
dequantise + cuBLAS, ``dequant_gemm``) against cuBLAS BF16 (``F.linear`` on a dense bf16
weight of the same shape, timed in the same run) and the path it replaced (``TILED=True``: the
older tiled NVFP4 GEMM / official-format kernels); then the grouped routed-experts prefill
(``dsv4lab.kernels.moe_prefill``) at 4096 tokens, top-6, against the per-expert reference.

Per row: kernel us and TFLOP/s, cuBLAS us and TFLOP/s, kernel / cuBLAS (at M <= 256 also both
replayed from a CUDA graph: eagerly such a call is host-bound), the old path's us and the speedup over it, max |y - ref| / max |ref| against dequantise + ``F.linear``. ``--sweep`` also
times a few tile variants per (shape, format, M) and prints the fastest (the fixed rule in
``gemm_tiles`` comes from such a sweep). Timing: ``triton.testing.do_bench`` (median, L2 flushed
between runs by do_bench).

    python3 benchmarks/gemm.py --json $OUT/gemm_h200.json
    python3 benchmarks/gemm.py --sweep --json $OUT/gemm_sweep.json
    python3 benchmarks/gemm.py --moe-phases --formats nvfp4 --experts 8 --json $OUT/moe_phases.json
    python3 benchmarks/gemm.py --dequant --sweep --json $OUT/dequant.json   # the dense tier's dequantiser
    python3 benchmarks/gemm.py --cpu-smoke        # tiny shapes through the interpreter (tested)
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

SMOKE = "--cpu-smoke" in sys.argv
if SMOKE:  # before triton is imported
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from dsv4lab.quant.stacked import stack_experts  # noqa: E402
from dsv4lab.quant.weights import FP8BlockWeight, MXFP4Weight, NVFP4Weight  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
SHAPES = {"q_a": (7168, 1536), "q_b": (1536, 65536), "o_b": (16384, 7168), "wkv": (7168, 512),
          "w1/w3": (7168, 3072), "w2": (3072, 7168)}  # name -> (K, N)
SMOKE_SHAPES = {"tiny": (256, 96)}
# variants merged over the rule's tiles (gemm_tiles) for --sweep: the 2026-12-03 rule came from a
# sweep of whole tiles (kernels/h200_gemm_sweep_tiles.json); these probe around it
SWEEP = [{"STAGES": 4}, {"GROUP_M": 4}, {"GROUP_M": 16}, {"WORDS": True}, {"BK": 128, "STAGES": 2}, {"BK": 64},
         {"BN": 64, "num_warps": 4}, {"BM": 128}, {"BM": 128, "BN": 256}, {"SWAP": False, "BM": 128, "BN": 256}]


def rand_weight(fmt: str, N: int, K: int, dev, seed: int):
    g = torch.Generator(device=dev).manual_seed(seed)
    if fmt == "fp8_block":
        codes = torch.randint(0, 256, (N, K), generator=g, dtype=torch.uint8, device=dev)
        codes[(codes & 0x7F) == 0x7F] = 0x3C
        return FP8BlockWeight(codes.view(torch.float8_e4m3fn),
                              torch.rand((N + 127) // 128, K // 128, generator=g, device=dev) * 0.01 + 1e-5)
    packed = torch.randint(0, 256, (N, K // 2), generator=g, dtype=torch.uint8, device=dev)
    if fmt == "mxfp4":
        return MXFP4Weight(packed, torch.randint(118, 124, (N, K // 32), generator=g, dtype=torch.uint8,
                                                 device=dev).view(torch.float8_e8m0fnu))
    sc = (torch.rand(N, K // 16, generator=g, device=dev) * 4 + 2 ** -9).to(torch.float8_e4m3fn)
    return NVFP4Weight(packed, sc, torch.tensor(0.021, device=dev))


def timed(fn, dev) -> float:
    """Median microseconds (do_bench on CUDA; one call on the CPU smoke)."""
    if dev.type != "cuda":
        fn()
        return float("nan")
    from triton.testing import do_bench  # lazy: heavy optional dependency
    return do_bench(fn, warmup=10, rep=50) * 1e3


def timed_graph(fn, dev) -> float:
    """Median microseconds of ``fn`` replayed from a CUDA graph: the GPU time without the host's
    launch cost, which bounds a small-M call timed eagerly (NaN off CUDA)."""
    if dev.type != "cuda":
        return float("nan")
    from triton.testing import do_bench  # lazy: heavy optional dependency
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return do_bench(graph.replay, warmup=10, rep=50) * 1e3


def matmul(x, w, cfg):
    """The kernel entry points with a config (``TILED=True``: the older kernels)."""
    from dsv4lab.kernels.linear_nvfp4 import nvfp4_matmul  # lazy: imports triton
    from dsv4lab.kernels.linear_official import official_matmul

    if w.format == "nvfp4":
        return nvfp4_matmul(x, w.packed, w.block_scale, w.global_scale, config=cfg)
    return official_matmul(x, w, config=cfg)


def gemm_row(name, fmt, K, N, M, dev, sweep: bool) -> dict:
    w = rand_weight(fmt, N, K, dev, seed=M + N)
    x = torch.randn(M, K, device=dev).to(torch.bfloat16)
    dense = w.dequantize(torch.bfloat16)
    ref = F.linear(x, dense)
    y = matmul(x, w, None)
    flop = 2 * M * N * K
    t_k = timed(lambda: matmul(x, w, None), dev)
    t_b = timed(lambda: F.linear(x, dense), dev)
    row = {"shape": name, "format": fmt, "M": M, "K": K, "N": N,
           "max_err_over_max_ref": float((y.float() - ref.float()).abs().max() / ref.float().abs().max()),
           "kernel_us": t_k, "kernel_TFLOPs": flop / t_k / 1e6, "cublas_bf16_us": t_b,
           "cublas_bf16_TFLOPs": flop / t_b / 1e6, "of_cublas": t_b / t_k}
    if M >= 64:  # both prefill tiers whatever the dispatcher picks: where dequantise + cuBLAS wins
        tiers = [("triton", {"DENSE": False, "WGMMA": False}), ("dense", {"DENSE": True})]
        sm90 = dev.type == "cuda" and torch.cuda.get_device_capability(dev) >= (9, 0)
        if fmt != "fp8_block" and M < 512 and sm90:  # the Gluon async-wgmma tier (linear_gemm_wgmma)
            tiers.append(("wgmma", {"DENSE": False, "WGMMA": True}))
        for tier, c in tiers:
            t = timed(lambda: matmul(x, w, c), dev)
            row.update({f"{tier}_us": t, f"{tier}_of_cublas": t_b / t})
    if M <= 256:  # eager timing of a small M is the host's launch cost: also time the GPU alone
        g_k, g_b = timed_graph(lambda: matmul(x, w, None), dev), timed_graph(lambda: F.linear(x, dense), dev)
        row.update(kernel_graph_us=g_k, cublas_bf16_graph_us=g_b, of_cublas_graph=g_b / g_k)
    if M <= 256 or dev.type != "cuda":  # the old path at 4096 takes long and is not the comparison asked for
        t_o = timed(lambda: matmul(x, w, {"TILED": True}), dev)
        row.update(old_us=t_o, speedup_over_old=t_o / t_k)
    if sweep and dev.type == "cuda":
        from dsv4lab.kernels.linear_gemm import gemm_tiles  # lazy: imports triton

        base = gemm_tiles(fmt, M, N, K, dev)
        best = (t_k, base)
        tried = []
        for c in SWEEP:
            cfg = {**base, **c}
            if K % cfg["BK"]:
                continue
            try:
                ok = float((matmul(x, w, cfg).float() - ref.float()).abs().max() / ref.float().abs().max()) < 2e-2
                t = timed(lambda: matmul(x, w, cfg), dev) if ok else float("inf")
            except Exception as e:  # a config that does not fit (shared memory, registers) is skipped
                t = float("inf")
                print(f"  skip {cfg}: {type(e).__name__}", file=sys.stderr)
            tried.append({"variant": c, "us": t})
            if t < best[0]:
                best = (t, cfg)
        row.update(sweep_best_us=best[0], sweep_best=best[1], sweep_tried=tried)
    del dense
    return row


DEQUANT_SHAPES = {"w1/w3": (7168, 3072), "q_b": (1536, 65536), "o_b": (16384, 7168)}
DEQUANT_VARIANTS = [{"BN": bn, "BK": bk, "WORDS": wd, "num_warps": nw} for bn, bk in ((32, 128), (64, 128), (128, 64),
                    (64, 256), (128, 128)) for wd in (False, True) for nw in (4, 8)]


def copy_GBps(nbytes: int, dev) -> float:
    """Read + written GB/s of a device copy of ``nbytes`` (the ceiling of a one-pass kernel)."""
    a = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=dev)
    b = torch.empty_like(a)
    return 2 * nbytes / timed(lambda: b.copy_(a), dev) / 1e3


def dequant_rows_bench(fmt, name, K, N, dev, sweep: bool) -> dict:
    """``dequant_gemm.dequantize_rows`` of one [N, K] weight to bf16: GB/s read + written against a
    copy of the bf16 bytes in the same run; with ``sweep`` each of DEQUANT_VARIANTS (checked equal)."""
    from dsv4lab.kernels.dequant_gemm import DEQUANT_TILES, dequantize_rows  # lazy: imports triton

    w = rand_weight(fmt, N, K, dev, seed=N)
    if fmt == "nvfp4":
        args = ("nvfp4", w.packed, w.block_scale, w.global_scale.reshape(1).float())
    elif fmt == "mxfp4":
        args = ("mxfp4", w.packed, w.scale, None)
    else:
        args = ("fp8_block", w.data, w.scale_float().contiguous(), None)
    moved = sum(t.numel() * t.element_size() for t in args[1:3]) + N * K * 2
    out = torch.empty(N, K, dtype=torch.bfloat16, device=dev)
    ref = dequantize_rows(*args, 0, N, torch.bfloat16)
    ceiling = copy_GBps(N * K * 2, dev)
    row = {"shape": name, "format": fmt, "K": K, "N": N, "bytes_moved": moved, "copy_GBps": ceiling}
    for c in [DEQUANT_TILES] + (DEQUANT_VARIANTS if sweep else []):
        try:
            ok = torch.equal(dequantize_rows(*args, 0, N, torch.bfloat16, out=out, cfg=c), ref)
            us = timed(lambda: dequantize_rows(*args, 0, N, torch.bfloat16, out=out, cfg=c), dev) if ok else float("inf")
        except Exception as e:  # a tile that does not fit is skipped
            print(f"  skip {c}: {type(e).__name__}", file=sys.stderr)
            continue
        row.setdefault("variants", []).append({"cfg": c, "us": us, "GBps": moved / us / 1e3, "of_copy": moved / us / 1e3 / ceiling})
    row["default_us"], row["default_of_copy"] = row["variants"][0]["us"], row["variants"][0]["of_copy"]
    best = min(row["variants"], key=lambda v: v["us"])
    row["best"] = best
    return row


MOE_SWEEP = [{"BM": 128}, {"BM": 128, "BK": 64}, {"BM": 256, "BK": 64}, {"BM": 256, "BK": 64, "num_warps": 4}]


MOE_PHASE_TILES = [{"BN": bn, "BK": bk, "STAGES": st, "num_warps": nw}
                   for bn in (64, 128, 256) for bk in (64, 128) for st in (3, 4) for nw in (4, 8)
                   if not (bn == 256 and nw == 4)]


def moe_inputs(fmt, T, E, k, H, I, dev) -> tuple:
    """Seeded random expert stacks (w1, w3, w2), tokens x [T, H] bf16, top-k ids and weights [T, k]."""
    w1 = stack_experts([rand_weight(fmt, I, H, dev, 10 + e) for e in range(E)])
    w3 = stack_experts([rand_weight(fmt, I, H, dev, 1000 + e) for e in range(E)])
    w2 = stack_experts([rand_weight(fmt, H, I, dev, 2000 + e) for e in range(E)])
    g = torch.Generator(device=dev).manual_seed(0)
    x = (torch.randn(T, H, device=dev, generator=g) * 0.05).to(torch.bfloat16)
    ids = torch.rand(T, E, device=dev, generator=g).topk(k, dim=-1).indices
    return w1, w3, w2, x, ids, torch.rand(T, k, device=dev, generator=g)


def moe_phase_sweep(fmt, T, E, k, H, I, dev, limit=10.0, bms=(64, 128, 256), tiles=None) -> list[dict]:
    """The up (w1 + w3, SwiGLU) and down (w2) grouped GEMMs timed apart per (BM, tiles), each
    checked against the default tiles' output; TFLOP/s of each."""
    from dsv4lab.kernels.moe_prefill import expert_schedule, grouped_gemm  # lazy: imports triton

    w1, w3, w2, x, ids, _ = moe_inputs(fmt, T, E, k, H, I, dev)
    rows = []
    for bm in bms:
        sched = expert_schedule(ids, E, bm)
        h_ref = grouped_gemm(x, sched, True, w1, w3, limit, None, {"BM": bm})  # each GEMM's own rule otherwise
        y_ref = grouped_gemm(h_ref, sched, False, w2, cfg={"BM": bm})
        phases = {"up": (lambda c: grouped_gemm(x, sched, True, w1, w3, limit, None, c), h_ref, 2 * 2 * T * k * H * I, H),
                  "down": (lambda c: grouped_gemm(h_ref, sched, False, w2, cfg=c), y_ref, 2 * T * k * H * I, I)}
        for phase, (run, ref, flop, K) in phases.items():
            for t in tiles or MOE_PHASE_TILES:
                c = {**t, "BM": bm}
                if K % c["BK"]:
                    continue
                try:
                    ok = float((run(c).float() - ref.float()).abs().max() / ref.float().abs().max()) < 2e-2
                    us = timed(lambda: run(c), dev) if ok else float("inf")
                    r = {"phase": phase, "cfg": c, "us": us, "TFLOPs": flop / us / 1e6, "agrees": ok}
                except Exception as e:  # a tile that does not fit (shared memory, registers) is skipped
                    r = {"phase": phase, "cfg": c, "error": f"{type(e).__name__}: {str(e)[:120]}"}
                print(json.dumps(r), flush=True)
                rows.append(r)
    return rows


def grouped_wgmma_ok(x, w1, w3, w2) -> bool:
    """The Gluon grouped GEMMs run here (sm_90, a triton with Gluon)."""
    from dsv4lab.kernels import moe_prefill  # lazy: imports triton

    return moe_prefill.grouped_wgmma_supported is not None and moe_prefill.grouped_wgmma_supported(x, w1, w3, w2)


def moe_row(fmt, T, E, k, H, I, dev, limit=10.0, sweep: bool = False) -> dict:
    from dsv4lab.kernels.moe_prefill import moe_prefill_triton  # lazy: imports triton
    from dsv4lab.kernels.moe_prefill_ref import moe_prefill_ref

    w1, w3, w2, x, ids, wt = moe_inputs(fmt, T, E, k, H, I, dev)
    y = moe_prefill_triton(x, ids, wt, w1, w3, w2, limit)
    ref = moe_prefill_ref(x, ids, wt, w1, w3, w2, limit)
    t_k = timed(lambda: moe_prefill_triton(x, ids, wt, w1, w3, w2, limit), dev)
    t_r = timed(lambda: moe_prefill_ref(x, ids, wt, w1, w3, w2, limit), dev)
    tier_cfgs = [("grouped", {"DENSE": False, "WGMMA": False}), ("dense", {"DENSE": True})]
    if dev.type == "cuda" and grouped_wgmma_ok(x, w1, w3, w2):   # the Gluon grouped GEMMs, both tile heights
        tier_cfgs += [("wgmma", {"DENSE": False, "WGMMA": True}),   # WGMMA_DEFAULT: mixed tiles, A in registers
                      ("wgmma_bm64", {"DENSE": False, "WGMMA": True, "BM": 64}),
                      ("wgmma_bm128", {"DENSE": False, "WGMMA": True, "BM": 128}),
                      ("wgmma_smem", {"DENSE": False, "WGMMA": True, "FRAG": False}),   # A through shared memory
                      ("wgmma_smem_bm128", {"DENSE": False, "WGMMA": True, "FRAG": False, "BM": 128})]  # the old default
    tiers = {}
    for tier, c in tier_cfgs:
        yt = moe_prefill_triton(x, ids, wt, w1, w3, w2, limit, cfg=c)
        tiers[f"{tier}_err"] = float((yt.float() - ref.float()).abs().max() / ref.float().abs().max())
        tiers[f"{tier}_us"] = timed(lambda: moe_prefill_triton(x, ids, wt, w1, w3, w2, limit, cfg=c), dev)
    flop = 2 * T * k * 3 * H * I
    variants = []
    if sweep and dev.type == "cuda":
        for c in MOE_SWEEP:
            try:
                yc = moe_prefill_triton(x, ids, wt, w1, w3, w2, limit, cfg=c)
                ok = float((yc.float() - ref.float()).abs().max() / ref.float().abs().max()) < 2e-2
                variants.append({"cfg": c, "us": timed(lambda: moe_prefill_triton(x, ids, wt, w1, w3, w2, limit, cfg=c), dev)
                                 if ok else float("inf")})
            except Exception as e:  # a config that does not fit (shared memory, registers) is skipped
                print(f"  skip {c}: {type(e).__name__}", file=sys.stderr)
    return {"moe_sweep": variants, "moe_prefill": fmt, "tokens": T, "experts": E, "top_k": k, "hidden": H, "inter": I,
            "kernel_us": t_k, "kernel_TFLOPs": flop / t_k / 1e6, "reference_us": t_r, "speedup": t_r / t_k, **tiers,
            "max_err_over_max_ref": float((y.float() - ref.float()).abs().max() / ref.float().abs().max())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--formats", default="nvfp4,mxfp4,fp8_block")
    ap.add_argument("--shapes", default=",".join(SHAPES), help=f"comma list of {', '.join(SHAPES)}")
    ap.add_argument("--m", default="128,4096", help="batch sizes")
    ap.add_argument("--experts", type=int, default=384, help="routed experts in the MoE prefill (fewer if memory)")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--no-moe", dest="moe", action="store_false")
    ap.add_argument("--sweep", action="store_true", help="also time tile variants and report the fastest")
    ap.add_argument("--moe-phases", action="store_true",
                    help="only the MoE prefill's up and down GEMMs, timed apart per tiling (MOE_PHASE_TILES x BM)")
    ap.add_argument("--moe-bm", default="64,128,256", help="token rows per tile tried by --moe-phases")
    ap.add_argument("--dequant", action="store_true",
                    help="only the dense tier's dequantiser per shape and format, GB/s against a copy (--sweep: its tiles)")
    ap.add_argument("--json", type=Path, nargs="?", default=None, const=RESULTS / "gemm.json")
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny shapes through Triton's interpreter (no timing)")
    args = ap.parse_args()
    fmts = [f for f in args.formats.split(",") if f]
    bad = [f for f in fmts if f not in ("nvfp4", "mxfp4", "fp8_block")]
    if bad:
        ap.error(f"--formats: {bad} not in ['fp8_block', 'mxfp4', 'nvfp4']")
    if args.cpu_smoke:
        dev, shapes, ms = torch.device("cpu"), SMOKE_SHAPES, [64, 130]
        moe_args = dict(T=40, E=6, k=3, H=64, I=96)
    else:
        if not torch.cuda.is_available():
            ap.error("needs CUDA (or --cpu-smoke)")
        names = [s for s in args.shapes.split(",") if s]
        unknown = [s for s in names if s not in SHAPES]
        if unknown:
            ap.error(f"--shapes: {unknown} not in {list(SHAPES)}")
        dev, shapes, ms = torch.device("cuda"), {s: SHAPES[s] for s in names}, [int(m) for m in args.m.split(",")]
        moe_args = dict(T=args.tokens, E=args.experts, k=6, H=7168, I=3072)
    if args.dequant:
        dshapes = {"tiny": (256, 96)} if args.cpu_smoke else DEQUANT_SHAPES
        res = {"device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu", "torch": torch.__version__,
               "dequant": [dequant_rows_bench(fmt, name, K, N, dev, args.sweep and dev.type == "cuda")
                           for name, (K, N) in dshapes.items() for fmt in fmts]}
        if args.json is not None:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(res, indent=1) + "\n")
        print("RESULT" + json.dumps(res))
        return
    if args.moe_phases:
        smoke = (dict(bms=(16,), tiles=[{"BN": 32, "BK": 32, "STAGES": 2, "num_warps": 4}]) if args.cpu_smoke
                 else dict(bms=tuple(int(b) for b in args.moe_bm.split(","))))
        res = {"device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu", "torch": torch.__version__,
               "moe_phases": {fmt: moe_phase_sweep(fmt, dev=dev, **moe_args, **smoke) for fmt in fmts if fmt != "fp8_block"}}
        if args.json is not None:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(res, indent=1) + "\n")
        print("RESULT" + json.dumps(res))
        return
    rows = []
    for name, (K, N) in shapes.items():
        for fmt in fmts:
            for M in ms:
                rows.append(gemm_row(name, fmt, K, N, M, dev, args.sweep))
                print(json.dumps(rows[-1]), flush=True)
    moe = []
    if args.moe:
        for fmt in [f for f in fmts if f != "fp8_block"]:
            moe.append(moe_row(fmt, dev=dev, sweep=args.sweep, **moe_args))
            print(json.dumps(moe[-1]), flush=True)
            if dev.type == "cuda":
                torch.cuda.empty_cache()
    res = {"device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu", "torch": torch.__version__,
           "gemm": rows, "moe_prefill": moe}
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(res, indent=1) + "\n")
    print("RESULT" + json.dumps(res))


if __name__ == "__main__":
    main()
