"""Deterministic random weights that exercise every mechanism (tests, demos, training init)."""
from __future__ import annotations

import torch

from ..config import DSV4Config


@torch.no_grad()
def randomize_(model, seed: int = 0, std: float | None = None) -> "torch.nn.Module":
    """Fill all weights with seeded random values: linears ~ N(0, 1/in), norms ~ 1 + 0.3 N,
    mHC/sink/ape/biases ~ 0.3 N, mHC scales ~ 1 + 0.3 N, hash tables random expert sets."""
    cfg: DSV4Config = model.config
    g = torch.Generator().manual_seed(seed)

    def rnd(shape):
        return torch.randn(shape, generator=g)

    for name, p in model.named_parameters():
        if p.ndim >= 2:
            s = std if std is not None else p.shape[-1] ** -0.5
            val = rnd(p.shape) * s
        elif name.endswith("scale"):
            val = 1.0 + 0.3 * rnd(p.shape)
        elif "norm" in name:
            val = 1.0 + 0.3 * rnd(p.shape)
        else:
            val = 0.3 * rnd(p.shape)
        p.copy_(val.to(p.dtype))
    for name, b in model.named_buffers():
        if name.endswith("tid2eid"):
            b.copy_(torch.stack([torch.randperm(cfg.n_routed_experts, generator=g)[: cfg.num_experts_per_tok]
                                 for _ in range(b.shape[0])]))
        elif name.endswith("router.bias"):
            b.copy_(0.1 * rnd(b.shape))
    for _, ql in model.qlinears():
        ql._dense_cache = None
    return model

