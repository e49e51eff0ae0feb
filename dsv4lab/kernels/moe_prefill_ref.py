"""PyTorch reference of the routed-experts prefill (what ``moe_prefill.moe_prefill_triton`` replaces).

Per hit expert, its tokens through the dequantised expert exactly as ``dsv4lab.model.moe.Experts``'
sparse path does (linears in x.dtype, ``clamped_swiglu``, the routing weight before w2 or on the
output), accumulated with ``index_add_`` in expert order. No triton: ``dsv4lab.kernels.dispatch.moe_prefill``
runs it wherever the kernel cannot.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..model.swiglu import clamped_swiglu
from ..quant.stacked import Stacked


def moe_prefill_ref(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w1: Stacked, w3: Stacked,
                    w2: Stacked, limit: float | None, weight_before_w2: bool = False) -> torch.Tensor:
    """x [T, H], ids / weights [T, k], stacks ``StackedNVFP4`` or ``StackedMXFP4`` -> [T, H] in
    x.dtype. Reads the hit experts on the host (not graph-safe; it is the reference)."""
    out = torch.zeros_like(x)
    dt = x.dtype
    for e in torch.unique(ids).tolist():
        pos_t, pos_k = torch.where(ids == e)
        w_e = weights[pos_t, pos_k, None]
        xe = x[pos_t]
        h = clamped_swiglu(F.linear(xe, w1.weight(e).dequantize(dt)), F.linear(xe, w3.weight(e).dequantize(dt)), limit)
        if weight_before_w2:
            h = h * w_e.to(h.dtype)
        y = F.linear(h, w2.weight(e).dequantize(dt))
        out.index_add_(0, pos_t, (y if weight_before_w2 else y * w_e.to(y.dtype)).to(out.dtype))
    return out
