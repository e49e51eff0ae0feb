"""Triton decode top-k of the lightning indexer: the kernel of
``dsv4lab.model.indexer.index_top_k_decode`` (same signature; ``Indexer.topk_kernel``).

The reference masks the entries w >= n_valid with -inf, runs ``torch.topk`` (on CUDA a radix
select plus a sort of the k: two launches) and turns the indices past n_valid into -1, among
eight small launches. This kernel is one launch, one program per batch row, reading only the n
valid scores (n read on the device: no host sync, graph safe):

* n <= k: the selection is every valid entry, written in index order (entry t in slot t), then
  -1 up to k: one pass of stores, no read of the scores (a decode step before position 4k on
  V4-Pro: n = pos / 4 < k = 1024).
* n > k: an exact radix select of the k-th largest score over monotone uint32 keys of the fp32
  bits (-0.0 taken as +0.0, as ``torch.topk`` compares values), four passes of 8-bit digits with
  ``tl.histogram``; then one pass writes the entries above that threshold and the first entries
  equal to it (lowest index first) until k are taken, in index order.

The selection is deterministic and, for distinct scores, the reference's set (its order is the
index order, the reference's the score order: the decode attention takes them as a set). Ties at
the k-th score take the lowest indices (``torch.topk`` leaves that choice to its algorithm).
Cost: five reads of the 4n score bytes by one program per row; the reference path stays for
capacities above ``TOPK_MAX_ENTRIES`` (``dispatch.index_top_k_decode``).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .device import on_input_device
from .host import INTERPRET, next_pow2
from .launch import new_site
from .pdl import pdl_enter, pdl_kw, use_pdl

BLOCK = 2048            # scores per tile (8 warps: 8 per thread)
NUM_WARPS = 8
_SITES: dict = {}  # (id(kernel), BLOCK_K) -> LaunchSite
TOPK_MAX_ENTRIES = 65536  # capacity above which the single-program passes cost more than torch.topk's launches


@triton.jit
def _key(s):
    """Monotone uint32 key of fp32 scores (larger score, larger key; -0.0 as +0.0)."""
    b = (s + 0.0).to(tl.uint32, bitcast=True)
    return tl.where((b >> 31) != 0, ~b, b | 0x80000000)


@triton.jit
def _digit_pass(row, n, prefix, need, SHIFT: tl.constexpr, BLOCK: tl.constexpr):
    """One radix pass over the n scores at ``row``: the 8-bit digit at SHIFT of the need-th largest
    key among those whose higher digits equal ``prefix``'s -> (prefix with that digit, how many of
    the keys with the new prefix still to take)."""
    offs = tl.arange(0, BLOCK)
    digits = tl.arange(0, 256)
    hist = tl.zeros([256], tl.int32)
    for t0 in range(0, n, BLOCK):
        t = t0 + offs
        ok = t < n
        key = _key(tl.load(row + t, mask=ok, other=0.0))
        if SHIFT == 24:
            match = ok
        else:
            match = ok & ((key >> (SHIFT + 8)) == (prefix >> (SHIFT + 8)))
        hist += tl.histogram(((key >> SHIFT) & 0xFF).to(tl.int32), 256, mask=match)
    incl = tl.sum(hist, 0) - tl.cumsum(hist, 0) + hist   # keys with digit >= d
    above = incl - hist                                  # keys with digit > d
    d = tl.max(tl.where((above < need) & (need <= incl), digits, -1), 0)
    need -= tl.sum(tl.where(digits == d, above, 0), 0)
    return prefix | (tl.maximum(d, 0).to(tl.uint32) << SHIFT), need


@triton.jit
def _top_k_kernel(s_ptr, n_ptr, out_ptr, T, K, s_b, o_b, BLOCK: tl.constexpr, BLOCK_K: tl.constexpr,
                  PDL: tl.constexpr = False):
    pdl_enter(PDL)
    b = tl.program_id(0).to(tl.int64)
    row = s_ptr + b * s_b
    orow = out_ptr + b * o_b
    n = tl.minimum(tl.load(n_ptr).to(tl.int32), T)
    if n <= K:  # every valid entry, in index order: entry t in slot t, -1 after; no read of the scores
        for p0 in range(0, K, BLOCK_K):
            p = p0 + tl.arange(0, BLOCK_K)
            tl.store(orow + p, tl.where(p < n, p, -1).to(tl.int64), mask=p < K)
    else:
        offs = tl.arange(0, BLOCK)
        prefix = tl.zeros([], tl.uint32)          # the high digits of the k-th largest key found so far
        need = K                                  # how many still to take among the keys matching prefix
        prefix, need = _digit_pass(row, n, prefix, need, 24, BLOCK)
        prefix, need = _digit_pass(row, n, prefix, need, 16, BLOCK)
        prefix, need = _digit_pass(row, n, prefix, need, 8, BLOCK)
        prefix, need = _digit_pass(row, n, prefix, need, 0, BLOCK)
        written = 0
        ties = 0
        for t0 in range(0, n, BLOCK):
            t = t0 + offs
            ok = t < n
            key = _key(tl.load(row + t, mask=ok, other=0.0))
            eq = ok & (key == prefix)
            rank = ties + tl.cumsum(eq.to(tl.int32), 0)
            sel = ok & ((key > prefix) | (eq & (rank <= need)))
            slot = written + tl.cumsum(sel.to(tl.int32), 0) - 1
            tl.store(orow + slot, t.to(tl.int64), mask=sel)
            written += tl.sum(sel.to(tl.int32), 0)
            ties += tl.sum(eq.to(tl.int32), 0)
        # n > k: the passes above took exactly k, so no slot is left for a -1


@on_input_device
def index_top_k_decode_triton(scores: torch.Tensor, n_valid: torch.Tensor, k: int) -> torch.Tensor:
    """``index_top_k_decode`` in one launch: scores [B,1,T] fp32, n_valid a 0-d device tensor ->
    indices [B,1,min(k, T)] int64 (the valid entries with the largest scores, index order, -1 after)."""
    B, S, T = scores.shape
    if S != 1 or scores.dtype != torch.float32:
        raise ValueError(f"index_top_k_decode_triton: scores must be fp32 [B,1,T], got {scores.dtype} {tuple(scores.shape)}")
    kk = min(k, T)
    scores = scores.contiguous()
    out = scores.new_empty(B, 1, kk, dtype=torch.int64)
    kernel, block_k = _top_k_kernel, min(next_pow2(kk), 1024)  # the kernel looked up per call: tests replace it
    pdl = use_pdl(B, scores.device)
    skey = (id(kernel), block_k, pdl)
    site = _SITES.get(skey) or new_site(_SITES, skey, kernel, BLOCK=BLOCK, BLOCK_K=block_k,
                                        num_warps=1 if INTERPRET else NUM_WARPS, **pdl_kw(pdl))
    site((B,), scores, n_valid, out, T, kk, scores.stride(0), out.stride(0))
    return out

