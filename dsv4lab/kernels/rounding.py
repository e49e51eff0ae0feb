"""Triton device rounding that gives the torch reference's bits: ``round_to`` (fp32 to the output
dtype, round to nearest even; bf16 by integer arithmetic, so the interpreter rounds like the GPU)
and ``decode_swiglu``, the MoE decode kernels' clamped SwiGLU rounded where the reference rounds.
A module of its own because the GEMMs, the split-K fix-up and the MoE kernels all store through it.
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def round_to(v, OUT_TY: tl.constexpr):
    """fp32 ``v`` rounded to OUT_TY (round to nearest even), kept in fp32: what a torch op in that
    dtype returns. bf16 by integer arithmetic, so the interpreter (whose numpy bf16 cast truncates)
    rounds like the GPU; NaN stays NaN."""
    if OUT_TY == tl.bfloat16:
        b = v.to(tl.int32, bitcast=True)
        r = ((b + 0x7FFF + ((b >> 16) & 1)) & -65536).to(tl.float32, bitcast=True)  # -65536 = 0xFFFF0000
        return tl.where(v != v, v, r)
    else:
        return v.to(OUT_TY).to(tl.float32)


@triton.jit
def decode_swiglu(gate, up, limit, OUT_TY: tl.constexpr):
    """The decode kernels' ``clamped_swiglu`` on fp32 gate / up already rounded to OUT_TY: clamp
    (gate above, up both sides) BEFORE SiLU, silu(gate) rounded to OUT_TY, times up (the caller's
    store rounds the product). One place, so the MoE decode kernels cannot drift apart."""
    gate = tl.minimum(gate, limit)
    up = tl.minimum(tl.maximum(up, -limit), limit)
    return round_to(gate * tl.sigmoid(gate), OUT_TY) * up
