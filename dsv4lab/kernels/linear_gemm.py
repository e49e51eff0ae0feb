"""W4A16 prefill GEMM (M >= 64) for NVFP4, MXFP4 and FP8-block weights on tensor cores.

y[M, N] = x[M, K] @ W^T with W kept as stored: each program dequantises a [BN, BK] weight tile in
registers (``weight_decode.dequant_tile``: nibbles decoded into K order, block scales applied, one
rounding to bf16/fp16 that is exact for the FP4 formats) and feeds it to ``tl.dot`` (wgmma on
sm_90) against the [BM, BK] activation tile; the K loop is software-pipelined
(``tl.range(num_stages=STAGES)``: cp.async into shared memory), so the weight bytes, scales and x
of the next steps are in flight while this step decodes and multiplies. Scales are read once per
K step (BK / 16 e4m3, BK / 32 E8M0, one fp32 per 128-column FP8 block).

Two tile orientations, chosen per shape by ``gemm_tiles`` (a fixed rule, no run-time tuning: the
summation order is the same on every GPU):

* ``SWAP`` (small M, e.g. 128): acc[BN, BM] = W_tile @ x_tile^T, weight rows as the MMA's M side
  (64 rows per warpgroup) and the tokens as its N side, so a 128-token batch fills one tile; the
  few (M, N) tiles are split over K (the counter fix-up of ``split_k.store_or_fix_up``: fp32
  partials summed in split order, one launch, deterministic) until they cover the SMs.
* plain (large M): acc[BM, BN] = x_tile @ W_tile^T in 128 x 128 / 128 x 256 tiles, programs in
  groups of GROUP_M row tiles sharing the weight columns (L2 reuse of the decoded weights' bytes).

NVFP4's global scale multiplies the fp32 accumulator (like ``linear_nvfp4``); the reference
rounds W * global scale to bf16 instead (tolerances in docs/kernels.md).
Imports triton: import lazily (``dsv4lab.kernels.dispatch`` reaches it through ``linear_nvfp4``
and ``linear_official``).
"""
from __future__ import annotations

import functools
import warnings

import torch
import triton
import triton.language as tl

from .dequant_gemm import DENSE_MIN_M, dense_gemm, dense_supported
from .host import INTERPRET, cdiv, counters, device_capability, dot_dtype, num_sms
from .launch import launch
from .split_k import store_or_fix_up
from .weight_decode import FMT_FP8, FMT_MXFP4, FMT_NVFP4, FORMAT_CODES, dequant_tile

try:  # Gluon (triton >= 3.5): the async-wgmma GEMM for 64..511 tokens of the FP4 formats
    from .linear_gemm_wgmma import launch_wgmma_gemm, wgmma_supported
except ImportError:  # an older triton: this module's tiles take those batches
    launch_wgmma_gemm = wgmma_supported = None

GEMM_MIN_M = 64  # from this batch on, the prefill GEMM (below: the GEMV / older tiled kernels)


@triton.jit
def grouped_tile(pid, num_m, num_n, GROUP_M: tl.constexpr):
    """Program ``pid`` -> (row tile, column tile), GROUP_M row tiles at a time per column tile."""
    per_group = GROUP_M * num_n
    first_m = (pid // per_group) * GROUP_M
    size_m = tl.minimum(num_m - first_m, GROUP_M)
    return first_m + (pid % per_group) % size_m, (pid % per_group) // size_m


@triton.jit
def _gemm_kernel(x_ptr, w_ptr, s_ptr, gs_ptr, y_ptr, ws_ptr, cnt_ptr, M, N, K, k_per_split, SPLIT,
                 stride_xm, stride_wn, stride_sn, stride_ym,
                 FMT: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
                 SWAP: tl.constexpr, STAGES: tl.constexpr, DOT_DTYPE: tl.constexpr, USE_SPLIT: tl.constexpr,
                 WORDS: tl.constexpr):
    num_m = tl.cdiv(M, BM)
    num_n = tl.cdiv(N, BN)
    pid_m, pid_n = grouped_tile(tl.program_id(0), num_m, num_n, GROUP_M)
    pid_k = tl.program_id(1)
    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_n = pid_n * BN + tl.arange(0, BN)
    m_ok = offs_m < M
    n_ok = offs_n < N
    # rows past the end read the last row (unmasked loads pipeline as whole vectors); not stored
    x_rows = x_ptr + tl.minimum(offs_m, M - 1)[:, None] * stride_xm
    w_rows = tl.minimum(offs_n, N - 1)
    offs_k = tl.arange(0, BK)
    k_lo = pid_k * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    if SWAP:
        acc = tl.zeros((BN, BM), dtype=tl.float32)
    else:
        acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in tl.range(k_lo, k_hi, BK, num_stages=STAGES):
        xt = tl.load(x_rows + (k0 + offs_k)[None, :]).to(DOT_DTYPE)
        w = dequant_tile(w_ptr, s_ptr, w_rows, n_ok, k0, stride_wn, stride_sn, BN, BK, FMT, DOT_DTYPE, WORDS)
        if SWAP:
            acc = tl.dot(w, tl.trans(xt), acc)
        else:
            acc = tl.dot(xt, tl.trans(w), acc)
    gs = 1.0
    if FMT == FMT_NVFP4:
        gs = tl.load(gs_ptr).to(tl.float32)
    tile = pid_m * num_n + pid_n
    if SWAP:
        store_or_fix_up(acc, y_ptr + offs_m[None, :] * stride_ym + offs_n[:, None],
                        ws_ptr + offs_m[None, :] * N + offs_n[:, None], n_ok[:, None] & m_ok[None, :],
                        cnt_ptr, tile, pid_k, M * N, SPLIT, gs, USE_SPLIT)
    else:
        store_or_fix_up(acc, y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :],
                        ws_ptr + offs_m[:, None] * N + offs_n[None, :], m_ok[:, None] & n_ok[None, :],
                        cnt_ptr, tile, pid_k, M * N, SPLIT, gs, USE_SPLIT)


# ----------------------------------------------------------------------------- host side
def block_k(K: int) -> int:
    """The K step: 128 where it divides K (every V4-Pro shape), else 64 or 32; 0 = no kernel."""
    for bk in (128, 64, 32):
        if K % bk == 0:
            return bk
    return 0


def gemm_tiles(fmt: str, M: int, N: int, K: int, device: torch.device) -> dict:
    """The fixed tile rule (H200, 132 SMs; from ``benchmarks/gemm.py --sweep``, docs/kernels.md).
    Always SWAP (weight rows on the MMA's M side, where the registers-dequantised tile can feed
    wgmma directly): M <= 256 in tiles of 128 weight rows x 64/128 tokens, BK 64 when the row tiles
    alone cover the SMs (q_b), else BK 128 and K split into as many parts as fill one wave (>= 4 K steps a
    split), and there, up to 128 tokens of the FP4 formats, 64 weight rows and 4 warps at that
    split (H100, M = 128, graph replays, ``benchmarks/results/kernels/m128_probe``: q_a 36.7 -> 33.4
    us, o_b 158 -> 139, w1/w3 47.5 -> 40.4, w2 42.1 -> 36.7 NVFP4; MXFP4 1-7 % less; q_b, whose
    128-row tiles cover the SMs, lost 10 % with them); larger M in 128 rows x 256 tokens, BK 64
    (M = 4096: 1.6-1.8x the 128 x 256 plain tiles on q_b, o_b and the experts, all three formats)."""
    bk = block_k(K)
    if INTERPRET:
        return {"BM": 64 if M <= 64 else 128, "BN": 32, "BK": min(bk, 64), "SWAP": M <= 256, "GROUP_M": 2,
                "STAGES": 2, "SPLIT": 1, "num_warps": 4}
    sms = num_sms(device)
    warps = 8
    if M <= 256:
        bm, bn, bk2 = (64 if M <= 64 else 128), 128, min(bk, 128)
        if cdiv(N, bn) >= sms:
            bk2 = min(bk, 64)
    else:
        bm, bn, bk2 = 256, 128, min(bk, 64)
    tiles = cdiv(M, bm) * cdiv(N, bn)
    steps = K // bk2
    split = 1
    if tiles < sms:  # one wave: a program per SM holds these tiles (~120 KB of stages), so a grid
        split = max(1, min(sms // tiles, steps // 4, 32))  # past the SM count runs a second, mostly idle wave
        if M <= 128 and fmt != "fp8_block":  # then 64 weight rows, 4 warps: twice the programs at the same split
            bn, warps = 64, 4
    return {"BM": bm, "BN": bn, "BK": bk2, "SWAP": True, "GROUP_M": 8, "STAGES": 3, "SPLIT": split,
            "num_warps": warps}


def gemm_supported(x2: torch.Tensor, K: int) -> bool:
    """The prefill GEMM takes M >= GEMM_MIN_M with K a multiple of 32 on sm_90+ (its tiles were
    chosen for Hopper) or under the interpreter; other cases keep the older kernels."""
    if x2.shape[0] < GEMM_MIN_M or not block_k(K):
        return False
    return INTERPRET or (x2.is_cuda and device_capability(x2.device) >= (9, 0))


# the tile rule per (format, M, N, K, device): a prefill launch at M = 128 is host-bound (~90 us a
# call on the H200 through kernel[grid] with the rule recomputed, against a few us of GPU time)
_cached_tiles = functools.lru_cache(maxsize=4096)(lambda fmt, M, N, K, device: gemm_tiles(fmt, M, N, K, device))


def launch_gemm(x2: torch.Tensor, fmt: str, data: torch.Tensor, scale: torch.Tensor, gs: torch.Tensor | None,
                y: torch.Tensor, cfg: dict | None = None) -> None:
    """y [M, N] = x2 [M, K] @ W^T for W = (``data``, ``scale``) of format ``fmt``: NVFP4 (packed
    uint8 [N, K/2], e4m3 [N, K/16], ``gs`` fp32 [1]), MXFP4 (packed, E8M0 [N, K/32]) or FP8-block
    (e4m3 [N, K], fp32 scales [ceil(N/128), ceil(K/128)]). ``cfg`` overrides ``gemm_tiles``."""
    M, K = x2.shape
    N = data.shape[0]
    c = _cached_tiles(fmt, M, N, K, x2.device) if not cfg else {**gemm_tiles(fmt, M, N, K, x2.device), **cfg}
    bm, bn, bk = c["BM"], c["BN"], c["BK"]
    if K % bk or bk % 32 or (fmt == "fp8_block" and 128 % bk):
        raise ValueError(f"BK {bk} must be a multiple of 32 dividing K = {K} (FP8-block: and 128)")
    kps = cdiv(cdiv(K, c["SPLIT"]), bk) * bk
    split = cdiv(K, kps)
    grid = (cdiv(M, bm) * cdiv(N, bn), split)
    if split > 1:
        ws = torch.empty((split, M, N), dtype=torch.float32, device=x2.device)
        cnt = counters(x2.device, grid[0])
    else:
        ws, cnt = y, y
    s = scale.view(torch.uint8) if fmt != "fp8_block" else scale
    wd = data.view(torch.int32) if c.get("WORDS") and fmt != "fp8_block" else data.view(torch.uint8)
    launch(_gemm_kernel, grid, x2, wd, s, gs if gs is not None else s, y, ws, cnt, M, N, K, kps, split,
           x2.stride(0), data.stride(0), s.stride(0), y.stride(0),
           FMT=FORMAT_CODES[fmt], BM=bm, BN=bn, BK=bk, GROUP_M=c["GROUP_M"], SWAP=c["SWAP"],
           STAGES=c["STAGES"], DOT_DTYPE=dot_dtype(x2), USE_SPLIT=split > 1,
           WORDS=c.get("WORDS", False) and fmt != "fp8_block", num_warps=c["num_warps"])


def prefill_gemm(x2: torch.Tensor, fmt: str, data: torch.Tensor, scale: torch.Tensor, gs: torch.Tensor | None,
                 y: torch.Tensor, cfg: dict | None = None) -> None:
    """The prefill GEMM's tier for this M: from ``DENSE_MIN_M`` rows on, dequantise + cuBLAS
    (``dequant_gemm.dense_gemm``: compute-bound there, and cuBLAS is ~1.7x this module's tiles);
    below, for NVFP4 / MXFP4 on sm_90 with Gluon, ``linear_gemm_wgmma`` (async wgmma, the next
    tile decoded while the last multiplies); else ``launch_gemm``. ``cfg``: ``DENSE`` / ``WGMMA``
    force a tier; tile keys force ``launch_gemm``."""
    c = dict(cfg or {})
    dense = c.pop("DENSE", None)
    wgmma = c.pop("WGMMA", None)
    if dense is None:
        dense = not c and wgmma is None and x2.shape[0] >= DENSE_MIN_M and dense_supported(x2.shape[1])
    if dense:
        dense_gemm(x2, fmt, data, scale, gs, y)
        return
    if wgmma is None and not c and _wgmma_ok[0] and wgmma_supported is not None and wgmma_supported(x2, fmt, data):
        try:
            launch_wgmma_gemm(x2, fmt, data, scale, gs, y)
            return
        except Exception as e:  # noqa: BLE001 - a triton whose Gluon this kernel does not compile on
            _wgmma_ok[0] = False
            warnings.warn(f"the Gluon GEMM (linear_gemm_wgmma) failed here ({type(e).__name__}: {e}); "
                          "the Triton tiles take these calls from now on")
    if wgmma:  # forced by cfg: errors surface
        launch_wgmma_gemm(x2, fmt, data, scale, gs, y)
    else:
        launch_gemm(x2, fmt, data, scale, gs, y, c or None)


_wgmma_ok = [True]  # False once the Gluon GEMM failed to compile or launch in this process


__all__ = ["GEMM_MIN_M", "prefill_gemm", "FMT_NVFP4", "FMT_MXFP4", "FMT_FP8", "gemm_tiles", "gemm_supported", "launch_gemm",
           "block_k", "grouped_tile"]
