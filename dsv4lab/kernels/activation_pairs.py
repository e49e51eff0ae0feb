"""The activation as f16x2 pairs, what the batch-1 NVFP4 GEMVs (``linear_nvfp4_tma``,
``moe_decode_tma``) multiply weight words with: per 16-group of x the 8 pairs of ``x' = x * xs``
(xs a power of two, so x' is exact in f16 for bf16 x) and the bits of 1/xs, in kept buffers of one
row (``pairs_buffers``). Built by a one-wave prelude (``x_pairs``) or emitted by the kernel that
produced x (``pair_rows`` / ``store_pair_rows`` + ``pairs_written``: norm, mHC, attention, the TMA
GEMV), in which case the prelude launches nothing; read back through TMA (``pairs_descriptor``,
``pairs_and_inv``). The record of which activation the buffers hold lives here and nowhere else.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
from triton.tools.tensor_descriptor import TensorDescriptor

from ..lanes import MAIN, borrow, current_lane, main_writes, note_main_write
from .host import INTERPRET, SCRATCH_IDS, cdiv, rebased, scratch
from .launch import LaunchSite
from .pdl import pdl_kw


BOX_GROUPS = 16  # 16-groups per TMA box along K: 128 bytes of weight words, 16 bytes of scales per row
INV_PAD = 64  # x_pairs' 1/xs is zero-padded to a multiple of this many groups (the widest box)


@triton.jit
def pair_rows(x, BG: tl.constexpr):
    """x [BG, 16] fp32 (BG 16-groups of an activation row) -> (rows [BG, 16] int32: the group's 8
    f16x2 pairs in columns 0-7, the bits of 1/xs in column 8, zeros after; 1/xs [BG] fp32), with a
    power-of-two xs per group (x * xs exact in f16 for bf16 x). The one body of ``_x_pairs_kernel``
    and of the norm kernel that emits its output's pairs (``norm_rope``), so both give these bits."""
    e = (tl.max(tl.abs(x), axis=1).to(tl.int32, bitcast=True) >> 23) & 0xFF
    b = tl.minimum(tl.maximum(268 - e, 1), 253)        # xs = 2^(141 - e) = 2^(b - 127)
    xs = (b << 23).to(tl.float32, bitcast=True)
    inv = ((254 - b) << 23).to(tl.float32, bitcast=True)
    h = (x * xs[:, None]).to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    # element 8h + 4q + 2t + r -> pair 4h + (2r + q), half t (H2_PAIR_LO = 0, 4, 1, 5; high half +2)
    h = tl.reshape(tl.permute(tl.reshape(h, (BG, 2, 2, 2, 2)), (0, 1, 4, 2, 3)), (BG, 8, 2))
    lo, hi = tl.split(h)
    pairs = tl.reshape(lo | (hi << 16), (BG, 8))
    c8 = tl.arange(0, 8)[None, :]
    extra = tl.where(c8 == 0, inv.to(tl.int32, bitcast=True)[:, None], 0)   # column 8: 1/xs bits
    return tl.reshape(tl.permute(tl.join(pairs, extra), (0, 2, 1)), (BG, 16)), inv


@triton.jit
def store_pair_rows(x, xp_ptr, inv_ptr, g, KG, KGP, BG: tl.constexpr):
    """``pair_rows`` of x [BG, 16] (groups ``g``) stored as ``x_pairs`` lays them out: rows g < KG,
    1/xs for g < KGP with zeros from KG on."""
    row, inv = pair_rows(x, BG)
    ok = g < KG
    tl.store(xp_ptr + g[:, None] * 16 + tl.arange(0, 16)[None, :], row, mask=ok[:, None])
    tl.store(inv_ptr + g, tl.where(ok, inv, 0.0), mask=g < KGP)


@triton.jit
def _x_pairs_kernel(x_ptr, xp_ptr, inv_ptr, KG, KGP, BG: tl.constexpr, PDL: tl.constexpr):
    """x [K] -> rows [KG, 16] of f16x2 pairs (columns 0-7) and 1/xs bits (column 8) per 16-group
    (power-of-two scaling), and 1/xs [KGP] on its own (zeros from KG to KGP)."""
    if PDL:  # launched early (programmatic dependent launch): wait for the previous grid's writes
        gdc_wait()
        gdc_launch_dependents()
    g = tl.program_id(0) * BG + tl.arange(0, BG)
    ok = g < KG
    x = tl.load(x_ptr + g[:, None] * 16 + tl.arange(0, 16)[None, :], mask=ok[:, None], other=0.0).to(tl.float32)
    store_pair_rows(x, xp_ptr, inv_ptr, g, KG, KGP, BG)


@triton.jit
def _pairs_at(xt, G: tl.constexpr, XINV: tl.constexpr):
    """The 8 f16x2 pair columns, each [1, G], of a loaded box ``xt`` of G pair rows (``XINV``: the
    box holds whole 16-word rows, pairs and 1/xs; else only the 8 pair words)."""
    if XINV:
        xt, _ = tl.split(tl.permute(tl.reshape(xt, (G, 2, 8)), (0, 2, 1)))   # columns 0-7
    xt = tl.reshape(xt, (G, 2, 2, 2))
    e0, e1 = tl.split(xt)
    e00, e01 = tl.split(e0)
    e10, e11 = tl.split(e1)
    x0, x4 = tl.split(e00)
    x2, x6 = tl.split(e01)
    x1, x5 = tl.split(e10)
    x3, x7 = tl.split(e11)
    return x0[None, :], x1[None, :], x2[None, :], x3[None, :], x4[None, :], x5[None, :], x6[None, :], x7[None, :]


@triton.jit
def pairs_and_inv(x_desc, inv_ptr, row0, g0, G: tl.constexpr, XINV: tl.constexpr):
    """Pair columns (``_pairs_at``) and 1/xs [1, G] of the G groups g0.. of the activation row whose
    groups start at pair row ``row0`` (0 for the GEMV; token / (token, expert) rows in the MoE).

    ``XINV``: 1/xs comes in column 8 of the same TMA rows as the pairs (q_b 19.5 -> 18.8-19.0 us,
    experts 8.6 -> 8.3 us; but o_b 23.5 -> 25.1 us, 23.9 at its best re-swept tile, so its rule
    keeps the other way). Else it is read unmasked from ``inv_ptr`` (``x_pairs`` zero-pads it to
    whole boxes); masked, that load compiled to 16 scalar cp.async per box with their address and
    predicate set-up, ~10 % of the loop's instructions. A TMA load of 1/xs on its own needed 128
    shuffles to broadcast, and 1-D descriptors faulted."""
    if XINV:
        xt = x_desc.load([row0 + g0, 0])
        _, rest = tl.split(tl.permute(tl.reshape(xt, (G, 2, 8)), (0, 2, 1)))   # columns 8..15
        rest, _ = tl.split(tl.reshape(rest, (G, 4, 2)))                # 8, 10, 12, 14
        rest, _ = tl.split(tl.reshape(rest, (G, 2, 2)))                # 8, 12
        c8, _ = tl.split(rest)                                         # 8: the bits of 1/xs
        inv = c8.to(tl.float32, bitcast=True)[None, :]
    else:  # issued before the pair box, as measured (the other order changes register allocation)
        inv = tl.load(inv_ptr + row0 + g0 + tl.arange(0, G))[None, :]
        xt = x_desc.load([row0 + g0, 0])
    x0, x1, x2, x3, x4, x5, x6, x7 = _pairs_at(xt, G, XINV)
    return inv, x0, x1, x2, x3, x4, x5, x6, x7


def pairs_buffers(KG: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The kept ``x_pairs`` buffers of a K/16 = KG row on ``device`` for a launch about to write
    them: rows int32 [KG, 16] and 1/xs fp32 [KGP] (KG padded to whole ``INV_PAD`` boxes). On the
    main lane, first waits for a side lane that borrowed them (``lanes.main_writes``)."""
    main_writes((KG, device))
    return _kept_pairs(KG, device)


_EMITTED: dict = {}  # (KG, device, lane) -> (activation, its version, the buffers' generation) whose pairs they hold
_PAIRS_GEN: dict = {}  # (KG, device, lane) -> how many times the kept pairs buffers of that size were written


def pairs_written(KG: int, device: torch.device, x: torch.Tensor | None = None) -> None:
    """Record a write of the kept pairs buffers of size KG (``x_pairs`` or an emitting kernel):
    with ``x``, they now hold x's pairs (``emitted``); without, whatever they held is gone."""
    lane = current_lane()
    key = (KG, device, lane)
    gen = _PAIRS_GEN[key] = _PAIRS_GEN.get(key, 0) + 1
    if x is None:
        _EMITTED.pop(key, None)
    else:  # x kept alive here, so no other tensor can be given its address
        _EMITTED[key] = (x, x._version, gen, x.data_ptr(), note_main_write() if lane == MAIN else 0)


def _pairs_record(x: torch.Tensor, key: tuple) -> tuple | None:
    """The record of the kept pairs buffers ``key`` = (KG, device, lane) if they hold x's pairs
    (``pairs_written(KG, dev, x)`` and no write since: x that tensor or a view of all of it at the
    same version), else None."""
    got = _EMITTED.get(key)
    if (got is not None and got[3] == x.data_ptr() and got[1] == x._version and got[2] == _PAIRS_GEN.get(key)
            and got[0].dtype == x.dtype and got[0].numel() == x.numel()):
        return got
    return None


def _kept_pairs(KG: int, device: torch.device, lane: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """A lane's kept pairs buffers (default the current lane's), for reading or writing."""
    return (scratch("x_pairs", (KG, 16), torch.int32, device, lane),
            scratch("x_pairs_inv", (cdiv(KG, INV_PAD) * INV_PAD,), torch.float32, device, lane))


def x_pairs(x: torch.Tensor, pdl: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """x (any float dtype, contiguous; its K = numel elements: one row) -> (int32 [K/16, 16]: per
    16-group the 8 f16x2 pairs, the bits of 1/xs and 7 unused words; 1/xs fp32 [KGP] again on its
    own, zeros after the K/16 groups up to whole ``INV_PAD`` boxes). Both are ``pairs_buffers``
    (valid until the next write of that size on this device: the GEMV launched next reads them),
    so eager decode allocates nothing here.

    No launch when the buffers hold x's pairs already because the kernel that produced x wrote
    them (``pairs_written(KG, dev, x)``: the decode's RMSNorm launches for the rows that feed
    GEMVs) and nothing wrote them since: x that tensor or a view of all of it (same address,
    dtype and size) at the same version counter, the buffers at the same generation; on a decode
    side lane also when the main lane's buffers hold them (read in place: ``lanes.borrow``, so a
    main-lane write to them first waits for the side lane). Otherwise always launched, also for an activation whose
    pairs the buffer may still hold: a memo of x_pairs' own results keyed on address and version
    was tried and dropped, because the MoE's SwiGLU rows live in a kept buffer that a kernel
    rewrites without bumping its version, so the memo served the previous token's pairs; an
    emitting kernel's output is a new tensor that no kernel writes afterwards."""
    KG = x.numel() // 16
    dev = x.device
    lane = current_lane()
    if _pairs_record(x, (KG, dev, lane)) is not None:
        return _kept_pairs(KG, dev)
    if lane != MAIN:
        got = _pairs_record(x, (KG, dev, MAIN))
        if got is not None:  # the side lane reads what the main lane emitted, in place
            borrow((KG, dev), got[4])
            return _kept_pairs(KG, dev, MAIN)
    xp, inv = pairs_buffers(KG, dev)
    kernel = _x_pairs_kernel  # looked up per call: a test's stand-in replaces the module attribute
    site = _X_PAIRS_SITES.get((id(kernel), pdl))
    if site is None:
        site = _X_PAIRS_SITES[id(kernel), pdl] = LaunchSite(
            kernel, BG=_X_PAIRS_BG, num_warps=1 if INTERPRET else 4, **pdl_kw(pdl))
    site((cdiv(inv.shape[0], _X_PAIRS_BG),), x, xp, inv, KG, inv.shape[0])
    pairs_written(KG, dev)
    return xp, inv


_X_PAIRS_BG = 16 if INTERPRET else 32   # 16-groups per program
_X_PAIRS_SITES: dict = {}               # (id(kernel), pdl) -> its LaunchSite (no per-call keyword key)


_PAIRS_DESC: dict = {}  # (KG, g, xinv) -> a descriptor over some x_pairs rows, the geometry to rebase
_PAIRS_KEPT: dict = {}  # (id(xp), g, xinv) -> the descriptor over that kept (``scratch``) pairs buffer


def pairs_descriptor(xp: torch.Tensor, g: int, xinv: bool) -> TensorDescriptor:
    """TMA descriptor over ``x_pairs`` rows [KG, 16] with boxes of ``g`` groups: whole rows (pairs
    and 1/xs, ``xinv``) or only their 8 pair words (row stride 64 bytes). Over a ``scratch`` buffer
    the same descriptor object comes back on every call, so its encoded TMA map is kept too
    (``launch``'s raw path)."""
    kept = _PAIRS_KEPT.get((id(xp), g, xinv))
    if kept is not None and kept.base is xp:
        return kept
    key = (xp.shape[0], g, xinv)
    tpl = _PAIRS_DESC.get(key)
    if tpl is None or xp.stride() != (16, 1) or xp.dtype != torch.int32:
        if xinv:
            d = TensorDescriptor.from_tensor(xp, [g, 16])
        else:
            d = TensorDescriptor(xp, [xp.shape[0], 8], [xp.stride(0), 1], [g, 8])
        if xp.stride() == (16, 1) and xp.dtype == torch.int32:
            _PAIRS_DESC[key] = rebased(d, None)  # the geometry only: keeps no activation alive
    else:
        d = rebased(tpl, xp)
    if id(xp) in SCRATCH_IDS:
        _PAIRS_KEPT[id(xp), g, xinv] = d
    return d
