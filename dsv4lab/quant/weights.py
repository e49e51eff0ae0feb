"""Quantised weight containers (NVFP4 / MXFP4 / FP8-block / plain) and their quantisers.

A QuantWeight keeps the checkpoint bytes as stored and dequantises on demand, so the model can
hold 4-bit weights and we can compare formats bit-exactly against checkpoints and kernels.
``tensors()`` returns the checkpoint suffixes (``weight``, ``weight_scale`` ...) the loader uses.

Byte-view policy: constructors accept any 1-byte view of the same bytes (uint8 / int8 /
float4_e2m1fn_x2 for packed FP4, uint8 / int8 for FP8 scales) and store one canonical dtype:
packed FP4 as uint8, E4M3 as float8_e4m3fn, E8M0 as float8_e8m0fnu, so ``tensors()`` dtypes do
not depend on which checkpoint dialect was loaded.

Degenerate inputs (documented choices): an all-zero tensor gets NVFP4 global scale 1.0; an
all-zero MXFP4 block gets exponent 0 (scale byte 127 = 1.0); an all-zero FP8 block gets scale 1.0
(E8M0: 2^0). Codes in those blocks are 0, never NaN.
"""
from __future__ import annotations

import math
from typing import Callable

import torch
import torch.nn.functional as F

from .fp4 import (
    NVFP4_BLOCK,
    as_bytes,
    e2m1_encode,
    mxfp4_dequantize,
    nvfp4_dequantize_blocks,
    nvfp4_quantize_blocks,
    pack_fp4,
    unpack_fp4,
)
from .fp8 import E4M3_MAX, as_e4m3, as_e8m0, ceil_log2, e8m0_from_exponent, e8m0_to_float, floor_log2, to_e4m3

MXFP4_BLOCK = 32
FP8_BLOCK = 128
NVFP4_GS_DENOM = 6.0 * E4M3_MAX  # E2M1 max * E4M3 max: global scale maps amax onto the grid top

__all__ = [
    "QuantWeight", "PlainWeight", "NVFP4Weight", "MXFP4Weight", "FP8BlockWeight",
    "quantize_nvfp4", "quantize_mxfp4", "quantize_fp8_block", "as_quant_weight",
]


def _scalar(x: torch.Tensor | float, device: torch.device) -> torch.Tensor:
    """A float32 0-dim tensor on ``device`` (checkpoints store scalars as [] or [1])."""
    t = torch.as_tensor(x, dtype=torch.float32, device=device)
    if t.numel() != 1:
        raise ValueError(f"expected a scalar scale, got shape {tuple(t.shape)}")
    return t.reshape(())


class QuantWeight:
    """Base class: a logical [out, in] weight held in some storage format."""

    format: str = "?"
    shape: tuple[int, int]
    input_scale: torch.Tensor | None = None

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        raise NotImplementedError

    def tensors(self) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def _map(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> "QuantWeight":
        raise NotImplementedError

    def row_block(self, start: int, rows: int) -> "QuantWeight | None":
        """Output rows start .. start + rows as a weight of the same format over views of the
        stored tensors (no copy), or None where the format's scale blocks do not split there (the
        block-diagonal use runs a kernel per row block on these)."""
        return None

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors().values())

    @property
    def device(self) -> torch.device:
        return self.tensors()["weight"].device

    def to(self, device: torch.device | str) -> "QuantWeight":
        """Same type and dtypes, tensors moved to ``device``."""
        return self._map(lambda t: t.to(device))

    def __repr__(self) -> str:
        parts = ", ".join(f"{k}={tuple(v.shape)}:{str(v.dtype).replace('torch.', '')}" for k, v in self.tensors().items())
        return f"{type(self).__name__}(shape={self.shape}, {parts})"


class PlainWeight(QuantWeight):
    """An unquantised bf16/fp16/fp32 weight behind the same interface."""

    format = "plain"

    def __init__(self, data: torch.Tensor) -> None:
        if data.dim() != 2:
            raise ValueError(f"weight must be 2-D [out, in], got {tuple(data.shape)}")
        self.data = data
        self.shape = (int(data.shape[0]), int(data.shape[1]))

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return self.data.to(dtype)

    def row_block(self, start: int, rows: int) -> "PlainWeight":
        return PlainWeight(self.data[start:start + rows])

    def tensors(self) -> dict[str, torch.Tensor]:
        return {"weight": self.data}

    def _map(self, fn):
        return PlainWeight(fn(self.data))


class NVFP4Weight(QuantWeight):
    """NVIDIA ModelOpt NVFP4: W = E2M1[code] * e4m3 block scale (16 along ``in``) * weight_scale_2."""

    format = "nvfp4"

    def __init__(
        self,
        packed: torch.Tensor,
        block_scale: torch.Tensor,
        global_scale: torch.Tensor | float,
        input_scale: torch.Tensor | float | None = None,
    ) -> None:
        packed = as_bytes(packed)
        if packed.dim() != 2:
            raise ValueError(f"NVFP4 packed weight must be [out, in/2], got {tuple(packed.shape)}")
        out, inn = int(packed.shape[0]), int(packed.shape[1]) * 2
        if inn % NVFP4_BLOCK:
            raise ValueError(f"NVFP4 in_features {inn} is not a multiple of {NVFP4_BLOCK}")
        block_scale = as_e4m3(block_scale)
        if tuple(block_scale.shape) != (out, inn // NVFP4_BLOCK):
            raise ValueError(f"NVFP4 weight_scale shape {tuple(block_scale.shape)} != {(out, inn // NVFP4_BLOCK)}")
        self.packed = packed
        self.block_scale = block_scale
        self.global_scale = _scalar(global_scale, packed.device)
        self.input_scale = None if input_scale is None else _scalar(input_scale, packed.device)
        self.shape = (out, inn)

    def codes(self) -> torch.Tensor:
        """uint8 E2M1 codes [out, in]."""
        return unpack_fp4(self.packed)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        out, inn = self.shape
        codes = self.codes().view(out, inn // NVFP4_BLOCK, NVFP4_BLOCK)
        w = nvfp4_dequantize_blocks(codes, self.block_scale, self.global_scale)
        return w.view(out, inn).to(dtype)

    def tensors(self) -> dict[str, torch.Tensor]:
        d = {"weight": self.packed, "weight_scale": self.block_scale, "weight_scale_2": self.global_scale}
        if self.input_scale is not None:
            d["input_scale"] = self.input_scale
        return d

    def _map(self, fn):
        return NVFP4Weight(fn(self.packed), fn(self.block_scale), fn(self.global_scale),
                           None if self.input_scale is None else fn(self.input_scale))

    def row_block(self, start: int, rows: int) -> "NVFP4Weight":
        return NVFP4Weight(self.packed[start:start + rows], self.block_scale[start:start + rows],
                           self.global_scale, self.input_scale)


class MXFP4Weight(QuantWeight):
    """OCP MXFP4 (official DeepSeek experts): W = E2M1[code] * 2^(e-127), one E8M0 per 32 along ``in``."""

    format = "mxfp4"

    def __init__(self, packed: torch.Tensor, scale: torch.Tensor) -> None:
        packed = as_bytes(packed)
        if packed.dim() != 2:
            raise ValueError(f"MXFP4 packed weight must be [out, in/2], got {tuple(packed.shape)}")
        out, inn = int(packed.shape[0]), int(packed.shape[1]) * 2
        if inn % MXFP4_BLOCK:
            raise ValueError(f"MXFP4 in_features {inn} is not a multiple of {MXFP4_BLOCK}")
        scale = as_e8m0(scale)
        if tuple(scale.shape) != (out, inn // MXFP4_BLOCK):
            raise ValueError(f"MXFP4 scale shape {tuple(scale.shape)} != {(out, inn // MXFP4_BLOCK)}")
        self.packed = packed
        self.scale = scale
        self.shape = (out, inn)

    def codes(self) -> torch.Tensor:
        return unpack_fp4(self.packed)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return mxfp4_dequantize(self.packed, self.scale).to(dtype)

    def tensors(self) -> dict[str, torch.Tensor]:
        return {"weight": self.packed, "scale": self.scale}

    def _map(self, fn):
        return MXFP4Weight(fn(self.packed), fn(self.scale))

    def row_block(self, start: int, rows: int) -> "MXFP4Weight":
        return MXFP4Weight(self.packed[start:start + rows], self.scale[start:start + rows])


class FP8BlockWeight(QuantWeight):
    """Official DeepSeek FP8: e4m3 weight, one scale (fp32 or E8M0) per block x block tile."""

    format = "fp8_block"

    def __init__(self, data: torch.Tensor, scale: torch.Tensor, block: int = FP8_BLOCK) -> None:
        data = as_e4m3(data)
        if data.dim() != 2:
            raise ValueError(f"FP8 weight must be 2-D [out, in], got {tuple(data.shape)}")
        out, inn = int(data.shape[0]), int(data.shape[1])
        if scale.dtype in (torch.uint8, torch.int8, torch.float8_e8m0fnu):
            scale = as_e8m0(scale)
        elif scale.is_floating_point():
            scale = scale.float()  # bf16/fp16 scales widen losslessly
        else:
            raise TypeError(f"FP8 block scale must be float or E8M0 bytes, got {scale.dtype}")
        want = (math.ceil(out / block), math.ceil(inn / block))
        if tuple(scale.shape) != want:
            raise ValueError(f"FP8 scale shape {tuple(scale.shape)} != {want} for weight {(out, inn)}, block {block}")
        self.data = data
        self.scale = scale
        self.block = int(block)
        self.shape = (out, inn)

    @property
    def scale_format(self) -> str:
        return "e8m0" if self.scale.dtype == torch.float8_e8m0fnu else "fp32"

    def scale_float(self) -> torch.Tensor:
        return e8m0_to_float(self.scale) if self.scale_format == "e8m0" else self.scale

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        out, inn = self.shape
        s = _expand_blocks(self.scale_float(), self.block, out, inn)
        return (self.data.float() * s).to(dtype)

    def tensors(self) -> dict[str, torch.Tensor]:
        return {"weight": self.data, "scale": self.scale}

    def _map(self, fn):
        return FP8BlockWeight(fn(self.data), fn(self.scale), self.block)

    def row_block(self, start: int, rows: int) -> "FP8BlockWeight | None":
        """None unless start and rows are whole scale blocks (the last block may be partial)."""
        b, out = self.block, self.shape[0]
        if start % b or (rows % b and start + rows != out):
            return None
        return FP8BlockWeight(self.data[start:start + rows], self.scale[start // b:math.ceil((start + rows) / b)], b)


def _expand_blocks(s: torch.Tensor, block: int, out: int, inn: int) -> torch.Tensor:
    """[ceil(out/b), ceil(in/b)] -> [out, in] by broadcasting (expand, not repeat_interleave: no sync)."""
    ob, ib = s.shape
    return s[:, None, :, None].expand(ob, block, ib, block).reshape(ob * block, ib * block)[:out, :inn]


# --------------------------------------------------------------------------- quantisers
def quantize_nvfp4(
    w: torch.Tensor,
    global_scale: torch.Tensor | float | None = None,
    input_scale: torch.Tensor | float | None = None,
) -> NVFP4Weight:
    """ModelOpt recipe. ``global_scale`` defaults to amax(|W|)/(6*448) (1.0 if W is all zero);
    pass it explicitly to re-quantise with a fixed scale (e.g. idempotence, shared scales)."""
    if w.dim() != 2 or w.shape[1] % NVFP4_BLOCK:
        raise ValueError(f"NVFP4 needs a 2-D weight with in % {NVFP4_BLOCK} == 0, got {tuple(w.shape)}")
    out, inn = w.shape
    w32 = w.detach().float()
    if global_scale is None:
        amax = w32.abs().amax()
        gs = torch.where(amax > 0, amax / NVFP4_GS_DENOM, torch.ones_like(amax))
    else:
        gs = _scalar(global_scale, w.device)
    codes, bs = nvfp4_quantize_blocks(w32.view(out, inn // NVFP4_BLOCK, NVFP4_BLOCK), gs)
    return NVFP4Weight(pack_fp4(codes.view(out, inn)), bs, gs, input_scale)


def quantize_mxfp4(w: torch.Tensor) -> MXFP4Weight:
    """OCP MX: per 32-block exponent X = floor(log2 amax) - 2 (clamped to E8M0), codes = E2M1(x/2^X).
    Values up to 8*2^X saturate to 6*2^X, as the spec prescribes. All-zero blocks: X = 0;
    blocks containing NaN get the NaN scale byte 255."""
    if w.dim() != 2 or w.shape[1] % MXFP4_BLOCK:
        raise ValueError(f"MXFP4 needs a 2-D weight with in % {MXFP4_BLOCK} == 0, got {tuple(w.shape)}")
    out, inn = w.shape
    blocks = w.detach().float().view(out, inn // MXFP4_BLOCK, MXFP4_BLOCK)
    amax = blocks.abs().amax(dim=-1)
    x = torch.where(amax > 0, floor_log2(torch.where(amax > 0, amax, torch.ones_like(amax))) - 2,
                    torch.zeros_like(amax, dtype=torch.int32))
    scale = e8m0_from_exponent(x)
    codes = e2m1_encode(blocks / e8m0_to_float(scale).unsqueeze(-1))
    # a NaN anywhere in a block -> scale byte 255 (NaN), so dequantisation shows it
    scale = torch.where(amax.isnan(), 255, scale.view(torch.uint8)).to(torch.uint8).view(torch.float8_e8m0fnu)
    return MXFP4Weight(pack_fp4(codes.view(out, inn)), scale)


def quantize_fp8_block(w: torch.Tensor, scale_format: str = "fp32", block: int = FP8_BLOCK) -> FP8BlockWeight:
    """Per block x block tile s = amax/448 (all-zero tile: 1.0); "e8m0" rounds s up to 2^k so
    |w/s| <= 448 still holds. Edge tiles are partial (zero padding does not change amax)."""
    if scale_format not in ("fp32", "e8m0"):
        raise ValueError(f"scale_format must be 'fp32' or 'e8m0', got {scale_format!r}")
    if w.dim() != 2:
        raise ValueError(f"FP8 block needs a 2-D weight, got {tuple(w.shape)}")
    out, inn = w.shape
    ob, ib = math.ceil(out / block), math.ceil(inn / block)
    wp = F.pad(w.detach().float(), (0, ib * block - inn, 0, ob * block - out))
    amax = wp.view(ob, block, ib, block).abs().amax(dim=(1, 3))
    s = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
    if scale_format == "e8m0":
        scale = e8m0_from_exponent(ceil_log2(s))
        s = e8m0_to_float(scale)
    else:
        scale = s
    data = to_e4m3(w.detach().float() / _expand_blocks(s, block, out, inn))
    return FP8BlockWeight(data, scale, block)


def as_quant_weight(x: torch.Tensor | QuantWeight) -> QuantWeight:
    """Tensor -> PlainWeight; a QuantWeight is returned unchanged."""
    if isinstance(x, QuantWeight):
        return x
    if isinstance(x, torch.Tensor):
        return PlainWeight(x)
    raise TypeError(f"cannot make a QuantWeight from {type(x).__name__}")
