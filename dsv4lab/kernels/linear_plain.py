"""Decode GEMV for unquantised (bf16 / fp16) weights: y = x @ W^T for M <= ``MAX_ROWS`` rows of x
in one launch (``QLinear.plain_kernel``).

Why: V4-Pro keeps several decode projections in bf16 (the compressors' wkv / wgate, the indexer's
weights_proj, the router). cuBLAS runs each as a split-K GEMV plus a separate reduce kernel: 5-8 us
for 0.9-15 MB of weight, 20-40 % of the copy rate (H200 graph trace of one CSA layer, 12 such
launches, ~41 us of its ~340). For the small ones (N <= 384) one launch is faster; the wide ones
(the compressors' 512 and 1024 rows) stay on cuBLAS (``dispatch.PLAIN_GEMV_MAX_N``). Here: grid =
row tiles of ``BN`` x K splits, each program streams its [BN, CH] slab of W against x's chunk with
fp32 FMAs (bf16 products are exact in fp32), and the split
partials are summed by the last program of the tile in split order (``store_or_fix_up``: one
launch, deterministic, CUDA-graph safe). The split is a fixed rule of the shape (no SM count), so
the order is the same on every GPU. The result differs from cuBLAS only in the fp32 summation order
before the one rounding to x's dtype.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from .common import cdiv, next_pow2, counters, pdl_enter, pdl_kw, scratch, store_or_fix_up, use_pdl, INTERPRET
from .device import on_input_device
from .launch import new_site

MAX_ROWS = 4            # x rows (decode batch) this kernel takes; dispatch.plain_linear sends more to cuBLAS
# tiles from an H200 sweep (scratch sweep of BN 8-32, BK 256-1024, 128-512 programs, 4 / 8 warps; graph
# replay over 24 weight copies, K = 7168): device us against cuBLAS's GEMV + reduce, N = 256: 4.89 vs
# 6.36, N = 64: 3.42 vs 5.99, N = 384: 5.50 vs 7.37, but N = 1024: 8.43 vs 8.04 (dispatch keeps cuBLAS
# from PLAIN_GEMV_MAX_N rows on)
BN = 8                  # weight rows per program
BK = 1024               # K per step (2 KB of a bf16 row)
TARGET_PROGRAMS = 512   # row tiles x splits aimed at
_SITES: dict = {}       # (id(kernel), constexprs) -> LaunchSite (4 plain GEMVs an eager CSA layer)


@triton.jit
def _gemv_plain_kernel(x_ptr, w_ptr, y_ptr, ws_ptr, cnt_ptr, M, N, K, CH, SPLIT, stride_xm, stride_wn, stride_ym,
                       USE_SPLIT: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                       PDL: tl.constexpr = False):
    pdl_enter(PDL)
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rows = pid_n * BN + tl.arange(0, BN)
    r_ok = rows < N
    m = tl.arange(0, BM)
    m_ok = m < M
    out = tl.zeros((BM, BN), dtype=tl.float32)
    k_lo = pid_k * CH
    for k0 in range(0, CH, BK):
        kk = k0 + tl.arange(0, BK)
        k = k_lo + kk
        k_ok = (kk < CH) & (k < K)
        w = tl.load(w_ptr + rows[:, None].to(tl.int64) * stride_wn + k[None, :], mask=r_ok[:, None] & k_ok[None, :],
                    other=0.0).to(tl.float32)
        x = tl.load(x_ptr + m[:, None] * stride_xm + k[None, :], mask=m_ok[:, None] & k_ok[None, :],
                    other=0.0).to(tl.float32)
        out += tl.sum(x[:, None, :] * w[None, :, :], axis=2)     # [BM, BN]
    mask = m_ok[:, None] & r_ok[None, :]
    store_or_fix_up(out, y_ptr + m[:, None] * stride_ym + rows[None, :], ws_ptr + m[:, None] * N + rows[None, :],
                    mask, cnt_ptr, pid_n, pid_k, M * N, SPLIT, 1.0, USE_SPLIT)


@functools.lru_cache(maxsize=1024)  # a rule of ints asked on every launch (4 plain GEMVs an eager layer)
def plain_split(N: int, K: int, split: int | None = None, bn: int = BN, bk: int = BK,
                programs: int = TARGET_PROGRAMS) -> tuple[int, int]:
    """(CH, SPLIT): K chunks of a multiple of ``bk`` so that row tiles x splits is about
    ``programs``, at most one chunk a step (V4-Pro, K = 7168: N = 384 -> 48 tiles x 7 splits of 1024)."""
    tiles = cdiv(N, bn)
    want = split or max(1, min(cdiv(programs, tiles), cdiv(K, bk)))
    ch = cdiv(cdiv(K, want), bk) * bk
    return ch, cdiv(K, ch)


def plain_gemv_takes(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Rows of x within MAX_ROWS, W [N, K] with unit inner stride in x's dtype on x's device."""
    return (w.dim() == 2 and w.dtype == x.dtype and w.device == x.device and w.stride(-1) == 1
            and x.shape[-1] == w.shape[1] and x.numel() // max(x.shape[-1], 1) <= MAX_ROWS)


def plain_gemv(x: torch.Tensor, w: torch.Tensor, *, split: int | None = None, config: dict | None = None) -> torch.Tensor:
    """y [..., N] = x [..., K] @ w^T for at most MAX_ROWS rows (``plain_gemv_takes``), in x's dtype;
    ``split`` overrides the rule, ``config`` the tile (BN, BK, PROGRAMS, WARPS; tests, sweeps)."""
    if not plain_gemv_takes(x, w):
        raise ValueError(f"plain_gemv: needs x [..., K] with at most {MAX_ROWS} rows and w [N, K] (unit inner stride) "
                         f"of x's dtype on x's device; got x {tuple(x.shape)} {x.dtype} on {x.device}, w "
                         f"{tuple(w.shape)} {w.dtype} on {w.device}. Use dispatch.plain_linear, which falls back to F.linear")
    return launch_plain_gemv(x, w, split=split, config=config)


@on_input_device
def launch_plain_gemv(x: torch.Tensor, w: torch.Tensor, *, split: int | None = None,
                      config: dict | None = None) -> torch.Tensor:
    """``plain_gemv`` for inputs its caller has checked with ``plain_gemv_takes`` (the decode hot path:
    ``dispatch.plain_linear`` checks once)."""
    cfg = config or {}
    bn, bk = cfg.get("BN", BN), cfg.get("BK", BK)
    N, K = w.shape
    x2 = x.reshape(-1, K)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    M = x2.shape[0]
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if M == 0 or N == 0:
        return y.view(*x.shape[:-1], N)
    if K == 0:
        return y.zero_().view(*x.shape[:-1], N)
    ch, n_split = plain_split(N, K, split, bn, bk, cfg.get("PROGRAMS", TARGET_PROGRAMS))
    tiles = cdiv(N, bn)
    ws = scratch("plain_split", (n_split * M * N if n_split > 1 else 1,), torch.float32, x.device)
    cnt = counters(x.device, tiles)
    kernel, bm, warps = _gemv_plain_kernel, next_pow2(M), 1 if INTERPRET else cfg.get("WARPS", 4)  # kernel: tests replace it
    pdl = use_pdl(tiles * n_split, x.device)
    skey = (id(kernel), n_split > 1, bm, bn, bk, warps, pdl)
    site = _SITES.get(skey) or new_site(_SITES, skey, kernel, USE_SPLIT=n_split > 1, BM=bm, BN=bn, BK=bk,
                                        num_warps=warps, **pdl_kw(pdl))
    site((tiles, n_split), x2, w, y, ws, cnt, M, N, K, ch, n_split, x2.stride(0), w.stride(0), y.stride(0))
    return y.view(*x.shape[:-1], N)
