"""The module-level quantisation round trips of DeepSeek's reference inference code, once
(attention, compressor and indexer call these; the linear one lives in QLinear, the expert one
in Experts). Equations and where each applies: docs/precision.md.
"""
from __future__ import annotations

import torch

from ..quant.activations import fake_quant_fp4_pow2, fake_quant_fp8_block
from ..quant.hadamard import hadamard

KV_FP8_BLOCK = 64       # act_quant(kv[..., :-rd], 64, "ue8m0")
INDEXER_FP4_BLOCK = 32  # fp4_act_quant(x, 32): fp4_block_size


def kv_fp8_round_trip(kv: torch.Tensor, rope_dim: int) -> torch.Tensor:
    """``kv_fp8``: the first D - rope_dim dims in blocks of 64 through e4m3 with scales
    2^ceil(log2(max(amax, 1e-4)/448)); the RoPE dims untouched."""
    nope = fake_quant_fp8_block(kv[..., :-rope_dim], KV_FP8_BLOCK, scale_format="e8m0")
    return torch.cat([nope, kv[..., -rope_dim:]], dim=-1)


def indexer_fp4_round_trip(x: torch.Tensor) -> torch.Tensor:
    """``indexer_fp4``: normalised Walsh-Hadamard rotation of the last dim, then E2M1 in blocks
    of 32 with scales 2^ceil(log2(max(amax, 6*2^-126)/6))."""
    return fake_quant_fp4_pow2(hadamard(x), INDEXER_FP4_BLOCK)
