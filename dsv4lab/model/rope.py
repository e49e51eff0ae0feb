"""Interleaved partial RoPE on the LAST ``rope_dim`` channels of each head.

Two thetas: ``main`` (sliding-only layers) and ``compress`` (CSA/HCA layers, their compressors
and indexer). YaRN (compress rope of the real checkpoints) takes its inverse frequencies from
transformers' own rope initialiser so the numbers are the oracle's.
"""
from __future__ import annotations

import torch

from ..config import DSV4Config
from .component import Component


def inverse_frequencies(config: DSV4Config, kind: str) -> torch.Tensor:
    dim = config.qk_rope_head_dim
    base = config.rope_theta if kind == "main" else config.compress_rope_theta
    if kind == "compress" and config.rope_scaling and config.rope_scaling.get("rope_type", config.rope_scaling.get("type")) == "yarn":
        from transformers import DeepseekV4Config  # lazy: heavy optional dependency
        from transformers.modeling_rope_utils import (
            ROPE_INIT_FUNCTIONS,  # lazy: heavy optional dependency
        )

        hf = DeepseekV4Config(**{k: v for k, v in config.to_transformers_dict().items()
                                 if k not in ("architectures", "model_type")})
        inv, _ = ROPE_INIT_FUNCTIONS["yarn"](hf, None, layer_type="compress")
        return inv.float()
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))


class Rotary(Component):
    """cos/sin tables per position (computed on the fly: positions may be device tensors)."""

    def __init__(self, config: DSV4Config, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.register_buffer("inv_freq", inverse_frequencies(config, kind), persistent=False)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [..., S] (any int/float dtype) -> cos, sin [..., S, rope_dim/2] in fp32."""
        return rope_angles(positions, self.inv_freq)


def rope_angles(positions: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [..., S, rope_dim/2] (fp32) of the angles positions * inv_freq, both in fp32."""
    freqs = positions.float().unsqueeze(-1) * inv_freq.float()
    return freqs.cos(), freqs.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate consecutive channel pairs of the trailing rope slice of x.

    x [..., S, (heads,) D]; cos/sin broadcastable to [..., S, (1,) rope_dim/2]. Math in fp32,
    result in x's dtype, nope channels untouched.
    """
    rd = cos.shape[-1] * 2
    nope, rope = x[..., :-rd], x[..., -rd:]
    r = rope.float().unflatten(-1, (-1, 2))
    x1, x2 = r[..., 0], r[..., 1]
    o1 = x1 * cos - x2 * sin
    o2 = x2 * cos + x1 * sin
    rotated = torch.stack((o1, o2), dim=-1).flatten(-2).to(x.dtype)
    return torch.cat([nope, rotated], dim=-1)
