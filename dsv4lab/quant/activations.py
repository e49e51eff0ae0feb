"""Activation quantisation as the Blackwell / official kernels do it, emulated ("fake quant").

Each function returns the *dequantised* tensor in ``x.dtype`` so an ordinary matmul afterwards
reproduces the quantised GEMM up to accumulation order. Math runs in fp32, shares its block code
with the weight quantisers (``fp4.nvfp4_quantize_blocks``), and never syncs with the host, so it
can sit inside a captured CUDA graph.

Known, documented differences from hardware kernels: TensorRT-LLM/FlashInfer NVFP4 quantisers
multiply by approximate reciprocals (rcp.approx) of the inverse global scale, so a value sitting
exactly on an E2M1 rounding boundary can land on the other side; the GEMM also applies scales to
fp32 partial sums rather than to a bf16-rounded dequantised operand.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .fp4 import NVFP4_BLOCK, e2m1_decode, e2m1_encode, nvfp4_dequantize_blocks, nvfp4_quantize_blocks
from .fp8 import E4M3_MAX, ceil_log2, e8m0_from_exponent, e8m0_to_float, to_e4m3

NVFP4_GS_DENOM = 6.0 * E4M3_MAX
# Official DeepSeek act_quant floors each block amax at 1e-4 before s = amax/448 (keeps tiny or
# all-zero blocks finite); we follow it by default.
FP8_ACT_AMAX_FLOOR = 1e-4
# Official fp4_act_quant (the indexer's q and k): block amax floored at 6 * 2^-126 (the smallest
# normal scale times E2M1's max), so an all-zero block gets the scale 2^-126, not 0.
FP4_ACT_AMAX_FLOOR = 6.0 * 2.0 ** -126
E2M1_MAX = 6.0


def nvfp4_global_scale(x: torch.Tensor) -> torch.Tensor:
    """Dynamic per-tensor NVFP4 scale amax(|x|)/(6*448) as a float32 0-dim tensor on x.device.
    All-zero x gives 1.0 (same guard as the weight quantiser) instead of 0, which would be 0/0."""
    amax = x.detach().abs().amax().float()
    return torch.where(amax > 0, amax / NVFP4_GS_DENOM, torch.ones_like(amax))


def fake_quant_nvfp4(x: torch.Tensor, global_scale: torch.Tensor | float) -> torch.Tensor:
    """NVFP4 round trip along the last dim: 16-element blocks, e4m3 block scale, E2M1 codes.

    ``global_scale`` (> 0) is the dequant-convention scale: runtime amax/(6*448) or a checkpoint
    ``input_scale``. If it is smaller than amax/(6*448), block scales saturate at 448 and values clip.
    """
    k = x.shape[-1]
    if k % NVFP4_BLOCK:
        raise ValueError(f"NVFP4 activations need last dim % {NVFP4_BLOCK} == 0, got {k}")
    gs = torch.as_tensor(global_scale, dtype=torch.float32, device=x.device).reshape(())
    blocks = x.float().reshape(*x.shape[:-1], k // NVFP4_BLOCK, NVFP4_BLOCK)
    codes, scale = nvfp4_quantize_blocks(blocks, gs)
    return nvfp4_dequantize_blocks(codes, scale, gs).reshape(x.shape).to(x.dtype)


def fake_quant_fp8_block(
    x: torch.Tensor,
    block: int = 128,
    scale_format: str = "fp32",
    amax_floor: float = FP8_ACT_AMAX_FLOOR,
) -> torch.Tensor:
    """Per-``block`` (along the last dim) FP8 round trip: s = max(amax, amax_floor)/448 (rounded up
    to a power of two for "e8m0"), values e4m3(clamp(x/s)). A partial last block is allowed."""
    if scale_format not in ("fp32", "e8m0"):
        raise ValueError(f"scale_format must be 'fp32' or 'e8m0', got {scale_format!r}")
    k = x.shape[-1]
    nb = math.ceil(k / block)
    xp = x.float()
    if nb * block != k:
        xp = F.pad(xp, (0, nb * block - k))
    blocks = xp.reshape(*x.shape[:-1], nb, block)
    amax = blocks.abs().amax(dim=-1, keepdim=True).clamp_min(amax_floor)
    if scale_format == "e8m0":
        # the official kernel: s = 2^ceil(log2(amax * (1/448))) (multiplied by the fp32
        # reciprocal, as DeepSeek's act_quant does), an exact power of two
        s = e8m0_to_float(e8m0_from_exponent(ceil_log2(amax * (1.0 / E4M3_MAX))))
    else:
        s = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
    y = to_e4m3(blocks / s).float() * s
    return y.reshape(*x.shape[:-1], nb * block)[..., :k].to(x.dtype)


def fake_quant_fp4_pow2(x: torch.Tensor, block: int = 32, amax_floor: float = FP4_ACT_AMAX_FLOOR) -> torch.Tensor:
    """Per-``block`` E2M1 round trip with power-of-two scales, as DeepSeek's ``fp4_act_quant``
    (the indexer's rotated q and k): s = 2^ceil(log2(max(amax, amax_floor) * (1/6))),
    values E2M1(x/s) (round to nearest, ties to even, saturating at 6) times s. The last dim
    must be a multiple of ``block``."""
    k = x.shape[-1]
    if k % block:
        raise ValueError(f"FP4 activations need last dim % {block} == 0, got {k}")
    blocks = x.float().reshape(*x.shape[:-1], k // block, block)
    amax = blocks.abs().amax(dim=-1, keepdim=True).clamp_min(amax_floor)
    s = e8m0_to_float(e8m0_from_exponent(ceil_log2(amax * (1.0 / E2M1_MAX))))
    y = e2m1_decode(e2m1_encode(blocks / s)) * s
    return y.reshape(x.shape).to(x.dtype)
