"""Triton decode scores of the lightning indexer: the kernel of
``dsv4lab.model.indexer.index_scores_decode`` (same signature, so it fills the
``Indexer.decode_kernel`` slot; reference parity on CPU through the interpreter).

scores[b, t] = sum_h w[b,h] * ReLU(q[b,h] . K[b,t]) / sqrt(Ih) for t < n_valid, -inf after, with
w = weights_proj(x) * w_scale in fp32 (``Indexer.head_weights`` folded in). A fixed grid of
programs per batch row, each holding q [Hi, Ih] and w in registers and striding over key tiles of
BLOCK_T rows: the valid tiles (bound read on the device, no host sync) through one tl.dot each,
then the tail up to the capacity T is written -inf without reading keys. bf16 / fp16 inputs of
one dtype use their tensor-core dot (exact products, fp32 sums: the reference's fp32 matmul up to
summation order); fp32 or mixed dtypes IEEE fp32 dots.

The top-k stays ``torch.topk`` inside ``Indexer.select`` (the same tie and -1 handling as the
reference, by construction): a one-launch Triton top-k of 1024 out of up to max_len / 4 scores
would need a multi-pass radix select, and the scores are only 4 bytes per entry (the keys 256).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .device import on_input_device
from .host import INTERPRET, cdiv, dot_dtype, next_pow2, num_sms
from .launch import new_site
from .norm_rope import rope_cos_sin, rotate_pairs
from .pdl import pdl_enter, pdl_kw, use_pdl

BLOCK_T = 64    # keys per tile: s [Hi=64, 64] fp32 and q [64, 128] bf16 per program at V4-Pro shapes
NUM_WARPS = 4
_SITES: dict = {}  # (id(kernel), constexprs) -> LaunchSite


@triton.jit
def _index_scores_kernel(q_ptr, w_ptr, k_ptr, n_ptr, out_ptr, T, HI, DI, PROGS, w_scale, k_scale,
                         sq_b, sq_h, sw_b, sk_b, sk_t, so_b, pos_ptr, inv_ptr,
                         DOT: tl.constexpr, IEEE: tl.constexpr,
                         BLOCK_T: tl.constexpr, BLOCK_HI: tl.constexpr, BLOCK_DI: tl.constexpr,
                         PDL: tl.constexpr = False, RD: tl.constexpr = 0, PRECISE: tl.constexpr = True):
    """``RD`` > 0: q arrives as wq_b wrote it; each program rotates the last RD channels of its heads
    at ``pos`` first (``norm_rope``'s RoPE: ``rope_cos_sin``, ``rotate_pairs``, launched without FMA
    contraction), the bits of the indexer's ``rope_kernel`` launch."""
    pdl_enter(PDL)
    p = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    offs_h = tl.arange(0, BLOCK_HI)
    offs_d = tl.arange(0, BLOCK_DI)
    offs_t = tl.arange(0, BLOCK_T)
    hmask = offs_h < HI
    dmask = offs_d < DI
    n = tl.minimum(tl.load(n_ptr).to(tl.int32), T)
    q = tl.load(q_ptr + b * sq_b + offs_h[:, None] * sq_h + offs_d[None, :], mask=hmask[:, None] & dmask[None, :],
                other=0.0)
    if RD > 0:
        HALF: tl.constexpr = BLOCK_DI // 2
        ve, vo = tl.split(tl.reshape(q.to(tl.float32), [BLOCK_HI, HALF, 2]))
        rot, cos, sin = rope_cos_sin(tl.load(pos_ptr), inv_ptr, tl.arange(0, HALF), DI // 2, RD, 1, PRECISE)
        ve, vo = rotate_pairs(ve, vo, rot[None, :], cos[None, :], sin[None, :], q_ptr.dtype.element_ty)
        q = tl.reshape(tl.join(ve, vo), [BLOCK_HI, BLOCK_DI]).to(q_ptr.dtype.element_ty)
    q = q.to(DOT)
    w = tl.load(w_ptr + b * sw_b + offs_h, mask=hmask, other=0.0).to(tl.float32) * w_scale   # 0 for padded heads
    n_tiles = tl.cdiv(n, BLOCK_T)
    for tb in range(p, n_tiles, PROGS):
        t = tb * BLOCK_T + offs_t
        ok = t < n
        k = tl.load(k_ptr + b * sk_b + t[:, None].to(tl.int64) * sk_t + offs_d[None, :], mask=ok[:, None] & dmask[None, :],
                    other=0.0).to(DOT)
        if IEEE:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")   # [Hi, BLOCK_T]
        else:
            s = tl.dot(q, tl.trans(k))
        s = tl.maximum(s, 0.0) * k_scale
        sc = tl.sum(s * w[:, None], 0)
        tl.store(out_ptr + b * so_b + t, tl.where(ok, sc, float("-inf")), mask=t < T)
    for tb in range(n_tiles + p, tl.cdiv(T, BLOCK_T), PROGS):   # closed-later entries: -inf, keys unread
        t = tb * BLOCK_T + offs_t
        tl.store(out_ptr + b * so_b + t, tl.full([BLOCK_T], float("-inf"), tl.float32), mask=t < T)


def scores_dot_type(q: torch.Tensor, keys: torch.Tensor):
    """The tl.dot operand type giving the reference's fp32 products: bf16 / fp16 when both are."""
    if q.dtype == keys.dtype and q.dtype in (torch.bfloat16, torch.float16):
        return dot_dtype(keys)
    return tl.float32


@on_input_device
def index_scores_decode_triton(q: torch.Tensor, w_raw: torch.Tensor, keys: torch.Tensor, n_valid: torch.Tensor,
                               w_scale: float, programs: int | None = None, positions: torch.Tensor | None = None,
                               inv_freq: torch.Tensor | None = None) -> torch.Tensor:
    """``index_scores_decode`` in one launch: q [B,1,Hi,Ih], w_raw [B,1,Hi], keys [B,T,Ih], n_valid a
    0-d device tensor -> scores [B,1,T] fp32. ``programs`` per batch row: None = two per SM
    spread over the batch (at most one per tile). ``positions`` [1] and ``inv_freq``: q is wq_b's
    raw output, rotated here first as ``norm_rope(q, positions, inv_freq)`` gives it."""
    B, S, HI, DI = q.shape
    if S != 1:
        raise ValueError(f"index_scores_decode_triton: q must hold one token per sequence, got q.shape={tuple(q.shape)}")
    if (positions is None) != (inv_freq is None) or (positions is not None and positions.numel() != 1):
        raise ValueError("index_scores_decode_triton: positions (one, on q's device) and inv_freq come together; got "
                         f"positions={None if positions is None else tuple(positions.shape)}, "
                         f"inv_freq={None if inv_freq is None else tuple(inv_freq.shape)}")
    q = q.contiguous()
    w_raw = w_raw.contiguous()
    keys = keys.contiguous()
    T = keys.shape[1]
    out = q.new_empty(B, 1, T, dtype=torch.float32)
    n_tiles = cdiv(T, BLOCK_T)
    progs = programs or max(1, min(n_tiles, cdiv(2 * num_sms(q.device), B)))
    dot = scores_dot_type(q, keys)
    kernel = _index_scores_kernel  # looked up per call: tests replace it
    pdl = use_pdl(progs * B, q.device)
    rd = 0 if inv_freq is None else 2 * inv_freq.shape[-1]
    skey = (id(kernel), dot, HI, DI, pdl, rd)
    # the RoPE variant without FMA contraction: its products round as norm_rope's (the scores then too)
    site = _SITES.get(skey) or new_site(_SITES, skey, kernel, DOT=dot, IEEE=dot == tl.float32, BLOCK_T=BLOCK_T,
                                        BLOCK_HI=next_pow2(max(HI, 16)), BLOCK_DI=next_pow2(max(DI, 16)), RD=rd,
                                        PRECISE=not INTERPRET, num_warps=NUM_WARPS, **pdl_kw(pdl),
                                        **({"enable_fp_fusion": False} if rd else {}))
    site((progs, B),
        q, w_raw, keys, n_valid, out, T, HI, DI, progs, w_scale, DI ** -0.5,
        q.stride(0), q.stride(2), w_raw.stride(0), keys.stride(0), keys.stride(1), out.stride(0),
        n_valid if positions is None else positions, q if inv_freq is None else inv_freq)
    return out
