"""MoE decode path with TMA-fed expert weights (Hopper and newer).

Same math and roundings as ``dsv4lab.kernels.moe_decode`` (gate/up rounded to x.dtype before the clamps,
h stored in x.dtype, the k weighted expert outputs summed in fp32 and rounded once), but the
expert rows stream through the multi-stage TMA ring and the f16x2 inner loop of
``dsv4lab.kernels.linear_nvfp4_tma`` instead of per-thread pointer loads with fp32 FMAs:

1. ``x_pairs(x)``: per-16-group scaled f16x2 pairs of every token row (one short wave);
2. ``_moe_up_kernel`` (grid = I tiles x T*k): rows of w1[e] and w3[e] against token t's pairs,
   the clamped SwiGLU, h[t*k + j] in x.dtype, written as h's pairs where whole 16-groups allow
   (``PAIRS``: V4-Pro's I = 3072);
3. else ``x_pairs(h)``;
4. ``_moe_down_kernel`` (grid = H tiles x T*k): one (token, expert) w2 GEMV per CTA, weighted by
   the routing weight into an fp32 partial; the last of a token's k CTAs (per-tile counter) sums
   the k partials in expert order and stores y (deterministic, no zero-fill, graph-safe).

Steps 2 and 4 may also run as one launch (``SCHEDULE`` "fused", MXFP4's default): CTAs draw tickets,
the first ones run up tiles, the rest down tiles that wait on their (token, expert) pair's counter
until its up tiles have written h's pairs; the down tiles fill the SMs as the up tiles retire, with
no launch gap and no up-grid tail between the two GEMVs.

Expert stacks are addressed as 2-D [E*N, K/16] descriptors with the row offset e*N read from the
device-side ids: no host sync. Needs H and I multiples of 256 (16-byte TMA strides for the scales).
MXFP4 stacks (the official checkpoint's experts: one E8M0 per 32 elements, no global scale) take
the same kernels with 32-group boxes and the scales expanded per group pair (``MX``); they need
H and I multiples of 512.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
from triton.tools.tensor_descriptor import TensorDescriptor

from ..quant.stacked import StackedMXFP4
from .activation_pairs import BOX_GROUPS, pairs_and_inv, pairs_descriptor, store_pair_rows, x_pairs
from .host import INTERPRET, cdiv, counters, device_capability, scratch
from .launch import new_site
from .pdl import pdl_kw
from .rounding import decode_swiglu, round_to
from .split_k import arrive, store_or_fix_up, sum_partials
from .weight_decode import block_scales, group_dot, weight_global_scale

_SITES: dict = {}  # (id(kernel), constexprs) -> LaunchSite (2 launches an eager MoE layer)


@triton.jit
def _up_sums(w1_desc, s1_desc, w3_desc, s3_desc, x_desc, xinv_ptr, xrow, r0, KG,
             BN: tl.constexpr, G: tl.constexpr, STAGES: tl.constexpr, USE_ASM: tl.constexpr, MX: tl.constexpr):
    """Rows r0 .. r0 + BN of w1 and of w3 against the activation pairs at pair row ``xrow``: the two
    fp32 dot products [BN] before the global scales."""
    acc1 = tl.zeros((BN, G), dtype=tl.float32)
    acc3 = tl.zeros((BN, G), dtype=tl.float32)
    for g0 in tl.range(0, KG, G, num_stages=STAGES):
        inv, x0, x1, x2, x3, x4, x5, x6, x7 = pairs_and_inv(x_desc, xinv_ptr, xrow, g0, G, True)
        acc1 += group_dot(w1_desc.load([r0, g0]), x0, x1, x2, x3, x4, x5, x6, x7, BN, G, USE_ASM) * \
            (block_scales(s1_desc, r0, g0, BN, G, MX) * inv)
        acc3 += group_dot(w3_desc.load([r0, g0]), x0, x1, x2, x3, x4, x5, x6, x7, BN, G, USE_ASM) * \
            (block_scales(s3_desc, r0, g0, BN, G, MX) * inv)
    return tl.sum(acc1, axis=1), tl.sum(acc3, axis=1)


@triton.jit
def _down_sum(w2_desc, s2_desc, h_desc, hinv_ptr, hrow, r0, KG,
              BN: tl.constexpr, G: tl.constexpr, STAGES: tl.constexpr, USE_ASM: tl.constexpr, MX: tl.constexpr):
    """Rows r0 .. r0 + BN of w2 against the pairs of h at pair row ``hrow`` (fp32 [BN], unscaled)."""
    acc = tl.zeros((BN, G), dtype=tl.float32)
    for g0 in tl.range(0, KG, G, num_stages=STAGES):
        inv, x0, x1, x2, x3, x4, x5, x6, x7 = pairs_and_inv(h_desc, hinv_ptr, hrow, g0, G, True)
        acc += group_dot(w2_desc.load([r0, g0]), x0, x1, x2, x3, x4, x5, x6, x7, BN, G, USE_ASM) * \
            (block_scales(s2_desc, r0, g0, BN, G, MX) * inv)
    return tl.sum(acc, axis=1)


@triton.jit
def _up_tile(pair, pid_n, NPT, w1_desc, s1_desc, w3_desc, s3_desc, sw1_desc, ss1_desc, sw3_desc, ss3_desc, x_desc,
             xinv_ptr, ids_ptr, g1_ptr, g3_ptr, sg1_ptr, sg3_ptr, h_ptr, hp_ptr, hinv_ptr, I, KG, TOPK, NPAIR, stride_h,
             limit, BN: tl.constexpr, G: tl.constexpr, STAGES: tl.constexpr, USE_ASM: tl.constexpr, MX: tl.constexpr,
             PAIRS: tl.constexpr):
    """Rows pid_n * BN .. of h for ``pair`` = t * NPAIR + j (j < TOPK a routed expert, j == TOPK the
    shared one) of the NPT pairs: w1 and w3 against token t's pairs, the clamped SwiGLU, stored as
    h's pairs (``PAIRS``: I % BN == 0) or as h in x.dtype."""
    t = pair // NPAIR
    j = pair - t * NPAIR
    n0 = pid_n * BN
    rows = n0 + tl.arange(0, BN)
    if j == TOPK:
        a1, a3 = _up_sums(sw1_desc, ss1_desc, sw3_desc, ss3_desc, x_desc, xinv_ptr, t * KG, n0, KG, BN, G, STAGES,
                          USE_ASM, MX)
        gs1 = weight_global_scale(sg1_ptr, 0, MX)
        gs3 = weight_global_scale(sg3_ptr, 0, MX)
    else:
        e = tl.load(ids_ptr + t * TOPK + j).to(tl.int32)  # int32 or the router's int64 ids
        a1, a3 = _up_sums(w1_desc, s1_desc, w3_desc, s3_desc, x_desc, xinv_ptr, t * KG, e * I + n0, KG, BN, G, STAGES,
                          USE_ASM, MX)
        gs1 = weight_global_scale(g1_ptr, e, MX)
        gs3 = weight_global_scale(g3_ptr, e, MX)
    out_ty = h_ptr.dtype.element_ty
    gate = round_to(a1 * (16384.0 * gs1), out_ty)
    up = round_to(a3 * (16384.0 * gs3), out_ty)
    h = decode_swiglu(gate, up, limit, out_ty)
    if PAIRS:  # the down GEMV's pairs of these BN rows of h (I % BN == 0): no h, no x_pairs(h) launch
        NG: tl.constexpr = BN // 16
        g = pair * (I // 16) + n0 // 16 + tl.arange(0, NG)
        tot = NPT * (I // 16)   # every pair's groups: all written, no 1/xs padding
        store_pair_rows(tl.reshape(h.to(out_ty).to(tl.float32), (NG, 16)), hp_ptr, hinv_ptr, g, tot, tot, NG)
    else:
        tl.store(h_ptr + pair * stride_h + rows, h.to(out_ty), mask=rows < I)


@triton.jit
def _moe_up_kernel(w1_desc, s1_desc, w3_desc, s3_desc, sw1_desc, ss1_desc, sw3_desc, ss3_desc, x_desc, xinv_ptr,
                   ids_ptr, g1_ptr, g3_ptr, sg1_ptr, sg3_ptr, h_ptr, hp_ptr, hinv_ptr, I, KG, TOPK, NPAIR, stride_h,
                   limit, BN: tl.constexpr, G: tl.constexpr, STAGES: tl.constexpr, USE_ASM: tl.constexpr,
                   MX: tl.constexpr, PAIRS: tl.constexpr = False, TRIGGER: tl.constexpr = False):
    if TRIGGER:  # the down launch (PDL) may become resident now: it waits for this grid's end
        gdc_launch_dependents()
    _up_tile(tl.program_id(1), tl.program_id(0), tl.num_programs(1), w1_desc, s1_desc, w3_desc, s3_desc, sw1_desc,
             ss1_desc, sw3_desc, ss3_desc, x_desc, xinv_ptr, ids_ptr, g1_ptr, g3_ptr, sg1_ptr, sg3_ptr, h_ptr, hp_ptr,
             hinv_ptr, I, KG, TOPK, NPAIR, stride_h, limit, BN, G, STAGES, USE_ASM, MX, PAIRS)


@triton.jit
def _fix_up_routed_and_shared(part, y_ptrs, ws_ptrs, mask, cnt_ptr, tile, j, H, TOPK):
    """``store_or_fix_up`` over a token's TOPK + 1 partials of a row tile, where the last CTA rounds
    the sum of the TOPK routed ones (expert order) to y's dtype, adds the shared expert's partial
    rounded the same way and rounds again: the model's routed + shared, both in x.dtype."""
    if arrive(part, ws_ptrs + j * H, mask, cnt_ptr, tile) == TOPK:
        out_ty = y_ptrs.dtype.element_ty
        routed = sum_partials(ws_ptrs, H, TOPK, mask, tl.zeros_like(part))
        shared = tl.load(ws_ptrs + TOPK * H, mask=mask, other=0.0, cache_modifier=".cg")
        y = round_to(round_to(routed, out_ty) + round_to(shared, out_ty), out_ty)
        tl.store(y_ptrs, y.to(out_ty), mask=mask)
        tl.atomic_xchg(cnt_ptr + tile, 0, sem="relaxed")  # next use is a later launch: no fence


@triton.jit
def _down_tile(pair, pid_n, NT, w2_desc, s2_desc, sw2_desc, ss2_desc, h_desc, hinv_ptr, ids_ptr, wts_ptr, g2_ptr,
               sg2_ptr, y_ptr, ws_ptr, cnt_ptr, H, KG, TOPK, NPAIR, stride_yt, BN: tl.constexpr, G: tl.constexpr,
               STAGES: tl.constexpr, USE_ASM: tl.constexpr, MX: tl.constexpr, SHARED: tl.constexpr):
    """Row tile pid_n (of NT) of ``pair``'s w2 GEMV, weighted into an fp32 partial; the last of the
    token's pairs to arrive at the tile sums them in expert order and stores y."""
    t = pair // NPAIR
    j = pair - t * NPAIR
    n0 = pid_n * BN
    rows = n0 + tl.arange(0, BN)
    row_ok = rows < H
    if j == TOPK:
        a = _down_sum(sw2_desc, ss2_desc, h_desc, hinv_ptr, pair * KG, n0, KG, BN, G, STAGES, USE_ASM, MX)
        part = a * (16384.0 * weight_global_scale(sg2_ptr, 0, MX))
    else:
        e = tl.load(ids_ptr + t * TOPK + j).to(tl.int32)  # int32 or the router's int64 ids
        a = _down_sum(w2_desc, s2_desc, h_desc, hinv_ptr, pair * KG, e * H + n0, KG, BN, G, STAGES, USE_ASM, MX)
        part = a * (16384.0 * weight_global_scale(g2_ptr, e, MX) * tl.load(wts_ptr + t * TOPK + j).to(tl.float32))
    tile = t * NT + pid_n
    y_ptrs = y_ptr + t * stride_yt + rows
    ws_ptrs = ws_ptr + t * NPAIR * H + rows
    if SHARED:
        _fix_up_routed_and_shared(part, y_ptrs, ws_ptrs, row_ok, cnt_ptr, tile, j, H, TOPK)
    else:
        # the token's k experts are the "splits" of its row tile: the last sums them in expert order
        store_or_fix_up(part, y_ptrs, ws_ptrs, row_ok, cnt_ptr, tile, j, H, TOPK, 1.0, True)


@triton.jit
def _moe_down_kernel(w2_desc, s2_desc, sw2_desc, ss2_desc, h_desc, hinv_ptr, ids_ptr, wts_ptr, g2_ptr, sg2_ptr,
                     y_ptr, ws_ptr, cnt_ptr, H, KG, TOPK, NPAIR, stride_yt,
                     BN: tl.constexpr, G: tl.constexpr, STAGES: tl.constexpr, USE_ASM: tl.constexpr, MX: tl.constexpr,
                     SHARED: tl.constexpr, TRIGGER: tl.constexpr = False, PDL: tl.constexpr = False):
    if PDL:  # launched while the up grid runs: its h pairs are complete and visible after the wait
        gdc_wait()
    if TRIGGER:  # a PDL-launched successor (hc_post) may become resident once this grid's last CTAs run:
        gdc_launch_dependents()  # it does its own prologue there and waits for this grid's end as usual
    _down_tile(tl.program_id(1), tl.program_id(0), tl.num_programs(0), w2_desc, s2_desc, sw2_desc, ss2_desc, h_desc,
               hinv_ptr, ids_ptr, wts_ptr, g2_ptr, sg2_ptr, y_ptr, ws_ptr, cnt_ptr, H, KG, TOPK, NPAIR, stride_yt,
               BN, G, STAGES, USE_ASM, MX, SHARED)


@triton.jit
def _proxy_fence(USE_ASM: tl.constexpr):
    """Order this thread's generic-proxy accesses with its async-proxy (TMA) ones: h's pairs are
    written with plain stores and read by the down tiles' TMA loads (PTX ``fence.proxy.async``)."""
    if USE_ASM:
        tl.inline_asm_elementwise("fence.proxy.async.global; // $0", "=r", [], dtype=tl.int32, is_pure=False,
                                  pack=1)


@triton.jit
def _moe_fused_kernel(w1_desc, s1_desc, w3_desc, s3_desc, sw1_desc, ss1_desc, sw3_desc, ss3_desc, x_desc, xinv_ptr,
                      g1_ptr, g3_ptr, sg1_ptr, sg3_ptr, h_ptr, hp_ptr, I, KG_UP, limit,
                      w2_desc, s2_desc, sw2_desc, ss2_desc, h_desc, hinv_ptr, ids_ptr, wts_ptr, g2_ptr, sg2_ptr,
                      y_ptr, ws_ptr, cnt_ptr, sync_ptr, H, KG_DOWN, TOPK, NPAIR, NPT, NUP, NDOWN, stride_yt,
                      BN_UP: tl.constexpr, STAGES_UP: tl.constexpr, BN_DOWN: tl.constexpr, STAGES_DOWN: tl.constexpr,
                      G: tl.constexpr, USE_ASM: tl.constexpr, MX: tl.constexpr, SHARED: tl.constexpr,
                      TRIGGER: tl.constexpr = False):
    """Up and down tiles in one launch: each CTA draws a ticket; the first NPT * NUP tickets are up
    tiles (pair-major), the rest down tiles, which wait until their pair's NUP up tiles have
    written h's pairs (``sync_ptr``: [ticket, ready[NPT], seen[NPT]], all back to 0 at the end).
    Tickets are drawn by running CTAs in order, so every up tile is running or done before any
    down tile waits: no deadlock, whatever the residency. No launch gap and no up-grid tail
    between the two GEMVs: the down tiles fill the SMs as the up tiles retire."""
    if TRIGGER:  # a PDL-launched successor (hc_post) may become resident once this grid's last CTAs run
        gdc_launch_dependents()
    total = NPT * (NUP + NDOWN)
    tk = tl.atomic_add(sync_ptr, 1, sem="relaxed")
    if tk == total - 1:  # every ticket is drawn: the counter is free for the next launch
        tl.atomic_xchg(sync_ptr, 0, sem="relaxed")
    n_up = NPT * NUP
    if tk < n_up:
        pair = tk // NUP
        _up_tile(pair, tk - pair * NUP, NPT, w1_desc, s1_desc, w3_desc, s3_desc, sw1_desc, ss1_desc, sw3_desc,
                 ss3_desc, x_desc, xinv_ptr, ids_ptr, g1_ptr, g3_ptr, sg1_ptr, sg3_ptr, h_ptr, hp_ptr, hinv_ptr, I,
                 KG_UP, TOPK, NPAIR, I, limit, BN_UP, G, STAGES_UP, USE_ASM, MX, True)
        tl.debug_barrier()   # every thread's pair stores precede the release
        _proxy_fence(USE_ASM)
        tl.atomic_add(sync_ptr + 1 + pair, 1, sem="release")
    else:
        d = tk - n_up
        pair = d // NDOWN
        while tl.atomic_add(sync_ptr + 1 + pair, 0, sem="acquire") < NUP:
            pass   # a nanosleep between polls measured no faster (256, 2000 ns)
        _proxy_fence(USE_ASM)
        _down_tile(pair, d - pair * NDOWN, NDOWN, w2_desc, s2_desc, sw2_desc, ss2_desc, h_desc, hinv_ptr, ids_ptr,
                   wts_ptr, g2_ptr, sg2_ptr, y_ptr, ws_ptr, cnt_ptr, H, KG_DOWN, TOPK, NPAIR, stride_yt,
                   BN_DOWN, G, STAGES_DOWN, USE_ASM, MX, SHARED)
        if tl.atomic_add(sync_ptr + 1 + NPT + pair, 1, sem="relaxed") == NDOWN - 1:
            # the pair's last down tile: every one of them is past its wait, so both counters are free
            tl.atomic_xchg(sync_ptr + 1 + pair, 0, sem="relaxed")
            tl.atomic_xchg(sync_ptr + 1 + NPT + pair, 0, sem="relaxed")


def tma_moe_supported(x: torch.Tensor, w1, w3, w2) -> bool:
    """H and I multiples of 256 (MXFP4: 512, for 16-byte E8M0 rows) and 16-byte aligned stacks, on
    sm_90+ (or under the interpreter)."""
    E, I, H = w1.shape
    mult = 512 if _is_mx(w1) else 256
    if H % mult or I % mult:
        return False
    if not (_stack_args(w1, UP_TILE[0]).aligned and _stack_args(w3, UP_TILE[0]).aligned
            and _stack_args(w2, DOWN_TILES[_is_mx(w2)][0]).aligned):
        return False
    return INTERPRET or (x.is_cuda and device_capability(x.device) >= (9, 0))


def _is_mx(w) -> bool:
    return isinstance(w, StackedMXFP4)


# (rows a CTA, TMA ring stages, warps) of each launch; ``benchmarks/results/decode/moe_tile_sweep.py``
# times the alternatives on V4-Pro's experts (H = 7168, I = 3072). The down tile is per format
# (MXFP4?) and shared by every schedule: its rows ([BN, G] layout) fix the order of each output row's
# fp32 sum, so the schedules below give the same bits only with the same down tile.
UP_TILE = (16, 2, 1) if INTERPRET else (64, 3, 4)
DOWN_TILES = {False: (16, 2, 1), True: (16, 2, 1)} if INTERPRET else {False: (128, 3, 4), True: (64, 3, 4)}
FUSED_UP_TILES = {False: (16, 2, 1), True: (16, 2, 1)} if INTERPRET else {False: (64, 4, 4), True: (64, 3, 4)}
EMIT_H_PAIRS = True  # the up launch writes h's pairs (False: h + the x_pairs prelude; tests compare both)
# "two": the up and the down launch; "pdl": the same, the down launch programmatic-dependent on the
# up one (no launch gap); "fused": one launch of up and down tiles (``_moe_fused_kernel``, up tile
# ``FUSED_UP_TILES``). ``SCHEDULE`` None takes ``DEFAULT_SCHEDULE`` (both formats since stop 57), a
# name forces one (tests, benchmarks). Measured on H100s (benchmarks/results/decode/moe_schedule/,
# one token, 6 routed + the shared expert of V4-Pro, graph replay): two launches NVFP4 109-117 us
# (up 71 + down 42: the down GEMV's short K = 3072 loop at 68 % of the copy ceiling), MXFP4 120-125
# us (up 80); fused MXFP4 101-103 us (-16 %), NVFP4 115-122 us with 64-row down tiles, 107-111 us
# with 128-row ones. Full depth (stop 57, H100, two rounds): NVFP4 fused with 128-row down tiles
# 15.98 / 16.01 ms a token against 16.05 / 16.07 for two launches with 64-row ones
# (benchmarks/results/decode/stop57/).
SCHEDULES = ("two", "pdl", "fused")
DEFAULT_SCHEDULE = "fused"
SCHEDULE: str | None = None


class _StackArgs:
    """What the launches derive from one stack alone, kept on the (frozen) stack object: the 2-D
    [E*N, ...] descriptors (weight words boxes [BN, G], scale boxes [BN, G] NVFP4 e4m3 or [BN, G/2]
    MXFP4 E8M0: one per two groups), the global scales (MXFP4: a placeholder, not read) and
    whether its tensors are 16-byte aligned. Built on first use (~22 us of descriptors and
    checks a decode step otherwise); ``packed_ptr`` catches a ``t.data = ...`` swap under the stack."""

    __slots__ = ("packed_ptr", "bn", "descs", "gs", "aligned")

    def __init__(self, w, bn: int) -> None:
        mx = _is_mx(w)
        packed, scale = w.packed, (w.scale if mx else w.block_scale)
        self.packed_ptr = packed.data_ptr()
        self.bn = bn
        self.aligned = packed.data_ptr() % 16 == 0 and scale.data_ptr() % 16 == 0
        self.gs = scale.view(torch.uint8) if mx else w.global_scale.to(torch.float32).contiguous()
        self.descs = _build_descs(packed, scale, bn, 32 if mx else BOX_GROUPS, mx) if self.aligned else None


def _stack_args(w, bn: int) -> _StackArgs:
    got = w.__dict__.get("_tma_args")
    if got is None or got.packed_ptr != w.packed.data_ptr() or got.bn != bn:
        got = _StackArgs(w, bn)
        if _is_mx(w) or got.gs is w.global_scale:  # not a per-call fp32 copy: in-place updates are seen
            object.__setattr__(w, "_tma_args", got)  # frozen dataclass: its fields cannot change, a cache may
    return got


def _build_descs(packed: torch.Tensor, scale: torch.Tensor, bn: int, g: int, mx: bool):
    e, n, kh = packed.shape
    p = packed.view(torch.int64).reshape(e * n, kh // 8)
    s = scale.view(torch.uint8).reshape(e * n, scale.shape[-1])
    return TensorDescriptor.from_tensor(p, [bn, g]), TensorDescriptor.from_tensor(s, [bn, g // 2 if mx else g])


def moe_decode_tma(x: torch.Tensor, ids_c: torch.Tensor, wts: torch.Tensor, w1, w3, w2, lim: float,
                   k: int, shared: tuple | None = None) -> torch.Tensor:
    """x [T, H] contiguous, ids_c int32 or int64 [T*k], wts fp32 [T*k], stacks as in ``moe_decode_triton``
    (``StackedNVFP4`` or ``StackedMXFP4``: MXFP4 boxes hold 32 groups so the E8M0 box is 16 bytes).
    ``shared``: the shared expert's (w1, w3, w2) as one-expert stacks of the same format, run as a
    (k+1)-th pair of every token in the same two GEMV launches; y = routed + shared, each rounded to
    x.dtype first (``_fix_up_routed_and_shared``)."""
    T, H = x.shape
    E, I, _ = w1.shape
    mx = _is_mx(w1)
    g = 32 if mx else BOX_GROUPS
    schedule = SCHEDULE or DEFAULT_SCHEDULE
    if schedule not in SCHEDULES:
        raise ValueError(f"moe_decode_tma.SCHEDULE={schedule!r}: expected None or one of {', '.join(SCHEDULES)}")
    if schedule == "fused" and not (EMIT_H_PAIRS and I % FUSED_UP_TILES[mx][0] == 0):
        schedule = "two"   # one launch needs the up tiles to write h's pairs
    up_tile, down_tile = (FUSED_UP_TILES[mx] if schedule == "fused" else UP_TILE), DOWN_TILES[mx]
    bn, stages, warps = up_tile
    npair = k + (shared is not None)
    npt = T * npair
    sw1, sw3, sw2 = shared if shared is not None else (w1, w3, w2)  # stand-ins: no pair reaches them
    y = x.new_empty((T, H))
    xp, xinv = x_pairs(x)
    # the up launch writes h's pairs itself where its tiles cover whole 16-groups (V4-Pro: I = 3072;
    # the down launch reads 1/xs from the pair rows, so its own vector needs no padding); else h,
    # then the x_pairs prelude over it
    hkg = npt * I // 16
    emit = EMIT_H_PAIRS and I % bn == 0
    if emit:  # buffers of their own: x's pairs (read by this launch) never share them
        h = None
        hp = scratch("moe_h_pairs", (hkg, 16), torch.int32, x.device)
        hinv = scratch("moe_h_pairs_inv", (hkg,), torch.float32, x.device)
    else:
        h = scratch("moe_h", (npt, I), x.dtype, x.device)   # the SwiGLU rows: read by the down launch only
    a1, a3, s1, s3 = (_stack_args(w, bn) for w in (w1, w3, sw1, sw3))
    dbn, dstages, dwarps = down_tile
    a2, s2 = _stack_args(w2, dbn), _stack_args(sw2, dbn)
    n_tiles = cdiv(H, dbn)
    ws = scratch("moe_down", (npt, H), torch.float32, x.device)
    shared_on = shared is not None
    if schedule == "fused":
        kernel = _moe_fused_kernel  # looked up per call: tests replace kernels
        nup = I // bn
        cnt = counters(x.device, T * n_tiles + 1 + 2 * npt)
        fkey = (id(kernel), mx, shared_on, up_tile, down_tile)
        fused = _SITES.get(fkey) or new_site(_SITES, fkey, kernel, BN_UP=bn, STAGES_UP=stages, BN_DOWN=dbn,
                                             STAGES_DOWN=dstages, G=g, USE_ASM=not INTERPRET, MX=mx,
                                             SHARED=shared_on, TRIGGER=not INTERPRET, num_warps=max(warps, dwarps))
        fused((npt * (nup + n_tiles),),
              *a1.descs, *a3.descs, *s1.descs, *s3.descs, pairs_descriptor(xp, g, True), xinv,
              a1.gs, a3.gs, s1.gs, s3.gs, x, hp, I, H // 16, lim,
              *a2.descs, *s2.descs, pairs_descriptor(hp, g, True), hinv, ids_c, wts, a2.gs, s2.gs,
              y, ws, cnt, cnt[T * n_tiles:], H, I // 16, k, npair, npt, nup, n_tiles, y.stride(0))
        return y
    pdl = schedule == "pdl" and emit and not INTERPRET   # without emit, x_pairs(h) runs between the two
    up_kernel, down_kernel = _moe_up_kernel, _moe_down_kernel  # tests replace kernels
    ukey = (id(up_kernel), mx, emit, up_tile, pdl)
    up = _SITES.get(ukey) or new_site(_SITES, ukey, up_kernel, BN=bn, G=g, STAGES=stages, USE_ASM=not INTERPRET,
                                      MX=mx, PAIRS=emit, TRIGGER=pdl, num_warps=warps)
    up((cdiv(I, bn), npt),
        *a1.descs, *a3.descs, *s1.descs, *s3.descs, pairs_descriptor(xp, g, True), xinv, ids_c,
        a1.gs, a3.gs, s1.gs, s3.gs, x if emit else h, hp if emit else h, hinv if emit else h, I, H // 16, k, npair,
        I if emit else h.stride(0), lim)   # emitting: x stands in for h (its dtype is the rounding's; nothing stored)
    if not emit:
        hp, hinv = x_pairs(h)
    dkey = (id(down_kernel), mx, shared_on, down_tile, pdl)
    down = _SITES.get(dkey) or new_site(_SITES, dkey, down_kernel, BN=dbn, G=g, STAGES=dstages,
                                        USE_ASM=not INTERPRET, MX=mx, SHARED=shared_on, TRIGGER=not INTERPRET,
                                        num_warps=dwarps, **pdl_kw(pdl))
    down((n_tiles, npt),
        *a2.descs, *s2.descs, pairs_descriptor(hp, g, True), hinv, ids_c, wts,
        a2.gs, s2.gs, y, ws, counters(x.device, T * n_tiles), H, I // 16, k, npair, y.stride(0))
    return y
