"""Lightning indexer (dsv4lab/model/indexer.py) against the oracle's DeepseekV4Indexer (stateless)
on the same weights: its compressed keys, the scores its DeepseekV4IndexerScorer computes, and
the chosen entries (-1 past the closed ones); per-head key slices and queries without RoPE are
the known wrong variants.

Tolerances: keys and scores float32 atol=1e-5, rtol=1e-5; chosen entries exact (as sets per
query); a wrong variant must miss by more than 1e-3.
"""
from __future__ import annotations

import torch

from dsv4lab.analysis.components import shallow_clone
from dsv4lab.bugzoo.variants import IndexerKeysPerHead, IndexerQNoRope
from oracle_util import capture

ATOL, RTOL = 1e-5, 1e-5
WRONG = 1e-3
LAYER = 1  # CSA, ratio 4
S = 42


def _run(mixed, seed=0, B=2):
    cfg, hf, ours = mixed
    g = torch.Generator().manual_seed(seed)
    x, q_res = torch.randn(B, S, cfg.hidden_size, generator=g), torch.randn(B, S, cfg.q_lora_rank, generator=g)
    hf_ix = hf.model.layers[LAYER].self_attn.compressor.indexer
    out = {}
    calls = capture({"scorer": hf_ix.scorer},
                    lambda: out.setdefault("idx", hf_ix(x, q_res, torch.arange(S)[None].expand(B, -1), None, LAYER)))
    ix = ours.layers[LAYER].attn.indexer
    st = ours.new_state(B, S).layers[LAYER].indexer
    with torch.no_grad():
        n = ix.compressor.prefill(x, 0, st)
    keys = st.entries[:, :n]
    return ix, x, q_res, keys, calls["scorer"][0], out["idx"]


def test_keys_scores_and_choice_match_oracle(mixed):
    cfg, _, _ = mixed
    ix, x, q_res, keys, scorer_call, ref_idx = _run(mixed)
    ref_q, ref_keys, _ = scorer_call.args
    assert keys.shape == ref_keys.shape == (2, S // ix.ratio, cfg.index_head_dim)
    torch.testing.assert_close(keys, ref_keys, atol=ATOL, rtol=RTOL)
    positions = torch.arange(S)
    with torch.no_grad():
        scores = ix.scores(x, q_res, positions, keys)
        torch.testing.assert_close(scores, scorer_call.output, atol=ATOL, rtol=RTOL)
        idx = ix.select(scores, (positions + 1) // ix.ratio)
    assert idx.shape == ref_idx.shape == (2, S, cfg.index_topk)
    assert torch.equal(idx.sort(-1).values, ref_idx.sort(-1).values)
    # early queries see fewer closed entries than top-k: the rest is -1; later ones choose k
    assert (idx[:, : ix.ratio - 1] == -1).all() and (idx[:, -1] >= 0).all()
    assert (idx < ((positions + 1) // ix.ratio).view(1, -1, 1)).all()


def test_wrong_scores_miss_the_oracle(mixed):
    ix, x, q_res, keys, scorer_call, _ = _run(mixed, seed=1)
    positions = torch.arange(S)
    for cls in (IndexerKeysPerHead, IndexerQNoRope):
        with torch.no_grad():
            bad = shallow_clone(ix, cls).scores(x, q_res, positions, keys)
        assert (bad - scorer_call.output).abs().max().item() > WRONG, cls.__name__
