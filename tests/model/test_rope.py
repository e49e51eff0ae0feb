"""Interleaved partial RoPE (dsv4lab/model/rope.py) against the oracle's rotary and apply_rotary_pos_emb.

Tolerances: frequencies bit for bit; rotations atol=1e-6, rtol=1e-6 (float32, same formula,
different association); inverse rotation atol=1e-5.
"""
from __future__ import annotations

import torch
from transformers.models.deepseek_v4.modeling_deepseek_v4 import apply_rotary_pos_emb

from dsv4lab.model.rope import Rotary, apply_rope, inverse_frequencies

ATOL, RTOL = 1e-6, 1e-6


def _x(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def test_inverse_frequencies_match_oracle(mixed):
    cfg, hf, _ = mixed
    for kind in ("main", "compress"):
        assert torch.equal(inverse_frequencies(cfg, kind), getattr(hf.model.rotary_emb, f"{kind}_inv_freq")), kind
    assert not torch.equal(inverse_frequencies(cfg, "main"), inverse_frequencies(cfg, "compress"))


def test_rotary_tables_match_oracle(mixed):
    cfg, hf, _ = mixed
    pos = torch.arange(0, 300, 7)
    for kind in ("main", "compress"):
        cos, sin = Rotary(cfg, kind)(pos)
        ref_cos, ref_sin = hf.model.rotary_emb(torch.zeros(1), position_ids=pos[None], layer_type=kind)
        torch.testing.assert_close(cos, ref_cos[0], atol=ATOL, rtol=RTOL)
        torch.testing.assert_close(sin, ref_sin[0], atol=ATOL, rtol=RTOL)


def test_apply_rope_matches_oracle_and_not_rotate_half(mixed):
    cfg, _, _ = mixed
    B, S, H, D = 2, 11, 4, cfg.head_dim
    x = _x(B, S, H, D)
    cos, sin = Rotary(cfg, "compress")(torch.arange(3, 3 + S))
    got = apply_rope(x, cos.unsqueeze(-2), sin.unsqueeze(-2))
    ref = apply_rotary_pos_emb(x.transpose(1, 2), cos[None], sin[None]).transpose(1, 2)  # oracle: [B,H,S,D]
    torch.testing.assert_close(got, ref, atol=ATOL, rtol=RTOL)
    rd = cos.shape[-1] * 2
    assert torch.equal(got[..., :-rd], x[..., :-rd])  # nope channels untouched
    # NeoX-style rotate-half (pairs i, i+rd/2) is the known wrong layout
    r = x[..., -rd:]
    a, b = r[..., : rd // 2], r[..., rd // 2:]
    c, s = cos.unsqueeze(-2), sin.unsqueeze(-2)
    half = torch.cat([x[..., :-rd], a * c - b * s, b * c + a * s], dim=-1)
    assert not torch.allclose(half, ref, atol=1e-3)


def test_rope_inverse_and_relative_position(mixed):
    cfg, _, _ = mixed
    rot = Rotary(cfg, "main")
    q, k = _x(cfg.head_dim, seed=1), _x(cfg.head_dim, seed=2)

    def at(v, p):
        cos, sin = rot(torch.tensor([p]))
        return apply_rope(v[None], cos, sin)[0]

    cos, sin = rot(torch.tensor([37]))
    torch.testing.assert_close(apply_rope(apply_rope(q[None], cos, sin), cos, -sin)[0], q, atol=1e-5, rtol=1e-5)
    # q.k after RoPE depends on the distance only
    torch.testing.assert_close(at(q, 50) @ at(k, 45), at(q, 105) @ at(k, 100), atol=1e-5, rtol=1e-5)
    assert not torch.allclose(at(q, 50) @ at(k, 45), at(q, 50) @ at(k, 40), atol=1e-3)
