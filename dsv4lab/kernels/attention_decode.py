"""Triton decode attention: one query token per sequence over [sliding-window ring | compressed
entries] with the sink, reading only the valid keys in place: the kernel of
``dsv4lab.model.decode_attention.decode_attention`` (same signature, so it fills the
``Attention.decode_kernel`` slot; reference parity on CPU through the interpreter).

Keys are a virtual sequence of BLOCK_N-row tiles: first the ring's valid slots i < min(pos + 1,
W) (addressed by slot, the softmax does not care about order), then the entries: w < n_entries
(HCA, CSA with the indexer off) or the indexer's ``selected`` [B,1,k] gathered by index (-1 =
none, masked; a masked row is never read) up to its last valid slot (``attention_tiles.selected_extent``:
at position p < 4k, V4-Pro's k = 1024 slots hold about p / 4 valid ones). ``pos`` and
``n_entries`` are read on the device, so the grid and every shape are fixed by host ints
(CUDA-graph safe, no host sync).

FlashMLA-style split: at batch 1 the 128 heads make only 4 blocks of 32, so the tiles are spread
over ``splits`` programs per (head block, batch row), a balanced share each (split s takes tiles
[s*n/S, (s+1)*n/S) of the n valid ones). Every split runs the online softmax of
``attention_tiles.online_softmax_tile`` from m = sink, l = 0 and writes its fp32 (acc, m, l); a second
launch combines them per head with the sink's exp(sink - M), every split's partials in one load
and fixed-order reductions over them (deterministic, no atomics). One split (large batches) is
one launch that starts from l = 1 and writes the output.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from .activation_pairs import INV_PAD, pairs_buffers, pairs_written, store_pair_rows
from .attention_tiles import SEL_SCAN, head_block_query, online_softmax_tile, sel_scan_block, selected_extent
from .device import on_input_device
from .host import INTERPRET, cdiv, dot_dtype, next_pow2, num_sms, scratch
from .launch import new_site
from .norm_rope import NORM_NONE, launch_norm_rope, rope_cos_sin, rotate_pairs
from .pdl import pdl_enter, pdl_kw, use_pdl

BLOCK_H = 32   # heads per program: the bounded prefill kernel's tile (offline sm_90a: no spills)
BLOCK_N = 32   # keys per tile
NUM_WARPS = 8
COMBINE_D = 128  # output columns per combine program: [splits, 128] fp32 partials in one load
_SITES: dict = {}  # (id(kernel), constexprs) -> LaunchSite (2 launches an eager CSA layer)


@triton.jit
def _normed_roped_query(q, pos, inv_ptr, eps, D, RD: tl.constexpr, XDT: tl.constexpr, DOT: tl.constexpr,
                        PRECISE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    """q [BLOCK_H, BLOCK_D] (x's values, zero padded) -> unweighted_rms_norm then RoPE of its last RD
    channels at ``pos``, in DOT: ``norm_rope``'s NORM_PLAIN roundings (rsqrt to XDT, the normalised
    value to XDT, each RoPE product on its own, the result to XDT); the sum of squares runs in this
    tile's order, so a value may round one ulp from norm_rope's launch."""
    HALF: tl.constexpr = BLOCK_D // 2
    ve, vo = tl.split(tl.reshape(q.to(tl.float32), [BLOCK_H, HALF, 2]))
    r = tl.rsqrt((tl.sum(ve * ve, axis=1) + tl.sum(vo * vo, axis=1)) / D + eps)
    rq = r.to(XDT).to(tl.float32)[:, None]
    ve = (ve * rq).to(XDT).to(tl.float32)
    vo = (vo * rq).to(XDT).to(tl.float32)
    rot, cos, sin = rope_cos_sin(pos, inv_ptr, tl.arange(0, HALF), D // 2, RD, 1, PRECISE)
    ve, vo = rotate_pairs(ve, vo, rot[None, :], cos[None, :], sin[None, :], XDT)
    return tl.reshape(tl.join(ve, vo), [BLOCK_H, BLOCK_D]).to(XDT).to(DOT)


@triton.jit
def _decode_split_kernel(q_ptr, ring_ptr, ent_ptr, sel_ptr, n_ent_ptr, pos_ptr, sink_ptr,
                         out_ptr, part_ptr, m_ptr, l_ptr,
                         H, D, W, T, K, SPLITS, scale,
                         sq_b, sq_h, sr_b, sr_p, se_b, se_t, ssel_b, so_b, so_h, inv_ptr, q_eps,
                         HAS_ENT: tl.constexpr, HAS_SEL: tl.constexpr, FINAL: tl.constexpr,
                         DOT: tl.constexpr, IEEE: tl.constexpr,
                         BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                         PDL: tl.constexpr = False, SEL_SCAN: tl.constexpr = SEL_SCAN,
                         Q_RD: tl.constexpr = 0, PRECISE: tl.constexpr = True):
    """``Q_RD`` > 0: q arrives as wq_b wrote it; each program normalises its heads (unweighted RMS,
    ``q_eps``) and rotates their last Q_RD channels at ``pos`` first, as ``norm_rope`` does."""
    pdl_enter(PDL)
    hb = tl.program_id(0)
    sp = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    offs_h, offs_d, hmask, dmask, q, m_i = head_block_query(q_ptr + b * sq_b, sink_ptr, sq_h, H, D, hb, DOT, BLOCK_H, BLOCK_D)
    if Q_RD > 0:
        q = _normed_roped_query(q, tl.load(pos_ptr), inv_ptr, q_eps, D, Q_RD, out_ptr.dtype.element_ty, DOT, PRECISE,
                                BLOCK_H, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    pos = tl.load(pos_ptr).to(tl.int32)
    n_win = tl.minimum(pos + 1, W)
    if HAS_SEL:  # slots up to the last valid one (validity per index; -1 tiles after it are no-ops)
        n_ent = selected_extent(sel_ptr + b * ssel_b, K, SEL_SCAN)
    elif HAS_ENT:
        n_ent = tl.minimum(tl.load(n_ent_ptr).to(tl.int32), T)
    else:
        n_ent = 0
    tiles_win = tl.cdiv(n_win, BLOCK_N)
    n_tiles = tiles_win + tl.cdiv(n_ent, BLOCK_N)
    t_lo = (sp * n_tiles) // SPLITS
    t_hi = ((sp + 1) * n_tiles) // SPLITS
    if FINAL:
        l_i = tl.full([BLOCK_H], 1.0, tl.float32)   # the sink's exp(sink - sink)
    else:
        l_i = tl.zeros([BLOCK_H], tl.float32)       # the combine adds the sink once
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    for t in range(t_lo, t_hi):
        in_win = t < tiles_win
        j = tl.where(in_win, t, t - tiles_win) * BLOCK_N + offs_n
        if HAS_SEL:  # one row index per key, -1 = masked: the ring slot j or the selected entry
            idx = tl.load(sel_ptr + b * ssel_b + j, mask=j < tl.where(in_win, 0, K), other=-1).to(tl.int32)
            row = tl.where(in_win, tl.where(j < n_win, j, -1), idx)
        else:
            row = tl.where(j < tl.where(in_win, n_win, n_ent), j, -1)
        valid = row >= 0
        row = tl.maximum(row, 0)
        base = tl.where(in_win, ring_ptr + b * sr_b + row.to(tl.int64) * sr_p, ent_ptr + b * se_b + row.to(tl.int64) * se_t)
        k = tl.load(base[:, None] + offs_d[None, :], mask=valid[:, None] & dmask[None, :], other=0.0)
        m_i, l_i, acc = online_softmax_tile(q, k, valid, m_i, l_i, acc, scale, DOT, IEEE)
    if FINAL:
        tl.store(out_ptr + b * so_b + offs_h[:, None] * so_h + offs_d[None, :],
                 (acc / l_i[:, None]).to(out_ptr.dtype.element_ty), mask=hmask[:, None] & dmask[None, :])
    else:
        row_ml = (b * SPLITS + sp) * H + offs_h                          # [B, SPLITS, H]
        tl.store(part_ptr + row_ml[:, None] * D + offs_d[None, :], acc, mask=hmask[:, None] & dmask[None, :])
        tl.store(m_ptr + row_ml, m_i, mask=hmask)
        tl.store(l_ptr + row_ml, l_i, mask=hmask)


@triton.jit
def _decode_combine_kernel(part_ptr, m_ptr, l_ptr, sink_ptr, out_ptr, H, D, SPLITS, so_b, so_h,
                           pos_ptr, inv_ptr, xp_ptr, xinv_ptr, KG, KGP,
                           SPLITSP: tl.constexpr, BLOCK_D: tl.constexpr, RD: tl.constexpr = 0,
                           PRECISE: tl.constexpr = True, PAIRS: tl.constexpr = False, PDL: tl.constexpr = False):
    """One (head, BLOCK_D columns, batch row): every split's (m, l, acc) read in one load each (a loop
    over the splits was a chain of dependent loads: 18 of them for V4-Pro's CSA, ~7.6 us on an H100),
    combined with the sink's exp(sink - M) by fixed-order reductions over the splits. RD > 0: the
    output's inverse RoPE at ``pos`` on the last RD channels of each head (the bits of ``norm_rope``'s
    launch on the rounded output: ``rope_cos_sin``, ``rotate_pairs``, no FMA contraction), and
    ``PAIRS``: the row's ``x_pairs`` for the grouped wo_a (``store_pair_rows``, one batch row)."""
    pdl_enter(PDL)
    h = tl.program_id(0)
    db = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    offs_d = db * BLOCK_D + tl.arange(0, BLOCK_D)
    dmask = offs_d < D
    sp = tl.arange(0, SPLITSP)
    s_ok = sp < SPLITS
    r = (b * SPLITS + sp) * H + h                                     # [SPLITSP] rows of (m, l, acc)
    sink = tl.load(sink_ptr + h).to(tl.float32)
    m = tl.load(m_ptr + r, mask=s_ok, other=float("-inf"))
    m_all = tl.maximum(sink, tl.max(m, 0))
    w = tl.where(s_ok, tl.exp(m - m_all), 0.0)
    l_all = tl.exp(sink - m_all) + tl.sum(tl.load(l_ptr + r, mask=s_ok, other=0.0) * w, 0)
    part = tl.load(part_ptr + r[:, None] * D + offs_d[None, :], mask=s_ok[:, None] & dmask[None, :], other=0.0)
    acc = tl.sum(part * w[:, None], 0)
    y = (acc / l_all).to(out_ptr.dtype.element_ty)
    if RD > 0:
        HALF: tl.constexpr = BLOCK_D // 2
        ve, vo = tl.split(tl.reshape(y.to(tl.float32), [HALF, 2]))
        rot, cos, sin = rope_cos_sin(tl.load(pos_ptr), inv_ptr, db * HALF + tl.arange(0, HALF), D // 2, RD, -1,
                                     PRECISE)
        ve, vo = rotate_pairs(ve, vo, rot, cos, sin, out_ptr.dtype.element_ty)
        y = tl.reshape(tl.join(ve, vo), [BLOCK_D]).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + b * so_b + h * so_h + offs_d, y, mask=dmask)
    if PAIRS:  # whole 16-groups of the row [H * D] (D a multiple of BLOCK_D): g = (h * D + d) / 16
        NG: tl.constexpr = BLOCK_D // 16
        g = (h * D + db * BLOCK_D) // 16 + tl.arange(0, NG)
        store_pair_rows(tl.reshape(y.to(tl.float32), (NG, 16)), xp_ptr, xinv_ptr, g, KG, KGP, NG)


@functools.lru_cache(maxsize=1024)  # a rule of the shapes asked on every decode step
def decode_splits(batch: int, heads: int, key_capacity: int, device: torch.device) -> int:
    """Splits per (head block, batch row): enough programs for one wave of the SMs, then as few as
    keep the longest split's tile count (partials cost fp32 [splits, H, Dh] of writes and reads).
    A host rule of the shapes, so a step's grid and summation order never depend on ``pos``."""
    cap_tiles = max(1, cdiv(key_capacity, BLOCK_N))
    want = max(1, cdiv(num_sms(device), batch * cdiv(heads, BLOCK_H)))
    per_split = cdiv(cap_tiles, min(want, cap_tiles))
    return cdiv(cap_tiles, per_split)


@on_input_device
def decode_attention_triton(q: torch.Tensor, sink: torch.Tensor, scale: float, window_ring: torch.Tensor,
                            pos: torch.Tensor, entries: torch.Tensor | None = None,
                            n_entries: torch.Tensor | None = None, selected: torch.Tensor | None = None,
                            splits: int | None = None, inv_freq: torch.Tensor | None = None,
                            q_eps: float | None = None) -> torch.Tensor:
    """``decode_attention`` in one launch (one split) or two (splits + combine). q [B,1,H,Dh];
    window_ring [B,W,Dh]; entries [B,T,Dh] with ``n_entries`` (0-d device tensor) or ``selected``
    [B,1,k]; ``pos`` a 0-d device tensor. Returns [B,1,H,Dh] in the ring's dtype. ``splits``:
    None = ``decode_splits``. ``inv_freq``: the output's inverse RoPE at ``pos`` too (the bits of
    ``norm_rope(out, ..., inverse=True)``): in the combine launch, with the row's ``x_pairs`` for the
    grouped wo_a at one batch row; after one split, its own launch. ``q_eps`` (with ``inv_freq``):
    q is wq_b's raw output, normalised (``unweighted_rms_norm``) and rotated at ``pos`` in the split
    programs (``_normed_roped_query``) instead of by a launch of its own."""
    if q_eps is not None and inv_freq is None:
        raise ValueError("decode_attention_triton: q_eps (q still to normalise and rotate) needs inv_freq")
    B, S, H, D = q.shape
    if S != 1:
        raise ValueError(f"decode_attention_triton: q must hold one token per sequence, got q.shape={tuple(q.shape)}; "
                         "use the bounded prefill kernel for more")
    if entries is not None and selected is None and n_entries is None:
        raise ValueError("decode_attention_triton: entries without selected need n_entries (a 0-d device tensor)")
    ring = window_ring.contiguous()
    q = q.to(ring.dtype).contiguous()
    has_ent = entries is not None
    ent = entries.to(ring.dtype).contiguous() if has_ent else ring
    sel = selected.contiguous() if (has_ent and selected is not None) else None
    dev = q.device
    W, T = ring.shape[1], ent.shape[1] if has_ent else 0
    K = sel.shape[-1] if sel is not None else 0
    cap = W + (K if sel is not None else T)
    n_split = splits or decode_splits(B, H, cap, dev)
    out = ring.new_empty(B, 1, H, D)
    final = n_split == 1
    if final:
        part = m_part = l_part = out
    else:
        part = scratch("attn_split", (B, n_split, H, D), torch.float32, dev)   # read by the combine launch only
        m_part = scratch("attn_split_m", (B, n_split, H), torch.float32, dev)
        l_part = scratch("attn_split_l", (B, n_split, H), torch.float32, dev)
    sel_arg = sel if sel is not None else pos
    n_ent_arg = n_entries if (has_ent and n_entries is not None) else pos
    sink32 = sink.float().contiguous()
    dot = tl.float32 if ring.dtype == torch.float32 else dot_dtype(ring)  # fp32 under the interpreter
    block_d = next_pow2(max(D, 16))
    kernel, has_sel = _decode_split_kernel, sel is not None  # looked up per call: tests replace it
    grid = (cdiv(H, BLOCK_H), n_split, B)
    pdl = use_pdl(grid[0] * n_split * B, dev)
    scan = sel_scan_block(K)
    q_rd = 0 if q_eps is None else 2 * inv_freq.shape[-1]
    skey = (id(kernel), has_ent, has_sel, final, dot, block_d, pdl, scan, q_rd)
    site = _SITES.get(skey) or new_site(_SITES, skey, kernel, HAS_ENT=has_ent, HAS_SEL=has_sel, FINAL=final, DOT=dot,
                                        IEEE=dot == tl.float32, BLOCK_H=BLOCK_H, BLOCK_N=BLOCK_N, BLOCK_D=block_d,
                                        SEL_SCAN=scan, Q_RD=q_rd, PRECISE=not INTERPRET, num_warps=NUM_WARPS,
                                        **pdl_kw(pdl))
    site(grid,
        q, ring, ent, sel_arg, n_ent_arg, pos, sink32, out, part, m_part, l_part,
        H, D, W, T, K, n_split, scale,
        q.stride(0), q.stride(2), ring.stride(0), ring.stride(1), ent.stride(0), ent.stride(1),
        sel.stride(0) if sel is not None else 0, out.stride(0), out.stride(2),
        inv_freq if q_rd else sink32, float(q_eps or 0.0))
    if not final:
        kernel = _decode_combine_kernel
        splits_p, comb_d = next_pow2(n_split), min(block_d, COMBINE_D)
        grid = (H, cdiv(D, comb_d), B)
        pdl = use_pdl(grid[0] * grid[1] * B, dev)
        skey = (id(kernel), splits_p, comb_d, pdl)
        rd = 0 if inv_freq is None else 2 * inv_freq.shape[-1]
        emit = rd > 0 and B == 1 and D % comb_d == 0 and comb_d % 16 == 0 and (H * D // 16) % INV_PAD == 0
        kg = H * D // 16
        xp, xinv = pairs_buffers(kg, dev) if emit else (out, out)
        skey = (id(kernel), splits_p, comb_d, pdl, rd, emit)
        # no FMA contraction: the RoPE's products round as norm_rope's (and the combine's as before either way)
        site = _SITES.get(skey) or new_site(_SITES, skey, kernel, SPLITSP=splits_p, BLOCK_D=comb_d, RD=rd,
                                            PRECISE=not INTERPRET, PAIRS=emit, enable_fp_fusion=False, num_warps=4,
                                            **pdl_kw(pdl))
        site(grid, part, m_part, l_part, sink32, out, H, D, n_split, out.stride(0), out.stride(2),
             pos, out if inv_freq is None else inv_freq, xp, xinv, kg, xinv.shape[0] if emit else 0)
        if emit:
            pairs_written(kg, dev, out)
    elif inv_freq is not None:
        launch_norm_rope(out, out.dtype, norm=NORM_NONE, positions=pos.view(1), inv_freq=inv_freq, inverse=True,
                         inplace=True)
    return out
