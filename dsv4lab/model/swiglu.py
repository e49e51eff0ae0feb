"""The DSV4 clamped SwiGLU, once: every expert path (reference, stacked decode, kernels' oracle) calls it.

    swiglu(g, u) = silu(clamp(g, max=L)) * clamp(u, -L, L)

The clamp comes BEFORE SiLU (seeds/000: an engine that clamped silu(g) instead diverged only
where g > L). ``limit=None`` (or <= 0) means no clamp, as in configs without ``swiglu_limit``.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float | None) -> torch.Tensor:
    """silu(gate clamped above at limit) * (up clamped to [-limit, limit]), in the inputs' dtype."""
    if limit is not None and limit > 0:
        gate = gate.clamp(max=limit)
        up = up.clamp(min=-limit, max=limit)
    return F.silu(gate) * up
