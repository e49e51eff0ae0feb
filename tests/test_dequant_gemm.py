"""The large-M prefill tier: dequantise into a bounded scratch + cuBLAS (``dsv4lab.kernels.dequant_gemm``,
M >= ``DENSE_MIN_M``) and the dense routed-experts prefill (``moe_prefill.moe_prefill_dense``).

CPU: through Triton's interpreter in a subprocess (tests/dequant_interp_check.py): the dequantiser
bitwise equal to ``w.dequantize(dtype)`` for NVFP4 / MXFP4 / FP8-block in bf16 and fp32 (the
interpreter's bf16 cast of fp32 subnormals aside: within one subnormal step), so the GEMM equals
``F.linear(x, w.dequantize(x.dtype))`` bitwise; in row chunks within 1e-2 row-relative; the dense MoE
within the grouped kernel's tolerances of ``moe_prefill_ref`` (2e-2 bf16, 1e-5 fp32).
GPU (``-m gpu``): V4-Pro shapes at M = 4096 bitwise equal to dequantise + ``F.linear``; the fused
SwiGLU bitwise ``clamped_swiglu``. The dense MoE at V4-Pro sizes: tests/test_gemm.py.
"""
from __future__ import annotations

import importlib.util

import pytest
import torch
import torch.nn.functional as F

from oracle_util import interp_check_result

HAVE_TRITON = importlib.util.find_spec("triton") is not None
gpu = pytest.mark.skipif(not (torch.cuda.is_available() and HAVE_TRITON), reason="needs CUDA and triton")


@pytest.fixture(scope="module")
def interp():
    return interp_check_result("dequant_interp_check.py", timeout=900)


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4", "fp8_block"])
def test_interp_dequantise_is_the_reference(interp, fmt):
    for dt in ("bfloat16", "float32"):
        r = interp[f"dequant_{fmt}_{dt}"]
        assert r["normal_equal"] and r["subnormal_close"] and r["offset"] and r["words_tiles"], (dt, r)
        assert r["normal_count"] > 0.9 * 300 * 256
    assert interp[f"dense_{fmt}_one_chunk_equal"]
    assert interp[f"dense_{fmt}_dispatch_equal"]
    assert interp[f"dense_{fmt}_chunked"]["bad"] == 0
    # unforced: DENSE_MIN_M rows take the dense tier (bitwise), one row fewer the Triton GEMM
    at, below = interp[f"auto_{fmt}_M512"], interp[f"auto_{fmt}_M511"]
    assert at["equal"] and at["bad"] == 0
    assert below["bad"] == 0 and not below["equal"]


def test_interp_dense_moe(interp):
    r = {k: v for k, v in interp.items() if k.startswith("moe_dense_") and k != "moe_dense_fits"}
    assert len(r) == 2 * 2 * 2 * 2, sorted(r)
    assert all(v["bad"] == 0 for v in r.values()), {k: v for k, v in r.items() if v["bad"]}
    assert interp["moe_dense_fits"] == {"few_rows": False, "many_rows": True, "odd_K": False}


def test_interp_fused_swiglu(interp):
    r = {k: v for k, v in interp.items() if k.startswith("swiglu_")}
    assert len(r) == 2 * 2 * 2, sorted(r)
    assert all(v["bad"] == 0 for v in r.values()), r


def test_chunk_rows_bounds_the_scratch():
    from dsv4lab.kernels.dequant_gemm import SCRATCH_BYTES, chunk_rows

    assert chunk_rows(65536, 1536, torch.bfloat16) == 65536            # V4-Pro q_b: 201 MB, one chunk
    step = chunk_rows(129280, 7168, torch.bfloat16)                    # a quantised lm_head: 1.85 GB
    assert step % 128 == 0 and step * 7168 * 2 <= SCRATCH_BYTES < (step + 128) * 7168 * 2


def _rand_weight(fmt, N, K, seed):
    from interp_weights import rand_fp8, rand_mxfp4, rand_nvfp4

    torch.manual_seed(seed)
    w = {"nvfp4": rand_nvfp4, "mxfp4": rand_mxfp4, "fp8_block": rand_fp8}[fmt](N, K)
    return w.to("cuda")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4", "fp8_block"])
@pytest.mark.parametrize("K,N", [(1536, 65536), (16384, 7168), (7168, 512)])
def test_gpu_dense_gemm_is_the_reference(fmt, K, N):
    """M = 4096 through the dispatcher (the dense tier): bitwise dequantise + ``F.linear``; the
    dequantised weight bitwise ``w.dequantize`` (an E8M0 2^-127 scale included)."""
    from dsv4lab.kernels.dequant_gemm import dequantize_rows
    from dsv4lab.kernels.dispatch import quant_linear

    w = _rand_weight(fmt, N, K, seed=N)
    x = torch.randn(4096, K, device="cuda", dtype=torch.bfloat16)
    x[1] *= 1e3
    ref_w = w.dequantize(torch.bfloat16)
    if fmt == "nvfp4":
        d = dequantize_rows(fmt, w.packed, w.block_scale, w.global_scale.reshape(1).float(), 0, N, torch.bfloat16)
    elif fmt == "mxfp4":
        d = dequantize_rows(fmt, w.packed, w.scale, None, 0, N, torch.bfloat16)
    else:
        d = dequantize_rows(fmt, w.data, w.scale_float().contiguous(), None, 0, N, torch.bfloat16)
    assert torch.equal(d, ref_w)
    assert torch.equal(quant_linear(x, w), F.linear(x, ref_w))


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("limit", [None, 10.0])
def test_gpu_fused_swiglu_is_the_reference(limit):
    """The dense MoE's one-launch SwiGLU: bitwise ``clamped_swiglu`` (libdevice expf, IEEE division,
    the reference's roundings), and times the routing weight bitwise the reference's product."""
    from dsv4lab.kernels.moe_prefill import swiglu
    from dsv4lab.model.swiglu import clamped_swiglu

    g = torch.Generator(device="cuda").manual_seed(1)
    gate = (torch.randn(3000, 3072, device="cuda", generator=g) * 6).bfloat16()
    up = (torch.randn(3000, 3072, device="cuda", generator=g) * 6).bfloat16()
    rw = torch.rand(3000, device="cuda", generator=g)
    ref = clamped_swiglu(gate, up, limit)
    assert torch.equal(swiglu(gate, up, limit, None), ref)
    assert torch.equal(swiglu(gate, up, limit, rw), ref * rw[:, None].to(ref.dtype))
