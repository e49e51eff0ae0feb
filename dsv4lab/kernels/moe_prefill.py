"""Routed-experts prefill as grouped GEMMs: tokens sorted by expert, two GEMM launches, one unpermute.

For T tokens with top-k ``ids`` / ``weights`` over E experts (stacks ``StackedNVFP4`` or
``StackedMXFP4``), without a host sync (the schedule is built on the device; the grid is an upper
bound and surplus programs return at once, so it is CUDA-graph safe):

1. ``expert_schedule``: the T*k (token, slot) rows sorted by expert (stable ``argsort``), per-expert
   counts (a scatter-add), and a list of BM-row tiles, each inside one expert's rows.
2. up (``_grouped_kernel`` with ``DUAL``): per (tile, BN columns of I) the x rows of the tile's
   tokens (gathered by index) times the expert's w1 and w3 tiles (dequantised in registers,
   ``weight_decode.dequant_tile``), two fp32 accumulators; the epilogue rounds gate and up to x.dtype (what
   the reference's linears return), applies ``clamped_swiglu`` (clamp BEFORE SiLU) with the
   reference's roundings and, with ``weight_before_w2``, the routing weight: h [T*k, I] in x.dtype.
3. down: the same kernel over h rows (no gather) and w2: y [T*k, H] in x.dtype.
4. ``_unpermute_kernel``: out[t] = sum over slots j = 0..k-1, in that order, of y at (t, j)'s
   sorted row (times the routing weight rounded like the reference unless ``weight_before_w2``),
   fp32 sum, one rounding. Deterministic: no atomics anywhere.

The GEMM tiles are the SWAP orientation of ``linear_gemm`` (expert rows on the MMA's M side, a
tile's tokens on its N side): 4096 tokens with top-6 of 384 experts is 64 rows per expert on
average, so BM = 64.

Where the experts average >= ``DENSE_MIN_M`` rows (few experts, or long chunks), the GEMMs are
compute-bound and ``moe_prefill_dense`` runs instead: per hit expert its weights dequantised into
one bounded scratch (``dequant_gemm``) and cuBLAS, the reference's SwiGLU in one launch
(``_swiglu_kernel``), then the same unpermute.
It reads the per-expert counts on the host (one sync a layer), so a CUDA-graph capture keeps the
grouped kernels.
"""
from __future__ import annotations

import warnings

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from ..quant.stacked import StackedMXFP4, StackedNVFP4
from .dequant_gemm import DENSE_MIN_M, dense_supported, dequantize_rows
from .device import copy_to_host, on_input_device, wait_for_host
from .host import INTERPRET, cdiv, device_capability, dot_dtype
from .linear_gemm import block_k
from .rounding import round_to
from .weight_decode import FMT_NVFP4, dequant_tile

try:  # Gluon (triton >= 3.5): the async-wgmma grouped GEMMs, sm_90
    from .linear_gemm_wgmma import fragment_order
    from .moe_prefill_wgmma import grouped_wgmma, grouped_wgmma_supported
except ImportError:  # a triton without Gluon: the Triton grouped kernel takes every call
    grouped_wgmma = grouped_wgmma_supported = fragment_order = None


@triton.jit
def _grouped_kernel(x_ptr, src_ptr, tile_e_ptr, tile_r0_ptr, tile_r1_ptr, w_ptr, s_ptr, gs_ptr, w3_ptr, s3_ptr,
                    gs3_ptr, rw_ptr, y_ptr, N, K, stride_xm, stride_wn, stride_sn, stride_ym, limit,
                    FMT: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                    STAGES: tl.constexpr, DOT_DTYPE: tl.constexpr, GATHER: tl.constexpr, DUAL: tl.constexpr,
                    CLAMP: tl.constexpr, WEIGHT: tl.constexpr):
    """One (row tile, column tile): y[rows, cols] = x[src[rows]] @ W_e[cols]^T (DUAL: clamped
    SwiGLU of the w1 and w3 products, times the routing weight with WEIGHT). Weights as 2-D
    [E * N, ...] views; expert e's rows start at e * N."""
    tile = tl.program_id(0)
    e = tl.load(tile_e_ptr + tile)
    if e >= 0:
        r0 = tl.load(tile_r0_ptr + tile)
        r1 = tl.load(tile_r1_ptr + tile)
        offs_r = r0 + tl.arange(0, BM)
        r_ok = offs_r < r1
        rr = tl.minimum(offs_r, r1 - 1)  # rows past the tile's end re-read its last row (not stored)
        if GATHER:
            src = tl.load(src_ptr + rr)
        else:
            src = rr
        x_rows = x_ptr + src.to(tl.int64)[:, None] * stride_xm
        offs_n = tl.program_id(1) * BN + tl.arange(0, BN)
        n_ok = offs_n < N
        w_rows = e.to(tl.int64) * N + tl.minimum(offs_n, N - 1)
        offs_k = tl.arange(0, BK)
        acc = tl.zeros((BN, BM), dtype=tl.float32)
        acc3 = tl.zeros((BN, BM), dtype=tl.float32)
        for k0 in tl.range(0, K, BK, num_stages=STAGES):
            xt = tl.trans(tl.load(x_rows + (k0 + offs_k)[None, :]).to(DOT_DTYPE))
            w = dequant_tile(w_ptr, s_ptr, w_rows, n_ok, k0, stride_wn, stride_sn, BN, BK, FMT, DOT_DTYPE)
            acc = tl.dot(w, xt, acc)
            if DUAL:
                w3 = dequant_tile(w3_ptr, s3_ptr, w_rows, n_ok, k0, stride_wn, stride_sn, BN, BK, FMT, DOT_DTYPE)
                acc3 = tl.dot(w3, xt, acc3)
        out_ty = y_ptr.dtype.element_ty
        if FMT == FMT_NVFP4:
            acc = acc * tl.load(gs_ptr + e)
        h = round_to(acc, out_ty)
        if DUAL:
            if FMT == FMT_NVFP4:
                acc3 = acc3 * tl.load(gs3_ptr + e)
            up = round_to(acc3, out_ty)
            if CLAMP:
                h = tl.minimum(h, limit)
                up = tl.minimum(tl.maximum(up, -limit), limit)
            h = round_to(round_to(h / (1.0 + tl.exp(-h)), out_ty) * up, out_ty)
            if WEIGHT:
                h = round_to(h * round_to(tl.load(rw_ptr + rr), out_ty)[None, :], out_ty)
        tl.store(y_ptr + offs_r[None, :].to(tl.int64) * stride_ym + offs_n[:, None], h.to(out_ty),
                 mask=n_ok[:, None] & r_ok[None, :])


@triton.jit
def _unpermute_kernel(y_ptr, pos_ptr, rw_ptr, out_ptr, H, KTOP: tl.constexpr, BH: tl.constexpr,
                      WEIGHT: tl.constexpr):
    """out[t, cols] = sum_j (y[pos[t, j], cols] (* rw[t, j] rounded to y's dtype)) in slot order."""
    t = tl.program_id(0)
    offs = tl.program_id(1) * BH + tl.arange(0, BH)
    ok = offs < H
    acc = tl.zeros((BH,), dtype=tl.float32)
    out_ty = out_ptr.dtype.element_ty
    for j in tl.static_range(KTOP):
        r = tl.load(pos_ptr + t * KTOP + j).to(tl.int64)
        v = tl.load(y_ptr + r * H + offs, mask=ok, other=0.0).to(tl.float32)
        if WEIGHT:
            v = round_to(v * round_to(tl.load(rw_ptr + t * KTOP + j), out_ty), out_ty)
        acc += v
    tl.store(out_ptr + t * H + offs, acc.to(out_ty), mask=ok)


@triton.jit
def _swiglu_kernel(g_ptr, u_ptr, rw_ptr, h_ptr, n, I, limit, CLAMP: tl.constexpr, WEIGHT: tl.constexpr,
                   PRECISE: tl.constexpr, BLOCK: tl.constexpr):
    """h = clamped_swiglu(g, u) (* routing weight per row), one pass, with the reference's
    roundings: silu in fp32 by libdevice's expf and IEEE division (what torch's CUDA silu runs),
    rounded to h's dtype, times up, rounded; the weight cast to h's dtype, the product rounded."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n
    g = tl.load(g_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    if CLAMP:
        g = tl.minimum(g, limit)
        u = tl.minimum(tl.maximum(u, -limit), limit)
    out_ty = h_ptr.dtype.element_ty
    if PRECISE:
        s = libdevice.div_rn(g, 1.0 + libdevice.exp(-g))
    else:  # the interpreter has no libdevice
        s = g / (1.0 + tl.exp(-g))
    h = round_to(round_to(s, out_ty) * u, out_ty)
    if WEIGHT:
        h = round_to(h * round_to(tl.load(rw_ptr + offs // I, mask=ok, other=0.0), out_ty), out_ty)
    tl.store(h_ptr + offs, h.to(out_ty), mask=ok)


# ----------------------------------------------------------------------------- host side
def expert_schedule(ids: torch.Tensor, n_experts: int, bm: int | None) -> dict:
    """Device-side schedule for ``ids`` [T, k]: ``src`` (token of each sorted row, int32 [T*k]),
    ``order`` (flat (t, j) index of each sorted row), ``pos`` ((t, j) -> its sorted row, int32 [T*k]) and per tile of at most ``bm`` rows of one
    expert: ``tile_e`` (expert, -1 for surplus tiles), ``tile_r0`` / ``tile_r1`` (its first row,
    its expert's end row). The tile count is the host-side bound cdiv(T*k, bm) + min(E, T*k).
    ``bm`` None: no tiles (callers that tile otherwise, or not at all)."""
    T, k = ids.shape
    R = T * k
    flat = ids.reshape(-1).long()
    order = torch.argsort(flat, stable=True)
    # not bincount: on CUDA it reads the maximum id back to the host, which a CUDA graph capture forbids
    counts = torch.zeros(n_experts, dtype=torch.long, device=ids.device).scatter_add_(0, flat, torch.ones_like(flat))
    pos = torch.empty(R, dtype=torch.int32, device=ids.device)
    pos[order] = torch.arange(R, dtype=torch.int32, device=ids.device)
    sched = {"src": (order // k).to(torch.int32), "order": order, "pos": pos, "counts": counts}
    if bm is not None:
        sched.update(expert_tiles(counts, bm, (counts + bm - 1) // bm, cdiv(R, bm) + min(n_experts, R)))
    return sched


def expert_tiles(counts: torch.Tensor, bm: int, ntiles: torch.Tensor, bound: int) -> dict:
    """Tiles of ``bm`` rows over the sorted rows: ``ntiles[e]`` from expert e's first row (its
    ``counts[e]`` rows), ``bound`` tiles in all (host-side: the surplus ones get expert -1)."""
    E = counts.numel()
    ends = torch.cumsum(counts, 0)
    starts = ends - counts
    tcum = torch.cumsum(ntiles, 0)
    t = torch.arange(bound, device=counts.device)
    e = torch.searchsorted(tcum, t, right=True)
    valid = e < E
    ec = e.clamp(max=E - 1)
    r0 = starts[ec] + (t - (tcum[ec] - ntiles[ec])) * bm
    return {"tiles": bound, "tile_e": torch.where(valid, ec, -1).to(torch.int32), "tile_r0": r0.to(torch.int32),
            "tile_r1": ends[ec].to(torch.int32)}


def mixed_tiles(sched: dict, small: int = 64, big: int = 128) -> list[tuple[int, dict]]:
    """Two tile lists over ``sched``'s sorted rows: one ``small``-row tile for each expert with
    1..``small`` rows, ``big``-row tiles for the others. Each expert's weights are then decoded
    once (as with ``big`` alone) without multiplying a mostly empty tile (as with ``big`` for
    the experts a ``small`` tile holds). Host-side bounds: min(E, R) and cdiv(R, big) + min(E,
    R // (small + 1))."""
    counts = sched["counts"]
    E, R = counts.numel(), sched["src"].numel()
    few = (counts > 0) & (counts <= small)
    many = torch.where(counts > small, (counts + big - 1) // big, 0)
    return [(small, expert_tiles(counts, small, few.long(), min(E, R))),
            (big, expert_tiles(counts, big, many, cdiv(R, big) + min(E, R // (small + 1))))]


def prefill_tiles(N: int, K: int, rows_per_expert: float = 0.0) -> dict:
    """Fixed tiles of the grouped GEMMs (H200): 64 token rows x 128 weight rows, the largest BK of
    128 / 64 / 32 dividing K, 3 stages, 8 warps (V4-Pro's 384 experts average 64 rows at 4096
    tokens); where the experts average >= 128 rows, 128 token rows x 64 weight rows, BK 64, 4 warps
    (4096 tokens top-6 over 8 experts: 18.2 -> 12.6 ms with 128 x 128 tiles, then up 8.0 -> 7.3 ms
    and down 4.4 -> 4.2 ms: ``gemm.py --moe-phases``). Interpreter: 4 warps, 2 stages."""
    if INTERPRET:
        return {"BM": 64, "BN": 32, "BK": min(block_k(K), 64), "STAGES": 2, "num_warps": 4}
    if rows_per_expert >= 128:
        return {"BM": 128, "BN": 64, "BK": min(block_k(K), 64), "STAGES": 3, "num_warps": 4}
    return {"BM": 64, "BN": 128, "BK": block_k(K), "STAGES": 3, "num_warps": 8}


def _stack_views(w) -> tuple[str, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(format, 2-D [E*N, K/2] codes, 2-D scales as bytes, per-expert global scales or None)."""
    E, N, _ = w.shape
    if isinstance(w, StackedNVFP4):
        return ("nvfp4", w.packed.reshape(E * N, -1), w.block_scale.view(torch.uint8).reshape(E * N, -1),
                w.global_scale.reshape(E).float().contiguous())
    return "mxfp4", w.packed.reshape(E * N, -1), w.scale.view(torch.uint8).reshape(E * N, -1), None


def grouped_gemm(x: torch.Tensor, sched: dict, gather: bool, w, w3=None, limit: float | None = None,
                 rw: torch.Tensor | None = None, cfg: dict | None = None) -> torch.Tensor:
    """One grouped launch: [R, N] rows in sorted order (see ``_grouped_kernel``)."""
    E, N, K = w.shape
    fmt, p, s, gs = _stack_views(w)
    c = {**prefill_tiles(N, K), **(cfg or {})}
    R = sched["src"].numel()
    y = torch.empty((R, N), dtype=x.dtype, device=x.device)
    if R == 0:
        return y
    if w3 is not None:
        _, p3, s3, gs3 = _stack_views(w3)
    else:
        p3, s3, gs3 = p, s, gs
    clamp = limit is not None and limit > 0
    grid = (sched["tiles"], cdiv(N, c["BN"]))
    _grouped_kernel[grid](x, sched["src"], sched["tile_e"], sched["tile_r0"], sched["tile_r1"], p, s,
                          gs if gs is not None else s, p3, s3, gs3 if gs3 is not None else s,
                          rw if rw is not None else x, y, N, K, x.stride(0), p.stride(0), s.stride(0), y.stride(0),
                          float(limit) if clamp else 0.0,
                          FMT=0 if fmt == "nvfp4" else 1, BM=c["BM"], BN=c["BN"], BK=c["BK"], STAGES=c["STAGES"],
                          DOT_DTYPE=dot_dtype(x), GATHER=gather, DUAL=w3 is not None, CLAMP=clamp,
                          WEIGHT=rw is not None, num_warps=c["num_warps"])
    return y


def moe_prefill_supported(x: torch.Tensor, w1, w3, w2) -> bool:
    """Same-format NVFP4 / MXFP4 stacks with H and I multiples of 32, contiguous, on sm_90+ (the
    tiles were chosen for Hopper) or under the interpreter."""
    if len({type(w) for w in (w1, w3, w2)}) != 1 or not isinstance(w1, (StackedNVFP4, StackedMXFP4)):
        return False
    E, I, H = w1.shape
    if w3.shape != (E, I, H) or w2.shape != (E, H, I) or not (block_k(H) and block_k(I)):
        return False
    scales = [w.block_scale if isinstance(w, StackedNVFP4) else w.scale for w in (w1, w3, w2)]
    if not all(t.is_contiguous() for t in [w.packed for w in (w1, w3, w2)] + scales):
        return False
    return INTERPRET or (x.is_cuda and device_capability(x.device) >= (9, 0))


@on_input_device
def moe_prefill_triton(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w1, w3, w2,
                       limit: float | None, weight_before_w2: bool = False, cfg: dict | None = None) -> torch.Tensor:
    """Routed-expert output [T, H] in x.dtype for x [T, H], ``ids`` / ``weights`` [T, k]; stacks
    of one format (``moe_prefill_supported``). ``weight_before_w2``: the routing weight multiplies
    the SwiGLU output (DeepSeek's order), else each expert's output. ``cfg`` overrides the tiles of
    both GEMMs, its ``up`` / ``down`` entries those of one (``BM`` only for both: the schedule's);
    ``DENSE`` forces or refuses ``moe_prefill_dense`` (by default it runs where ``dense_moe_fits``);
    ``WGMMA`` forces or refuses the Gluon grouped GEMMs (``moe_prefill_wgmma``: by default on sm_90
    where ``grouped_wgmma_supported``; ``BM`` may come with it: 64, 128 or "mixed", ``mixed_tiles``;
    ``FRAG`` True: A decoded into registers, fragment order; ``WGMMA_DEFAULT`` when not given)."""
    if x.dim() != 2 or ids.shape != weights.shape or ids.shape[0] != x.shape[0]:
        raise ValueError(f"x must be [T, H] and ids / weights [T, k] with the same T; got x {tuple(x.shape)}, "
                         f"ids {tuple(ids.shape)}, weights {tuple(weights.shape)}")
    T, k = ids.shape
    E, I, H = w1.shape
    cfg = dict(cfg or {})
    dense = cfg.pop("DENSE", None)
    if dense or (dense is None and not cfg and dense_moe_fits(x, T * k / E, H, I)):
        return moe_prefill_dense(x, ids, weights, w1, w3, w2, limit, weight_before_w2)
    out = torch.empty((T, H), dtype=x.dtype, device=x.device)
    if T == 0:
        return out
    x = x.contiguous()
    rw = weights.reshape(-1).float().contiguous()
    rows = T * k / E
    wgmma = cfg.pop("WGMMA", None)
    if wgmma or (wgmma is None and not cfg and _wgmma_ok[0] and grouped_wgmma_supported is not None
                 and grouped_wgmma_supported(x, w1, w3, w2)):
        try:
            return _moe_prefill_wgmma(x, ids, rw, w1, w3, w2, limit, weight_before_w2,
                                      cfg.get("BM", WGMMA_DEFAULT["BM"]), out, cfg.get("FRAG", WGMMA_DEFAULT["FRAG"]))
        except Exception as e:  # noqa: BLE001 - a triton whose Gluon this kernel does not compile on
            if wgmma:  # forced: errors surface
                raise
            _wgmma_ok[0] = False
            warnings.warn(f"the Gluon grouped GEMMs (moe_prefill_wgmma) failed here ({type(e).__name__}: {e}); "
                          "the Triton grouped kernel takes these calls from now on")
    if cfg.get("BM") == "mixed":  # the Gluon GEMMs' two tile heights: this kernel keeps its rule
        cfg.pop("BM")
    up, down = cfg.pop("up", {}), cfg.pop("down", {})  # per-GEMM overrides (the tile sweep)
    bm = {**prefill_tiles(I, H, rows), **cfg}["BM"]
    cfg["BM"] = bm  # both grouped GEMMs walk the schedule's tiles
    sched = expert_schedule(ids, E, bm)
    rw_sorted = rw[sched["order"]] if weight_before_w2 else None
    h = grouped_gemm(x, sched, True, w1, w3, limit, rw_sorted, {**prefill_tiles(I, H, rows), **cfg, **up})
    y = grouped_gemm(h, sched, False, w2, cfg={**prefill_tiles(H, I, rows), **cfg, **down})
    return unpermute(y, sched["pos"], rw, out, k, weight=not weight_before_w2)


# The Gluon grouped GEMMs' default: mixed 64 / 128-row tiles, A decoded into registers. H100, 4096
# tokens top-6 of 384 V4-Pro experts (benchmarks/results/kernels/moe_wgmma/h100_variants_*):
# NVFP4 15.8 -> 14.4 ms, MXFP4 15.6 -> 13.9 ms against 128-row tiles through shared memory.
WGMMA_DEFAULT = {"BM": "mixed", "FRAG": True}
_wgmma_ok = [True]  # False once the Gluon grouped GEMMs failed to compile or launch in this process


def _moe_prefill_wgmma(x: torch.Tensor, ids: torch.Tensor, rw: torch.Tensor, w1, w3, w2, limit: float | None,
                       weight_before_w2: bool, bm: int | str, out: torch.Tensor, frag: bool = False) -> torch.Tensor:
    """``moe_prefill_triton`` by the Gluon grouped GEMMs (``frag``: A from registers, x and h in
    fragment order; ``bm`` "mixed": ``mixed_tiles``, two launches a GEMM). Transient: x's rows in
    sorted order [T*k, H] (TMA reads boxes, not gathered rows), freed once h [T*k, I] exists,
    before y [T*k, H]: the Triton path's peak (h + y)."""
    T, k = ids.shape
    E, I, H = w1.shape
    sched = expert_schedule(ids, E, None if bm == "mixed" else bm)
    groups = mixed_tiles(sched) if bm == "mixed" else [(bm, sched)]
    xs = fragment_order(x, sched["src"]) if frag else x.index_select(0, sched["src"])
    rws = rw[sched["order"]] if weight_before_w2 else None
    h = torch.empty((T * k, I), dtype=x.dtype, device=x.device)
    for b, tiles in groups:
        grouped_wgmma(xs, tiles, b, w1, w3, limit, rws, frag, out=h)
    del xs
    y = torch.empty((T * k, H), dtype=x.dtype, device=x.device)
    for b, tiles in groups:
        grouped_wgmma(h, tiles, b, w2, frag=frag, out=y)
    del h
    return unpermute(y, sched["pos"], rw, out, k, weight=not weight_before_w2)


def unpermute(y: torch.Tensor, pos: torch.Tensor, rw: torch.Tensor, out: torch.Tensor, k: int,
              weight: bool) -> torch.Tensor:
    """out [T, H] = per token the sum over its k sorted rows of y (times the routing weight)."""
    T, H = out.shape
    bh = 256 if INTERPRET else 1024
    _unpermute_kernel[(T, cdiv(H, bh))](y, pos, rw, out, H, KTOP=k, BH=bh, WEIGHT=weight,
                                        num_warps=1 if INTERPRET else 4)
    return out


def dense_moe_fits(x: torch.Tensor, rows_per_expert: float, H: int, I: int) -> bool:
    """``moe_prefill_dense`` takes this call: experts average >= DENSE_MIN_M rows, the dequantiser
    takes H and I, and no CUDA graph is being captured (it syncs on the counts)."""
    if rows_per_expert < DENSE_MIN_M or not (dense_supported(H) and dense_supported(I)):
        return False
    return not (x.is_cuda and torch.cuda.is_current_stream_capturing())


def swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float | None, row_weight: torch.Tensor | None) -> torch.Tensor:
    """``clamped_swiglu(gate, up, limit)`` (times ``row_weight`` [rows] cast to its dtype) for
    [rows, I] tensors in one launch (the four torch ops of the reference: ~4x the bytes)."""
    h = torch.empty_like(gate)
    n = gate.numel()
    if n == 0:
        return h
    clamp = limit is not None and limit > 0
    block = 1024
    _swiglu_kernel[(cdiv(n, block),)](gate, up, row_weight if row_weight is not None else gate, h, n, gate.shape[-1],
                                      float(limit) if clamp else 0.0, CLAMP=clamp, WEIGHT=row_weight is not None,
                                      PRECISE=not INTERPRET, BLOCK=block, num_warps=4)
    return h


@on_input_device
def moe_prefill_dense(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w1, w3, w2,
                      limit: float | None, weight_before_w2: bool = False) -> torch.Tensor:
    """``moe_prefill_triton``'s result by dequantise + cuBLAS per hit expert, in the reference's
    order of operations (``moe_prefill_ref``: linears in x.dtype, ``clamped_swiglu`` with its
    roundings (``swiglu``), the routing weight), summed per token by ``unpermute`` (fp32, slot
    order, one rounding). Transient: one
    expert's three dequantised matrices, its rows' activations, and y [T*k, H]."""
    T, k = ids.shape
    E, I, H = w1.shape
    out = torch.empty((T, H), dtype=x.dtype, device=x.device)
    if T == 0:
        return out
    dt = x.dtype
    sched = expert_schedule(ids, E, None)  # its rows sorted by expert, no tiles
    order, src = sched["order"], sched["src"]
    rw = weights.reshape(-1).float().contiguous()
    views = [_stack_views(w) for w in (w1, w3, w2)]
    scratch = [torch.empty(shape, dtype=dt, device=x.device) for shape in ((I, H), (I, H), (H, I))]

    def dequantize(e: int) -> list[torch.Tensor]:
        return [dequantize_rows(fmt, p, s, None if gs is None else gs[e:e + 1], e * buf.shape[0], buf.shape[0], dt,
                                out=buf) for (fmt, p, s, gs), buf in zip(views, scratch)]

    # the one host sync (prefill only, never captured): the counts travel while the GPU already
    # dequantises expert 0 (hit in this regime: experts average >= DENSE_MIN_M rows), so the
    # queue does not run dry while the host waits and then launches the loop
    counts_host, ready = copy_to_host(sched["counts"])
    first = dequantize(0)
    counts = wait_for_host(counts_host, ready).tolist()
    y = torch.empty((order.numel(), H), dtype=dt, device=x.device)
    r0 = 0
    for e, c in enumerate(counts):
        if not c:
            continue
        w1e, w3e, w2e = first if e == 0 else dequantize(e)
        xe = x.index_select(0, src[r0:r0 + c])
        h = swiglu(torch.mm(xe, w1e.t()), torch.mm(xe, w3e.t()), limit,
                   rw[order[r0:r0 + c]] if weight_before_w2 else None)
        torch.mm(h, w2e.t(), out=y[r0:r0 + c])
        r0 += c
    return unpermute(y, sched["pos"], rw, out, k, weight=not weight_before_w2)
