"""Triton prefill scores of the lightning indexer: ``dsv4lab.model.indexer.index_scores_prefill``
(same signature, so it fills the ``Indexer.prefill_kernel`` slot; parity on CPU through the interpreter).

scores[b, s, t] = sum_h w[b,s,h] * ReLU(q[b,s,h] . K[b,t]) / sqrt(Ih) for t < n_valid[s], -inf after,
with w = weights_proj(x) * w_scale in fp32. The reference builds the [B, S, Hi, T] fp32 products
and reduces them in three more passes; at V4-Pro's 64 heads, a 4k chunk and 16k entries (64k
context) that is ~17 GB of memory traffic per pass (H200: ~65 ms of a 128 ms CSA chunk). Here one
program takes a tile of BLOCK_T keys (read once) and QB queries, and for each query one tensor-core
dot [Hi, Ih] x [Ih, BLOCK_T], ReLU, and the weighted sum over heads in registers: nothing but the
[B, S, T] scores reaches memory. Tiles past every query's closed entries are written -inf without
reading keys. Dot types as the decode kernel (``indexer_decode``): bf16 / fp16 products exact,
fp32 sums (the reference's fp32 matmul up to summation order); fp32 inputs IEEE fp32 dots.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .device import on_input_device
from .host import cdiv, next_pow2
from .indexer_decode import scores_dot_type
from .launch import launch

BLOCK_T = 64     # keys per program: [Hi=64, 64] fp32 scores per query dot at V4-Pro shapes
QUERIES = 16     # queries per program: the key tile is read once for all of them
NUM_WARPS = 4


@triton.jit
def _index_scores_prefill_kernel(q_ptr, w_ptr, k_ptr, n_ptr, out_ptr, S, T, HI, DI, w_scale, k_scale,
                                 sq_b, sq_s, sq_h, sw_b, sw_s, sk_b, sk_t, so_b, so_s,
                                 DOT: tl.constexpr, IEEE: tl.constexpr, QB: tl.constexpr,
                                 BLOCK_T: tl.constexpr, BLOCK_HI: tl.constexpr, BLOCK_DI: tl.constexpr):
    tb = tl.program_id(0)
    s0 = tl.program_id(1) * QB
    b = tl.program_id(2).to(tl.int64)
    offs_h = tl.arange(0, BLOCK_HI)
    offs_d = tl.arange(0, BLOCK_DI)
    offs_t = tb * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_q = s0 + tl.arange(0, QB)
    hmask = offs_h < HI
    dmask = offs_d < DI
    n_q = tl.minimum(tl.load(n_ptr + offs_q, mask=offs_q < S, other=0).to(tl.int32), T)
    n_max = tl.max(n_q, 0)
    if tb * BLOCK_T < n_max:
        k = tl.load(k_ptr + b * sk_b + offs_t[:, None].to(tl.int64) * sk_t + offs_d[None, :],
                    mask=(offs_t < n_max)[:, None] & dmask[None, :], other=0.0).to(DOT)
        for i in range(QB):
            s = s0 + i
            if s < S:
                n = tl.minimum(tl.load(n_ptr + s).to(tl.int32), T)
                row = b * sq_b + s.to(tl.int64) * sq_s
                q = tl.load(q_ptr + row + offs_h[:, None] * sq_h + offs_d[None, :],
                            mask=hmask[:, None] & dmask[None, :], other=0.0).to(DOT)
                w = tl.load(w_ptr + b * sw_b + s.to(tl.int64) * sw_s + offs_h, mask=hmask, other=0.0).to(tl.float32) * w_scale
                if IEEE:
                    sc = tl.dot(q, tl.trans(k), input_precision="ieee")   # [Hi, BLOCK_T]
                else:
                    sc = tl.dot(q, tl.trans(k))
                sc = tl.maximum(sc, 0.0) * k_scale
                tot = tl.sum(sc * w[:, None], 0)
                tl.store(out_ptr + b * so_b + s.to(tl.int64) * so_s + offs_t, tl.where(offs_t < n, tot, float("-inf")),
                         mask=offs_t < T)
    else:   # closed later for every query of the block: -inf, keys unread
        ninf = tl.full([QB, BLOCK_T], float("-inf"), tl.float32)
        ptrs = out_ptr + b * so_b + offs_q[:, None].to(tl.int64) * so_s + offs_t[None, :]
        tl.store(ptrs, ninf, mask=(offs_q < S)[:, None] & (offs_t < T)[None, :])


@on_input_device
def index_scores_prefill_triton(q: torch.Tensor, w_raw: torch.Tensor, keys: torch.Tensor, n_valid: torch.Tensor,
                                w_scale: float) -> torch.Tensor:
    """``index_scores_prefill`` in one launch: q [B,S,Hi,Ih], w_raw [B,S,Hi], keys [B,T,Ih], n_valid
    [S] (entries closed for each query, on the device) -> scores [B,S,T] fp32."""
    B, S, HI, DI = q.shape
    if n_valid.shape != (S,):
        raise ValueError(f"index_scores_prefill_triton: n_valid must hold one count per query, shape ({S},); "
                         f"got {tuple(n_valid.shape)}")
    q = q.contiguous()
    w_raw = w_raw.contiguous()
    keys = keys.contiguous()
    n_valid = n_valid.contiguous()
    T = keys.shape[1]
    out = torch.empty(B, S, T, dtype=torch.float32, device=q.device)
    if S == 0 or T == 0:
        return out
    dot = scores_dot_type(q, keys)
    launch(_index_scores_prefill_kernel, (cdiv(T, BLOCK_T), cdiv(S, QUERIES), B),
           q, w_raw, keys, n_valid, out, S, T, HI, DI, w_scale, DI ** -0.5,
           q.stride(0), q.stride(1), q.stride(2), w_raw.stride(0), w_raw.stride(1), keys.stride(0), keys.stride(1),
           out.stride(0), out.stride(1),
           DOT=dot, IEEE=dot == tl.float32, QB=QUERIES, BLOCK_T=BLOCK_T, BLOCK_HI=next_pow2(max(HI, 16)),
           BLOCK_DI=next_pow2(max(DI, 16)), num_warps=NUM_WARPS)
    return out
