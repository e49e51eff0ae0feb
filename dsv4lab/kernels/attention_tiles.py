"""What the attention kernels (``attention_decode``, ``attention_bounded``) share: how far a query's
selected slots are walked (``selected_extent`` and its block sizes), the start of a head block
(``head_block_query``) and one key tile of the online softmax (``online_softmax_tile``).
"""
from __future__ import annotations

import triton
import triton.language as tl

from .host import next_pow2


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
