"""What several Triton kernels share: the E2M1/E4M3/E8M0 decodes, the prefill GEMMs' weight-tile
dequantisation (``dequant_tile``) and rounding (``round_to``), the f16x2 group dot, the split-K
finish, the attention kernels' online-softmax tile, the activation-pair builder of the TMA paths,
and host helpers (interpreter flag, split-K counters, SM count, tl.dot dtype).

Layouts: NVFP4 weights as int64 words (16 nibbles = one e4m3 scale block); the batch-1 loops take
the activation as f16x2 pairs ``x' = x * xs`` (xs a power of two per 16-group, so x' is exact in
f16 for bf16 x); ``group_dot`` multiplies one word against a group's 8 pairs with inline PTX
(``fma.rn.f16x2``) on the GPU and an f16-rounding emulation under the interpreter. See
docs/kernels.md for the design and tolerances.

Imports triton (import this module only from kernel modules; ``dsv4lab.kernels`` stays
triton-free). Under ``TRITON_INTERPRET=1`` it patches the interpreter for numpy >= 2.4 once.
"""
from __future__ import annotations

import functools
import math

import os
import weakref
from typing import Callable, TypeVar

import numpy as np
import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
from triton.tools.tensor_descriptor import TensorDescriptor

from ..lanes import MAIN, borrow, current_lane, main_writes, note_main_write
from .launch import LaunchSite


def patch_interpreter_for_numpy2() -> None:
    """TRITON_INTERPRET=1 with numpy >= 2.4: triton 3.6's interpreter turns 0-d scalars into
    1-element arrays and calls ``int()`` on them in ``range(...)`` bounds, which numpy 2.4 refuses.
    Patch ``tensor.__index__`` to take the single element. No-op unless interpreting."""
    if os.environ.get("TRITON_INTERPRET", "0") != "1":
        return
    from triton.runtime import interpreter as interp  # only exists to be patched when interpreting

    if getattr(interp, "_dsv4lab_patched", False):
        return
    orig = interp._patch_lang_tensor

    def patched(tensor, scope):
        orig(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(np.asarray(self.handle.data).reshape(-1)[0]))

    interp._patch_lang_tensor = patched
    interp._dsv4lab_patched = True


patch_interpreter_for_numpy2()

# Every kernel here was checked and timed with Triton's FP fusion (FMA contraction) on: its default
# through 3.9, which warns that 3.10 turns it off. Kernels whose products must round as the
# reference's separate ones launch with ``enable_fp_fusion=False`` themselves; a setting of the
# user's own wins.
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")


# ----------------------------------------------------------------------------- device helpers
@triton.jit
def fp16_pair(w32, J: tl.constexpr):
    """int32 word holding 8 nibbles -> (fp32 of nibble J, fp32 of nibble J+4), each E2M1*2^-14."""
    # 0x80008000 as an int32 constant (keeps the arithmetic 32-bit)
    if J == 3:
        p = ((w32 >> 3) & 0x0E000E00) | (w32 & -2147450880)
    else:
        p = ((w32 << (9 - 4 * J)) & 0x0E000E00) | ((w32 << (12 - 4 * J)) & -2147450880)
    lo = p.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    hi = (p >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    return lo, hi


@triton.jit
def e4m3_to_f32(s_u8):
    return s_u8.to(tl.float8e4nv, bitcast=True).to(tl.float32)


@triton.jit
def e8m0_to_f32(e):
    """E8M0 byte -> 2^(e-127) as fp32 (e = 0: 2^-127, a subnormal; e = 255: NaN), like torch."""
    e = e.to(tl.int32)
    v = (e << 23).to(tl.float32, bitcast=True)
    v = tl.where(e == 0, tl.full(e.shape, 4194304, tl.int32).to(tl.float32, bitcast=True), v)
    return tl.where(e == 255, float("nan"), v)


@triton.jit
def pdl_enter(PDL: tl.constexpr):
    """First statement of a kernel that may be launched with programmatic dependent launch (PDL):
    wait until the previous grid on the stream has finished and its writes are visible, then let
    the next grid's CTAs become resident (they wait the same way). Nothing else precedes it, so
    every global read and write of the kernel stays ordered after the previous kernel, as without
    PDL; what is gained is the next launch's latency, hidden under this kernel's run. Without
    ``PDL`` (the interpreter, multi-wave grids, ``DSV4LAB_PDL=0``) it compiles to nothing."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()


@triton.jit
def store_or_fix_up(acc, y_ptrs, ws_ptrs, mask, cnt_ptr, tile, pid_k, split_stride, SPLIT, scale,
                     USE_SPLIT: tl.constexpr):
    """y = acc * scale; with split K every split writes its fp32 partial at ws_ptrs + pid_k *
    split_stride and bumps the tile's counter, and the last one sums the SPLIT partials in split
    order, stores and resets the counter (one launch, deterministic, CUDA-graph safe). Returns
    whether this program stored the tile (every program without split K; the last split with it),
    for kernels that go on from the stored tile (``gate_route``)."""
    out_ty = y_ptrs.dtype.element_ty
    if not USE_SPLIT:
        tl.store(y_ptrs, round_to(acc * scale, out_ty).to(out_ty), mask=mask)
        stored = tl.full((), 1, tl.int1)
    else:
        stored = arrive(acc, ws_ptrs + pid_k * split_stride, mask, cnt_ptr, tile) == SPLIT - 1
        if stored:
            tot = sum_partials(ws_ptrs, split_stride, SPLIT, mask, tl.zeros_like(acc))
            tl.store(y_ptrs, round_to(tot * scale, out_ty).to(out_ty), mask=mask)
            tl.atomic_xchg(cnt_ptr + tile, 0, sem="relaxed")  # next use is a later launch: no fence
    return stored


@triton.jit
def arrive(part, part_ptrs, mask, cnt_ptr, tile):
    """Store this program's fp32 partial and bump the tile's counter: the count before (the last
    of n programs reads n - 1 and then sums the partials, stores and resets the counter)."""
    tl.store(part_ptrs, part, mask=mask)
    tl.debug_barrier()
    return tl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel")


@triton.jit
def sum_partials(ws_ptrs, split_stride, SPLIT, mask, tot):
    """tot + the SPLIT fp32 partials at ws_ptrs + s * split_stride, added in split order (the
    fix-up of ``store_or_fix_up`` and of the MoE decode's token tiles)."""
    if tot.numel <= 2048:
        # GEMV tiles: four partials per round trip, still summed in split order; a loop of
        # single loads waits one L2 latency per split (H200: wkv 6.5 -> 5.4 us, q_a 7.7 -> 6.9)
        for s in range(0, SPLIT, 4):
            p0 = tl.load(ws_ptrs + s * split_stride, mask=mask, other=0.0, cache_modifier=".cg")
            p1 = tl.load(ws_ptrs + (s + 1) * split_stride, mask=tl.where(s + 1 < SPLIT, mask, False), other=0.0, cache_modifier=".cg")
            p2 = tl.load(ws_ptrs + (s + 2) * split_stride, mask=tl.where(s + 2 < SPLIT, mask, False), other=0.0, cache_modifier=".cg")
            p3 = tl.load(ws_ptrs + (s + 3) * split_stride, mask=tl.where(s + 3 < SPLIT, mask, False), other=0.0, cache_modifier=".cg")
            tot = (((tot + p0) + p1) + p2) + p3
    else:  # GEMM tiles (64-128 x 128): four in flight would spill registers (o_b M=128 178 -> 239 us)
        for s in range(SPLIT):
            tot += tl.load(ws_ptrs + s * split_stride, mask=mask, other=0.0, cache_modifier=".cg")
    return tot


@triton.jit
def nibble_plane_dots(w64, sc, xt, xm, acc, DOT_DTYPE: tl.constexpr):
    """acc [BN, BM] += the 16 nibble planes of the int64 words w64 [BN, W] (element 16w + j),
    each as exact E2M1 * 2^-14 * sc in DOT_DTYPE, through tl.dot against the x^T plane at
    xt + j ([W, BM] pointers, mask xm)."""
    w_lo = w64.to(tl.int32)
    w_hi = (w64 >> 32).to(tl.int32)
    for j in tl.static_range(4):
        a, b = fp16_pair(w_lo, j)
        acc = tl.dot((a * sc).to(DOT_DTYPE), tl.load(xt + j, mask=xm, other=0.0).to(DOT_DTYPE), acc)
        acc = tl.dot((b * sc).to(DOT_DTYPE), tl.load(xt + j + 4, mask=xm, other=0.0).to(DOT_DTYPE), acc)
        c, d = fp16_pair(w_hi, j)
        acc = tl.dot((c * sc).to(DOT_DTYPE), tl.load(xt + j + 8, mask=xm, other=0.0).to(DOT_DTYPE), acc)
        acc = tl.dot((d * sc).to(DOT_DTYPE), tl.load(xt + j + 12, mask=xm, other=0.0).to(DOT_DTYPE), acc)
    return acc


@triton.jit
def gemv_rows_m1(w_ptr, s_ptr, stride_wn, stride_sn, x_ptr, rows, row_ok, g_lo, g_hi, gps,
                  BN: tl.constexpr, G: tl.constexpr):
    """sum_k W'[rows, k] * x[k] over groups [g_lo, g_hi) for one activation row; W' = E2M1*s*2^-14.
    w_ptr: int64 words [N, K/16]; s_ptr: uint8 e4m3 [N, K/16]; x_ptr: fp row of K."""
    acc = tl.zeros((BN, G), dtype=tl.float32)
    offs_g = tl.arange(0, G)
    # software pipelining by hand: the next tile's weight/scale loads are issued before this
    # tile's decode (the loop has no tl.dot, so Triton's pipeliner leaves it alone)
    gg = g_lo + offs_g
    gm = gg < g_hi
    m2 = row_ok[:, None] & gm[None, :]
    w_nx = tl.load(w_ptr + rows[:, None] * stride_wn + gg[None, :], mask=m2, other=0)
    s_nx = tl.load(s_ptr + rows[:, None] * stride_sn + gg[None, :], mask=m2, other=0)
    for g0 in range(g_lo, g_lo + gps, G):
        gg = g0 + offs_g
        gm = gg < g_hi
        w64 = w_nx
        sc = e4m3_to_f32(s_nx)
        gn = gg + G
        mn = row_ok[:, None] & (gn < g_hi)[None, :]
        w_nx = tl.load(w_ptr + rows[:, None] * stride_wn + gn[None, :], mask=mn, other=0)
        s_nx = tl.load(s_ptr + rows[:, None] * stride_sn + gn[None, :], mask=mn, other=0)
        w_lo = w64.to(tl.int32)
        w_hi = (w64 >> 32).to(tl.int32)
        xb = x_ptr + gg * 16
        part = tl.zeros((BN, G), dtype=tl.float32)
        for j in tl.static_range(4):
            a, b = fp16_pair(w_lo, j)
            xa = tl.load(xb + j, mask=gm, other=0.0).to(tl.float32)
            xb4 = tl.load(xb + j + 4, mask=gm, other=0.0).to(tl.float32)
            part += a * xa[None, :] + b * xb4[None, :]
            c, d = fp16_pair(w_hi, j)
            xc = tl.load(xb + j + 8, mask=gm, other=0.0).to(tl.float32)
            xd = tl.load(xb + j + 12, mask=gm, other=0.0).to(tl.float32)
            part += c * xc[None, :] + d * xd[None, :]
        acc += part * sc
    return tl.sum(acc, axis=1)


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


# weight formats of the prefill GEMM tiles (``dequant_tile``)
FMT_NVFP4 = tl.constexpr(0)
FMT_MXFP4 = tl.constexpr(1)
FMT_FP8 = tl.constexpr(2)
FORMAT_CODES = {"nvfp4": 0, "mxfp4": 1, "fp8_block": 2}  # weight format name -> the FMT constexpr


@triton.jit
def fp4_nibbles_f32(b):
    """uint8/int32 bytes [R, C] -> (low, high nibble) as exact E2M1 * 2^-14 in fp32 (the f16 bit
    trick of ``fp16_pair``, one byte at a time: subnormal 0.5 included)."""
    b = b.to(tl.int32)
    lo = (((b & 7) << 9) | ((b & 8) << 12)).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    hi = (((b & 0x70) << 5) | ((b & 0x80) << 8)).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    return lo, hi


@triton.jit
def dequant_tile(w_ptr, s_ptr, rows, row_ok, k0, stride_wn, stride_sn, BN: tl.constexpr, BK: tl.constexpr,
                 FMT: tl.constexpr, DOT_DTYPE: tl.constexpr, WORDS: tl.constexpr = False):
    """Weight rows ``rows`` [BN], columns k0 .. k0 + BK (BK a multiple of 32; FP8 tiles inside one
    128-column scale block) as [BN, BK] DOT_DTYPE in K order, block scales applied (exact: E2M1
    times e4m3 / E8M0 has at most 6 significant bits; FP8 rounds e4m3 * fp32 scale once, like
    ``FP8BlockWeight.dequantize``); NVFP4's global scale is left to the caller.

    NVFP4: ``w_ptr`` bytes [N, K/2], ``s_ptr`` e4m3 bytes [N, K/16]. MXFP4: the same bytes, E8M0
    [N, K/32]. FP8: e4m3 bytes [N, K], ``s_ptr`` fp32 [ceil(N/128), ceil(K/128)]."""
    if FMT == FMT_FP8:
        offs_k = k0 + tl.arange(0, BK)
        w8 = tl.load(w_ptr + rows[:, None] * stride_wn + offs_k[None, :], mask=row_ok[:, None], other=0)
        sc = tl.load(s_ptr + (rows // 128) * stride_sn + k0 // 128, mask=row_ok, other=0.0)
        return (w8.to(tl.float8e4nv, bitcast=True).to(tl.float32) * sc[:, None]).to(DOT_DTYPE)
    else:
        if WORDS:
            # int32 words (8 codes): 4-byte shared-memory reads instead of single bytes; bytes 4w + i
            offs_w = k0 // 8 + tl.arange(0, BK // 8)
            w32 = tl.load(w_ptr + rows[:, None] * (stride_wn // 4) + offs_w[None, :], mask=row_ok[:, None], other=0)
            b = tl.join(tl.join(w32 & 0xFF, (w32 >> 8) & 0xFF), tl.join((w32 >> 16) & 0xFF, (w32 >> 24) & 0xFF))
            b = tl.reshape(tl.permute(b, (0, 1, 3, 2)), (BN, BK // 2))
        else:
            offs_b = k0 // 2 + tl.arange(0, BK // 2)
            b = tl.load(w_ptr + rows[:, None] * stride_wn + offs_b[None, :], mask=row_ok[:, None], other=0)
        lo, hi = fp4_nibbles_f32(b)
        w = tl.join(lo, hi)  # [BN, BK/2, 2]: element 2i (low nibble), 2i + 1 (high)
        if FMT == FMT_NVFP4:
            offs_g = k0 // 16 + tl.arange(0, BK // 16)
            sc = e4m3_to_f32(tl.load(s_ptr + rows[:, None] * stride_sn + offs_g[None, :], mask=row_ok[:, None],
                                     other=0)) * 16384.0
            w = tl.reshape(w, (BN, BK // 16, 16)) * sc[:, :, None]
        else:
            offs_g = k0 // 32 + tl.arange(0, BK // 32)
            sc = e8m0_to_f32(tl.load(s_ptr + rows[:, None] * stride_sn + offs_g[None, :], mask=row_ok[:, None],
                                     other=127)) * 16384.0
            w = tl.reshape(w, (BN, BK // 32, 32)) * sc[:, :, None]
        return tl.reshape(w, (BN, BK)).to(DOT_DTYPE)


SEL_SCAN = 256  # selected slots ``selected_extent`` reads a step in prefill (many programs overlap the loads)
SEL_SCAN_MAX = 4096  # selected slots ``selected_extent`` reads in one load (V4-Pro's k = 1024: one)


def sel_scan_block(k: int) -> int:
    """Decode's ``selected_extent`` BLOCK for k selected slots: all of them in one load up to SEL_SCAN_MAX
    (a loop of smaller loads is a chain of dependent reads before the first key tile)."""
    return min(next_pow2(max(k, 16)), SEL_SCAN_MAX)


@triton.jit
def selected_extent(sel_row_ptr, K, BLOCK: tl.constexpr):
    """1 + the last slot c < K of one query's selected row (int32 / int64 entry indices) holding an
    index >= 0, 0 when none does. The attention kernels walk the selected slots only this far: past
    it every tile is all -1, which the online softmax leaves unchanged (p = 0, alpha = 1), so the
    result is the same and no order of the -1s is assumed. The indexer's top-k puts its -1s last,
    so a query with n < k closed entries walks n slots, not k (a 4k prompt's CSA queries average
    half of V4-Pro's 1024)."""
    hi = tl.sum(tl.zeros([BLOCK], dtype=tl.int32), 0)
    for c0 in range(0, K, BLOCK):
        c = c0 + tl.arange(0, BLOCK)
        idx = tl.load(sel_row_ptr + c, mask=c < K, other=-1)
        hi = tl.maximum(hi, tl.max(tl.where(idx >= 0, c + 1, 0), 0))
    return hi


@triton.jit
def head_block_query(q_row_ptr, sink_ptr, sq_h, H, D, hb, DOT: tl.constexpr, BLOCK_H: tl.constexpr,
                     BLOCK_D: tl.constexpr):
    """The attention kernels' start for heads hb * BLOCK_H.. of one query row (``q_row_ptr``: its
    head 0): head / dim offsets and masks, q [BLOCK_H, BLOCK_D] in DOT (masked: 0) and the running
    max started at the per-head sink logit (fp32)."""
    offs_h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    hmask = offs_h < H
    dmask = offs_d < D
    q = tl.load(q_row_ptr + offs_h[:, None] * sq_h + offs_d[None, :], mask=hmask[:, None] & dmask[None, :],
                other=0.0).to(DOT)
    m_i = tl.load(sink_ptr + offs_h, mask=hmask, other=0.0).to(tl.float32)
    return offs_h, offs_d, hmask, dmask, q, m_i


@triton.jit
def online_softmax_tile(q, k, valid, m_i, l_i, acc, scale, DOT: tl.constexpr, IEEE: tl.constexpr):
    """One key tile of the attention kernels' online softmax: q [BH, D] (in DOT), keys k [BN, D]
    (K == V, loaded; masked rows zero), valid [BN]; running max m_i, sum l_i [BH] and acc [BH, D]
    in fp32. P goes to DOT for P.V (IEEE fp32 dots when DOT is fp32)."""
    k = k.to(DOT)
    if IEEE:
        s = tl.dot(q, tl.trans(k), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k))
    s = tl.where(valid[None, :], s * scale, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp(m_i - m_new)
    p = tl.exp(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    if IEEE:
        pv = tl.dot(p.to(DOT), k, input_precision="ieee")
    else:
        pv = tl.dot(p.to(DOT), k)
    acc = acc * alpha[:, None] + pv
    return m_new, l_i, acc


# f16x2 path (M == 1 on the GPU): the nibbles of an int32 word are turned into E5M2-like bytes
# (sign at bit 7, e1 e0 m at bits 3..1), four at a time: the even nibbles of all four bytes with
# one pair of shifts and masks, the odd ones with another; prmt then puts two such bytes into the
# high bytes of an f16x2 register, which is E2M1 * 2^-14 exactly (subnormals included). Per 8
# weights: 3 shifts, 4 logic ops, 4 prmt, 4 hfma2 (the nibble-pair decode it replaced needed 7
# shifts and 8 logic ops: 1805 -> 1549 SASS instructions per 256x16-word box and thread).
# Pairs: (e0, e2), (e4, e6) from the even codes, (e1, e3), (e5, e7) from the odd ones.
# $1/$2: the group's low/high int32 word; $3..$6 / $7..$10: the matching x' pairs.
_H2_WORD = """
shl.b32 a, {w}, 1; shl.b32 b, {w}, 4; and.b32 b, b, 0x80808080; lop3.b32 e, a, b, 0x0E0E0E0E, 0xEC;
shr.b32 a, {w}, 3; and.b32 b, {w}, 0x80808080; lop3.b32 o, a, b, 0x0E0E0E0E, 0xEC;
prmt.b32 p, e, 0, 0x1404; fma.rn.f16x2 acc, p, {x0}, acc;
prmt.b32 p, e, 0, 0x3424; fma.rn.f16x2 acc, p, {x1}, acc;
prmt.b32 p, o, 0, 0x1404; fma.rn.f16x2 acc, p, {x2}, acc;
prmt.b32 p, o, 0, 0x3424; fma.rn.f16x2 acc, p, {x3}, acc;
"""
# element offsets (within an 8-element half group) of the low half of x' pairs 0..3; the high
# half is the element 2 further on
H2_PAIR_LO = (0, 4, 1, 5)
_H2_GROUP_ASM = tl.constexpr("{ .reg .b32 a, b, e, o, p, acc; .reg .f16 hlo, hhi; .reg .f32 flo, fhi;\nmov.b32 acc, 0;\n"
                 + _H2_WORD.format(w="$1", x0="$3", x1="$4", x2="$5", x3="$6")
                 + _H2_WORD.format(w="$2", x0="$7", x1="$8", x2="$9", x3="$10")
                 + "mov.b32 {hlo, hhi}, acc; cvt.f32.f16 flo, hlo; cvt.f32.f16 fhi, hhi; add.f32 flo, flo, fhi;\n"
                 + "mov.b32 $0, flo; }")


@triton.jit
def _code_to_f32(c):
    """E5M2-like byte code (sign bit 7, e1 e0 m bits 3..1) -> the f16 with that high byte, as fp32."""
    return ((c & 0xFF) << 8).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _h2_word_emulated(w32, x0, x1, x2, x3, acc_lo, acc_hi):
    """What one _H2_WORD block computes, in plain Triton (the interpreter cannot run PTX): the
    even/odd byte codes, exact f16 products added to the f16 running sums in the same order
    (pair k: lo half element H2_PAIR_LO[k], hi half element H2_PAIR_LO[k] + 2)."""
    even = ((w32 << 1) & 0x0E0E0E0E) | ((w32 << 4) & -2139062144)   # -2139062144 = 0x80808080
    odd = ((w32 >> 3) & 0x0E0E0E0E) | (w32 & -2139062144)
    for k in tl.static_range(4):
        if k == 0:
            xp = x0
        elif k == 1:
            xp = x1
        elif k == 2:
            xp = x2
        else:
            xp = x3
        if k < 2:
            c = even >> (16 * k)
        else:
            c = odd >> (16 * (k - 2))
        lo = _code_to_f32(c)
        hi = _code_to_f32(c >> 8)
        xa = xp.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        xc = (xp >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        acc_lo = (acc_lo + lo * xa).to(tl.float16).to(tl.float32)
        acc_hi = (acc_hi + hi * xc).to(tl.float16).to(tl.float32)
    return acc_lo, acc_hi


@triton.jit
def group_dot(w64, x0, x1, x2, x3, x4, x5, x6, x7, BN: tl.constexpr, G: tl.constexpr, USE_ASM: tl.constexpr):
    """Per (row, group) sum of the 16 products of one int64 weight word [BN, G] with the group's
    x' pairs x0..x7 ([1, G] each), in units of 2^-14 / xs: ``_H2_GROUP_ASM`` on the GPU, its
    plain-Triton emulation under the interpreter (one running f16x2 sum over both halves)."""
    w_lo = w64.to(tl.int32)
    w_hi = (w64 >> 32).to(tl.int32)
    if USE_ASM:
        part = tl.inline_asm_elementwise(
            _H2_GROUP_ASM, "=r,r,r,r,r,r,r,r,r,r,r", [w_lo, w_hi, x0, x1, x2, x3, x4, x5, x6, x7],
            dtype=tl.int32, is_pure=True, pack=1).to(tl.float32, bitcast=True)
    else:
        z = tl.zeros((BN, G), dtype=tl.float32)
        a_lo, a_hi = _h2_word_emulated(w_lo, x0, x1, x2, x3, z, z)
        a_lo, a_hi = _h2_word_emulated(w_hi, x4, x5, x6, x7, a_lo, a_hi)
        part = a_lo + a_hi
    return part


# ----------------------------------------------------------------------------- host side
_COUNTERS: dict = {}  # (device type, index, lane) -> split-K tile counters
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
T = TypeVar("T")


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for host ints. ``triton.cdiv`` is a ``constexpr_function`` in triton 3.6: ~2 us
    of argument unwrapping per host call, paid several times per launch."""
    return -(-a // b)


def next_pow2(n: int) -> int:
    """The smallest power of two >= n (0 for 0), as ``triton.next_power_of_2`` without its host cost."""
    return 1 << (n - 1).bit_length() if n > 0 else 0


_PER_WEIGHT: dict[int, tuple[weakref.ref, dict]] = {}  # id(tensor) -> (weakref to it, {key: value})
PER_WEIGHT_ENTRIES = 8  # per tensor; a miss beyond this clears its entries (a swapped .data, dtypes)


def _drop_weight(i: int, ref: weakref.ref) -> None:
    if _PER_WEIGHT.get(i, (None,))[0] is ref:
        del _PER_WEIGHT[i]


def weight_cached(t: torch.Tensor, key: tuple, build: Callable[[], T]) -> T:
    """``build()`` once per (tensor object ``t``, its data_ptr / shape / strides, ``key``): what the
    launch of a weight derives from it alone (configs, split arithmetic, TMA descriptors over it).

    Safe against stale entries: keyed on ``t``'s identity through a weak reference (a new weight
    object, e.g. after ``QLinear.set_weight``, misses; an entry goes when its tensor dies, so no
    dead weight is kept alive by the cache) and on its data_ptr / shape / strides (``t.data = ...``
    misses). ``key`` must name everything else the value depends on (other tensors by id AND
    data_ptr, dtypes, devices, env switches)."""
    i = id(t)
    slot = _PER_WEIGHT.get(i)
    if slot is None or slot[0]() is not t:
        slot = _PER_WEIGHT[i] = (weakref.ref(t, lambda r, i=i: _drop_weight(i, r)), {})
    full = (t.data_ptr(), t.shape, t.stride(), key)
    entries = slot[1]
    v = entries.get(full)
    if v is None:
        if len(entries) >= PER_WEIGHT_ENTRIES:
            entries.clear()
        v = entries[full] = build()
    return v


def rebased(template: TensorDescriptor, base: torch.Tensor) -> TensorDescriptor:
    """``template`` over another tensor of the same shape, strides and dtype (16-byte aligned, as
    every allocation is): a copy with ``base`` swapped, skipping ``TensorDescriptor``'s validation
    (~4 us a call) that ``template`` already passed for this geometry."""
    if not hasattr(template, "__dict__"):  # a triton whose descriptor keeps its fields in slots: rebuild
        return template if base is None else TensorDescriptor(base, template.shape, template.strides,
                                                              template.block_shape)
    d = object.__new__(TensorDescriptor)
    d.__dict__.update(template.__dict__)
    d.base = base
    return d


_SCRATCH: dict = {}  # (tag, shape, dtype, device, lane) -> a kept buffer (never dropped: graphs keep its address)
_SCRATCH_IDS: set = set()  # id() of each kept buffer (alive forever, so an id names one buffer)
SCRATCH_MAX_ELEMS = 1 << 22  # larger requests (prefill sizes) get a fresh allocation instead


def scratch(tag: str, shape: tuple, dtype: torch.dtype, device: torch.device, lane: int | None = None) -> torch.Tensor:
    """A buffer for a kernel's internal operands (x pairs, split-K partials, the MoE's SwiGLU rows):
    written and read back by the launches of one call, never handed to the caller. One kept tensor
    per (tag, shape, dtype, device) instead of an allocation per call (~3-5 us of host each on the
    H200's host, ~30 a V4-Pro eager decode layer). Safe because those launches run in order on the
    device's stream: a later call's first write waits for the earlier call's last read (a PDL
    launch waits for the previous grid before its first access). Kept forever: a CUDA graph
    captured over it holds its address. Requests above ``SCRATCH_MAX_ELEMS`` are allocated fresh.
    One buffer per decode lane (``dsv4lab.lanes``; ``lane``: that lane's, default the current one):
    the side lane's launches run beside the main's."""
    key = (tag, shape, dtype, device, current_lane() if lane is None else lane)
    t = _SCRATCH.get(key)
    if t is None:
        t = torch.empty(shape, dtype=dtype, device=device)
        if math.prod(shape) <= SCRATCH_MAX_ELEMS:
            _SCRATCH[key] = t
            _SCRATCH_IDS.add(id(t))
    return t


PDL_ON = os.environ.get("DSV4LAB_PDL", "1") != "0"   # read once: A/B runs set it per process
_PDL_SMS: dict = {}  # device -> SM count where PDL applies (Hopper and newer), 0 where it does not


def pdl_kw(pdl: bool) -> dict:
    """A launch site's keywords for the choice: the kernel's ``PDL`` constexpr, and Triton's
    ``launch_pdl`` option where it is on (passed only then: off is Triton's default)."""
    return {"PDL": True, "launch_pdl": True} if pdl else {"PDL": False}


def use_pdl(programs: int, device: torch.device) -> bool:
    """Launch a decode kernel of ``programs`` CTAs with PDL (``pdl_enter`` + ``launch_pdl``)? On
    CUDA sm_90+ for grids of at most one wave: CTAs that the next grid makes resident early wait in
    ``griddepcontrol.wait`` and hold SM slots, which a multi-wave grid's later CTAs would need."""
    sms = _PDL_SMS.get(device)
    if sms is None:
        ok = PDL_ON and not INTERPRET and device.type == "cuda" and device_capability(device)[0] >= 9
        sms = _PDL_SMS[device] = num_sms(device) if ok else 0
    return programs <= sms


def counters(device: torch.device, n: int) -> torch.Tensor:
    """Split-K tile counters (zero at rest: each tile's last program resets its own), one array per
    device and decode lane (``dsv4lab.lanes``: two lanes' launches run at once)."""
    key = (device.type, device.index, current_lane())
    c = _COUNTERS.get(key)
    if c is None or c.numel() < n:
        c = torch.zeros(max(n, 4096), dtype=torch.int32, device=device)
        _COUNTERS[key] = c
    return c


@functools.lru_cache(maxsize=None)
def _capability(index: int | None) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def device_capability(device: torch.device) -> tuple[int, int]:
    """The CUDA capability of ``device``, kept per device: the kernels' support checks ask on every
    call (a device-properties query each time)."""
    return _capability(device.index if device.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of ``device``, kept per device (split rules ask on every decode
    launch: a properties query each time otherwise); 4 for the CPU (interpreter, stubs)."""
    if device.type == "cuda":
        return _sm_count(device.index if device.index is not None else torch.cuda.current_device())
    return 4


def dot_dtype(x: torch.Tensor | torch.dtype):
    """The tl.dot operand dtype for activations x (a tensor or its dtype)."""
    if INTERPRET:  # triton 3.6's interpreter mis-computes bf16 tl.dot under numpy 2.x; fp32 is
        return tl.float32  # the same math here (operands are exact bf16 values)
    return tl.float16 if getattr(x, "dtype", x) == torch.float16 else tl.bfloat16


BOX_GROUPS = 16  # 16-groups per TMA box along K: 128 bytes of weight words, 16 bytes of scales per row
INV_PAD = 64  # x_pairs' 1/xs is zero-padded to a multiple of this many groups (the widest box)


@triton.jit
def pair_rows(x, BG: tl.constexpr):
    """x [BG, 16] fp32 (BG 16-groups of an activation row) -> (rows [BG, 16] int32: the group's 8
    f16x2 pairs in columns 0-7, the bits of 1/xs in column 8, zeros after; 1/xs [BG] fp32), with a
    power-of-two xs per group (x * xs exact in f16 for bf16 x). The one body of ``_x_pairs_kernel``
    and of the norm kernel that emits its output's pairs (``norm_rope``), so both give these bits."""
    e = (tl.max(tl.abs(x), axis=1).to(tl.int32, bitcast=True) >> 23) & 0xFF
    b = tl.minimum(tl.maximum(268 - e, 1), 253)        # xs = 2^(141 - e) = 2^(b - 127)
    xs = (b << 23).to(tl.float32, bitcast=True)
    inv = ((254 - b) << 23).to(tl.float32, bitcast=True)
    h = (x * xs[:, None]).to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    # element 8h + 4q + 2t + r -> pair 4h + (2r + q), half t (H2_PAIR_LO = 0, 4, 1, 5; high half +2)
    h = tl.reshape(tl.permute(tl.reshape(h, (BG, 2, 2, 2, 2)), (0, 1, 4, 2, 3)), (BG, 8, 2))
    lo, hi = tl.split(h)
    pairs = tl.reshape(lo | (hi << 16), (BG, 8))
    c8 = tl.arange(0, 8)[None, :]
    extra = tl.where(c8 == 0, inv.to(tl.int32, bitcast=True)[:, None], 0)   # column 8: 1/xs bits
    return tl.reshape(tl.permute(tl.join(pairs, extra), (0, 2, 1)), (BG, 16)), inv


@triton.jit
def store_pair_rows(x, xp_ptr, inv_ptr, g, KG, KGP, BG: tl.constexpr):
    """``pair_rows`` of x [BG, 16] (groups ``g``) stored as ``x_pairs`` lays them out: rows g < KG,
    1/xs for g < KGP with zeros from KG on."""
    row, inv = pair_rows(x, BG)
    ok = g < KG
    tl.store(xp_ptr + g[:, None] * 16 + tl.arange(0, 16)[None, :], row, mask=ok[:, None])
    tl.store(inv_ptr + g, tl.where(ok, inv, 0.0), mask=g < KGP)


@triton.jit
def _x_pairs_kernel(x_ptr, xp_ptr, inv_ptr, KG, KGP, BG: tl.constexpr, PDL: tl.constexpr):
    """x [K] -> rows [KG, 16] of f16x2 pairs (columns 0-7) and 1/xs bits (column 8) per 16-group
    (power-of-two scaling), and 1/xs [KGP] on its own (zeros from KG to KGP)."""
    if PDL:  # launched early (programmatic dependent launch): wait for the previous grid's writes
        gdc_wait()
        gdc_launch_dependents()
    g = tl.program_id(0) * BG + tl.arange(0, BG)
    ok = g < KG
    x = tl.load(x_ptr + g[:, None] * 16 + tl.arange(0, 16)[None, :], mask=ok[:, None], other=0.0).to(tl.float32)
    store_pair_rows(x, xp_ptr, inv_ptr, g, KG, KGP, BG)


@triton.jit
def _pairs_at(xt, G: tl.constexpr, XINV: tl.constexpr):
    """The 8 f16x2 pair columns, each [1, G], of a loaded box ``xt`` of G pair rows (``XINV``: the
    box holds whole 16-word rows, pairs and 1/xs; else only the 8 pair words)."""
    if XINV:
        xt, _ = tl.split(tl.permute(tl.reshape(xt, (G, 2, 8)), (0, 2, 1)))   # columns 0-7
    xt = tl.reshape(xt, (G, 2, 2, 2))
    e0, e1 = tl.split(xt)
    e00, e01 = tl.split(e0)
    e10, e11 = tl.split(e1)
    x0, x4 = tl.split(e00)
    x2, x6 = tl.split(e01)
    x1, x5 = tl.split(e10)
    x3, x7 = tl.split(e11)
    return x0[None, :], x1[None, :], x2[None, :], x3[None, :], x4[None, :], x5[None, :], x6[None, :], x7[None, :]


@triton.jit
def pairs_and_inv(x_desc, inv_ptr, row0, g0, G: tl.constexpr, XINV: tl.constexpr):
    """Pair columns (``_pairs_at``) and 1/xs [1, G] of the G groups g0.. of the activation row whose
    groups start at pair row ``row0`` (0 for the GEMV; token / (token, expert) rows in the MoE).

    ``XINV``: 1/xs comes in column 8 of the same TMA rows as the pairs (q_b 19.5 -> 18.8-19.0 us,
    experts 8.6 -> 8.3 us; but o_b 23.5 -> 25.1 us, 23.9 at its best re-swept tile, so its rule
    keeps the other way). Else it is read unmasked from ``inv_ptr`` (``x_pairs`` zero-pads it to
    whole boxes); masked, that load compiled to 16 scalar cp.async per box with their address and
    predicate set-up, ~10 % of the loop's instructions. A TMA load of 1/xs on its own needed 128
    shuffles to broadcast, and 1-D descriptors faulted."""
    if XINV:
        xt = x_desc.load([row0 + g0, 0])
        _, rest = tl.split(tl.permute(tl.reshape(xt, (G, 2, 8)), (0, 2, 1)))   # columns 8..15
        rest, _ = tl.split(tl.reshape(rest, (G, 4, 2)))                # 8, 10, 12, 14
        rest, _ = tl.split(tl.reshape(rest, (G, 2, 2)))                # 8, 12
        c8, _ = tl.split(rest)                                         # 8: the bits of 1/xs
        inv = c8.to(tl.float32, bitcast=True)[None, :]
    else:  # issued before the pair box, as measured (the other order changes register allocation)
        inv = tl.load(inv_ptr + row0 + g0 + tl.arange(0, G))[None, :]
        xt = x_desc.load([row0 + g0, 0])
    x0, x1, x2, x3, x4, x5, x6, x7 = _pairs_at(xt, G, XINV)
    return inv, x0, x1, x2, x3, x4, x5, x6, x7


@triton.jit
def block_scales(s_desc, n0, g0, BN: tl.constexpr, G: tl.constexpr, MX: tl.constexpr):
    """[BN, G] fp32 scales of the G 16-groups from g0: NVFP4 one e4m3 per group; MXFP4 one E8M0 per
    32 elements, i.e. per two groups (the descriptor's box is [BN, G/2])."""
    if MX:
        f = e8m0_to_f32(s_desc.load([n0, g0 // 2]))
        return tl.reshape(tl.join(f, f), (BN, G))
    else:
        return e4m3_to_f32(s_desc.load([n0, g0]))


@triton.jit
def weight_global_scale(gs_ptr, idx, MX: tl.constexpr):
    """The tensor-wide (per-expert: ``idx``) NVFP4 global scale; MXFP4 has none (1, no load, so a
    placeholder pointer is fine and no device-side constant has to exist before graph capture)."""
    if MX:
        return 1.0
    else:
        return tl.load(gs_ptr + idx).to(tl.float32)


def expert_ids(ids: torch.Tensor) -> torch.Tensor:
    """The MoE kernels' flat expert ids [T * k]: the router's int64 ids as they are (the kernels load
    either width), anything else as int32; a ``.to(int32)`` was one more CUDA kernel a decode layer."""
    flat = ids.reshape(-1)
    if flat.dtype not in (torch.int32, torch.int64):
        flat = flat.to(torch.int32)
    return flat if flat.is_contiguous() else flat.contiguous()


def pairs_buffers(KG: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The kept ``x_pairs`` buffers of a K/16 = KG row on ``device`` for a launch about to write
    them: rows int32 [KG, 16] and 1/xs fp32 [KGP] (KG padded to whole ``INV_PAD`` boxes). On the
    main lane, first waits for a side lane that borrowed them (``lanes.main_writes``)."""
    main_writes((KG, device))
    return _kept_pairs(KG, device)


_EMITTED: dict = {}  # (KG, device, lane) -> (activation, its version, the buffers' generation) whose pairs they hold
_PAIRS_GEN: dict = {}  # (KG, device, lane) -> how many times the kept pairs buffers of that size were written


def pairs_written(KG: int, device: torch.device, x: torch.Tensor | None = None) -> None:
    """Record a write of the kept pairs buffers of size KG (``x_pairs`` or an emitting kernel):
    with ``x``, they now hold x's pairs (``emitted``); without, whatever they held is gone."""
    lane = current_lane()
    key = (KG, device, lane)
    gen = _PAIRS_GEN[key] = _PAIRS_GEN.get(key, 0) + 1
    if x is None:
        _EMITTED.pop(key, None)
    else:  # x kept alive here, so no other tensor can be given its address
        _EMITTED[key] = (x, x._version, gen, x.data_ptr(), note_main_write() if lane == MAIN else 0)


def _pairs_record(x: torch.Tensor, key: tuple) -> tuple | None:
    """The record of the kept pairs buffers ``key`` = (KG, device, lane) if they hold x's pairs
    (``pairs_written(KG, dev, x)`` and no write since: x that tensor or a view of all of it at the
    same version), else None."""
    got = _EMITTED.get(key)
    if (got is not None and got[3] == x.data_ptr() and got[1] == x._version and got[2] == _PAIRS_GEN.get(key)
            and got[0].dtype == x.dtype and got[0].numel() == x.numel()):
        return got
    return None


def _kept_pairs(KG: int, device: torch.device, lane: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """A lane's kept pairs buffers (default the current lane's), for reading or writing."""
    return (scratch("x_pairs", (KG, 16), torch.int32, device, lane),
            scratch("x_pairs_inv", (cdiv(KG, INV_PAD) * INV_PAD,), torch.float32, device, lane))


def x_pairs(x: torch.Tensor, pdl: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """x (any float dtype, contiguous; its K = numel elements: one row) -> (int32 [K/16, 16]: per
    16-group the 8 f16x2 pairs, the bits of 1/xs and 7 unused words; 1/xs fp32 [KGP] again on its
    own, zeros after the K/16 groups up to whole ``INV_PAD`` boxes). Both are ``pairs_buffers``
    (valid until the next write of that size on this device: the GEMV launched next reads them),
    so eager decode allocates nothing here.

    No launch when the buffers hold x's pairs already because the kernel that produced x wrote
    them (``pairs_written(KG, dev, x)``: the decode's RMSNorm launches for the rows that feed
    GEMVs) and nothing wrote them since: x that tensor or a view of all of it (same address,
    dtype and size) at the same version counter, the buffers at the same generation; on a decode
    side lane also when the main lane's buffers hold them (read in place: ``lanes.borrow``, so a
    main-lane write to them first waits for the side lane). Otherwise always launched, also for an activation whose
    pairs the buffer may still hold: a memo of x_pairs' own results keyed on address and version
    was tried and dropped, because the MoE's SwiGLU rows live in a kept buffer that a kernel
    rewrites without bumping its version, so the memo served the previous token's pairs; an
    emitting kernel's output is a new tensor that no kernel writes afterwards."""
    KG = x.numel() // 16
    dev = x.device
    lane = current_lane()
    if _pairs_record(x, (KG, dev, lane)) is not None:
        return _kept_pairs(KG, dev)
    if lane != MAIN:
        got = _pairs_record(x, (KG, dev, MAIN))
        if got is not None:  # the side lane reads what the main lane emitted, in place
            borrow((KG, dev), got[4])
            return _kept_pairs(KG, dev, MAIN)
    xp, inv = pairs_buffers(KG, dev)
    kernel = _x_pairs_kernel  # looked up per call: a test's stand-in replaces the module attribute
    site = _X_PAIRS_SITES.get((id(kernel), pdl))
    if site is None:
        site = _X_PAIRS_SITES[id(kernel), pdl] = LaunchSite(
            kernel, BG=_X_PAIRS_BG, num_warps=1 if INTERPRET else 4, **pdl_kw(pdl))
    site((cdiv(inv.shape[0], _X_PAIRS_BG),), x, xp, inv, KG, inv.shape[0])
    pairs_written(KG, dev)
    return xp, inv


_X_PAIRS_BG = 16 if INTERPRET else 32   # 16-groups per program
_X_PAIRS_SITES: dict = {}               # (id(kernel), pdl) -> its LaunchSite (no per-call keyword key)


_PAIRS_DESC: dict = {}  # (KG, g, xinv) -> a descriptor over some x_pairs rows, the geometry to rebase
_PAIRS_KEPT: dict = {}  # (id(xp), g, xinv) -> the descriptor over that kept (``scratch``) pairs buffer


def pairs_descriptor(xp: torch.Tensor, g: int, xinv: bool) -> TensorDescriptor:
    """TMA descriptor over ``x_pairs`` rows [KG, 16] with boxes of ``g`` groups: whole rows (pairs
    and 1/xs, ``xinv``) or only their 8 pair words (row stride 64 bytes). Over a ``scratch`` buffer
    the same descriptor object comes back on every call, so its encoded TMA map is kept too
    (``launch``'s raw path)."""
    kept = _PAIRS_KEPT.get((id(xp), g, xinv))
    if kept is not None and kept.base is xp:
        return kept
    key = (xp.shape[0], g, xinv)
    tpl = _PAIRS_DESC.get(key)
    if tpl is None or xp.stride() != (16, 1) or xp.dtype != torch.int32:
        if xinv:
            d = TensorDescriptor.from_tensor(xp, [g, 16])
        else:
            d = TensorDescriptor(xp, [xp.shape[0], 8], [xp.stride(0), 1], [g, 8])
        if xp.stride() == (16, 1) and xp.dtype == torch.int32:
            _PAIRS_DESC[key] = rebased(d, None)  # the geometry only: keeps no activation alive
    else:
        d = rebased(tpl, xp)
    if id(xp) in _SCRATCH_IDS:
        _PAIRS_KEPT[id(xp), g, xinv] = d
    return d
