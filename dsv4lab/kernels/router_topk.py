"""The router after its gate matmul as one launch: scores (sqrtsoftplus / sigmoid / softmax), the
top-k of scores + bias (or the hash choice tid2eid[token]), and the routing weights (renormalised
unless softmax, times the routed scaling factor). One program per token over all E experts.

Same ids as the reference: the elementwise scores call what torch's CUDA kernels call (libdevice
expf / log1p, IEEE sqrt and division), so the scores are the reference's bits; top-k takes the
largest scores + bias, ties to the lowest expert id, and writes them in ascending id order with any
tied k-th values last (what ``torch.topk(sorted=False)``'s CUDA kernel writes). Weights are summed
in another order (fp32, ~1e-7 relative). Reference: ``dsv4lab.model.moe.route``.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from .device import on_input_device
from .host import INTERPRET, next_pow2
from .launch import new_site
from .pdl import pdl_enter, pdl_kw, use_pdl

SCORES = {"sqrtsoftplus": 0, "sigmoid": 1, "softmax": 2}
_SITES: dict = {}  # (id(kernel), constexprs) -> LaunchSite
SOFTPLUS_THRESHOLD = tl.constexpr(20.0)  # F.softplus(beta=1, threshold=20): x itself above it


@triton.jit
def _elementwise_score(l, SCORE: tl.constexpr, PRECISE: tl.constexpr):
    """sqrt(softplus(l)) (SCORE 0) or 1 / (1 + exp(-l)) (SCORE 1), as torch's CUDA kernels compute them."""
    if PRECISE:
        e = libdevice.exp(l if SCORE == 0 else -l)
    else:             # the interpreter has no libdevice
        e = tl.exp(l if SCORE == 0 else -l)
    if SCORE == 0:
        if PRECISE:
            sp = libdevice.log1p(e)
        else:
            sp = tl.log(1.0 + e)
        s = tl.sqrt_rn(tl.where(l > SOFTPLUS_THRESHOLD, l, sp))
    else:
        s = _div(tl.full(l.shape, 1.0, tl.float32), 1.0 + e)
    return s


@triton.jit
def _div(a, b):
    """a / b (a tensor, b a tensor of its shape or a scalar) rounded as IEEE division: ``/`` on
    fp32 is approximate on the GPU."""
    return tl.div_rn(a, b + tl.zeros_like(a))


@triton.jit
def route_row(row, t, bias_ptr, tid_ptr, tok_ptr, ids_ptr, w_ptr, E, scale, K: tl.constexpr, KP: tl.constexpr,
              BE: tl.constexpr, SCORE: tl.constexpr, HASH: tl.constexpr, PRECISE: tl.constexpr,
              CACHE: tl.constexpr):
    """Token t's route from its logits at ``row`` (E of them, read through ``CACHE``: ".cg" where
    other programs of this launch wrote them): ids and weights at ids_ptr / w_ptr + t * K."""
    offs = tl.arange(0, BE)
    ok = offs < E
    l = tl.load(row + offs, mask=ok, other=float("-inf"), cache_modifier=CACHE).to(tl.float32)
    if SCORE == 2:    # softmax over the experts
        m = tl.max(l, axis=0)
        if PRECISE:
            e = libdevice.exp(l - m)
        else:
            e = tl.exp(l - m)
        denom = tl.sum(tl.where(ok, e, 0.0), axis=0)
        scores = _div(e, denom)
    else:
        scores = _elementwise_score(l, SCORE, PRECISE)
    if HASH:          # ids = tid2eid[token], weights = the scores at those ids
        kk = tl.arange(0, KP)
        kok = kk < K
        tok = tl.load(tok_ptr + t).to(tl.int64)
        ids = tl.load(tid_ptr + tok * K + kk, mask=kok, other=0).to(tl.int64)
        lk = tl.load(row + ids, mask=kok, other=0.0, cache_modifier=CACHE).to(tl.float32)
        if SCORE == 2:
            if PRECISE:
                ek = libdevice.exp(lk - m)
            else:
                ek = tl.exp(lk - m)
            wk = _div(ek, denom)
        else:
            wk = _elementwise_score(lk, SCORE, PRECISE)
            wk = _div(wk, tl.sum(tl.where(kok, wk, 0.0), axis=0) + 1e-20)
        tl.store(ids_ptr + t * K + kk, ids, mask=kok)
        tl.store(w_ptr + t * K + kk, wk * scale, mask=kok)
    else:             # top-k of scores + bias, ties to the lowest id
        v = tl.where(ok, scores + tl.load(bias_ptr + offs, mask=ok, other=0.0).to(tl.float32), float("-inf"))
        sel = offs < 0
        for _ in tl.static_range(K):
            vw = tl.where(sel, float("-inf"), v)
            best = tl.min(tl.where(vw == tl.max(vw, axis=0), offs, BE), axis=0)
            sel = sel | (offs == best)
        kth = tl.min(tl.where(sel, v, float("inf")), axis=0)
        above = sel & (v > kth)
        tied = sel & (v == kth)
        slot = tl.where(above, tl.cumsum(above.to(tl.int32), axis=0) - 1,
                        tl.sum(above.to(tl.int32), axis=0) + tl.cumsum(tied.to(tl.int32), axis=0) - 1)
        w = tl.where(sel, scores, 0.0)
        if SCORE != 2:
            w = _div(w, tl.sum(w, axis=0) + 1e-20)
        tl.store(ids_ptr + t * K + slot, offs.to(tl.int64), mask=sel)
        tl.store(w_ptr + t * K + slot, w * scale, mask=sel)


@triton.jit
def _route_kernel(logits_ptr, bias_ptr, tid_ptr, tok_ptr, ids_ptr, w_ptr, E, stride_l, scale,
                  K: tl.constexpr, KP: tl.constexpr, BE: tl.constexpr, SCORE: tl.constexpr,
                  HASH: tl.constexpr, PRECISE: tl.constexpr, PDL: tl.constexpr = False):
    pdl_enter(PDL)
    t = tl.program_id(0)
    route_row(logits_ptr + t.to(tl.int64) * stride_l, t, bias_ptr, tid_ptr, tok_ptr, ids_ptr, w_ptr, E, scale,
              K, KP, BE, SCORE, HASH, PRECISE, "")


def route_warps(be: int) -> int:
    """The warps of the route kernel for ``be`` (the experts' power of two): one per 128 lanes, 1..8."""
    return max(1, min(8, be // 128))


@on_input_device
def route_triton(logits: torch.Tensor, top_k: int, scoring: str, scale: float, bias: torch.Tensor | None = None,
                 tid2eid: torch.Tensor | None = None, input_ids: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] (any float dtype; read as fp32) -> ids [T, k] (long), weights [T, k] (fp32).
    Hash routing when ``tid2eid`` [V, k] is given (``input_ids``: T token ids), else top-k of
    scores + ``bias`` [E]."""
    T, E = logits.shape
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    ids = logits.new_empty(T, top_k, dtype=torch.long)
    w = logits.new_empty(T, top_k, dtype=torch.float32)
    hash_ = tid2eid is not None
    toks = input_ids.reshape(-1) if hash_ else logits
    BE = next_pow2(E)
    kernel, score = _route_kernel, SCORES[scoring]  # the kernel looked up per call: tests replace it
    pdl = use_pdl(T, logits.device)
    skey = (id(kernel), top_k, BE, score, hash_, pdl)
    site = _SITES.get(skey) or new_site(_SITES, skey, kernel, K=top_k, KP=next_pow2(top_k), BE=BE, SCORE=score,
                                        HASH=hash_, PRECISE=not INTERPRET,
                                        num_warps=1 if INTERPRET else route_warps(BE), enable_fp_fusion=False,
                                        **pdl_kw(pdl))
    site((T,), logits, bias if bias is not None else logits, tid2eid.contiguous() if hash_ else logits,
         toks, ids, w, E, logits.stride(0), float(scale))
    return ids, w
