"""KV compressor (dsv4lab/model/compressor.py), HCA and CSA, against the oracle's
DeepseekV4HCACompressor / DeepseekV4CSACompressor (stateless) on the same weights; decode token
by token and chunked prefill build the same entries; ``ape`` on C is the known wrong variant.

Tolerances: float32 atol=1e-5, rtol=1e-5; a wrong variant must miss by more than 1e-3.
"""
from __future__ import annotations

import pytest
import torch

from dsv4lab.analysis.components import shallow_clone
from dsv4lab.bugzoo.variants import CompressorApeOnKV

ATOL, RTOL = 1e-5, 1e-5
WRONG = 1e-3
LAYERS = {"csa": 1, "hca": 2}
S = 42  # not a multiple of either ratio: an open window is left over


def _inputs(cfg, seed=0, B=2):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, S, cfg.hidden_size, generator=g), torch.randn(B, S, cfg.q_lora_rank, generator=g)


def _oracle_entries(hf, layer, x, q_res):
    comp = hf.model.layers[layer].self_attn.compressor
    with torch.no_grad():
        kv, _ = comp(x, q_res, torch.arange(S)[None].expand(x.shape[0], -1), None, layer)
    return kv[:, 0]  # [B, T, d]


def _prefill(ours, layer, x, comp=None):
    comp = comp or ours.layers[layer].attn.compressor
    st = ours.new_state(x.shape[0], S).layers[layer].compressor
    with torch.no_grad():
        n = comp.prefill(x, 0, st)
    return st.entries[:, :n]


@pytest.mark.parametrize("kind", sorted(LAYERS))
def test_prefill_entries_match_oracle(mixed, kind):
    cfg, hf, ours = mixed
    layer = LAYERS[kind]
    comp = ours.layers[layer].attn.compressor
    assert comp.overlap == (kind == "csa") and comp.ape.abs().max() > 0
    x, q_res = _inputs(cfg, seed=layer)
    want = _oracle_entries(hf, layer, x, q_res)
    got = _prefill(ours, layer, x)
    assert got.shape == want.shape == (2, S // comp.ratio, cfg.head_dim)
    torch.testing.assert_close(got, want, atol=ATOL, rtol=RTOL)
    bad = _prefill(ours, layer, x, shallow_clone(comp, CompressorApeOnKV))
    assert (bad - want).abs().max().item() > WRONG


@pytest.mark.parametrize("kind", sorted(LAYERS))
def test_chunked_prefill_and_decode_build_the_same_entries(mixed, kind):
    cfg, hf, ours = mixed
    layer = LAYERS[kind]
    comp = ours.layers[layer].attn.compressor
    x, q_res = _inputs(cfg, seed=10 + layer)
    want = _oracle_entries(hf, layer, x, q_res)
    st = ours.new_state(2, S).layers[layer].compressor
    with torch.no_grad():
        comp.prefill(x[:, :7], 0, st)      # ends inside a window
        comp.prefill(x[:, 7:19], 7, st)
        for t in range(19, S):
            n = comp.decode(x[:, t : t + 1], torch.tensor(t), st)
    assert int(n) == S // comp.ratio
    torch.testing.assert_close(st.entries[:, : int(n)], want, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("kind", sorted(LAYERS))
def test_rope_kernel_slot_matches_the_oracle(mixed, kind):
    """``Compressor.rope_kernel`` (the fused norm + RoPE of the pooled entries; here the dispatcher,
    which on CPU runs ``norm_rope_ref``) gives the oracle's entries, is called once a prefill, and
    a replaced norm keeps the unfused path."""
    from dsv4lab.kernels import dispatch
    from dsv4lab.model.norms import RMSNorm

    cfg, hf, ours = mixed
    layer = LAYERS[kind]
    comp = ours.layers[layer].attn.compressor
    x, q_res = _inputs(cfg, seed=20 + layer)
    want = _oracle_entries(hf, layer, x, q_res)
    calls = []
    comp.rope_kernel = lambda *a, **k: (calls.append(k), dispatch.norm_rope(*a, **k))[1]
    try:
        got = _prefill(ours, layer, x)
        assert len(calls) == 1 and calls[0]["fp8_nope"] is False
        torch.testing.assert_close(got, want, atol=ATOL, rtol=RTOL)
        norm = comp.norm
        comp.norm = type("OtherNorm", (RMSNorm,), {})(norm.weight.shape[0], norm.eps)
        comp.norm.load_state_dict(norm.state_dict())
        assert not comp.fused_norm_rope()
        torch.testing.assert_close(_prefill(ours, layer, x), want, atol=ATOL, rtol=RTOL)
        assert len(calls) == 1
        comp.norm = norm
    finally:
        comp.rope_kernel = None
