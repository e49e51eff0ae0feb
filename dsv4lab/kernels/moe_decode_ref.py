"""PyTorch reference of the routed-experts decode (what ``moe_decode`` / ``moe_decode_tma`` replace).

Per (token, expert): dequantise the expert's weights and run the DSV4 expert exactly as
``dsv4lab.model.moe.Expert`` does (linears in x.dtype, ``clamped_swiglu``), weighted sum in x.dtype.
No triton: ``dsv4lab.kernels.dispatch.moe_decode`` runs it wherever the kernels cannot.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from ..model.swiglu import clamped_swiglu
from ..quant.stacked import Stacked


def _routed_loop(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                 dense: Callable[[str, int], torch.Tensor], limit: float | None) -> torch.Tensor:
    """The per-(token, expert) loop both references share; ``dense(name, e)`` is expert e's
    ``w1`` / ``w3`` / ``w2`` weight in x.dtype. Reads ids on the host (not graph-safe)."""
    ids_h = ids.tolist()
    ys = []
    for t in range(x.shape[0]):
        acc = torch.zeros_like(x[t])
        xt = x[t:t + 1]
        for j, e in enumerate(ids_h[t]):
            gate = F.linear(xt, dense("w1", e))
            up = F.linear(xt, dense("w3", e))
            y = F.linear(clamped_swiglu(gate, up, limit), dense("w2", e))[0]
            acc = acc + y * weights[t, j].to(y.dtype)
        ys.append(acc)
    return torch.stack(ys) if ys else x.new_empty(0, x.shape[-1])


def moe_decode_ref(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w1: Stacked,
                   w3: Stacked, w2: Stacked, limit: float | None) -> torch.Tensor:
    """x [T, H], ids / weights [T, k], stacks ``StackedNVFP4`` or ``StackedMXFP4`` -> [T, H] in x.dtype."""
    stacks = {"w1": w1, "w3": w3, "w2": w2}
    return _routed_loop(x, ids, weights, lambda name, e: stacks[name].weight(e).dequantize(x.dtype), limit)


def moe_decode_plain_ref(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w1: torch.Tensor,
                         w3: torch.Tensor, w2: torch.Tensor, limit: float | None) -> torch.Tensor:
    """``moe_decode_ref`` for unquantised stacks w1 / w3 [E, I, H], w2 [E, H, I] (taken in x.dtype,
    as ``QLinear.dense_weight``): what ``moe_decode_plain`` replaces."""
    stacks = {"w1": w1, "w3": w3, "w2": w2}
    return _routed_loop(x, ids, weights, lambda name, e: stacks[name][e].to(x.dtype), limit)
