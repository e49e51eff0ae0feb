"""NVFP4 (ModelOpt) W4A16 matmul: y = x @ W^T with W kept packed.

Layout: ``packed`` uint8 [N, K/2] (low nibble = even element), ``block_scale`` e4m3 [N, K/16],
``global_scale`` fp32 scalar; W = E2M1[code] * float(block_scale) * global_scale.

Two Triton kernels here, plus the TMA-fed decode GEMV in ``dsv4lab.kernels.linear_nvfp4_tma`` that M <= 16
takes on Hopper+ (this module's GEMV stays for older GPUs and unaligned shapes):

* ``_gemv_kernel`` (M <= 16, decode). The packed rows are read as int64 words: one word = 16
  elements = exactly one scale block. Nibbles j and j+4 of an int32 become exact E2M1 * 2^-14
  values (``((w << (9-4j)) & 0x0E000E00) | ((w << (12-4j)) & 0x80008000)`` as an f16 pair,
  subnormals included) for the ``tl.dot`` and fp32 loops.
  - M == 1, ``H2`` (default on CUDA): the nibbles become E5M2-like bytes four at a time and
    ``prmt`` packs two into an f16x2 (``_H2_WORD``: the same E2M1 * 2^-14 values in fewer
    instructions); inline PTX multiplies the f16x2 weights into x' = x * xs
    (xs a power of two putting max|x| in [2^14, 2^15), so x' is exact in f16 for bf16 x and
    every sum of 8 products stays below 2^7) with ``fma.rn.f16x2``; the 16-element group sum is
    widened to fp32 once and scaled by the block scale. ``XP``: x' is packed into the f16x2
    pairs by one small kernel (``_x_pairs_kernel``) before the GEMV, so CTAs load 8 int32 per
    group instead of converting 16 x values each. ``PF``: weight tiles prefetched ahead (1 or 2).
    Under the interpreter the PTX is emulated with f16 roundings in Triton.
  - M == 1 without ``H2``: fp32 FMAs with a cvt per weight (kept as the ablation baseline).
  - M in 2..16: ``tl.dot`` per nibble plane (weights as the A operand, exact E2M1*s in bf16),
    the batch padded to 16.
  Split-K over many CTAs with an in-kernel fix-up: every split writes an fp32 partial, bumps a
  per-tile counter, and the last one sums the partials, writes the output and resets the
  counter (one launch, graph-safe). Configs are tuned per shape on first use.
* ``_gemm_kernel`` (M > 16 below sm_90 or M < 64; M >= 64 on sm_90+ takes ``dsv4lab.kernels.linear_gemm``): tiles dequantised to bf16/fp16 in registers (lo/hi nibbles
  joined back into K order) and ``tl.dot``; split-K (same fix-up) when the (M, N) tiles cannot
  fill the SMs.

The global scale is applied to the fp32 accumulator, not folded into the weights; the reference
(``NVFP4Weight.dequantize`` then matmul) rounds the weight to the activation dtype instead, so
the two differ by accumulation order and one bf16 rounding of W (tolerances in docs/kernels.md).

Shared device helpers: the decodes and group dot in ``weight_decode``, the split-K finish in ``split_k``.
Import has no side effects; triton is imported here, so import this module lazily
(``dsv4lab.kernels.dispatch`` does).
"""
from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl
from triton.testing import do_bench

from ..model.linear import grouped_linear
from .dequant_gemm import DENSE_MIN_M, SCRATCH_BYTES, dense_supported, dequantize_rows
from .device import env_value, on_input_device
from .host import INTERPRET, cdiv, counters, dot_dtype, next_pow2, num_sms, weight_cached
from .launch import launch
from .linear_gemm import gemm_supported, prefill_gemm
from .linear_nvfp4_tma import GemvTmaPlan, emits_pairs, launch_gemv_tma, pair_fits, run_gemv_tma, run_gemv_tma_pair, \
    tma_default_config, tma_supported
from .split_k import store_or_fix_up
from .weight_decode import e4m3_to_f32, gemv_rows_m1, group_dot, nibble_plane_dots


@triton.jit
def _x_half(xb, o: tl.constexpr, gm, xs):
    """x'[16g + o] = x * xs (power of two) as f16 bits in the low half of an int32."""
    v = (tl.load(xb + o, mask=gm, other=0.0).to(tl.float32) * xs).to(tl.float16)
    return v.to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF


@triton.jit
def _x_pair(xb, o: tl.constexpr, gm, xs):
    """x' pair (elements o, o + 2) of a group: o = 8h + H2_PAIR_LO[j] for pair 4h + j."""
    return _x_half(xb, o, gm, xs) | (_x_half(xb, o + 2, gm, xs) << 16)


@triton.jit
def _x_scale(x_ptr, k_lo, k_hi, XB: tl.constexpr):
    """Power of two xs (and 1/xs) with max|x[k_lo:k_hi]| * xs in [2^14, 2^15): x' = x*xs is
    exact in f16 for bf16 x and products with E2M1*2^-14 stay normal, sums of 8 below 2^7."""
    amax = tl.zeros((XB,), dtype=tl.float32)
    for k0 in range(k_lo, k_hi, XB):
        offs = k0 + tl.arange(0, XB)
        amax = tl.maximum(amax, tl.abs(tl.load(x_ptr + offs, mask=offs < k_hi, other=0.0).to(tl.float32)))
    e = (tl.max(amax, axis=0).to(tl.int32, bitcast=True) >> 23) & 0xFF
    b = tl.minimum(tl.maximum(268 - e, 1), 253)       # xs = 2^(141 - e) = 2^(b - 127)
    return (b << 23).to(tl.float32, bitcast=True), ((254 - b) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _x_pairs_kernel(x_ptr, xp_ptr, inv_ptr, K, XB: tl.constexpr):
    """One CTA: x' = x * xs (power of two, see _x_scale) packed as the f16x2 pairs the M=1 loop
    consumes (pair 8g + 4h + j = elements 16g + 8h + H2_PAIR_LO[j] and +2), and 1/xs; one launch per call lets
    every GEMV CTA read 8 int32 per group instead of converting 16 x values itself."""
    xs, inv = _x_scale(x_ptr, 0, K, XB)
    for p0 in range(0, K // 2, XB):
        p = p0 + tl.arange(0, XB)
        ok = p < K // 2
        a = (p // 8) * 16 + ((p % 8) // 4) * 8 + (p % 2) * 4 + (p % 4) // 2   # H2_PAIR_LO = 0, 4, 1, 5
        lo = (tl.load(x_ptr + a, mask=ok, other=0.0).to(tl.float32) * xs).to(tl.float16)
        hi = (tl.load(x_ptr + a + 2, mask=ok, other=0.0).to(tl.float32) * xs).to(tl.float16)
        pair = (lo.to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF) | (hi.to(tl.int16, bitcast=True).to(tl.int32) << 16)
        tl.store(xp_ptr + p, pair, mask=ok)
    tl.store(inv_ptr, inv)


@triton.jit
def _load_pairs(xp_ptr, gg, gm):
    """The 8 precomputed x' pairs of groups gg, as [1, G] rows (broadcast over the tile's rows)."""
    xq = xp_ptr + gg * 8
    return (tl.load(xq + 0, mask=gm, other=0)[None, :], tl.load(xq + 1, mask=gm, other=0)[None, :],
            tl.load(xq + 2, mask=gm, other=0)[None, :], tl.load(xq + 3, mask=gm, other=0)[None, :],
            tl.load(xq + 4, mask=gm, other=0)[None, :], tl.load(xq + 5, mask=gm, other=0)[None, :],
            tl.load(xq + 6, mask=gm, other=0)[None, :], tl.load(xq + 7, mask=gm, other=0)[None, :])


@triton.jit
def _gemv_rows_m1_h2(w_ptr, s_ptr, stride_wn, stride_sn, x_ptr, xp_ptr, rows, row_ok, g_lo, g_hi, gps, xs,
                     BN: tl.constexpr, G: tl.constexpr, USE_ASM: tl.constexpr, XP: tl.constexpr, PF: tl.constexpr):
    """Like gemv_rows_m1 (result in units of 2^-14 / xs) with f16x2 products: see _H2_GROUP_ASM.
    XP: the x' pairs come precomputed from _x_pairs_kernel, else each CTA builds them.
    PF: weight tiles in flight ahead of the one being decoded (1 or 2)."""
    acc = tl.zeros((BN, G), dtype=tl.float32)
    offs_g = tl.arange(0, G)
    gg = g_lo + offs_g
    m2 = row_ok[:, None] & (gg < g_hi)[None, :]
    w_nx = tl.load(w_ptr + rows[:, None] * stride_wn + gg[None, :], mask=m2, other=0)
    s_nx = tl.load(s_ptr + rows[:, None] * stride_sn + gg[None, :], mask=m2, other=0)
    if PF == 2:
        m2b = row_ok[:, None] & ((gg + G) < g_hi)[None, :]
        w_nx2 = tl.load(w_ptr + rows[:, None] * stride_wn + (gg + G)[None, :], mask=m2b, other=0)
        s_nx2 = tl.load(s_ptr + rows[:, None] * stride_sn + (gg + G)[None, :], mask=m2b, other=0)
    for g0 in range(g_lo, g_lo + gps, G):
        gg = g0 + offs_g
        gm = gg < g_hi
        w64 = w_nx
        sc = e4m3_to_f32(s_nx)
        gn = gg + PF * G
        mn = row_ok[:, None] & (gn < g_hi)[None, :]
        if PF == 2:
            w_nx = w_nx2
            s_nx = s_nx2
            w_nx2 = tl.load(w_ptr + rows[:, None] * stride_wn + gn[None, :], mask=mn, other=0)
            s_nx2 = tl.load(s_ptr + rows[:, None] * stride_sn + gn[None, :], mask=mn, other=0)
        else:
            w_nx = tl.load(w_ptr + rows[:, None] * stride_wn + gn[None, :], mask=mn, other=0)
            s_nx = tl.load(s_ptr + rows[:, None] * stride_sn + gn[None, :], mask=mn, other=0)
        if XP:
            x0, x1, x2, x3, x4, x5, x6, x7 = _load_pairs(xp_ptr, gg, gm)
        else:
            xb = x_ptr + gg * 16
            x0 = _x_pair(xb, 0, gm, xs)[None, :]    # offsets 8h + H2_PAIR_LO[j]
            x1 = _x_pair(xb, 4, gm, xs)[None, :]
            x2 = _x_pair(xb, 1, gm, xs)[None, :]
            x3 = _x_pair(xb, 5, gm, xs)[None, :]
            x4 = _x_pair(xb, 8, gm, xs)[None, :]
            x5 = _x_pair(xb, 12, gm, xs)[None, :]
            x6 = _x_pair(xb, 9, gm, xs)[None, :]
            x7 = _x_pair(xb, 13, gm, xs)[None, :]
        acc += group_dot(w64, x0, x1, x2, x3, x4, x5, x6, x7, BN, G, USE_ASM) * sc
    return tl.sum(acc, axis=1)


@triton.jit
def _gemv_rows_dot(w_ptr, s_ptr, stride_wn, stride_sn, x_ptr, stride_xm, M, rows, row_ok, g_lo, g_hi, gps,
                   BN: tl.constexpr, G: tl.constexpr, BMP: tl.constexpr, DOT_DTYPE: tl.constexpr):
    """[BN, BMP] = W[rows] @ x[:M]^T over groups [g_lo, g_hi); weights as exact E2M1*s in DOT_DTYPE."""
    acc = tl.zeros((BN, BMP), dtype=tl.float32)
    offs_g = tl.arange(0, G)
    offs_m = tl.arange(0, BMP)
    m_ok = offs_m < M
    for g0 in range(g_lo, g_lo + gps, G):
        gg = g0 + offs_g
        gm = gg < g_hi
        m2 = row_ok[:, None] & gm[None, :]
        w64 = tl.load(w_ptr + rows[:, None] * stride_wn + gg[None, :], mask=m2, other=0)
        sc = e4m3_to_f32(tl.load(s_ptr + rows[:, None] * stride_sn + gg[None, :], mask=m2, other=0)) * 16384.0
        # x^T planes [G, BMP]: element 16*g + j of each activation row
        xt = x_ptr + offs_m[None, :] * stride_xm + gg[:, None] * 16
        acc = nibble_plane_dots(w64, sc, xt, gm[:, None] & m_ok[None, :], acc, DOT_DTYPE)
    return acc


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, s_ptr, gs_ptr, y_ptr, ws_ptr, cnt_ptr, xp_ptr, inv_ptr,
                 M, N, KG, stride_xm, stride_wn, stride_sn, stride_ym, groups_per_split, SPLIT,
                 USE_SPLIT: tl.constexpr, BN: tl.constexpr, G: tl.constexpr, BMP: tl.constexpr,
                 DOT_DTYPE: tl.constexpr, H2: tl.constexpr, USE_ASM: tl.constexpr, XP: tl.constexpr,
                 PF: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rows = pid_n * BN + tl.arange(0, BN)
    row_ok = rows < N
    g_lo = pid_k * groups_per_split
    g_hi = tl.minimum(g_lo + groups_per_split, KG)
    gs = tl.load(gs_ptr).to(tl.float32)
    if BMP == 1:
        if H2:
            if XP:
                xs = 1.0
                inv_xs = tl.load(inv_ptr)
            else:
                xs, inv_xs = _x_scale(x_ptr, g_lo * 16, g_hi * 16, 1024)
            acc = _gemv_rows_m1_h2(w_ptr, s_ptr, stride_wn, stride_sn, x_ptr, xp_ptr, rows, row_ok, g_lo, g_hi,
                                   groups_per_split, xs, BN, G, USE_ASM, XP, PF)
            acc = acc * (16384.0 * inv_xs)  # undo 2^-14 (nibble trick) and the x scaling
        else:
            acc = gemv_rows_m1(w_ptr, s_ptr, stride_wn, stride_sn, x_ptr, rows, row_ok, g_lo, g_hi, groups_per_split, BN, G)
            acc = acc * 16384.0  # undo the 2^-14 of the fp16 nibble trick
        store_or_fix_up(acc, y_ptr + rows, ws_ptr + rows, row_ok, cnt_ptr, pid_n, pid_k, N, SPLIT, gs, USE_SPLIT)
    else:
        acc = _gemv_rows_dot(w_ptr, s_ptr, stride_wn, stride_sn, x_ptr, stride_xm, M, rows, row_ok,
                             g_lo, g_hi, groups_per_split, BN, G, BMP, DOT_DTYPE)
        offs_m = tl.arange(0, BMP)
        store_or_fix_up(acc, y_ptr + offs_m[None, :] * stride_ym + rows[:, None], ws_ptr + offs_m[None, :] * N + rows[:, None],
                         row_ok[:, None] & (offs_m < M)[None, :], cnt_ptr, pid_n, pid_k, M * N, SPLIT, gs, USE_SPLIT)


@triton.jit
def _gemm_kernel(x_ptr, p_ptr, s_ptr, gs_ptr, y_ptr, ws_ptr, cnt_ptr, M, N, K, k_per_split, SPLIT,
                 stride_xm, stride_pn, stride_sn, stride_ym,
                 BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, DOT_DTYPE: tl.constexpr,
                 USE_SPLIT: tl.constexpr):
    """Tiled GEMM over (M, N) tiles and K splits; splits > 1 finish like the GEMV (fp32
    partials, a per-tile counter, the last split sums and stores)."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_n = pid_n * BN + tl.arange(0, BN)
    m_ok = offs_m < M
    n_ok = offs_n < N
    offs_kb = tl.arange(0, BK // 2)
    offs_k = tl.arange(0, BK)
    offs_g = tl.arange(0, BK // 16)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    k_lo = pid_k * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    for k0 in range(k_lo, k_hi, BK):
        k_ok = (k0 + offs_k) < k_hi
        xt = tl.load(x_ptr + offs_m[:, None] * stride_xm + (k0 + offs_k)[None, :],
                     mask=m_ok[:, None] & k_ok[None, :], other=0.0).to(DOT_DTYPE)
        kb_ok = (k0 // 2 + offs_kb) < k_hi // 2
        b = tl.load(p_ptr + offs_n[:, None] * stride_pn + (k0 // 2 + offs_kb)[None, :],
                    mask=n_ok[:, None] & kb_ok[None, :], other=0).to(tl.int32)
        g_ok = (k0 // 16 + offs_g) < k_hi // 16
        sc = e4m3_to_f32(tl.load(s_ptr + offs_n[:, None] * stride_sn + (k0 // 16 + offs_g)[None, :],
                                  mask=n_ok[:, None] & g_ok[None, :], other=0)) * 16384.0
        lo = (((b & 7) << 9) | ((b & 8) << 12)).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        hi = (((b & 0x70) << 5) | ((b & 0x80) << 8)).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        w = tl.reshape(tl.join(lo, hi), (BN, BK // 16, 16))
        w = tl.reshape(w * sc[:, :, None], (BN, BK)).to(DOT_DTYPE)
        acc = tl.dot(xt, tl.trans(w), acc)
    store_or_fix_up(acc, y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :], ws_ptr + offs_m[:, None] * N + offs_n[None, :],
                     m_ok[:, None] & n_ok[None, :], cnt_ptr, pid_m * tl.num_programs(1) + pid_n, pid_k, M * N, SPLIT,
                     tl.load(gs_ptr).to(tl.float32), USE_SPLIT)


_TUNED: dict = {}
def _bmp(m: int) -> int:
    return 1 if m == 1 else 16


def default_config(M: int, N: int, K: int, device: torch.device) -> dict:
    """Heuristic: enough CTAs to cover every SM ~4x; split K when N alone does not."""
    KG = K // 16
    if M == 1:
        bn, g, warps = (32, 16, 4) if not INTERPRET else (16, 2, 1)
    else:
        bn, g, warps = (64, 16, 4) if not INTERPRET else (16, 16, 1)
    n_tiles = cdiv(N, bn)
    target = 4 * num_sms(device)
    split = max(1, min(cdiv(target, n_tiles), KG // (4 * g) if KG >= 4 * g else 1, 64))
    return {"BN": bn, "G": g, "SPLIT": split, "num_warps": warps, "H2": M == 1, "XP": M == 1}


def _candidates(M: int, N: int, K: int, device: torch.device) -> list[dict]:
    KG = K // 16
    sms = num_sms(device)
    shapes = [(32, 16, 4), (64, 8, 4), (64, 16, 4), (128, 8, 8), (128, 16, 8), (256, 8, 8)] if M == 1 else \
             [(64, 16, 4), (128, 16, 4), (64, 32, 4)]
    out = []
    for bn, g, w in shapes:
        n_tiles = cdiv(N, bn)
        for mult in (2, 4, 8):
            split = max(1, min(cdiv(mult * sms, n_tiles), max(1, KG // g), 64))
            for h2, xp, pf in (((True, True, 1), (True, True, 2), (True, False, 1), (False, False, 1)) if M == 1
                               else ((False, False, 1),)):
                c = {"BN": bn, "G": g, "SPLIT": split, "num_warps": w, "H2": h2, "XP": xp, "PF": pf}
                if c not in out:
                    out.append(c)
    return out


def _launch_gemv(x2, packed, scale, gs, y, cfg):
    if cfg.get("TMA"):
        if x2.shape[0] > 16 or not tma_supported(x2, packed, scale):
            raise ValueError("a TMA config needs M <= 16, K % 256 == 0, 16-byte aligned weights and CUDA "
                             "capability >= 9.0 (or TRITON_INTERPRET=1)")
        launch_gemv_tma(x2, packed, scale, gs, y, cfg)
        return
    M, K = x2.shape
    N = packed.shape[0]
    KG = K // 16
    w64 = packed.view(torch.int64)
    split = cfg["SPLIT"]
    gps = cdiv(cdiv(KG, split), cfg["G"]) * cfg["G"]
    split = cdiv(KG, gps)
    n_tiles = cdiv(N, cfg["BN"])
    bmp = _bmp(M)
    if split > 1:
        ws = torch.empty((split, M, N), dtype=torch.float32, device=x2.device)
        cnt = counters(x2.device, n_tiles)
    else:
        ws = y
        cnt = y
    h2 = bool(cfg.get("H2", False)) and bmp == 1
    xpairs = h2 and bool(cfg.get("XP", False))
    if xpairs:
        xp = torch.empty(K // 2, dtype=torch.int32, device=x2.device)
        inv = torch.empty(1, dtype=torch.float32, device=x2.device)
        xb = 64 if INTERPRET else min(4096, next_pow2(max(K // 2, 64)))  # few, wide steps: it runs before every CTA
        launch(_x_pairs_kernel, (1,), x2, xp, inv, K, XB=xb, num_warps=1 if INTERPRET else 16)
    else:
        xp, inv = x2, gs
    launch(_gemv_kernel, (n_tiles, split),
        x2, w64, scale.view(torch.uint8), gs, y, ws, cnt, xp, inv,
        M, N, KG, x2.stride(0), w64.stride(0), scale.stride(0), y.stride(0), gps, split,
        USE_SPLIT=split > 1, BN=cfg["BN"], G=cfg["G"], BMP=bmp, DOT_DTYPE=dot_dtype(x2),
        H2=h2, USE_ASM=not INTERPRET, XP=xpairs, PF=int(cfg.get("PF", 1)),
        num_warps=cfg["num_warps"])


def gemm_config(M: int, N: int, K: int, device: torch.device) -> dict:
    """Prefill tiles; split K when the (M, N) tiles alone cannot fill the SMs (e.g. wkv 7168->512
    at M=128 has 4 tiles of 128x128)."""
    if INTERPRET:
        return {"BM": 32, "BN": 16, "BK": 32, "SPLIT": 1, "num_warps": 1}
    bm, bn, bk, warps = (64 if M <= 64 else 128), 128, 64, 8
    tiles = cdiv(M, bm) * cdiv(N, bn)
    sms = num_sms(device)
    split = 1
    if tiles < sms:
        split = max(1, min(cdiv(2 * sms, tiles), K // (4 * bk), 32))
    return {"BM": bm, "BN": bn, "BK": bk, "SPLIT": split, "num_warps": warps}


def _launch_gemm(x2, packed, scale, gs, y, cfg):
    M, K = x2.shape
    N = packed.shape[0]
    bm, bn, bk = cfg["BM"], cfg["BN"], cfg["BK"]
    kps = cdiv(cdiv(K, cfg["SPLIT"]), bk) * bk  # whole BK steps (and 16-groups) per split
    split = cdiv(K, kps)
    grid = (cdiv(M, bm), cdiv(N, bn), split)
    if split > 1:
        ws = torch.empty((split, M, N), dtype=torch.float32, device=x2.device)
        cnt = counters(x2.device, grid[0] * grid[1])
    else:
        ws, cnt = y, y
    launch(_gemm_kernel, grid, x2, packed, scale, gs, y, ws, cnt, M, N, K, kps, split,
                       x2.stride(0), packed.stride(0), scale.stride(0), y.stride(0),
                       BM=bm, BN=bn, BK=bk, DOT_DTYPE=dot_dtype(x2), USE_SPLIT=split > 1,
                       num_warps=cfg["num_warps"])


def _use_tma(x2, packed, scale) -> bool:
    """M <= 16 on Hopper+ with TMA-compatible strides takes ``nvfp4_gemv_tma`` (DSV4LAB_KERNEL_TMA=0 opts out)."""
    if x2.shape[0] > 16 or x2.device.type != "cuda" or os.environ.get("DSV4LAB_KERNEL_TMA", "1") == "0":
        return False
    return tma_supported(x2, packed, scale)


@functools.lru_cache(maxsize=None)
def _device_kind(dev_type: str, index: int | None) -> tuple:
    """What a tuned config depends on: identical GPUs share one choice."""
    if dev_type != "cuda":
        return (dev_type,)
    p = torch.cuda.get_device_properties(index)
    return (p.name, p.major, p.minor, p.multi_processor_count)


def tune_key(M: int, N: int, K: int, dtype: torch.dtype, device: torch.device, tma: bool) -> tuple:
    """The ``_TUNED`` key of a matmul call (benchmarks read the chosen configs back with it)."""
    return (_bmp(M), N, K, dtype, _device_kind(device.type, device.index), tma)


def _tuned_config(x2, packed, scale, gs, y) -> dict:
    """The config of a call without one. The TMA GEMV has a fixed tile rule; the pointer GEMV uses
    ``default_config`` unless DSV4LAB_KERNEL_TUNE=1, which times the candidates with ``do_bench``
    on first use. Off by default because a timed choice (its split K, so its fp32 summation order)
    can differ between GPUs and runs: the NVFP4 model split over two H200s gave logits up to 0.8
    apart from one GPU. Tuned choices are shared by identical GPUs."""
    M, K = x2.shape
    N = packed.shape[0]
    tma = _use_tma(x2, packed, scale)
    key = tune_key(M, N, K, x2.dtype, x2.device, tma)
    cfg = _TUNED.get(key)
    if cfg is not None:
        return cfg
    if tma:  # fixed tile rule, see tma_default_config
        cfg = tma_default_config(N, K, x2.device, M)
    elif x2.device.type != "cuda" or os.environ.get("DSV4LAB_KERNEL_TUNE", "0") != "1" \
            or torch.cuda.is_current_stream_capturing():
        cfg = default_config(M, N, K, x2.device)
    else:
        best = None
        for c in _candidates(M, N, K, x2.device):
            try:
                t = do_bench(lambda: _launch_gemv(x2, packed, scale, gs, y, c), warmup=5, rep=20)
            except Exception:  # a config that does not compile/fit is skipped
                continue
            if best is None or t < best[0]:
                best = (t, c)
        cfg = best[1] if best else default_config(M, N, K, x2.device)
    _TUNED[key] = cfg
    return cfg


class _DecodePlan:
    """A weight's decode (M <= 16) launch, cached by ``_decode_plan``: its uint8 views, the config
    and, on the TMA path, the ``GemvTmaPlan``; ``gs`` the fp32 [1] view of the global scale (None
    when that needs a copy, which is then made per call so in-place updates are seen)."""

    __slots__ = ("packed", "scale", "cfg", "tma", "gs")

    def __init__(self, packed, scale, cfg, tma, gs):
        self.packed, self.scale, self.cfg, self.tma, self.gs = packed, scale, cfg, tma, gs


def _decode_plan(x2: torch.Tensor, packed: torch.Tensor, block_scale: torch.Tensor, global_scale: torch.Tensor,
                 M: int) -> _DecodePlan | None:
    """The cached ``_DecodePlan`` of this weight for x2's dtype, device and batch bucket (x2 [..., K]
    rows; None when the weight's tensors need a per-call copy: a byte-offset or strided view). Keyed
    on the weight tensors' identities and data pointers (``host.weight_cached``) and on DSV4LAB_KERNEL_TMA."""
    key = (id(block_scale), block_scale.data_ptr(), id(global_scale), global_scale.data_ptr(), M == 1, x2.dtype,
           x2.device, env_value("DSV4LAB_KERNEL_TMA", "1"))
    return weight_cached(packed, key, lambda: _build_decode_plan(x2.reshape(-1, x2.shape[-1]), packed, block_scale,
                                                                 global_scale))


def _build_decode_plan(x2, packed_in, block_scale, global_scale) -> _DecodePlan | None:
    packed = packed_in.view(torch.uint8).contiguous()
    scale = block_scale.view(torch.uint8).contiguous()
    if packed.data_ptr() != packed_in.data_ptr() or packed.data_ptr() % 8 or scale.data_ptr() != block_scale.data_ptr():
        return None  # copies: nvfp4_matmul's uncached path makes them per call
    gs = global_scale.reshape(1).to(device=x2.device, dtype=torch.float32)
    y = torch.empty((x2.shape[0], packed.shape[0]), dtype=x2.dtype, device=x2.device)  # for a tuning run only
    cfg = _tuned_config(x2, packed, scale, gs, y)
    tma = None
    if cfg.get("TMA"):
        if not tma_supported(x2, packed, scale):
            raise ValueError("a TMA config needs M <= 16, K % 256 == 0, 16-byte aligned weights and CUDA "
                             "capability >= 9.0 (or TRITON_INTERPRET=1)")
        tma = GemvTmaPlan(packed, scale, cfg, x2.shape[0] == 1, x2.dtype)
    return _DecodePlan(packed, scale, cfg, tma, gs if gs.data_ptr() == global_scale.data_ptr() else None)


@on_input_device
def nvfp4_matmul(x: torch.Tensor, packed: torch.Tensor, block_scale: torch.Tensor,
                 global_scale: torch.Tensor, out_dtype: torch.dtype | None = None,
                 config: dict | None = None) -> torch.Tensor:
    """y[..., N] = x[..., K] @ W^T for NVFP4 W given as (packed [N,K/2], block_scale [N,K/16], gs).

    M = prod(leading dims) <= 16 takes the split-K GEMV kernel, larger M the tiled GEMM; M >= 64 on
    sm_90+ the prefill GEMM of ``dsv4lab.kernels.linear_gemm`` (``config`` keys of its
    ``gemm_tiles``; ``TILED=True`` keeps this module's tiled GEMM). M <= 16 on
    CUDA capability >= 9.0 with K % 256 == 0 takes the TMA-fed GEMV (``dsv4lab.kernels.linear_nvfp4_tma``).
    ``config`` overrides the tuned choice (GEMV: BN, G, SPLIT, num_warps, H2, XP, PF; TMA GEMV:
    TMA=True, BN, STAGES, SPLIT, num_warps; GEMM: BM, BN, BK, SPLIT, num_warps). Output dtype =
    x.dtype by default.
    """
    N, KH = packed.shape
    K = KH * 2
    if x.shape[-1] != K:
        raise ValueError(f"x last dim {x.shape[-1]} != weight in_features {K}")
    lead = x.shape[:-1]
    if config is None and x.numel() == K and x.is_contiguous():
        # one token (decode): the M = 1 GEMV reads x by address alone, so no [1, K] view is made
        plan = _decode_plan(x, packed, block_scale, global_scale, 1)
        if plan is not None and plan.tma is not None and plan.tma.m1:
            gs = plan.gs if plan.gs is not None else global_scale.reshape(1).to(device=x.device, dtype=torch.float32)
            y = x.new_empty((*lead, N), dtype=out_dtype or x.dtype)
            run_gemv_tma(plan.tma, x, gs, y)
            return y
    x2 = x if x.dim() == 2 else x.reshape(-1, K)  # reshape makes a new tensor object even when it is one
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    M = x2.shape[0]
    if 0 < M <= 16 and config is None:
        plan = _decode_plan(x2, packed, block_scale, global_scale, M)
        if plan is not None:
            gs = plan.gs if plan.gs is not None else global_scale.reshape(1).to(device=x.device, dtype=torch.float32)
            m1 = plan.tma is not None and plan.tma.m1   # the M = 1 GEMV writes y's N contiguous values
            y = torch.empty((*lead, N) if m1 else (M, N), dtype=out_dtype or x.dtype, device=x.device)
            if plan.tma is not None:
                run_gemv_tma(plan.tma, x2, gs, y)
            else:
                _launch_gemv(x2, plan.packed, plan.scale, gs, y, plan.cfg)
            return y if m1 else y.reshape(*lead, N)
    packed = packed.view(torch.uint8).contiguous()
    if packed.data_ptr() % 8:  # the kernels read packed rows as int64 words (a byte-offset view: copy once)
        packed = packed.clone()
    scale = block_scale.view(torch.uint8).contiguous()
    gs = global_scale.reshape(1).to(device=x.device, dtype=torch.float32)
    y = torch.empty((M, N), dtype=out_dtype or x.dtype, device=x.device)
    if M == 0:
        return y.reshape(*lead, N)
    if config and config.get("TMA") and M > 16:
        raise ValueError(f"a TMA config is for decode (M <= 16); got M = {M}")
    if M <= 16:
        cfg = config or _tuned_config(x2, packed, scale, gs, y)
        _launch_gemv(x2, packed, scale, gs, y, cfg)
    elif gemm_supported(x2, K) and not (config or {}).get("TILED"):
        prefill_gemm(x2, "nvfp4", packed, scale, gs, y, config)
    else:
        _launch_gemm(x2, packed, scale, gs, y, {**gemm_config(M, N, K, x2.device), **(config or {})})
    return y.reshape(*lead, N)


def _grouped_plan(x1: torch.Tensor, packed_in: torch.Tensor, block_scale: torch.Tensor, global_scale: torch.Tensor,
                  groups: int) -> _DecodePlan | None:
    """The cached one-token grouped plan of this weight (``launch_gemv_tma(groups=G)``'s, built once:
    a plan per call rebuilt its descriptors and launch site on every eager step, ~0.5 ms a layer on
    the H200). None when the TMA GEMV does not apply (DSV4LAB_KERNEL_TMA=0, ``tma_supported``), the
    row blocks are not a multiple of the tile or the weight needs a copy."""
    key = ("grouped", groups, id(block_scale), block_scale.data_ptr(), id(global_scale), global_scale.data_ptr(),
           x1.dtype, x1.device, env_value("DSV4LAB_KERNEL_TMA", "1"))

    def build() -> _DecodePlan | None:
        packed, scale = packed_in.view(torch.uint8), block_scale.view(torch.uint8)
        N, K = packed.shape[0], packed.shape[1] * 2
        if env_value("DSV4LAB_KERNEL_TMA", "1") == "0" or not tma_supported(x1, packed, scale):
            return None
        cfg = tma_default_config(N, K, x1.device, 1)
        if (N // groups) % cfg["BN"] or not (packed.is_contiguous() and scale.is_contiguous()):
            return None
        gs = global_scale.reshape(1).to(device=x1.device, dtype=torch.float32)
        plan = GemvTmaPlan(packed, scale, cfg, True, x1.dtype, groups)
        return _DecodePlan(packed, scale, cfg, plan, gs if gs.data_ptr() == global_scale.data_ptr() else None)

    return weight_cached(packed_in, key, build)


@on_input_device
def nvfp4_grouped_matmul(x: torch.Tensor, packed: torch.Tensor, block_scale: torch.Tensor,
                         global_scale: torch.Tensor) -> torch.Tensor:
    """The block-diagonal (grouped) use: x [..., G, K] -> y [..., G, N/G], row block g of W times
    x[..., g, :]. One token on the TMA path (sm_90+, K % 256 == 0, row blocks a multiple of the
    tile) is one prelude + one GEMV for all G blocks (wo_a: 16 blocks, 2 launches instead of 32).
    Where the prefill GEMM takes its dense tier (``DENSE_MIN_M`` tokens) and W fits the
    dequantiser's scratch, W is dequantised once and multiplied as the reference does
    (``grouped_linear``: one bmm; bitwise the reference): 2 launches instead of 16 dequantisations,
    16 GEMMs and a stack. Otherwise one ``nvfp4_matmul`` per row block (views, no copy)."""
    G, K = x.shape[-2], x.shape[-1]
    N = packed.shape[0]
    if N % G:
        raise ValueError(f"grouped matmul: {N} weight rows do not split into {G} groups")
    rows = N // G
    lead = x.shape[:-2]
    if x.is_cuda and x.numel() == G * K and x.is_contiguous():  # one token: the GEMV reads x by address alone
        plan = _grouped_plan(x, packed, block_scale, global_scale, G)
        if plan is not None:
            y = x.new_empty((*lead, G, rows))
            gs = plan.gs if plan.gs is not None else global_scale.reshape(1).to(device=x.device, dtype=torch.float32)
            run_gemv_tma(plan.tma, x, gs, y, emit=emits_pairs(plan.tma, y))  # wo_b reads y's pairs: no prelude
            return y
    x1 = x.reshape(-1, G, K)
    packed_in, packed = packed, packed.view(torch.uint8)
    scale = block_scale.view(torch.uint8)
    if x1.shape[0] == 1 and _use_tma(x1[0, :1], packed, scale):
        plan = _grouped_plan(x1, packed_in, block_scale, global_scale, G)
        if plan is not None:
            y = torch.empty(N, dtype=x.dtype, device=x.device)
            gs = plan.gs if plan.gs is not None else global_scale.reshape(1).to(device=x.device, dtype=torch.float32)
            run_gemv_tma(plan.tma, x1[0].contiguous().reshape(1, G * K), gs, y, emit=emits_pairs(plan.tma, y))
            return y.view(*lead, G, rows)
    M = x1.shape[0]
    if (M >= DENSE_MIN_M and dense_supported(K) and gemm_supported(x1[:, 0], K)
            and N * K * x.element_size() <= SCRATCH_BYTES):
        gs = global_scale.reshape(1).to(device=x.device, dtype=torch.float32)
        return grouped_linear(x, dequantize_rows("nvfp4", packed, scale, gs, 0, N, x.dtype), G)
    ys = [nvfp4_matmul(x1[:, g], packed[g * rows:(g + 1) * rows], block_scale[g * rows:(g + 1) * rows], global_scale)
          for g in range(G)]
    return torch.stack(ys, dim=-2).view(*lead, G, rows)


@on_input_device
def nvfp4_pair_matmul(x: torch.Tensor, a, b) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(x @ A^T, x @ B^T) for one decode token x (K elements, contiguous) and two NVFP4 weights of
    in_features K in one launch, each bitwise ``nvfp4_matmul(x, ...)``; None where their M = 1 TMA
    GEMVs cannot share a launch (``linear_nvfp4_tma.pair_fits``: q_a and wkv of V4-Pro do)."""
    if x.numel() != a.packed.shape[1] * 2 or not x.is_contiguous():
        return None
    pa = _decode_plan(x, a.packed, a.block_scale, a.global_scale, 1)
    pb = _decode_plan(x, b.packed, b.block_scale, b.global_scale, 1)
    if pa is None or pb is None or pa.tma is None or pb.tma is None or pa.gs is None or pb.gs is None \
            or not pair_fits(pa.tma, pb.tma):
        return None
    lead = x.shape[:-1]
    ya = x.new_empty((*lead, pa.tma.N))
    yb = x.new_empty((*lead, pb.tma.N))
    run_gemv_tma_pair(pa.tma, pb.tma, x, pa.gs, pb.gs, ya, yb)
    return ya, yb


def nvfp4_matmul_ref(x: torch.Tensor, w) -> torch.Tensor:
    """Reference: ``NVFP4Weight.dequantize(x.dtype)`` then ``F.linear`` (what the kernel replaces)."""
    return torch.nn.functional.linear(x, w.dequantize(x.dtype))
