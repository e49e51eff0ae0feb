"""Quantise / dequantise linear weights in memory: what-if studies and tests before a checkpoint
with those weights exists."""
from __future__ import annotations

import contextlib
import fnmatch
from typing import Iterator

from ..quant import weights as W
from .policy import linear_kind


def select_linears(model, kinds=None, pattern: str | None = None):
    """(name, QLinear) of the linears of ``kinds`` (one or several) matching ``pattern``."""
    kinds = None if kinds is None else ({kinds} if isinstance(kinds, str) else set(kinds))
    for name, ql in model.qlinears():
        if kinds is not None and linear_kind(name) not in kinds:
            continue
        if pattern is not None and not fnmatch.fnmatchcase(name, pattern):
            continue
        yield name, ql


def quantize_linears(model, kinds=None, fmt: str = "nvfp4", pattern: str | None = None,
                     input_scale: float | None = None) -> list[str]:
    """Quantise plain linear weights in memory: every linear, or those of ``kinds`` / matching
    ``pattern``. ``fmt``: ``nvfp4`` (ModelOpt recipe, global scale amax/(6*448)), ``mxfp4`` or
    ``fp8``. Linears already quantised, or whose in_features the format cannot block, are left
    alone. Returns the names changed."""
    qfn = {"nvfp4": lambda w: W.quantize_nvfp4(w, input_scale=input_scale), "mxfp4": W.quantize_mxfp4,
           "fp8": W.quantize_fp8_block}[fmt]
    block = {"nvfp4": 16, "mxfp4": 32, "fp8": 1}[fmt]
    done = []
    for name, ql in select_linears(model, kinds, pattern):
        if ql.quantized or ql.in_features % block:
            continue
        ql.set_weight(qfn(ql.weight.detach().float()))
        done.append(name)
    return done


def dequantize_linears(model, dtype=None) -> list[str]:
    """Replace every quantised linear weight by its dequantised plain tensor (in ``dtype``,
    default the model dtype). Returns the names changed."""
    dtype = dtype or model.dtype
    done = []
    for name, ql in model.qlinears():
        if ql.quantized:
            ql.set_weight(ql.qweight.dequantize(dtype).to(ql.qweight.device))
            done.append(name)
    return done


@contextlib.contextmanager
def quantized_in_place(model, kinds=None, fmt: str = "nvfp4", pattern: str | None = None,
                       input_scale: float | None = None) -> Iterator[list[str]]:
    """``with quantized_in_place(model) as names:`` -- :func:`quantize_linears` on the model itself
    for the body (instead of on a copy of the whole model); the plain weights it replaced are held
    and put back on exit, bit for bit, also on an exception."""
    plain = {name: ql.weight for name, ql in model.qlinears() if not ql.quantized}
    try:
        yield quantize_linears(model, kinds, fmt, pattern, input_scale)
    finally:
        for name, ql in model.qlinears():
            if name in plain and ql.quantized:
                ql.set_weight(plain[name])
