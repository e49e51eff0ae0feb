"""The glue around the attention's quantised matmuls as one launch each: the weighted RMSNorm of the
q latent (``q_norm``), the per-head RMS norm + RoPE of the queries, ``kv_norm`` + RoPE (+ the
``kv_fp8`` round trip) of the shared K=V head, and the inverse RoPE of the attention output.

One kernel, switched by constexprs: a program takes ``HB`` heads of one row, loads each head's even
and odd channels as two [HB, D/2] tiles (the RoPE pairs), normalises (fp32 statistics, the reference's
roundings: ``RMSNorm`` rounds the normalised value to x's dtype before the weight, the head norm
rounds the fp32 rsqrt to x's dtype), rotates the last ``RD`` channels with angles computed from the
device position (pos * inv_freq in fp32, then cos/sin: no tables, no host sync), and for ``kv_fp8``
rounds the non-RoPE channels through e4m3 per 64 with power-of-two scales (exact bit arithmetic).
Launched with ``enable_fp_fusion=False`` so the RoPE products round as the reference's separate
multiplies and adds. Reference: ``dsv4lab.kernels.norm_rope_ref``.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from .activation_pairs import INV_PAD, pairs_buffers, pairs_written, store_pair_rows
from .device import on_input_device
from .host import INTERPRET, cdiv, next_pow2
from .launch import LaunchSite
from .pdl import pdl_enter, pdl_kw, use_pdl

NORM_NONE, NORM_PLAIN, NORM_WEIGHTED = 0, 1, 2  # NORM constexpr: none, unweighted (q heads), weighted
E4M3_MAX = tl.constexpr(448.0)
KV_FP8_BLOCK_PAIRS = tl.constexpr(32)  # 64 channels per kv_fp8 block = 32 RoPE pairs
RNE_MAGIC = tl.constexpr(12582912.0)   # 1.5 * 2^23: (r + M) - M rounds 0 <= r < 2^22 to the nearest even integer
WIDE_ROWS = 64      # rows (tokens) from which a program takes 16 heads instead of 2


@triton.jit
def _pow2(e):
    """2^e (int32 e in [-126, 127]) as fp32, exactly."""
    return ((e + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _floor_log2(a):
    """floor(log2(a)) of fp32 a >= 0 from its exponent bits (-127 for zero and subnormals)."""
    return ((a.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127


@triton.jit
def _e4m3_round_trip(v):
    """e4m3fn(v) as fp32 (round to nearest even, saturating at 448, subnormals at 2^-9 steps)."""
    a = tl.minimum(tl.abs(v), E4M3_MAX)
    e = tl.maximum(_floor_log2(a), -6)
    r = a * _pow2(3 - e)                      # exact: a power-of-two scaling, r < 16
    q = ((r + RNE_MAGIC) - RNE_MAGIC) * _pow2(e - 3)
    return tl.where(v < 0, -q, q)


@triton.jit
def _fp8_nope(xe, xo, nope, HB: tl.constexpr, BP: tl.constexpr):
    """kv_fp8 on the non-RoPE pairs (``nope`` mask) of the even and odd tiles [HB, BP]: per 64
    channels s = 2^ceil(log2(max(amax, 1e-4) * (1/448))), values e4m3(x / s) * s."""
    NB: tl.constexpr = BP // KV_FP8_BLOCK_PAIRS
    a = tl.maximum(tl.where(nope, tl.abs(xe), 0.0), tl.where(nope, tl.abs(xo), 0.0))
    amax = tl.max(tl.reshape(a, [HB, NB, KV_FP8_BLOCK_PAIRS]), axis=2)
    t = tl.maximum(amax, 1e-4) * (1.0 / E4M3_MAX)
    bits = t.to(tl.int32, bitcast=True)
    c = ((bits >> 23) & 0xFF) - 127 + ((bits & 0x7FFFFF) != 0).to(tl.int32)  # ceil(log2 t), t normal
    c = tl.reshape(tl.broadcast_to(tl.reshape(c, [HB, NB, 1]), [HB, NB, KV_FP8_BLOCK_PAIRS]), [HB, BP])
    s, inv = _pow2(c), _pow2(-c)
    ye = _e4m3_round_trip(xe * inv) * s
    yo = _e4m3_round_trip(xo * inv) * s
    return tl.where(nope, ye, xe), tl.where(nope, yo, xo)


@triton.jit
def rope_cos_sin(pos, inv_ptr, pairs, P: tl.constexpr, RD: tl.constexpr, ROPE: tl.constexpr, PRECISE: tl.constexpr):
    """(rot, cos, sin) of the RoPE pairs ``pairs`` (indices into a head's P = D / 2 pairs, the last
    RD / 2 rotated) at position ``pos``: angle pos * inv_freq in fp32, cos/sin as torch's CUDA ones
    (``PRECISE``: libdevice; the interpreter has none), sin negated for the inverse (ROPE < 0)."""
    j = pairs - (P - RD // 2)                    # frequency index of a RoPE pair (< 0: not rotated)
    rot = (j >= 0) & (pairs < P)
    inv = tl.load(inv_ptr + j, mask=rot, other=0.0).to(tl.float32)
    ang = pos.to(tl.float32) * inv
    if PRECISE:
        cos, sin = libdevice.cos(ang), libdevice.sin(ang)
    else:
        cos, sin = tl.cos(ang), tl.sin(ang)
    if ROPE < 0:
        sin = -sin
    return rot, cos, sin


@triton.jit
def rotate_pairs(ve, vo, rot, cos, sin, OUT: tl.constexpr):
    """The even / odd channels (fp32) rotated where ``rot``, each product and sum rounded on its own
    (launch with ``enable_fp_fusion=False``) and the result to OUT and back, as ``apply_rope``."""
    re = (ve * cos - vo * sin).to(OUT).to(tl.float32)
    ro = (vo * cos + ve * sin).to(OUT).to(tl.float32)
    return tl.where(rot, re, ve), tl.where(rot, ro, vo)


@triton.jit
def _norm_rope_rows(x_ptr, y_ptr, w_ptr, pos_ptr, inv_ptr, ring_ptr, xp_ptr, xinv_ptr, S, H, eps,
                    stride_xt, stride_xh, stride_yt, stride_yh, stride_rb, stride_rs, W, KG, KGP, t, h0,
                    D: tl.constexpr, RD: tl.constexpr, NORM: tl.constexpr, ROPE: tl.constexpr,
                    FP8: tl.constexpr, HB: tl.constexpr, BP: tl.constexpr, PRECISE: tl.constexpr,
                    RING: tl.constexpr, PAIRS: tl.constexpr):
    """Heads h0 .. h0 + HB of row t: the one body of ``_norm_rope_kernel`` and of each half of
    ``_norm_pair_kernel``, so a paired launch gives each row the bits of its own launch."""
    P: tl.constexpr = D // 2
    heads = h0 + tl.arange(0, HB)
    pairs = tl.arange(0, BP)
    chans = tl.arange(0, 2 * BP)   # whole rows, loaded and stored contiguously, split into pairs in registers
    ok = (heads < H)[:, None] & (chans < D)[None, :]
    xx = tl.load(x_ptr + t * stride_xt + heads[:, None] * stride_xh + chans[None, :], mask=ok, other=0.0)
    xe, xo = tl.split(tl.reshape(xx, [HB, BP, 2]))
    xdt = xe.dtype
    ve, vo = xe.to(tl.float32), xo.to(tl.float32)
    if NORM != 0:
        ms = (tl.sum(ve * ve, axis=1) + tl.sum(vo * vo, axis=1)) / D
        r = tl.rsqrt(ms + eps)[:, None]
        if NORM == 1:   # unweighted_rms_norm: x * rsqrt(...).to(x.dtype), rounded to x.dtype
            rq = r.to(xdt).to(tl.float32)
            ve = (ve * rq).to(xdt).to(tl.float32)
            vo = (vo * rq).to(xdt).to(tl.float32)
        else:           # RMSNorm: weight * (x * rsqrt(...)).to(x.dtype), rounded to the output dtype
            we = tl.load(w_ptr + 2 * pairs, mask=pairs < P, other=0.0).to(tl.float32)[None, :]
            wo = tl.load(w_ptr + 2 * pairs + 1, mask=pairs < P, other=0.0).to(tl.float32)[None, :]
            ve = (we * (ve * r).to(xdt).to(tl.float32)).to(y_ptr.dtype.element_ty).to(tl.float32)
            vo = (wo * (vo * r).to(xdt).to(tl.float32)).to(y_ptr.dtype.element_ty).to(tl.float32)
    if ROPE != 0:
        rot, cos, sin = rope_cos_sin(tl.load(pos_ptr + t % S), inv_ptr, pairs, P, RD, ROPE, PRECISE)
        ve, vo = rotate_pairs(ve, vo, rot[None, :], cos[None, :], sin[None, :], y_ptr.dtype.element_ty)
    if FP8:
        nope = (heads >= 0)[:, None] & (pairs < P - RD // 2)[None, :]
        ve, vo = _fp8_nope(ve, vo, nope, HB, BP)
    yy = tl.reshape(tl.join(ve.to(y_ptr.dtype.element_ty), vo.to(y_ptr.dtype.element_ty)), [HB, 2 * BP])
    tl.store(y_ptr + t * stride_yt + heads[:, None] * stride_yh + chans[None, :], yy, mask=ok)
    if PAIRS:  # the row's x_pairs rows as the next GEMVs read them (activation_pairs.pair_rows): one head, or
        NG: tl.constexpr = 2 * BP // 16  # HB heads of D = 2 * BP channels each (whole groups per head)
        g = ((t * H + heads) * (D // 16))[:, None] + tl.arange(0, NG)[None, :]
        store_pair_rows(tl.reshape(yy.to(tl.float32), (HB * NG, 16)), xp_ptr, xinv_ptr, tl.reshape(g, (HB * NG,)),
                        KG, KGP, HB * NG)
    if RING:  # the decode's sliding-window write: row t = (sequence b, position s) -> ring[b, pos % W]
        slot = tl.load(pos_ptr + t % S) % W
        tl.store(ring_ptr + (t // S) * stride_rb + slot * stride_rs + heads[:, None] * D + chans[None, :], yy, mask=ok)


@triton.jit
def _norm_rope_kernel(x_ptr, y_ptr, w_ptr, pos_ptr, inv_ptr, ring_ptr, xp_ptr, xinv_ptr, S, H, eps,
                      stride_xt, stride_xh, stride_yt, stride_yh, stride_rb, stride_rs, W, KG, KGP,
                      D: tl.constexpr, RD: tl.constexpr, NORM: tl.constexpr, ROPE: tl.constexpr,
                      FP8: tl.constexpr, HB: tl.constexpr, BP: tl.constexpr, PRECISE: tl.constexpr,
                      RING: tl.constexpr = False, PAIRS: tl.constexpr = False, PDL: tl.constexpr = False):
    pdl_enter(PDL)
    # row t of [T, H, D] (T = batch * S, positions per S), heads from program 1's block
    _norm_rope_rows(x_ptr, y_ptr, w_ptr, pos_ptr, inv_ptr, ring_ptr, xp_ptr, xinv_ptr, S, H, eps,
                    stride_xt, stride_xh, stride_yt, stride_yh, stride_rb, stride_rs, W, KG, KGP,
                    tl.program_id(0), tl.program_id(1) * HB, D, RD, NORM, ROPE, FP8, HB, BP, PRECISE, RING, PAIRS)


@triton.jit
def _norm_pair_kernel(a_ptr, qr_ptr, qw_ptr, xp_ptr, xinv_ptr, KG, KGP, q_eps,
                      kv_ptr, kvy_ptr, kvw_ptr, pos_ptr, inv_ptr, ring_ptr, stride_rb, stride_rs, W, kv_eps,
                      DQ: tl.constexpr, BPQ: tl.constexpr, DKV: tl.constexpr, RD: tl.constexpr, BPKV: tl.constexpr,
                      FP8: tl.constexpr, PRECISE: tl.constexpr, PDL: tl.constexpr = False):
    """One decode token's q_norm (program 0: weighted RMSNorm of the q latent a [DQ], emitting its
    pairs for wq_b) and kv_norm + RoPE (+ kv_fp8) with the ring write (program 1: kv [DKV]): the two
    launches of ``_q_kv_fused`` that read the wq_a / wkv pair's outputs, as one."""
    pdl_enter(PDL)
    if tl.program_id(0) == 0:
        _norm_rope_rows(a_ptr, qr_ptr, qw_ptr, a_ptr, a_ptr, a_ptr, xp_ptr, xinv_ptr, 1, 1, q_eps,
                        DQ, DQ, DQ, DQ, 0, 0, 1, KG, KGP, 0, 0,
                        DQ, 0, 2, 0, False, 1, BPQ, PRECISE, False, True)        # NORM 2: weighted
    else:
        _norm_rope_rows(kv_ptr, kvy_ptr, kvw_ptr, pos_ptr, inv_ptr, ring_ptr, xp_ptr, xinv_ptr, 1, 1, kv_eps,
                        DKV, DKV, DKV, DKV, stride_rb, stride_rs, W, 0, 0, 0, 0,
                        DKV, RD, 2, 1, FP8, 1, BPKV, PRECISE, True, False)


_SITES: dict = {}  # (id(kernel), constexprs) -> LaunchSite: no per-call keyword key (7 launches a decode layer)


@on_input_device
def launch_norm_rope(x: torch.Tensor, out_dtype: torch.dtype, *, norm: int, eps: float = 0.0,
                     weight: torch.Tensor | None = None, positions: torch.Tensor | None = None,
                     inv_freq: torch.Tensor | None = None, inverse: bool = False, fp8_nope: bool = False,
                     heads_per_program: int | None = None, inplace: bool = False,
                     one_head: bool = False, ring: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., S, H, D] -> y of x's shape in ``out_dtype``: the norm (``NORM_*``), then RoPE on the
    last 2 * len(inv_freq) channels at ``positions`` [S] (``inverse``: at -pos; none without
    positions), then ``fp8_nope`` (kv_fp8 on the other channels). Positions broadcast over the
    leading dims, as the reference's cos/sin [S, rd/2] do. ``inplace`` (RoPE alone, x's dtype):
    only the RoPE channels are read and rewritten, in x's storage where x is a view of it (the
    inverse RoPE of the attention output: 64 of 512 channels, 1/8 of the copy's bytes).
    ``one_head``: x is [..., D], one head a row (``rms_norm``: no unsqueeze / squeeze objects).
    ``ring`` [B, W, D] in ``out_dtype`` with unit inner stride (x [B, S, 1, D], S <= W; the caller
    checks: ``dispatch.norm_rope``): y is also stored at ring[b, positions[s] % W], the decode's
    sliding-window write without its two aten ops (remainder, index_copy_).

    Host side: at most one reshape, one allocation and no view for the common layouts (each tensor
    object is ~3 us of host on a slow core; eager decode makes 7 of these calls a layer)."""
    shape = x.shape
    D = shape[-1]
    H = 1 if one_head else shape[-2]
    if x.is_contiguous():             # any leading dims: rows of H * D elements, no view object made
        x3, T, sxt, sxh = x, x.numel() // (H * D), H * D, D
    else:
        if x.stride(-1) == 1 and (x.dim() == (2 if one_head else 3)):
            x3 = x                    # rows [T, (H,) D] as they are: strides read below
        else:
            x3 = x.reshape(-1, D) if one_head else x.reshape(-1, H, D)
            if x3.stride(-1) != 1:
                x3 = x3.contiguous()
        T = x3.shape[0]
        sxt = x3.stride(0)
        sxh = D if one_head else x3.stride(1)
    rope = positions is not None
    in_place = inplace and norm == NORM_NONE and not fp8_nope and rope and out_dtype == x.dtype
    # a decode row rewritten in place whole (the inverse RoPE of the attention output, [1, H, D] with
    # D a power of two): its program tiles cover whole 16-groups, so it writes the row's pairs for wo_a
    emit_heads = (in_place and T == 1 and not one_head and D == next_pow2(D) and D % 16 == 0
                  and (H * D // 16) % INV_PAD == 0 and sxh == D and sxt == H * D)
    if in_place and emit_heads:
        whole = y = x3                                  # whole rows in place: the non-RoPE channels as they were
        syt, syh = sxt, sxh
    elif in_place:
        whole = x3
        x3 = y = x3[..., D - 2 * inv_freq.shape[-1]:]  # the RoPE channels, row strides of the whole tensor
        D = y.shape[-1]
        syt, syh = sxt, sxh
    else:
        whole = y = x.new_empty(shape, dtype=out_dtype)   # contiguous: strides known (new_empty: ~1.5 us less)
        syt, syh = H * D, D
    BP = max(next_pow2(D // 2), KV_FP8_BLOCK_PAIRS.value if fp8_nope else 1)
    # heads per program: 2 at decode (H = 128: 64 programs a row), 16 from WIDE_ROWS rows (whole-row
    # loads make the result independent of it: H200, 4096 x 128 x 512 q, 2 -> 16 heads 388 -> 288 us)
    HB = heads_per_program or min(next_pow2(H), 16 if T >= WIDE_ROWS else 2)
    RD = 2 * inv_freq.shape[-1] if rope else 0
    ROPE = (-1 if inverse else 1) if rope else 0
    kernel = _norm_rope_kernel  # looked up per call: a test's stand-in replaces the module attribute
    grid = (T, cdiv(H, HB))
    pdl = use_pdl(T * grid[1], x.device)
    has_ring = ring is not None
    # one row normalised whole (a decode RMSNorm): also write its pairs for the GEMVs that read it
    emit = emit_heads or (one_head and T == 1 and D % 16 == 0 and pairs_capacity(D, BP))
    kg = T * H * D // 16
    skey = (id(kernel), D, RD, norm, ROPE, fp8_nope, HB, BP, pdl, has_ring, emit)
    site = _SITES.get(skey)
    if site is None:
        site = _SITES[skey] = LaunchSite(kernel, D=D, RD=RD, NORM=norm, ROPE=ROPE, FP8=fp8_nope, HB=HB, BP=BP,
                                         PRECISE=not INTERPRET, RING=has_ring, PAIRS=emit, enable_fp_fusion=False,
                                         num_warps=1 if INTERPRET else max(1, min(8, HB * BP // 128)),
                                         **pdl_kw(pdl))
    xp, xinv = pairs_buffers(kg, x.device) if emit else (x3, x3)
    site(grid,
         x3, y, x3 if weight is None else weight, positions if rope else x3, inv_freq if rope else x3,
         ring if has_ring else x3, xp, xinv, positions.numel() if rope else 1, H, float(eps), sxt, sxh, syt, syh,
         *((ring.stride(0), ring.stride(1), ring.shape[1]) if has_ring else (0, 0, 1)),
         kg, xinv.shape[0] if emit else 0)
    out = whole if whole.shape == shape else whole.view(shape)
    if emit:
        pairs_written(kg, x.device, out)
    return out


_PAIR_SITES: dict = {}  # (id(kernel), constexprs) -> LaunchSite of _norm_pair_kernel (1 launch a decode layer)


@on_input_device
def launch_norm_pair(a: torch.Tensor, q_weight: torch.Tensor, q_eps: float, kv: torch.Tensor, kv_weight: torch.Tensor,
                     kv_eps: float, positions: torch.Tensor, inv_freq: torch.Tensor, fp8_nope: bool,
                     ring: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """One decode token's (q_norm(a), kv_norm + RoPE (+ kv_fp8) of kv written into ``ring``) in one
    launch: a [B=1, S=1, DQ], kv [1, 1, 1, DKV] contiguous, the outputs in promote(weight, x) and the
    ring in kv's output dtype with unit inner stride. None where the pair does not fit (the caller
    launches the two halves on their own): other rows, layouts or dtypes, or a DQ whose pairs the
    one-row tile cannot emit (``pairs_capacity``). The q half is ``rms_norm``'s launch (same tile and
    warps: the same bits, its pairs for wq_b emitted); the kv half runs with the q half's warps, so
    its statistics may round differently from its own launch's (within the reference's tolerance)."""
    DQ, DKV = a.shape[-1], kv.shape[-1]
    q_dtype = torch.promote_types(q_weight.dtype, a.dtype)
    kv_dtype = torch.promote_types(kv_weight.dtype, kv.dtype)
    BPQ, BPKV = next_pow2(DQ // 2), max(next_pow2(DKV // 2), KV_FP8_BLOCK_PAIRS.value if fp8_nope else 1)
    if not (a.numel() == DQ and kv.numel() == DKV and a.is_contiguous() and kv.is_contiguous()
            and DQ % 16 == 0 and DKV % 2 == 0 and pairs_capacity(DQ, BPQ) and positions.numel() == 1
            and ring.dtype == kv_dtype and ring.stride(-1) == 1 and ring.dim() == 3 and ring.shape[0] == 1
            and ring.shape[-1] == DKV and 2 * inv_freq.shape[-1] <= DKV and q_weight.numel() == DQ
            and kv_weight.numel() == DKV):
        return None
    q_res, kv_out = a.new_empty(a.shape, dtype=q_dtype), kv.new_empty(kv.shape, dtype=kv_dtype)
    kg = DQ // 16
    xp, xinv = pairs_buffers(kg, a.device)
    pdl = use_pdl(2, a.device)
    kernel = _norm_pair_kernel  # looked up per call: a test's stand-in replaces the module attribute
    key = (id(kernel), DQ, DKV, 2 * inv_freq.shape[-1], fp8_nope, pdl)
    site = _PAIR_SITES.get(key)
    if site is None:
        site = _PAIR_SITES[key] = LaunchSite(kernel, DQ=DQ, BPQ=BPQ, DKV=DKV, RD=2 * inv_freq.shape[-1],
                                             BPKV=BPKV, FP8=fp8_nope, PRECISE=not INTERPRET, enable_fp_fusion=False,
                                             num_warps=1 if INTERPRET else max(1, min(8, BPQ // 128)), **pdl_kw(pdl))
    site((2,), a, q_res, q_weight, xp, xinv, kg, xinv.shape[0], float(q_eps),
         kv, kv_out, kv_weight, positions, inv_freq, ring, ring.stride(0), ring.stride(1), ring.shape[1], float(kv_eps))
    pairs_written(kg, a.device, q_res)
    return q_res, kv_out


def pairs_capacity(D: int, BP: int) -> bool:
    """Does a one-row program's [2 * BP] tile cover the kept pairs' padded 1/xs (``INV_PAD`` groups
    per box) that it must zero-fill? (V4-Pro's 7168 and 1536 do; 512 would not.)"""
    return 2 * BP // 16 >= cdiv(D // 16, INV_PAD) * INV_PAD
