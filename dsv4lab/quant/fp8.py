"""FP8 E4M3 casts and E8M0 (power-of-two) scale helpers.

Exponents are computed with ``torch.frexp`` (exact, subnormals included) rather than log2, which
is an approximation on some backends; E8M0 bytes are built as integers and *viewed* as
``float8_e8m0fnu`` so no rounding mode of a cast is relied on. Decoding uses torch's native cast
(byte 0 -> 2^-127, byte 255 -> NaN).
"""
from __future__ import annotations

import torch

E4M3_MAX = 448.0
E8M0_BIAS = 127
E8M0_MIN_EXP = -127  # byte 0
E8M0_MAX_EXP = 127  # byte 254 (255 is NaN)


def to_e4m3(x: torch.Tensor) -> torch.Tensor:
    """Saturating cast to float8_e4m3fn (RNE). Clamped first: torch's overflow behaviour (NaN vs
    saturate) has differed across versions and devices. NaN stays NaN."""
    return x.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)


def as_e4m3(t: torch.Tensor) -> torch.Tensor:
    """float8_e4m3fn, or its uint8/int8 byte view, -> float8_e4m3fn view."""
    if t.dtype == torch.float8_e4m3fn:
        return t
    if t.dtype in (torch.uint8, torch.int8):
        return t.view(torch.float8_e4m3fn)
    raise TypeError(f"expected float8_e4m3fn or its uint8/int8 bytes, got {t.dtype}")


def as_e8m0(t: torch.Tensor) -> torch.Tensor:
    """float8_e8m0fnu, or its uint8/int8 byte view, -> float8_e8m0fnu view."""
    if t.dtype == torch.float8_e8m0fnu:
        return t
    if t.dtype in (torch.uint8, torch.int8):
        return t.view(torch.float8_e8m0fnu)
    raise TypeError(f"expected float8_e8m0fnu or its uint8/int8 bytes, got {t.dtype}")


def e8m0_to_float(t: torch.Tensor) -> torch.Tensor:
    """E8M0 (any byte view) -> float32 2^(e-127); e=255 -> NaN."""
    return as_e8m0(t).to(torch.float32)


def e8m0_from_exponent(exp: torch.Tensor) -> torch.Tensor:
    """Integer exponents (clamped to [-127, 127]) -> float8_e8m0fnu scales 2^exp."""
    b = exp.clamp(E8M0_MIN_EXP, E8M0_MAX_EXP) + E8M0_BIAS
    return b.to(torch.uint8).view(torch.float8_e8m0fnu)


def floor_log2(x: torch.Tensor) -> torch.Tensor:
    """floor(log2(x)) for finite x > 0, exactly (int32). x = m * 2^e with m in [0.5, 1)."""
    _, e = torch.frexp(x.float())
    return e.to(torch.int32) - 1


def ceil_log2(x: torch.Tensor) -> torch.Tensor:
    """ceil(log2(x)) for finite x > 0, exactly (int32): powers of two map to themselves."""
    m, e = torch.frexp(x.float())
    e = e.to(torch.int32)
    return torch.where(m == 0.5, e - 1, e)
