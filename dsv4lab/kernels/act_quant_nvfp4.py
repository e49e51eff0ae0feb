"""NVFP4 activation quantisation (W4A4 emulation) as a Triton kernel.

Per 16-element block along the last dim: s = e4m3(min(amax_block / (6*gs), 448)) (RNE),
codes = E2M1 round-to-nearest-even of x / (float(s)*gs) (saturating at 6, ties to the even code,
anything rounding to 0 is +0; blocks whose s*gs is 0 get code 0), exactly the math of
``dsv4lab.quant.fp4.nvfp4_quantize_blocks`` (IEEE divisions via ``div_rn``, not approximate
reciprocals). The global scale ``gs`` is a device scalar: runtime amax/(6*448)
(``dsv4lab.quant.activations.nvfp4_global_scale``) or a checkpoint ``input_scale``.

Returns the dequantised tensor (fake quant, x.dtype) and the packed codes uint8 [..., K/2] and
e4m3 block scales [..., K/16], all from one launch.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..quant.activations import nvfp4_global_scale
from .device import on_input_device
from .host import INTERPRET, cdiv  # importing host also patches the interpreter for numpy >= 2.4


@triton.jit
def _act_quant_kernel(x_ptr, gs_ptr, y_ptr, p_ptr, s_ptr, NB, BB: tl.constexpr):
    pid = tl.program_id(0)
    blk = pid * BB + tl.arange(0, BB)
    b_ok = blk < NB
    offs = blk[:, None] * 16 + tl.arange(0, 16)[None, :]
    x = tl.load(x_ptr + offs, mask=b_ok[:, None], other=0.0).to(tl.float32)
    gs = tl.load(gs_ptr).to(tl.float32)
    amax = tl.max(tl.abs(x), axis=1)
    s_f = tl.minimum(tl.math.div_rn(amax, 6.0 * gs), 448.0)
    s8 = s_f.to(tl.float8e4nv)
    s = s8.to(tl.float32)
    denom = s * gs
    ok = denom > 0
    q = tl.math.div_rn(x, tl.where(ok, denom, 1.0)[:, None])
    a = tl.abs(q)
    code = (a > 0.25).to(tl.int32) + (a >= 0.75).to(tl.int32) + (a > 1.25).to(tl.int32) \
        + (a >= 1.75).to(tl.int32) + (a > 2.5).to(tl.int32) + (a >= 3.5).to(tl.int32) + (a > 5.0).to(tl.int32)
    code = tl.where(ok[:, None], code, 0)
    neg = (q < 0) & (code != 0)
    # E2M1 magnitude code -> value: e = c>>1, m = c&1; e==0: m/2 ; else 2^(e-1)*(1+m/2)
    e = code >> 1
    m = code & 1
    n = tl.where(e == 0, 2 * m, (2 + m) << e)
    v = n.to(tl.float32) * 0.25
    v = tl.where(neg, -v, v)
    y = (v * s[:, None]) * gs
    tl.store(y_ptr + offs, y.to(y_ptr.dtype.element_ty), mask=b_ok[:, None])
    full = code | (neg.to(tl.int32) << 3)
    ev, od = tl.split(tl.reshape(full, (BB, 8, 2)))
    packed = (ev | (od << 4)).to(tl.uint8)
    tl.store(p_ptr + blk[:, None] * 8 + tl.arange(0, 8)[None, :], packed, mask=b_ok[:, None])
    tl.store(s_ptr + blk, s8.to(tl.uint8, bitcast=True), mask=b_ok)


@on_input_device
def nvfp4_act_quant(x: torch.Tensor, global_scale: torch.Tensor | float | None = None):
    """-> (x_dq [x.shape, x.dtype], packed uint8 [..., K/2], block_scale float8_e4m3fn [..., K/16], gs).

    ``global_scale=None`` uses the runtime amax/(6*448) (the reference's ``nvfp4_global_scale``,
    one torch reduction on the device, no host sync); pass ``input_scale`` for the checkpoint mode.
    """
    K = x.shape[-1]
    if K % 16:
        raise ValueError(f"NVFP4 activations need last dim % 16 == 0, got {K}")
    if global_scale is None:
        gs = nvfp4_global_scale(x)
    else:
        gs = torch.as_tensor(global_scale, dtype=torch.float32, device=x.device)
    gs = gs.reshape(1).to(device=x.device, dtype=torch.float32)
    xc = x.contiguous()
    lead = x.shape[:-1]
    NB = xc.numel() // 16
    y = torch.empty_like(xc)
    packed = torch.empty((*lead, K // 2), dtype=torch.uint8, device=x.device)
    scale = torch.empty((*lead, K // 16), dtype=torch.uint8, device=x.device)
    if NB:
        BB = 16 if INTERPRET else 128
        _act_quant_kernel[(cdiv(NB, BB),)](xc, gs, y, packed, scale, NB, BB=BB, num_warps=4)
    return y, packed, scale.view(torch.float8_e4m3fn), gs.reshape(())


def fake_quant_nvfp4_kernel(x: torch.Tensor, global_scale: torch.Tensor | float) -> torch.Tensor:
    """Drop-in for ``dsv4lab.quant.activations.fake_quant_nvfp4`` (dequantised output only)."""
    return nvfp4_act_quant(x, global_scale)[0]
