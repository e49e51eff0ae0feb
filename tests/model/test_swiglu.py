"""clamped_swiglu (dsv4lab/model/swiglu.py) against the oracle's expert gate and the equation.

swiglu(g, u) = silu(clamp(g, max=L)) * clamp(u, -L, L). Tolerances: against the oracle's
``DeepseekV4Experts._apply_gate`` bit for bit (same ops); against the float64 equation
atol=1e-6, rtol=1e-6.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from dsv4lab.model.swiglu import clamped_swiglu


def _gu(seed=0, n=(64, 16), scale=3.0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*n, generator=g) * scale, torch.randn(*n, generator=g) * scale


def test_matches_oracle_expert_gate(mixed):
    cfg, hf, _ = mixed
    gate, up = _gu()
    experts = hf.model.layers[1].mlp.experts
    assert experts.limit == cfg.swiglu_limit
    ref = experts._apply_gate(torch.cat([gate, up], dim=-1))
    assert torch.equal(clamped_swiglu(gate, up, cfg.swiglu_limit), ref)


def test_equation_and_clamp_after_silu_differs_exactly_where_gate_exceeds_limit():
    L = 1.0
    gate, up = _gu(seed=1)
    got = clamped_swiglu(gate, up, L)
    g, u = gate.double().clamp(max=L), up.double().clamp(-L, L)
    torch.testing.assert_close(got.double(), g * torch.sigmoid(g) * u, atol=1e-6, rtol=1e-6)
    after = F.silu(gate).clamp(max=L) * up.clamp(-L, L)  # known wrong: clamps silu(g), not g
    differs = ~torch.isclose(got, after, atol=1e-6, rtol=1e-6)
    assert differs.any()
    assert torch.equal(differs, (gate > L) & (up != 0))


def test_no_limit_is_plain_swiglu():
    gate, up = _gu(seed=2)
    for limit in (None, 0.0):
        assert torch.equal(clamped_swiglu(gate, up, limit), F.silu(gate) * up)
    assert not torch.equal(clamped_swiglu(gate, up, 1.0), F.silu(gate) * up)


def test_keeps_dtype():
    gate, up = _gu(seed=3)
    out = clamped_swiglu(gate.bfloat16(), up.bfloat16(), 1.0)
    assert out.dtype == torch.bfloat16
