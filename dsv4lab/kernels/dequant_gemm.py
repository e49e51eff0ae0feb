"""Large-M prefill GEMM: dequantise the weight once into a bounded scratch, then cuBLAS.

At M >= ``DENSE_MIN_M`` a quantised GEMM is compute-bound, and the registers-dequantising Triton
GEMM (``linear_gemm``) reaches ~50-60 % of cuBLAS BF16 on the H200: the dequantisation competes
with wgmma for the same warps. Writing the weight out in x.dtype costs one pass over it (read
0.56 B, write 2 B an element for FP4; cuBLAS then reads the 2 B), ~5 % of a V4-Pro-shaped GEMM at
M = 4096 (q_b: ~60 us against ~1.2 ms), and the GEMM itself is cuBLAS's.

Numerics: ``_dequant_kernel`` computes what ``w.dequantize(dtype)`` computes (E2M1 x block scale
exact in fp32, times NVFP4's global scale, one rounding to x.dtype; FP8: e4m3 x fp32 scale, one
rounding), so y equals ``F.linear(x, w.dequantize(x.dtype))`` bitwise wherever ``torch.mm`` and
``F.linear`` pick the same cuBLAS kernel (tests/test_dequant_gemm.py).

Memory: the scratch holds at most ``SCRATCH_BYTES`` of dequantised rows; a larger weight (the
lm_head) runs in row chunks, each chunk's output copied into its columns of y. Imports triton:
import lazily.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .host import INTERPRET, cdiv
from .launch import launch
from .rounding import round_to
from .weight_decode import FMT_NVFP4, FORMAT_CODES, dequant_tile

DENSE_MIN_M = 512           # from this many rows on, dequantise + cuBLAS (benchmarks/gemm.py --m sweep)
SCRATCH_BYTES = 256 << 20   # the dequantised rows held at once (V4-Pro q_b in bf16: 201 MB, one chunk)
# the dequantiser's tiles (H200; WORDS: int32 loads of 8 codes, not bytes)
DEQUANT_TILES = ({"BN": 32, "BK": 64, "WORDS": False, "num_warps": 4} if INTERPRET
                 else {"BN": 64, "BK": 128, "WORDS": False, "num_warps": 4})


@triton.jit
def _dequant_kernel(w_ptr, s_ptr, gs_ptr, out_ptr, row0, N, stride_wn, stride_sn, stride_on,
                    FMT: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, WORDS: tl.constexpr):
    """out[r, k0:k0+BK] = W[row0 + r, k0:k0+BK] (times NVFP4's global scale), rounded once to
    out's dtype; rows r of one BN tile, columns of one BK tile."""
    offs = tl.program_id(0) * BN + tl.arange(0, BN)
    ok = offs < N
    rows = tl.minimum(offs, N - 1).to(tl.int64) + row0  # int64: a 384-expert stack passes 2^31 bytes
    k0 = tl.program_id(1) * BK
    w = dequant_tile(w_ptr, s_ptr, rows, ok, k0, stride_wn, stride_sn, BN, BK, FMT, tl.float32, WORDS)
    if FMT == FMT_NVFP4:
        w = w * tl.load(gs_ptr).to(tl.float32)
    out_ty = out_ptr.dtype.element_ty
    tl.store(out_ptr + offs.to(tl.int64)[:, None] * stride_on + (k0 + tl.arange(0, BK))[None, :],
             round_to(w, out_ty).to(out_ty), mask=ok[:, None])


def dequantize_rows(fmt: str, data: torch.Tensor, scale: torch.Tensor, gs: torch.Tensor | None, row0: int,
                    rows: int, dtype: torch.dtype, out: torch.Tensor | None = None, cfg: dict | None = None) -> torch.Tensor:
    """Rows ``row0 .. row0 + rows`` of the stored weight (``data``: packed FP4 bytes [N, K/2] or
    e4m3 [N, K]; ``scale``: e4m3 / E8M0 bytes, or FP8-block fp32 [ceil(N/128), ceil(K/128)]; ``gs``:
    NVFP4's fp32 global scale, one element) as [rows, K] ``dtype`` (into ``out`` when given).
    ``cfg`` overrides the tiles (BN, BK, WORDS, num_warps: ``benchmarks/gemm.py --dequant``)."""
    K = data.shape[1] * (1 if fmt == "fp8_block" else 2)
    if not dense_supported(K):
        raise ValueError(f"dequantize_rows: K = {K} must be a multiple of 32 (the FP4 scale blocks)")
    c = {**DEQUANT_TILES, **(cfg or {})}
    bk = next(b for b in (c["BK"], 64, 32) if K % b == 0 and b <= c["BK"])
    words = bool(c["WORDS"]) and fmt != "fp8_block" and data.data_ptr() % 4 == 0 and data.stride(0) % 4 == 0
    if out is None:
        out = torch.empty((rows, K), dtype=dtype, device=data.device)
    if rows == 0:
        return out
    d = data.view(torch.int32) if words else data.view(torch.uint8)
    s = scale if fmt == "fp8_block" else scale.view(torch.uint8)
    g = gs if gs is not None else s
    launch(_dequant_kernel, (cdiv(rows, c["BN"]), K // bk), d, s, g, out, row0, rows, data.view(torch.uint8).stride(0),
           s.stride(0), out.stride(0), FMT=FORMAT_CODES[fmt], BN=c["BN"], BK=bk, WORDS=words, num_warps=c["num_warps"])
    return out


def dense_supported(K: int) -> bool:
    """The dequantiser's column tiles (128, 64 or 32) need K a multiple of 32, like the GEMM's."""
    return K > 0 and K % 32 == 0


def chunk_rows(N: int, K: int, dtype: torch.dtype) -> int:
    """Weight rows dequantised at once: all N if they fit ``SCRATCH_BYTES``, else a multiple of 128
    (FP8-block scale rows stay whole) that does."""
    per_row = K * torch.empty((), dtype=dtype).element_size()
    if N * per_row <= SCRATCH_BYTES:
        return N
    return max(128, SCRATCH_BYTES // per_row // 128 * 128)


def dense_gemm(x2: torch.Tensor, fmt: str, data: torch.Tensor, scale: torch.Tensor, gs: torch.Tensor | None,
               y: torch.Tensor) -> None:
    """y [M, N] = x2 [M, K] @ W^T: W dequantised to x2.dtype in chunks of ``chunk_rows``, each
    multiplied by ``torch.mm`` (cuBLAS on CUDA)."""
    N = data.shape[0]
    K = x2.shape[1]
    step = chunk_rows(N, K, x2.dtype)
    if step >= N:
        torch.mm(x2, dequantize_rows(fmt, data, scale, gs, 0, N, x2.dtype).t(), out=y)
        return
    scratch = torch.empty((step, K), dtype=x2.dtype, device=x2.device)
    for n0 in range(0, N, step):
        n = min(step, N - n0)
        w = dequantize_rows(fmt, data, scale, gs, n0, n, x2.dtype, out=scratch[:n])
        y[:, n0:n0 + n] = torch.mm(x2, w.t())


__all__ = ["DENSE_MIN_M", "SCRATCH_BYTES", "dequantize_rows", "dense_supported", "chunk_rows", "dense_gemm"]
