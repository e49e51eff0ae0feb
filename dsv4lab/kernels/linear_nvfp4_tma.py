"""Decode (M <= 16) NVFP4 GEMV fed by TMA (Hopper and newer): y = x @ W^T, W kept packed.

Why a second M=1 kernel: the pointer-load GEMV in ``nvfp4_matmul`` keeps only one weight tile in
flight per warp and reached ~57% of the copy ceiling on lm_head. Here the weight words, their e4m3
scales and the activation pairs are loaded by TMA into a multi-stage shared-memory ring
(``tl.range(num_stages=...)`` pipelines descriptor loads even without ``tl.dot``), so several
tiles are in flight per CTA and no thread spends instructions on addresses.

Two launches per call:

* ``_x_pairs_kernel`` (grid over 16-groups of K): per 16-group g a power of two xs_g with
  max|x_g| * xs_g in [2^14, 2^15); x' = x * xs_g rounded to f16 (exact for bf16 x) and packed as
  the f16x2 pairs the inner loop multiplies (pair 4h + j = elements 8h + a_j and 8h + a_j + 2,
  a = 0, 4, 1, 5: the order in which ``_H2_WORD`` decodes the even and odd nibbles), written
  with the bits of 1/xs_g as one 16-word row per group (so one TMA box brings both; ``XINV``),
  and 1/xs_g once more on its own, zero-padded (the o_b rule reads that). Per-group (not
  per-row) scaling: no global reduction, so this prelude is one short wave, and a group of tiny
  values next to a large outlier keeps its precision.
* ``_gemv_tma_kernel`` (M == 1; grid = row tiles x K splits): the f16x2 inner loop of ``nvfp4_matmul``
  (``_H2_GROUP_ASM``: four E2M1 nibbles -> E5M2-like bytes per shift and mask, two bytes -> one
  f16x2 register by ``prmt``, ``fma.rn.f16x2`` against x', the
  16-product group sum widened to fp32 once) times (block scale * 1/xs_g). Split K finishes like
  the other kernels: fp32 partials, a per-tile counter, the last split sums in split order
  (deterministic, one launch, graph-safe).

With ``PDL`` (chosen for grids of about one wave) both launch with programmatic dependent launch:
the prelude waits for the previous grid and lets the GEMV launch at once; the GEMV's CTAs become
resident while the prelude runs and wait (``griddepcontrol.wait``) before their first load, which
hides the second launch's latency (~1 us of a 20 us q_b call). Safe in CUDA graphs and next to
kernels launched without it (their launch then waits for completion as usual).

M in 2..16 (``_gemv_tma_dot_kernel``) uses the same weight ring with ``nvfp4_matmul``'s ``tl.dot``
inner loop (exact E2M1*s planes against x^T planes, batch padded to 16); no prelude.

Requirements (else ``nvfp4_matmul`` keeps the pointer-load GEMV): CUDA capability >= 9.0, K a
multiple of 256 (TMA needs 16-byte row strides for the e4m3 scales [N, K/16]) and 16-byte aligned
weight/scale base pointers. Under ``TRITON_INTERPRET=1`` the kernel runs on CPU tensors (the PTX
emulated in plain Triton), which is how CI checks it.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
from triton.tools.tensor_descriptor import TensorDescriptor

from .activation_pairs import (BOX_GROUPS, INV_PAD, pairs_and_inv, pairs_buffers, pairs_descriptor, pairs_written,
                               store_pair_rows, x_pairs)
from .host import INTERPRET, cdiv, counters, device_capability, dot_dtype, num_sms, scratch
from .launch import LaunchSite
from .pdl import PDL_ON, pdl_kw
from .rounding import round_to
from .split_k import arrive, store_or_fix_up, sum_partials
from .weight_decode import block_scales, group_dot, nibble_plane_dots, weight_global_scale

_INV_PAD = tl.constexpr(INV_PAD)  # a global a jitted function reads must be a constexpr


@triton.jit
def _tile_and_split(N, KG, gps, BN: tl.constexpr):
    """(n0, rows, row_ok, g_lo, g_hi) of this CTA: row tile program_id(0), K split program_id(1)."""
    n0 = tl.program_id(0) * BN
    rows = n0 + tl.arange(0, BN)
    g_lo = tl.program_id(1) * gps
    return n0, rows, rows < N, g_lo, tl.minimum(g_lo + gps, KG)


@triton.jit
def _gemv_tma_tile(w_desc, s_desc, x_desc, inv_ptr, gs_ptr, y_ptr, ws_ptr, cnt_ptr, N, KG, gps, SPLIT, pid_n, pid_k,
                   USE_SPLIT: tl.constexpr, BN: tl.constexpr, G: tl.constexpr, STAGES: tl.constexpr,
                   USE_ASM: tl.constexpr, PDL: tl.constexpr, MX: tl.constexpr, XINV: tl.constexpr,
                   ROWS_PER_X: tl.constexpr, EMIT: tl.constexpr, oxp_ptr, oinv_ptr, OKG, OKGP):
    """One CTA of the M = 1 GEMV: row tile ``pid_n`` x K split ``pid_k`` (the body of the single
    and the paired kernel, so a weight's outputs are the same bits in either). The kernel has
    waited on the previous grid already where ``PDL``. ``EMIT``: the tile's finishing program also
    writes y's ``x_pairs`` rows (OKG = N / 16 groups at oxp_ptr / oinv_ptr) for the GEMV after it."""
    n0 = pid_n * BN
    rows = n0 + tl.arange(0, BN)
    row_ok = rows < N
    g_lo = pid_k * gps
    g_hi = tl.minimum(g_lo + gps, KG)
    if ROWS_PER_X:
        row0 = (n0 // ROWS_PER_X) * KG
    else:
        row0 = 0
    acc = tl.zeros((BN, G), dtype=tl.float32)
    for g0 in tl.range(g_lo, g_hi, G, num_stages=STAGES):
        w64 = w_desc.load([n0, g0])                     # [BN, G] int64: 16 nibbles = one scale block
        sc = block_scales(s_desc, n0, g0, BN, G, MX)  # loads issued in the order w, s, 1/xs, x pairs
        inv, x0, x1, x2, x3, x4, x5, x6, x7 = pairs_and_inv(x_desc, inv_ptr, row0, g0, G, XINV)
        part = group_dot(w64, x0, x1, x2, x3, x4, x5, x6, x7, BN, G, USE_ASM)
        acc += part * (sc * inv)
    if PDL:  # the next launch (e.g. the next call's prelude) may start while this grid finishes
        gdc_launch_dependents()
    res = tl.sum(acc, axis=1) * 16384.0  # undo the 2^-14 of the nibble trick
    if EMIT:
        _store_emitting(res, y_ptr + rows, ws_ptr + rows, row_ok, cnt_ptr, pid_n, pid_k, N, SPLIT,
                        weight_global_scale(gs_ptr, 0, MX), USE_SPLIT, n0, oxp_ptr, oinv_ptr, OKG, OKGP, BN)
    else:
        store_or_fix_up(res, y_ptr + rows, ws_ptr + rows, row_ok, cnt_ptr, pid_n, pid_k, N, SPLIT,
                        weight_global_scale(gs_ptr, 0, MX), USE_SPLIT)


@triton.jit
def _store_emitting(acc, y_ptrs, ws_ptrs, mask, cnt_ptr, tile, pid_k, split_stride, SPLIT, scale,
                    USE_SPLIT: tl.constexpr, n0, oxp_ptr, oinv_ptr, OKG, OKGP, BN: tl.constexpr):
    """``store_or_fix_up`` that also stores the finished tile's ``x_pairs`` rows (``store_pair_rows``
    of the values as stored: the bits ``x_pairs(y)`` would write); the tile holding row N - 1 also
    zeroes 1/xs from OKG to OKGP."""
    out_ty = y_ptrs.dtype.element_ty
    done = True
    if USE_SPLIT:
        done = arrive(acc, ws_ptrs + pid_k * split_stride, mask, cnt_ptr, tile) == SPLIT - 1
    if done:
        if USE_SPLIT:
            acc = sum_partials(ws_ptrs, split_stride, SPLIT, mask, tl.zeros_like(acc))
        y = round_to(acc * scale, out_ty)
        tl.store(y_ptrs, y.to(out_ty), mask=mask)
        g = n0 // 16 + tl.arange(0, BN // 16)
        store_pair_rows(tl.reshape(tl.where(mask, y, 0.0), (BN // 16, 16)), oxp_ptr, oinv_ptr, g, OKG, OKGP, BN // 16)
        if n0 + BN >= OKG * 16:
            pad = OKG + tl.arange(0, _INV_PAD)
            tl.store(oinv_ptr + pad, tl.zeros((_INV_PAD,), dtype=tl.float32), mask=pad < OKGP)
        if USE_SPLIT:
            tl.atomic_xchg(cnt_ptr + tile, 0, sem="relaxed")  # next use is a later launch: no fence


@triton.jit
def _gemv_tma_kernel(w_desc, s_desc, x_desc, inv_ptr, gs_ptr, y_ptr, ws_ptr, cnt_ptr, N, KG, gps, SPLIT,
                     USE_SPLIT: tl.constexpr, BN: tl.constexpr, G: tl.constexpr, STAGES: tl.constexpr,
                     USE_ASM: tl.constexpr, PDL: tl.constexpr, MX: tl.constexpr, XINV: tl.constexpr,
                     ROWS_PER_X: tl.constexpr = 0):
    """``ROWS_PER_X`` (grouped use, a multiple of BN): row block i of that many rows multiplies
    activation row i (pair rows from i * KG); 0: one activation row for all."""
    if PDL:  # launched while the x-pair prelude runs; its pairs are visible after the wait
        gdc_wait()
    _gemv_tma_tile(w_desc, s_desc, x_desc, inv_ptr, gs_ptr, y_ptr, ws_ptr, cnt_ptr, N, KG, gps, SPLIT,
                   tl.program_id(0), tl.program_id(1), USE_SPLIT, BN, G, STAGES, USE_ASM, PDL, MX, XINV, ROWS_PER_X,
                   False, y_ptr, y_ptr, 0, 0)


@triton.jit
def _gemv_tma_emit_kernel(w_desc, s_desc, x_desc, inv_ptr, gs_ptr, y_ptr, ws_ptr, cnt_ptr, N, KG, gps, SPLIT,
                          oxp_ptr, oinv_ptr, OKG, OKGP,
                          USE_SPLIT: tl.constexpr, BN: tl.constexpr, G: tl.constexpr, STAGES: tl.constexpr,
                          USE_ASM: tl.constexpr, PDL: tl.constexpr, MX: tl.constexpr, XINV: tl.constexpr,
                          ROWS_PER_X: tl.constexpr = 0):
    """``_gemv_tma_kernel`` that also writes y's ``x_pairs`` (OKG groups at oxp_ptr / oinv_ptr,
    1/xs zeroed up to OKGP): the same CTAs and the same y bits (``run_gemv_tma(emit=True)``)."""
    if PDL:
        gdc_wait()
    _gemv_tma_tile(w_desc, s_desc, x_desc, inv_ptr, gs_ptr, y_ptr, ws_ptr, cnt_ptr, N, KG, gps, SPLIT,
                   tl.program_id(0), tl.program_id(1), USE_SPLIT, BN, G, STAGES, USE_ASM, PDL, MX, XINV, ROWS_PER_X,
                   True, oxp_ptr, oinv_ptr, OKG, OKGP)


@triton.jit
def _gemv_tma_pair_kernel(wa_desc, sa_desc, wb_desc, sb_desc, x_desc, inv_ptr, gsa_ptr, gsb_ptr, ya_ptr, yb_ptr,
                          wsa_ptr, wsb_ptr, cnt_ptr, NA, NB, KG, gpsa, gpsb, SPLIT_A, SPLIT_B, TILES_A,
                          USE_SPLIT_A: tl.constexpr, USE_SPLIT_B: tl.constexpr, BN: tl.constexpr, G: tl.constexpr,
                          STAGES: tl.constexpr, USE_ASM: tl.constexpr, PDL: tl.constexpr, MX: tl.constexpr,
                          XINV: tl.constexpr):
    """Two weights against one activation row in one launch (``run_gemv_tma_pair``): programs
    0 .. TILES_A * SPLIT_A - 1 are weight A's (tile, split) CTAs, the rest weight B's, each exactly
    the single kernel's CTA (B's tile counters after A's)."""
    if PDL:  # launched while the x-pair prelude runs; its pairs are visible after the wait
        gdc_wait()
    pid = tl.program_id(0)
    n_a = TILES_A * SPLIT_A
    if pid < n_a:
        _gemv_tma_tile(wa_desc, sa_desc, x_desc, inv_ptr, gsa_ptr, ya_ptr, wsa_ptr, cnt_ptr, NA, KG, gpsa, SPLIT_A,
                       pid % TILES_A, pid // TILES_A, USE_SPLIT_A, BN, G, STAGES, USE_ASM, PDL, MX, XINV, 0,
                       False, ya_ptr, ya_ptr, 0, 0)
    else:
        q = pid - n_a
        tiles_b = tl.cdiv(NB, BN)
        _gemv_tma_tile(wb_desc, sb_desc, x_desc, inv_ptr, gsb_ptr, yb_ptr, wsb_ptr, cnt_ptr + TILES_A, NB, KG, gpsb,
                       SPLIT_B, q % tiles_b, q // tiles_b, USE_SPLIT_B, BN, G, STAGES, USE_ASM, PDL, MX, XINV, 0,
                       False, yb_ptr, yb_ptr, 0, 0)


@triton.jit
def _gemv_tma_dot_kernel(w_desc, s_desc, x_ptr, gs_ptr, y_ptr, ws_ptr, cnt_ptr, M, N, KG, stride_xm, stride_ym,
                         gps, SPLIT, USE_SPLIT: tl.constexpr, BN: tl.constexpr, G: tl.constexpr,
                         BMP: tl.constexpr, STAGES: tl.constexpr, DOT_DTYPE: tl.constexpr, MX: tl.constexpr):
    """M in 2..16: the same TMA-fed weight ring; per nibble plane the exact E2M1*s tile (bf16/f16)
    goes through ``tl.dot`` against the matching x^T plane (batch padded to BMP = 16)."""
    n0, rows, row_ok, g_lo, g_hi = _tile_and_split(N, KG, gps, BN)
    offs_m = tl.arange(0, BMP)
    m_ok = offs_m < M
    acc = tl.zeros((BN, BMP), dtype=tl.float32)
    for g0 in tl.range(g_lo, g_hi, G, num_stages=STAGES):
        w64 = w_desc.load([n0, g0])
        sc = block_scales(s_desc, n0, g0, BN, G, MX) * 16384.0
        gg = g0 + tl.arange(0, G)
        xt = x_ptr + offs_m[None, :] * stride_xm + gg[:, None] * 16   # x^T planes [G, BMP]
        acc = nibble_plane_dots(w64, sc, xt, (gg < KG)[:, None] & m_ok[None, :], acc, DOT_DTYPE)
    store_or_fix_up(acc, y_ptr + offs_m[None, :] * stride_ym + rows[:, None], ws_ptr + offs_m[None, :] * N + rows[:, None],
                     row_ok[:, None] & m_ok[None, :], cnt_ptr, tl.program_id(0), tl.program_id(1), M * N, SPLIT,
                     weight_global_scale(gs_ptr, 0, MX), USE_SPLIT)


# ----------------------------------------------------------------------------- host side
def tma_supported(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor) -> bool:
    """Whether the TMA GEMV can take this call (see the module docstring)."""
    K = packed.shape[1] * 2
    if K % 256 or packed.data_ptr() % 16 or scale.data_ptr() % 16:
        return False
    if INTERPRET:
        return True
    return x.is_cuda and device_capability(x.device) >= (9, 0)


def _split_for(N: int, K: int, bn: int, mult: int, sms: int) -> int:
    tiles = cdiv(N, bn)
    return max(1, min(cdiv(mult * sms, tiles), max(1, (K // 16) // BOX_GROUPS), 64))


def tma_default_config(N: int, K: int, device: torch.device, M: int = 1) -> dict:
    """The tile choice, from the H200 sweeps (``benchmarks/m1_sweep.py``, docs/kernels.md): 256-row
    tiles without split when they cover the SMs (lm_head, q_b), split K over ~2 waves for few long
    rows (o_b), 64-row tiles split over ~2 waves for the small expert/projection shapes.

    Not tuned at run time: ``do_bench`` on eager calls times the host launch path (descriptor
    set-up, two launches), not the kernel, and picked tiles up to 1.4x slower than these. Wider
    TMA boxes (cfg ``G`` = 32/64 groups) or 16/32-row tiles measured slower on q_b and o_b."""
    if INTERPRET:
        return {"TMA": True, "BN": 16, "STAGES": 2, "SPLIT": 1, "num_warps": 1}
    sms = num_sms(device)
    if M > 1:  # the tl.dot loop: 128-row tiles when they cover the SMs, else split K over ~4 waves
        if cdiv(N, 128) >= sms:
            bn, mult = 128, 1
        else:
            bn, mult = (128 if N >= 4096 else 64), 4
        return {"TMA": True, "BN": bn, "STAGES": 3, "SPLIT": _split_for(N, K, bn, mult, sms), "num_warps": 4}
    xinv = True  # 1/xs in the pair rows (``pairs_and_inv``)
    if cdiv(N, 256) >= sms:  # 4 stages (1 CTA/SM) for long rows: lm_head 145 us vs 208 us with 3
        bn, mult, stages = 256, 1, (4 if K >= 4096 else 3)
    elif K >= 8192:  # o_b: 128-row tiles, 3 stages (3 CTAs/SM), split ~10: 24.0-24.4 us vs 25.5-25.9
        bn, mult, stages = 128, 4, 3   # for 256 rows / 4 stages in three runs (h200_run8_sweeps.txt);
        xinv = False                   # 1/xs by pointer: 23.5 us vs 25.1 with it in the pair rows
    else:
        bn, mult, stages = 64, 2, 3
    split = _split_for(N, K, bn, mult, sms)
    # programmatic dependent launch of prelude -> GEMV pays off for grids of short CTAs (about one
    # wave or split K: q_b 21.6 -> 20.6 us, o_b 27.1 -> 25.9, experts 9.9 -> 9.4); lm_head's
    # multi-wave grid of long CTAs lost 145 -> 163 us with it, so it stays off there
    pdl = cdiv(N, bn) * split <= 3 * sms or split > 1  # (the TMA path already implies sm_90+)
    return {"TMA": True, "BN": bn, "STAGES": stages, "SPLIT": split, "num_warps": 4, "PDL": pdl, "XINV": xinv}


class GemvTmaPlan:
    """What a TMA GEMV launch derives from the weight, the config and the activation dtype alone:
    descriptors over the weight words and scales, the split arithmetic, the grid and the kernel's
    constexpr arguments. ``nvfp4_matmul`` keeps one per weight (``host.weight_cached``), so a decode
    call only allocates and launches."""

    __slots__ = ("N", "KG", "gps", "split", "n_tiles", "grid", "wd", "sd", "g", "m1", "pdl", "xinv", "kw", "site",
                 "emit_site")

    def __init__(self, packed: torch.Tensor, scale: torch.Tensor, cfg: dict, m1: bool, x_dtype: torch.dtype,
                 groups: int = 1):
        self.N = N = packed.shape[0]
        self.KG = KG = packed.shape[1] // 8              # packed [N, K/2] bytes: K/16 groups
        bn, g = cfg["BN"], cfg.get("G", BOX_GROUPS)      # g: 16-groups per TMA box along K
        self.gps = gps = cdiv(cdiv(KG, cfg["SPLIT"]), g) * g   # whole boxes per split: no box straddles two
        self.split = split = cdiv(KG, gps)
        self.n_tiles = cdiv(N, bn)
        self.grid = (self.n_tiles, split)
        self.g, self.m1 = g, m1
        mx = bool(cfg.get("MX", False))   # MXFP4: the scales hold one E8M0 per two groups, gs is 1
        self.wd = TensorDescriptor.from_tensor(packed.view(torch.int64), [bn, g])
        self.sd = TensorDescriptor.from_tensor(scale.view(torch.uint8), [bn, g // 2 if mx else g])
        self.pdl = bool(cfg.get("PDL", False)) and not INTERPRET and PDL_ON   # DSV4LAB_PDL=0: none
        self.xinv = bool(cfg.get("XINV", True))
        if m1:
            self.kw = dict(USE_SPLIT=split > 1, BN=bn, G=g, STAGES=cfg["STAGES"], USE_ASM=not INTERPRET,
                           MX=mx, XINV=self.xinv, ROWS_PER_X=N // groups if groups > 1 else 0,
                           num_warps=cfg["num_warps"], **pdl_kw(self.pdl))
            # the descriptors and ints the plan passes on every call (``run_gemv_tma``): keyed by identity;
            # the x-pairs descriptor too (2): over the kept ``x_pairs`` buffer it is one object per size
            self.site = LaunchSite(_gemv_tma_kernel, fixed=(0, 1, 2, 8, 9, 10, 11), **self.kw)
            self.emit_site = None  # the EMIT variant, made on its first use (``run_gemv_tma(emit=True)``)
        else:
            self.kw = dict(USE_SPLIT=split > 1, BN=bn, G=g, BMP=16, STAGES=cfg["STAGES"],
                           DOT_DTYPE=dot_dtype(x_dtype),
                           MX=mx, num_warps=cfg["num_warps"])
            self.site = LaunchSite(_gemv_tma_dot_kernel, fixed=(0, 1, 8, 9, 12, 13), **self.kw)


def emits_pairs(plan: GemvTmaPlan, y: torch.Tensor) -> bool:
    """Can this M = 1 launch also write y's ``x_pairs`` (``run_gemv_tma(emit=True)``)? y one row of
    16-groups, and of another size than x's pairs (the launch reads those while it writes)."""
    return plan.m1 and plan.N % 16 == 0 and plan.N // 16 != plan.KG and y.is_contiguous() and y.numel() == plan.N


def run_gemv_tma(plan: GemvTmaPlan, x2: torch.Tensor, gs: torch.Tensor, y: torch.Tensor,
                 pairs: tuple[torch.Tensor, torch.Tensor] | None = None, emit: bool = False) -> None:
    """The launches of ``launch_gemv_tma`` for a ``plan`` made for this weight and x2's dtype (x2
    [M, K] contiguous rows, M == 1 iff ``plan.m1``, where any contiguous shape of one row will do;
    grouped: x2 already [1, groups * K] or any contiguous shape of those elements). ``emit``
    (``emits_pairs``): the launch also writes y's pairs into the kept buffers and records them
    (``pairs_written``), so a quantised GEMV reading y next launches no ``x_pairs`` (wo_a -> wo_b)."""
    M = 1 if plan.m1 else x2.shape[0]
    if plan.split > 1:
        ws = scratch("gemv_split", (plan.split, M, plan.N), torch.float32, x2.device)
        cnt = counters(x2.device, plan.n_tiles)
    else:
        ws, cnt = y, y
    if plan.m1 and emit:
        xp, inv = x_pairs(x2, plan.pdl) if pairs is None else pairs
        okg = plan.N // 16
        oxp, oinv = pairs_buffers(okg, y.device)
        if plan.emit_site is None:
            plan.emit_site = LaunchSite(_gemv_tma_emit_kernel, fixed=(0, 1, 2, 8, 9, 10, 11), **plan.kw)
        plan.emit_site(plan.grid, plan.wd, plan.sd, pairs_descriptor(xp, plan.g, plan.xinv), inv, gs, y, ws, cnt,
                       plan.N, plan.KG, plan.gps, plan.split, oxp, oinv, okg, oinv.numel())
        pairs_written(okg, y.device, y)
    elif plan.m1:
        xp, inv = x_pairs(x2, plan.pdl) if pairs is None else pairs
        plan.site(plan.grid, plan.wd, plan.sd, pairs_descriptor(xp, plan.g, plan.xinv), inv, gs, y, ws, cnt,
                  plan.N, plan.KG, plan.gps, plan.split)
    else:
        plan.site(plan.grid, plan.wd, plan.sd, x2, gs, y, ws, cnt, M, plan.N, plan.KG, x2.stride(0), y.stride(0),
                  plan.gps, plan.split)


def pair_fits(a: GemvTmaPlan, b: GemvTmaPlan) -> bool:
    """Can two weights' M = 1 GEMVs share one launch (``run_gemv_tma_pair``)? The same K, box, tile
    rows, stages, warps, format, 1/xs placement and PDL choice (their splits may differ), neither
    grouped: then each weight's CTAs are exactly its own launch's."""
    if not (a.m1 and b.m1) or a.KG != b.KG or a.g != b.g or a.xinv != b.xinv or a.pdl != b.pdl:
        return False
    ka, kb = a.kw, b.kw
    return all(ka[k] == kb[k] for k in ("BN", "STAGES", "num_warps", "MX")) and not ka["ROWS_PER_X"] \
        and not kb["ROWS_PER_X"]


_PAIR_SITES: dict = {}  # (id(kernel), constexprs) -> LaunchSite of _gemv_tma_pair_kernel


def run_gemv_tma_pair(a: GemvTmaPlan, b: GemvTmaPlan, x: torch.Tensor, gsa: torch.Tensor, gsb: torch.Tensor,
                      ya: torch.Tensor, yb: torch.Tensor) -> None:
    """ya = x @ A^T and yb = x @ B^T for one activation row x in one launch (``pair_fits``): one
    x_pairs prelude (or the pairs an RMSNorm launch emitted), the same bits as ``run_gemv_tma`` of
    each. Split partials: one scratch, A's then B's; tile counters: A's then B's."""
    dev = x.device
    ws = scratch("gemv_split_pair", (a.split * a.N + b.split * b.N,), torch.float32, dev)
    cnt = counters(dev, a.n_tiles + b.n_tiles)
    xp, inv = x_pairs(x, a.pdl)
    kernel = _gemv_tma_pair_kernel  # looked up per call: a test's stand-in replaces the module attribute
    key = (id(kernel), a.kw["BN"], a.g, a.kw["STAGES"], a.kw["MX"], a.xinv, a.kw["num_warps"], a.pdl, a.split > 1,
           b.split > 1)
    site = _PAIR_SITES.get(key)
    if site is None:
        site = _PAIR_SITES[key] = LaunchSite(
            kernel, USE_SPLIT_A=a.split > 1, USE_SPLIT_B=b.split > 1, BN=a.kw["BN"], G=a.g,
            STAGES=a.kw["STAGES"], USE_ASM=not INTERPRET, MX=a.kw["MX"], XINV=a.xinv, num_warps=a.kw["num_warps"],
            **pdl_kw(a.pdl))
    site((a.n_tiles * a.split + b.n_tiles * b.split,), a.wd, a.sd, b.wd, b.sd, pairs_descriptor(xp, a.g, a.xinv), inv,
         gsa, gsb, ya, yb, ws, ws[a.split * a.N:], cnt, a.N, b.N, a.KG, a.gps, b.gps, a.split, b.split, a.n_tiles)


def launch_gemv_tma(x2: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, gs: torch.Tensor,
                    y: torch.Tensor, cfg: dict, pairs: tuple[torch.Tensor, torch.Tensor] | None = None,
                    groups: int = 1) -> None:
    """y[M, N] = x2[M, K] @ W^T for M <= 16 with ``cfg`` = {BN, STAGES, SPLIT, num_warps, optional G
    (groups per box, default 16) and PDL} (``tma_default_config``): M == 1 the f16x2 loop, M in 2..16
    the ``tl.dot`` loop. ``pairs``: precomputed ``x_pairs(x2[0])`` (benchmarks time the GEMV alone).

    ``groups`` > 1: the block-diagonal (grouped) use of one token, x2 [groups, K] and y [N]: row
    block i of N / groups rows (a multiple of BN) times x2[i], in the same two launches (one
    prelude over all groups' pairs, one GEMV whose tiles pick their activation row).

    Builds a ``GemvTmaPlan`` per call; ``nvfp4_matmul`` caches it per weight instead."""
    M, K = x2.shape
    N = packed.shape[0]
    if groups > 1:
        if M != groups or N % groups or (N // groups) % cfg["BN"]:
            raise ValueError(f"grouped GEMV: x2 must be [groups={groups}, K] and the {N} rows split into "
                             f"blocks that are multiples of BN={cfg['BN']}; got x2 {tuple(x2.shape)}")
        x2, M = x2.reshape(1, groups * K), 1
    run_gemv_tma(GemvTmaPlan(packed, scale, cfg, M == 1, x2.dtype, groups), x2, gs, y, pairs)
