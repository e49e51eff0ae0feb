"""The Gluon W4A16 GEMM for 64..511 tokens (``dsv4lab.kernels.linear_gemm_wgmma``: async wgmma,
the next weight tile decoded while the previous wgmma runs).

CPU: compiled for sm_90a through a stand-in driver (tests/wgmma_offline_check.py, in a subprocess),
with the grouped MoE prefill GEMMs of ``moe_prefill_wgmma`` (their ``grouped_*`` cases):
it compiles at V4-Pro shapes with the installed triton's Gluon, ptxas spills nothing and does not
serialise the async wgmmas (its warning C7515, which loses the overlap the kernel exists for), and
the shared memory fits one CTA an SM. Gluon has no interpreter: the arithmetic is checked on the GPU.
GPU (``-m gpu``): against dequantise + ``F.linear`` at ragged and V4-Pro shapes, both FP4 formats,
bf16 and fp16, one and several K splits; twice, bitwise equal (split-K counters reset).

Tolerance (every element): |y - ref| <= 1e-2 (|ref| + max|ref| of its row), as tests/test_gemm.py
(bf16 output, fp32 accumulation in another order, the NVFP4 reference rounds W * global scale).
"""
from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from test_gemm import _rand_weight, _row_close  # the GPU weights and row tolerance of the Triton GEMM's tests

ROOT = Path(__file__).resolve().parents[1]
HAVE_TRITON = importlib.util.find_spec("triton") is not None
gpu = pytest.mark.skipif(not (torch.cuda.is_available() and HAVE_TRITON), reason="needs CUDA and triton")
SMEM_PER_CTA = 227 * 1024  # sm_90's most shared memory one CTA may use


def test_offline_sm90_compile():
    assert HAVE_TRITON, "triton is part of the test set-up (pip install -e '.[kernels]')"
    r = subprocess.run([sys.executable, str(ROOT / "tests" / "wgmma_offline_check.py")], cwd=ROOT, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads([ln for ln in r.stdout.splitlines() if ln.startswith("RESULT")][-1][len("RESULT"):])
    assert len(res) == 9 and sum(n.startswith("grouped_") for n in res) == 4, sorted(res)
    # the grouped GEMMs decode A into wgmma's registers (fragment order): the down GEMM stores nothing
    # to shared memory, the up GEMM only its epilogue's exchange (fewer stores than with A in shared memory)
    assert res["grouped_nvfp4_down_bm128_f16"]["st_shared"] == 0, res
    assert res["grouped_nvfp4_up_bm128"]["st_shared"] < res["grouped_nvfp4_up_bm128_smem_a"]["st_shared"], res
    for name, v in res.items():
        assert v["ptxas_rc"] == 0, (name, v["ptxas_err"])
        assert v["wgmma"] > 0 and v["spill_bytes"] == 0 and not v["serialized"], (name, v)
        assert v["shared"] <= SMEM_PER_CTA, (name, v["shared"])


def test_tile_rule():
    from dsv4lab.kernels.linear_gemm_wgmma import MAX_SPLIT, wgmma_tiles

    o_b = wgmma_tiles(128, 7168, 16384, 132)   # 56 row tiles: split 2 fills one wave, 128 steps each: doubled
    assert (o_b["BM"], o_b["BN"], o_b["SPLIT"]) == (128, 128, 4)
    w2 = wgmma_tiles(128, 7168, 3072, 132)     # 24 steps a split: not doubled
    assert (w2["BM"], w2["SPLIT"]) == (128, 2)
    q_a = wgmma_tiles(128, 1536, 7168, 132)    # 12 row tiles: 64-token tiles, 24 of them, split 11 (264 CTAs)
    assert (q_a["BM"], q_a["SPLIT"]) == (64, 11)
    assert wgmma_tiles(64, 7168, 3072, 132)["BM"] == 64
    assert wgmma_tiles(300, 7168, 3072, 132)["BM"] == 128  # 3 token tiles, not a 256-token accumulator
    assert wgmma_tiles(128, 65536, 1536, 132)["SPLIT"] == 1  # q_b: 512 row tiles cover the SMs
    assert wgmma_tiles(128, 512, 7168, 132)["SPLIT"] > MAX_SPLIT >= q_a["SPLIT"]  # wkv stays with the Triton tiles


def test_unsupported_formats_refused():
    """fp16 x with MXFP4 (an E8M0 scale need not be an f16) and FP8-block stay with linear_gemm."""
    from dsv4lab.kernels.linear_gemm_wgmma import launch_wgmma_gemm

    x = torch.zeros(64, 128, dtype=torch.float16)
    with pytest.raises(ValueError, match="MXFP4 with bf16"):
        launch_wgmma_gemm(x, "mxfp4", torch.zeros(8, 64, dtype=torch.uint8), torch.zeros(8, 4, dtype=torch.uint8),
                          None, torch.empty(64, 8, dtype=torch.float16))
    with pytest.raises(ValueError, match="fp8_block"):
        launch_wgmma_gemm(x.bfloat16(), "fp8_block", torch.zeros(8, 128, dtype=torch.uint8), torch.ones(1, 1), None,
                          torch.empty(64, 8, dtype=torch.bfloat16))


def test_prefill_gemm_routes_and_falls_back(monkeypatch):
    """``prefill_gemm`` takes the Gluon GEMM where ``wgmma_supported`` says so; if it fails (a triton
    whose Gluon it does not compile on) one warning, and the Triton tiles take every later call;
    ``WGMMA=True`` in a config surfaces the error, ``WGMMA=False`` skips the Gluon GEMM."""
    import dsv4lab.kernels.linear_gemm as lg

    calls = []

    def broken(*a, **k):
        calls.append("wgmma")
        raise RuntimeError("no such Gluon op")

    monkeypatch.setattr(lg, "wgmma_supported", lambda x2, fmt, data: True)
    monkeypatch.setattr(lg, "launch_wgmma_gemm", broken)
    monkeypatch.setattr(lg, "launch_gemm", lambda *a, **k: calls.append("triton"))
    monkeypatch.setattr(lg, "_wgmma_ok", [True])
    x, p, s, y = torch.zeros(64, 128), torch.zeros(8, 64, dtype=torch.uint8), torch.zeros(8, 8), torch.zeros(64, 8)
    with pytest.warns(UserWarning, match="Triton tiles take these calls"):
        lg.prefill_gemm(x, "nvfp4", p, s, None, y)
    assert calls == ["wgmma", "triton"] and lg._wgmma_ok == [False]
    lg.prefill_gemm(x, "nvfp4", p, s, None, y)
    assert calls[2:] == ["triton"]
    with pytest.raises(RuntimeError, match="no such Gluon op"):
        lg.prefill_gemm(x, "nvfp4", p, s, None, y, {"WGMMA": True})
    monkeypatch.setattr(lg, "_wgmma_ok", [True])
    lg.prefill_gemm(x, "nvfp4", p, s, None, y, {"WGMMA": False})
    assert calls[-1] == "triton"


# ----------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("M,K,N,cfg,dtype", [
    (128, 16384, 7168, None, torch.bfloat16),        # o_b, split K
    (128, 16384, 7168, {"SPLIT": 1}, torch.bfloat16),
    (64, 7168, 1536, None, torch.bfloat16),          # q_a, 64 tokens
    (97, 1024, 200, {"SPLIT": 3}, torch.bfloat16),   # ragged tokens and rows, a short last split
    (300, 3072, 7168, None, torch.float16),          # three token tiles, fp16
])
def test_gpu_wgmma_gemm(fmt, M, K, N, cfg, dtype):
    from dsv4lab.kernels.linear_gemm_wgmma import launch_wgmma_gemm

    if fmt == "mxfp4" and dtype == torch.float16:
        dtype = torch.bfloat16  # MXFP4 takes bf16 x only (test_unsupported_formats_refused)
    w = _rand_weight(fmt, N, K, seed=M + N)
    x = torch.randn(M, K, device="cuda", dtype=dtype)
    x[1] *= 1e3                                       # an outlier token
    p, s, gs = (w.packed, w.block_scale, w.global_scale) if fmt == "nvfp4" else (w.packed, w.scale, None)
    y = torch.empty(M, N, device="cuda", dtype=dtype)
    launch_wgmma_gemm(x, fmt, p, s, gs, y, cfg)
    _row_close(y, F.linear(x, w.dequantize(dtype)), 1e-2)
    y2 = torch.empty_like(y)
    launch_wgmma_gemm(x, fmt, p, s, gs, y2, cfg)
    assert torch.equal(y, y2)
