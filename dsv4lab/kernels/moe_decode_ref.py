"""PyTorch reference of the routed-experts decode (what ``moe_decode`` / ``moe_decode_tma`` replace).

Per (token, expert): dequantise the expert's weights and run the DSV4 expert exactly as
``dsv4lab.model.moe.Expert`` does (linears in x.dtype, ``clamped_swiglu``), weighted sum in x.dtype.
No triton: ``dsv4lab.kernels.dispatch.moe_decode`` runs it wherever the kernels cannot.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..model.swiglu import clamped_swiglu
from ..quant.stacked import Stacked


def moe_decode_ref(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w1: Stacked,
                   w3: Stacked, w2: Stacked, limit: float | None) -> torch.Tensor:
    """x [T, H], ids / weights [T, k], stacks ``StackedNVFP4`` or ``StackedMXFP4`` -> [T, H] in x.dtype.
    Reads ids on the host (not graph-safe; it is the reference)."""
    ids_h = ids.tolist()
    ys = []
    for t in range(x.shape[0]):
        acc = torch.zeros_like(x[t])
        xt = x[t:t + 1]
        for j, e in enumerate(ids_h[t]):
            gate = F.linear(xt, w1.weight(e).dequantize(x.dtype))
            up = F.linear(xt, w3.weight(e).dequantize(x.dtype))
            y = F.linear(clamped_swiglu(gate, up, limit), w2.weight(e).dequantize(x.dtype))[0]
            acc = acc + y * weights[t, j].to(y.dtype)
        ys.append(acc)
    return torch.stack(ys)


def moe_decode_plain_ref(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w1: torch.Tensor,
                         w3: torch.Tensor, w2: torch.Tensor, limit: float | None) -> torch.Tensor:
    """``moe_decode_ref`` for unquantised stacks w1 / w3 [E, I, H], w2 [E, H, I] (taken in x.dtype,
    as ``QLinear.dense_weight``): what ``moe_decode_plain`` replaces."""
    ids_h = ids.tolist()
    ys = []
    for t in range(x.shape[0]):
        acc = torch.zeros_like(x[t])
        xt = x[t:t + 1]
        for j, e in enumerate(ids_h[t]):
            gate = F.linear(xt, w1[e].to(x.dtype))
            up = F.linear(xt, w3[e].to(x.dtype))
            y = F.linear(clamped_swiglu(gate, up, limit), w2[e].to(x.dtype))[0]
            acc = acc + y * weights[t, j].to(y.dtype)
        ys.append(acc)
    return torch.stack(ys) if ys else x.new_empty(0, x.shape[-1])
