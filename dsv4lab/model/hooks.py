"""Named hook points: identity modules whose dotted path is the hook name.

A hook point is an ``nn.Module`` so the standard ``register_forward_hook`` works (a hook may
return a replacement tensor) and its name is stable: ``layers.3.attn.hook_q``. Components ask
``hp.active`` before computing anything expensive only a hook would read.
"""
from __future__ import annotations

import torch
from .component import Component


class HookPoint(Component):
    """Identity tap; forward hooks registered on it see (and may replace) the tensor."""

    def __init__(self, meaning: str = "") -> None:
        super().__init__()
        self.meaning = meaning

    @property
    def active(self) -> bool:
        return bool(self._forward_hooks) or bool(self._forward_pre_hooks)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x
