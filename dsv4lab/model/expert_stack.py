"""Stacked expert weights: one [E, ...] tensor per projection, shared with the experts as views.

Decode must pick a token's experts on the device (graph-safe, no host sync) and read only their
bytes. Stacking the per-expert weights once lets a step gather by expert id; each expert's
QLinear keeps a view into the stack, so no memory is duplicated and per-expert inspection still
works. Plain, NVFP4 and MXFP4 (the official checkpoint's experts) weights gather natively; other
formats fall back to the masked loop.
"""
from __future__ import annotations

import torch

from ..quant.fp4 import mxfp4_dequantize, nvfp4_dequantize_blocks, unpack_fp4
from ..quant.weights import MXFP4Weight, NVFP4Weight


class ExpertStack:
    PROJ = ("w1", "w3", "w2")

    def __init__(self, experts) -> None:
        self.formats = {}
        self.tensors: dict[str, dict[str, torch.Tensor]] = {}
        for p in self.PROJ:
            qls = [getattr(experts[e], p) for e in range(len(experts))]
            fmts = {ql.format for ql in qls}
            if len(fmts) != 1 or next(iter(fmts)) not in ("plain", "nvfp4", "mxfp4"):
                raise ValueError(f"cannot stack experts' {p}: formats {sorted(fmts)}")
            fmt = fmts.pop()
            self.formats[p] = fmt
            if fmt == "plain":
                w = torch.stack([ql.weight.data for ql in qls])
                self.tensors[p] = {"weight": w}
                for e, ql in enumerate(qls):
                    ql.weight.data = w[e]
            elif fmt == "mxfp4":
                t = {"packed": torch.stack([ql.qweight.packed for ql in qls]),
                     "scale": torch.stack([ql.qweight.scale for ql in qls])}
                self.tensors[p] = t
                for e, ql in enumerate(qls):
                    ql.qweight = MXFP4Weight(t["packed"][e], t["scale"][e])
            else:
                t = {"packed": torch.stack([ql.qweight.packed for ql in qls]),
                     "scale": torch.stack([ql.qweight.block_scale for ql in qls]),
                     "gs": torch.stack([ql.qweight.global_scale for ql in qls])}
                self.tensors[p] = t
                for e, ql in enumerate(qls):
                    ql.qweight = NVFP4Weight(t["packed"][e], t["scale"][e], t["gs"][e], ql.qweight.input_scale)
        self.key = self.identity(experts)

    @classmethod
    def identity(cls, experts) -> tuple:
        """What the stack was built from (to notice a swapped expert weight)."""
        out = []
        for e in range(len(experts)):
            for p in cls.PROJ:
                ql = getattr(experts[e], p)
                t = ql.qweight.packed if ql.qweight is not None and hasattr(ql.qweight, "packed") else ql.weight
                out.append(None if t is None else (t.data_ptr(), t.device))
        return tuple(out)

    def gather(self, proj: str, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Dense [n, out, in] weights of experts ``ids`` [n] (only their bytes are read)."""
        t = self.tensors[proj]
        if self.formats[proj] == "plain":
            return t["weight"].index_select(0, ids).to(dtype)
        packed = t["packed"].index_select(0, ids)            # [n, out, in/2]
        scale = t["scale"].index_select(0, ids)              # [n, out, in/16] (MXFP4: in/32, E8M0)
        if self.formats[proj] == "mxfp4":
            return mxfp4_dequantize(packed, scale).to(dtype)
        gs = t["gs"].index_select(0, ids).view(-1, 1, 1, 1)
        n, out, half = packed.shape
        codes = unpack_fp4(packed).view(n, out, half * 2 // 16, 16)
        return nvfp4_dequantize_blocks(codes, scale, gs).view(n, out, half * 2).to(dtype)
