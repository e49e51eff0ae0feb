"""Triton prefill attention over [sliding window | compressed entries] with the sink: the kernel of
``dsv4lab.model.bounded_attention.bounded_attention`` (same signature, so it fills the
``Attention.kernel`` slot; reference parity on CPU through the interpreter).

One program per (query, block of BLOCK_H = 64 heads, batch row): q [BLOCK_H, Dh] stays in registers,
keys stream in tiles of BLOCK_N rows: first the window (contiguous positions
[q_pos - window + 1, q_pos]), then the entries: the CSA indexer's ``selected`` rows gathered by
index (up to the row's last valid slot: ``attention_tiles.selected_extent``), or HCA's closed entries
w < (q_pos + 1) // ratio. Online softmax in fp32 started from the
sink logit (m = sink, l = 1), P.V with P in the keys' dtype (bf16 / fp16 tensor-core dots; fp32
inputs and the interpreter: IEEE fp32 dots) and fp32 accumulators, the output rounded once to
the keys' dtype; nothing of size [H, S, L] exists, only the output [B, S, H, Dh].
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .attention_tiles import SEL_SCAN, head_block_query, online_softmax_tile, selected_extent
from .device import on_input_device
from .host import cdiv, dot_dtype, next_pow2

CSA_STAGES = 2  # pipeline stages of the CSA case (gathered keys); the window-only and HCA cases keep Triton's


@triton.jit
def _bounded_attention_kernel(q_ptr, wk_ptr, ent_ptr, sel_ptr, sink_ptr, out_ptr,
                              S, H, D, P, T, K, q_start, k_start, window, ratio, scale,
                              sq_b, sq_s, sq_h, swk_b, swk_p, sent_b, sent_t, ssel_b, ssel_s, so_b, so_s, so_h,
                              HAS_ENT: tl.constexpr, HAS_SEL: tl.constexpr, DOT: tl.constexpr, IEEE: tl.constexpr,
                              BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                              SEL_SCAN: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)  # 64-bit offsets: one call may hold > 2^31 query elements
    hb = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    offs_h, offs_d, hmask, dmask, q, m_i = head_block_query(q_ptr + b * sq_b + t * sq_s, sink_ptr, sq_h, H, D, hb,
                                                            DOT, BLOCK_H, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    l_i = tl.full([BLOCK_H], 1.0, tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    qpos = q_start + t
    j_lo = tl.maximum(qpos - window + 1 - k_start, 0)
    j_hi = qpos - k_start  # inclusive: the query's own key
    for n0 in range(j_lo, j_hi + 1, BLOCK_N):
        j = n0 + offs_n
        valid = j <= j_hi
        k = tl.load(wk_ptr + b * swk_b + j[:, None] * swk_p + offs_d[None, :], mask=valid[:, None] & dmask[None, :], other=0.0)
        m_i, l_i, acc = online_softmax_tile(q, k, valid, m_i, l_i, acc, scale, DOT, IEEE)
    if HAS_SEL:
        sel_row = sel_ptr + b * ssel_b + t * ssel_s
        for n0 in range(0, selected_extent(sel_row, K, SEL_SCAN), BLOCK_N):  # -1 tiles after it: no-ops
            c = n0 + offs_n
            idx = tl.load(sel_row + c, mask=c < K, other=-1)
            valid = idx >= 0
            k = tl.load(ent_ptr + b * sent_b + tl.maximum(idx, 0)[:, None] * sent_t + offs_d[None, :],
                        mask=valid[:, None] & dmask[None, :], other=0.0)
            m_i, l_i, acc = online_softmax_tile(q, k, valid, m_i, l_i, acc, scale, DOT, IEEE)
    elif HAS_ENT:
        n_vis = tl.minimum((qpos + 1) // ratio, T)
        for n0 in range(0, n_vis, BLOCK_N):
            w = n0 + offs_n
            valid = w < n_vis
            k = tl.load(ent_ptr + b * sent_b + w[:, None] * sent_t + offs_d[None, :], mask=valid[:, None] & dmask[None, :], other=0.0)
            m_i, l_i, acc = online_softmax_tile(q, k, valid, m_i, l_i, acc, scale, DOT, IEEE)
    out = acc / l_i[:, None]
    tl.store(out_ptr + b * so_b + t * so_s + offs_h[:, None] * so_h + offs_d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=hmask[:, None] & dmask[None, :])


@on_input_device
def bounded_attention_triton(q: torch.Tensor, sink: torch.Tensor, scale: float, window: int,
                             window_keys: torch.Tensor, q_start: int, k_start: int,
                             entries: torch.Tensor | None = None, ratio: int = 0,
                             selected: torch.Tensor | None = None,
                             q_block: int | None = None, k_block: int | None = None,
                             block_bytes: int = 0, block_h: int = 64, block_n: int = 32, num_warps: int = 8,
                             num_stages: int | None = None) -> torch.Tensor:
    """``bounded_attention`` as one Triton launch (``q_block`` / ``k_block`` / ``block_bytes``
    are the reference's tiling and ignored here; ``num_stages`` None: 2 with CSA's ``selected``
    (H200, 4k chunk: 7.09 -> 6.84 ms, the same bits; 1 stage 10.0, 4 stages 7.09), else Triton's
    default). Returns [B,S,H,Dh] in the keys' dtype.

    Tiles from ``benchmarks/prefill_attention.py`` on the H200 (V4-Pro shapes, a 4k chunk): 64 heads
    x 32 keys, 8 warps took CSA (1024 selected) 14.4 -> 7.1 ms, HCA 2.2 -> 1.2, window-only
    1.8 -> 1.0 against the 32-head tiles an offline compile had picked (they spill less, but each
    query's keys are read half as often with 64 heads); 16 tilings tried, 128 heads spill or fail."""
    B, S, H, D = q.shape
    q = q.to(window_keys.dtype).contiguous()
    wk = window_keys.contiguous()
    ent = entries.to(wk.dtype).contiguous() if entries is not None else wk
    sel = selected.to(torch.int32).contiguous() if (entries is not None and selected is not None) else None
    out = torch.empty(B, S, H, D, dtype=wk.dtype, device=q.device)
    sel_arg = sel if sel is not None else torch.empty(1, 1, 1, dtype=torch.int32, device=q.device)
    grid = (S, cdiv(H, block_h), B)
    stages = num_stages if num_stages is not None else CSA_STAGES if sel is not None else None
    dot = tl.float32 if wk.dtype == torch.float32 else dot_dtype(wk)  # fp32 under the interpreter
    _bounded_attention_kernel[grid](
        q, wk, ent, sel_arg, sink.float().contiguous(), out,
        S, H, D, wk.shape[1], ent.shape[1] if entries is not None else 0, sel_arg.shape[-1], q_start, k_start, window,
        max(ratio, 1), scale,
        q.stride(0), q.stride(1), q.stride(2), wk.stride(0), wk.stride(1), ent.stride(0), ent.stride(1),
        sel_arg.stride(0), sel_arg.stride(1), out.stride(0), out.stride(1), out.stride(2),
        HAS_ENT=entries is not None, HAS_SEL=sel is not None, DOT=dot, IEEE=dot == tl.float32,
        BLOCK_H=block_h, BLOCK_N=block_n, BLOCK_D=next_pow2(max(D, 16)), SEL_SCAN=SEL_SCAN, num_warps=num_warps,
        **({} if stages is None else {"num_stages": stages}))
    return out
