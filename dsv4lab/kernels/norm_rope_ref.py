"""The PyTorch reference of ``norm_rope``'s fused launches, composed of the model's own functions
(the same calls ``Attention._q_kv`` / ``_output`` make), so a CPU model with these installed in its
slots computes the reference bit for bit."""
from __future__ import annotations

import torch

from ..model.norms import rms_norm, unweighted_rms_norm
from ..model.rope import apply_rope, rope_angles
from ..model.roundtrips import kv_fp8_round_trip


def norm_rope_ref(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, eps: float | None = None,
                  weight: torch.Tensor | None = None, inverse: bool = False, fp8_nope: bool = False,
                  inplace: bool = False) -> torch.Tensor:
    """x [..., S, H, D]: RMS norm per head (``eps`` None: none; ``weight`` None: unweighted), RoPE
    on the last 2 * len(inv_freq) channels at ``positions`` [S] (``inverse``: at -pos), then the
    ``kv_fp8`` round trip of the other channels. ``inplace`` allows an implementation to reuse x's
    storage (the caller drops x); the reference always returns a new tensor."""
    if eps is not None:
        x = unweighted_rms_norm(x, eps) if weight is None else rms_norm(x, weight, eps)
    cos, sin = rope_angles(positions, inv_freq)
    x = apply_rope(x, cos.unsqueeze(-2), (-sin if inverse else sin).unsqueeze(-2))
    return kv_fp8_round_trip(x, 2 * cos.shape[-1]) if fp8_nope else x
