"""The normalised Walsh-Hadamard transform (Sylvester order), the rotation DeepSeek's reference
applies to the lightning indexer's queries and keys before their FP4 round trip.

    hadamard(x) = x @ H_d * d^-1/2,   H_1 = [1],  H_2n = [[H_n, H_n], [H_n, -H_n]]

H_d is symmetric and H_d H_d = d I, so the normalised transform is orthonormal and its own
inverse: scores q.k are unchanged by rotating both (up to rounding), but the FP4 round trip that
follows sees spread-out values. A butterfly (log2 d passes of adds), in fp32, no host syncs.
"""
from __future__ import annotations

import torch


def hadamard(x: torch.Tensor) -> torch.Tensor:
    """Normalised Walsh-Hadamard transform along the last dim (a power of two), math in fp32,
    result in ``x.dtype``."""
    d = x.shape[-1]
    if d < 1 or d & (d - 1):
        raise ValueError(f"hadamard needs a power-of-two last dim, got {d}")
    y = x.float().reshape(-1, d)
    h = 1
    while h < d:
        y = y.view(-1, d // (2 * h), 2, h)
        a, b = y[:, :, 0], y[:, :, 1]
        y = torch.stack([a + b, a - b], dim=2).view(-1, d)
        h *= 2
    return (y * d ** -0.5).view(x.shape).to(x.dtype)
