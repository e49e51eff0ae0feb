"""Decode (M == 1) FP8-block GEMV fed by TMA (Hopper and newer): y = x @ W^T for an
``FP8BlockWeight`` (e4m3 [N, K], one fp32 scale per 128 x 128 block), the official format's
attention projections.

Why: the tiled kernel of ``linear_official`` pads the token to a 16-row ``tl.dot`` and loads its
weight tiles by pointer; at decode it read the V4-Pro layer's ~300 MB of FP8 projections at ~42 %
of the copy ceiling (H100: 237 of the official layer's 434 us). Here the weight tiles [BN, 128]
come through a multi-stage TMA ring (``tl.range(num_stages=...)`` pipelines descriptor loads), each
e4m3 is widened to fp32 in registers and multiplied by x * s, x's 128 elements of the K step times
that step's block scale (one fp32 per CTA and step: BN divides 128, so a tile lies in one scale
block). fp32 products and sums, one rounding to x's dtype at the end, like the tiled kernel's fp32
accumulation (its per-block partial sums round in another order: not the same bits).

``fp8_pair_gemv``: two weights of one x (V4-Pro's wq_a and wkv) in one launch, each CTA exactly its
single launch's (``Attention.quant_pair_kernel``).

``ROWS_PER_X`` (grouped use, the block-diagonal wo_a): row block i of that many rows multiplies
activation row i (x holds the G rows back to back): the 16 groups of wo_a in one launch instead
of one launch per group. Split K finishes with the counter fix-up of ``split_k.store_or_fix_up``
(fp32 partials summed in split order: deterministic, one launch, graph-safe). With ``PDL`` the
kernel waits for the previous grid before its first load and lets the next grid launch once its
loop is done (grids of about one wave or split K, like the NVFP4 TMA GEMV).

Requirements (else the tiled kernel): sm_90+ (or the interpreter), K a multiple of 128 (whole scale
blocks per K step, and the 16-byte row stride TMA needs), a 16-byte aligned weight base pointer.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
from triton.tools.tensor_descriptor import TensorDescriptor

from .host import INTERPRET, cdiv, counters, device_capability, num_sms, scratch, weight_cached
from .launch import LaunchSite
from .pdl import PDL_ON, pdl_kw
from .split_k import store_or_fix_up

BK = 128  # K step: one FP8 scale block


@triton.jit
def _fp8_gemv_tile(w_desc, s_ptr, x_ptr, y_ptr, ws_ptr, cnt_ptr, N, K, kps, SPLIT, stride_sn, pid_n, pid_k,
                   USE_SPLIT: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, STAGES: tl.constexpr,
                   PDL: tl.constexpr, ROWS_PER_X: tl.constexpr):
    """One CTA: row tile ``pid_n`` x K split ``pid_k`` (``kps`` columns, a multiple of BK); the body
    of the single and the paired kernel, so a weight's outputs are the same bits in either."""
    n0 = pid_n * BN
    rows = n0 + tl.arange(0, BN)
    k_lo = pid_k * kps
    k_hi = tl.minimum(k_lo + kps, K)
    if ROWS_PER_X:
        x_row = x_ptr + (n0 // ROWS_PER_X) * K
    else:
        x_row = x_ptr
    s_row = s_ptr + (n0 // 128) * stride_sn
    offs_k = tl.arange(0, BK)
    acc = tl.zeros((BN, BK), dtype=tl.float32)
    for k0 in tl.range(k_lo, k_hi, BK, num_stages=STAGES):
        w8 = w_desc.load([n0, k0])                                            # [BN, BK] e4m3 bytes
        xs = tl.load(x_row + k0 + offs_k).to(tl.float32) * tl.load(s_row + k0 // BK)
        acc += w8.to(tl.float8e4nv, bitcast=True).to(tl.float32) * xs[None, :]
    if PDL:
        gdc_launch_dependents()
    store_or_fix_up(tl.sum(acc, axis=1), y_ptr + rows, ws_ptr + rows, rows < N, cnt_ptr, pid_n, pid_k, N, SPLIT,
                    1.0, USE_SPLIT)


@triton.jit
def _fp8_gemv_kernel(w_desc, s_ptr, x_ptr, y_ptr, ws_ptr, cnt_ptr, N, K, kps, SPLIT, stride_sn,
                     USE_SPLIT: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, STAGES: tl.constexpr,
                     PDL: tl.constexpr, ROWS_PER_X: tl.constexpr):
    """Grid (row tiles, K splits)."""
    if PDL:  # x is the previous kernel's output
        gdc_wait()
    _fp8_gemv_tile(w_desc, s_ptr, x_ptr, y_ptr, ws_ptr, cnt_ptr, N, K, kps, SPLIT, stride_sn, tl.program_id(0),
                   tl.program_id(1), USE_SPLIT, BN, BK, STAGES, PDL, ROWS_PER_X)


@triton.jit
def _fp8_gemv_pair_kernel(wa_desc, sa_ptr, wb_desc, sb_ptr, x_ptr, ya_ptr, yb_ptr, wsa_ptr, wsb_ptr, cnt_ptr, NA, NB,
                          K, kpsa, kpsb, SPLIT_A, SPLIT_B, TILES_A, stride_sa, stride_sb,
                          USE_SPLIT_A: tl.constexpr, USE_SPLIT_B: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                          STAGES: tl.constexpr, PDL: tl.constexpr):
    """Two weights of one x in one launch (``fp8_pair_gemv``): programs 0 .. TILES_A * SPLIT_A - 1
    are weight A's (tile, split) CTAs, the rest B's, each exactly the single kernel's CTA (B's tile
    counters after A's)."""
    if PDL:
        gdc_wait()
    pid = tl.program_id(0)
    n_a = TILES_A * SPLIT_A
    if pid < n_a:
        _fp8_gemv_tile(wa_desc, sa_ptr, x_ptr, ya_ptr, wsa_ptr, cnt_ptr, NA, K, kpsa, SPLIT_A, stride_sa,
                       pid % TILES_A, pid // TILES_A, USE_SPLIT_A, BN, BK, STAGES, PDL, 0)
    else:
        q = pid - n_a
        tiles_b = tl.cdiv(NB, BN)
        _fp8_gemv_tile(wb_desc, sb_ptr, x_ptr, yb_ptr, wsb_ptr, cnt_ptr + TILES_A, NB, K, kpsb, SPLIT_B, stride_sb,
                       q % tiles_b, q // tiles_b, USE_SPLIT_B, BN, BK, STAGES, PDL, 0)


def scales_f32(w) -> torch.Tensor:
    """The ``FP8BlockWeight``'s fp32 scales, contiguous, kept per weight: E8M0 scales are widened
    once, not by an elementwise launch on every call (an in-place edit of the scales bumps their
    ``_version``: a new widening). Shared by this GEMV's plans and ``linear_official``'s kernels."""
    return weight_cached(w.data, ("scales_f32", id(w.scale), w.scale.data_ptr(), w.scale._version),
                         lambda: w.scale_float().contiguous())


def fp8_tma_supported(x: torch.Tensor, data: torch.Tensor) -> bool:
    """Whether this GEMV can take a call on x with e4m3 weight ``data`` [N, K] (module docstring)."""
    K = data.shape[1]
    if K % BK or data.stride(0) != K or data.stride(1) != 1 or data.data_ptr() % 16:
        return False
    if INTERPRET:
        return True
    return x.is_cuda and device_capability(x.device) >= (9, 0)


def fp8_tma_config(N: int, K: int, device: torch.device, rows_per_x: int = 0) -> dict:
    """Tiles: 64 rows x 128 columns a stage (8 KB), 4 stages, 4 warps (64 fp32 accumulators a
    thread), K split until the grid covers the SMs about twice (at least 2 K steps a split).
    Measured in the official V4-Pro layer on one H100 (``benchmarks/results/decode/fp8_gemv/config_ab.sh``):
    CSA 362.5-362.7 us, HCA 340.4-341.8, against 370.8-372.4 / 349.4-350.7 for the microbench
    sweep's best single rule (5 stages, 8 warps, one wave), which wins alone by ~2 % and loses
    beside the layer's other launches. Grouped: row tiles must not straddle two groups (BN divides
    ``rows_per_x``; 0 where 32 does not)."""
    if INTERPRET:
        return {"BN": 16, "STAGES": 2, "SPLIT": 1, "num_warps": 1, "PDL": False}
    bn = 64
    if rows_per_x and rows_per_x % bn:
        bn = 32 if rows_per_x % 32 == 0 else 0
    tiles = cdiv(N, bn) if bn else 1
    sms = num_sms(device)
    split = max(1, min(cdiv(2 * sms, tiles), K // (2 * BK), 64))
    return {"BN": bn, "STAGES": 4, "SPLIT": split, "num_warps": 4, "PDL": tiles * split <= 3 * sms or split > 1}


class Fp8GemvPlan:
    """What a launch derives from the weight and the config alone (descriptor, splits, grid,
    constexprs); ``fp8_gemv`` keeps one per weight (``host.weight_cached``)."""

    __slots__ = ("N", "K", "kps", "split", "n_tiles", "grid", "wd", "s32", "site", "kw", "grouped")

    def __init__(self, data: torch.Tensor, s32: torch.Tensor, cfg: dict, rows_per_x: int = 0):
        self.N, self.K = N, K = data.shape
        bn = cfg["BN"]
        if bn <= 0 or 128 % bn or (rows_per_x and rows_per_x % bn):
            raise ValueError(f"FP8 GEMV: BN {bn} must divide the 128-row scale block"
                             + (f" and the {rows_per_x}-row groups" if rows_per_x else ""))
        self.kps = kps = cdiv(cdiv(K, cfg["SPLIT"]), BK) * BK
        self.split = split = cdiv(K, kps)
        self.n_tiles = cdiv(N, bn)
        self.grid = (self.n_tiles, split)
        self.wd = TensorDescriptor.from_tensor(data.view(torch.uint8), [bn, BK])
        self.s32 = s32
        pdl = bool(cfg.get("PDL", False)) and PDL_ON and not INTERPRET
        self.grouped = bool(rows_per_x)
        self.kw = dict(BN=bn, STAGES=cfg["STAGES"], num_warps=cfg["num_warps"], PDL=pdl)  # what a pair must share
        self.site = LaunchSite(_fp8_gemv_kernel, fixed=(0, 1, 6, 7, 8, 9, 10), USE_SPLIT=split > 1, BN=bn, BK=BK,
                               STAGES=cfg["STAGES"], ROWS_PER_X=rows_per_x, num_warps=cfg["num_warps"],
                               **pdl_kw(pdl))

    def __call__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        """y [N] (any contiguous shape of N elements) = W @ x for x's contiguous elements."""
        if self.split > 1:
            ws = scratch("fp8_gemv_split", (self.split, self.N), torch.float32, x.device)
            cnt = counters(x.device, self.n_tiles)
        else:
            ws, cnt = y, y
        self.site(self.grid, self.wd, self.s32, x, y, ws, cnt, self.N, self.K, self.kps, self.split,
                  self.s32.stride(0))


_PAIR_SITES: dict = {}  # (id(kernel), constexprs) -> LaunchSite of _fp8_gemv_pair_kernel


def fp8_pair_fits(a: Fp8GemvPlan, b: Fp8GemvPlan) -> bool:
    """Can two weights' GEMVs of one x share a launch (``fp8_pair_gemv``)? The same K, tile rows,
    stages, warps and PDL choice (their splits may differ), neither grouped: then each weight's CTAs
    are exactly its own launch's, so each output is the bits of its own call."""
    return a.K == b.K and a.kw == b.kw and not a.grouped and not b.grouped


def fp8_pair_gemv(x: torch.Tensor, wa, wb) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(x @ A^T, x @ B^T) for one token x (K contiguous elements) and two FP8-block weights in one
    launch (V4-Pro's wq_a and wkv), each the bits of ``fp8_gemv`` of its own; None where the GEMV
    does not apply or the two plans do not fit one launch (``fp8_pair_fits``)."""
    if x.numel() != wa.shape[1] or not x.is_contiguous():
        return None
    a, b = fp8_plan(x, wa), fp8_plan(x, wb)
    if a is None or b is None or not fp8_pair_fits(a, b):
        return None
    lead = x.shape[:-1]
    ya, yb = x.new_empty((*lead, a.N)), x.new_empty((*lead, b.N))
    dev = x.device
    ws = scratch("fp8_gemv_split_pair", (a.split * a.N + b.split * b.N,), torch.float32, dev)
    cnt = counters(dev, a.n_tiles + b.n_tiles)
    kernel = _fp8_gemv_pair_kernel  # looked up per call: a test's stand-in replaces the module attribute
    key = (id(kernel), tuple(sorted(a.kw.items())), a.split > 1, b.split > 1)
    site = _PAIR_SITES.get(key)
    if site is None:
        site = _PAIR_SITES[key] = LaunchSite(
            kernel, USE_SPLIT_A=a.split > 1, USE_SPLIT_B=b.split > 1, BN=a.kw["BN"], BK=BK, STAGES=a.kw["STAGES"],
            num_warps=a.kw["num_warps"], **pdl_kw(a.kw["PDL"]))
    site((a.n_tiles * a.split + b.n_tiles * b.split,), a.wd, a.s32, b.wd, b.s32, x, ya, yb, ws, ws[a.split * a.N:],
         cnt, a.N, b.N, a.K, a.kps, b.kps, a.split, b.split, a.n_tiles, a.s32.stride(0), b.s32.stride(0))
    return ya, yb


def fp8_plan(x: torch.Tensor, w, groups: int = 1, cfg: dict | None = None) -> Fp8GemvPlan | None:
    """The plan for M = 1 calls of the ``FP8BlockWeight`` w (cached per weight unless ``cfg``
    overrides the tiles), or None where this GEMV does not apply (``fp8_tma_supported``; grouped:
    rows that do not split into whole tiles per group)."""
    N, K = w.shape
    rows = N // groups if groups > 1 else 0
    if not fp8_tma_supported(x, w.data) or (groups > 1 and N % groups):
        return None

    def build() -> Fp8GemvPlan | None:
        c = {**fp8_tma_config(N, K, x.device, rows), **(cfg or {})}
        if c["BN"] <= 0:
            return None
        return Fp8GemvPlan(w.data, scales_f32(w), c, rows)

    if cfg:
        return build()
    # the plan holds the fp32 scales (``scales_f32``): an in-place edit of the scales makes a new one
    return weight_cached(w.data, ("fp8_gemv", id(w.scale), w.scale.data_ptr(), w.scale._version, groups, x.device),
                         build)


def fp8_gemv(x: torch.Tensor, w, y: torch.Tensor, groups: int = 1, cfg: dict | None = None) -> bool:
    """y = x @ W^T for one token (x: K elements, or G * K for ``groups`` = G row blocks of W, each
    times its own K elements; contiguous) into y (N elements). False where the GEMV does not
    apply (nothing written)."""
    plan = fp8_plan(x, w, groups, cfg)
    if plan is None:
        return False
    plan(x, y)
    return True


def fp8_grouped_gemv(x: torch.Tensor, w, groups: int) -> torch.Tensor | None:
    """The block-diagonal use for one token: x [..., G, K] (G * K contiguous elements) -> y
    [..., G, N/G], row block g of W times x[..., g, :], in one launch (wo_a: 16 blocks; each block
    the bits of its own GEMV at the same tiles); None for several tokens or where the GEMV does not
    apply (the caller runs the row blocks)."""
    G, K = x.shape[-2], x.shape[-1]
    if G != groups or x.numel() != G * K or not x.is_contiguous() or w.shape[1] != K or w.shape[0] % G:
        return None
    y = x.new_empty((*x.shape[:-2], G, w.shape[0] // G))
    return y if fp8_gemv(x, w, y, groups) else None


__all__ = ["BK", "Fp8GemvPlan", "scales_f32", "fp8_gemv", "fp8_grouped_gemv", "fp8_pair_fits", "fp8_pair_gemv", "fp8_plan", "fp8_tma_config", "fp8_tma_supported"]
