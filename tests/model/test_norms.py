"""RMSNorm / unweighted_rms_norm (dsv4lab/model/norms.py) against the oracle's norms and the equation.

Tolerances: float32 against the oracle atol=1e-6, rtol=1e-6 (same math, same order); against
the float64 equation atol=1e-5, rtol=1e-5; the bf16 rules are checked bit for bit.
"""
from __future__ import annotations

import torch
from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4RMSNorm, DeepseekV4UnweightedRMSNorm

from dsv4lab.model.norms import RMSNorm, unweighted_rms_norm

ATOL, RTOL = 1e-6, 1e-6


def _x(*shape, seed=0, scale=3.0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


def test_rms_norm_matches_oracle_modules(mixed):
    cfg, hf, ours = mixed
    pairs = [(ours.norm, hf.model.norm, cfg.hidden_size),
             (ours.layers[1].attn.q_norm, hf.model.layers[1].self_attn.q_a_norm, cfg.q_lora_rank),
             (ours.layers[2].attn.kv_norm, hf.model.layers[2].self_attn.kv_norm, cfg.head_dim)]
    for mine, ref, dim in pairs:
        assert not torch.equal(mine.weight, torch.ones_like(mine.weight))  # a weight that matters
        x = _x(2, 5, dim)
        with torch.no_grad():
            torch.testing.assert_close(mine(x), ref(x), atol=ATOL, rtol=RTOL)


def test_rms_norm_equation_and_wrong_eps_placement():
    norm = RMSNorm(24, eps=0.5)  # a large eps so where it sits is visible
    with torch.no_grad():
        norm.weight.copy_(1 + 0.3 * _x(24, seed=1, scale=1.0))
    x = _x(3, 24, scale=0.5)
    xd, wd = x.double(), norm.weight.double()
    want = wd * xd / torch.sqrt(xd.pow(2).mean(-1, keepdim=True) + 0.5)
    with torch.no_grad():
        got = norm(x)
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)
    eps_outside = wd * xd / (torch.sqrt(xd.pow(2).mean(-1, keepdim=True)) + 0.5)
    assert not torch.allclose(got.double(), eps_outside, atol=1e-5, rtol=1e-5)


def test_rms_norm_bf16_statistics_in_fp32():
    norm = RMSNorm(64).bfloat16()
    with torch.no_grad():
        norm.weight.copy_(1 + 0.3 * _x(64, seed=2, scale=1.0))
    x = _x(16, 64, seed=3).bfloat16()
    with torch.no_grad():
        got = norm(x)
    h = x.float()
    want = norm.weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + norm.eps)).to(torch.bfloat16)
    assert got.dtype == torch.bfloat16 and torch.equal(got, want)
    stats_in_bf16 = norm.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.eps))
    assert not torch.equal(got, stats_in_bf16)


def test_unweighted_rms_norm_matches_oracle_bitwise():
    oracle = DeepseekV4UnweightedRMSNorm(eps=1e-6)
    for dtype in (torch.float32, torch.bfloat16):
        x = _x(4, 7, 48, seed=4).to(dtype)
        got = unweighted_rms_norm(x, 1e-6)
        assert got.dtype == dtype and torch.equal(got, oracle(x)), dtype
    x = _x(64, 48, seed=5).bfloat16()
    in_fp32 = (x.float() * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + 1e-6)).to(x.dtype)
    assert not torch.equal(unweighted_rms_norm(x, 1e-6), in_fp32)  # the oracle rescales in x's dtype


def test_weighted_norm_equals_oracle_standalone():
    mine, ref = RMSNorm(32, 1e-6), DeepseekV4RMSNorm(32, 1e-6)
    w = 1 + 0.3 * _x(32, seed=6, scale=1.0)
    with torch.no_grad():
        mine.weight.copy_(w)
        ref.weight.copy_(w)
        x = _x(3, 32, seed=7)
        torch.testing.assert_close(mine(x), ref(x), atol=ATOL, rtol=RTOL)
