"""Hyper-connections (dsv4lab/model/mhc.py): pre/post/comb, Sinkhorn, expansion, HyperHead, against
the oracle's DeepseekV4HyperConnection / DeepseekV4HyperHead / decoder-layer expansion on the
same weights, and the known wrong variants of dsv4lab/bugzoo/variants.py.

Tolerances: float32 against the oracle atol=1e-6, rtol=1e-6; a wrong variant must miss by more
than atol=1e-4.
"""
from __future__ import annotations

import copy

import torch

from dsv4lab.analysis.components import shallow_clone
from dsv4lab.bugzoo.variants import (MHCCombNotTransposed, MHCPreNoEps, MHCSinkhornFromExp, MHCSplitOrder,
                                     sinkhorn_from_exp)
from dsv4lab.model.mhc import HyperConnection, sinkhorn

ATOL, RTOL = 1e-6, 1e-6
WRONG = 1e-4


def _streams(cfg, seed=0, B=2, S=5):
    return torch.randn(B, S, cfg.hc_mult, cfg.hidden_size, generator=torch.Generator().manual_seed(seed))


def test_hyper_connection_matches_oracle(mixed):
    cfg, hf, ours = mixed
    for i in range(cfg.num_hidden_layers):
        for site in ("attn_hc", "ffn_hc"):
            h = _streams(cfg, seed=i)
            with torch.no_grad():
                post, comb, collapsed = getattr(ours.layers[i], site)(h)
                ref = getattr(hf.model.layers[i], site)(h)
            for got, want in zip((post, comb, collapsed), ref):
                torch.testing.assert_close(got, want, atol=ATOL, rtol=RTOL)


def test_wrong_mixes_miss_the_oracle(mixed):
    """hc_eps raised to 0.05 on both sides (a copy) so the eps-sized bugs (Sinkhorn from exp,
    pre without eps) show: the reference still matches, every wrong variant misses."""
    cfg, hf, ours = mixed
    h = _streams(cfg, seed=7)
    mine, ref_hc = copy.deepcopy(ours.layers[1].attn_hc), copy.deepcopy(hf.model.layers[1].attn_hc)
    mine.hc_eps = ref_hc.hc_eps = 0.05
    with torch.no_grad():
        ref = ref_hc(h)
        for got, want in zip(mine(h), ref):
            torch.testing.assert_close(got, want, atol=ATOL, rtol=RTOL)
        for cls in (MHCSplitOrder, MHCSinkhornFromExp, MHCPreNoEps):
            got = shallow_clone(mine, cls)(h)
            worst = max((g - w).abs().max().item() for g, w in zip(got, ref))
            assert worst > WRONG, cls.__name__


def test_sinkhorn_is_doubly_stochastic_and_starts_from_softmax():
    logits = torch.randn(6, 4, 4, generator=torch.Generator().manual_seed(1))
    comb = sinkhorn(logits, iters=100, eps=1e-6)
    ones = torch.ones(6, 4)
    torch.testing.assert_close(comb.sum(-2), ones, atol=1e-5, rtol=0)  # the last step normalises columns
    torch.testing.assert_close(comb.sum(-1), ones, atol=1e-3, rtol=0)
    assert (comb > 0).all()
    # one iteration = softmax over rows (+eps), then one column normalisation
    one = torch.softmax(logits, -1) + 1e-6
    torch.testing.assert_close(sinkhorn(logits, 1, 1e-6), one / (one.sum(-2, keepdim=True) + 1e-6), atol=ATOL, rtol=RTOL)
    assert not torch.allclose(sinkhorn_from_exp(logits, 2, 0.05), sinkhorn(logits, 2, 0.05), atol=WRONG)


def test_expand_uses_comb_transposed(mixed):
    cfg, hf, ours = mixed
    h = _streams(cfg, seed=3)
    out = torch.randn(2, 5, cfg.hidden_size, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        post, comb, _ = ours.layers[2].ffn_hc(h)
        got = ours.layers[2].ffn_hc.combine(h, out, post, comb)
    # the equation: new_k = post_k * out + sum_j comb[j, k] * stream_j
    want = post.unsqueeze(-1) * out.unsqueeze(-2) + torch.einsum("bsjk,bsjd->bskd", comb, h)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(comb, comb.transpose(-1, -2), atol=WRONG)  # direction matters
    wrong = MHCCombNotTransposed.expand(h, out, post, comb)
    assert (wrong - want).abs().max().item() > WRONG
    assert HyperConnection.expand is not MHCCombNotTransposed.expand


def test_hyper_head_matches_oracle(mixed):
    cfg, hf, ours = mixed
    h = _streams(cfg, seed=5)
    with torch.no_grad():
        torch.testing.assert_close(ours.hc_head(h), hf.model.hc_head(h), atol=ATOL, rtol=RTOL)
        plain_mean = h.mean(2)
        assert not torch.allclose(ours.hc_head(h), plain_mean, atol=WRONG)
