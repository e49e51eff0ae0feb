"""randomize_ / random_model (dsv4lab/model/init.py): seeded, deterministic weights of the documented
distributions, so every mechanism (sinks, ape, mHC, router bias, hash tables) is exercised."""
from __future__ import annotations

import torch

from dsv4lab.workbench import random_model
from oracle_util import tiny_config


def test_seeded_deterministic_and_documented_ranges():
    cfg = tiny_config()
    a, b, c = random_model(cfg, seed=3), random_model(cfg, seed=3), random_model(cfg, seed=4)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert any(not torch.equal(sa[k], sc[k]) for k in sa if sa[k].is_floating_point())
    lin = a.layers[1].attn.wq_b.weight
    assert abs(lin.std().item() - lin.shape[-1] ** -0.5) < 0.3 * lin.shape[-1] ** -0.5  # ~ N(0, 1/in)
    norm = a.layers[1].attn.kv_norm.weight
    assert abs(norm.mean().item() - 1.0) < 0.2 and norm.std().item() > 0.1  # ~ 1 + 0.3 N
    for t in (a.layers[1].attn.sink, a.layers[1].attn.compressor.ape, a.layers[1].attn_hc.base, a.layers[1].mlp.router.bias):
        assert t.abs().max() > 0
    tid2eid = a.layers[0].mlp.router.tid2eid
    assert tid2eid.shape == (cfg.vocab_size, cfg.num_experts_per_tok)
    assert all(len(set(row.tolist())) == cfg.num_experts_per_tok for row in tid2eid)  # distinct experts per token
