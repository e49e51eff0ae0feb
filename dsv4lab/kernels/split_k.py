"""Triton device side of split K, shared by the GEMV / GEMM kernels, the gate and the MoE decode:
each split stores its fp32 partial and bumps its tile's counter (``arrive``); the last one sums the
partials in split order (``sum_partials``), stores the tile and resets the counter
(``store_or_fix_up``). One launch, deterministic, CUDA-graph safe; the counters are
``host.counters``.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .rounding import round_to


@triton.jit
def store_or_fix_up(acc, y_ptrs, ws_ptrs, mask, cnt_ptr, tile, pid_k, split_stride, SPLIT, scale,
                     USE_SPLIT: tl.constexpr):
    """y = acc * scale; with split K every split writes its fp32 partial at ws_ptrs + pid_k *
    split_stride and bumps the tile's counter, and the last one sums the SPLIT partials in split
    order, stores and resets the counter (one launch, deterministic, CUDA-graph safe). Returns
    whether this program stored the tile (every program without split K; the last split with it),
    for kernels that go on from the stored tile (``gate_route``)."""
    out_ty = y_ptrs.dtype.element_ty
    if not USE_SPLIT:
        tl.store(y_ptrs, round_to(acc * scale, out_ty).to(out_ty), mask=mask)
        stored = tl.full((), 1, tl.int1)
    else:
        stored = arrive(acc, ws_ptrs + pid_k * split_stride, mask, cnt_ptr, tile) == SPLIT - 1
        if stored:
            tot = sum_partials(ws_ptrs, split_stride, SPLIT, mask, tl.zeros_like(acc))
            tl.store(y_ptrs, round_to(tot * scale, out_ty).to(out_ty), mask=mask)
            tl.atomic_xchg(cnt_ptr + tile, 0, sem="relaxed")  # next use is a later launch: no fence
    return stored


@triton.jit
def arrive(part, part_ptrs, mask, cnt_ptr, tile):
    """Store this program's fp32 partial and bump the tile's counter: the count before (the last
    of n programs reads n - 1 and then sums the partials, stores and resets the counter)."""
    tl.store(part_ptrs, part, mask=mask)
    tl.debug_barrier()
    return tl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel")


@triton.jit
def sum_partials(ws_ptrs, split_stride, SPLIT, mask, tot):
    """tot + the SPLIT fp32 partials at ws_ptrs + s * split_stride, added in split order (the
    fix-up of ``store_or_fix_up`` and of the MoE decode's token tiles)."""
    if tot.numel <= 2048:
        # GEMV tiles: four partials per round trip, still summed in split order; a loop of
        # single loads waits one L2 latency per split (H200: wkv 6.5 -> 5.4 us, q_a 7.7 -> 6.9)
        for s in range(0, SPLIT, 4):
            p0 = tl.load(ws_ptrs + s * split_stride, mask=mask, other=0.0, cache_modifier=".cg")
            p1 = tl.load(ws_ptrs + (s + 1) * split_stride, mask=tl.where(s + 1 < SPLIT, mask, False), other=0.0,
                         cache_modifier=".cg")
            p2 = tl.load(ws_ptrs + (s + 2) * split_stride, mask=tl.where(s + 2 < SPLIT, mask, False), other=0.0,
                         cache_modifier=".cg")
            p3 = tl.load(ws_ptrs + (s + 3) * split_stride, mask=tl.where(s + 3 < SPLIT, mask, False), other=0.0,
                         cache_modifier=".cg")
            tot = (((tot + p0) + p1) + p2) + p3
    else:  # GEMM tiles (64-128 x 128): four in flight would spill registers (o_b M=128 178 -> 239 us)
        for s in range(SPLIT):
            tot += tl.load(ws_ptrs + s * split_stride, mask=mask, other=0.0, cache_modifier=".cg")
    return tot
