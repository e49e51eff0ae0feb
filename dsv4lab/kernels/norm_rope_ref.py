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
                  inplace: bool = False, ring: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., S, H, D]: RMS norm per head (``eps`` None: none; ``weight`` None: unweighted), RoPE
    on the last 2 * len(inv_freq) channels at ``positions`` [S] (``inverse``: at -pos), then the
    ``kv_fp8`` round trip of the other channels. ``inplace`` allows an implementation to reuse x's
    storage (the caller drops x); the reference always returns a new tensor. ``ring`` [B, W, D]
    (x [B, S, 1, D], S <= W: the decode's shared K=V head): the result is also written at the ring
    slots ``positions % W``, in the ring's dtype (the decode's sliding-window write)."""
    if ring is not None:
        check_ring(x, positions, ring)
    if eps is not None:
        x = unweighted_rms_norm(x, eps) if weight is None else rms_norm(x, weight, eps)
    cos, sin = rope_angles(positions, inv_freq)
    x = apply_rope(x, cos.unsqueeze(-2), (-sin if inverse else sin).unsqueeze(-2))
    y = kv_fp8_round_trip(x, 2 * cos.shape[-1]) if fp8_nope else x
    if ring is not None:
        ring.index_copy_(1, positions % ring.shape[1], y.squeeze(-2).to(ring.dtype))
    return y


norm_rope_ref.takes_ring = True  # callers may hand it the decode ring (``Attention.decode``)


def check_ring(x: torch.Tensor, positions: torch.Tensor, ring: torch.Tensor) -> None:
    """``ring=`` needs x [B, S, 1, D] and a ring [B, W, D] on x's device with S <= W."""
    if not (x.dim() == 4 and x.shape[-2] == 1 and ring.dim() == 3 and ring.shape[0] == x.shape[0]
            and ring.shape[2] == x.shape[-1] and positions.numel() <= ring.shape[1] and ring.device == x.device):
        raise ValueError(f"norm_rope: ring= needs x [B, S, 1, D] and a ring [B, W, D] on x's device with "
                         f"S <= W; got x {tuple(x.shape)} on {x.device}, ring {tuple(ring.shape)} on {ring.device}, "
                         f"{positions.numel()} positions")
