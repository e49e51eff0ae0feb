"""Fewer decode launches (issue #24): the indexer's decode top-k kernel
(dsv4lab/kernels/indexer_topk.py) against ``dsv4lab.model.indexer.index_top_k_decode``, the
``Indexer.rope_kernel`` / ``.topk_kernel`` and layer ``RMSNorm.kernel`` slots, and the launch
inventory of a V4-Pro decode step (benchmarks/launch_inventory.py).

CPU: the kernel through Triton's interpreter in a subprocess (tests/indexer_topk_interp_check.py:
none / fewer than k / exactly k / more than k valid over several tiles, k > capacity, n_valid past
the capacity; ties take the lowest indices, -0.0 equals +0.0); the slots in a tiny model
(reference-equal callables: bitwise the reference logits; the selection in index order within
fp32 summation-order differences);
the inventory with stubbed launches (a kernel path that silently fell back adds aten ops).
GPU (@pytest.mark.gpu): V4-Pro shapes (k 512 / 1024 of up to 16384 entries), the same set as
torch.topk for distinct scores, CUDA-graph replay equal to eager.
"""
from __future__ import annotations


import pytest
import torch

from dsv4lab.kernels import install as install_mod
from dsv4lab.kernels.dispatch import index_top_k_decode, norm_rope, rms_norm
from dsv4lab.model.indexer import Indexer, index_top_k_decode as top_k_ref
from dsv4lab.model.norms import RMSNorm
from dsv4lab.workbench import random_model
from oracle_util import Counting, benchmark_module, decode_logits as _decode_logits, interp_check_result, random_ids, tiny_config



def test_interp_top_k_matches_reference():
    res = interp_check_result("indexer_topk_interp_check.py")
    cases = [k for k in res if not k.startswith("ties")]
    assert len(cases) == 7
    for case in cases:
        assert res[case] == {"same_set": True, "shape_ok": True, "dtype_ok": True, "index_order": True}, (case, res[case])
    assert res["ties"] == [0, 1, 2, 5]           # 2, 2, 1, then the first of the zeros (-0.0 == +0.0)
    assert res["ties_all_equal"] == [0, 1, 2, 3, 4]


@pytest.fixture(scope="module")
def tiny():
    cfg = tiny_config()
    return random_model(cfg, seed=3), random_ids(cfg, n=30, b=2)


def test_indexer_and_norm_slots_equal_the_reference(tiny):
    """Reference-equal callables in ``Indexer.rope_kernel`` / ``.topk_kernel`` (with the decode
    scores slot) and the layer norms' ``RMSNorm.kernel`` give the reference logits bitwise; a top-k
    in index order (the kernel's) within 1e-5 (the reference gathers the keys in selection order);
    ``hook_q`` keeps the queries' reference RoPE."""
    m, ids = tiny
    idxs = [i for i in m.modules() if isinstance(i, Indexer)]
    norms = [mod for n, mod in m.named_modules() if n.endswith(("attn_norm", "ffn_norm"))]
    ref = _decode_logits(m, ids)
    rope, topk, norm = Counting(norm_rope), Counting(index_top_k_decode), Counting(rms_norm)
    from dsv4lab.kernels.dispatch import index_scores_decode
    try:
        for ix in idxs:
            ix.decode_kernel, ix.rope_kernel, ix.topk_kernel = index_scores_decode, rope, topk
        for nm in norms:
            nm.kernel = norm
        assert torch.equal(_decode_logits(m, ids), ref)
        assert topk.calls == 6 * len(idxs) and rope.calls >= topk.calls and norm.calls > 0

        def index_order(scores, n_valid, k):   # the kernel's order: valid entries ascending, then -1
            idx = top_k_ref(scores, n_valid, k)
            return torch.where(idx < 0, idx.max() + 1, idx).sort(-1).values.masked_fill_(
                torch.arange(idx.shape[-1]) >= (idx >= 0).sum(-1, keepdim=True), -1)
        for ix in idxs:
            ix.topk_kernel = index_order
        got = _decode_logits(m, ids)   # the same keys gathered in another order: fp32 sums reordered
        assert (got - ref).abs().max() <= 1e-5 * ref.abs().max(), (got - ref).abs().max()
        with idxs[0].hook_q.register_forward_hook(lambda *a: None):
            assert not idxs[0].rope_takes_kernel() and idxs[-1 if len(idxs) > 1 else 0].rope_takes_kernel() == (len(idxs) > 1)
    finally:
        for ix in idxs:
            ix.decode_kernel = ix.rope_kernel = ix.topk_kernel = None
        for nm in norms:
            nm.kernel = None


def test_install_puts_norm_kernels_on_layer_norms_only(tiny, monkeypatch):
    """``install_kernels`` ("on CUDA", patched) gives the layer / final RMSNorms ``rms_norm`` and the
    indexers their three slots, never the norms inside an Attention or Compressor; disable clears."""
    m, _ = tiny
    monkeypatch.setattr(install_mod, "have_triton_cuda", lambda: True)
    monkeypatch.setattr(install_mod, "_on_cuda", lambda t: t is not None)
    monkeypatch.setattr(install_mod.pool_cute, "have_cute", lambda: False)
    try:
        install_mod.install_kernels(m)
        for name, mod in m.named_modules():
            if isinstance(mod, RMSNorm):
                inner = name.endswith(("q_norm", "kv_norm", "compressor.norm"))
                assert (mod.kernel is None) == inner, name
        ix = next(i for i in m.modules() if isinstance(i, Indexer))
        assert ix.topk_kernel is index_top_k_decode and ix.rope_kernel is norm_rope
    finally:
        install_mod.install_kernels(m, enable=False)
    assert all(getattr(mod, "kernel", None) is None for mod in m.modules() if isinstance(mod, RMSNorm))


def _inventory():
    return benchmark_module("launch_inventory")


@pytest.mark.parametrize("joined", [True, False], ids=["joined", "split"])
@pytest.mark.parametrize("layer,most", [("compressed_sparse_attention", 20), ("heavily_compressed_attention", 16)])
def test_launch_inventory_counts_a_v4_pro_step(layer, most, joined):
    """The inventory of one V4-Pro decode step (stubbed launches, 8 experts): every fused component
    launches its kernels, and the estimate stays within what it is today (the issue's budget: 60);
    a kernel path falling back to its reference would add aten ops (the indexer's top-k alone
    eight) and fail here. The MoE (routed + the folded shared expert) is one launch of up and down
    tiles and no x-pairs prelude (its input's pairs come from ffn_hc's launch, h's from the up tiles); no aten
    op is left, and no GEMV takes a prelude (wo_b's input pairs come from wo_a's launch); wq_a and
    wkv are one launch; the layer norms run in the mHC sites' launches (``norms_with``). Joined
    (``set_post_pre``, on by default, and the opt-in ``set_gate_route``), the attn expansion runs with
    the FFN pre and the router's gate with its route: two launches fewer; split, each site its pre and
    its post."""
    from dsv4lab.kernels import dispatch

    prev = dispatch.set_post_pre(joined), dispatch.set_gate_route(joined)
    try:
        inv = _inventory().inventory(layer, stub=True, experts=8)
    finally:
        dispatch.set_post_pre(prev[0]), dispatch.set_gate_route(prev[1])
    comps = inv["components"]
    assert inv["estimated_cuda_kernels"] <= most - 2 * joined, inv
    assert "attn_norm" not in comps and "ffn_norm" not in comps, sorted(comps)
    if joined:
        assert comps["attn_hc"] == {"triton": {"mhc_fused._hc_pre_kernel": 1, "mhc_fused._hc_post_pre_kernel": 1},
                                    "aten": {}}
        assert comps["ffn_hc"] == {"triton": {"mhc_fused._hc_post_kernel": 1}, "aten": {}}
        assert comps["mlp.router"] == {"triton": {"gate_route._gate_route_kernel": 1}, "aten": {}}
    else:
        for site in ("attn_hc", "ffn_hc"):
            assert comps[site] == {"triton": {"mhc_fused._hc_pre_kernel": 1, "mhc_fused._hc_post_kernel": 1},
                                   "aten": {}}
        assert "gate_route._gate_route_kernel" not in comps["mlp.router"]["triton"], comps["mlp.router"]
    assert comps["mlp"]["triton"] == {"moe_decode_tma._moe_fused_kernel": 1}, comps["mlp"]
    assert inv["aten_ops"] == 0, inv
    for lin in ("attn.wq_b", "attn.wo_b"):  # inputs from an emitting launch: the GEMV alone
        assert comps[lin]["triton"] == {"linear_nvfp4_tma._gemv_tma_kernel": 1}, (lin, comps[lin])
    assert comps["attn.wo_a"]["triton"] == {"linear_nvfp4_tma._gemv_tma_emit_kernel": 1}   # emits wo_b's pairs
    # wq_a and wkv of attn_norm's output: one paired launch from the attention, each linear takes its offer
    assert comps["attn"]["triton"]["linear_nvfp4_tma._gemv_tma_pair_kernel"] == 1, comps["attn"]
    assert "attn.wq_a" not in comps and "attn.wkv" not in comps, sorted(comps)
    assert not any(c.startswith(("mlp.shared_expert", "mlp.experts")) for c in comps), sorted(comps)
    if layer.startswith("compressed"):
        assert comps["attn.indexer"] == {"triton": {"indexer_decode._index_scores_kernel": 1,  # the q RoPE folded in
                                                    "indexer_topk._top_k_kernel": 1}, "aten": {}}


def test_launch_inventory_of_a_short_prefill():
    """``--prefill S``: one prefill of an S-token prompt, what every triage evaluation runs. The
    fused sites launch there too (mHC pre/post with the layer norms folded in, the GEMVs), and the
    count is recorded per component (the HCA layer: no indexer)."""
    inv = _inventory().inventory("heavily_compressed_attention", stub=True, experts=8, prefill=3)
    comps = inv["components"]
    assert inv["step"] == "prefill 3 tokens"
    assert comps["attn_hc"]["triton"] == {"mhc_fused._hc_pre_kernel": 1, "mhc_fused._hc_post_kernel": 1}
    assert "ffn_norm" not in comps and "attn_norm" not in comps, sorted(comps)
    assert inv["triton_launches"] >= 18 and inv["estimated_cuda_kernels"] > inv["triton_launches"]
    assert not any(c.startswith("attn.indexer") for c in comps)


# ----------------------------------------------------------------------------- GPU: V4-Pro shapes
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("B", [1, 4])
@pytest.mark.parametrize("T,n,k", [(1024, 250, 512), (1024, 1024, 512), (16384, 300, 1024), (16384, 1024, 1024),
                                   (16384, 5000, 1024), (16384, 16384, 1024), (16384, 16384, 512)])
def test_gpu_top_k_v4_pro_shapes(B, T, n, k):
    from dsv4lab.kernels.indexer_topk import index_top_k_decode_triton

    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(T + n)
    scores = torch.randn(B, 1, T, device=dev, generator=g)
    scores = scores.masked_fill(torch.arange(T, device=dev) >= n, float("-inf"))   # as the scores kernel writes
    nv = torch.tensor(n, device=dev)
    got = index_top_k_decode_triton(scores, nv, k)
    want = top_k_ref(scores, nv, k)
    assert torch.equal(got.sort(-1).values, want.sort(-1).values)
    valid = got[got >= 0].view(B, -1)
    assert bool((valid.diff(dim=-1) > 0).all())   # index order
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        index_top_k_decode_triton(scores, nv, k)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = index_top_k_decode_triton(scores, nv, k)
    nv.fill_(min(n + 7, T))                            # the count is read on the device at replay
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, index_top_k_decode_triton(scores, nv, k))


@pytest.mark.gpu
@gpu
def test_gpu_layer_norm_and_indexer_rope_v4_pro_shapes():
    """rms_norm at hidden 7168 and the indexer queries' RoPE (64 heads x 128, rope 64) against
    their references (one bf16 rounding apart at most)."""
    from dsv4lab.kernels.norm_rope_ref import norm_rope_ref
    from dsv4lab.model.norms import rms_norm as rms_ref

    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(1, 1, 7168, device=dev, generator=g).bfloat16() * 3
    w = (torch.rand(7168, device=dev, generator=g) + 0.5).bfloat16()
    u = 2.0 ** -7
    y, r = rms_norm(x, w, 1e-6).float(), rms_ref(x, w, 1e-6).float()
    assert ((y - r).abs() <= u * r.abs() + 2 * u * r.abs().max()).all()
    q = torch.randn(1, 1, 64, 128, device=dev, generator=g).bfloat16()
    inv = (1.0 / (160000.0 ** (torch.arange(0, 64, 2, dtype=torch.float) / 64))).to(dev)
    pos = torch.tensor([70000], device=dev)
    y, r = norm_rope(q, pos, inv).float(), norm_rope_ref(q, pos, inv).float()
    assert ((y - r).abs() <= u * r.abs() + 2 * u * r.abs().max()).all()
