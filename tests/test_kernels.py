"""Parity of the Triton kernels (dsv4lab/kernels/) with the PyTorch references in dsv4lab.quant.

CPU: the kernels run through Triton's interpreter in a subprocess that sets TRITON_INTERPRET=1
before importing triton (tests/kernels_interp_check.py, tiny shapes).
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
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from oracle_util import interp_check_result

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
        from dsv4lab.kernels import dispatch
        from dsv4lab.quant.weights import quantize_nvfp4
        from dsv4lab.quant.stacked import StackedNVFP4
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




@pytest.fixture(scope="module")
def interp_results():
    assert HAVE_TRITON, "triton is part of the test set-up (pip install -e '.[kernels]'); the interpreter tests need it"
    return interp_check_result("kernels_interp_check.py", timeout=600)  # 282 s measured alone on 2 cores


def test_interp_tma_gemv(interp_results):
    """The TMA GEMV (descriptor loads, per-group x scaling, split-K fix-up) through the interpreter."""
    r = {k: v for k, v in interp_results.items() if k.startswith("tma_") and k not in ("tma_pairs", "tma_rejects_m17", "tma_pair")}
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


def test_interp_tma_gemv_pair(interp_results):
    """Two weights of one x in one launch (wq_a + wkv): each output bitwise its own launch's, with
    different splits (the pair's partials and tile counters kept apart); tiles that differ do not fit."""
    v = interp_results["tma_pair"]
    assert v["a_bitwise"] and v["b_bitwise"] and v["splits"] == [2, 3], v
    assert v["fits"] is True and v["other_tiles_fit"] is False, v
    assert v["a_err"]["bad"] == 0 and v["a_err"]["max_abs"] <= 1e-2 * v["a_err"]["ref_max"], v


def test_interp_grouped_tma_gemv(interp_results):
    """The block-diagonal use (wo_a) of the TMA GEMV: each row block against its own x row in one
    prelude + one GEMV (split 1 with 1/xs in the pair rows, split 2 by pointer); tiles must not
    straddle blocks; more tokens take one GEMV per block."""
    for k in ("tmagrp_split1", "tmagrp_split2"):
        v = interp_results[k]
        assert v["bad"] == 0 and v["ref_max"] > 0 and v["max_abs"] <= 2e-3 * v["ref_max"], (k, v)
    assert interp_results["tmagrp_rejects_partial_tiles"] is True
    v = interp_results["grouped_one_token"]  # the cached plan of nvfp4_grouped_matmul, bf16 output
    assert v["bad"] == 0 and v["ref_max"] > 0 and v["max_abs"] <= 1e-2 * v["ref_max"], v
    assert interp_results["grouped_one_token_plans"] == {"same": True, "other_groups": True}
    assert interp_results["grouped_loop"]["bad"] == 0
    assert interp_results["grouped_dense_bitwise"] is True  # 512 tokens: one dequantisation + one bmm


def test_interp_grouped_gemv_emits_pairs(interp_results):
    """wo_a's GEMV writes the x_pairs of its output for wo_b (no prelude launch): the same y bits as
    the plain launch, the same pair rows and 1/xs (padding zeroed) as an x_pairs launch over y,
    recorded as y's; refused where y's pairs are the size of x's (the launch reads those)."""
    for split in (1, 2):
        v = interp_results[f"emit_split{split}"]
        assert v["emits"], v
        assert v["y_bitwise"] and v["rows"] and v["inv"] and v["recorded"], v
        assert v["inv_len"] == 64, v
    assert interp_results["emit_split1"]["refuses_same_size"] is True


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
    r = interp_results["moetma_h_pairs"]  # the up launch writing h's pairs: the prelude's bits, one launch fewer
    assert r["equal"] and r["launches"] == [3, 4] and r["max_abs"] <= 2e-2 * r["ref_max"], r
    r = interp_results["moetma_mx"]  # MXFP4 stacks through the same kernels (32-group boxes, E8M0)
    assert r["ref_max"] > 0 and r["max_abs"] <= 2e-2 * r["ref_max"], r
    assert r["dispatch_cpu_is_ref"] and interp_results["moetma_mx_rejects_pointer"] is True


def test_interp_moe_decode_schedules():
    """Two launches, a PDL'd down launch (two under the interpreter) and one fused launch of
    ticketed up/down tiles (twice: tickets and pair counters reset): bitwise the same y with the
    shared expert, within the TMA path's tolerance of the reference, every counter back at 0."""
    r = interp_check_result("moe_schedule_interp_check.py", timeout=300)
    assert [r[s]["equal"] for s in ("two", "pdl", "fused")] == [[True], [True], [True, True]], r
    assert r["two"]["ref_max"] > 0 and r["two"]["max_abs"] <= 2e-2 * r["two"]["ref_max"], r
    assert r["counters_zero"], r


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_interp_moe_decode_shared_fold(interp_results, fmt):
    """The shared expert as one more pair in the TMA MoE launches: bitwise the routed call plus the
    one-expert call (bf16 add), within the routed path's tolerance of the reference, still one
    launch (both formats' default schedule: up and down tiles fused), and the CPU dispatch is the
    reference sum."""
    r = interp_results[f"moe_shared_{fmt}"]
    assert r["equal_parts"], r
    assert r["ref_max"] > 0 and r["max_abs"] <= 2e-2 * r["ref_max"], r
    assert r["launches"] == ["_moe_fused_kernel"], r
    assert r["dispatch_cpu_is_ref"], r
    assert interp_results["moe_shared_rejects"] is True


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
    from dsv4lab.kernels.linear_nvfp4 import nvfp4_matmul, nvfp4_matmul_ref

    K, N = V4_PRO_SHAPES[name]
    w = _rand_nvfp4_cuda(N, K)
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    y = nvfp4_matmul(x, w.packed, w.block_scale, w.global_scale)
    _close(y, nvfp4_matmul_ref(x, w))
    y2 = nvfp4_matmul(x, w.packed, w.block_scale, w.global_scale)  # counters were reset
    _close(y2, nvfp4_matmul_ref(x, w))


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("h2,xp,pf", [(True, True, 1), (True, True, 2), (True, False, 1), (False, False, 1)])
@pytest.mark.parametrize("xkind", ["bf16", "fp16", "fp32", "outliers", "tiny"])
def test_gpu_m1_inner_loops(h2, xp, pf, xkind):
    """Both M=1 inner loops (f16x2 products with the power-of-two x scaling, and fp32 FMAs) on
    inputs that stress the scaling: fp32/fp16 x, a few 1e4 outliers, and x of order 1e-30."""
    from dsv4lab.kernels.linear_nvfp4 import nvfp4_matmul, nvfp4_matmul_ref

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
    from dsv4lab.kernels.linear_nvfp4 import nvfp4_matmul, nvfp4_matmul_ref

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
@pytest.mark.parametrize("T", [1, 2])
def test_gpu_grouped_wo_a_v4_pro(T):
    """wo_a at V4-Pro shapes (16 groups of 1024 rows, K = 4096): one token takes the grouped TMA
    GEMV (one prelude + one GEMV for all groups), two tokens one GEMV per group; both within the
    matmul tolerance of each group's reference, the second call equal to the first (split
    counters reset), a CUDA-graph replay bitwise equal to eager."""
    from dsv4lab.kernels.linear_nvfp4 import nvfp4_grouped_matmul, nvfp4_matmul_ref
    from dsv4lab.quant.weights import NVFP4Weight

    if torch.cuda.get_device_capability() < (9, 0):
        pytest.fail("the TMA GEMV needs sm_90+; run the GPU tests on the H200")
    G, K, R = 16, 4096, 1024
    w = _rand_nvfp4_cuda(G * R, K, seed=3)
    x = torch.randn(T, G, K, device="cuda", dtype=torch.bfloat16)
    x[:, 3] *= 100  # groups of different magnitude: each must read its own x row
    y = nvfp4_grouped_matmul(x, w.packed, w.block_scale, w.global_scale)
    assert y.shape == (T, G, R)
    for g in range(G):
        wg = NVFP4Weight(w.packed[g * R:(g + 1) * R], w.block_scale[g * R:(g + 1) * R], w.global_scale)
        _close(y[:, g], nvfp4_matmul_ref(x[:, g], wg))
    assert torch.equal(nvfp4_grouped_matmul(x, w.packed, w.block_scale, w.global_scale), y)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        yg = nvfp4_grouped_matmul(x, w.packed, w.block_scale, w.global_scale)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(yg, y)
    if T == 1:  # the grouped GEMV wrote y's pairs (wo_b's input): the bits an x_pairs launch writes
        from dsv4lab.kernels import activation_pairs

        y = nvfp4_grouped_matmul(x, w.packed, w.block_scale, w.global_scale)
        kg = G * R // 16
        assert activation_pairs._pairs_record(y, (kg, y.device, 0)) is not None
        emitted = [t.clone() for t in activation_pairs.x_pairs(y.flatten())]  # the kept buffers, no launch
        fresh = activation_pairs.x_pairs(y.flatten().clone())         # a new tensor: launched
        assert torch.equal(emitted[0], fresh[0]) and torch.equal(emitted[1], fresh[1])


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("M,bn,split", [(2, 64, 1), (4, 128, 5), (16, 64, 3), (16, 256, 1)])
def test_gpu_tma_dot(M, bn, split):
    """The TMA-fed tl.dot loop (M in 2..16) with split K and a partial row tile."""
    from dsv4lab.kernels.linear_nvfp4 import nvfp4_matmul, nvfp4_matmul_ref

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
    from dsv4lab.kernels import dispatch
    from dsv4lab.kernels.linear_official import _VERIFIED, official_matmul

    g = torch.Generator(device="cuda").manual_seed(11)
    wf = torch.randn(N, K, device="cuda", generator=g) * 0.02
    w = quantize_mxfp4(wf) if fmt == "mxfp4" else quantize_fp8_block(wf, scale_format="e8m0" if N == 1000 else "fp32")
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    ref = torch.nn.functional.linear(x, w.dequantize(torch.bfloat16))
    _close(official_matmul(x, w), ref)
    if M <= 16:  # decode takes the TMA GEMVs (MXFP4 M <= 16, FP8-block M = 1); the tiled kernel stays correct too
        _close(official_matmul(x, w, config={"TMA": False}), ref)
    _close(dispatch.quant_linear(x, w), ref)
    assert all(v for k, v in _VERIFIED.items() if k[0] == fmt and k[1:3] == (N, K))


@pytest.mark.gpu
@gpu
def test_gpu_m1_path_choice():
    """M=1 takes the TMA GEMV on Hopper for aligned weights and falls back to the pointer-load GEMV
    (still correct) for a weight whose base is not 16-byte aligned or when opted out."""
    from dsv4lab.kernels import linear_nvfp4 as nm

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
    from dsv4lab.kernels.linear_nvfp4 import nvfp4_matmul, nvfp4_matmul_ref

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
    from dsv4lab.kernels.act_quant_nvfp4 import nvfp4_act_quant

    x = torch.randn(16, 7168, device="cuda", dtype=torch.bfloat16) * 5
    gs = None if mode == "runtime" else torch.tensor(0.002, device="cuda")
    y, packed, scale, g = nvfp4_act_quant(x, gs)
    ref = fake_quant_nvfp4(x, nvfp4_global_scale(x) if gs is None else gs)
    assert (ref != 0).sum() > 1000
    assert torch.equal(y, ref), (y.float() - ref.float()).abs().max()


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("T", [1, 4, 16])
@pytest.mark.parametrize("tma", [True, False])
def test_gpu_moe_decode(T, tma):
    """Both MoE decode paths (TMA-fed and pointer loads) on V4-Pro expert shapes; the TMA path
    twice, which also checks that the down kernel's counters were reset."""
    from dsv4lab.kernels.moe_decode import moe_decode_triton
    from dsv4lab.kernels.moe_decode_ref import moe_decode_ref
    from dsv4lab.quant.stacked import StackedNVFP4

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
    from dsv4lab.kernels import dispatch
    from dsv4lab.kernels.moe_decode import moe_decode_triton
    from dsv4lab.kernels.moe_decode_ref import moe_decode_ref
    from dsv4lab.quant.stacked import StackedMXFP4

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


def _v4_pro_expert_stacks(fmt: str, E: int, seed: int):
    """E routed V4-Pro experts (H 7168, I 3072) as NVFP4 or MXFP4 stacks on the GPU, and the
    shared expert's one-expert stacks: (w1, w3, w2, (sw1, sw3, sw2))."""
    from dsv4lab.quant.weights import quantize_mxfp4
    from dsv4lab.quant.stacked import StackedMXFP4, StackedNVFP4, stack_one

    H, I = 7168, 3072
    g = torch.Generator(device="cuda").manual_seed(seed)
    if fmt == "nvfp4":
        one_w = lambda n, kk, s: _rand_nvfp4_cuda(n, kk, s)  # noqa: E731
        Stack = StackedNVFP4
    else:
        one_w = lambda n, kk, s: quantize_mxfp4(torch.randn(n, kk, device="cuda", generator=g) * 0.02)  # noqa: E731
        Stack = StackedMXFP4
    w1, w3 = (Stack.from_weights([one_w(I, H, o + e) for e in range(E)]) for o in (10, 20))
    w2 = Stack.from_weights([one_w(H, I, 30 + e) for e in range(E)])
    return w1, w3, w2, (stack_one(one_w(I, H, 40)), stack_one(one_w(I, H, 41)), stack_one(one_w(H, I, 42)))


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("T", [1, 3])
def test_gpu_moe_decode_schedules_agree(fmt, T):
    """The TMA MoE decode's three schedules (two launches, the down one PDL-launched, one fused
    launch of up and down tiles) on V4-Pro shapes with the shared expert: bitwise the same y,
    eagerly (three calls each: the fused launch's tickets and pair counters are back at 0 after
    every call) and replayed from a CUDA graph, and the counters are all 0 afterwards."""
    from dsv4lab.kernels import host
    from dsv4lab.kernels import moe_decode_tma as mdt

    H, E, k = 7168, 8, 6
    w1, w3, w2, sh = _v4_pro_expert_stacks(fmt, E, 11)
    x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16) * 0.05
    ids = torch.stack([torch.randperm(E, device="cuda")[:k] for _ in range(T)]).reshape(-1).to(torch.int32)
    wt = torch.rand(T * k, device="cuda")
    saved = mdt.SCHEDULE
    outs = {}
    try:
        for sched in mdt.SCHEDULES:
            mdt.SCHEDULE = sched
            ys = [mdt.moe_decode_tma(x, ids, wt, w1, w3, w2, 10.0, k, shared=sh) for _ in range(3)]
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                yg = mdt.moe_decode_tma(x, ids, wt, w1, w3, w2, 10.0, k, shared=sh)
            for _ in range(3):
                graph.replay()
            torch.cuda.synchronize()
            outs[sched] = ys + [yg]
    finally:
        mdt.SCHEDULE = saved
    base = outs["two"][0]
    assert base.abs().max() > 0
    for sched, ys in outs.items():
        for y in ys:
            assert torch.equal(y, base), (sched, (y.float() - base.float()).abs().max())
    assert int(host.counters(x.device, 1).abs().sum()) == 0


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("T", [1, 4])
def test_gpu_moe_decode_shared_fold(fmt, T):
    """The shared expert folded into the TMA MoE launches on V4-Pro shapes: bitwise the routed
    call plus the one-expert call (added in bf16, as the model), within the routed tolerance of
    the reference sum, and a CUDA graph replay equals the eager call."""
    from dsv4lab.kernels.moe_decode import moe_decode_triton
    from dsv4lab.kernels.moe_decode_ref import moe_decode_ref

    H, E, k = 7168, 8, 6
    w1, w3, w2, sh = _v4_pro_expert_stacks(fmt, E, 7)
    x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16) * 0.05
    ids = torch.stack([torch.randperm(E, device="cuda")[:k] for _ in range(T)])
    wt = torch.rand(T, k, device="cuda")
    one, ones = torch.zeros(T, 1, dtype=torch.long, device="cuda"), torch.ones(T, 1, device="cuda")
    y = moe_decode_triton(x, ids, wt, w1, w3, w2, 10.0, shared=sh)
    parts = moe_decode_triton(x, ids, wt, w1, w3, w2, 10.0) + moe_decode_triton(x, one, ones, *sh, 10.0)
    assert torch.equal(y, parts)
    ref = moe_decode_ref(x, ids, wt, w1, w3, w2, 10.0) + moe_decode_ref(x, one, ones, *sh, 10.0)
    err = (y.float() - ref.float()).abs().max() / ref.float().abs().max()
    assert ref.abs().max() > 0 and err <= 2e-2, err
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        yg = moe_decode_triton(x, ids, wt, w1, w3, w2, 10.0, shared=sh)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(yg, y)


@pytest.mark.gpu
@gpu
def test_gpu_dispatch_picks_kernel():
    from dsv4lab.kernels import dispatch

    assert dispatch.have_triton_cuda()
    w = _rand_nvfp4_cuda(256, 512)
    x = torch.randn(1, 512, device="cuda", dtype=torch.bfloat16)
    _close(dispatch.nvfp4_linear(x, w), torch.nn.functional.linear(x, w.dequantize(torch.bfloat16)))


def test_on_input_device_switches_to_the_input_device(monkeypatch):
    """Triton launches on the current device: the kernel entry points switch to their input's
    device first (a 2-GPU split raced without it), and leave CPU inputs and the current device alone."""
    import contextlib
    from types import SimpleNamespace

    from dsv4lab.kernels.device import on_input_device

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
    on1 = SimpleNamespace(is_cuda=True, device=SimpleNamespace(index=1), get_device=lambda: 1)
    on0 = SimpleNamespace(is_cuda=True, device=SimpleNamespace(index=0), get_device=lambda: 0)
    assert entry(on1, y=5) == "ran" and seen[-1] == (1, 5) and cur["dev"] == 0  # switched, then restored
    assert entry(on0) == "ran" and seen[-1] == (0, 0) and switched == [1]       # already current: no switch
    assert entry(torch.zeros(2)) == "ran" and switched == [1]                  # CPU: untouched
    import importlib

    for mod, names in (("linear_nvfp4", ["nvfp4_matmul"]), ("linear_official", ["official_matmul", "verified_official_matmul"]),
                       ("moe_decode", ["moe_decode_triton"]), ("act_quant_nvfp4", ["nvfp4_act_quant"]),
                       ("compressor_pool_cute", ["compressor_pool_cute", "compressor_pool_aot"])):
        m = importlib.import_module(f"dsv4lab.kernels.{mod}")
        for n in names:  # every public launcher carries the guard
            assert getattr(getattr(m, n), "launch_guard", False), (mod, n)


def test_launchers_are_opaque_to_torch_compile():
    """Dynamo must not trace into a launcher (Inductor re-emitting our Triton source failed on its
    inline PTX on the H200): the guarded entry runs as a Python call on every compiled call."""
    from dsv4lab.kernels.device import on_input_device

    tracing = []

    @on_input_device
    def entry(x):
        tracing.append(torch.compiler.is_compiling())  # True if Dynamo traced through it
        return x * 2

    f = torch.compile(lambda x: entry(x + 1) - 1, backend="eager")
    for _ in range(3):
        assert torch.equal(f(torch.ones(3)), torch.full((3,), 3.0))
    assert tracing == [False] * 3
