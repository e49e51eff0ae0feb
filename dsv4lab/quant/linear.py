"""qlinear: the reference quantised GEMM, y = q_act(x) @ dequant(W)^T.

This is the slow-but-exact emulation every fast kernel is checked against: dequantise the weight
into x.dtype, optionally fake-quantise the activation, then F.linear (which accumulates in fp32
for bf16 on GPU, as the real kernels do). No host syncs, so it is CUDA-graph capturable.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .activations import fake_quant_fp8_block, fake_quant_nvfp4, nvfp4_global_scale
from .modes import ACT_SCALES, ActScale, unknown_choice
from .weights import QuantWeight, as_quant_weight

ACTS = ("none", "nvfp4", "fp8")


def quantize_activation(x: torch.Tensor, w: QuantWeight, act: str = "none", act_scale: str = ActScale.AMAX) -> torch.Tensor:
    """x as the GEMM would see it under ``act`` ("none" | "nvfp4" | "fp8")."""
    if act == "none":
        return x
    if act == "fp8":
        return fake_quant_fp8_block(x)
    if act != "nvfp4":
        raise ValueError(f"act must be one of {ACTS}, got {act!r}")
    if act_scale == ActScale.AMAX:
        gs = nvfp4_global_scale(x)
    elif act_scale == ActScale.INPUT_SCALE:
        if getattr(w, "input_scale", None) is None:
            raise ValueError(
                f"act_scale='input_scale' but this {w.format} weight has no input_scale; use act_scale='amax'"
            )
        gs = w.input_scale
    else:
        raise unknown_choice("act_scale", act_scale, ACT_SCALES)
    return fake_quant_nvfp4(x, gs)


def qlinear(
    x: torch.Tensor,
    w: QuantWeight | torch.Tensor,
    act: str = "none",
    act_scale: str = ActScale.AMAX,
    weight_cache: torch.Tensor | None = None,
) -> torch.Tensor:
    """y = x' W^T. W = ``weight_cache`` if given (a pre-dequantised copy) else w.dequantize(x.dtype)."""
    w = as_quant_weight(w)
    xq = quantize_activation(x, w, act, act_scale)
    wd = weight_cache if weight_cache is not None else w.dequantize(x.dtype)
    return F.linear(xq, wd)
