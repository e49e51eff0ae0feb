"""Prefill at scale (issue #25): the indexer's prefill scores kernel (dsv4lab/kernels/indexer_prefill.py)
against ``dsv4lab.model.indexer.index_scores_prefill``, and the ``Indexer.prefill_kernel`` slot.

CPU: the kernel through Triton's interpreter in a subprocess (tests/indexer_prefill_interp_check.py:
a first chunk whose late tiles are closed for every query, a late chunk, odd head / dim sizes, bf16);
the slot in a tiny model (the dispatcher runs the reference on CPU: chunked prefill logits bitwise the
slot-free ones, the slot called once per CSA layer and block, not while an indexer hook listens).
GPU (@pytest.mark.gpu): V4-Pro shapes (64 heads x 128, 4096 entries), scores within fp32
summation-order differences and the same top-k sets; a tiny model's prefill on the GPU equal.
"""
from __future__ import annotations

import pytest
import torch

from dsv4lab.kernels.dispatch import index_scores_prefill
from dsv4lab.model.indexer import Indexer, index_scores_prefill as scores_ref, top_k_valid
from dsv4lab.workbench import random_model
from oracle_util import Counting, interp_check_result, random_ids, tiny_config

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (run on the device machine)")


def test_interp_prefill_scores_match_reference():
    res = interp_check_result("indexer_prefill_interp_check.py")
    assert sorted(res) == ["bf16", "first_chunk", "late_chunk", "odd_heads"]
    for name, r in res.items():
        assert r["shape_ok"] and r["inf_pattern_ok"] and r["same_topk"], (name, r)
        assert r["max_abs"] <= 1e-5 * max(r["scale"], 1.0), (name, r)


def _prefill_logits(m, ids, chunk):
    st = m.new_state(ids.shape[0], ids.shape[1])
    with torch.no_grad():
        return m.prefill(ids, st, chunk=chunk)


def test_prefill_slot_keeps_the_logits_and_steps_aside_for_hooks():
    cfg = tiny_config()
    m = random_model(cfg, seed=3)
    ids = random_ids(cfg, n=48, b=2)
    idxs = [i for i in m.modules() if isinstance(i, Indexer)]
    assert idxs, "the tiny config has CSA layers"
    ref = _prefill_logits(m, ids, chunk=16)
    slots = [Counting(index_scores_prefill) for _ in idxs]
    try:
        for ix, slot in zip(idxs, slots):
            ix.prefill_kernel = slot
        got = _prefill_logits(m, ids, chunk=16)
        assert torch.equal(got, ref)
        assert all(s.calls >= 1 for s in slots)
        before = [s.calls for s in slots]
        with idxs[0].hook_scores.register_forward_hook(lambda *a: None):
            assert not idxs[0].prefill_takes_kernel()
            _prefill_logits(m, ids, chunk=16)
        assert slots[0].calls == before[0]                                   # hooked: the reference
        assert all(s.calls > b for s, b in zip(slots[1:], before[1:]))       # the others keep the slot
        m.train()
        with torch.enable_grad():
            assert not idxs[0].prefill_takes_kernel()  # training with grad: the reference (distillation)
        m.eval()
        assert idxs[0].prefill_takes_kernel()
    finally:
        for ix in idxs:
            ix.prefill_kernel = None


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_prefill_scores_v4_pro_shapes_on_gpu(dtype):
    from dsv4lab.kernels.indexer_prefill import index_scores_prefill_triton

    g = torch.Generator(device="cuda").manual_seed(0)
    B, S, T, HI, DI, start, ratio = 1, 512, 4096, 64, 128, 16384 - 512, 4
    q = torch.randn(B, S, HI, DI, device="cuda", generator=g).to(dtype)
    w = torch.randn(B, S, HI, device="cuda", generator=g).to(dtype)
    keys = torch.randn(B, T, DI, device="cuda", generator=g).to(dtype)
    n_valid = (torch.arange(start, start + S, device="cuda") + 1) // ratio
    want = scores_ref(q, w, keys, n_valid, HI ** -0.5)
    got = index_scores_prefill_triton(q, w, keys, n_valid, HI ** -0.5)
    fin = torch.isfinite(want)
    assert torch.equal(fin, torch.isfinite(got))
    assert (got[fin] - want[fin]).abs().max() <= 1e-5 * want[fin].abs().max()
    a, b = top_k_valid(got, n_valid, 1024).sort(-1).values, top_k_valid(want, n_valid, 1024).sort(-1).values
    assert (a == b).all(-1).float().mean() >= 0.95  # near-ties at the k-th score may swap in a few rows


@pytest.mark.gpu
@cuda
def test_prefill_slot_on_gpu_keeps_the_logits():
    cfg = tiny_config()
    m = random_model(cfg, seed=3, device="cuda")
    ids = random_ids(cfg, n=48, b=2).cuda()
    ref = _prefill_logits(m, ids, chunk=16)
    idxs = [i for i in m.modules() if isinstance(i, Indexer)]
    try:
        for ix in idxs:
            ix.prefill_kernel = index_scores_prefill
        got = _prefill_logits(m, ids, chunk=16)
    finally:
        for ix in idxs:
            ix.prefill_kernel = None
    assert (got - ref).abs().max() <= 1e-4 * ref.abs().max()
