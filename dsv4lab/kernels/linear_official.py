"""Matmul for the official DeepSeek weight formats: MXFP4 (routed experts) and FP8-block (the rest).

y[M, N] = x[M, K] @ W^T with W kept as stored (``dsv4lab.quant.weights``):

* ``MXFP4Weight``: E2M1 codes packed two per byte (low nibble = even element), one E8M0 exponent
  per 32 elements along K. The rows are read as int64 words (16 codes); nibbles j and j+4 of an
  int32 become exact E2M1 * 2^-14 values with the shift/mask trick of ``nvfp4_matmul``, times
  2^(e-127) * 2^14 (exact), cast to bf16 (exact: 2 significant bits) and fed to ``tl.dot``
  nibble plane by nibble plane against the matching x^T plane.
* ``FP8BlockWeight`` (block 128): e4m3 tiles [BN, 128] cast to bf16 (exact) through ``tl.dot``
  against x^T [128, BM]; the fp32 block scale (E8M0 scales are widened on the host, a
  [N/128, K/128] tensor) multiplies each 128-wide partial product.

M >= 64 on sm_90+ takes the prefill GEMM of ``dsv4lab.kernels.linear_gemm`` (``TILED=True`` in
``config`` keeps the kernels here). One kernel per format covers decode (BM = 16) and prefill (BM = 64) over (N tiles, M tiles, K
splits); the loads go through Triton's software pipeline (``tl.range(num_stages=...)``, cp.async
on sm_80+). Split K finishes with the counter fix-up used by every kernel here (deterministic,
one launch, graph-safe). x is cast to bf16 (fp16 for fp16 x), the accumulation is fp32.

MXFP4 at decode (M <= 16, K % 512 == 0, sm_90+) instead goes through the TMA GEMV of
``nvfp4_gemv_tma`` with E8M0 block scales (one per two 16-groups, global scale 1): the TMA ring
and, at M = 1, the f16x2 loop of NVFP4; FP8-block at M = 1 (K % 128 == 0, sm_90+) through the TMA
GEMV of ``linear_fp8_tma`` (``config={"TMA": False}`` keeps the tiled kernel for both).

Measured on the H200 (docs/kernels.md); the dispatcher (``dsv4lab.kernels.dispatch.quant_linear``) still
checks each (format, shape, batch bucket, dtype, device) against the PyTorch reference on its
first call and keeps the reference, with a warning, where they disagree
(``verified_official_matmul``): a cheap guard for GPUs these kernels have not run on.
"""
from __future__ import annotations

import os
import warnings

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .device import on_input_device
from .host import INTERPRET, cdiv, counters, device_capability, dot_dtype, num_sms, weight_cached
from .launch import launch
from .dequant_gemm import DENSE_MIN_M
from .linear_fp8_tma import fp8_gemv, fp8_pair_gemv, scales_f32
from .linear_gemm import GEMM_MIN_M, gemm_supported, prefill_gemm
from .linear_nvfp4_tma import GemvTmaPlan, run_gemv_tma, tma_default_config, tma_supported
from .split_k import store_or_fix_up
from .weight_decode import e8m0_to_f32, nibble_plane_dots


@triton.jit
def _finish(acc, y_ptr, ws_ptr, cnt_ptr, offs_m, offs_n, M, N, stride_ym, pid_m, pid_n, pid_k, SPLIT,
            USE_SPLIT: tl.constexpr):
    """acc [BN, BM] (rows n, batch m) -> y[m, n] through the shared split-K finish."""
    store_or_fix_up(acc, y_ptr + offs_m[None, :] * stride_ym + offs_n[:, None], ws_ptr + offs_m[None, :] * N + offs_n[:, None],
                     (offs_n < N)[:, None] & (offs_m < M)[None, :], cnt_ptr, pid_m * tl.num_programs(0) + pid_n, pid_k,
                     M * N, SPLIT, 1.0, USE_SPLIT)


@triton.jit
def _mxfp4_kernel(x_ptr, w_ptr, s_ptr, y_ptr, ws_ptr, cnt_ptr, M, N, KW, stride_xm, stride_wn, stride_sn,
                  stride_ym, wps, SPLIT, USE_SPLIT: tl.constexpr, BN: tl.constexpr, BW: tl.constexpr,
                  BM: tl.constexpr, STAGES: tl.constexpr, DOT_DTYPE: tl.constexpr):
    """KW int64 words per row (16 codes each, 2 words per E8M0 scale); BW words per step."""
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_n = pid_n * BN + tl.arange(0, BN)
    offs_m = pid_m * BM + tl.arange(0, BM)
    n_ok = offs_n < N
    m_ok = offs_m < M
    w_lo_i = pid_k * wps
    w_hi_i = tl.minimum(w_lo_i + wps, KW)
    acc = tl.zeros((BN, BM), dtype=tl.float32)
    for w0 in tl.range(w_lo_i, w_hi_i, BW, num_stages=STAGES):
        ww = w0 + tl.arange(0, BW)
        wm = ww < w_hi_i
        w64 = tl.load(w_ptr + offs_n[:, None] * stride_wn + ww[None, :], mask=n_ok[:, None] & wm[None, :], other=0)
        sb = w0 // 2 + tl.arange(0, BW // 2)
        s8 = tl.load(s_ptr + offs_n[:, None] * stride_sn + sb[None, :], mask=n_ok[:, None] & (sb < KW // 2)[None, :],
                     other=127)
        sc = e8m0_to_f32(s8) * 16384.0                                       # [BN, BW/2]
        sc = tl.reshape(tl.join(sc, sc), (BN, BW))                             # word 2i and 2i+1 share scale i
        xt = x_ptr + offs_m[None, :] * stride_xm + ww[:, None] * 16            # x^T planes [BW, BM]
        acc = nibble_plane_dots(w64, sc, xt, wm[:, None] & m_ok[None, :], acc, DOT_DTYPE)
    _finish(acc, y_ptr, ws_ptr, cnt_ptr, offs_m, offs_n, M, N, stride_ym, pid_m, pid_n, pid_k, SPLIT, USE_SPLIT)


@triton.jit
def _fp8_block_kernel(x_ptr, w_ptr, s_ptr, y_ptr, ws_ptr, cnt_ptr, M, N, K, stride_xm, stride_wn, stride_sn,
                      stride_ym, kps, SPLIT, USE_SPLIT: tl.constexpr, BN: tl.constexpr, BM: tl.constexpr,
                      STAGES: tl.constexpr, DOT_DTYPE: tl.constexpr):
    """e4m3 W [N, K] with fp32 scales [ceil(N/128), ceil(K/128)]; BN divides 128, K steps of 128."""
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_n = pid_n * BN + tl.arange(0, BN)
    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_k = tl.arange(0, 128)
    n_ok = offs_n < N
    m_ok = offs_m < M
    k_lo = pid_k * kps
    k_hi = tl.minimum(k_lo + kps, K)
    s_row = s_ptr + (pid_n * BN // 128) * stride_sn
    acc = tl.zeros((BN, BM), dtype=tl.float32)
    for k0 in tl.range(k_lo, k_hi, 128, num_stages=STAGES):
        kk = k0 + offs_k
        km = kk < k_hi
        w8 = tl.load(w_ptr + offs_n[:, None] * stride_wn + kk[None, :], mask=n_ok[:, None] & km[None, :], other=0)
        w = w8.to(tl.float8e4nv, bitcast=True).to(tl.float32).to(DOT_DTYPE)
        xt = tl.load(x_ptr + offs_m[None, :] * stride_xm + kk[:, None], mask=km[:, None] & m_ok[None, :], other=0.0)
        part = tl.dot(w, xt.to(DOT_DTYPE))
        acc += part * tl.load(s_row + k0 // 128)
    _finish(acc, y_ptr, ws_ptr, cnt_ptr, offs_m, offs_n, M, N, stride_ym, pid_m, pid_n, pid_k, SPLIT, USE_SPLIT)


# ----------------------------------------------------------------------------- host side
def _tiles(M: int, N: int, K: int, device: torch.device, bn: int) -> tuple[int, int]:
    """(BM, K splits for the number of K steps ``K``): decode BM = 16, prefill 64; split K until
    the grid covers the SMs ~2x (at most 32 splits, at least 4 steps each)."""
    bm = 16 if M <= 16 else 64
    tiles = cdiv(N, bn) * cdiv(M, bm)
    split = max(1, min(cdiv(2 * num_sms(device), tiles), K // 4 if K >= 4 else 1, 32))
    return bm, split


def supported(x: torch.Tensor, w) -> bool:
    """Whether the kernel can take (x, w): MXFP4 anywhere triton runs; FP8-block with block 128 on
    sm_89+ (e4m3 conversions) or under the interpreter."""
    fmt = getattr(w, "format", None)
    if fmt == "mxfp4":
        return w.packed.data_ptr() % 8 == 0 and w.packed.stride(-1) == 1
    if fmt == "fp8_block":
        if w.block != 128 or w.data.stride(-1) != 1:
            return False
        return INTERPRET or (x.is_cuda and device_capability(x.device) >= (8, 9))
    return False


def mx_tma_supported(x2: torch.Tensor, w) -> bool:
    """MXFP4 decode through the TMA GEMV of ``nvfp4_gemv_tma`` (sm_90+): the E8M0 rows need a
    16-byte stride and 16-byte boxes (K % 512 == 0, boxes of 32 groups) and aligned bases."""
    K = w.shape[1]
    if K % 512 or w.packed.stride(0) != K // 2 or w.scale.stride(0) != K // 32:
        return False
    return tma_supported(x2, w.packed, w.scale)


def _mx_decode_tma(x2: torch.Tensor, w, y: torch.Tensor, cfg: dict) -> None:
    """M <= 16 MXFP4: the NVFP4 TMA GEMV's tiles with 32-group boxes (one E8M0 per two groups),
    rows capped at 128 (a 256-row box of 32 groups would be 64 KB per stage), global scale 1."""
    if not any(k != "TMA" for k in cfg):  # the default tiles: plan cached per weight (host.weight_cached)
        key = (id(w.scale), w.scale.data_ptr(), x2.shape[0] == 1, x2.dtype, x2.device)
        plan, s8 = weight_cached(w.packed, key, lambda: _mx_plan(x2, w, cfg))
        run_gemv_tma(plan, x2, s8, y)  # MX: no global scale (the gs argument is not read)
        return
    plan, s8 = _mx_plan(x2, w, cfg)
    run_gemv_tma(plan, x2, s8, y)


def _mx_plan(x2: torch.Tensor, w, cfg: dict) -> tuple[GemvTmaPlan, torch.Tensor]:
    N, K = w.shape
    base = tma_default_config(N, K, x2.device, x2.shape[0])
    base["BN"] = min(base["BN"], 128)
    tc = {**base, "G": 32, **{k: v for k, v in cfg.items() if k != "TMA"}, "MX": True}
    s8 = w.scale.view(torch.uint8)
    return GemvTmaPlan(w.packed, s8, tc, x2.shape[0] == 1, x2.dtype), s8


@on_input_device
def official_matmul(x: torch.Tensor, w, config: dict | None = None) -> torch.Tensor:
    """y[..., N] = x[..., K] @ W^T for an ``MXFP4Weight`` or ``FP8BlockWeight`` (``supported``)."""
    N, K = w.shape
    if x.shape[-1] != K:
        raise ValueError(f"x last dim {x.shape[-1]} != weight in_features {K}")
    if not supported(x, w):
        raise ValueError(f"no kernel for {type(w).__name__} (format {getattr(w, 'format', None)!r}) here")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, K)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    M = x2.shape[0]
    y = torch.empty((M, N), dtype=x.dtype, device=x.device)
    if M == 0:
        return y.reshape(*lead, N)
    cfg = dict(config or {})
    if gemm_supported(x2, K) and not cfg.get("TILED"):
        if w.format == "mxfp4":
            prefill_gemm(x2, "mxfp4", w.packed, w.scale, None, y, cfg)
        else:
            prefill_gemm(x2, "fp8_block", w.data, scales_f32(w), None, y, cfg)
        return y.reshape(*lead, N)
    if w.format == "mxfp4" and M <= 16 and cfg.get("TMA", True) and mx_tma_supported(x2, w):
        _mx_decode_tma(x2, w, y, cfg)
        return y.reshape(*lead, N)
    if w.format == "fp8_block" and M == 1 and cfg.get("TMA", True):
        tma_cfg = {k: v for k, v in cfg.items() if k != "TMA"}
        if fp8_gemv(x2, w, y, cfg=tma_cfg or None):
            return y.reshape(*lead, N)
    warps = cfg.get("num_warps", 1 if INTERPRET else 4)
    stages = cfg.get("STAGES", 2 if INTERPRET else 3)
    if w.format == "mxfp4":
        w64 = w.packed.view(torch.int64)
        s8 = w.scale.view(torch.uint8)
        bn, bw = cfg.get("BN", 16 if INTERPRET else 64), cfg.get("BW", 16)  # tl.dot needs K >= 16
        KW = K // 16
        bm, split = _tiles(M, N, KW // bw, x.device, bn)
        split = cfg.get("SPLIT", split)
        wps = cdiv(cdiv(KW, split), bw) * bw
        split = cdiv(KW, wps)
    else:
        s32 = scales_f32(w)
        bn = cfg.get("BN", 16 if INTERPRET else 64)
        if 128 % bn:
            raise ValueError(f"FP8-block BN {bn} must divide the 128-row scale block")
        bm, split = _tiles(M, N, cdiv(K, 128), x.device, bn)
        split = cfg.get("SPLIT", split)
        kps = cdiv(cdiv(K, split), 128) * 128
        split = cdiv(K, kps)
    bm = cfg.get("BM", bm)
    grid = (cdiv(N, bn), cdiv(M, bm), split)
    if split > 1:
        ws = torch.empty((split, M, N), dtype=torch.float32, device=x.device)
        cnt = counters(x.device, grid[0] * grid[1])
    else:
        ws, cnt = y, y
    if w.format == "mxfp4":
        launch(_mxfp4_kernel, grid, x2, w64, s8, y, ws, cnt, M, N, KW, x2.stride(0), w64.stride(0), s8.stride(0), y.stride(0),
                            wps, split, USE_SPLIT=split > 1, BN=bn, BW=bw, BM=bm, STAGES=stages,
                            DOT_DTYPE=dot_dtype(x2), num_warps=warps)
    else:
        launch(_fp8_block_kernel, grid, x2, w.data.view(torch.uint8), s32, y, ws, cnt, M, N, K, x2.stride(0), w.data.stride(0),
                                s32.stride(0), y.stride(0), kps, split, USE_SPLIT=split > 1, BN=bn, BM=bm,
                                STAGES=stages, DOT_DTYPE=dot_dtype(x2), num_warps=warps)
    return y.reshape(*lead, N)


_VERIFIED: dict = {}


def _verify_key(x: torch.Tensor, w) -> tuple:
    """The first-use check's key: (format, shape, batch bucket, dtype, device) of a call."""
    M = x.numel() // max(x.shape[-1], 1)
    tiers = (1, 16, GEMM_MIN_M - 1, DENSE_MIN_M - 1)  # one bucket per kernel path: GEMV, GEMV, tiled, GEMM, dense
    bucket = next((b for b in tiers if M <= b), DENSE_MIN_M)
    return (w.format, *w.shape, bucket, x.dtype, x.device.type, x.device.index)


def verified_official_pair(x: torch.Tensor, wa, wb) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``Attention.quant_pair_kernel`` for two FP8-block weights of one decode token: their GEMVs
    in one launch (``linear_fp8_tma.fp8_pair_gemv``, each output the bits of its own call) once
    both have passed ``verified_official_matmul``'s first-use check for this call's key (or it
    is off); None before that, or where the pair does not apply (the linears then run alone)."""
    if not (wa.format == wb.format == "fp8_block" and supported(x, wa) and supported(x, wb)):
        return None
    if os.environ.get("DSV4LAB_KERNEL_VERIFY", "1") != "0" and not (
            _VERIFIED.get(_verify_key(x, wa)) and _VERIFIED.get(_verify_key(x, wb))):
        return None
    return fp8_pair_gemv(x, wa, wb)


@on_input_device
def verified_official_matmul(x: torch.Tensor, w) -> torch.Tensor:
    """``official_matmul`` behind a first-use parity check per (format, N, K, batch bucket, dtype,
    device): the first call (outside CUDA-graph capture) also runs the reference and keeps the
    kernel only when |y - ref| <= 1e-2 |ref| + 1e-2 max|ref| everywhere; a call under capture
    before that check runs the reference (graph-safe). ``DSV4LAB_KERNEL_VERIFY=0`` skips the check."""
    ref = lambda: F.linear(x, w.dequantize(x.dtype))  # noqa: E731
    key = _verify_key(x, w)
    ok = _VERIFIED.get(key)
    if ok is None and os.environ.get("DSV4LAB_KERNEL_VERIFY", "1") == "0":
        ok = _VERIFIED[key] = True
    if ok is None:
        if x.is_cuda and torch.cuda.is_current_stream_capturing():
            return ref()
        y, r = official_matmul(x, w), ref()
        yf, rf = y.float(), r.float()
        ok = bool(((yf - rf).abs() <= 1e-2 * rf.abs() + 1e-2 * rf.abs().max()).all())
        _VERIFIED[key] = ok
        if not ok:
            warnings.warn(f"{w.format} kernel disagrees with the reference for {key}; keeping the reference "
                          f"(max |diff| {float((yf - rf).abs().max()):.3g}, max |ref| {float(rf.abs().max()):.3g})")
            return r
        return y
    return official_matmul(x, w) if ok else ref()
