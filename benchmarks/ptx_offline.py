"""Offline sm_90 PTX of the installed kernel variants, no GPU needed: every launch the kernels make
for the H200 decode/prefill shapes (132 SMs) is compiled through a stand-in driver and its PTX
hashed without debug sections and line info, so a refactor can be checked for unchanged code.

    python benchmarks/ptx_offline.py out.json                 # current layout (dsv4lab.kernels)
    python benchmarks/ptx_offline.py old.json --layout OLD    # the pre-move top-level ``kernels``
"""
import argparse
import hashlib
import importlib
import json
import os
import re
import sys
from pathlib import Path

import torch
import triton  # a benchmark script: triton is required here
from triton.backends.compiler import GPUTarget
from triton.runtime import jit as tjit

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ["DSV4LAB_DIRECT_LAUNCH"] = "0"  # every launch through the patched run(): it records the PTX
_ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
_ap.add_argument("out")
_ap.add_argument("--layout", choices=("NEW", "OLD"), default="NEW")
_args = _ap.parse_args()
LAYOUT = _args.layout
OUT = _args.out
P = "kernels." if LAYOUT == "OLD" else "dsv4lab.kernels."
NAMES = {"OLD": {"lin": "nvfp4_matmul", "tma": "nvfp4_gemv_tma", "off": "official_matmul", "moe": "moe_decode",
                 "moetma": "moe_decode_tma", "aq": "nvfp4_act_quant"},
         "NEW": {"lin": "linear_nvfp4", "tma": "linear_nvfp4_tma", "off": "linear_official", "moe": "moe_decode",
                 "moetma": "moe_decode_tma", "aq": "act_quant_nvfp4"}}[LAYOUT]


class StandInDriver:  # what JITFunction.run asks of the driver, for an H200 that is not here
    def get_current_target(self): return GPUTarget("cuda", 90, 32)
    def get_current_device(self): return 0
    def get_current_stream(self, device=None): return 0
    def get_active_torch_device(self): return torch.device("cpu")


triton.runtime.driver.set_active(StandInDriver())
PTX = {}
_run = tjit.JITFunction.run


def run(self, *args, grid, warmup, **kwargs):
    k = _run(self, *args, grid=grid, warmup=True, **kwargs)
    ptx = k.asm["ptx"]
    ptx = ptx.split("\t.section\t.debug")[0]
    ptx = "\n".join(l for l in ptx.splitlines() if not l.strip().startswith((".loc", ".file", "//", "$L__")) and l.strip())
    ptx = re.sub(r"\$L__\w+", "L", ptx)
    PTX[CASE + ":" + self.__name__ + ":" + str(len(PTX))] = hashlib.sha1(ptx.encode()).hexdigest()
    return k


tjit.JITFunction.run = run
mods = {k: importlib.import_module(P + v) for k, v in NAMES.items()}
for m in list(sys.modules.values()):
    for attr in ("_num_sms", "num_sms"):
        if getattr(m, "__name__", "").startswith(P.rstrip(".")) and hasattr(m, attr):
            setattr(m, attr, lambda device: 132)
from dsv4lab.quant.weights import MXFP4Weight, FP8BlockWeight  # noqa: E402

lin, tma, off, moe, moetma, aq = (mods[k] for k in ("lin", "tma", "off", "moe", "moetma", "aq"))
dev = torch.device("cpu")
SHAPES = [("expert", 7168, 3072), ("expert_w2", 3072, 7168), ("q_a", 7168, 1536), ("q_b", 1536, 65536),
          ("wkv", 7168, 512), ("o_b", 16384, 7168), ("lm_head", 7168, 129280)]


def nv(N, K):
    return (torch.zeros(N, K // 2, dtype=torch.uint8), torch.zeros(N, K // 16, dtype=torch.uint8).view(torch.float8_e4m3fn),
            torch.ones(1))


CASE = ""
for name, K, N in SHAPES:
    p, s, gs = nv(N, K)
    s8 = s.view(torch.uint8)
    for M in (1, 4):
        CASE = f"{name}/M{M}"
        x = torch.zeros(M, K, dtype=torch.bfloat16)
        y = torch.empty(M, N, dtype=torch.bfloat16)
        tma.launch_gemv_tma(x, p, s8, gs, y, tma.tma_default_config(N, K, dev, M))      # installed on sm_90
        lin._launch_gemv(x, p, s8, gs, y, lin.default_config(M, N, K, dev))             # pre-sm_90 / unaligned
    CASE = f"{name}/M128"
    if name != "lm_head":
        x = torch.zeros(128, K, dtype=torch.bfloat16)
        lin._launch_gemm(x, p, s8, gs, torch.empty(128, N, dtype=torch.bfloat16), lin.gemm_config(128, N, K, dev))
# MoE
H, I, E, k = 7168, 3072, 16, 6
Snv = getattr(moe, "StackedNVFP4", None)
if Snv is None:
    from dsv4lab.quant.stacked import StackedNVFP4 as Snv, StackedMXFP4 as Smx
else:
    Smx = moe.StackedMXFP4
mk = lambda N, K: Snv(torch.zeros(E, N, K // 2, dtype=torch.uint8), torch.zeros(E, N, K // 16, dtype=torch.uint8).view(torch.float8_e4m3fn), torch.ones(E))
mkx = lambda N, K: Smx(torch.zeros(E, N, K // 2, dtype=torch.uint8), torch.zeros(E, N, K // 32, dtype=torch.uint8))
ids = torch.zeros(k, dtype=torch.int32)
wts = torch.ones(k)
x = torch.zeros(1, H, dtype=torch.bfloat16)
CASE = "moe_tma_nv"
moetma.moe_decode_tma(x, ids, wts, mk(I, H), mk(I, H), mk(H, I), 10.0, k)
CASE = "moe_tma_mx"
moetma.moe_decode_tma(x, ids, wts, mkx(I, H), mkx(I, H), mkx(H, I), 10.0, k)
CASE = "moe_ptr_nv"
moe.moe_decode_triton(x, ids.view(1, k), wts.view(1, k), mk(I, H), mk(I, H), mk(H, I), 10.0, tma=False)
# official formats
off.supported = lambda x, w: True
for fmt, K, N in (("mxfp4", 7168, 3072), ("mxfp4", 3072, 7168), ("fp8_block", 7168, 1536), ("fp8_block", 16384, 7168)):
    for M in (1, 4, 128):
        CASE = f"{fmt}/{K}x{N}/M{M}"
        xx = torch.zeros(M, K, dtype=torch.bfloat16)
        if fmt == "mxfp4":
            w = MXFP4Weight(torch.zeros(N, K // 2, dtype=torch.uint8), torch.zeros(N, K // 32, dtype=torch.uint8).view(torch.float8_e8m0fnu))
            if M <= 16:
                off._mx_decode_tma(xx, w, torch.empty(M, N, dtype=torch.bfloat16), {})
        else:
            w = FP8BlockWeight(torch.zeros(N, K, dtype=torch.float8_e4m3fn), torch.ones(N // 128, K // 128))
        off.official_matmul(xx, w, {"TMA": False})
# prefill GEMM (sm_90+, M >= 64; stand-in tensors are on the CPU, so call the launcher directly)
gemm = importlib.import_module(P + "linear_gemm") if LAYOUT == "NEW" else None
if gemm is not None:
    gemm.num_sms = lambda device: 132
    for name, K, N in SHAPES:
        if name == "lm_head":
            continue
        for M in (128, 4096):
            xx = torch.zeros(M, K, dtype=torch.bfloat16)
            yy = torch.empty(M, N, dtype=torch.bfloat16)
            for fmt in ("nvfp4", "mxfp4", "fp8_block"):
                CASE = f"gemm/{name}/{fmt}/M{M}"
                if fmt == "fp8_block":
                    d, sc, g1 = torch.zeros(N, K, dtype=torch.uint8), torch.ones((N + 127) // 128, K // 128), None
                else:
                    d = torch.zeros(N, K // 2, dtype=torch.uint8)
                    sc, g1 = torch.zeros(N, K // (16 if fmt == "nvfp4" else 32), dtype=torch.uint8), torch.ones(1)
                gemm.launch_gemm(xx, fmt, d, sc, g1, yy)
    mp = importlib.import_module(P + "moe_prefill")
    for fmt, mkw in (("nv", mk), ("mx", mkx)):
        CASE = f"moe_prefill_{fmt}"
        T = 256
        ids_p = torch.arange(T * k).remainder(E).view(T, k)
        mp.moe_prefill_triton(torch.zeros(T, H, dtype=torch.bfloat16), ids_p, torch.ones(T, k), mkw(I, H), mkw(I, H),
                              mkw(H, I), 10.0)
if LAYOUT == "NEW":  # the router's gate GEMV and route as one launch (V4-Pro: 384 experts x 7168, top-6)
    from dsv4lab.kernels.gate_route import gate_route_triton  # noqa: E402

    for T in (1, 4):
        CASE = f"gate_route/T{T}"
        gx, gw = torch.zeros(T, 7168, dtype=torch.bfloat16), torch.zeros(384, 7168, dtype=torch.bfloat16)
        gate_route_triton(gx, gw, 6, "sqrtsoftplus", 2.5, torch.zeros(384))
        gate_route_triton(gx, gw, 6, "sqrtsoftplus", 2.5, None, torch.zeros(16, 6, dtype=torch.long),
                          torch.zeros(1, T, dtype=torch.long))
CASE = "act_quant"
aq.nvfp4_act_quant(torch.zeros(4, 7168, dtype=torch.bfloat16))
if LAYOUT == "NEW":  # mHC sites (hc 4, hidden 7168): decode batches and one prefill chunk
    mhc = importlib.import_module(P + "mhc_fused")
    for T in (1, 4, 64):
        CASE = f"mhc/T{T}"
        hs = torch.zeros(T, 1, 4, 7168, dtype=torch.bfloat16)
        mhc.hc_pre(hs, torch.zeros(24, 4 * 7168), torch.zeros(24), torch.ones(3), 20, 1e-6, 1e-6)
        mhc.hc_head_pre(hs, torch.zeros(4, 4 * 7168), torch.zeros(4), torch.ones(1), 1e-6, 1e-6)
        mhc.hc_post(hs, torch.zeros(T, 1, 7168, dtype=torch.bfloat16), torch.zeros(T, 1, 4), torch.zeros(T, 1, 4, 4))
        if mhc.post_pre_fits(hs):  # the attn expansion and the ffn pre as one launch (batch-1 decode)
            mhc.hc_post_pre(hs, torch.zeros(T, 1, 7168, dtype=torch.bfloat16), torch.zeros(T, 1, 4),
                            torch.zeros(T, 1, 4, 4), torch.zeros(24, 4 * 7168), torch.zeros(24), torch.ones(3), 20,
                            1e-6, 1e-6, block_norm_weight=torch.ones(7168, dtype=torch.bfloat16), block_norm_eps=1e-6)

if LAYOUT == "NEW":  # the compressor decode step: attention CSA (ratio 4) / HCA (128) at d 512, indexer d 128
    from dsv4lab.kernels.compressor_decode import compressor_decode_triton  # noqa: E402

    for kind, d, m, ov in (("csa", 512, 4, True), ("hca", 512, 128, False), ("indexer", 128, 4, True)):
        CASE = f"compressor_decode/{kind}"
        c, bf = 2 if ov else 1, torch.bfloat16
        compressor_decode_triton(torch.zeros(1, 1, c * d, dtype=bf), torch.zeros(1, 1, c * d, dtype=bf),
                                 torch.zeros((), dtype=torch.long), torch.zeros(1, c * m, c * d, dtype=bf),
                                 torch.zeros(1, c * m, c * d), torch.zeros(1, 16, d, dtype=bf),
                                 torch.zeros(m, c * d, dtype=bf), torch.zeros(d, dtype=bf), torch.zeros(32), 1e-6, ov)
json.dump(PTX, open(OUT, "w"), indent=0, sort_keys=True)
print(len(PTX), "launches", len(set(PTX.values())), "distinct PTX")
