"""MoE decode for unquantised (plain) expert stacks in two launches: the BF16 originals (``orig``) and
the embedded model's fp32 experts, reading only the chosen experts' rows.

Without it, graph-safe decode of plain experts runs the masked loop over every expert (small E: the
embedded model's 8 experts cost 48 matmuls and ~440 elementwise kernels a step, ~70 % of its 788
kernels) or, for E > 16, gathers the chosen experts' weights into a dense copy (V4-Pro BF16
originals: 6 x 3 x 3072 x 7168 x 2 bytes = 0.8 GB of transient copy a token a layer).

For each token t and chosen expert e = ids[t, j] (stacks w1, w3 [E, I, H], w2 [E, H, I]):
    gate = clamp(x_t . w1[e]^T, max=limit); up = clamp(x_t . w3[e]^T, -limit, limit)
    h    = silu(gate) * up                      (launch 1, grid I-tiles x T*k, h in x.dtype)
    out_t = sum_j (h_tj . w2[e]^T) * weight_tj  (launch 2, grid H-tiles x T)
Rounding points are the reference's (``moe_decode_ref.moe_decode_plain_ref``, as ``Expert``): the
weights taken in x.dtype, each product sum in fp32 rounded to x.dtype (a linear's output), the
clamped SwiGLU rounded as ``clamped_swiglu``, each weighted expert output rounded and added in
x.dtype in k order. Only the fp32 summation order differs from the reference's matmuls.
Graph-safe: ids and weights stay on the device, no host sync.

Imports triton (import only from ``dispatch``).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .device import on_input_device
from .host import INTERPRET, cdiv, expert_ids
from .launch import LaunchSite
from .rounding import decode_swiglu, round_to

BN = 16 if INTERPRET else 32     # output rows per program
BK = 64 if INTERPRET else 256    # reduction step (fp32 accumulators BN x BK)


@triton.jit
def _row_dot(w_ptr, x_ptr, rows, row_ok, K, stride_wn, XDT: tl.constexpr, ROUND_W: tl.constexpr,
             BN: tl.constexpr, BK: tl.constexpr):
    """[BN] fp32 sums of w[rows, :K] * x[:K], each weight taken in XDT (rounded when ROUND_W)."""
    acc = tl.zeros((BN, BK), dtype=tl.float32)
    for k0 in range(0, K, BK):
        k = k0 + tl.arange(0, BK)
        k_ok = k < K
        xv = tl.load(x_ptr + k, mask=k_ok, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + rows[:, None].to(tl.int64) * stride_wn + k[None, :],
                    mask=row_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
        if ROUND_W:
            w = round_to(w, XDT)
        acc += w * xv[None, :]
    return tl.sum(acc, axis=1)


@triton.jit
def _plain_up_kernel(x_ptr, ids_ptr, w1_ptr, w3_ptr, h_ptr, I, H, TOPK, stride_xt, stride_we, stride_wn, stride_h,
                     limit, ROUND_W: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    pid_n = tl.program_id(0)
    pair = tl.program_id(1)  # t * TOPK + j
    t = pair // TOPK
    e = tl.load(ids_ptr + pair).to(tl.int64)
    rows = pid_n * BN + tl.arange(0, BN)
    row_ok = rows < I
    xdt = h_ptr.dtype.element_ty
    xrow = x_ptr + t * stride_xt
    gate = round_to(_row_dot(w1_ptr + e * stride_we, xrow, rows, row_ok, H, stride_wn, xdt, ROUND_W, BN, BK), xdt)
    up = round_to(_row_dot(w3_ptr + e * stride_we, xrow, rows, row_ok, H, stride_wn, xdt, ROUND_W, BN, BK), xdt)
    h = decode_swiglu(gate, up, limit, xdt)
    tl.store(h_ptr + pair * stride_h + rows, h.to(xdt), mask=row_ok)


@triton.jit
def _plain_down_kernel(h_ptr, ids_ptr, wts_ptr, w2_ptr, y_ptr, H, I, TOPK, stride_h, stride_we, stride_wn,
                       stride_yt, ROUND_W: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    pid_n = tl.program_id(0)
    t = tl.program_id(1)
    rows = pid_n * BN + tl.arange(0, BN)
    row_ok = rows < H
    xdt = y_ptr.dtype.element_ty
    acc = tl.zeros((BN,), dtype=tl.float32)
    for j in range(0, TOPK):
        pair = t * TOPK + j
        e = tl.load(ids_ptr + pair).to(tl.int64)
        wt = round_to(tl.load(wts_ptr + pair).to(tl.float32), xdt)
        y = round_to(_row_dot(w2_ptr + e * stride_we, h_ptr + pair * stride_h, rows, row_ok, I, stride_wn, xdt,
                              ROUND_W, BN, BK), xdt)
        acc = round_to(acc + round_to(y * wt, xdt), xdt)
    tl.store(y_ptr + t * stride_yt + rows, acc.to(xdt), mask=row_ok)


_SITES: dict = {}  # (id(kernel), ROUND_W) -> LaunchSite


def _site(kernel, round_w: bool) -> LaunchSite:
    site = _SITES.get((id(kernel), round_w))
    if site is None:
        site = _SITES[id(kernel), round_w] = LaunchSite(kernel, ROUND_W=round_w, BN=BN, BK=BK,
                                                    num_warps=1 if INTERPRET else 4)
    return site


def plain_moe_supported(x: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor) -> bool:
    """Contiguous rows in one float dtype per stack (x may differ: the weights are taken in x's)."""
    return all(w.dim() == 3 and w.stride(-1) == 1 and w.dtype.is_floating_point and w.device == x.device
               for w in (w1, w3, w2)) and w1.stride() == w3.stride()


@on_input_device
def moe_decode_plain_triton(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w1: torch.Tensor,
                            w3: torch.Tensor, w2: torch.Tensor, limit: float | None) -> torch.Tensor:
    """x [T, H], ids [T, k] (int), weights [T, k], stacks w1 / w3 [E, I, H], w2 [E, H, I] -> [T, H] in x.dtype."""
    T, H = x.shape
    k = ids.shape[1]
    E, I, Hk = w1.shape
    if Hk != H or tuple(w2.shape) != (E, H, I) or w3.shape != w1.shape:
        raise ValueError(f"plain expert stacks w1 {tuple(w1.shape)} w3 {tuple(w3.shape)} w2 {tuple(w2.shape)} "
                         f"do not fit x {tuple(x.shape)}: need [E, I, H], [E, I, H], [E, H, I]")
    y = torch.empty((T, H), dtype=x.dtype, device=x.device)
    if T == 0:
        return y
    x = x if x.stride(-1) == 1 else x.contiguous()
    ids_c = expert_ids(ids)
    wts = weights.reshape(-1).to(torch.float32)
    lim = float("inf") if limit is None or limit <= 0 else float(limit)
    h = torch.empty((T * k, I), dtype=x.dtype, device=x.device)
    _site(_plain_up_kernel, w1.dtype != x.dtype and x.dtype != torch.float32)(
        (cdiv(I, BN), T * k), x, ids_c, w1, w3, h, I, H, k, x.stride(0), w1.stride(0), w1.stride(1), h.stride(0), lim)
    _site(_plain_down_kernel, w2.dtype != x.dtype and x.dtype != torch.float32)(
        (cdiv(H, BN), T), h, ids_c, wts, w2, y, H, I, k, h.stride(0), w2.stride(0), w2.stride(1), y.stride(0))
    return y
