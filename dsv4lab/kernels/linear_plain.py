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

from .device import on_input_device
from .host import INTERPRET, cdiv, counters, next_pow2, scratch
from .launch import LaunchSite, new_site
from .pdl import pdl_enter, pdl_kw, use_pdl
from .split_k import store_or_fix_up

MAX_ROWS = 4            # x rows (decode batch) this kernel takes; dispatch.plain_linear sends more to cuBLAS
# tiles from an H200 sweep (scratch sweep of BN 8-32, BK 256-1024, 128-512 programs, 4 / 8 warps; graph
# replay over 24 weight copies, K = 7168): device us against cuBLAS's GEMV + reduce, N = 256: 4.89 vs
# 6.36, N = 64: 3.42 vs 5.99, N = 384: 5.50 vs 7.37, but N = 1024: 8.43 vs 8.04 (dispatch keeps cuBLAS
# from PLAIN_GEMV_MAX_N rows on)
BN = 8                  # weight rows per program
BK = 1024               # K per step (2 KB of a bf16 row)
TARGET_PROGRAMS = 512   # row tiles x splits aimed at
WARPS = 4               # warps of the single kernel's program (gate_route runs the same)
BATCH_WARPS = 4         # warps of a batched program
_SITES: dict = {}       # (id(kernel), constexprs) -> LaunchSite (4 plain GEMVs an eager CSA layer)


@triton.jit
def plain_acc(x_ptr, w_ptr, pid_n, pid_k, M, N, K, CH, stride_xm, stride_wn, BM: tl.constexpr, BN: tl.constexpr,
              BK: tl.constexpr):
    """One program's fp32 partial [BM, BN]: rows pid_n * BN.. of W against x's K chunk pid_k (of
    CH); with its token and row indices and their mask (the GEMV's and ``gate_route``'s tiles)."""
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
    return out, m, rows, m_ok[:, None] & r_ok[None, :]


@triton.jit
def _plain_tile(x_ptr, w_ptr, y_ptr, ws_ptr, cnt_ptr, pid_n, pid_k, M, N, K, CH, SPLIT, stride_xm, stride_wn,
                stride_ym, USE_SPLIT: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """One program of the GEMV: its partial (``plain_acc``) summed by ``store_or_fix_up`` (the one
    body of the single and the batched kernel, so a weight's outputs are the same bits in either)."""
    out, m, rows, mask = plain_acc(x_ptr, w_ptr, pid_n, pid_k, M, N, K, CH, stride_xm, stride_wn, BM, BN, BK)
    store_or_fix_up(out, y_ptr + m[:, None] * stride_ym + rows[None, :], ws_ptr + m[:, None] * N + rows[None, :],
                    mask, cnt_ptr, pid_n, pid_k, M * N, SPLIT, 1.0, USE_SPLIT)


@triton.jit
def _gemv_plain_kernel(x_ptr, w_ptr, y_ptr, ws_ptr, cnt_ptr, M, N, K, CH, SPLIT, stride_xm, stride_wn, stride_ym,
                       USE_SPLIT: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                       PDL: tl.constexpr = False):
    pdl_enter(PDL)
    _plain_tile(x_ptr, w_ptr, y_ptr, ws_ptr, cnt_ptr, tl.program_id(0), tl.program_id(1), M, N, K, CH, SPLIT,
                stride_xm, stride_wn, stride_ym, USE_SPLIT, BM, BN, BK)


@triton.jit
def _batch_member(x_ptr, w_ptr, y_ptr, ws_ptr, cnt_ptr, local, M, N, K, CH, SPLIT, stride_xm,
                  USE_SPLIT: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """Program ``local`` of one weight's block of the batched grid: its (row tile, K split) in the
    order of the single kernel's 2-D grid; y rows [M, N] contiguous, W rows of stride K."""
    _plain_tile(x_ptr, w_ptr, y_ptr, ws_ptr, cnt_ptr, local // SPLIT, local % SPLIT, M, N, K, CH, SPLIT,
                stride_xm, K, N, USE_SPLIT, BM, BN, BK)


@triton.jit
def _gemv_plain_batch_kernel(x_ptr, y_ptr, ws_ptr, cnt_ptr, M, K, stride_xm,
                             w0, w1, w2, w3, w4, n0, n1, n2, n3, n4, ch0, ch1, ch2, ch3, ch4,
                             s0, s1, s2, s3, s4,
                             NW: tl.constexpr, U0: tl.constexpr, U1: tl.constexpr, U2: tl.constexpr,
                             U3: tl.constexpr, U4: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                             BK: tl.constexpr):
    """Up to five weights [N_i, K] against one x in one launch: weight i owns a block of
    ceil(N_i / BN) * s_i programs (after the blocks of 0..i-1), its outputs [M, N_i] follow each
    other in y, its split partials in ws and its tile counters in cnt."""
    pid = tl.program_id(0)
    t0 = tl.cdiv(n0, BN)
    if pid < t0 * s0:
        _batch_member(x_ptr, w0, y_ptr, ws_ptr, cnt_ptr, pid, M, n0, K, ch0, s0, stride_xm, U0, BM, BN, BK)
    if NW > 1:
        p1, y1, q1, t1 = t0 * s0, M * n0, M * n0 * s0, t0
        if (pid >= p1) & (pid < p1 + tl.cdiv(n1, BN) * s1):
            _batch_member(x_ptr, w1, y_ptr + y1, ws_ptr + q1, cnt_ptr + t1, pid - p1, M, n1, K, ch1, s1, stride_xm,
                          U1, BM, BN, BK)
        if NW > 2:
            p2, y2, q2, t2 = p1 + tl.cdiv(n1, BN) * s1, y1 + M * n1, q1 + M * n1 * s1, t1 + tl.cdiv(n1, BN)
            if (pid >= p2) & (pid < p2 + tl.cdiv(n2, BN) * s2):
                _batch_member(x_ptr, w2, y_ptr + y2, ws_ptr + q2, cnt_ptr + t2, pid - p2, M, n2, K, ch2, s2,
                              stride_xm, U2, BM, BN, BK)
            if NW > 3:
                p3, y3, q3, t3 = p2 + tl.cdiv(n2, BN) * s2, y2 + M * n2, q2 + M * n2 * s2, t2 + tl.cdiv(n2, BN)
                if (pid >= p3) & (pid < p3 + tl.cdiv(n3, BN) * s3):
                    _batch_member(x_ptr, w3, y_ptr + y3, ws_ptr + q3, cnt_ptr + t3, pid - p3, M, n3, K, ch3, s3,
                                  stride_xm, U3, BM, BN, BK)
                if NW > 4:
                    p4, y4, q4, t4 = p3 + tl.cdiv(n3, BN) * s3, y3 + M * n3, q3 + M * n3 * s3, t3 + tl.cdiv(n3, BN)
                    if pid >= p4:
                        _batch_member(x_ptr, w4, y_ptr + y4, ws_ptr + q4, cnt_ptr + t4, pid - p4, M, n4, K, ch4, s4,
                                      stride_xm, U4, BM, BN, BK)


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
    y = x.new_empty(M, N)
    if M == 0 or N == 0:
        return y.view(*x.shape[:-1], N)
    if K == 0:
        return y.zero_().view(*x.shape[:-1], N)
    ch, n_split = plain_split(N, K, split, bn, bk, cfg.get("PROGRAMS", TARGET_PROGRAMS))
    tiles = cdiv(N, bn)
    ws = scratch("plain_split", (n_split * M * N if n_split > 1 else 1,), torch.float32, x.device)
    cnt = counters(x.device, tiles)
    kernel = _gemv_plain_kernel  # looked up per call: tests replace it
    bm, warps = next_pow2(M), 1 if INTERPRET else cfg.get("WARPS", WARPS)
    pdl = use_pdl(tiles * n_split, x.device)
    skey = (id(kernel), n_split > 1, bm, bn, bk, warps, pdl)
    site = _SITES.get(skey) or new_site(_SITES, skey, kernel, USE_SPLIT=n_split > 1, BM=bm, BN=bn, BK=bk,
                                        num_warps=warps, **pdl_kw(pdl))
    site((tiles, n_split), x2, w, y, ws, cnt, M, N, K, ch, n_split, x2.stride(0), w.stride(0), y.stride(0))
    return y.view(*x.shape[:-1], N)


MAX_BATCH = 5           # weights one batched launch takes (a CSA layer's compressor, indexer-compressor, weights_proj)
_BATCH_PLANS: dict = {}  # (weights' row counts, K, M) -> _BatchPlan


class _BatchPlan:
    """A batched launch's fixed part for one tuple of weight shapes and row count: the int arguments
    around the weights, the grid, the output split and the sizes of ws and cnt. Holds no tensor (the
    weights come with each call), so a cached plan keeps no replaced weight alive."""

    __slots__ = ("pad", "head", "tail", "sizes", "shapes", "grid", "ws_elems", "tiles", "site")

    def __init__(self, ns: tuple[int, ...], K: int, M: int):
        rules = [plain_split(n, K, None, BN, BK, TARGET_PROGRAMS) for n in ns]  # the module's tiles now
        self.pad = pad = MAX_BATCH - len(ns)
        self.sizes = [M * n for n in ns]
        self.shapes = [(M, n) for n in ns]
        self.grid = (sum(cdiv(n, BN) * s for n, (_, s) in zip(ns, rules)),)
        self.ws_elems = max(1, sum(M * n * s for n, (_, s) in zip(ns, rules)))
        self.tiles = sum(cdiv(n, BN) for n in ns)
        self.head = (M, K, K)   # rows, K, x's row stride (rows contiguous)
        self.tail = (*ns, *(0,) * pad, *(ch for ch, _ in rules), *(BK,) * pad, *(s for _, s in rules), *(1,) * pad)
        use = [s > 1 for _, s in rules] + [False] * pad
        # the ints are this plan's own objects on every call (``fixed``); the weights (7..11) are not
        self.site = LaunchSite(_gemv_plain_batch_kernel, fixed=(4, 5, 6, *range(12, 12 + len(self.tail))),
                               NW=len(ns), U0=use[0], U1=use[1], U2=use[2], U3=use[3], U4=use[4],
                               BM=next_pow2(M), BN=BN, BK=BK, num_warps=1 if INTERPRET else BATCH_WARPS)


def plain_gemv_batch_takes(x: torch.Tensor, weights) -> bool:
    """1..MAX_BATCH weights, each ``plain_gemv_takes`` x and with contiguous rows (the batched
    kernel reads row n at n * K)."""
    return (0 < len(weights) <= MAX_BATCH
            and all(plain_gemv_takes(x, w) and w.stride(0) == w.shape[1] for w in weights))


def plain_gemv_batch(x: torch.Tensor, weights) -> list[torch.Tensor]:
    """[x @ w^T for w in weights] in one launch, each output the same bits as ``plain_gemv(x, w)``
    (the same programs with the same K splits, gathered into one grid). Why: a CSA layer's decode
    makes five unquantised projections of one x (the compressor's wkv / wgate, the indexer
    compressor's, the indexer's weights_proj): one launch instead of five (seven kernels where
    cuBLAS ran the wide ones as GEMV + reduce)."""
    weights = tuple(weights)
    if not plain_gemv_batch_takes(x, weights):
        raise ValueError(f"plain_gemv_batch: needs 1..{MAX_BATCH} weights [N, K] with contiguous rows in x's dtype on "
                         f"x's device and x [..., K] with at most {MAX_ROWS} rows; got x {tuple(x.shape)} {x.dtype} on "
                         f"{x.device} and weights {[(tuple(w.shape), w.dtype, str(w.device)) for w in weights]}. "
                         "Use plain_gemv per weight for other layouts")
    return launch_plain_gemv_batch(x, weights)


@on_input_device
def launch_plain_gemv_batch(x: torch.Tensor, weights: tuple[torch.Tensor, ...]) -> list[torch.Tensor]:
    """``plain_gemv_batch`` for inputs its caller checked with ``plain_gemv_batch_takes`` (the decode
    hot path: one allocation for every output, views of it returned; one row: one ``split`` call)."""
    K = x.shape[-1]
    if x.is_contiguous():  # rows at stride K as they are: no [M, K] view object
        x2, M = x, (x.numel() // K if K else 0)
    else:
        x2 = x.reshape(-1, K)
        if x2.stride(-1) != 1 or (x2.shape[0] > 1 and x2.stride(0) != K):
            x2 = x2.contiguous()  # rows at stride K: the plan passes K as x's row stride
        M = x2.shape[0]
    ns = tuple(w.shape[0] for w in weights)
    key = (ns, K, M)
    plan = _BATCH_PLANS.get(key)
    if plan is None:
        if len(_BATCH_PLANS) >= 256:
            _BATCH_PLANS.clear()
        plan = _BATCH_PLANS[key] = _BatchPlan(ns, K, M)
    lead = x.shape[:-1]
    one_row = M == 1 and K > 0  # y [*lead, sum(ns)]: the outputs are its column blocks, from one split call
    y = x.new_empty((*lead, sum(ns)) if one_row else (sum(plan.sizes),))
    if M == 0 or K == 0:
        y.zero_()
    else:
        ws = scratch("plain_batch_split", (plan.ws_elems,), torch.float32, x.device)
        cnt = counters(x.device, plan.tiles)
        plan.site(plan.grid, x2, y, ws, cnt, *plan.head, *weights, *(weights[0],) * plan.pad, *plan.tail)
    if one_row:
        return list(y.split(ns, dim=-1))
    return [part.view(*lead, s[1]) for part, s in zip(y.split(plan.sizes), plan.shapes)]
