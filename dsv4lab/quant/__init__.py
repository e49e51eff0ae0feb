"""Quantisation formats for DSV4 weights and activations (E2M1/NVFP4, MXFP4, FP8 block), bit-exact.

Import is cheap and does no device work.
"""
from __future__ import annotations

from .activations import fake_quant_fp8_block, fake_quant_nvfp4, nvfp4_global_scale
from .fp4 import E2M1_VALUES, e2m1_decode, e2m1_encode, pack_fp4, unpack_fp4
from .linear import qlinear
from .weights import (
    FP8BlockWeight,
    MXFP4Weight,
    NVFP4Weight,
    PlainWeight,
    QuantWeight,
    as_quant_weight,
    quantize_fp8_block,
    quantize_mxfp4,
    quantize_nvfp4,
)

__all__ = [
    "E2M1_VALUES", "e2m1_decode", "e2m1_encode", "pack_fp4", "unpack_fp4",
    "QuantWeight", "PlainWeight", "NVFP4Weight", "MXFP4Weight", "FP8BlockWeight",
    "quantize_nvfp4", "quantize_mxfp4", "quantize_fp8_block", "as_quant_weight",
    "nvfp4_global_scale", "fake_quant_nvfp4", "fake_quant_fp8_block", "qlinear",
]
