"""The router's gate GEMV and its route (scores, top-k or hash choice, weights) as one launch.

Why: at decode the router is two dependent launches, the gate GEMV over an unquantised [E, D]
weight (``linear_plain``: V4-Pro 384 x 7168, 48 row tiles x 7 K splits) and ``router_topk``'s
one program a token; the H100 trace of a CSA layer spends ~11 us on the pair for ~1.3 us of
weight bytes. Here the GEMV's programs are ``linear_plain``'s (``plain_acc``, the same split rule,
the same split-order fix-up), and the program that stores a row tile's logits bumps one more
counter; the last of the row tiles then routes every token from the logits the others stored
(``router_topk.route_row``, read past L1). Same logits bits as ``plain_gemv``, so the same ids;
the weights are the same bits where the route kernel would run with this launch's 4 warps
(``route_warps``: 257-512 experts, V4-Pro's 384) and ~1e-7 apart otherwise (a sum's order).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .device import on_input_device
from .host import INTERPRET, cdiv, counters, next_pow2, scratch
from .launch import new_site
from .linear_plain import BK, BN, MAX_ROWS, TARGET_PROGRAMS, WARPS, plain_acc, plain_split
from .pdl import pdl_enter, pdl_kw, use_pdl
from .router_topk import SCORES, route_row, route_warps
from .split_k import store_or_fix_up

_SITES: dict = {}        # (id(kernel), constexprs) -> LaunchSite


@triton.jit
def _route_when_last(y_ptr, cnt_ptr, TILES, M, N, bias_ptr, tid_ptr, tok_ptr, ids_ptr, wt_ptr, scale,
                     TOP_K: tl.constexpr, KP: tl.constexpr, BE: tl.constexpr, SCORE: tl.constexpr,
                     HASH: tl.constexpr, PRECISE: tl.constexpr):
    """After a row tile's logits are stored: the last of the TILES routes every token and resets
    the launch's counter (its next use is a later launch)."""
    tl.debug_barrier()
    if tl.atomic_add(cnt_ptr + TILES, 1, sem="acq_rel") == TILES - 1:
        for t in range(M):
            route_row(y_ptr + t * N, t, bias_ptr, tid_ptr, tok_ptr, ids_ptr, wt_ptr, N, scale, TOP_K, KP, BE,
                      SCORE, HASH, PRECISE, ".cg")
        tl.atomic_xchg(cnt_ptr + TILES, 0, sem="relaxed")


@triton.jit
def _gate_route_kernel(x_ptr, w_ptr, y_ptr, ws_ptr, cnt_ptr, M, N, K, CH, SPLIT, TILES, stride_xm, stride_wn,
                       bias_ptr, tid_ptr, tok_ptr, ids_ptr, wt_ptr, scale,
                       USE_SPLIT: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                       TOP_K: tl.constexpr, KP: tl.constexpr, BE: tl.constexpr, SCORE: tl.constexpr,
                       HASH: tl.constexpr, PRECISE: tl.constexpr, PDL: tl.constexpr = False):
    """Program (row tile, K split): ``linear_plain``'s program (``plain_acc``, ``store_or_fix_up``), then
    the route once all row tiles are stored."""
    pdl_enter(PDL)
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    out, m, rows, mask = plain_acc(x_ptr, w_ptr, pid_n, pid_k, M, N, K, CH, stride_xm, stride_wn, BM, BN, BK)
    if store_or_fix_up(out, y_ptr + m[:, None] * N + rows[None, :], ws_ptr + m[:, None] * N + rows[None, :], mask,
                       cnt_ptr, pid_n, pid_k, M * N, SPLIT, 1.0, USE_SPLIT):
        _route_when_last(y_ptr, cnt_ptr, TILES, M, N, bias_ptr, tid_ptr, tok_ptr, ids_ptr, wt_ptr, scale, TOP_K, KP,
                         BE, SCORE, HASH, PRECISE)


def gate_route_takes(x: torch.Tensor, w: torch.Tensor, top_k: int, scoring: str) -> bool:
    """x [T, D] of at most ``MAX_ROWS`` tokens, contiguous, and W [E, D] in x's dtype on its device with
    contiguous rows; 1 <= top_k <= E and a scoring the route kernel has."""
    return (x.dim() == 2 and 0 < x.shape[0] <= MAX_ROWS and x.is_contiguous() and w.dim() == 2
            and w.dtype == x.dtype and w.device == x.device and w.is_contiguous() and x.shape[1] == w.shape[1] > 0
            and 0 < top_k <= w.shape[0] and scoring in SCORES)


@on_input_device
def gate_route_triton(x: torch.Tensor, w: torch.Tensor, top_k: int, scoring: str, scale: float,
                      bias: torch.Tensor | None = None, tid2eid: torch.Tensor | None = None,
                      input_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``route(plain_gemv(x, w), ...)`` in one launch for inputs ``gate_route_takes``: ids [T, k]
    (long), weights [T, k] (fp32). Hash routing with ``tid2eid`` [V, k] and ``input_ids`` (T ids)."""
    M, K = x.shape
    N = w.shape[0]
    ch, n_split = plain_split(N, K, None, BN, BK, TARGET_PROGRAMS)
    tiles = cdiv(N, BN)
    y = x.new_empty(M, N)                                   # the logits, as plain_gemv rounds them
    ws = scratch("gate_route_split", (n_split * M * N if n_split > 1 else 1,), torch.float32, x.device)
    cnt = counters(x.device, tiles + 1)                     # the row tiles', then the launch's
    ids = x.new_empty(M, top_k, dtype=torch.long)
    wt = x.new_empty(M, top_k, dtype=torch.float32)
    hash_ = tid2eid is not None
    BE = next_pow2(N)
    kernel, score = _gate_route_kernel, SCORES[scoring]  # the kernel looked up per call: tests replace it
    pdl = use_pdl(tiles * n_split, x.device)
    skey = (id(kernel), n_split > 1, next_pow2(M), top_k, BE, score, hash_, pdl)
    site = _SITES.get(skey) or new_site(_SITES, skey, kernel, USE_SPLIT=n_split > 1, BM=next_pow2(M), BN=BN, BK=BK,
                                        TOP_K=top_k, KP=next_pow2(top_k), BE=BE, SCORE=score, HASH=hash_,
                                        PRECISE=not INTERPRET, num_warps=1 if INTERPRET else WARPS,
                                        enable_fp_fusion=False, **pdl_kw(pdl))
    site((tiles, n_split), x, w, y, ws, cnt, M, N, K, ch, n_split, tiles, x.stride(0), w.stride(0),
         bias if bias is not None else y, tid2eid.contiguous() if hash_ else y,
         input_ids.reshape(-1) if hash_ else y, ids, wt, float(scale))
    return ids, wt


def same_bits_as_two_launches(n_experts: int) -> bool:
    """Are the weights the bits of ``plain_gemv`` then ``route_triton``? Where the route kernel
    would run with this launch's warps (the ids always are)."""
    return route_warps(next_pow2(n_experts)) == WARPS
