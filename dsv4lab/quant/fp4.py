"""E2M1 (FP4) codes: decode, round-to-nearest-even encode, nibble packing, NVFP4 block math.

Everything is integer/bit arithmetic or comparisons against exactly representable thresholds, so
results are bit-exact on every device and there are no lookup tables to copy host->device (which
would break CUDA-graph capture). No op here reads a value back to the host.

Conventions (documented choices):
  * zero always encodes as code 0 (+0): values that round to magnitude 0, including negative ones
    and -0.0, get code 0. Code 8 (-0) still decodes to -0.0. Hardware ``cvt`` keeps the sign, so
    compare *values*, not codes, against kernel output for tiny negatives.
  * NaN encodes as code 0 (every comparison with NaN is False). Callers that care see NaN through
    the block scale instead (a NaN in a block makes its amax, hence its scale, NaN).
  * |x| > 6 (and +-inf) saturate to +-6 (code 7 / 15).
"""
from __future__ import annotations

import torch

from .fp8 import e8m0_to_float, to_e4m3

E2M1_VALUES: tuple[float, ...] = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E2M1_MAX = 6.0

# Magnitude code = number of thresholds passed. Ties go to the even code: ">" where the even
# neighbour is below the midpoint (0.25, 1.25, 2.5, 5), ">=" where it is above (0.75, 1.75, 3.5).
_THRESHOLDS: tuple[tuple[float, bool], ...] = (
    (0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False), (3.5, True), (5.0, False),
)


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """View int8 / float4_e2m1fn_x2 / uint8 storage as uint8 (same bytes, no copy)."""
    if t.dtype == torch.uint8:
        return t
    if t.element_size() != 1:
        raise TypeError(f"expected a 1-byte dtype (uint8/int8/float4_e2m1fn_x2), got {t.dtype}")
    return t.view(torch.uint8)


def e2m1_decode(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes (low 4 bits used) -> float32 values; exact: value = n/4 with small integer n."""
    c = as_bytes(codes) & 0xF  # uint8 arithmetic throughout: 1 byte/element temporaries
    mag = c & 7
    e = mag >> 1
    m = mag & 1
    # e == 0: m * 0.5 = (2m)/4 ; e >= 1: 2^(e-1) * (1 + m/2) = ((2 + m) << e) / 4
    n = torch.where(e == 0, 2 * m, (2 + m) << e)
    v = n.to(torch.float32) * 0.25
    return torch.where(c >= 8, -v, v)


def e2m1_encode(x: torch.Tensor) -> torch.Tensor:
    """Round to the nearest E2M1 value (ties to even code, saturating at 6) -> uint8 codes 0..15."""
    if x.dtype not in (torch.float32, torch.float64, torch.float16, torch.bfloat16):
        x = x.float()  # thresholds are exact in every float dtype above, so no widening needed
    a = x.abs()
    code = torch.zeros(x.shape, dtype=torch.uint8, device=x.device)
    for t, inclusive in _THRESHOLDS:
        code += (a >= t) if inclusive else (a > t)
    neg = (x < 0) & (code != 0)  # canonical +0 for anything that rounds to zero
    return code | (neg.to(torch.uint8) << 3)


def pack_fp4(codes: torch.Tensor) -> torch.Tensor:
    """codes [..., K] -> uint8 [..., K/2]; low nibble = element 2j, high nibble = element 2j+1."""
    if codes.shape[-1] % 2:
        raise ValueError(f"pack_fp4 needs an even last dim, got {tuple(codes.shape)}")
    c = as_bytes(codes) & 0xF
    return c[..., 0::2] | (c[..., 1::2] << 4)


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """uint8 (or int8 / float4_e2m1fn_x2 view) [..., K/2] -> uint8 codes [..., K]."""
    p = as_bytes(packed)
    return torch.stack((p & 0xF, p >> 4), dim=-1).flatten(-2)


# --------------------------------------------------------------------------- NVFP4 block math
NVFP4_BLOCK = 16


def nvfp4_quantize_blocks(blocks: torch.Tensor, global_scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """ModelOpt NVFP4 math on fp32 ``blocks`` [..., 16] -> (codes uint8 [..., 16], e4m3 scales [...]).

    scale = e4m3(amax_block / (6 * global_scale)); codes = E2M1(x / (scale * global_scale)).
    Blocks whose e4m3 scale is 0 (all-zero, or underflowed) get codes 0, never NaN. Shared by the
    weight quantiser and activation fake-quant so the two can never drift apart.
    """
    amax = blocks.abs().amax(dim=-1)
    scale = to_e4m3(amax / (6.0 * global_scale))
    denom = (scale.float() * global_scale).unsqueeze(-1)
    ok = denom > 0
    codes = e2m1_encode(blocks / torch.where(ok, denom, torch.ones_like(denom)))
    codes = codes.masked_fill(~ok, 0)
    return codes, scale


def nvfp4_dequantize_blocks(codes: torch.Tensor, scale: torch.Tensor, global_scale: torch.Tensor) -> torch.Tensor:
    """(E2M1[code] * float(scale)) * global_scale in fp32; the first product is exact, so one rounding."""
    return (e2m1_decode(codes) * scale.float().unsqueeze(-1)) * global_scale


def mxfp4_dequantize(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """MXFP4 [..., out, in/2] codes with E8M0 [..., out, in/32] scales -> fp32 [..., out, in]
    (E2M1[code] * 2^(e-127), exact): one weight, or a stack of experts."""
    v = e2m1_decode(unpack_fp4(packed))
    v = v.view(*v.shape[:-1], v.shape[-1] // 32, 32) * e8m0_to_float(scale).unsqueeze(-1)
    return v.flatten(-2)
