"""Parity of the Triton kernels (kernels/) with the PyTorch references in dsv4lab.quant.

CPU: the kernels run through Triton's interpreter in a subprocess that sets TRITON_INTERPRET=1
before importing triton (tiny shapes; skipped when triton is not installed).
GPU (@pytest.mark.gpu): real V4-Pro shapes, only when CUDA is available.

Tolerances (random inputs, non-trivial scales, negative codes; never zeros):
  * matmul vs dequantise(x.dtype)+F.linear: |y - ref| <= 1e-2*|ref| + 1e-2*max|ref| (bf16 out;
    fp32 accumulate in a different order, weights exact in bf16 on both sides);
  * activation quant: bit-exact (dequantised values, packed codes and e4m3 scales); under the
    interpreter bf16 outputs may differ by 1 bf16 ulp (numpy's bf16 cast), codes/scales exact;
  * MoE decode vs per-expert reference in bf16: |y - ref| <= 2e-2*max|ref| (two bf16 GEMV stages).
"""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
HAVE_TRITON = importlib.util.find_spec("triton") is not None
HAVE_CUDA = torch.cuda.is_available()


def test_dispatch_imports_without_triton_and_uses_reference_on_cpu():
    code = textwrap.dedent("""
        import sys, builtins
        real = builtins.__import__
        def fake(name, *a, **k):
            if name == "triton" or name.startswith("triton."):
                raise ImportError("no triton here")
            return real(name, *a, **k)
        builtins.__import__ = fake
        import torch
        from kernels import dispatch
        from dsv4lab.quant.weights import quantize_nvfp4
        from kernels.moe_decode import StackedNVFP4
        assert not dispatch.have_triton_cuda()
        torch.manual_seed(0)
        w = quantize_nvfp4(torch.randn(32, 64))
        x = torch.randn(2, 64)
        y = dispatch.nvfp4_linear(x, w)
        assert torch.allclose(y, x @ w.dequantize(torch.float32).T, atol=1e-4)
        ws = [quantize_nvfp4(torch.randn(16, 64)) for _ in range(3)]
        w2 = [quantize_nvfp4(torch.randn(64, 16)) for _ in range(3)]
        out = dispatch.moe_decode(x, torch.tensor([[0, 2], [1, 0]]), torch.rand(2, 2), ws, ws, w2, 7.0)
        assert out.shape == (2, 64) and out.abs().sum() > 0
        print("OK", "triton" in sys.modules)
    """)
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                       env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "OK False"


_INTERP_SCRIPT = r"""
import os, json
os.environ["TRITON_INTERPRET"] = "1"
import torch
from dsv4lab.quant.weights import quantize_nvfp4, NVFP4Weight
from dsv4lab.quant.activations import fake_quant_nvfp4, nvfp4_global_scale
from dsv4lab.quant.fp4 import nvfp4_quantize_blocks, pack_fp4
from kernels.nvfp4_matmul import nvfp4_matmul, nvfp4_matmul_ref
from kernels.nvfp4_act_quant import nvfp4_act_quant
from kernels.moe_decode import StackedNVFP4, moe_decode_triton, moe_decode_ref

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
# TMA-fed batch-1 GEMV (kernels.nvfp4_gemv_tma): K = 512 -> 32 groups = 2 TMA boxes, N = 40 (a
# partial row tile), x stressing the per-group scaling; and its x-pairs prelude bit-exact
from kernels.nvfp4_gemv_tma import x_pairs
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
                    "inv_exact": bool(torch.equal(inv, ((254 - b) << 23).view(torch.float32)))
                    and bool(torch.equal(xp[:, 8].view(torch.float32), inv))}
for M in (2, 5, 16):  # the tl.dot loop on the same weight ring
    x = rnd(M, 512).to(torch.bfloat16)
    for split in (1, 2):
        cfg = {"TMA": True, "BN": 16, "STAGES": 2, "SPLIT": split, "num_warps": 1}
        y = nvfp4_matmul(x, wt.packed, wt.block_scale, wt.global_scale, out_dtype=torch.float32, config=cfg)
        res[f"tmadot_M{M}_split{split}"] = err(y, nvfp4_matmul_ref(x.float(), wt))
try:
    nvfp4_matmul(rnd(17, 512).to(torch.bfloat16), wt.packed, wt.block_scale, wt.global_scale,
                 config={"TMA": True, "BN": 16, "STAGES": 2, "SPLIT": 1, "num_warps": 1})
    res["tma_rejects_m17"] = False
except ValueError:
    res["tma_rejects_m17"] = True
# official formats (kernels.official_matmul): MXFP4 (quantised and random codes with exponents
# 2^-20..2^20) and FP8-block (fp32 and E8M0 scales, 2 row blocks, a partial K block)
from dsv4lab.quant.weights import quantize_mxfp4, quantize_fp8_block, MXFP4Weight
from kernels.official_matmul import official_matmul, verified_official_matmul, _VERIFIED
import kernels.official_matmul as om
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
from kernels.official_matmul import mx_tma_supported
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

# TMA-fed MoE decode (kernels.moe_decode_tma): H = I = 256 (one TMA box of groups), 4 experts
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
try:
    moe_decode_triton(rnd(T, 64).to(torch.bfloat16), ids, wt, mk(32, 64), mk(32, 64), mk(64, 32), None, tma=True)
    res["moetma_rejects"] = False
except ValueError:
    res["moetma_rejects"] = True
# the same kernels on MXFP4 stacks (official experts: E8M0 per 32, no global scale): H = I = 512
from kernels.moe_decode import StackedMXFP4
from dsv4lab.quant.weights import quantize_mxfp4
from kernels import dispatch
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
from kernels.nvfp4_matmul import decode_probe_selfcheck
res["decode_probe"] = decode_probe_selfcheck("cpu")
print("RESULT" + json.dumps(res))
"""


@pytest.fixture(scope="module")
def interp_results():
    assert HAVE_TRITON, "triton is part of the test set-up (pip install -e '.[kernels]'); the interpreter tests need it"
    r = subprocess.run([sys.executable, "-c", _INTERP_SCRIPT], cwd=ROOT, capture_output=True, text=True,
                       env={**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}, timeout=300)
    assert r.returncode == 0, r.stderr[-4000:]
    line = [l for l in r.stdout.splitlines() if l.startswith("RESULT")][-1]
    return json.loads(line[len("RESULT"):])


def test_interp_decode_probe(interp_results):
    """The M == 1 loop's byte-code decode (its plain-Triton emulation) gives exactly the reference
    E2M1 value for every code at every element position of a word."""
    assert interp_results["decode_probe"] == {"exact": True, "pairs_covered": 256, "nonzero": 3584}


def test_interp_tma_gemv(interp_results):
    """The TMA GEMV (descriptor loads, per-group x scaling, split-K fix-up) through the interpreter."""
    r = {k: v for k, v in interp_results.items() if k.startswith("tma_") and k not in ("tma_pairs", "tma_rejects_m17")}
    assert len(r) == 12  # 5 x kinds x 2 splits + 32-group boxes x 2 splits
    for k, v in r.items():
        assert v["bad"] == 0 and v["ref_max"] > 0, (k, v)
        assert v["max_abs"] <= 2e-3 * v["ref_max"], (k, v)  # fp32 out: only f16 group sums round
    d = {k: v for k, v in interp_results.items() if k.startswith("tmadot_")}
    assert len(d) == 6
    for k, v in d.items():  # bf16 x, exact weights, fp32 accumulate and output: order only
        assert v["bad"] == 0 and v["ref_max"] > 0 and v["max_abs"] <= 1e-4 * v["ref_max"], (k, v)
    assert interp_results["tma_pairs"] == {"pairs_exact": True, "inv_exact": True}
    assert interp_results["tma_rejects_m17"] is True


def test_interp_nvfp4_matmul(interp_results):
    mm = {k: v for k, v in interp_results.items() if k.startswith("mm_")}
    assert len(mm) == 2 * (4 + 3 + 2 + 4 + 1)
    for name, r in mm.items():
        assert r["ref_max"] > 0.1, name
        assert r["bad"] == 0, (name, r)


def test_interp_act_quant_bit_exact(interp_results):
    act = {k: v for k, v in interp_results.items() if k.startswith("act_")}
    assert len(act) == 6
    for name, r in act.items():
        assert r["nonzero"] > 100, name
        assert r["packed_exact"] and r["scale_exact"] and r["gs_exact"], (name, r)
        # fp32: bit-exact. bf16: the interpreter's numpy bf16 cast is not RNE, so allow 1 bf16 ulp
        # here; the GPU test requires bit-exact bf16 too.
        assert r["dq_exact"] if name.endswith("float32") else r["dq_rel"] <= 2 ** -7, (name, r)


def test_interp_official_formats(interp_results):
    """MXFP4 and FP8-block kernels (decode and prefill tiles, split K; MXFP4 decode through the TMA
    GEMV with E8M0 scales and through the tiled kernel) and the first-use guard."""
    r = {k: v for k, v in interp_results.items() if k.startswith("off_") and "verified" not in k and "choice" not in k}
    assert len(r) == 4 * 3 * 2 + 2 * 2 * 2 + 2 + 2
    assert interp_results["off_mx_tma_choice"] == [True, False]  # K = 1280 is not a multiple of 512
    for k, v in r.items():  # bf16 x (exact in the dot), exact weights, fp32 accumulate, bf16 out
        assert v["bad"] == 0 and v["ref_max"] > 0, (k, v)
    assert interp_results["off_verified_ok"] == {"kept": True, "equal": True}
    assert interp_results["off_verified_guard"] == {"warned": True, "ref_first": True, "ref_after": True, "state": True}


def test_interp_moe_decode_tma(interp_results):
    for lim in ("None", "1.5"):
        r = interp_results[f"moetma_lim{lim}"]
        assert r["ref_max"] > 0 and r["max_abs"] <= 2e-2 * r["ref_max"], r
        assert r["repeat_equal"], r  # the down kernel's counters were reset; deterministic sum order
    assert interp_results["moetma_rejects"] is True
    r = interp_results["moetma_mx"]  # MXFP4 stacks through the same kernels (32-group boxes, E8M0)
    assert r["ref_max"] > 0 and r["max_abs"] <= 2e-2 * r["ref_max"], r
    assert r["dispatch_cpu_is_ref"] and interp_results["moetma_mx_rejects_pointer"] is True


def test_interp_moe_decode(interp_results):
    for lim in ("None", "1.5"):
        r = interp_results[f"moe_lim{lim}"]
        assert r["ref_max"] > 0.1
        assert r["max_abs"] <= 2e-2 * r["ref_max"], r


# ----------------------------------------------------------------------------- GPU, real shapes
gpu = pytest.mark.skipif(not (HAVE_CUDA and HAVE_TRITON), reason="needs CUDA + triton")

V4_PRO_SHAPES = {  # name: (K=in, N=out)
    "expert_w1": (7168, 3072), "expert_w2": (3072, 7168), "q_a": (7168, 1536), "q_b": (1536, 65536),
    "wkv": (7168, 512), "o_b": (16384, 7168), "lm_head": (7168, 129280),
}


def _rand_nvfp4_cuda(n, k, seed=0):
    from dsv4lab.quant.weights import NVFP4Weight

    g = torch.Generator(device="cuda").manual_seed(seed)
    packed = torch.randint(0, 256, (n, k // 2), generator=g, dtype=torch.uint8, device="cuda")
    sc = (torch.rand(n, k // 16, generator=g, device="cuda") * 4 + 2 ** -9).to(torch.float8_e4m3fn)
    return NVFP4Weight(packed, sc, torch.tensor(0.021, device="cuda"))


def _stress_x(kind: str, K: int, seed: int) -> torch.Tensor:
    """One activation row [1, K] that stresses the f16x2 x scaling: bf16/fp16/fp32 dtypes, a few
    1e4 outliers (bf16), or values of order 1e-30 (bf16)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(1, K, device="cuda", generator=g)
    if kind == "outliers":
        x[0, ::997] = 1e4
    elif kind == "tiny":
        x = x * 1e-30
    return x.to({"fp16": torch.float16, "fp32": torch.float32}.get(kind, torch.bfloat16))


def _close(y, r, rtol=1e-2, atol_frac=1e-2):
    y, r = y.float(), r.float()
    assert r.abs().max() > 0
    bad = (y - r).abs() > rtol * r.abs() + atol_frac * r.abs().max()
    assert int(bad.sum()) == 0, f"{int(bad.sum())} bad, max abs {(y - r).abs().max().item()} ref max {r.abs().max().item()}"


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("name,M", [(n, m) for n in V4_PRO_SHAPES for m in (1, 4, 16, 128)
                                    if not (n == "lm_head" and m == 128)])  # lm_head prefill: covered by smaller shapes
def test_gpu_nvfp4_matmul(name, M):
    from kernels.nvfp4_matmul import nvfp4_matmul, nvfp4_matmul_ref

    K, N = V4_PRO_SHAPES[name]
    w = _rand_nvfp4_cuda(N, K)
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    y = nvfp4_matmul(x, w.packed, w.block_scale, w.global_scale)
    _close(y, nvfp4_matmul_ref(x, w))
    y2 = nvfp4_matmul(x, w.packed, w.block_scale, w.global_scale)  # counters were reset
    _close(y2, nvfp4_matmul_ref(x, w))


@pytest.mark.gpu
@gpu
def test_gpu_decode_probe():
    """The inline PTX of the M == 1 loop (shifts, masks, prmt, fma.rn.f16x2) decodes every code
    at every element position exactly like the reference."""
    from kernels.nvfp4_matmul import decode_probe_selfcheck

    assert decode_probe_selfcheck("cuda") == {"exact": True, "pairs_covered": 256, "nonzero": 3584}


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("h2,xp,pf", [(True, True, 1), (True, True, 2), (True, False, 1), (False, False, 1)])
@pytest.mark.parametrize("xkind", ["bf16", "fp16", "fp32", "outliers", "tiny"])
def test_gpu_m1_inner_loops(h2, xp, pf, xkind):
    """Both M=1 inner loops (f16x2 products with the power-of-two x scaling, and fp32 FMAs) on
    inputs that stress the scaling: fp32/fp16 x, a few 1e4 outliers, and x of order 1e-30."""
    from kernels.nvfp4_matmul import nvfp4_matmul, nvfp4_matmul_ref

    K, N = 7168, 3072
    w = _rand_nvfp4_cuda(N, K, seed=3)
    x = _stress_x(xkind, K, seed=4)
    for split in (1, 8):
        cfg = {"BN": 64, "G": 8, "SPLIT": split, "num_warps": 4, "H2": h2, "XP": xp, "PF": pf}
        _close(nvfp4_matmul(x, w.packed, w.block_scale, w.global_scale, config=cfg), nvfp4_matmul_ref(x, w))


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("bn,stages,split,extra", [(64, 3, 1, {}), (256, 3, 1, {"PDL": True}), (128, 4, 7, {}),
                                                   (256, 4, 10, {"PDL": True}), (64, 4, 3, {"G": 32, "PDL": True}),
                                                   (128, 3, 10, {"PDL": True, "XINV": False}),
                                                   (256, 3, 1, {"XINV": False})])
@pytest.mark.parametrize("xkind", ["bf16", "fp16", "fp32", "outliers", "tiny"])
def test_gpu_tma_gemv(bn, stages, split, extra, xkind):
    """The TMA GEMV's tiles/stages/splits/box widths, with and without programmatic dependent
    launch, on inputs that stress the per-group x scaling; N = 3000 leaves a partial row tile (TMA
    zero-fills it, the store is masked)."""
    from kernels.nvfp4_matmul import nvfp4_matmul, nvfp4_matmul_ref

    if torch.cuda.get_device_capability() < (9, 0):
        pytest.fail("the TMA GEMV needs sm_90+; run the GPU tests on the H200")
    K, N = 7168, 3000
    w = _rand_nvfp4_cuda(N, K, seed=6)
    x = _stress_x(xkind, K, seed=7)
    cfg = {"TMA": True, "BN": bn, "STAGES": stages, "SPLIT": split, "num_warps": 4, **extra}
    for _ in range(2):  # the second call checks that the split counters were reset
        _close(nvfp4_matmul(x, w.packed, w.block_scale, w.global_scale, config=cfg), nvfp4_matmul_ref(x, w))


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("M,bn,split", [(2, 64, 1), (4, 128, 5), (16, 64, 3), (16, 256, 1)])
def test_gpu_tma_dot(M, bn, split):
    """The TMA-fed tl.dot loop (M in 2..16) with split K and a partial row tile."""
    from kernels.nvfp4_matmul import nvfp4_matmul, nvfp4_matmul_ref

    w = _rand_nvfp4_cuda(3000, 7168, seed=9)
    x = torch.randn(M, 7168, device="cuda", dtype=torch.bfloat16)
    cfg = {"TMA": True, "BN": bn, "STAGES": 3, "SPLIT": split, "num_warps": 4}
    for _ in range(2):
        _close(nvfp4_matmul(x, w.packed, w.block_scale, w.global_scale, config=cfg), nvfp4_matmul_ref(x, w))


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("fmt,K,N", [("mxfp4", 7168, 3072), ("mxfp4", 3072, 7168), ("fp8_block", 7168, 1536),
                                     ("fp8_block", 16384, 7168), ("fp8_block", 7168, 1000)])
@pytest.mark.parametrize("M", [1, 4, 16, 128])
def test_gpu_official_formats(fmt, K, N, M):
    """MXFP4 / FP8-block kernels on V4-Pro shapes (plus a partial row block) against the reference,
    and the dispatcher keeping them after its first-use check."""
    from dsv4lab.quant.weights import quantize_fp8_block, quantize_mxfp4
    from kernels import dispatch
    from kernels.official_matmul import _VERIFIED, official_matmul

    g = torch.Generator(device="cuda").manual_seed(11)
    wf = torch.randn(N, K, device="cuda", generator=g) * 0.02
    w = quantize_mxfp4(wf) if fmt == "mxfp4" else quantize_fp8_block(wf, scale_format="e8m0" if N == 1000 else "fp32")
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    ref = torch.nn.functional.linear(x, w.dequantize(torch.bfloat16))
    _close(official_matmul(x, w), ref)
    if fmt == "mxfp4" and M <= 16:  # decode takes the TMA GEMV; the tiled kernel stays correct too
        _close(official_matmul(x, w, config={"TMA": False}), ref)
    _close(dispatch.quant_linear(x, w), ref)
    assert all(v for k, v in _VERIFIED.items() if k[0] == fmt and k[1:3] == (N, K))


@pytest.mark.gpu
@gpu
def test_gpu_m1_path_choice():
    """M=1 takes the TMA GEMV on Hopper for aligned weights and falls back to the pointer-load GEMV
    (still correct) for a weight whose base is not 16-byte aligned or when opted out."""
    from kernels import nvfp4_matmul as nm

    K, N = 3072, 1024
    w = _rand_nvfp4_cuda(N, K, seed=8)
    x = torch.randn(1, K, device="cuda", dtype=torch.bfloat16)
    assert nm._use_tma(x, w.packed, w.block_scale.view(torch.uint8)) == (torch.cuda.get_device_capability() >= (9, 0))
    ref = nm.nvfp4_matmul_ref(x, w)
    buf = torch.empty(N * K // 2 + 8, dtype=torch.uint8, device="cuda")
    for off in (8, 1):  # 8: int64-aligned, not 16 (pointer GEMV); 1: not even int64-aligned (copied once)
        odd = buf[off:off + N * K // 2].view(N, K // 2)
        odd.copy_(w.packed)
        assert odd.data_ptr() % 16 == off and not nm._use_tma(x, odd, w.block_scale.view(torch.uint8))
        _close(nm.nvfp4_matmul(x, odd, w.block_scale, w.global_scale), ref)
    os.environ["DSV4LAB_KERNEL_TMA"] = "0"
    try:
        assert not nm._use_tma(x, w.packed, w.block_scale.view(torch.uint8))
        _close(nm.nvfp4_matmul(x, w.packed, w.block_scale, w.global_scale), ref)
    finally:
        os.environ.pop("DSV4LAB_KERNEL_TMA")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("split", [1, 5, 32])
def test_gpu_gemm_split_k(split):
    from kernels.nvfp4_matmul import nvfp4_matmul, nvfp4_matmul_ref

    w = _rand_nvfp4_cuda(512, 7168, seed=5)
    x = torch.randn(200, 7168, device="cuda", dtype=torch.bfloat16)
    cfg = {"BM": 128, "BN": 128, "BK": 64, "SPLIT": split, "num_warps": 8}
    for _ in range(2):  # the second call checks that the tile counters were reset
        _close(nvfp4_matmul(x, w.packed, w.block_scale, w.global_scale, config=cfg), nvfp4_matmul_ref(x, w))


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("mode", ["runtime", "input_scale"])
def test_gpu_act_quant(mode):
    from dsv4lab.quant.activations import fake_quant_nvfp4, nvfp4_global_scale
    from kernels.nvfp4_act_quant import nvfp4_act_quant

    x = torch.randn(16, 7168, device="cuda", dtype=torch.bfloat16) * 5
    gs = None if mode == "runtime" else torch.tensor(0.002, device="cuda")
    y, packed, scale, g = nvfp4_act_quant(x, gs)
    ref = fake_quant_nvfp4(x, nvfp4_global_scale(x) if gs is None else gs)
    assert (ref != 0).sum() > 1000
    assert torch.equal(y, ref), (y.float() - ref.float()).abs().max()


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("T", [1, 4])
@pytest.mark.parametrize("tma", [True, False])
def test_gpu_moe_decode(T, tma):
    """Both MoE decode paths (TMA-fed and pointer loads) on V4-Pro expert shapes; the TMA path
    twice, which also checks that the down kernel's counters were reset."""
    from kernels.moe_decode import StackedNVFP4, moe_decode_ref, moe_decode_triton

    H, I, E, k = 7168, 3072, 8, 6
    w1 = StackedNVFP4.from_weights([_rand_nvfp4_cuda(I, H, 10 + e) for e in range(E)])
    w3 = StackedNVFP4.from_weights([_rand_nvfp4_cuda(I, H, 20 + e) for e in range(E)])
    w2 = StackedNVFP4.from_weights([_rand_nvfp4_cuda(H, I, 30 + e) for e in range(E)])
    x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16) * 0.05
    ids = torch.stack([torch.randperm(E, device="cuda")[:k] for _ in range(T)])
    wt = torch.rand(T, k, device="cuda")
    ref = moe_decode_ref(x, ids, wt, w1, w3, w2, 10.0)
    assert ref.abs().max() > 0
    for _ in range(2 if tma else 1):
        y = moe_decode_triton(x, ids, wt, w1, w3, w2, 10.0, tma=tma)
        err = (y.float() - ref.float()).abs().max() / ref.float().abs().max()
        assert err <= 2e-2, err


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("T", [1, 4])
def test_gpu_moe_decode_mxfp4(T):
    """Official-format (MXFP4) experts through the TMA MoE kernels on V4-Pro shapes, twice (the
    counters reset), also under a CUDA graph, and through the dispatcher."""
    from dsv4lab.quant.weights import quantize_mxfp4
    from kernels import dispatch
    from kernels.moe_decode import StackedMXFP4, moe_decode_ref, moe_decode_triton

    H, I, E, k = 7168, 3072, 8, 6
    g = torch.Generator(device="cuda").manual_seed(5)
    mk = lambda n, kk: StackedMXFP4.from_weights(  # noqa: E731
        [quantize_mxfp4(torch.randn(n, kk, device="cuda", generator=g) * 0.02) for _ in range(E)])
    w1, w3, w2 = mk(I, H), mk(I, H), mk(H, I)
    x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16) * 0.05
    ids = torch.stack([torch.randperm(E, device="cuda")[:k] for _ in range(T)])
    wt = torch.rand(T, k, device="cuda")
    ref = moe_decode_ref(x, ids, wt, w1, w3, w2, 10.0)
    assert ref.abs().max() > 0
    ys = [moe_decode_triton(x, ids, wt, w1, w3, w2, 10.0) for _ in range(2)] + [dispatch.moe_decode(x, ids, wt, w1, w3, w2, 10.0)]
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        yg = moe_decode_triton(x, ids, wt, w1, w3, w2, 10.0)
    graph.replay()
    torch.cuda.synchronize()
    for y in ys + [yg]:
        err = (y.float() - ref.float()).abs().max() / ref.float().abs().max()
        assert err <= 2e-2, err
    assert torch.equal(ys[0], ys[1]) and torch.equal(ys[0], yg)


@pytest.mark.gpu
@gpu
def test_gpu_dispatch_picks_kernel():
    from kernels import dispatch

    assert dispatch.have_triton_cuda()
    w = _rand_nvfp4_cuda(256, 512)
    x = torch.randn(1, 512, device="cuda", dtype=torch.bfloat16)
    _close(dispatch.nvfp4_linear(x, w), torch.nn.functional.linear(x, w.dequantize(torch.bfloat16)))


def test_on_input_device_switches_to_the_input_device(monkeypatch):
    """Triton launches on the current device: the kernel entry points switch to their input's
    device first (a 2-GPU split raced without it), and leave CPU inputs and the current device alone."""
    import contextlib
    from types import SimpleNamespace

    from kernels._device import on_input_device

    seen = []

    @on_input_device
    def entry(x, y=0):
        seen.append((torch.cuda.current_device(), y))
        return "ran"

    cur = {"dev": 0}
    switched = []

    @contextlib.contextmanager
    def fake_device(d):
        prev, cur["dev"] = cur["dev"], d.index
        switched.append(d.index)
        try:
            yield
        finally:
            cur["dev"] = prev

    monkeypatch.setattr(torch.cuda, "current_device", lambda: cur["dev"])
    monkeypatch.setattr(torch.cuda, "device", fake_device)
    on1 = SimpleNamespace(is_cuda=True, device=SimpleNamespace(index=1))
    on0 = SimpleNamespace(is_cuda=True, device=SimpleNamespace(index=0))
    assert entry(on1, y=5) == "ran" and seen[-1] == (1, 5) and cur["dev"] == 0  # switched, then restored
    assert entry(on0) == "ran" and seen[-1] == (0, 0) and switched == [1]       # already current: no switch
    assert entry(torch.zeros(2)) == "ran" and switched == [1]                  # CPU: untouched
    import importlib

    for mod, names in (("nvfp4_matmul", ["nvfp4_matmul"]), ("official_matmul", ["official_matmul", "verified_official_matmul"]),
                       ("moe_decode", ["moe_decode_triton"]), ("nvfp4_act_quant", ["nvfp4_act_quant"]),
                       ("cute_compressor_pool", ["compressor_pool_cute", "compressor_pool_aot"])):
        m = importlib.import_module(f"kernels.{mod}")
        for n in names:  # every public launcher carries the guard
            assert getattr(m, n).__code__ is on_input_device(lambda x: x).__code__, (mod, n)
