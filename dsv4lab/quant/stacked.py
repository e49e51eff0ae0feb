"""Expert weights of one shape stacked along a leading expert dim, as the fused MoE decode reads them.

``StackedNVFP4`` (packed [E, N, K/2], e4m3 scales [E, N, K/16], global scales [E]) and
``StackedMXFP4`` (packed [E, N, K/2], E8M0 scales [E, N, K/32]: the official checkpoint's experts).
They live here, below the model and the kernels, so ``dsv4lab.model.moe`` can build them without
importing ``dsv4lab.kernels``. Build a stack once per layer (``stack_experts``), not per call.
Stacks are frozen: their tensors cannot be reassigned, so a kernel may keep what it derives from
a stack (TMA descriptors) on the stack object for as long as it lives.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .weights import MXFP4Weight, NVFP4Weight


@dataclass(frozen=True)
class StackedNVFP4:
    """E NVFP4 weights of one shape [N, K] stacked along a leading expert dim."""

    packed: torch.Tensor  # uint8 [E, N, K/2]
    block_scale: torch.Tensor  # float8_e4m3fn [E, N, K/16]
    global_scale: torch.Tensor  # float32 [E]

    @classmethod
    def from_weights(cls, ws) -> "StackedNVFP4":
        return cls(torch.stack([w.packed for w in ws]), torch.stack([w.block_scale for w in ws]),
                   torch.stack([w.global_scale.reshape(()).float() for w in ws]))

    @property
    def shape(self) -> tuple[int, int, int]:
        e, n, kh = self.packed.shape
        return e, n, kh * 2

    def weight(self, e: int) -> NVFP4Weight:
        """Expert ``e`` as an ``NVFP4Weight`` (views, no copy)."""
        return NVFP4Weight(self.packed[e], self.block_scale[e], self.global_scale[e])


@dataclass(frozen=True)
class StackedMXFP4:
    """E MXFP4 weights (the official checkpoint's experts) of one shape [N, K] stacked along a
    leading expert dim; only the TMA-fed decode (``dsv4lab.kernels.moe_decode_tma``) takes them."""

    packed: torch.Tensor  # uint8 [E, N, K/2]
    scale: torch.Tensor  # E8M0 [E, N, K/32]

    @classmethod
    def from_weights(cls, ws) -> "StackedMXFP4":
        return cls(torch.stack([w.packed for w in ws]), torch.stack([w.scale for w in ws]))

    @property
    def shape(self) -> tuple[int, int, int]:
        e, n, kh = self.packed.shape
        return e, n, kh * 2

    def weight(self, e: int) -> MXFP4Weight:
        """Expert ``e`` as an ``MXFP4Weight`` (views, no copy)."""
        return MXFP4Weight(self.packed[e], self.scale[e])


Stacked = StackedNVFP4 | StackedMXFP4


def stack_one(w) -> Stacked:
    """One ``NVFP4Weight`` / ``MXFP4Weight`` as a one-expert stack of views (no copy): the shared
    expert, run beside the routed stacks by the MoE decode kernels."""
    fmt = getattr(w, "format", None)
    if fmt == "nvfp4":
        return StackedNVFP4(w.packed.unsqueeze(0), w.block_scale.unsqueeze(0), w.global_scale.reshape(1).float())
    if fmt == "mxfp4":
        return StackedMXFP4(w.packed.unsqueeze(0), w.scale.unsqueeze(0))
    raise ValueError(f"stack_one: a one-expert stack needs an NVFP4 or MXFP4 weight, got format {fmt!r}")


def stack_experts(ws) -> Stacked:
    """A list of per-expert weights of one format as ``StackedNVFP4`` or ``StackedMXFP4``."""
    fmts = {getattr(w, "format", None) for w in ws}
    if fmts == {"nvfp4"}:
        return StackedNVFP4.from_weights(ws)
    if fmts == {"mxfp4"}:
        return StackedMXFP4.from_weights(ws)
    raise ValueError(f"cannot stack expert weights of formats {sorted(map(str, fmts))}")
