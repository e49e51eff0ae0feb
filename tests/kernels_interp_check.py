"""The Triton kernels through Triton's interpreter on CPU tensors (tiny shapes): run by
tests/test_kernels.py in a subprocess with TRITON_INTERPRET=1, which must be set before triton is
imported. Prints one line ``RESULT{json}`` with what the tests assert on.

    TRITON_INTERPRET=1 python tests/kernels_interp_check.py
"""
import os
import sys
from pathlib import Path

if os.environ.get("TRITON_INTERPRET") != "1":
    sys.exit("run with TRITON_INTERPRET=1 (set before triton is imported)")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import os, json
os.environ["TRITON_INTERPRET"] = "1"
import torch
from dsv4lab.quant.weights import quantize_nvfp4, NVFP4Weight
from dsv4lab.quant.activations import fake_quant_nvfp4, nvfp4_global_scale
from dsv4lab.quant.fp4 import nvfp4_quantize_blocks, pack_fp4
from dsv4lab.kernels.linear_nvfp4 import nvfp4_matmul, nvfp4_matmul_ref
from dsv4lab.kernels.act_quant_nvfp4 import nvfp4_act_quant
from dsv4lab.kernels.moe_decode import moe_decode_triton
from dsv4lab.kernels.moe_decode_ref import moe_decode_ref
from dsv4lab.quant.stacked import StackedNVFP4

res = {}
g = torch.Generator().manual_seed(0)

def rnd(*s):
    return torch.randn(*s, generator=g)

def random_nvfp4(n, k):
    # random codes (all 16, negatives included) and random e4m3 scales incl. subnormal ones
    packed = torch.randint(0, 256, (n, k // 2), generator=g, dtype=torch.uint8)
    sc = (torch.rand(n, k // 16, generator=g) * 4 + 2 ** -9).to(torch.float8_e4m3fn)
    return NVFP4Weight(packed, sc, torch.tensor(0.37))

def err(y, r):
    y, r = y.float(), r.float()
    bad = (y - r).abs() > (1e-2 * r.abs() + 1e-2 * r.abs().max())
    return {"max_abs": (y - r).abs().max().item(), "ref_max": r.abs().max().item(), "bad": int(bad.sum())}

N, K = 40, 96
for name, w in (("quantized", quantize_nvfp4(rnd(N, K) * torch.rand(N, 1, generator=g) * 3)),
                ("random_codes", random_nvfp4(N, K))):
    for M in (1, 2, 3, 20):
        x = rnd(M, K).to(torch.bfloat16)
        ref = nvfp4_matmul_ref(x, w)
        res[f"mm_{name}_M{M}"] = err(nvfp4_matmul(x, w.packed, w.block_scale, w.global_scale), ref)
        if M <= 16:  # split-K fix-up path
            cfg = {"BN": 16, "G": 2 if M == 1 else 16, "SPLIT": 3, "num_warps": 1}
            Kb = 512 if M > 1 else K  # the dot path needs >= 16 groups per split
            w2 = random_nvfp4(N, Kb) if M > 1 else w
            x2 = rnd(M, Kb).to(torch.bfloat16)
            res[f"mm_{name}_M{M}_splitk"] = err(nvfp4_matmul(x2, w2.packed, w2.block_scale, w2.global_scale, config=cfg),
                                              nvfp4_matmul_ref(x2, w2))
        if M == 1:  # the fp32-FMA variant (the default M=1 path is the f16x2 one) and f16x2 with split-K
            for h2, xp, pf in ((False, False, 1), (True, False, 1), (True, True, 1), (True, True, 2)):
                cfg = {"BN": 16, "G": 2, "SPLIT": 3, "num_warps": 1, "H2": h2, "XP": xp, "PF": pf}
                res[f"mm_{name}_M1_h2{h2}_xp{xp}_pf{pf}"] = err(nvfp4_matmul(x, w.packed, w.block_scale, w.global_scale, config=cfg), ref)
        if M > 16:  # prefill GEMM with split-K (3 splits of 32 over K=96)
            cfg = {"BM": 32, "BN": 16, "BK": 32, "SPLIT": 3, "num_warps": 1}
            res[f"mm_{name}_M{M}_gemm_split"] = err(nvfp4_matmul(x, w.packed, w.block_scale, w.global_scale, config=cfg), ref)
    x = rnd(1, K).to(torch.float16)
    res[f"mm_{name}_fp16"] = err(nvfp4_matmul(x, w.packed, w.block_scale, w.global_scale), nvfp4_matmul_ref(x, w))
    x = rnd(2, 3, K)
    res[f"mm_{name}_fp32_3d"] = err(nvfp4_matmul(x, w.packed, w.block_scale, w.global_scale), nvfp4_matmul_ref(x, w))

x = rnd(3, 64) * 3
x[0, :16] *= 1e-3  # a block with a tiny scale
for mode, gs in (("runtime", None), ("input_scale", torch.tensor(0.004)), ("input_scale_small", torch.tensor(1e-4))):
    for dt in (torch.float32, torch.bfloat16):
        xx = x.to(dt)
        y, packed, scale, gsk = nvfp4_act_quant(xx, gs)
        gref = nvfp4_global_scale(xx) if gs is None else gs
        ref = fake_quant_nvfp4(xx, gref)
        codes, sref = nvfp4_quantize_blocks(xx.float().reshape(3, 4, 16), gref)
        res[f"act_{mode}_{str(dt)[6:]}"] = {
            "dq_exact": bool(torch.equal(y, ref)), "dq_rel": ((y.float() - ref.float()).abs() / ref.float().abs().clamp_min(1e-30)).max().item(),
            "nonzero": int((ref != 0).sum()),
            "packed_exact": bool(torch.equal(packed, pack_fp4(codes.reshape(3, 64)))),
            "scale_exact": bool(torch.equal(scale.view(torch.uint8), sref.view(torch.uint8).reshape(3, 4))),
            "gs_exact": bool(torch.equal(gsk.float(), torch.as_tensor(gref).float().reshape(()))),
        }

E, H, I, T, k = 4, 64, 32, 3, 2
mk = lambda n, kk: StackedNVFP4.from_weights([quantize_nvfp4(rnd(n, kk)) for _ in range(E)])
w1, w3, w2 = mk(I, H), mk(I, H), mk(H, I)
x = rnd(T, H).to(torch.bfloat16)
ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
wt = torch.rand(T, k, generator=g)
for lim in (None, 1.5):
    y = moe_decode_triton(x, ids, wt, w1, w3, w2, lim)
    ref = moe_decode_ref(x, ids, wt, w1, w3, w2, lim)
    res[f"moe_lim{lim}"] = {"max_abs": (y.float() - ref.float()).abs().max().item(), "ref_max": ref.abs().max().item()}
# TMA-fed batch-1 GEMV (dsv4lab.kernels.linear_nvfp4_tma): K = 512 -> 32 groups = 2 TMA boxes, N = 40 (a
# partial row tile), x stressing the per-group scaling; and its x-pairs prelude bit-exact
from dsv4lab.kernels.linear_nvfp4_tma import x_pairs
wt = random_nvfp4(40, 512)
for kind in ("bf16", "fp16", "fp32", "outliers", "tiny"):
    x = rnd(1, 512)
    if kind == "outliers":
        x[0, ::97] = 1e4
    elif kind == "tiny":
        x = x * 1e-30
    x = x.to({"fp16": torch.float16, "fp32": torch.float32}.get(kind, torch.bfloat16))
    for split in (1, 2):
        # 1/xs in the pair rows (XINV) without split, through its own pointer with split
        cfg = {"TMA": True, "BN": 16, "STAGES": 2, "SPLIT": split, "num_warps": 1, "XINV": split == 1}
        y = nvfp4_matmul(x, wt.packed, wt.block_scale, wt.global_scale, out_dtype=torch.float32, config=cfg)
        res[f"tma_{kind}_split{split}"] = err(y, nvfp4_matmul_ref(x.float(), wt))
wt2 = random_nvfp4(40, 1024)  # 32-group boxes (cfg G): 64 groups = 2 boxes, split across them
x = rnd(1, 1024).to(torch.bfloat16)
for split in (1, 2):
    cfg = {"TMA": True, "BN": 16, "G": 32, "STAGES": 2, "SPLIT": split, "num_warps": 1, "XINV": split == 1}
    y = nvfp4_matmul(x, wt2.packed, wt2.block_scale, wt2.global_scale, out_dtype=torch.float32, config=cfg)
    res[f"tma_G32_split{split}"] = err(y, nvfp4_matmul_ref(x.float(), wt2))
x = rnd(512).to(torch.bfloat16)
x[:16] *= 1e3
x[16:32] *= 1e-3
xp, inv = x_pairs(x)
xf = x.float().reshape(32, 16)
e = (xf.abs().amax(1).view(torch.int32) >> 23) & 0xFF
b = (268 - e).clamp(1, 253)
xs = (b << 23).view(torch.float32)
h = (xf * xs[:, None]).half().view(torch.int16).to(torch.int32) & 0xFFFF
idx = torch.tensor([0, 4, 1, 5, 8, 12, 9, 13])   # pair 4h + j: elements 8h + (0, 4, 1, 5)[j] and +2
ref_pairs = h[:, idx] | (h[:, idx + 2] << 16)
res["tma_pairs"] = {"pairs_exact": bool(torch.equal(xp[:, :8], ref_pairs)),
                    "inv_exact": bool(torch.equal(inv[:32], ((254 - b) << 23).view(torch.float32)))
                    and bool(torch.equal(xp[:, 8].view(torch.float32), inv[:32]))
                    and inv.numel() == 64 and not bool(inv[32:].any())}   # zeros up to whole INV_PAD boxes
for M in (2, 5, 16):  # the tl.dot loop on the same weight ring
    x = rnd(M, 512).to(torch.bfloat16)
    for split in (1, 2):
        cfg = {"TMA": True, "BN": 16, "STAGES": 2, "SPLIT": split, "num_warps": 1}
        y = nvfp4_matmul(x, wt.packed, wt.block_scale, wt.global_scale, out_dtype=torch.float32, config=cfg)
        res[f"tmadot_M{M}_split{split}"] = err(y, nvfp4_matmul_ref(x.float(), wt))
# two weights of one x in one launch (wq_a + wkv): each output the bits of its own launch; A with 3
# tiles split 2 (a partial tile), B with 2 tiles split 3 (the pair's counters and partials apart)
from dsv4lab.kernels.linear_nvfp4_tma import GemvTmaPlan, pair_fits, run_gemv_tma, run_gemv_tma_pair
wa, wb = random_nvfp4(40, 768), random_nvfp4(32, 768)
xq = rnd(768).to(torch.bfloat16)
plans = [GemvTmaPlan(w.packed, w.block_scale.view(torch.uint8), {"TMA": True, "BN": 16, "STAGES": 2, "SPLIT": sp,
                                                                  "num_warps": 1, "XINV": True}, True, xq.dtype)
         for w, sp in ((wa, 2), (wb, 3))]
gss = [w.global_scale.reshape(1).float() for w in (wa, wb)]
alone = []
for pl, gs in zip(plans, gss):
    alone.append(torch.empty(pl.N, dtype=torch.bfloat16))
    run_gemv_tma(pl, xq, gs, alone[-1])
ya, yb = torch.full((40,), float("nan"), dtype=torch.bfloat16), torch.full((32,), float("nan"), dtype=torch.bfloat16)
run_gemv_tma_pair(plans[0], plans[1], xq, gss[0], gss[1], ya, yb)
other = GemvTmaPlan(wb.packed, wb.block_scale.view(torch.uint8), {"TMA": True, "BN": 32, "STAGES": 2, "SPLIT": 1,
                                                                   "num_warps": 1, "XINV": True}, True, xq.dtype)
res["tma_pair"] = {"a_bitwise": bool(torch.equal(ya, alone[0])), "b_bitwise": bool(torch.equal(yb, alone[1])),
                   "splits": [plans[0].split, plans[1].split], "fits": pair_fits(*plans),
                   "other_tiles_fit": pair_fits(plans[0], other),
                   "a_err": err(ya.float(), nvfp4_matmul_ref(xq[None].float(), wa)[0])}
# grouped (block-diagonal, wo_a) use of the TMA GEMV: 3 row blocks of 32 rows (2 tiles each), each
# times its own x row, in one prelude + one GEMV; and the per-block loop for 2 tokens
from dsv4lab.kernels.linear_nvfp4 import nvfp4_grouped_matmul
from dsv4lab.kernels.linear_nvfp4_tma import launch_gemv_tma
wg = random_nvfp4(96, 512)
xg = rnd(3, 512).to(torch.bfloat16)
xg[1] *= 1e3  # groups of very different size: the prelude scales per 16-group
ref_g = torch.stack([nvfp4_matmul_ref(xg[g:g + 1].float(), NVFP4Weight(wg.packed[32 * g:32 * g + 32],
                     wg.block_scale[32 * g:32 * g + 32], wg.global_scale)) for g in range(3)]).reshape(-1)
for split in (1, 2):
    yg = torch.empty(96, dtype=torch.float32)
    cfg = {"TMA": True, "BN": 16, "STAGES": 2, "SPLIT": split, "num_warps": 1, "XINV": split == 1}
    launch_gemv_tma(xg, wg.packed, wg.block_scale.view(torch.uint8), wg.global_scale.reshape(1), yg, cfg, groups=3)
    res[f"tmagrp_split{split}"] = err(yg, ref_g)
try:
    launch_gemv_tma(xg, wg.packed, wg.block_scale.view(torch.uint8), wg.global_scale.reshape(1), torch.empty(96),
                    {"TMA": True, "BN": 64, "STAGES": 2, "SPLIT": 1, "num_warps": 1}, groups=3)
    res["tmagrp_rejects_partial_tiles"] = False
except ValueError:
    res["tmagrp_rejects_partial_tiles"] = True
# one token of nvfp4_grouped_matmul on CUDA: the plan (descriptors, launch site) is cached per weight
import dsv4lab.kernels.linear_nvfp4 as ln_mod
from dsv4lab.kernels.linear_nvfp4_tma import run_gemv_tma
p1 = ln_mod._grouped_plan(xg[None], wg.packed, wg.block_scale, wg.global_scale, 3)
p2 = ln_mod._grouped_plan(xg[None], wg.packed, wg.block_scale, wg.global_scale, 3)
y1 = torch.empty(96, dtype=torch.bfloat16)
run_gemv_tma(p1.tma, xg.reshape(1, -1), p1.gs if p1.gs is not None else wg.global_scale.reshape(1).float(), y1)
res["grouped_one_token"] = err(y1, ref_g)
res["grouped_one_token_plans"] = {"same": p1 is p2, "other_groups": ln_mod._grouped_plan(
    xg[None], wg.packed, wg.block_scale, wg.global_scale, 6) is not p1}
# the emitting launch (wo_a -> wo_b): y's x_pairs rows written by the GEMV's finishing programs, the
# same bits as an x_pairs launch over y, recorded so that x_pairs(y) launches nothing; split 1 and 2
from dsv4lab.kernels import activation_pairs
from dsv4lab.kernels.linear_nvfp4_tma import GemvTmaPlan, emits_pairs
gs_g = wg.global_scale.reshape(1).float()
for split in (1, 2):
    plan = GemvTmaPlan(wg.packed.view(torch.uint8), wg.block_scale.view(torch.uint8),
                       {"TMA": True, "BN": 16, "STAGES": 2, "SPLIT": split, "num_warps": 1}, True, torch.bfloat16, 3)
    oxp, oinv = activation_pairs.pairs_buffers(6, xg.device)
    oxp.fill_(-1)
    oinv.fill_(7.0)  # stale values the launch must overwrite (rows) or zero (1/xs padding from group 6 to 64)
    ye, yp = torch.empty(96, dtype=torch.bfloat16), torch.empty(96, dtype=torch.bfloat16)
    run_gemv_tma(plan, xg.reshape(1, -1), gs_g, ye, emit=emits_pairs(plan, ye))
    got = (oxp.clone(), oinv.clone())
    recorded = activation_pairs._pairs_record(ye, (6, xg.device, 0)) is not None
    run_gemv_tma(plan, xg.reshape(1, -1), gs_g, yp)
    want = activation_pairs.x_pairs(yp.clone())  # a new tensor: the x_pairs launch writes the same buffers
    res[f"emit_split{split}"] = {"y_bitwise": bool(torch.equal(ye, yp)), "rows": bool(torch.equal(got[0], want[0])),
                                 "inv": bool(torch.equal(got[1], want[1])), "recorded": recorded,
                                 "inv_len": int(got[1].numel()), "emits": emits_pairs(plan, ye),
                                 "refuses_same_size": False}
w_sq = random_nvfp4(256, 256)   # y of 16 groups, x of 16 groups: one kept buffer, read and written
plan_sq = GemvTmaPlan(w_sq.packed.view(torch.uint8), w_sq.block_scale.view(torch.uint8),
                      {"TMA": True, "BN": 16, "STAGES": 2, "SPLIT": 1, "num_warps": 1}, True, torch.bfloat16)
res["emit_split1"]["refuses_same_size"] = not emits_pairs(plan_sq, torch.empty(256, dtype=torch.bfloat16))
x2g = rnd(2, 3, 512).to(torch.bfloat16)
res["grouped_loop"] = err(nvfp4_grouped_matmul(x2g, wg.packed, wg.block_scale, wg.global_scale),
                          torch.stack([nvfp4_matmul_ref(x2g[:, g], NVFP4Weight(wg.packed[32 * g:32 * g + 32],
                                       wg.block_scale[32 * g:32 * g + 32], wg.global_scale)) for g in range(3)], dim=1))
# a prefill of DENSE_MIN_M tokens: the weight dequantised once, the reference's one bmm (bitwise)
from dsv4lab.model.linear import grouped_linear
x512 = rnd(512, 3, 512).to(torch.bfloat16)
y512 = nvfp4_grouped_matmul(x512, wg.packed, wg.block_scale, wg.global_scale)
res["grouped_dense_bitwise"] = bool(torch.equal(y512, grouped_linear(x512, wg.dequantize(torch.bfloat16), 3)))
try:
    nvfp4_matmul(rnd(17, 512).to(torch.bfloat16), wt.packed, wt.block_scale, wt.global_scale,
                 config={"TMA": True, "BN": 16, "STAGES": 2, "SPLIT": 1, "num_warps": 1})
    res["tma_rejects_m17"] = False
except ValueError:
    res["tma_rejects_m17"] = True
# official formats (dsv4lab.kernels.linear_official): MXFP4 (quantised and random codes with exponents
# 2^-20..2^20) and FP8-block (fp32 and E8M0 scales, 2 row blocks, a partial K block)
from dsv4lab.quant.weights import quantize_mxfp4, quantize_fp8_block, MXFP4Weight
from dsv4lab.kernels.linear_official import official_matmul, verified_official_matmul, _VERIFIED
import dsv4lab.kernels.linear_official as om
mx_q = quantize_mxfp4(rnd(40, 512) * torch.rand(40, 1, generator=g) * 3)
mx_r = MXFP4Weight(torch.randint(0, 256, (40, 256), generator=g, dtype=torch.uint8),
                   torch.randint(107, 148, (40, 16), generator=g, dtype=torch.uint8))
fp_a = quantize_fp8_block(rnd(150, 320) * 0.1)
fp_b = quantize_fp8_block(rnd(150, 320) * 30, scale_format="e8m0")
for wname, wq in (("mxq", mx_q), ("mxr", mx_r), ("fp8", fp_a), ("fp8e8m0", fp_b)):
    for M in (1, 3, 20):
        x = rnd(M, wq.shape[1]).to(torch.bfloat16)
        for split in (1, 2):
            y = official_matmul(x, wq, config={"SPLIT": split})  # MXFP4 M <= 16: the TMA GEMV (K % 512 == 0)
            res[f"off_{wname}_M{M}_split{split}"] = err(y, torch.nn.functional.linear(x.float(), wq.dequantize(torch.float32)))
            if wname.startswith("mx") and M <= 16:  # and the tiled MXFP4 kernel it replaces there
                y = official_matmul(x, wq, config={"SPLIT": split, "TMA": False})
                res[f"off_{wname}_M{M}_split{split}_tiled"] = err(y, torch.nn.functional.linear(x.float(), wq.dequantize(torch.float32)))
# MXFP4 through the TMA GEMV over 3 boxes of 32 groups, split 2 (boxes 2 + 1), M = 1 and 4
from dsv4lab.kernels.linear_official import mx_tma_supported
mx_3 = MXFP4Weight(torch.randint(0, 256, (40, 768), generator=g, dtype=torch.uint8),
                   torch.randint(117, 138, (40, 48), generator=g, dtype=torch.uint8))
for M in (1, 4):
    x = rnd(M, 1536).to(torch.bfloat16)
    y = official_matmul(x, mx_3, config={"SPLIT": 2})
    res[f"off_mx3_M{M}_split2"] = err(y, torch.nn.functional.linear(x.float(), mx_3.dequantize(torch.float32)))
res["off_mx_tma_choice"] = [mx_tma_supported(x, mx_3), mx_tma_supported(x, quantize_mxfp4(rnd(24, 1280)))]
# uneven splits: MXFP4 K=1280 (80 words: splits of 32/32/16), FP8 N=130 (a 2-row second row block), K=700
for wname, wq in (("mxodd", quantize_mxfp4(rnd(24, 1280))), ("fp8odd", quantize_fp8_block(rnd(130, 700)))):
    x = rnd(2, wq.shape[1]).to(torch.bfloat16)
    y = official_matmul(x, wq, config={"SPLIT": 3})
    res[f"off_{wname}_M2_split3"] = err(y, torch.nn.functional.linear(x.float(), wq.dequantize(torch.float32)))
x = rnd(2, 512).to(torch.bfloat16)
y = verified_official_matmul(x, mx_q)
res["off_verified_ok"] = {"kept": list(_VERIFIED.values()) == [True], "equal": bool(torch.equal(y, official_matmul(x, mx_q)))}
_VERIFIED.clear()
real = om.official_matmul
om.official_matmul = lambda x, w, config=None: torch.zeros(*x.shape[:-1], w.shape[0], dtype=x.dtype)  # a broken kernel
import warnings
with warnings.catch_warnings(record=True) as wl:
    warnings.simplefilter("always")
    y = verified_official_matmul(x, mx_q)
    y2 = verified_official_matmul(x, mx_q)
om.official_matmul = real
ref = torch.nn.functional.linear(x, mx_q.dequantize(x.dtype))
res["off_verified_guard"] = {"warned": len(wl) == 1, "ref_first": bool(torch.equal(y, ref)), "ref_after": bool(torch.equal(y2, ref)),
                             "state": list(_VERIFIED.values()) == [False]}

# TMA-fed MoE decode (dsv4lab.kernels.moe_decode_tma): H = I = 256 (one TMA box of groups), 4 experts
E, H, I, T, k = 4, 256, 256, 3, 2
w1, w3, w2 = mk(I, H), mk(I, H), mk(H, I)
x = rnd(T, H).to(torch.bfloat16)
ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
wt = torch.rand(T, k, generator=g)
for lim in (None, 1.5):
    y = moe_decode_triton(x, ids, wt, w1, w3, w2, lim, tma=True)
    y2 = moe_decode_triton(x, ids, wt, w1, w3, w2, lim, tma=True)
    ref = moe_decode_ref(x, ids, wt, w1, w3, w2, lim)
    res[f"moetma_lim{lim}"] = {"max_abs": (y.float() - ref.float()).abs().max().item(), "ref_max": ref.abs().max().item(),
                               "repeat_equal": bool(torch.equal(y, y2))}
# the up launch writing h's pairs (I a multiple of the tile) against h + the
# x_pairs prelude: the same bits, one launch fewer (the two-launch schedule: without h's pairs the
# fused one steps back to it, so the default schedule would compare fused with two)
from dsv4lab.kernels import moe_decode_tma as mdt
mdt.SCHEDULE = "two"
from dsv4lab.kernels.launch import LaunchSite
x4 = rnd(4, H).to(torch.bfloat16)
ids4 = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(4)])
wt4 = torch.rand(4, k, generator=g)
counts = {}
real_call = LaunchSite.__call__
LaunchSite.__call__ = lambda site, *a: (counts.__setitem__(mdt.EMIT_H_PAIRS, counts.get(mdt.EMIT_H_PAIRS, 0) + 1),
                                        real_call(site, *a))[1]
y_emit = moe_decode_triton(x4, ids4, wt4, w1, w3, w2, 1.5, tma=True)
mdt.EMIT_H_PAIRS = False
y_prelude = moe_decode_triton(x4, ids4, wt4, w1, w3, w2, 1.5, tma=True)
mdt.EMIT_H_PAIRS = True
mdt.SCHEDULE = None
LaunchSite.__call__ = real_call
ref = moe_decode_ref(x4, ids4, wt4, w1, w3, w2, 1.5)
res["moetma_h_pairs"] = {"equal": bool(torch.equal(y_emit, y_prelude)), "launches": [counts[True], counts[False]],
                         "max_abs": (y_emit.float() - ref.float()).abs().max().item(), "ref_max": ref.abs().max().item()}
try:
    moe_decode_triton(rnd(T, 64).to(torch.bfloat16), ids, wt, mk(32, 64), mk(32, 64), mk(64, 32), None, tma=True)
    res["moetma_rejects"] = False
except ValueError:
    res["moetma_rejects"] = True
# the same kernels on MXFP4 stacks (official experts: E8M0 per 32, no global scale): H = I = 512
from dsv4lab.quant.stacked import StackedMXFP4
from dsv4lab.quant.weights import quantize_mxfp4
from dsv4lab.kernels import dispatch
mkx = lambda n, kk: StackedMXFP4.from_weights([quantize_mxfp4(rnd(n, kk) * (1 + e)) for e in range(E)])
H = I = 512
m1, m3, m2 = mkx(I, H), mkx(I, H), mkx(H, I)
x = rnd(2, H).to(torch.bfloat16)
ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(2)])
wt = torch.rand(2, k, generator=g)
y = moe_decode_triton(x, ids, wt, m1, m3, m2, 1.5)
ref = moe_decode_ref(x, ids, wt, m1, m3, m2, 1.5)
res["moetma_mx"] = {"max_abs": (y.float() - ref.float()).abs().max().item(), "ref_max": ref.abs().max().item(),
                    "dispatch_cpu_is_ref": bool(torch.equal(dispatch.moe_decode(x, ids, wt, m1, m3, m2, 1.5), ref))}
try:  # MXFP4 has no pointer-load variant
    moe_decode_triton(x, ids, wt, m1, m3, m2, 1.5, tma=False)
    res["moetma_mx_rejects_pointer"] = False
except ValueError:
    res["moetma_mx_rejects_pointer"] = True
# the shared expert folded into the same two launches (shared=): bitwise the routed call plus a
# one-expert call added in bf16 (the model's routed + shared), near the reference; both formats
from dsv4lab.quant.stacked import stack_one
for fmt, ws, sh in (("nvfp4", (mk(256, 256), mk(256, 256), mk(256, 256)),
                     tuple(stack_one(quantize_nvfp4(rnd(256, 256) * 2)) for _ in range(3))),
                    ("mxfp4", (m1, m3, m2), tuple(stack_one(quantize_mxfp4(rnd(512, 512))) for _ in range(3)))):
    Hs = ws[0].shape[2]
    T2 = 2
    xs = rnd(T2, Hs).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T2)])
    wt = torch.rand(T2, k, generator=g)
    one, ones = torch.zeros(T2, 1, dtype=torch.long), torch.ones(T2, 1)
    y = moe_decode_triton(xs, ids, wt, *ws, 1.5, tma=True, shared=sh)
    parts = moe_decode_triton(xs, ids, wt, *ws, 1.5, tma=True) + moe_decode_triton(xs, one, ones, *sh, 1.5, tma=True)
    ref = moe_decode_ref(xs, ids, wt, *ws, 1.5) + moe_decode_ref(xs, one, ones, *sh, 1.5)
    launches = []
    from dsv4lab.kernels.launch import LaunchSite
    real_call = LaunchSite.__call__
    LaunchSite.__call__ = lambda site, *a: (launches.append(site.kernel.fn.__name__), real_call(site, *a))[1]
    moe_decode_triton(xs, ids, wt, *ws, 1.5, tma=True, shared=sh)
    LaunchSite.__call__ = real_call
    launches = [n for n in launches if n != "_x_pairs_kernel"]  # the activations' pair preludes
    res[f"moe_shared_{fmt}"] = {"equal_parts": bool(torch.equal(y, parts)), "max_abs": (y.float() - ref.float()).abs().max().item(),
                                "ref_max": ref.abs().max().item(), "launches": launches,
                                "dispatch_cpu_is_ref": bool(torch.equal(dispatch.moe_decode(xs, ids, wt, *ws, 1.5, shared=sh), ref))}
try:
    moe_decode_triton(xs, ids, wt, *ws, 1.5, tma=True, shared=sh[:2])
    res["moe_shared_rejects"] = False
except ValueError as e:
    res["moe_shared_rejects"] = "one-expert stacks" in str(e)
print("RESULT" + json.dumps(res))
