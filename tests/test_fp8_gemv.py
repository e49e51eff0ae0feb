"""The FP8-block decode GEMV (dsv4lab/kernels/linear_fp8_tma.py): the official format's attention
projections at M = 1, and wo_a's block-diagonal use in one launch.

CPU: the kernel through Triton's interpreter (tests/fp8_gemv_interp_check.py): ragged rows, one and
several K splits, fp32 and E8M0 scales, bf16 / fp32 x, the grouped launch (each row block the bits
of its own call), what the dispatcher takes and declines; the tile rule in-process.
GPU (@pytest.mark.gpu): V4-Pro's FP8 shapes against the fp64 product of the dequantised weight,
deterministic, CUDA-graph replay equal to eager, and ``QLinear.grouped`` with kernels installed.

Tolerance: fp32 products (e4m3 exact, x * block scale rounded once) summed in fp32, one rounding to
x's dtype: |kernel - fp64| <= one step of the output dtype of max|fp64| (2^-7 in bf16: the
interpreter's fp32 -> bf16 cast truncates; on the GPU half that) plus the fp32 sum's error.
"""
from __future__ import annotations

import importlib.util

import pytest
import torch
from oracle_util import interp_check_result

HAVE_TRITON = importlib.util.find_spec("triton") is not None
gpu = pytest.mark.skipif(not (torch.cuda.is_available() and HAVE_TRITON), reason="needs CUDA + triton")
UNIT = {torch.bfloat16: 2.0 ** -7, torch.float32: 1e-6}


def test_interp_fp8_gemv_matches_fp64():
    res = interp_check_result("fp8_gemv_interp_check.py")
    for case, dt in (("bf16_ragged_rows", torch.bfloat16), ("bf16_split3", torch.bfloat16),
                     ("f32_e8m0_two_scale_rows", torch.float32)):
        v = res[case]
        assert v["took"] and v["deterministic"] and v["rel"] <= UNIT[dt], (case, v)
    assert res["bf16_split3"]["splits"] == 3 and res["f32_e8m0_two_scale_rows"]["splits"] == 2
    assert res["bf16_ragged_rows"]["tiles"] == 3  # 40 rows in 16-row interpreter tiles
    assert res["official_matmul_is_gemv"] and res["tiled_rel"] <= UNIT[torch.bfloat16]
    grouped = res["grouped"]
    assert grouped["shape"] == [1, 3, 128] and grouped["rel"] <= UNIT[torch.bfloat16] and grouped["blocks_bitwise"]
    assert res["grouped_two_tokens_declined"] and res["k200_declined"]
    assert res["dispatch_cpu_reference"] and res["quant_linear_cpu_reference"]
    pair = res["pair"]
    assert pair == {"bitwise": True, "shapes": [[1, 48], [1, 160]], "waits_for_check": True,
                    "after_check_bitwise": True, "other_k_declined": True}, pair
    edit = res["scale_edit_seen"]
    assert edit["changed"] and edit["rel"] <= UNIT[torch.float32], edit


def test_tile_rule(monkeypatch):
    """64-row tiles (32 where a group's rows need it, none where 32 does not divide them), K split
    until ~2 waves, at least two K steps a split."""
    pytest.importorskip("triton")
    from dsv4lab.kernels import linear_fp8_tma as m

    monkeypatch.setattr(m, "INTERPRET", False)
    monkeypatch.setattr(m, "num_sms", lambda device: 132)
    cpu = torch.device("cpu")
    q_b = m.fp8_tma_config(65536, 1536, cpu)
    assert q_b["BN"] == 64 and q_b["SPLIT"] == 1
    wo_b = m.fp8_tma_config(7168, 16384, cpu)
    assert wo_b["BN"] == 64 and wo_b["SPLIT"] == 3 and wo_b["PDL"]   # 112 tiles: 2 waves at 3 splits
    wkv = m.fp8_tma_config(512, 7168, cpu)
    assert wkv["SPLIT"] == 28  # 8 tiles x 28 splits of 2 K steps (56 steps)
    assert m.fp8_tma_config(64, 512, cpu)["SPLIT"] == 2  # at least 2 K steps (of 4) a split
    assert m.fp8_tma_config(16 * 1024, 4096, cpu, rows_per_x=1024)["BN"] == 64
    assert m.fp8_tma_config(4 * 96, 4096, cpu, rows_per_x=96)["BN"] == 32
    assert m.fp8_tma_config(4 * 40, 4096, cpu, rows_per_x=40)["BN"] == 0


def test_plan_rejects_tiles_across_scale_blocks():
    pytest.importorskip("triton")
    from dsv4lab.kernels.linear_fp8_tma import Fp8GemvPlan
    from dsv4lab.quant.weights import quantize_fp8_block

    w = quantize_fp8_block(torch.randn(256, 256))
    with pytest.raises(ValueError, match="BN 48 must divide the 128-row scale block"):
        Fp8GemvPlan(w.data, w.scale_float(), {"BN": 48, "SPLIT": 1, "STAGES": 2, "num_warps": 4})


def _fp64_close(y: torch.Tensor, want: torch.Tensor) -> None:
    rel = ((y.double() - want).abs().max() / want.abs().max()).item()
    assert rel <= 2.0 ** -8 + 1e-6, rel


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("name,K,N,scale_format", [("q_a", 7168, 1536, "fp32"), ("q_b", 1536, 65536, "fp32"),
                                                   ("wkv", 7168, 512, "e8m0"), ("wo_b", 16384, 7168, "fp32"),
                                                   ("ragged", 4096, 1000, "e8m0")])
def test_gpu_fp8_gemv_v4_pro_shapes(name, K, N, scale_format):
    """The GEMV on V4-Pro's FP8 projection shapes: within a bf16 step of fp64, deterministic, the
    dispatcher's M = 1 path, and a CUDA-graph replay the same bits as the eager call."""
    from dsv4lab.kernels.linear_fp8_tma import fp8_gemv, fp8_plan
    from dsv4lab.kernels.linear_official import official_matmul
    from dsv4lab.quant.weights import quantize_fp8_block

    g = torch.Generator(device="cuda").manual_seed(5)
    w = quantize_fp8_block(torch.randn(N, K, device="cuda", generator=g) * K ** -0.5, scale_format)
    x = torch.randn(1, K, device="cuda", generator=g).to(torch.bfloat16)
    want = x.double() @ w.dequantize(torch.float64).T
    y = torch.empty(1, N, device="cuda", dtype=torch.bfloat16)
    assert fp8_gemv(x, w, y)
    _fp64_close(y, want)
    assert torch.equal(official_matmul(x, w), y)
    again = torch.empty_like(y)
    fp8_gemv(x, w, again)
    assert torch.equal(again, y)
    out = torch.empty_like(y)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fp8_gemv(x, w, out)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, y)
    assert fp8_plan(x, w).split >= 1


@pytest.mark.gpu
@gpu
def test_gpu_grouped_wo_a_one_launch():
    """wo_a's shape (16 groups of 1024 rows, K = 4096): ``QLinear.grouped`` with the kernel slots set
    is one launch for one token, each group the bits of its own row block's GEMV at the same tiles;
    two tokens run the row blocks one by one (no dequantised copy), within a bf16 step of fp64."""
    from dsv4lab.kernels.dispatch import grouped_quant_linear, quant_linear
    from dsv4lab.kernels.linear_fp8_tma import fp8_gemv, fp8_plan
    from dsv4lab.model.linear import QLinear, grouped_linear
    from dsv4lab.quant.weights import quantize_fp8_block

    G, rows, K = 16, 1024, 4096
    g = torch.Generator(device="cuda").manual_seed(6)
    w = quantize_fp8_block(torch.randn(G * rows, K, device="cuda", generator=g) * K ** -0.5)
    lin = QLinear(K, G * rows)
    lin.set_weight(w)
    lin.to("cuda")
    lin.kernel, lin.grouped_kernel = quant_linear, grouped_quant_linear  # what install_kernels sets for FP8
    x = torch.randn(1, G, K, device="cuda", generator=g).to(torch.bfloat16)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        y = lin.grouped(x, G)
        torch.cuda.synchronize()
    launches = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    assert len(launches) == 1 and "_fp8_gemv_kernel" in launches[0].name, [e.name for e in launches]
    want = grouped_linear(x.double(), w.dequantize(torch.float64), G)
    _fp64_close(y, want)
    plan = fp8_plan(x, w, G)
    tiles = {"BN": plan.wd.block_shape[0], "SPLIT": plan.split, "STAGES": plan.site.kw["STAGES"],
             "num_warps": plan.site.kw["num_warps"]}
    for i in (0, 7, 15):
        block = torch.empty(rows, device="cuda", dtype=torch.bfloat16)
        assert fp8_gemv(x[0, i].contiguous(), w.row_block(i * rows, rows), block, cfg=tiles)
        assert torch.equal(y[0, i], block)
    x2 = torch.randn(2, G, K, device="cuda", generator=g).to(torch.bfloat16)
    _fp64_close(lin.grouped(x2, G), grouped_linear(x2.double(), w.dequantize(torch.float64), G))


@pytest.mark.gpu
@gpu
def test_gpu_pair_is_each_single_launch():
    """wq_a and wkv of V4-Pro (7168 -> 1536 and 512) in one launch: each output the bits of its own
    GEMV (the splits differ: 11 and 28), and the dispatcher's pair only after both weights passed
    the first-use check."""
    from dsv4lab.kernels import linear_official as lo
    from dsv4lab.kernels.dispatch import quant_linear_pair
    from dsv4lab.kernels.linear_fp8_tma import fp8_gemv, fp8_pair_gemv
    from dsv4lab.quant.weights import quantize_fp8_block

    g = torch.Generator(device="cuda").manual_seed(7)
    wa = quantize_fp8_block(torch.randn(1536, 7168, device="cuda", generator=g) * 0.01)
    wb = quantize_fp8_block(torch.randn(512, 7168, device="cuda", generator=g) * 0.01, "e8m0")
    x = torch.randn(1, 7168, device="cuda", generator=g).to(torch.bfloat16)
    ya, yb = torch.empty(1, 1536, device="cuda", dtype=torch.bfloat16), torch.empty(1, 512, device="cuda",
                                                                                     dtype=torch.bfloat16)
    fp8_gemv(x, wa, ya)
    fp8_gemv(x, wb, yb)
    pa, pb = fp8_pair_gemv(x, wa, wb)
    assert torch.equal(pa, ya) and torch.equal(pb, yb)
    for key in (lo._verify_key(x, wa), lo._verify_key(x, wb)):
        lo._VERIFIED.pop(key, None)
    assert quant_linear_pair(x, wa, wb) is None  # not checked yet: the linears run alone
    lo.verified_official_matmul(x, wa)
    lo.verified_official_matmul(x, wb)
    qa, qb = quant_linear_pair(x, wa, wb)
    assert torch.equal(qa, ya) and torch.equal(qb, yb)


@pytest.mark.gpu
@gpu
def test_gpu_official_shared_expert_three_launches():
    """The official format's FP8-block shared expert with its kernels installed: w1 + w3 in one
    launch, the clamped SwiGLU in one, w2 in one (the reference path: 3 GEMVs and 4 elementwise
    launches), and the same bits as the linears' kernels with the reference SwiGLU."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from oracle_util import tiny_config

    from dsv4lab.kernels import linear_official as lo
    from dsv4lab.kernels.install import install_kernels
    from dsv4lab.model.moe import SharedExpert
    from dsv4lab.quant.weights import quantize_fp8_block

    cfg = tiny_config(hidden_size=1024, moe_intermediate_size=512, swiglu_limit=7.0)
    se = SharedExpert(cfg)
    g = torch.Generator().manual_seed(8)
    for p in ("w1", "w3", "w2"):
        ql = getattr(se, p)
        ql.set_weight(quantize_fp8_block(torch.randn(ql.out_features, ql.in_features, generator=g) * 0.05))
    se.to("cuda")
    assert install_kernels(se) == 4  # the shared expert's two slots and its three linears
    x = (torch.randn(1, 1, 1024, generator=g) * 3).to("cuda", torch.bfloat16)
    with torch.no_grad():
        slots = se.quant_pair_kernel, se.swiglu_kernel
        se.quant_pair_kernel = se.swiglu_kernel = None
        ref = se(x)  # first call: the linears' first-use checks, then the singles' bits
        ref = se(x)
        se.quant_pair_kernel, se.swiglu_kernel = slots
        assert all(lo._VERIFIED.get(lo._verify_key(x, getattr(se, p).qweight)) for p in ("w1", "w3"))
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            got = se(x)
            torch.cuda.synchronize()
    names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    assert len(names) == 3 and "_fp8_gemv_pair_kernel" in names[0] and "_swiglu_kernel" in names[1], names
    assert torch.equal(got, ref)
