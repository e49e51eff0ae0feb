"""RMS norms as DSV4 computes them: statistics in fp32, weight applied in the input dtype."""
from __future__ import annotations

import torch
from torch import nn
from .component import Component


class RMSNorm(Component):
    """``kernel``: optional ``f(x, weight, eps)`` with ``rms_norm``'s math (``dsv4lab.kernels``:
    one launch instead of the reference's eight elementwise ones); not used in training with grad
    (the kernels have no backward)."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.kernel = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel is not None and not (self.training and torch.is_grad_enabled()):
            return self.kernel(x, self.weight, self.eps)
        return rms_norm(x, self.weight, self.eps)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm's math (also the reference of the fused kernels): the normalised value rounded to
    x's dtype, then times the weight (result in their promoted dtype)."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def unweighted_rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm without a weight (query heads, mHC input); the oracle rescales in x's dtype."""
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)
