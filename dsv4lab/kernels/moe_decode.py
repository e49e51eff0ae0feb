"""MoE decode path for NVFP4 experts in two launches (pointer loads; ``dsv4lab.kernels.moe_decode_tma`` is the
TMA-fed variant taken on sm_90+).

For each token t and each of its k chosen experts e = ids[t, j]:
    gate = clamp(x_t @ w1[e]^T, max=limit); up = clamp(x_t @ w3[e]^T, -limit, limit)
    h    = silu(gate) * up
    out_t = sum_j weights[t, j] * (h @ w2[e]^T)
Launch 1 (``_moe_up_kernel``, grid = I-tiles x T*k) streams w1 and w3 rows of the chosen expert
against one activation row (the M=1 GEMV inner loop of ``nvfp4_matmul``) and writes h in x.dtype
(as the reference's bf16 linear outputs; gate/up are rounded to x.dtype before the activation).
Launch 2 (``_moe_down_kernel``, grid = H-tiles x T) loops over the token's k experts, weights
each w2 GEMV by the routing weight and writes the fp32 sum once (no atomics, no zero-fill).
Expert ids and weights stay on the device: no host sync, CUDA-graph capturable.

Experts are given stacked (``dsv4lab.quant.stacked.StackedNVFP4``: packed [E, N, K/2], e4m3 scales [E, N, K/16], global
scales [E]); build the stack once per layer (``StackedNVFP4.from_weights``). MXFP4 experts
(``StackedMXFP4``, the official checkpoint's) run through the TMA variant only.
"""
from __future__ import annotations


import torch
import triton
import triton.language as tl

from ..quant.stacked import StackedMXFP4, StackedNVFP4
from .device import env_value, on_input_device
from .host import INTERPRET, cdiv, expert_ids
from .launch import launch
from .moe_decode_tma import moe_decode_tma, tma_moe_supported
from .rounding import decode_swiglu, round_to
from .weight_decode import gemv_rows_m1


@triton.jit
def _moe_up_kernel(x_ptr, ids_ptr, w1_ptr, s1_ptr, g1_ptr, w3_ptr, s3_ptr, g3_ptr, h_ptr,
                   I, KG, TOPK, stride_xt, stride_we, stride_wn, stride_se, stride_sn, stride_h,
                   limit, gps, BN: tl.constexpr, G: tl.constexpr):
    pid_n = tl.program_id(0)
    pair = tl.program_id(1)  # t * TOPK + j
    t = pair // TOPK
    e = tl.load(ids_ptr + pair).to(tl.int64)
    rows = pid_n * BN + tl.arange(0, BN)
    row_ok = rows < I
    xrow = x_ptr + t * stride_xt
    a1 = gemv_rows_m1(w1_ptr + e * stride_we, s1_ptr + e * stride_se, stride_wn, stride_sn, xrow,
                       rows, row_ok, 0, KG, gps, BN, G)
    a3 = gemv_rows_m1(w3_ptr + e * stride_we, s3_ptr + e * stride_se, stride_wn, stride_sn, xrow,
                       rows, row_ok, 0, KG, gps, BN, G)
    out_ty = h_ptr.dtype.element_ty
    gate = round_to(a1 * (16384.0 * tl.load(g1_ptr + e)), out_ty)
    up = round_to(a3 * (16384.0 * tl.load(g3_ptr + e)), out_ty)
    h = decode_swiglu(gate, up, limit, out_ty)
    tl.store(h_ptr + pair * stride_h + rows, h.to(h_ptr.dtype.element_ty), mask=row_ok)


@triton.jit
def _moe_down_kernel(h_ptr, ids_ptr, wts_ptr, w2_ptr, s2_ptr, g2_ptr, y_ptr,
                     H, KG, TOPK, stride_h, stride_we, stride_wn, stride_se, stride_sn, stride_yt,
                     gps, BN: tl.constexpr, G: tl.constexpr):
    pid_n = tl.program_id(0)
    t = tl.program_id(1)
    rows = pid_n * BN + tl.arange(0, BN)
    row_ok = rows < H
    acc = tl.zeros((BN,), dtype=tl.float32)
    for j in range(0, TOPK):
        pair = t * TOPK + j
        e = tl.load(ids_ptr + pair).to(tl.int64)
        wt = tl.load(wts_ptr + pair).to(tl.float32)
        a = gemv_rows_m1(w2_ptr + e * stride_we, s2_ptr + e * stride_se, stride_wn, stride_sn,
                          h_ptr + pair * stride_h, rows, row_ok, 0, KG, gps, BN, G)
        acc += a * (16384.0 * tl.load(g2_ptr + e) * wt)
    tl.store(y_ptr + t * stride_yt + rows, acc.to(y_ptr.dtype.element_ty), mask=row_ok)


def _cfg():
    return (16, 2, 1) if INTERPRET else (32, 16, 4)


@on_input_device
def moe_decode_triton(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w1: StackedNVFP4,
                      w3: StackedNVFP4, w2: StackedNVFP4, limit: float | None,
                      tma: bool | None = None, shared: tuple | None = None) -> torch.Tensor:
    """x [T, H], ids [T, k] (int), weights [T, k] -> [T, H] in x.dtype.

    ``tma=None``: the TMA-fed path (``dsv4lab.kernels.moe_decode_tma``, four launches) where it is
    supported (sm_90+, H and I multiples of 256; DSV4LAB_KERNEL_TMA=0 opts out), else the two
    pointer-load launches here. ``True`` forces it (ValueError when unsupported).

    ``shared``: the shared expert's (w1, w3, w2) as one-expert stacks of the routed ones' format;
    the result is then routed + shared (each in x.dtype, added in x.dtype, as ``MoE.forward``). On
    the TMA path it runs in the same launches, else as a second call here."""
    T, H = x.shape
    E, I, Hk = w1.shape
    if Hk != H or w2.shape[1:] != (H, I) or w3.shape != w1.shape:
        raise ValueError(f"expert shapes w1 {w1.shape} w3 {w3.shape} w2 {w2.shape} vs x {tuple(x.shape)}")
    if shared is not None and (len(shared) != 3 or tuple(w.shape for w in shared) != ((1, I, H), (1, I, H), (1, H, I))
                               or {type(w) for w in shared} != {type(w1)}):
        raise ValueError(f"shared must be (w1, w3, w2) one-expert stacks of shapes [1, {I}, {H}], [1, {I}, {H}], "
                         f"[1, {H}, {I}] in the routed experts' format ({type(w1).__name__}); got "
                         f"{[(type(w).__name__, tuple(w.shape)) for w in shared]}")
    if T == 0:
        return torch.empty((0, H), dtype=x.dtype, device=x.device)
    ok = tma_moe_supported(x, w1, w3, w2)
    if isinstance(w1, StackedMXFP4):  # no pointer-load variant for E8M0 scales
        if not ok or tma is False:
            raise ValueError("MXFP4 experts need the TMA MoE path: H, I multiples of 512, 16-byte aligned "
                             "stacks and sm_90+ (dsv4lab.kernels.dispatch.moe_decode falls back to the reference)")
        tma = True
    if tma is None:
        tma = ok and env_value("DSV4LAB_KERNEL_TMA", "1") != "0"
    elif tma and not ok:
        raise ValueError("the TMA MoE path needs H, I multiples of 256, 16-byte aligned stacks and sm_90+")
    if shared is not None and not (tma and tma_moe_supported(x, *shared)):
        one = torch.zeros((T, 1), dtype=torch.int32, device=x.device)
        routed = _moe_decode(x, ids, weights, w1, w3, w2, limit, tma, None)
        return routed + _moe_decode(x, one, torch.ones((T, 1), device=x.device), *shared, limit, tma, None)
    return _moe_decode(x, ids, weights, w1, w3, w2, limit, tma, shared)


def _moe_decode(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w1, w3, w2, limit: float | None,
                tma: bool, shared: tuple | None) -> torch.Tensor:
    """``moe_decode_triton`` after its checks, on the path ``tma`` chose (``shared`` only on the TMA one)."""
    T, H = x.shape
    k = ids.shape[1]
    E, I, _ = w1.shape
    x = x.contiguous()
    ids_c = expert_ids(ids)
    wts = weights.reshape(-1).to(torch.float32).contiguous()
    lim = float("inf") if limit is None or limit <= 0 else float(limit)
    if tma:
        return moe_decode_tma(x, ids_c, wts, w1, w3, w2, lim, k, shared)
    bn, g, warps = _cfg()
    h = x.new_empty((T * k, I))
    y = x.new_empty((T, H))

    def parts(w):
        p = w.packed.view(torch.int64)
        s = w.block_scale.view(torch.uint8)
        return p, s, w.global_scale.to(torch.float32).contiguous()

    p1, s1, g1 = parts(w1)
    p3, s3, g3 = parts(w3)
    p2, s2, g2 = parts(w2)
    kg1 = H // 16
    launch(_moe_up_kernel, (cdiv(I, bn), T * k),
           x, ids_c, p1, s1, g1, p3, s3, g3, h, I, kg1, k, x.stride(0), p1.stride(0), p1.stride(1),
        s1.stride(0), s1.stride(1), h.stride(0), lim, cdiv(kg1, g) * g, BN=bn, G=g, num_warps=warps)
    kg2 = I // 16
    launch(_moe_down_kernel, (cdiv(H, bn), T),
           h, ids_c, wts, p2, s2, g2, y, H, kg2, k, h.stride(0), p2.stride(0), p2.stride(1),
        s2.stride(0), s2.stride(1), y.stride(0), cdiv(kg2, g) * g, BN=bn, G=g, num_warps=warps)
    return y
