"""Triton decode step of the KV compressor (``Compressor.decode`` after its two projections) in
one launch: what the reference spends a dozen small PyTorch launches on.

Given the new token's raw projections kv = wkv(x) and z = wgate(x) (the QLinear calls stay
before it), one program per batch row

1. writes kv (in the ring's dtype) and the gate logit z + ape[pos % m] (fp32) into ring slot
   pos % R (R = m, or 2m for CSA's overlapping windows);
2. if the window closes ((pos + 1) % m == 0, read on the device: no host branch, CUDA-graph safe)
   pools it: per channel softmax over the slots of (z + ape) -- the bias goes into the logits,
   never into kv -- (CSA: the previous window's Ca half then this window's Cb half; window 0's Ca
   slots hold gate -inf and weigh 0), then kv_norm and RoPE at position w*m with the compress
   theta, and writes the entry at min(w, n_max - 1). Otherwise the entries are not touched;
3. writes the entry count (pos + 1) // m.

Rounding points are the reference's: softmax in fp32, the weights and each product rounded to
kv's dtype, the slot sum accumulated in fp32 and rounded once to kv's dtype; RMS statistics in
fp32, the normalised value rounded to kv's dtype and multiplied by the norm weight (in the
promoted dtype); RoPE in fp32 with separate roundings (FP contraction off, as PyTorch's separate
ops), the result in that dtype, then in the entries' dtype. exp/cos/sin are libdevice's (on the
GPU; numpy's under the interpreter), so the fp32 values differ from PyTorch's by a few ulps at
most; tolerances in docs/kernels.md.

The slots stream in tiles of BLOCK_L x d (d whole: the norm needs the full row) in three passes
(max, sum of exp, weighted sum) like ``torch.softmax``; a non-closing step reads no slot.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from .device import on_input_device
from .host import INTERPRET, next_pow2  # importing host also patches the interpreter for numpy >= 2.4
from .launch import new_site
from .pdl import pdl_enter, pdl_kw, use_pdl


@triton.jit
def _exp(x, ACCURATE: tl.constexpr):
    if ACCURATE:  # libdevice's expf (what PyTorch's softmax uses); the interpreter has no libdevice
        return libdevice.exp(x)
    else:
        return tl.exp(x)


@triton.jit
def _slot_tile(ring_kv_ptr, ring_gate_ptr, s_rkb, s_rkr, s_rgb, s_rgr, b, l0, pos, cur_kv, cur_g,
               offs_d, dmask, M: tl.constexpr, L: tl.constexpr, D: tl.constexpr, OVERLAP: tl.constexpr,
               BLOCK_L: tl.constexpr):
    """Slots l0 .. l0+BLOCK_L of the closing window: kv (ring dtype) and gate (fp32, -inf outside),
    the new token's slot taken from registers (its ring store may not be visible yet)."""
    offs_l = l0 + tl.arange(0, BLOCK_L)
    if OVERLAP:
        w = pos // M
        prev_row = ((w + 1) % 2) * M
        cur_row = (w % 2) * M
        row = tl.where(offs_l < M, prev_row + offs_l, cur_row + offs_l - M)
        col = tl.where(offs_l < M, 0, D)  # Ca half of the previous window, Cb half of this one
        cur_l = M + pos % M
    else:
        row = offs_l
        col = offs_l * 0
        cur_l = pos % M
    lmask = offs_l < L
    m2 = lmask[:, None] & dmask[None, :]
    kv = tl.load(ring_kv_ptr + b * s_rkb + row[:, None] * s_rkr + col[:, None] + offs_d[None, :], mask=m2, other=0.0)
    g = tl.load(ring_gate_ptr + b * s_rgb + row[:, None] * s_rgr + col[:, None] + offs_d[None, :], mask=m2,
                other=float("-inf"))
    is_cur = (offs_l == cur_l)[:, None]
    kv = tl.where(is_cur, cur_kv[None, :], kv)
    g = tl.where(is_cur, cur_g[None, :], g)
    g = tl.where(dmask[None, :], g, 0.0)  # padding channels: finite, never stored
    return kv, g


@triton.jit
def _compressor_decode_kernel(
        kv_ptr, z_ptr, ape_ptr, pos_ptr, ring_kv_ptr, ring_gate_ptr, ent_ptr, nw_ptr, inv_freq_ptr, n_ptr,
        n_max, eps, s_kvb, s_zb, s_ape, s_rkb, s_rkr, s_rgb, s_rgr, s_eb, s_en,
        M: tl.constexpr, R: tl.constexpr, D: tl.constexpr, C: tl.constexpr, RD: tl.constexpr, OVERLAP: tl.constexpr,
        CUR_COL: tl.constexpr,
        KV_DT: tl.constexpr, NORM_DT: tl.constexpr, ACCURATE: tl.constexpr,
        BLOCK_C: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_L: tl.constexpr, PDL: tl.constexpr = False):
    pdl_enter(PDL)
    b = tl.program_id(0)
    pos = tl.load(pos_ptr)
    slot = pos % M
    # 1. ring write: kv in the ring's dtype, z + ape in fp32
    offs_c = tl.arange(0, BLOCK_C)
    cmask = offs_c < C
    kv = tl.load(kv_ptr + b * s_kvb + offs_c, mask=cmask, other=0.0)
    g = tl.load(z_ptr + b * s_zb + offs_c, mask=cmask, other=0.0).to(tl.float32) \
        + tl.load(ape_ptr + slot * s_ape + offs_c, mask=cmask, other=0.0).to(tl.float32)
    rrow = pos % R
    tl.store(ring_kv_ptr + b * s_rkb + rrow * s_rkr + offs_c, kv.to(ring_kv_ptr.dtype.element_ty), mask=cmask)
    tl.store(ring_gate_ptr + b * s_rgb + rrow * s_rgr + offs_c, g, mask=cmask)
    if b == 0:
        tl.store(n_ptr, (pos + 1) // M)
    # 2. pool the window when it closes
    if (pos + 1) % M == 0:  # R = L: the ring holds exactly the slots a window pools
        offs_d = tl.arange(0, BLOCK_D)
        dmask = offs_d < D
        # the new token as a slot: its Cb half under CSA (CUR_COL = d), all of it otherwise
        cur_kv = tl.load(kv_ptr + b * s_kvb + CUR_COL + offs_d, mask=dmask, other=0.0).to(ring_kv_ptr.dtype.element_ty)
        cur_g = tl.load(z_ptr + b * s_zb + CUR_COL + offs_d, mask=dmask, other=0.0).to(tl.float32) \
            + tl.load(ape_ptr + slot * s_ape + CUR_COL + offs_d, mask=dmask, other=0.0).to(tl.float32)
        mx = tl.full([BLOCK_D], float("-inf"), tl.float32)
        for l0 in range(0, R, BLOCK_L):
            _, gt = _slot_tile(ring_kv_ptr, ring_gate_ptr, s_rkb, s_rkr, s_rgb, s_rgr, b, l0, pos, cur_kv, cur_g,
                               offs_d, dmask, M, R, D, OVERLAP, BLOCK_L)
            mx = tl.maximum(mx, tl.max(gt, 0))
        den = tl.zeros([BLOCK_D], tl.float32)
        for l0 in range(0, R, BLOCK_L):
            _, gt = _slot_tile(ring_kv_ptr, ring_gate_ptr, s_rkb, s_rkr, s_rgb, s_rgr, b, l0, pos, cur_kv, cur_g,
                               offs_d, dmask, M, R, D, OVERLAP, BLOCK_L)
            den += tl.sum(_exp(gt - mx[None, :], ACCURATE), 0)
        acc = tl.zeros([BLOCK_D], tl.float32)
        for l0 in range(0, R, BLOCK_L):
            kt, gt = _slot_tile(ring_kv_ptr, ring_gate_ptr, s_rkb, s_rkr, s_rgb, s_rgr, b, l0, pos, cur_kv, cur_g,
                                offs_d, dmask, M, R, D, OVERLAP, BLOCK_L)
            wt = tl.math.div_rn(_exp(gt - mx[None, :], ACCURATE), den[None, :]).to(KV_DT)
            prod = (kt.to(KV_DT).to(tl.float32) * wt.to(tl.float32)).to(KV_DT)
            acc += tl.sum(prod.to(tl.float32), 0)
        h = acc.to(KV_DT).to(tl.float32)
        # kv_norm: fp32 statistics, normalised value in kv's dtype, times the weight
        ms = tl.math.div_rn(tl.sum(tl.where(dmask, h * h, 0.0), 0), D * 1.0)
        hn = (h * tl.rsqrt(ms + eps)).to(KV_DT).to(tl.float32)
        nw = tl.load(nw_ptr + offs_d, mask=dmask, other=0.0).to(tl.float32)
        e = (nw * hn).to(NORM_DT).to(tl.float32)
        # RoPE on the last RD channels (consecutive pairs) at position w*m
        w = pos // M
        pairs = tl.reshape(e, (BLOCK_D // 2, 2))
        x1, x2 = tl.split(pairs)
        p = tl.arange(0, BLOCK_D // 2) - (D - RD) // 2
        is_rope = (p >= 0) & (p < RD // 2)
        inv = tl.load(inv_freq_ptr + p, mask=is_rope, other=0.0).to(tl.float32)
        freq = (w * M).to(tl.float32) * inv
        cos = tl.cos(freq)
        sin = tl.sin(freq)
        o1 = tl.where(is_rope, (x1 * cos - x2 * sin).to(NORM_DT).to(tl.float32), x1)
        o2 = tl.where(is_rope, (x2 * cos + x1 * sin).to(NORM_DT).to(tl.float32), x2)
        out = tl.reshape(tl.join(o1, o2), (BLOCK_D,))
        idx = tl.minimum(w, n_max - 1)
        tl.store(ent_ptr + b * s_eb + idx * s_en + offs_d, out.to(ent_ptr.dtype.element_ty), mask=dmask)


_TL = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}
_SITES: dict = {}  # (id(kernel), constexprs) -> LaunchSite (two compressors an eager CSA layer)


def _check(name: str, t: torch.Tensor, shape: tuple, fix: str) -> None:
    if tuple(t.shape) != shape:
        raise ValueError(f"compressor_decode_triton: {name} has shape {tuple(t.shape)}, expected {shape}; {fix}")


@on_input_device
def compressor_decode_triton(kv: torch.Tensor, z: torch.Tensor, pos: torch.Tensor, ring_kv: torch.Tensor,
                             ring_gate: torch.Tensor, entries: torch.Tensor, ape: torch.Tensor,
                             norm_weight: torch.Tensor, inv_freq: torch.Tensor, eps: float, overlap: bool,
                             block_l: int = 16, num_warps: int | None = None) -> torch.Tensor:
    """One decode step of a compressor: kv = wkv(x), z = wgate(x) [B, 1, c*d] of the token at the
    device position ``pos`` (0-dim long); updates ``ring_kv`` / ``ring_gate`` [B, c*m, c*d] and,
    when its window closes, ``entries`` [B, n_max, d] in place (``CompressorState``'s tensors).
    ``ape`` [m, c*d], ``norm_weight`` [d], ``inv_freq`` [rope_dim/2] are the compressor's. Returns
    the entry count (pos + 1) // m as a long tensor shaped like ``pos``.

    Tiles: BLOCK_L = 16 slots x d (512 at V4-Pro) per pass, 8 warps for d >= 512; see
    docs/kernels.md for the offline sm_90 compile."""
    m, C = ape.shape
    c = 2 if overlap else 1
    B = kv.shape[0]
    if C % c or (C // c) % 2:
        raise ValueError(f"compressor_decode_triton: ape has {C} channels; expected c*d with c={c} and d even")
    d = C // c
    rd = 2 * inv_freq.numel()
    _check("kv", kv, (B, 1, C), "pass wkv(x) for one token x [B, 1, hidden]")
    _check("z", z, (B, 1, C), "pass wgate(x) for the same token")
    _check("ring_kv", ring_kv, (B, c * m, C), "allocate the state with CompressorState.empty(..., overlap=...)")
    _check("ring_gate", ring_gate, (B, c * m, C), "allocate the state with CompressorState.empty(..., overlap=...)")
    _check("norm_weight", norm_weight, (d,), "pass the compressor's norm.weight")
    if entries.dim() != 3 or entries.shape[0] != B or entries.shape[2] != d:
        raise ValueError(f"compressor_decode_triton: entries has shape {tuple(entries.shape)}, expected "
                         f"[{B}, n_max, {d}]; pass CompressorState.entries")
    if rd > d:
        raise ValueError(f"compressor_decode_triton: inv_freq has {rd // 2} frequencies, more than d/2 = {d // 2}")
    if ring_gate.dtype != torch.float32:
        raise ValueError(f"compressor_decode_triton: ring_gate is {ring_gate.dtype}; the gate ring is fp32")
    if pos.numel() != 1 or pos.dtype != torch.long:
        raise ValueError(f"compressor_decode_triton: pos must be one long (the device position), got "
                         f"{pos.dtype} of shape {tuple(pos.shape)}")
    for name, t in (("ring_kv", ring_kv), ("ring_gate", ring_gate), ("entries", entries)):
        if t.stride(-1) != 1:
            raise ValueError(f"compressor_decode_triton: {name} must have a contiguous last dim (stride {t.stride()})")
    # [B, 1, C] rows as they are when contiguous (row stride C): no view objects on the decode path
    kv2 = kv if kv.is_contiguous() else kv.reshape(B, C).contiguous()
    z2 = z if z.is_contiguous() else z.reshape(B, C).contiguous()
    ape_c, nw, inv = ape.contiguous(), norm_weight.contiguous(), inv_freq.contiguous()
    n = kv.new_empty(pos.shape, dtype=torch.long)   # one element, shaped like pos
    norm_dt = torch.promote_types(norm_weight.dtype, kv.dtype)
    BLOCK_D = next_pow2(d)
    L = c * m
    BLOCK_L = min(next_pow2(L), block_l)
    if num_warps is None:
        num_warps = 8 if BLOCK_D >= 512 else 4
    kernel, kv_dt, norm_tl = _compressor_decode_kernel, _TL[kv.dtype], _TL[norm_dt]  # kernel: tests replace it
    pdl = use_pdl(B, kv.device)
    skey = (id(kernel), m, c, d, C, rd, overlap, kv_dt, norm_tl, BLOCK_D, BLOCK_L, num_warps, pdl)
    site = _SITES.get(skey) or new_site(
        _SITES, skey, kernel, M=m, R=c * m, D=d, C=C, RD=rd, OVERLAP=overlap, CUR_COL=d if overlap else 0, KV_DT=kv_dt,
        NORM_DT=norm_tl, ACCURATE=not INTERPRET, BLOCK_C=next_pow2(C), BLOCK_D=BLOCK_D, BLOCK_L=BLOCK_L,
        num_warps=num_warps, enable_fp_fusion=False, **pdl_kw(pdl))
    site((B,),
        kv2, z2, ape_c, pos, ring_kv, ring_gate, entries, nw, inv, n,
        entries.shape[1], float(eps), C if kv2 is kv else kv2.stride(0), C if z2 is z else z2.stride(0), ape_c.stride(0),
        ring_kv.stride(0), ring_kv.stride(1), ring_gate.stride(0), ring_gate.stride(1),
        entries.stride(0), entries.stride(1))
    return n
