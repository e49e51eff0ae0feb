"""The routed experts' grouped prefill GEMMs in Gluon (``dsv4lab.kernels.moe_prefill_wgmma``).

CPU: the kernel compiles for sm_90a at V4-Pro's expert shapes without spills or serialised wgmmas
(tests/wgmma_offline_check.py's ``grouped_*`` cases, asserted in tests/test_gemm_wgmma.py);
here the routing in ``moe_prefill_triton`` (default on, forced, refused, one warning and the Triton
kernel after a failure) and the refusals at the boundary. Gluon has no interpreter: the arithmetic
is checked on the GPU (``-m gpu``) against the per-expert reference (``moe_prefill_ref``) and the
Triton grouped kernel: ~64 rows an expert (V4-Pro's 384 experts at 4096 tokens), both FP4 formats,
the routing weight before w2 or after, 64 and 128 rows a tile; ragged (empty experts, partial
tiles, fp16, an outlier token); bitwise equal on a second call and under a CUDA graph.

Tolerance (every element): |y - ref| <= 2e-2 (|ref| + max|ref| of its row), tests/test_gemm.py's MoE
bound (bf16 h between the GEMMs, fp32 accumulation in another order).
"""
from __future__ import annotations

import importlib.util

import pytest
import torch

from test_gemm import _moe_inputs, _row_close  # the GPU expert stacks and row tolerance of the Triton kernels' tests

HAVE_TRITON = importlib.util.find_spec("triton") is not None
gpu = pytest.mark.skipif(not (torch.cuda.is_available() and HAVE_TRITON), reason="needs CUDA and triton")


def _cpu_stacks(E=4, H=128, I=64):
    from dsv4lab.quant.stacked import StackedMXFP4, StackedNVFP4

    def nv(n, k):
        return StackedNVFP4(torch.zeros(E, n, k // 2, dtype=torch.uint8),
                            torch.zeros(E, n, k // 16, dtype=torch.float8_e4m3fn), torch.ones(E))
    mx = StackedMXFP4(torch.zeros(E, I, H // 2, dtype=torch.uint8), torch.zeros(E, I, H // 32, dtype=torch.uint8))
    return nv(I, H), nv(I, H), nv(H, I), mx


def test_routing_and_fallback(monkeypatch):
    """By default the Gluon GEMMs take the call where supported; a failure warns once and the
    Triton grouped kernel takes this and every later call; ``WGMMA=True`` surfaces the error,
    ``WGMMA=False`` skips the Gluon path."""
    import dsv4lab.kernels.moe_prefill as mp

    calls = []

    def broken(*a, **k):
        calls.append("wgmma")
        raise RuntimeError("no such Gluon op")

    def triton_gemm(x, sched, gather, w, *a, **k):
        calls.append("triton")
        return torch.zeros(sched["src"].numel(), w.shape[1], dtype=x.dtype)

    monkeypatch.setattr(mp, "grouped_wgmma_supported", lambda *a: True)
    monkeypatch.setattr(mp, "_moe_prefill_wgmma", broken)
    monkeypatch.setattr(mp, "grouped_gemm", triton_gemm)
    monkeypatch.setattr(mp, "unpermute", lambda y, pos, rw, out, k, weight: out)
    monkeypatch.setattr(mp, "_wgmma_ok", [True])
    w1, w3, w2, _ = _cpu_stacks()
    x, ids, wt = torch.zeros(8, 128, dtype=torch.bfloat16), torch.zeros(8, 2, dtype=torch.long), torch.ones(8, 2)
    with pytest.warns(UserWarning, match="Triton grouped kernel takes these calls"):
        mp.moe_prefill_triton(x, ids, wt, w1, w3, w2, 10.0)
    assert calls == ["wgmma", "triton", "triton"] and mp._wgmma_ok == [False]
    mp.moe_prefill_triton(x, ids, wt, w1, w3, w2, 10.0)
    assert calls[3:] == ["triton", "triton"]
    with pytest.raises(RuntimeError, match="no such Gluon op"):
        mp.moe_prefill_triton(x, ids, wt, w1, w3, w2, 10.0, cfg={"WGMMA": True})
    monkeypatch.setattr(mp, "_wgmma_ok", [True])
    del calls[:]
    mp.moe_prefill_triton(x, ids, wt, w1, w3, w2, 10.0, cfg={"WGMMA": False})
    assert calls == ["triton", "triton"]


def test_boundary_refusals():
    """CPU tensors are not supported; fp16 x with MXFP4, a K against x's width, a tile height the
    kernel has no layout for: one error naming what to change."""
    from dsv4lab.kernels.moe_prefill import expert_schedule
    from dsv4lab.kernels.moe_prefill_wgmma import grouped_wgmma, grouped_wgmma_supported

    w1, w3, w2, mx = _cpu_stacks()
    assert not grouped_wgmma_supported(torch.zeros(4, 128, dtype=torch.bfloat16), w1, w3, w2)
    sched = expert_schedule(torch.zeros(4, 2, dtype=torch.long), 4, 64)
    with pytest.raises(ValueError, match="MXFP4 with bf16"):
        grouped_wgmma(torch.zeros(8, 128, dtype=torch.float16), sched, 64, mx)
    with pytest.raises(ValueError, match="against K = 128"):
        grouped_wgmma(torch.zeros(8, 96, dtype=torch.bfloat16), sched, 64, w1)
    with pytest.raises(ValueError, match="bm 96"):
        grouped_wgmma(torch.zeros(8, 128, dtype=torch.bfloat16), sched, 96, w1)
    with pytest.raises(ValueError, match="must match"):
        grouped_wgmma(torch.zeros(8, 128, dtype=torch.bfloat16), sched, 64, w1, mx)


def test_mixed_tiles_cover_every_row_once():
    """``mixed_tiles`` on skewed routing (empty experts, 1..64-row experts, experts over 128 rows):
    every sorted row in exactly one tile of its own expert, one 64-row tile for each expert of at
    most 64 rows, 128-row tiles for the rest, surplus tiles marked -1 within the host bounds."""
    from dsv4lab.kernels.moe_prefill import expert_schedule, mixed_tiles

    g = torch.Generator().manual_seed(0)
    E, T, k = 24, 700, 6
    p = torch.rand(E, generator=g) ** 4  # skewed: some experts far over 128 rows, some empty
    p[3] = p[17] = 0
    ids = torch.stack([torch.multinomial(p, k, generator=g) for _ in range(T)])
    sched = expert_schedule(ids, E, None)  # rows sorted, no tiles of its own
    counts = sched["counts"]
    assert "tile_e" not in sched
    assert (counts > 128).any() and ((counts > 0) & (counts <= 64)).any() and (counts == 0).any()
    expert_of_row = torch.repeat_interleave(torch.arange(E), counts)
    seen = torch.zeros(T * k, dtype=torch.long)
    groups = mixed_tiles(sched)
    assert [b for b, _ in groups] == [64, 128]
    assert groups[0][1]["tiles"] == E and groups[1][1]["tiles"] == -(-T * k // 128) + E
    for bm, t in groups:
        live = t["tile_e"] >= 0
        for e, r0, r1 in zip(t["tile_e"][live].tolist(), t["tile_r0"][live].tolist(), t["tile_r1"][live].tolist()):
            rows = torch.arange(r0, min(r0 + bm, r1))
            assert len(rows) and (expert_of_row[rows] == e).all() and (counts[e] <= 64) == (bm == 64)
            seen[rows] += 1
        assert live.sum() == (((counts > 0) & (counts <= 64)).sum() if bm == 64
                              else torch.where(counts > 64, -(-counts // 128), 0).sum())
    assert (seen == 1).all()


# ----------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("before", [False, True])
@pytest.mark.parametrize("bm,frag", [(64, True), (128, True), (128, False), ("mixed", True), ("mixed", False)])
def test_gpu_grouped_wgmma_v4_pro_experts(fmt, before, bm, frag):
    """683 tokens, top-6 of 64 V4-Pro-sized experts (~64 rows each, as 384 experts at 4096 tokens),
    clamp 10, A from registers (fragment order) or through shared memory: against the reference
    and the Triton grouped kernel; bitwise on a second call."""
    from dsv4lab.kernels.moe_prefill import moe_prefill_triton
    from dsv4lab.kernels.moe_prefill_ref import moe_prefill_ref

    w1, w3, w2, x, ids, wt = _moe_inputs(fmt, 64, T=683)
    c = {"WGMMA": True, "BM": bm, "FRAG": frag}
    y = moe_prefill_triton(x, ids, wt, w1, w3, w2, 10.0, before, cfg=c)
    _row_close(y, moe_prefill_ref(x, ids, wt, w1, w3, w2, 10.0, before), 2e-2)
    _row_close(y, moe_prefill_triton(x, ids, wt, w1, w3, w2, 10.0, before, cfg={"WGMMA": False}), 2e-2)
    assert torch.equal(moe_prefill_triton(x, ids, wt, w1, w3, w2, 10.0, before, cfg=c), y)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("fmt,dtype", [("nvfp4", torch.float16), ("nvfp4", torch.bfloat16), ("mxfp4", torch.bfloat16)])
def test_gpu_grouped_wgmma_ragged(fmt, dtype):
    """7 tokens over 16 small experts (most empty, every tile partial), an outlier token, no
    clamp; then the default route at 2048 tokens under a CUDA graph equals the eager call."""
    from dsv4lab.kernels.moe_prefill import moe_prefill_triton
    from dsv4lab.kernels.moe_prefill_ref import moe_prefill_ref

    w1, w3, w2, x, ids, wt = _moe_inputs(fmt, 16, T=7, k=3, H=256, I=192)
    x = x.to(dtype)
    x[2] *= 1e3
    y = moe_prefill_triton(x, ids, wt, w1, w3, w2, None, cfg={"WGMMA": True})
    _row_close(y, moe_prefill_ref(x, ids, wt, w1, w3, w2, None), 2e-2)

    w1, w3, w2, x, ids, wt = _moe_inputs(fmt, 16, T=2048, k=3, H=256, I=192)
    x = x.to(dtype)
    y = moe_prefill_triton(x, ids, wt, w1, w3, w2, 10.0)
    _row_close(y, moe_prefill_ref(x, ids, wt, w1, w3, w2, 10.0), 2e-2)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        yg = moe_prefill_triton(x, ids, wt, w1, w3, w2, 10.0)
    graph.replay()
    assert torch.equal(yg, y)
