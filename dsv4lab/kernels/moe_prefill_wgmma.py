"""The routed experts' grouped prefill GEMMs on Hopper tensor cores, in Gluon (async wgmma).

Why: with V4-Pro's 384 experts a 4096-token chunk gives each expert ~64 rows, so the dense tier
(dequantise + cuBLAS) never applies and ``moe_prefill``'s Triton grouped kernel ran at ~115 TFLOP/s
(28.8 ms a layer on the H200): it decodes a weight tile in the warps that then wait on its wgmma,
the M = 128 problem ``linear_gemm_wgmma`` solved. This module runs that kernel's K loop
(``linear_gemm_wgmma.k_step``: TMA ring, packed decode into a double-buffered wgmma operand, async
wgmma overlapped with the next decode) over ``moe_prefill.expert_schedule``'s tiles:

* one CTA: 128 weight rows x one tile of BM sorted rows of one expert (``tile_e`` / ``tile_r0`` /
  ``tile_r1``), the whole K (no split: the tiles fill the GPU many times over); surplus tiles of the
  schedule's bound (``tile_e`` -1) return at once (CUDA-graph safe: no host sync);
* up (``DUAL``): the 128 rows are 64 of w1 and the same 64 of w3 (two TMA boxes into one ring
  slot, one wgmma), so gate and up of 64 columns come out of one accumulator; the epilogue
  exchanges the halves through shared memory, then the Triton kernel's epilogue: the global scales,
  each product rounded to x's dtype, clamped SwiGLU (clamp before SiLU), the routing weight;
* down: 128 columns of w2 over h's rows (already sorted).

The x rows of the up GEMM are gathered by the caller into sorted order (``x[src]``): TMA on Hopper
reads boxes, not gathered rows. That buffer [T*k, H] lives only until h exists and takes the place y
[T*k, H] takes next, so the prefill's peak does not grow. Deterministic: no atomics, no split.
"""
from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, warpgroup_mma_wait
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from ..quant.stacked import StackedMXFP4, StackedNVFP4
from .host import cdiv, device_capability
from .linear_gemm_wgmma import FRAG_WORDS, k_step, k_step_fragment, cta_barrier, fragment_column, tma_load
from .weight_decode import FMT_NVFP4, FORMAT_CODES

BN, BK, STAGES, WARPS = 128, 64, 4, 8  # the dense kernel's tile (H100 probe, linear_gemm_wgmma.wgmma_tiles)


@gluon.jit
def _load_step(x_desc, w_desc, w3_desc, bar, x_buf, w_buf, r0, wr0, k, ok, DUAL: gl.constexpr, HALF: gl.constexpr):
    """TMA of one K step into a ring slot: the x rows' tile and the weight rows (DUAL: w1's and w3's
    HALF rows into the slot's two halves)."""
    tma_load(x_desc, [r0, k], bar, x_buf, pred=ok)
    if DUAL:
        tma_load(w_desc, [wr0, k // 2], bar, w_buf.slice(0, HALF), pred=ok)
        tma_load(w3_desc, [wr0, k // 2], bar, w_buf.slice(HALF, HALF), pred=ok)
    else:
        tma_load(w_desc, [wr0, k // 2], bar, w_buf, pred=ok)


@gluon.jit
def _refill(x_desc, w_desc, w3_desc, ready, x_smem, w_smem, i, n_steps, r0, wr0, nbytes: gl.constexpr,
            BK: gl.constexpr, STAGES: gl.constexpr, DUAL: gl.constexpr, HALF: gl.constexpr, SYNC: gl.constexpr = True):
    """At step i (step i - 1's wgmma done in this warpgroup): refill step i - 1's ring slot with step
    i - 1 + STAGES. ``SYNC``: a CTA barrier first (A from registers: nothing else has made both
    warpgroups pass their wait)."""
    if SYNC:
        cta_barrier()
    nxt = i - 1 + STAGES
    ok = nxt < n_steps
    sp = (i + STAGES - 1) % STAGES
    mbarrier.expect(ready.index(sp), nbytes, pred=ok)
    _load_step(x_desc, w_desc, w3_desc, ready.index(sp), x_smem.index(sp), w_smem.index(sp), r0, wr0, nxt * BK, ok,
               DUAL, HALF)


@gluon.jit
def _grouped_wgmma_kernel(x_desc, w_desc, w3_desc, s_ptr, s3_ptr, gs_ptr, gs3_ptr, tile_e_ptr, tile_r0_ptr,
                          tile_r1_ptr, rw_ptr, y_ptr, N, K, n_cols, stride_sn, stride_ym, limit,
                          FMT: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr,
                          STAGES: gl.constexpr, DUAL: gl.constexpr, CLAMP: gl.constexpr, WEIGHT: gl.constexpr,
                          FRAG: gl.constexpr, num_warps: gl.constexpr):
    """y[rows, cols] of one (schedule tile, column block) (module docstring). Weights as 2-D
    [E * N, K/2] views: expert e's rows start at e * N."""
    pid = gl.program_id(0)
    tile = pid // n_cols
    e = gl.load(tile_e_ptr + tile)
    if e >= 0:
        HALF: gl.constexpr = BN // 2
        OUT: gl.constexpr = HALF if DUAL else BN   # output columns a CTA
        r0 = gl.load(tile_r0_ptr + tile)
        r1 = gl.load(tile_r1_ptr + tile)
        n0 = (pid % n_cols) * OUT
        wr0 = e * N + n0
        n_steps = K // BK
        dt: gl.constexpr = x_desc.dtype

        mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                      instr_shape=[16, BM, 16])
        if FRAG:   # A decoded into wgmma's registers (linear_gemm_wgmma: fragment order)
            wl: gl.constexpr = FRAG_WORDS
        else:      # A decoded into a double-buffered shared-memory operand
            wl: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 2], threads_per_warp=[32 // (BK // 16), BK // 16],
                                                warps_per_cta=[num_warps, 1], order=[1, 0])
        F16: gl.constexpr = dt == gl.float16
        x_smem = gl.allocate_shared_memory(dt, [STAGES, BM, BK], x_desc.layout)
        w_smem = gl.allocate_shared_memory(gl.uint8, [STAGES, BN, BK // 2], w_desc.layout)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for j in gl.static_range(STAGES):
            mbarrier.init(ready.index(j), count=1)
        nbytes: gl.constexpr = x_desc.block_type.nbytes + BN * BK // 2
        for j in gl.static_range(STAGES):
            ok = j < n_steps
            mbarrier.expect(ready.index(j), nbytes, pred=ok)
            _load_step(x_desc, w_desc, w3_desc, ready.index(j), x_smem.index(j), w_smem.index(j), r0, wr0, j * BK, ok,
                       DUAL, HALF)

        rows = gl.arange(0, BN, layout=gl.SliceLayout(1, wl))
        word = gl.arange(0, BK // 8, layout=gl.SliceLayout(0, wl))
        if DUAL:   # slot rows 0..HALF-1 are w1's, HALF.. w3's, both for columns n0 + row % HALF
            col = n0 + rows % HALF
            srow = gl.expand_dims(wr0 + rows % HALF, 1) * stride_sn
            first = gl.expand_dims(rows < HALF, 1)
        else:
            col = n0 + rows
            srow = gl.expand_dims(wr0 + rows, 1) * stride_sn
        sc_mask = gl.expand_dims(col < N, 1) & gl.expand_dims(word < BK // 8, 0)
        if FMT == FMT_NVFP4:   # one scale a 16-code group (two words)
            sc_off = srow + gl.expand_dims(word // 2, 0)
        else:          # one E8M0 a 32-code group (four words)
            sc_off = srow + gl.expand_dims(word // 4, 0)
        if DUAL:
            sc_base = gl.where(first, s_ptr + sc_off, s3_ptr + sc_off)
        else:
            sc_base = s_ptr + sc_off

        # step 0 peeled, as in linear_gemm_wgmma (keeps ptxas from serialising the async wgmmas)
        acc = gl.zeros([BN, BM], gl.float32, mma)
        if FRAG:   # unrolled by 2: A alternates between two register sets (linear_gemm_wgmma, fragment order)
            dot_a: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
            acc = k_step_fragment(acc, 0, 0, ready, w_smem, x_smem, sc_base, sc_mask, FMT, BN, BK, STAGES, wl, dot_a,
                                  F16)
            for j in range(0, (n_steps - 1) // 2):
                acc = k_step_fragment(acc, 1 + 2 * j, 0, ready, w_smem, x_smem, sc_base, sc_mask, FMT, BN, BK, STAGES,
                                     wl, dot_a, F16)
                _refill(x_desc, w_desc, w3_desc, ready, x_smem, w_smem, 1 + 2 * j, n_steps, r0, wr0, nbytes, BK,
                        STAGES, DUAL, HALF)
                acc = k_step_fragment(acc, 2 + 2 * j, 0, ready, w_smem, x_smem, sc_base, sc_mask, FMT, BN, BK, STAGES,
                                     wl, dot_a, F16)
                _refill(x_desc, w_desc, w3_desc, ready, x_smem, w_smem, 2 + 2 * j, n_steps, r0, wr0, nbytes, BK,
                        STAGES, DUAL, HALF)
            if (n_steps - 1) % 2 == 1:
                acc = k_step_fragment(acc, n_steps - 1, 0, ready, w_smem, x_smem, sc_base, sc_mask, FMT, BN, BK, STAGES,
                                     wl, dot_a, F16)
        else:
            a_l: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BN, BK], dt)
            a_smem = gl.allocate_shared_memory(dt, [2, BN, BK], a_l)
            acc = k_step(acc, 0, 0, ready, w_smem, x_smem, a_smem, sc_base, sc_mask, FMT, BN, BK, STAGES, 0, wl, F16)
            acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc, ))
            for i in range(1, n_steps):
                acc = k_step(acc, i, 0, ready, w_smem, x_smem, a_smem, sc_base, sc_mask, FMT, BN, BK, STAGES, 0, wl,
                            F16)
                acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc, ))   # step i - 1's wgmma is done:
                _refill(x_desc, w_desc, w3_desc, ready, x_smem, w_smem, i, n_steps, r0, wr0, nbytes, BK, STAGES,
                        DUAL, HALF, False)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
        for j in gl.static_range(STAGES):
            mbarrier.invalidate(ready.index(j))

        out_ty: gl.constexpr = y_ptr.dtype.element_ty
        if DUAL:
            # gate (rows < HALF) and up (rows >= HALF) of one column sit in different warpgroups:
            # exchange through shared memory, then one thread a (column, row) pair
            el: gl.constexpr = gl.BlockedLayout(size_per_thread=[2, 1], threads_per_warp=[32, 1],
                                                warps_per_cta=[1, num_warps], order=[0, 1])
            epi = gl.allocate_shared_memory(gl.float32, [BN, BM],
                                            gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[1, 0]))
            cta_barrier()   # both warpgroups' wgmmas done: epi may reuse the ring's shared memory
            epi.store(acc)
            cta_barrier()
            g = epi.slice(0, HALF).load(el)
            u = epi.slice(HALF, HALF).load(el)
            if FMT == FMT_NVFP4:
                g = g * gl.load(gs_ptr + e)
                u = u * gl.load(gs3_ptr + e)
            g = g.to(out_ty).to(gl.float32)   # each linear's output in x's dtype, as the reference
            u = u.to(out_ty).to(gl.float32)
            if CLAMP:
                g = gl.minimum(g, limit)
                u = gl.minimum(gl.maximum(u, -limit), limit)
            h = ((g / (1.0 + gl.exp(-g))).to(out_ty).to(gl.float32) * u).to(out_ty).to(gl.float32)
            offs_n = n0 + gl.arange(0, HALF, layout=gl.SliceLayout(1, el))
            offs_r = r0 + gl.arange(0, BM, layout=gl.SliceLayout(0, el))
            if WEIGHT:
                w_r = gl.load(rw_ptr + offs_r, mask=offs_r < r1, other=0.0).to(out_ty).to(gl.float32)
                h = (h * gl.expand_dims(w_r, 0)).to(out_ty).to(gl.float32)
            cols = offs_n
            if FRAG:   # h is the down GEMM's x: its columns in fragment order
                cols = fragment_column(offs_n)
        else:
            h = acc
            if FMT == FMT_NVFP4:
                h = h * gl.load(gs_ptr + e)
            offs_n = n0 + gl.arange(0, BN, layout=gl.SliceLayout(1, mma))
            offs_r = r0 + gl.arange(0, BM, layout=gl.SliceLayout(0, mma))
            cols = offs_n
        mask = gl.expand_dims(offs_n < N, 1) & gl.expand_dims(offs_r < r1, 0)
        gl.store(y_ptr + gl.expand_dims(offs_r.to(gl.int64), 0) * stride_ym + gl.expand_dims(cols, 1),
                 h.to(out_ty), mask=mask)


def _stack_parts(w) -> tuple[str, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(format, 2-D [E*N, K/2] codes, 2-D scales as bytes, per-expert fp32 global scales or None)."""
    E, N, _ = w.shape
    if isinstance(w, StackedNVFP4):
        return ("nvfp4", w.packed.reshape(E * N, -1), w.block_scale.view(torch.uint8).reshape(E * N, -1),
                w.global_scale.reshape(E).float().contiguous())
    if isinstance(w, StackedMXFP4):
        return "mxfp4", w.packed.reshape(E * N, -1), w.scale.view(torch.uint8).reshape(E * N, -1), None
    raise ValueError(f"grouped_wgmma: weights must be StackedNVFP4 or StackedMXFP4, got {type(w).__name__}")


def grouped_wgmma_supported(x: torch.Tensor, w1, w3, w2) -> bool:
    """sm_90+, bf16 x (fp16 too for NVFP4: an E8M0 scale need not be an f16), stacks of one FP4
    format, packed codes contiguous and 16-byte aligned (TMA), H and I multiples of BK (whole K
    steps)."""
    if not (x.is_cuda and device_capability(x.device) >= (9, 0)):
        return False
    if len({type(w) for w in (w1, w3, w2)}) != 1 or not isinstance(w1, (StackedNVFP4, StackedMXFP4)):
        return False
    E, I, H = w1.shape
    if I % BK or H % BK:
        return False
    ok_dtype = x.dtype == torch.bfloat16 or (x.dtype == torch.float16 and isinstance(w1, StackedNVFP4))
    return ok_dtype and all(w.packed.is_contiguous() and w.packed.data_ptr() % 16 == 0 for w in (w1, w3, w2))


def grouped_wgmma(x: torch.Tensor, sched: dict, bm: int, w, w3=None, limit: float | None = None,
                  rw: torch.Tensor | None = None, frag: bool = False, out: torch.Tensor | None = None) -> torch.Tensor:
    """One grouped launch over ``sched``'s tiles of ``bm`` rows: y [R, N] in sorted row order =
    x [R, K] (rows already sorted) @ W_e^T per row's expert; with ``w3`` the clamped SwiGLU of the w1
    and w3 products (times ``rw`` [R], the sorted rows' routing weights, when given). ``frag``: A
    decoded into registers, x's columns in fragment order (``linear_gemm_wgmma.fragment_order``),
    and the SwiGLU output (with ``w3``) written in fragment order too; else A through shared memory
    and plain column order everywhere. ``out``: y, written at the tiles' rows only (the other
    tile list of ``moe_prefill.mixed_tiles`` writes the rest)."""
    E, N, K = w.shape
    fmt, p, s, gs = _stack_parts(w)
    R = x.shape[0]
    if x.dtype not in (torch.bfloat16, torch.float16) or (fmt == "mxfp4" and x.dtype != torch.bfloat16):
        raise ValueError(f"grouped_wgmma: {fmt} weights with {x.dtype} x are not supported "
                         "(NVFP4 with bf16 / fp16, MXFP4 with bf16); use moe_prefill.grouped_gemm")
    if x.shape[1] != K or K % BK or bm not in (64, 128):
        raise ValueError(f"grouped_wgmma: x [R, {x.shape[1]}] against K = {K} (a multiple of {BK}) with bm "
                         f"{bm} (64 or 128)")
    if out is not None and (out.shape != (R, N) or out.dtype != x.dtype or not out.is_contiguous()):
        raise ValueError(f"grouped_wgmma: out must be a contiguous [{R}, {N}] {x.dtype} tensor, got "
                         f"{tuple(out.shape)} {out.dtype}")
    y = out if out is not None else torch.empty((R, N), dtype=x.dtype, device=x.device)
    if R == 0:
        return y
    if w3 is not None:
        f3, p3, s3, gs3 = _stack_parts(w3)
        if f3 != fmt or w3.shape != w.shape:
            raise ValueError(f"grouped_wgmma: w3 {f3} {tuple(w3.shape)} must match w {fmt} {tuple(w.shape)}")
    else:
        p3, s3, gs3 = p, s, gs
    dual = w3 is not None
    rows_w = BN // 2 if dual else BN
    dt = gl.bfloat16 if x.dtype == torch.bfloat16 else gl.float16
    x = x.contiguous()
    x_desc = TensorDescriptor.from_tensor(x, [bm, BK], gl.NVMMASharedLayout.get_default_for([bm, BK], dt))
    w_layout = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=8, rank=2)
    w_desc = TensorDescriptor.from_tensor(p, [rows_w, BK // 2], w_layout)
    w3_desc = TensorDescriptor.from_tensor(p3, [rows_w, BK // 2], w_layout) if dual else w_desc
    n_cols = cdiv(N, rows_w)
    clamp = dual and limit is not None and limit > 0
    gs_arg = gs if gs is not None else s
    _grouped_wgmma_kernel[(sched["tiles"] * n_cols,)](
        x_desc, w_desc, w3_desc, s, s3, gs_arg, gs3 if gs3 is not None else gs_arg, sched["tile_e"], sched["tile_r0"],
        sched["tile_r1"], rw if rw is not None else s, y, N, K, n_cols, s.stride(0), y.stride(0),
        float(limit) if clamp else 0.0, FMT=FORMAT_CODES[fmt], BM=bm, BN=BN, BK=BK, STAGES=STAGES, DUAL=dual,
        CLAMP=clamp, WEIGHT=rw is not None, FRAG=frag, num_warps=WARPS,
        maxnreg=128 if frag else None)  # FRAG: 109-115 registers under the cap (145-149 without; sm_90a offline)
    return y


__all__ = ["grouped_wgmma", "grouped_wgmma_supported", "BN", "BK"]
