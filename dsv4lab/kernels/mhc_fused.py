"""Fused mHC (manifold-constrained hyper-connection) sites for decode: one launch per step each.

* ``hc_pre``: ``HyperConnection.mixes`` + ``forward`` (``dsv4lab.model.mhc.mix_weights`` and
  ``collapse``): the RMS statistic of the flattened streams x [T, hc*D], the [mix, hc*D] linear
  ``fn`` (mix = (2+hc)*hc), sigmoid, the Sinkhorn loop over [hc, hc] and the collapsed block input.
* ``hc_head_pre``: the same for ``HyperHead`` (mix = hc, pre only).
* ``hc_post``: ``HyperConnection.expand``, new streams post_k*out + sum_j comb[j,k]*stream_j.

Pre: the hc*D reduction is split over a grid (token blocks of BT rows) x (SPLIT chunks of hc*D);
each program accumulates x·fn rows and sum x^2 for its chunk in fp32, writes them as one partial
and bumps the token block's counter; the last program of the block sums the SPLIT partials (a
fixed-shape reduction: the same order every launch), finishes sigmoid / Sinkhorn in fp32 and
collapses the streams (products and sum in fp32, stream order 0..hc-1, one cast to the streams'
dtype), then resets the counter: one launch, deterministic, CUDA-graph safe. The split is a fixed
rule of the shape (no SM count, no tuning), so the order is the same on every GPU. F.linear(x*r, fn)
is computed as r * (x·fn): the same value up to fp32 rounding.

Pre with the block's norm (``block_norm_weight``, the decode layer's attn_norm / ffn_norm folded):
the last program writes ``rms_norm`` of the collapsed rows instead of them; one token (``ONE_ROW``)
from the registers with its ``x_pairs`` for the GEMVs after it, on ``ONE_ROW_WARPS`` (the K sums
then run in another order than the plain launch's: within its tolerance, not its bits); several
tokens stored, read back and normalised in steps (``_block_norm``).

Pre, dense tier (prefill: T >= ``DENSE_MIN_T`` bf16 tokens): the [T, hc*D] x [hc*D, mix] products
run on cuBLAS (``torch.bmm`` with fp32 output) against ``fn`` split into three bf16 parts (hi + mid +
lo carry fn's 24 mantissa bits, so each bf16 x part product is exact and the sums are fp32, as in the
tiles), batched over K chunks of ``DENSE_CHUNK_K``: Hopper's tensor cores add into fp32 with
truncation, which over one 28672-long sum moved the mixes by ~4e-5 relative (pre by 3.5e-5); the
chunks' partials are added in IEEE fp32 by the second launch (one program per BT tokens), which
also sums x^2, adds the parts in a fixed order and finishes as above. Deterministic by construction
(no cross-program ordering; cuBLAS is run-to-run deterministic on one GPU). Why: the tiles ran ~1 ms
a site at 4096 tokens (8x a copy of x); tensor-core tiles in Triton were faster but not
deterministic (docs/kernels.md). Graph-safe (no host sync).

Post: one program per (token, BD columns); the rounding points are the reference's in the
streams' dtype: post and comb cast to it, post*out rounded, the comb^T·streams sum of hc exact
products in fp32 (stream order) rounded, the sum of both rounded.

Imports triton (import only from ``dispatch``).
"""
from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from .activation_pairs import INV_PAD, pairs_buffers, pairs_written, store_pair_rows
from .device import on_input_device
from .host import INTERPRET, cdiv, counters, next_pow2, scratch
from .launch import new_site
from .pdl import pdl_enter, pdl_kw, use_pdl

BT_MAX = 16         # token rows per program of hc_pre
ACC_ELEMS = 256     # BT * BK: the per-program K step (fp32 accumulators ~ 25 * 256 / 128 threads)
SPLIT_ROWS = 128    # BT * SPLIT: the partials the last program reads at once
MIN_PROGRAMS = 96   # hc_pre's grid at least this (token blocks x splits) where T allows
POST_BD = 512       # columns per hc_post program
COLLAPSE_ELEMS = 2048  # BT * BD: the collapse tile of the last program (T = 1: 4 steps over D = 7168)
NORM_CHUNK = tl.constexpr(2048)  # channels a step of the folded block norm (its pairs: 128 groups)
DECODE_COLLAPSE_ELEMS = 8192  # one token: the collapse in one step over D = 7168 (H200 site 11.7 -> 11.3 us, same bits)
ONE_ROW_WARPS = 8     # the norm fold's one-row finish: the whole row and its pairs in one program
PRE_WARPS = 4          # warps of a split-K hc_pre program (8 or 16: no faster, and Sinkhorn's sums reorder)
DENSE_MIN_T = 1024  # hc_pre tokens (bf16 streams) from which the mix products run on cuBLAS (H200, V4-Pro
                    # site, tiles / dense us: 512 231 / 315, 1024 273 / 139, 2048 505 / 165, 4096 966 / 288)
DENSE_BT = 4        # tokens per program of the dense tier's finish (x is read twice: keep it in L2)
_SITES: dict = {}  # (id(kernel), constexprs) -> LaunchSite (4 launches an eager layer)
EARLY_FN_ON = os.environ.get("DSV4LAB_HC_PRE_EARLY_FN", "1") != "0"  # A/B switch of hc_pre's EARLY_FN
DENSE_CHUNK_K = 1024  # K per batch of the dense tier's products (fp32 partials summed in the finish)


@triton.jit
def _rounded(x, dt: tl.constexpr, BF16_BY_HAND: tl.constexpr):
    """fp32 x rounded to dt (nearest even, as the GPU's cvt.rn) and widened back to fp32. Under the
    interpreter, whose fp32 -> bf16 cast truncates, bf16 is rounded with integer ops instead."""
    if BF16_BY_HAND:
        b = x.to(tl.int32, bitcast=True)
        return ((b + 0x7FFF + ((b >> 16) & 1)) & -65536).to(tl.float32, bitcast=True)
    return x.to(dt).to(tl.float32)


@triton.jit
def _sinkhorn(logit, ij_ok, iters, hc_eps):
    """comb [BT, HCP, HCP] from its logits (-inf outside ``ij_ok`` [HCP, HCP]), as the reference's
    ``sinkhorn``: row softmax + eps, then alternate column / row normalisations (each + eps)."""
    e = tl.exp(logit - tl.max(logit, axis=2)[:, :, None])
    c = e / tl.sum(e, axis=2)[:, :, None] + hc_eps          # row softmax + eps
    c = tl.where(ij_ok[None, :, :], c, 0.0)              # padding stays out of every sum
    c = c / (tl.sum(c, axis=1)[:, None, :] + hc_eps)
    for _ in range(iters - 1):
        c = c / (tl.sum(c, axis=2)[:, :, None] + hc_eps)
        c = c / (tl.sum(c, axis=1)[:, None, :] + hc_eps)
    return c


@triton.jit
def _finish(x_ptr, base_ptr, scale_ptr, pre_ptr, post_ptr, comb_ptr, out_ptr, t, t_ok, ss, p_pre, p_post, p_comb,
            K, D, iters, hc_eps, norm_eps, bn_w_ptr, bn_y_ptr, xp_ptr, xinv_ptr, bn_eps, KG, KGP,
            HC: tl.constexpr, HCP: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr,
            HEAD: tl.constexpr, BF16_BY_HAND: tl.constexpr, SINKHORN: tl.constexpr, BLOCK_NORM: tl.constexpr,
            PAIRS: tl.constexpr, ONE_ROW: tl.constexpr, CACHE: tl.constexpr):
    """Totals of one token block -> pre (post, comb) stored in fp32, collapsed stored in x's dtype;
    ``BLOCK_NORM``: the block's RMSNorm of it instead: ``ONE_ROW`` (one token, D <= BD) from the
    registers, the weight loaded first (its latency under the mixes' finish), else stored and
    normalised in steps (``_block_norm``)."""
    if BLOCK_NORM and ONE_ROW:
        dw = tl.arange(0, BD)
        w_row = tl.load(bn_w_ptr + dw, mask=dw < D, other=0.0).to(tl.float32)
    r = 1.0 / tl.sqrt(ss / K + norm_eps)                      # unweighted RMS of the flattened streams
    jj = tl.arange(0, HCP)
    j_ok = jj < HC
    s_pre = tl.load(scale_ptr).to(tl.float32)
    b_pre = tl.load(base_ptr + jj, mask=j_ok, other=0.0).to(tl.float32)
    pre = tl.sigmoid(p_pre * r[:, None] * s_pre + b_pre[None, :]) + hc_eps
    m2 = t_ok[:, None] & j_ok[None, :]
    tl.store(pre_ptr + t[:, None] * HC + jj[None, :], pre, mask=m2)
    if not HEAD:
        s_post = tl.load(scale_ptr + 1).to(tl.float32)
        s_comb = tl.load(scale_ptr + 2).to(tl.float32)
        b_post = tl.load(base_ptr + HC + jj, mask=j_ok, other=0.0).to(tl.float32)
        post = 2.0 * tl.sigmoid(p_post * r[:, None] * s_post + b_post[None, :])
        tl.store(post_ptr + t[:, None] * HC + jj[None, :], post, mask=m2)
        ij = jj[:, None] * HC + jj[None, :]                  # [HCP, HCP] index i*hc + j
        ij_ok = j_ok[:, None] & j_ok[None, :]
        b_comb = tl.load(base_ptr + 2 * HC + ij, mask=ij_ok, other=0.0).to(tl.float32)
        logit = tl.reshape(p_comb, (BT, HCP, HCP)) * r[:, None, None] * s_comb + b_comb[None, :, :]
        logit = tl.where(ij_ok[None, :, :], logit, float("-inf"))
        if SINKHORN:
            c = _sinkhorn(logit, ij_ok, iters, hc_eps)
        else:  # the logits, for an hc_post that projects them (``PendingSinkhorn``)
            c = logit
        tl.store(comb_ptr + t[:, None, None] * (HC * HC) + ij[None, :, :], c, mask=t_ok[:, None, None] & ij_ok[None, :, :])
    dt = x_ptr.dtype.element_ty
    if BLOCK_NORM and ONE_ROW:
        d = tl.arange(0, BD)
        m = t_ok[:, None] & (d < D)[None, :]
        col = _collapsed(x_ptr, pre, jj, t, d, m, K, D, HC, BT, BD, BF16_BY_HAND, CACHE)
        r_row = tl.rsqrt(tl.sum(col * col, axis=1) / D + bn_eps)
        ydt = bn_y_ptr.dtype.element_ty
        y = _rounded(w_row[None, :] * _rounded(col * r_row[:, None], dt, BF16_BY_HAND), ydt, BF16_BY_HAND)
        tl.store(bn_y_ptr + t[:, None] * D + d[None, :], y.to(ydt), mask=m)
        if PAIRS:
            store_pair_rows(tl.reshape(y, (BD // 16, 16)), xp_ptr, xinv_ptr, tl.arange(0, BD // 16), KG, KGP, BD // 16)
        return
    ss_out = tl.zeros((BT,), dtype=tl.float32)
    for d0 in range(0, D, BD):                                # collapsed = sum_j pre_j * stream_j
        d = d0 + tl.arange(0, BD)
        m = t_ok[:, None] & (d < D)[None, :]
        col = _collapsed(x_ptr, pre, jj, t, d, m, K, D, HC, BT, BD, BF16_BY_HAND, CACHE)
        tl.store(out_ptr + t[:, None] * D + d[None, :], col.to(dt), mask=m)
        if BLOCK_NORM:
            ss_out += tl.sum(col * col, axis=1)
    if BLOCK_NORM:
        tl.debug_barrier()                                    # the collapsed row, as stored, for every thread
        _block_norm(out_ptr, bn_w_ptr, bn_y_ptr, t, t_ok, tl.rsqrt(ss_out / D + bn_eps), D, BT, BF16_BY_HAND)


@triton.jit
def _collapsed(x_ptr, pre, jj, t, d, m, K, D, HC: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr,
               BF16_BY_HAND: tl.constexpr, CACHE: tl.constexpr):
    """Columns ``d`` of the collapsed rows sum_j pre_j * stream_j [BT, BD]: fp32 products and sum in
    stream order, rounded once to the streams' dtype (kept in fp32). ``CACHE`` ".cg": the streams
    were written by other programs of this grid (``_hc_post_pre_kernel``), read past L1."""
    acc = tl.zeros((BT, BD), dtype=tl.float32)
    for j in tl.static_range(HC):
        pj = tl.sum(tl.where(jj[None, :] == j, pre, 0.0), axis=1)
        sj = tl.load(x_ptr + t[:, None] * K + j * D + d[None, :], mask=m, other=0.0, cache_modifier=CACHE)
        acc += pj[:, None] * sj.to(tl.float32)
    return _rounded(acc, x_ptr.dtype.element_ty, BF16_BY_HAND)


@triton.jit
def _block_norm(c_ptr, w_ptr, y_ptr, t, t_ok, r, D, BT: tl.constexpr, BF16_BY_HAND: tl.constexpr):
    """The block's RMSNorm (``rms_norm``) of the collapsed rows [BT, D] at c_ptr, given their
    rsqrt(mean square + eps) ``r`` [BT]: (c * r) rounded to c's dtype, times the weight, rounded to
    y's; in steps of ``NORM_CHUNK`` channels."""
    NBD: tl.constexpr = NORM_CHUNK // BT
    dt = c_ptr.dtype.element_ty
    ydt = y_ptr.dtype.element_ty
    for d0 in range(0, D, NBD):
        d = d0 + tl.arange(0, NBD)
        d_ok = d < D
        m = t_ok[:, None] & d_ok[None, :]
        c = tl.load(c_ptr + t[:, None] * D + d[None, :], mask=m, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + d, mask=d_ok, other=0.0).to(tl.float32)
        y = _rounded(w[None, :] * _rounded(c * r[:, None], dt, BF16_BY_HAND), ydt, BF16_BY_HAND)
        tl.store(y_ptr + t[:, None] * D + d[None, :], y.to(ydt), mask=m)


@triton.jit
def _reduce_and_finish(acc_ss, acc_pre, acc_post, acc_comb, tb, sp, t, t_ok, x_ptr, base_ptr, scale_ptr, pre_ptr,
                       post_ptr, comb_ptr, out_ptr, ws_ptr, cnt_ptr, K, D, iters, hc_eps, norm_eps, bn_w_ptr, bn_y_ptr,
                       xp_ptr, xinv_ptr, bn_eps, KG, KGP, HC: tl.constexpr, HCP: tl.constexpr, BT: tl.constexpr,
                       BD: tl.constexpr, SPLIT: tl.constexpr, SPLITP: tl.constexpr, HEAD: tl.constexpr,
                       BF16_BY_HAND: tl.constexpr, SINKHORN: tl.constexpr, BLOCK_NORM: tl.constexpr,
                       PAIRS: tl.constexpr, ONE_ROW: tl.constexpr, CACHE: tl.constexpr):
    """A split program's sums of its K chunk -> ``_finish`` (one split), else its partial row, the
    token block's counter, and in the last program the partials summed in split order, ``_finish``
    and the counter reset (the body of ``_hc_pre_kernel`` and ``_hc_post_pre_kernel`` after their
    products, so both give these bits)."""
    jj = tl.arange(0, HCP)
    cc = tl.arange(0, HCP * HCP)
    ss = tl.sum(acc_ss, axis=1)
    p_pre = tl.sum(acc_pre, axis=2)
    p_post = tl.sum(acc_post, axis=2)
    p_comb = tl.sum(acc_comb, axis=2)
    if SPLIT == 1:
        _finish(x_ptr, base_ptr, scale_ptr, pre_ptr, post_ptr, comb_ptr, out_ptr, t, t_ok, ss, p_pre, p_post, p_comb,
                K, D, iters, hc_eps, norm_eps, bn_w_ptr, bn_y_ptr, xp_ptr, xinv_ptr, bn_eps, KG, KGP,
                HC, HCP, BT, BD, HEAD, BF16_BY_HAND, SINKHORN, BLOCK_NORM, PAIRS, ONE_ROW, CACHE)
    else:
        # partial row per (block, split, token): [pre HCP | post HCP | comb HCP^2 | sum x^2]
        W = 2 * HCP + HCP * HCP + 1
        tt = tl.arange(0, BT)
        row = ws_ptr + ((tb * SPLIT + sp) * BT + tt) * W
        tl.store(row[:, None] + jj[None, :], p_pre)
        tl.store(row[:, None] + HCP + jj[None, :], p_post)
        tl.store(row[:, None] + 2 * HCP + cc[None, :], p_comb)
        tl.store(row + 2 * HCP + HCP * HCP, ss)
        tl.debug_barrier()
        old = tl.atomic_add(cnt_ptr + tb, 1, sem="acq_rel")
        if old == SPLIT - 1:
            s = tl.arange(0, SPLITP)
            rows = ws_ptr + ((tb * SPLIT + s[:, None]) * BT + tt[None, :]) * W   # [SPLITP, BT]
            s_ok = (s < SPLIT)[:, None, None]
            ss = tl.sum(tl.load(rows + 2 * HCP + HCP * HCP, mask=(s < SPLIT)[:, None], other=0.0,
                                cache_modifier=".cg"), axis=0)
            p_pre = tl.sum(tl.load(rows[:, :, None] + jj[None, None, :], mask=s_ok, other=0.0, cache_modifier=".cg"),
                           axis=0)
            p_post = tl.sum(tl.load(rows[:, :, None] + HCP + jj[None, None, :], mask=s_ok, other=0.0,
                                    cache_modifier=".cg"), axis=0)
            p_comb = tl.sum(tl.load(rows[:, :, None] + 2 * HCP + cc[None, None, :], mask=s_ok, other=0.0,
                                    cache_modifier=".cg"), axis=0)
            _finish(x_ptr, base_ptr, scale_ptr, pre_ptr, post_ptr, comb_ptr, out_ptr, t, t_ok, ss, p_pre, p_post,
                    p_comb, K, D, iters, hc_eps, norm_eps, bn_w_ptr, bn_y_ptr, xp_ptr, xinv_ptr, bn_eps, KG, KGP,
                    HC, HCP, BT, BD, HEAD, BF16_BY_HAND, SINKHORN, BLOCK_NORM, PAIRS, ONE_ROW, CACHE)
            tl.atomic_xchg(cnt_ptr + tb, 0, sem="relaxed")  # next use is a later launch: no fence


@triton.jit
def _fn_rows(fn_ptr, k, k_ok, K, HC: tl.constexpr, HCP: tl.constexpr, BK: tl.constexpr, HEAD: tl.constexpr):
    """fn's pre, post and comb rows [HCP, BK], [HCP, BK], [HCP*HCP, BK] at columns k (as stored;
    HEAD: pre's rows only, the other two unused stand-ins of their shapes): hc_pre's early step and
    the fused post+pre load them before the PDL wait."""
    jj = tl.arange(0, HCP)
    j_ok = jj < HC
    w_pre = tl.load(fn_ptr + jj[:, None] * K + k[None, :], mask=j_ok[:, None] & k_ok[None, :], other=0.0)
    if HEAD:
        return w_pre, w_pre, tl.zeros((HCP * HCP, BK), dtype=w_pre.dtype)
    cc = tl.arange(0, HCP * HCP)                             # comb row (i, j) = cc // HCP, cc % HCP
    c_row = 2 * HC + (cc // HCP) * HC + cc % HCP
    c_ok = ((cc // HCP) < HC) & ((cc % HCP) < HC)
    w_post = tl.load(fn_ptr + (HC + jj[:, None]) * K + k[None, :], mask=j_ok[:, None] & k_ok[None, :], other=0.0)
    w_comb = tl.load(fn_ptr + c_row[:, None] * K + k[None, :], mask=c_ok[:, None] & k_ok[None, :], other=0.0)
    return w_pre, w_post, w_comb


@triton.jit
def _step_products(x, w_pre, w_post, w_comb, BT: tl.constexpr, HCP: tl.constexpr, BK: tl.constexpr,
                   HEAD: tl.constexpr):
    """One K step's accumulators (x . x, x . fn's pre, post and comb rows) of x [BT, BK] fp32, each
    zeros plus the products: the one expression of hc_pre's early step and the fused post+pre, so a
    GPU rounds them alike (a bare product is contracted into the sums' first add, an FMA with one
    rounding less: H100, not the two launches' bits; the interpreter does not contract)."""
    acc_ss = tl.zeros((BT, BK), dtype=tl.float32)
    acc_pre = tl.zeros((BT, HCP, BK), dtype=tl.float32)
    acc_post = tl.zeros((BT, HCP, BK), dtype=tl.float32)
    acc_comb = tl.zeros((BT, HCP * HCP, BK), dtype=tl.float32)
    acc_ss += x * x
    acc_pre += x[:, None, :] * w_pre.to(tl.float32)[None, :, :]
    if not HEAD:
        acc_post += x[:, None, :] * w_post.to(tl.float32)[None, :, :]
        acc_comb += x[:, None, :] * w_comb.to(tl.float32)[None, :, :]
    return acc_ss, acc_pre, acc_post, acc_comb


@triton.jit
def _hc_pre_kernel(x_ptr, fn_ptr, base_ptr, scale_ptr, pre_ptr, post_ptr, comb_ptr, out_ptr, ws_ptr, cnt_ptr,
                   T, K, D, CH, iters, hc_eps, norm_eps, bn_w_ptr, bn_y_ptr, xp_ptr, xinv_ptr, bn_eps, KG, KGP,
                   HC: tl.constexpr, HCP: tl.constexpr, BT: tl.constexpr,
                   BK: tl.constexpr, BD: tl.constexpr, SPLIT: tl.constexpr, SPLITP: tl.constexpr,
                   HEAD: tl.constexpr, BF16_BY_HAND: tl.constexpr, PDL: tl.constexpr = False,
                   SINKHORN: tl.constexpr = True, BLOCK_NORM: tl.constexpr = False, PAIRS: tl.constexpr = False,
                   ONE_ROW: tl.constexpr = False, EARLY_FN: tl.constexpr = False):
    """``EARLY_FN`` (one K step a program, PDL): fn's tile, a weight no grid writes, is loaded before
    the PDL wait, under the previous grid's run; the same products and sums."""
    if not EARLY_FN:
        pdl_enter(PDL)
    tb = tl.program_id(0)
    sp = tl.program_id(1)
    t = tb.to(tl.int64) * BT + tl.arange(0, BT)
    t_ok = t < T
    jj = tl.arange(0, HCP)
    j_ok = jj < HC
    cc = tl.arange(0, HCP * HCP)                             # comb row (i, j) = cc // HCP, cc % HCP
    c_row = 2 * HC + (cc // HCP) * HC + cc % HCP
    c_ok = ((cc // HCP) < HC) & ((cc % HCP) < HC)
    k_lo = sp * CH
    if EARLY_FN:  # CH <= BK: the one step, fn's rows first
        kk = tl.arange(0, BK)
        k = k_lo + kk
        k_ok = (kk < CH) & (k < K)
        w_pre, w_post, w_comb = _fn_rows(fn_ptr, k, k_ok, K, HC, HCP, BK, HEAD)
        pdl_enter(PDL)
        x = tl.load(x_ptr + t[:, None] * K + k[None, :], mask=t_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
        acc_ss, acc_pre, acc_post, acc_comb = _step_products(x, w_pre, w_post, w_comb, BT, HCP, BK, HEAD)
    else:
        acc_pre = tl.zeros((BT, HCP, BK), dtype=tl.float32)
        acc_post = tl.zeros((BT, HCP, BK), dtype=tl.float32)
        acc_comb = tl.zeros((BT, HCP * HCP, BK), dtype=tl.float32)
        acc_ss = tl.zeros((BT, BK), dtype=tl.float32)
        for k0 in range(0, CH, BK):
            kk = k0 + tl.arange(0, BK)
            k = k_lo + kk
            k_ok = (kk < CH) & (k < K)
            x = tl.load(x_ptr + t[:, None] * K + k[None, :], mask=t_ok[:, None] & k_ok[None, :],
                        other=0.0).to(tl.float32)
            acc_ss += x * x
            w = tl.load(fn_ptr + jj[:, None] * K + k[None, :], mask=j_ok[:, None] & k_ok[None, :],
                        other=0.0).to(tl.float32)
            acc_pre += x[:, None, :] * w[None, :, :]
            if not HEAD:
                w = tl.load(fn_ptr + (HC + jj[:, None]) * K + k[None, :], mask=j_ok[:, None] & k_ok[None, :],
                            other=0.0).to(tl.float32)
                acc_post += x[:, None, :] * w[None, :, :]
                w = tl.load(fn_ptr + c_row[:, None] * K + k[None, :], mask=c_ok[:, None] & k_ok[None, :],
                            other=0.0).to(tl.float32)
                acc_comb += x[:, None, :] * w[None, :, :]
    _reduce_and_finish(acc_ss, acc_pre, acc_post, acc_comb, tb, sp, t, t_ok, x_ptr, base_ptr, scale_ptr, pre_ptr,
                       post_ptr, comb_ptr, out_ptr, ws_ptr, cnt_ptr, K, D, iters, hc_eps, norm_eps, bn_w_ptr, bn_y_ptr,
                       xp_ptr, xinv_ptr, bn_eps, KG, KGP, HC, HCP, BT, BD, SPLIT, SPLITP, HEAD, BF16_BY_HAND, SINKHORN,
                       BLOCK_NORM, PAIRS, ONE_ROW, "")


@triton.jit
def _hc_post_pre_kernel(s_ptr, o_ptr, post_ptr, comb_ptr, y_ptr, post_iters, post_eps,
                        fn_ptr, base_ptr, scale_ptr, pre_ptr, post2_ptr, comb2_ptr, out_ptr, ws_ptr, cnt_ptr,
                        T, K, D, CH, iters, hc_eps, norm_eps, bn_w_ptr, bn_y_ptr, xp_ptr, xinv_ptr, bn_eps, KG, KGP,
                        HC: tl.constexpr, HCP: tl.constexpr, BK: tl.constexpr, BD: tl.constexpr,
                        SPLIT: tl.constexpr, SPLITP: tl.constexpr, BF16_BY_HAND: tl.constexpr, PDL: tl.constexpr,
                        PROJECT: tl.constexpr, EARLY: tl.constexpr, SINKHORN: tl.constexpr,
                        BLOCK_NORM: tl.constexpr, PAIRS: tl.constexpr, ONE_ROW: tl.constexpr):
    """One site's expansion and the next site's pre in one launch (``hc_post_pre``), one token a row
    of programs: program (t, sp) owns K chunk sp of the new streams (CH <= BK elements of one stream
    jo), computes it as ``_hc_post_kernel`` does (``PROJECT``: comb from logits; ``EARLY``: before
    the PDL wait), stores it, and multiplies it by fn's rows (loaded before the PDL wait) as
    ``_hc_pre_kernel``'s program sp does (``_step_products``); the last program finishes from the new
    streams as stored."""
    t = tl.program_id(0).to(tl.int64)
    sp = tl.program_id(1)
    k_lo = sp * CH
    jo = k_lo // D                                           # the chunk's stream (D % CH == 0)
    kk = tl.arange(0, BK)
    k = k_lo + kk
    k_ok = kk < CH
    d = k_lo - jo * D + kk
    jj = tl.arange(0, HCP)
    j_ok = jj < HC
    w_pre, w_post, w_comb = _fn_rows(fn_ptr, k, k_ok, K, HC, HCP, BK, False)
    if PROJECT and EARLY:
        comb = _comb_of_logits(comb_ptr, t, jj, j_ok, post_iters, post_eps, HC, HCP)
    pdl_enter(PDL)
    if PROJECT and not EARLY:
        comb = _comb_of_logits(comb_ptr, t, jj, j_ok, post_iters, post_eps, HC, HCP)
    dt = y_ptr.dtype.element_ty
    post_j = _rounded(tl.load(post_ptr + t * HC + jo).to(tl.float32), dt, BF16_BY_HAND)
    out = tl.load(o_ptr + t * D + d, mask=k_ok, other=0.0).to(tl.float32)
    placed = _rounded(post_j * out, dt, BF16_BY_HAND)
    mixed = tl.zeros((BK,), dtype=tl.float32)
    for i in tl.static_range(HC):                             # comb^T @ streams, stream order (as hc_post)
        if PROJECT:
            c = tl.sum(tl.sum(tl.where((jj[:, None] == i) & (jj[None, :] == jo), comb, 0.0), axis=1), axis=0)
        else:
            c = tl.load(comb_ptr + t * (HC * HC) + i * HC + jo).to(tl.float32)
        si = tl.load(s_ptr + (t * HC + i) * D + d, mask=k_ok, other=0.0).to(tl.float32)
        mixed += _rounded(c, dt, BF16_BY_HAND) * si
    y = _rounded(placed + _rounded(mixed, dt, BF16_BY_HAND), dt, BF16_BY_HAND)
    tl.store(y_ptr + t * K + k, y.to(dt), mask=k_ok)
    x = tl.reshape(tl.where(k_ok, y, 0.0), (1, BK))                 # the new streams' chunk, as hc_pre loads it
    t_ok = tl.full((1,), 1, tl.int1) & (t < T)
    tv = tl.full((1,), 0, tl.int64) + t
    acc_ss, acc_pre, acc_post, acc_comb = _step_products(x, w_pre, w_post, w_comb, 1, HCP, BK, False)
    _reduce_and_finish(acc_ss, acc_pre, acc_post, acc_comb, t, sp, tv, t_ok, y_ptr, base_ptr, scale_ptr, pre_ptr,
                       post2_ptr, comb2_ptr, out_ptr, ws_ptr, cnt_ptr, K, D, iters, hc_eps, norm_eps, bn_w_ptr,
                       bn_y_ptr, xp_ptr, xinv_ptr, bn_eps, KG, KGP, HC, HCP, 1, BD, SPLIT, SPLITP, False, BF16_BY_HAND,
                       SINKHORN, BLOCK_NORM, PAIRS, ONE_ROW, ".cg")


@triton.jit
def _parts_sum(prod_ptr, t, t_ok, col, col_ok, T, MIX, CHUNKS):
    """[BT, len(col)] fp32 x . fn of the mix columns ``col`` from the products [CHUNKS, T, 3 * MIX]:
    per K chunk the three parts added (hi + mid) + lo, the chunks added in order."""
    m = t_ok[:, None] & col_ok[None, :]
    total = tl.zeros((t.shape[0], col.shape[0]), dtype=tl.float32)
    for c in range(CHUNKS):
        row = prod_ptr + (c * T + t[:, None]) * (3 * MIX) + col[None, :]
        hi = tl.load(row, mask=m, other=0.0)
        mid = tl.load(row + MIX, mask=m, other=0.0)
        lo = tl.load(row + 2 * MIX, mask=m, other=0.0)
        total += (hi + mid) + lo
    return total


@triton.jit
def _hc_pre_dense_finish_kernel(x_ptr, prod_ptr, base_ptr, scale_ptr, pre_ptr, post_ptr, comb_ptr, out_ptr,
                                T, K, D, MIX, CHUNKS, iters, hc_eps, norm_eps, bn_w_ptr, bn_y_ptr, bn_eps,
                                HC: tl.constexpr, HCP: tl.constexpr,
                                BT: tl.constexpr, BK: tl.constexpr, BD: tl.constexpr, HEAD: tl.constexpr,
                                BF16_BY_HAND: tl.constexpr, SINKHORN: tl.constexpr = True,
                                BLOCK_NORM: tl.constexpr = False):
    """The dense tier's second launch: sum x^2 of BT tokens, their mixes from the parts' products
    [CHUNKS, T, 3 * MIX] (cuBLAS), then ``_finish``."""
    t = tl.program_id(0).to(tl.int64) * BT + tl.arange(0, BT)
    t_ok = t < T
    acc_ss = tl.zeros((BT, BK), dtype=tl.float32)
    for k0 in range(0, K, BK):
        k = k0 + tl.arange(0, BK)
        x = tl.load(x_ptr + t[:, None] * K + k[None, :], mask=t_ok[:, None] & (k < K)[None, :], other=0.0)
        x = x.to(tl.float32)
        acc_ss += x * x
    ss = tl.sum(acc_ss, axis=1)
    jj = tl.arange(0, HCP)
    j_ok = jj < HC
    p_pre = _parts_sum(prod_ptr, t, t_ok, jj, j_ok, T, MIX, CHUNKS)
    if HEAD:
        p_post = p_pre
        p_comb = tl.zeros((BT, HCP * HCP), dtype=tl.float32)
    else:
        cc = tl.arange(0, HCP * HCP)                         # comb (i, j) = cc // HCP, cc % HCP
        p_post = _parts_sum(prod_ptr, t, t_ok, HC + jj, j_ok, T, MIX, CHUNKS)
        p_comb = _parts_sum(prod_ptr, t, t_ok, 2 * HC + (cc // HCP) * HC + cc % HCP,
                            ((cc // HCP) < HC) & ((cc % HCP) < HC), T, MIX, CHUNKS)
    _finish(x_ptr, base_ptr, scale_ptr, pre_ptr, post_ptr, comb_ptr, out_ptr, t, t_ok, ss, p_pre, p_post, p_comb,
            K, D, iters, hc_eps, norm_eps, bn_w_ptr, bn_y_ptr, bn_w_ptr, bn_w_ptr, bn_eps, 0, 0,
            HC, HCP, BT, BD, HEAD, BF16_BY_HAND, SINKHORN, BLOCK_NORM, False, False, "")


@triton.jit
def _comb_of_logits(comb_ptr, t, k, k_ok, iters, hc_eps, HC: tl.constexpr, HCP: tl.constexpr):
    """One token's comb [HCP, HCP] from the logits hc_pre stored (``_finish`` with SINKHORN off),
    read past L1 (``.cg``: they may be read before this grid's PDL wait)."""
    ij_ok = k_ok[:, None] & k_ok[None, :]
    logit = tl.load(comb_ptr + t * (HC * HC) + k[:, None] * HC + k[None, :], mask=ij_ok, other=float("-inf"),
                    cache_modifier=".cg")
    return tl.reshape(_sinkhorn(tl.reshape(logit, (1, HCP, HCP)), ij_ok, iters, hc_eps), (HCP, HCP))


@triton.jit
def _hc_post_kernel(x_ptr, o_ptr, post_ptr, comb_ptr, y_ptr, D, iters, hc_eps, HC: tl.constexpr, HCP: tl.constexpr,
                    BD: tl.constexpr, BF16_BY_HAND: tl.constexpr, PDL: tl.constexpr = False,
                    SINKHORN: tl.constexpr = False, EARLY: tl.constexpr = False):
    """``SINKHORN``: comb_ptr holds logits, projected here first; ``EARLY`` (the logits were written
    at least two grids before: a block ran since hc_pre) before the PDL wait, under the previous
    grid's run."""
    t = tl.program_id(0).to(tl.int64)
    k = tl.arange(0, HCP)
    k_ok = k < HC
    if SINKHORN and EARLY:
        comb = _comb_of_logits(comb_ptr, t, k, k_ok, iters, hc_eps, HC, HCP)
    pdl_enter(PDL)
    if SINKHORN and not EARLY:
        comb = _comb_of_logits(comb_ptr, t, k, k_ok, iters, hc_eps, HC, HCP)
    d = tl.program_id(1) * BD + tl.arange(0, BD)
    d_ok = d < D
    dt = y_ptr.dtype.element_ty
    post = _rounded(tl.load(post_ptr + t * HC + k, mask=k_ok, other=0.0).to(tl.float32), dt, BF16_BY_HAND)
    out = tl.load(o_ptr + t * D + d, mask=d_ok, other=0.0).to(tl.float32)
    placed = _rounded(post[:, None] * out[None, :], dt, BF16_BY_HAND)    # post.to(dtype) * out, rounded
    mixed = tl.zeros((HCP, BD), dtype=tl.float32)
    for j in tl.static_range(HC):                                     # comb^T @ streams, stream order
        if SINKHORN:  # row j of comb over k
            cj = _rounded(tl.sum(tl.where(k[:, None] == j, comb, 0.0), axis=0), dt, BF16_BY_HAND)
        else:
            cj = _rounded(tl.load(comb_ptr + t * (HC * HC) + j * HC + k, mask=k_ok, other=0.0).to(tl.float32), dt,
                          BF16_BY_HAND)
        sj = tl.load(x_ptr + (t * HC + j) * D + d, mask=d_ok, other=0.0).to(tl.float32)
        mixed += cj[:, None] * sj[None, :]
    y = _rounded(placed + _rounded(mixed, dt, BF16_BY_HAND), dt, BF16_BY_HAND).to(dt)
    tl.store(y_ptr + (t * HC + k[:, None]) * D + d[None, :], y, mask=k_ok[:, None] & d_ok[None, :])


@functools.lru_cache(maxsize=1024)  # a rule of ints asked on every launch
def pre_split(T: int, K: int, split: int | None = None, block_k: int | None = None) -> tuple[int, int, int, int]:
    """(BT, BK, CH, SPLIT) for T tokens and K = hc*D: a fixed rule of the shape. Token blocks of up
    to 16 rows, halved until the grid has >= MIN_PROGRAMS programs (a short prefill of 11 tokens in
    one 16-row block ran 8 programs: ~260 us a site on the H200). V4-Pro (K = 28672): T = 1 -> 112
    splits of 256; T = 11 -> 3 blocks of 4 rows x 32 splits of 896; T = 4096 -> 8 of 3584 per 16 rows."""
    bt = min(BT_MAX, next_pow2(max(T, 1)))
    while bt > 1 and split is None and cdiv(T, bt) * (SPLIT_ROWS // bt) < MIN_PROGRAMS:
        bt //= 2
    bk = block_k or max(16, ACC_ELEMS // bt)
    want = split or max(1, SPLIT_ROWS // bt)
    ch = cdiv(cdiv(K, want), bk) * bk
    return bt, bk, ch, cdiv(K, ch)


def _bf16_by_hand(x: torch.Tensor) -> bool:
    return INTERPRET and x.dtype == torch.bfloat16


def fn_parts(fn: torch.Tensor) -> torch.Tensor:
    """fn [mix, K] -> [3 * mix, K] bf16: hi, mid, lo with hi + mid + lo == fn (fp32's 24 mantissa
    bits in three 8-bit parts; exact for normal fp32 values), so x . part is exact per product."""
    f = fn.float()
    hi = f.to(torch.bfloat16)
    rest = f - hi.float()
    mid = rest.to(torch.bfloat16)
    return torch.cat([hi, mid, (rest - mid.float()).to(torch.bfloat16)])


def k_chunks(K: int, chunk: int | None = None) -> int:
    """How many equal K chunks the dense tier's products use: the fewest of at most ``chunk``
    (DENSE_CHUNK_K) elements that divide K (V4-Pro: 28672 = 28 x 1024)."""
    c = cdiv(K, chunk or DENSE_CHUNK_K)
    while K % c:
        c += 1
    return c


def _mix_products(x2d: torch.Tensor, parts: torch.Tensor, chunks: int) -> torch.Tensor:
    """[chunks, T, 3 * mix] fp32: per K chunk x [T, K] bf16 . parts^T, on cuBLAS on CUDA (bf16 in,
    fp32 out); on CPU (interpreter tests) an fp32 bmm of the same exact products."""
    T, K = x2d.shape
    kc = K // chunks
    xb = x2d.view(T, chunks, kc).transpose(0, 1)                        # [chunks, T, kc], no copy
    pb = parts.view(parts.shape[0], chunks, kc).permute(1, 2, 0)         # [chunks, kc, 3 * mix]
    if x2d.is_cuda:
        return torch.bmm(xb, pb, out_dtype=torch.float32)
    return torch.bmm(xb.float(), pb.float())


def use_dense(T: int, dtype: torch.dtype, dense: bool | None = None) -> bool:
    """The dense tier for T tokens of ``dtype`` streams: from DENSE_MIN_T bf16 tokens (its products
    are exact only for bf16 x), unless ``dense`` forces it (bf16 only) or forbids it."""
    if dense and dtype != torch.bfloat16:
        raise ValueError(f"hc_pre: dense=True needs bfloat16 streams (the tier's products are exact only for "
                         f"bf16 x); got {dtype}. Pass dense=None (the rule) or dense=False")
    if dtype != torch.bfloat16:
        return False
    return T >= DENSE_MIN_T if dense is None else dense


def _pre_dense(x, fn, base, scale, iters, hc_eps, norm_eps, head, pre, post, comb, out, sinkhorn=True, bn_w=None,
               bn_y=None, bn_eps=0.0):
    """The dense tier: cuBLAS products of x and fn's parts (transient: chunks x T x 3 * mix fp32,
    33 MB for a 4096-token V4-Pro chunk; fn's parts 4 MB), then one finish launch."""
    B, S, hc, D = x.shape
    T = B * S
    chunks = k_chunks(hc * D)
    prod = _mix_products(x.view(T, hc * D), fn_parts(fn), chunks)
    hcp = next_pow2(hc)
    kernel, by_hand = _hc_pre_dense_finish_kernel, _bf16_by_hand(x)  # kernel looked up per call: tests replace it
    block_norm = bn_w is not None
    skey = (id(kernel), hc, head, by_hand, sinkhorn, block_norm)
    site = _SITES.get(skey) or new_site(_SITES, skey, kernel, HC=hc, HCP=hcp, BT=DENSE_BT, BK=COLLAPSE_ELEMS // DENSE_BT,
                                        BD=COLLAPSE_ELEMS // DENSE_BT, HEAD=head, BF16_BY_HAND=by_hand,
                                        SINKHORN=sinkhorn, BLOCK_NORM=block_norm, num_warps=4)
    site((cdiv(T, DENSE_BT),),
        x, prod, base.contiguous(), scale.contiguous(), pre, post, comb, out, T, hc * D, D, fn.shape[0], chunks, int(iters),
        float(hc_eps), float(norm_eps), bn_w if block_norm else out, bn_y if block_norm else out, float(bn_eps))


def _pre_launch(streams, fn, base, scale, iters, hc_eps, norm_eps, head, split, block_k, dense, sinkhorn=True,
                block_norm_weight=None, block_norm_eps=0.0, expand=None):
    """The pre launch over ``streams``; ``expand`` = (old streams, block_out, post, comb, Sinkhorn
    iterations (0: comb given), eps, logits settled): ``streams`` is an empty buffer that
    ``_hc_post_pre_kernel`` fills with the expansion in the same launch (``hc_post_pre`` checked
    the shape: one token a program row, one K step a program)."""
    B, S, hc, D = streams.shape
    T, K = B * S, hc * D
    x = streams.contiguous()
    dev = x.device
    pre = x.new_empty(B, S, hc, dtype=torch.float32)
    post = pre if head else x.new_empty(B, S, hc, dtype=torch.float32)
    comb = pre if head else x.new_empty(B, S, hc, hc, dtype=torch.float32)
    block_norm = block_norm_weight is not None
    # the collapsed rows; with the block's norm its output (rms_norm's dtype: weight * x) is returned
    # instead, and the collapsed rows are a transient of the launch (none for one row: registers)
    normed = (x.new_empty(B, S, D, dtype=torch.promote_types(block_norm_weight.dtype, x.dtype)) if block_norm
              else x.new_empty(B, S, D))
    bn_w = block_norm_weight.contiguous() if block_norm else normed
    if T == 0:
        return pre, post, comb, normed
    if use_dense(T, x.dtype, dense):
        out = x.new_empty(B, S, D) if block_norm else normed
        _pre_dense(x, fn, base, scale, iters, hc_eps, norm_eps, head, pre, post, comb, out, sinkhorn, bn_w if block_norm
                   else None, normed, block_norm_eps)
        return pre, post, comb, normed
    bt, bk, ch, n_split = pre_split(T, K, split, block_k)
    hcp = next_pow2(hc)
    n_tb = cdiv(T, bt)
    if n_split > 1:
        ws = scratch("hc_pre_split", (n_tb * n_split * bt * (2 * hcp + hcp * hcp + 1),), torch.float32, dev)
        cnt = counters(dev, n_tb)
    else:
        ws = cnt = pre  # unused
    # one normalised row: also its x_pairs rows for the GEMVs that read it (as rms_norm's launch writes them)
    kg = D // 16
    kgp = cdiv(kg, INV_PAD) * INV_PAD
    bd = max(64, (DECODE_COLLAPSE_ELEMS if bt == 1 else COLLAPSE_ELEMS) // bt)
    one_row = block_norm and bt == 1 and D <= bd  # one token in one collapse step: normalised in registers
    emit = one_row and T == 1 and D % 16 == 0 and kgp * 16 <= bd  # the tile also covers the pairs' 1/xs padding
    out = x.new_empty(B, S, D) if block_norm and not one_row else normed  # one row stores no collapsed rows
    xp, xinv = pairs_buffers(kg, dev) if emit else (out, out)
    by_hand = _bf16_by_hand(x)
    pdl = use_pdl(n_tb * n_split, dev)
    warps = ONE_ROW_WARPS if one_row and not INTERPRET else PRE_WARPS
    if expand is not None:
        s_in, o_in, p_in, c_in, p_iters, p_eps, settled = expand
        project = p_iters > 0
        early = project and settled and pdl
        kernel = _hc_post_pre_kernel  # looked up per call: tests replace it
        skey = (id(kernel), hc, bk, n_split, by_hand, pdl, sinkhorn, block_norm, emit, one_row, project, early)
        site = _SITES.get(skey) or new_site(
            _SITES, skey, kernel, HC=hc, HCP=hcp, BK=bk, BD=bd, SPLIT=n_split, SPLITP=next_pow2(n_split),
            BF16_BY_HAND=by_hand, PROJECT=project, EARLY=early, SINKHORN=sinkhorn, BLOCK_NORM=block_norm,
            PAIRS=emit, ONE_ROW=one_row, num_warps=warps, **pdl_kw(pdl))
        site((n_tb, n_split),
            s_in, o_in, p_in, c_in, x, int(p_iters), float(p_eps), fn.contiguous(), base.contiguous(),
            scale.contiguous(), pre, post, comb, out, ws, cnt, T, K, D, ch, int(iters), float(hc_eps),
            float(norm_eps), bn_w, normed, xp, xinv, float(block_norm_eps), kg, kgp)
        if emit:
            pairs_written(kg, dev, normed)
        return pre, post, comb, normed
    kernel = _hc_pre_kernel  # looked up per call: tests replace it
    early_fn = ch <= bk and EARLY_FN_ON  # one K step a program: fn loaded first (before the PDL wait)
    skey = (id(kernel), hc, bt, bk, n_split, head, by_hand, pdl, sinkhorn, block_norm, emit, one_row, early_fn)
    site = _SITES.get(skey) or new_site(
        _SITES, skey, kernel, HC=hc, HCP=hcp, BT=bt, BK=bk, BD=bd, SPLIT=n_split,
        SPLITP=next_pow2(n_split), HEAD=head, BF16_BY_HAND=by_hand, SINKHORN=sinkhorn,
        num_warps=warps, BLOCK_NORM=block_norm, PAIRS=emit, ONE_ROW=one_row, EARLY_FN=early_fn, **pdl_kw(pdl))
    site((n_tb, n_split),
        x, fn.contiguous(), base.contiguous(), scale.contiguous(), pre, post, comb, out, ws, cnt,
        T, K, D, ch, int(iters), float(hc_eps), float(norm_eps), bn_w, normed, xp, xinv, float(block_norm_eps),
        kg, kgp)
    if emit:
        pairs_written(kg, dev, normed)
    return pre, post, comb, normed


@on_input_device
def hc_pre(streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, iters: int,
           hc_eps: float, norm_eps: float, *, split: int | None = None, block_k: int | None = None,
           dense: bool | None = None, sinkhorn: bool = True, block_norm_weight: torch.Tensor | None = None,
           block_norm_eps: float = 0.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """streams [B,S,hc,D] -> (pre [B,S,hc], post [B,S,hc], comb [B,S,hc,hc] fp32, collapsed [B,S,D] in
    streams.dtype), as ``mix_weights`` + ``collapse``; ``sinkhorn=False``: comb's logits instead
    (``mix_logits``; ``hc_post(sinkhorn_iters=...)`` projects them). ``block_norm_weight``: the last
    output is the block's RMSNorm of collapsed instead (``rms_norm(collapsed, weight, block_norm_eps)``,
    in its dtype), the same launch's last program normalising the rows it collapsed (and writing one
    row's ``x_pairs`` for the GEMVs that read it): the decode layer's attn_norm / ffn_norm launch
    folded. ``split`` / ``block_k`` override the tiles' rule, ``dense`` the tier (``use_dense``;
    tests and benchmarks)."""
    if block_norm_weight is not None and block_norm_weight.shape != streams.shape[-1:]:
        raise ValueError(f"hc_pre: block_norm_weight must be [D] = [{streams.shape[-1]}] (the streams' width); "
                         f"got {tuple(block_norm_weight.shape)}")
    return _pre_launch(streams, fn, base, scale, iters, hc_eps, norm_eps, False, split, block_k, dense, sinkhorn,
                       block_norm_weight, block_norm_eps)


@on_input_device
def hc_head_pre(streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, eps: float,
                norm_eps: float, *, split: int | None = None, block_k: int | None = None,
                dense: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """streams [B,S,hc,D] -> (pre [B,S,hc] fp32, collapsed [B,S,D]), as ``head_weights`` + ``collapse``."""
    pre, _, _, out = _pre_launch(streams, fn, base, scale, 1, eps, norm_eps, True, split, block_k, dense)
    return pre, out


def post_pre_fits(streams: torch.Tensor) -> bool:
    """Can ``hc_post_pre`` take these streams [B,S,hc,D] in one launch? One token a row of programs
    (batch-1 decode: ``pre_split``'s one-row blocks), one K step a program and no chunk across two
    streams (then each program's chunk of the new streams is its own to compute)."""
    B, S, hc, D = streams.shape
    T, K = B * S, hc * D
    if T == 0 or use_dense(T, streams.dtype):
        return False
    bt, bk, ch, _ = pre_split(T, K)
    return bt == 1 and ch <= bk and D % ch == 0


@on_input_device
def hc_post_pre(streams: torch.Tensor, block_out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor,
                fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, iters: int, hc_eps: float, norm_eps: float,
                *, sinkhorn_iters: int = 0, post_eps: float = 0.0, logits_settled: bool = False,
                sinkhorn: bool = True, block_norm_weight: torch.Tensor | None = None, block_norm_eps: float = 0.0
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """``hc_post(streams, block_out, post, comb, ...)`` and then ``hc_pre`` of the next site (fn, base,
    scale, ...) over the new streams in one launch: (new streams, pre, post, comb, collapsed or normed),
    the same bits as the two launches. None where ``post_pre_fits`` says no (the caller runs both).
    Why: the decode layer's attn expansion and ffn pre are two dependent launches, and the pre's
    programs only re-read what the expansion's just wrote (a launch and its wait less a layer)."""
    if not post_pre_fits(streams):
        return None
    y = torch.empty_like(streams.contiguous())
    pre, post2, comb2, rows = _pre_launch(
        y, fn, base, scale, iters, hc_eps, norm_eps, False, None, None, False, sinkhorn, block_norm_weight,
        block_norm_eps, expand=(streams.contiguous(), block_out.contiguous(), post.contiguous(), comb.contiguous(),
                                sinkhorn_iters, post_eps, logits_settled))
    return y, pre, post2, comb2, rows


@on_input_device
def hc_post(streams: torch.Tensor, block_out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor, *,
            sinkhorn_iters: int = 0, hc_eps: float = 0.0, logits_settled: bool = False) -> torch.Tensor:
    """New streams [B,S,hc,D] = post_k * block_out + sum_j comb[j,k] * stream_j, as ``HyperConnection.expand``
    (block_out in streams.dtype). ``sinkhorn_iters`` > 0: comb holds ``hc_pre(sinkhorn=False)``'s
    logits, projected per token first (``_sinkhorn``); ``logits_settled``: they were written at
    least two launches ago, so that runs before the PDL wait (under the previous grid)."""
    B, S, hc, D = streams.shape
    x = streams.contiguous()
    y = torch.empty_like(x)
    if B * S == 0:
        return y
    kernel, by_hand = _hc_post_kernel, _bf16_by_hand(x)  # kernel looked up per call: tests replace it
    grid = (B * S, cdiv(D, POST_BD))
    pdl = use_pdl(grid[0] * grid[1], x.device)
    project = sinkhorn_iters > 0
    early = project and logits_settled and pdl
    skey = (id(kernel), hc, by_hand, pdl, project, early)
    site = _SITES.get(skey) or new_site(_SITES, skey, kernel, HC=hc, HCP=next_pow2(hc), BD=POST_BD,
                                        BF16_BY_HAND=by_hand, SINKHORN=project, EARLY=early, num_warps=4,
                                        **pdl_kw(pdl))
    site(grid, x, block_out.contiguous(), post.contiguous(), comb.contiguous(), y, D, int(sinkhorn_iters),
         float(hc_eps))
    return y
