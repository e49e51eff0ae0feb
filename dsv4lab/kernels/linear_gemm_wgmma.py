"""W4A16 GEMM for small batches (64..511 tokens) on Hopper, written in Gluon: explicit async wgmma.

Why a second prefill GEMM: ``linear_gemm``'s Triton kernel dequantises the weight tile in the same
warps that then wait on its wgmma, so at M = 128 the tensor cores idle while the next tile decodes
(0.6-0.98x cuBLAS BF16 there, stop 48's probe). Gluon (Triton's lower-level dialect, shipped with
triton) lets the kernel say what Triton's pipeliner does not: issue the wgmma of step i
asynchronously and decode step i + 1 while it runs.

One CTA (8 warps): 128 weight rows x BM tokens (the swapped orientation, acc[BN, BM] = W · xᵀ:
weight rows on wgmma's M side, 64 a warpgroup) over one K split. Per K step of BK:

* TMA brings the packed weight bytes [BN, BK/2] and the x tile [BM, BK] into a STAGES-deep ring
  (one mbarrier a slot); the block scales (BK/16 e4m3, BK/32 E8M0 a row) come by plain loads, too
  narrow a row for a TMA box.
* Every thread decodes one 16-code group of a row (``_PAIRS_ASM``: integer multiplies and masks,
  two packed multiplies, exact) into a double-buffered wgmma operand in shared memory; a fence
  and a CTA barrier; the async wgmma against the x tile; a wait until at most one wgmma is in
  flight (the previous one is done: its ring slot is refilled by TMA).

Step 0 is peeled out of the loop (see ``_wgmma_gemm_kernel``). Split K: fp32 partials in a
tile-local block, summed in split order by the last split to arrive (a counter per tile, reset after;
deterministic, one launch). NVFP4's global scale multiplies the fp32 result. Needs sm_90 and
triton's Gluon: no interpreter path (``linear_gemm`` stays the CPU and pre-Hopper kernel); CI
compiles it for sm_90a offline (tests/wgmma_offline_check.py).
"""
from __future__ import annotations

import functools

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma, warpgroup_mma, \
    warpgroup_mma_wait
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from .host import cdiv, counters, device_capability, num_sms
from .weight_decode import FMT_MXFP4, FMT_NVFP4, FORMAT_CODES

# the TMA load's name: ``async_copy_global_to_shared`` in triton 3.6 (the device), ``async_load`` later
tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
cta_barrier = getattr(gl, "thread_barrier", None) or gl.barrier  # (``barrier`` in later triton)

if hasattr(gl.shared_memory_descriptor, "reinterpret"):  # triton > 3.6
    @gluon.jit
    def _words(d, R: gl.constexpr, C: gl.constexpr, SWIZZLE: gl.constexpr):
        """Shared tile ``d`` seen as int32 words [R, C] (the same bytes; NVMMA swizzle SWIZZLE bytes)."""
        return d.reinterpret(gl.int32, [R, C], gl.NVMMASharedLayout(swizzle_byte_width=SWIZZLE, element_bitwidth=32,
                                                                    rank=2))
else:
    @gluon.jit
    def _words(d, R: gl.constexpr, C: gl.constexpr, SWIZZLE: gl.constexpr):
        """Shared tile ``d`` seen as int32 words [R, C] (the same bytes; NVMMA swizzle SWIZZLE bytes)."""
        return d._reinterpret(gl.int32, [R, C], gl.NVMMASharedLayout(swizzle_byte_width=SWIZZLE, element_bitwidth=32,
                                                                     rank=2))


# One packed weight word (8 E2M1 codes, bytes 4w .. 4w + 3) -> four 16-bit pairs in K order, each
# code's bits placed by two multiplies and masks (byte b: b * 0x40040 puts its low code's magnitude at
# bits 8:6 and its high code's at 24:22, b * 0x1001000 their signs at 15 and 31: bf16 bits of
# E2M1 * 2^-126; f16: b * 0x200200, bits 11:9 and 27:25, E2M1 * 2^-14), then two packed multiplies:
# by 2^126 (f16: 2^14), exact, and by the block scale pair $5 (the product has <= 6 significant bits:
# exact). ~3.5 instructions a weight instead of ~9 through fp32.
_PAIRS_ASM = """{
.reg .b32 b, m, g, v, k;
mov.b32 k, KBIAS;
and.b32 b, $4, 0xFF;
mul.lo.u32 m, b, MMUL; and.b32 m, m, MMASK; mul.lo.u32 g, b, 0x1001000; and.b32 g, g, 0x80008000;
or.b32 v, m, g; mul.rn.OP v, v, k; mul.rn.OP $0, v, $5;
bfe.u32 b, $4, 8, 8;
mul.lo.u32 m, b, MMUL; and.b32 m, m, MMASK; mul.lo.u32 g, b, 0x1001000; and.b32 g, g, 0x80008000;
or.b32 v, m, g; mul.rn.OP v, v, k; mul.rn.OP $1, v, $5;
bfe.u32 b, $4, 16, 8;
mul.lo.u32 m, b, MMUL; and.b32 m, m, MMASK; mul.lo.u32 g, b, 0x1001000; and.b32 g, g, 0x80008000;
or.b32 v, m, g; mul.rn.OP v, v, k; mul.rn.OP $2, v, $5;
shr.u32 b, $4, 24;
mul.lo.u32 m, b, MMUL; and.b32 m, m, MMASK; mul.lo.u32 g, b, 0x1001000; and.b32 g, g, 0x80008000;
or.b32 v, m, g; mul.rn.OP v, v, k; mul.rn.OP $3, v, $5;
}"""
PAIRS_BF16 = gl.constexpr(_PAIRS_ASM.replace("KBIAS", "0x7E807E80").replace("MMUL", "0x40040")
                          .replace("MMASK", "0x01C001C0").replace("OP", "bf16x2"))
PAIRS_F16 = gl.constexpr(_PAIRS_ASM.replace("KBIAS", "0x74007400").replace("MMUL", "0x200200")
                         .replace("MMASK", "0x0E000E00").replace("OP", "f16x2"))


@gluon.jit
def _scale_pairs(sc_ptrs, sc_mask, FMT: gl.constexpr, F16: gl.constexpr):
    """The block scale of each weight word as a 16-bit pair (bf16, or f16 for fp16 x), exact:
    e4m3 (NVFP4) or E8M0 (MXFP4: 2^(e-127); e = 0 the subnormal 2^-127, 255 NaN, as torch)."""
    if FMT == FMT_NVFP4:
        s = gl.load(sc_ptrs, mask=sc_mask, other=0).to(gl.float8e4nv, bitcast=True).to(gl.float32)
        if F16:
            h = s.to(gl.float16).to(gl.int16, bitcast=True).to(gl.int32) & 0xFFFF
        else:
            h = s.to(gl.bfloat16).to(gl.int16, bitcast=True).to(gl.int32) & 0xFFFF
    else:
        e = gl.load(sc_ptrs, mask=sc_mask, other=127).to(gl.int32)
        h = gl.where(e == 0, 0x40, gl.where(e == 255, 0x7FC0, e << 7))
    return h | (h << 16)


@gluon.jit
def _byte_pairs(wq, sp, F16: gl.constexpr):
    """Each packed word's four 16-bit pairs, scaled (pair b: byte b's two codes), as four int32."""
    if F16:
        return gl.inline_asm_elementwise(PAIRS_F16, "=r,=r,=r,=r,r,r", [wq, sp],
                                         dtype=(gl.int32, gl.int32, gl.int32, gl.int32), is_pure=True, pack=1)
    else:
        return gl.inline_asm_elementwise(PAIRS_BF16, "=r,=r,=r,=r,r,r", [wq, sp],
                                         dtype=(gl.int32, gl.int32, gl.int32, gl.int32), is_pure=True, pack=1)


@gluon.jit
def _step_scales(sc_base, sc_mask, k, FMT: gl.constexpr, F16: gl.constexpr):
    """The scale pairs of the K step starting at column ``k`` (one scale per 16 NVFP4 / 32 MXFP4 codes)."""
    if FMT == FMT_NVFP4:
        sc_ptrs = sc_base + k // 16
    else:
        sc_ptrs = sc_base + k // 32
    return _scale_pairs(sc_ptrs, sc_mask, FMT, F16)


@gluon.jit
def _decode_words(wq, sp, BN: gl.constexpr, BK: gl.constexpr, F16: gl.constexpr):
    """Packed words [BN, BK/8] (8 codes each) and their scale pairs -> [BN, BK/2] 16-bit pairs
    (element 2i low half) in K order."""
    p0, p1, p2, p3 = _byte_pairs(wq, sp, F16)
    # join(join(p0, p2), join(p1, p3))[..., i, j] is pair 2i + j of the word
    return gl.reshape(gl.join(gl.join(p0, p2), gl.join(p1, p3)), [BN, BK // 2])


@gluon.jit
def k_step(acc, i, k_lo, ready, w_smem, x_smem, a_smem, sc_base, sc_mask, FMT: gl.constexpr, BN: gl.constexpr,
          BK: gl.constexpr, STAGES: gl.constexpr, PROBE: gl.constexpr, wl: gl.constexpr, F16: gl.constexpr):
    """K step i: wait for its slot, decode the weight tile into wgmma operand buffer i % 2, fence,
    CTA barrier, issue the async wgmma (not waited for here)."""
    s = i % STAGES
    sp = _step_scales(sc_base, sc_mask, k_lo + i * BK, FMT, F16)
    mbarrier.wait(ready.index(s), (i // STAGES) & 1)
    a = a_smem.index(i % 2)
    if PROBE != 1:  # PROBE 1: no decode (timing probe only)
        wq = _words(w_smem.index(s), BN, BK // 8, 0).load(wl)
        _words(a, BN, BK // 2, 2 * BK if BK <= 64 else 128).store(_decode_words(wq, sp, BN, BK, F16))
        fence_async_shared()
    cta_barrier()
    if PROBE != 2:  # PROBE 2: no wgmma (timing probe only)
        acc = warpgroup_mma(a, x_smem.index(s).permute((1, 0)), acc, use_acc=i > 0, is_async=True)
    return acc


# ---- the weight tile decoded straight into wgmma's register A operand (no shared-memory round trip)
# A thread of the m64nNk16 A fragment holds, per row r and r + 8 of its warp's 16, the k pairs 2c and
# 2c + 8 of every 16 (c = lane % 4): scattered bytes of the packed row. wgmma sums over k in any order
# as long as A and B agree, so a kernel may multiply in "fragment order" within each 64-wide K step:
# a thread decodes its two contiguous words (16 codes, one NVFP4 scale) of each of its rows, and the x
# columns are permuted the same way beforehand (``fragment_order``). Within a 64-block, code
# L = 16c + 8w1 + 2b + e (word 2c + w1, byte b, low/high nibble e) sits at column
# 32w1 + 16(b // 2) + 8(b % 2) + 2c + e. With these layouts the compiler moves no data between
# threads (offline PTX: no st.shared). The registers of an in-flight wgmma's A must not be rewritten
# until a wgmma wait covers it: a loop decoding into one SSA value every step would rewrite them
# while the previous step's wgmma still reads them, so callers alternate two (the K loop unrolled by 2:
# 109-115 registers offline; threading each step's A through the next wait's ``deps``, Gluon's
# documented way, compiles to 125-127, at the 128 cap of two CTAs an SM). Both warpgroups read each
# ring slot's x, so a slot is refilled only after a CTA barrier.
SPLIT_PAIR = gl.constexpr("mov.b32 {$0, $1}, $2;")
# words [128, 8] (128 weight rows, BK 64, 8 warps) as the A fragment wants them: lanes % 4 pick a
# word pair, lanes / 4 a row, registers the pair's second word and row + 8, warps 16 rows each
FRAG_WORDS = gl.constexpr(gl.DistributedLinearLayout(
    reg_bases=[[0, 1], [8, 0]], lane_bases=[[0, 2], [0, 4], [1, 0], [2, 0], [4, 0]],
    warp_bases=[[16, 0], [32, 0], [64, 0]], block_bases=[], shape=[128, 8]))


@gluon.jit
def _decode_fragment(wq, sp, dot_a: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr, F16: gl.constexpr):
    """Packed words [BN, BK/8] in ``FRAG_WORDS`` and their scale pairs -> the A operand [BN, BK]
    in fragment order, in ``dot_a`` (a register relabelling: nothing moves)."""
    p0, p1, p2, p3 = _byte_pairs(wq, sp, F16)
    G: gl.constexpr = BK // 16
    # [BN, c, w1] per byte b; joined -> [BN, c, w1, b % 2, b // 2]; column pair 16 w1 + 8 (b // 2) + 4 (b % 2) + c
    j = gl.join(gl.join(gl.reshape(p0, [BN, G, 2]), gl.reshape(p1, [BN, G, 2])),
                gl.join(gl.reshape(p2, [BN, G, 2]), gl.reshape(p3, [BN, G, 2])))
    pairs = gl.reshape(gl.permute(j, [0, 2, 4, 3, 1]), [BN, BK // 2])
    if F16:
        lo, hi = gl.inline_asm_elementwise(SPLIT_PAIR, "=h,=h,r", [pairs], dtype=(gl.float16, gl.float16),
                                           is_pure=True, pack=1)
    else:
        lo, hi = gl.inline_asm_elementwise(SPLIT_PAIR, "=h,=h,r", [pairs], dtype=(gl.bfloat16, gl.bfloat16),
                                           is_pure=True, pack=1)
    return gl.convert_layout(gl.reshape(gl.join(lo, hi), [BN, BK]), dot_a)


@gluon.jit
def fragment_column(n):
    """Where logical column ``n`` (of a 64-aligned K) sits in fragment order."""
    L = n % 64
    return n - L + 32 * ((L // 8) % 2) + 16 * ((L // 4) % 2) + 8 * ((L // 2) % 2) + 2 * (L // 16) + L % 2


def fragment_order(x: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] (K a multiple of 64) with each 64-block's columns in fragment order (one copy; with
    ``rows``, only those rows, gathered in the same copy)."""
    M, K = x.shape
    v = x.view(M, K // 64, 4, 2, 2, 2, 2).permute(0, 1, 3, 4, 5, 2, 6)  # (c, w1, b//2, b%2, e) -> (w1, b//2, b%2, c, e)
    if rows is not None:
        v = v[rows.long()]
    return v.reshape(v.shape[0], K)


@gluon.jit
def k_step_fragment(acc, i, k_lo, ready, w_smem, x_smem, sc_base, sc_mask, FMT: gl.constexpr, BN: gl.constexpr,
                   BK: gl.constexpr, STAGES: gl.constexpr, lw: gl.constexpr, dot_a: gl.constexpr,
                   F16: gl.constexpr):
    """K step i with A from registers: wait for its slot, decode into the fragment, issue the async
    wgmma, wait until step i - 1's is done (its slot may be refilled once both warpgroups are here)."""
    s = i % STAGES
    sp = _step_scales(sc_base, sc_mask, k_lo + i * BK, FMT, F16)
    mbarrier.wait(ready.index(s), (i // STAGES) & 1)
    a = _decode_fragment(_words(w_smem.index(s), BN, BK // 8, 0).load(lw), sp, dot_a, BN, BK, F16)
    acc = warpgroup_mma(a, x_smem.index(s).permute((1, 0)), acc, use_acc=i > 0, is_async=True)
    return warpgroup_mma_wait(num_outstanding=1, deps=(acc, ))


@gluon.jit
def _wgmma_gemm_kernel(x_desc, w_desc, s_ptr, gs_ptr, y_ptr, ws_ptr, cnt_ptr, M, N, K, k_per_split, SPLIT,
                       stride_sn, stride_ym,
                       FMT: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr,
                       STAGES: gl.constexpr, USE_SPLIT: gl.constexpr, PROBE: gl.constexpr,
                       num_warps: gl.constexpr):
    """y = x @ Wᵀ for one (row tile x token tile, K split) (module docstring). ``PROBE`` (timing
    probes only, benchmarks/results/kernels/wgmma_probe): 1 skips the decode, 2 the wgmma."""
    num_n = gl.cdiv(N, BN)
    tile = gl.program_id(0)
    n0 = (tile % num_n) * BN
    m0 = (tile // num_n) * BM
    pid_k = gl.program_id(1)
    k_lo = pid_k * k_per_split
    n_steps = (gl.minimum(k_lo + k_per_split, K) - k_lo) // BK
    dt: gl.constexpr = x_desc.dtype

    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                  instr_shape=[16, BM, 16])
    # decode layout: a thread holds two packed words (one 16-code group) of one row
    wl: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 2], threads_per_warp=[32 // (BK // 16), BK // 16],
                                        warps_per_cta=[num_warps, 1], order=[1, 0])
    a_l: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BN, BK], dt)
    F16: gl.constexpr = dt == gl.float16
    x_smem = gl.allocate_shared_memory(dt, [STAGES, BM, BK], x_desc.layout)
    w_smem = gl.allocate_shared_memory(gl.uint8, [STAGES, BN, BK // 2], w_desc.layout)
    a_smem = gl.allocate_shared_memory(dt, [2, BN, BK], a_l)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for j in gl.static_range(STAGES):
        mbarrier.init(ready.index(j), count=1)
    nbytes: gl.constexpr = x_desc.block_type.nbytes + w_desc.block_type.nbytes
    for j in gl.static_range(STAGES):
        ok = j < n_steps
        mbarrier.expect(ready.index(j), nbytes, pred=ok)
        tma_load(x_desc, [m0, k_lo + j * BK], ready.index(j), x_smem.index(j), pred=ok)
        tma_load(w_desc, [n0, (k_lo + j * BK) // 2], ready.index(j), w_smem.index(j), pred=ok)

    rows = n0 + gl.arange(0, BN, layout=gl.SliceLayout(1, wl))
    word = gl.arange(0, BK // 8, layout=gl.SliceLayout(0, wl))
    sc_mask = gl.expand_dims(rows < N, 1) & gl.expand_dims(word < BK // 8, 0)
    if FMT == FMT_NVFP4:   # one scale a 16-code group (two words)
        sc_base = s_ptr + gl.expand_dims(rows, 1) * stride_sn + gl.expand_dims(word // 2, 0)
    else:          # one E8M0 a 32-code group (four words)
        sc_base = s_ptr + gl.expand_dims(rows, 1) * stride_sn + gl.expand_dims(word // 4, 0)

    # step 0 peeled (every split has >= 1 step): the loop's zero-trip path then carries a wgmma's
    # accumulator too, which keeps ptxas from serialising the async wgmmas (its warning C7515)
    acc = k_step(gl.zeros([BN, BM], gl.float32, mma), 0, k_lo, ready, w_smem, x_smem, a_smem, sc_base, sc_mask,
                FMT, BN, BK, STAGES, PROBE, wl, F16)
    acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc, ))  # no wait: the carried value's type
    for i in range(1, n_steps):
        acc = k_step(acc, i, k_lo, ready, w_smem, x_smem, a_smem, sc_base, sc_mask, FMT, BN, BK, STAGES, PROBE, wl, F16)
        acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc, ))   # step i - 1's wgmma is done:
        nxt = i - 1 + STAGES                                        # refill its slot
        ok = nxt < n_steps
        sp = (i + STAGES - 1) % STAGES
        mbarrier.expect(ready.index(sp), nbytes, pred=ok)
        tma_load(x_desc, [m0, k_lo + nxt * BK], ready.index(sp), x_smem.index(sp), pred=ok)
        tma_load(w_desc, [n0, (k_lo + nxt * BK) // 2], ready.index(sp), w_smem.index(sp), pred=ok)
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
    for j in gl.static_range(STAGES):
        mbarrier.invalidate(ready.index(j))

    if USE_SPLIT:
        # fp32 partials in a tile-local [SPLIT, BN, BM] block: offsets known at compile time (few
        # registers), no masks; the last split sums them in split order
        TILE: gl.constexpr = BN * BM
        loc = gl.expand_dims(gl.arange(0, BN, layout=gl.SliceLayout(1, mma)), 1) * BM \
            + gl.expand_dims(gl.arange(0, BM, layout=gl.SliceLayout(0, mma)), 0)
        part = ws_ptr + tile * SPLIT * TILE + loc
        gl.store(part + pid_k * TILE, acc)
        cta_barrier()
        if gl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel") == SPLIT - 1:
            tot = gl.load(part)
            for jj in range(1, SPLIT):
                tot += gl.load(part + jj * TILE)
            _store_y(tot, y_ptr, gs_ptr, m0, n0, M, N, stride_ym, FMT, BN, BM, mma)
            gl.atomic_xchg(cnt_ptr + tile, 0, sem="relaxed")
    else:
        _store_y(acc, y_ptr, gs_ptr, m0, n0, M, N, stride_ym, FMT, BN, BM, mma)


@gluon.jit
def _store_y(acc, y_ptr, gs_ptr, m0, n0, M, N, stride_ym, FMT: gl.constexpr, BN: gl.constexpr, BM: gl.constexpr,
             mma: gl.constexpr):
    """y[m0 + j, n0 + i] = acc[i, j] (times NVFP4's global scale), one rounding to y's dtype."""
    gs = 1.0
    if FMT == FMT_NVFP4:
        gs = gl.load(gs_ptr).to(gl.float32)
    offs_n = n0 + gl.arange(0, BN, layout=gl.SliceLayout(1, mma))
    offs_m = m0 + gl.arange(0, BM, layout=gl.SliceLayout(0, mma))
    mask = gl.expand_dims(offs_n < N, 1) & gl.expand_dims(offs_m < M, 0)
    out_ty: gl.constexpr = y_ptr.dtype.element_ty
    gl.store(y_ptr + gl.expand_dims(offs_m, 0) * stride_ym + gl.expand_dims(offs_n, 1), (acc * gs).to(out_ty),
             mask=mask)


@functools.lru_cache(maxsize=4096)  # asked twice a call (wgmma_supported, the launch): once per shape
def wgmma_tiles(M: int, N: int, K: int, sms: int) -> dict:
    """The fixed tile rule (H100 probe at M = 128, ``benchmarks/results/kernels/wgmma_probe``): 128
    weight rows (8 warps, 64 a warpgroup), BK 64 in 4 stages (~115 KB of shared memory and ~100
    registers: two CTAs an SM), 128 tokens a tile (64 for M <= 64, and where fewer than 16 tiles
    would leave K splits to fill the SMs: q_a 34.7 -> 30.4 us), K split to fill one wave of
    tiles (>= 4 steps a split), doubled where each split keeps >= 64 steps (o_b 100.3 -> 88.9 us;
    w2's 12-step splits lost 31.1 -> 33.7)."""
    bn, bk = 128, 64
    wide = cdiv(M, 128) * cdiv(N, bn)          # tiles of 128 tokens
    bm = 64 if M <= 64 or wide < 16 else 128
    tiles = cdiv(M, bm) * cdiv(N, bn)
    steps = K // bk
    split = 1
    if tiles < sms:  # (64-token tiles for few row tiles keep the 128-token tiles' split: two CTAs an SM)
        split = max(1, min(sms // (tiles if M <= 64 else wide), steps // 4, 32))
        if steps // (2 * split) >= 64 and 2 * split <= 32:
            split *= 2
    return {"BM": bm, "BN": bn, "BK": bk, "STAGES": 4, "SPLIT": split, "num_warps": 8}


MAX_SPLIT = 12  # H100, M = 128: q_a's 11 splits beat the Triton tiles (30.3 vs 33.2 us), wkv's 28 lost (43.9 vs 25.0)


def wgmma_supported(x2: torch.Tensor, fmt: str, data: torch.Tensor) -> bool:
    """NVFP4 (bf16 or fp16 x) / MXFP4 (bf16 x: an E8M0 scale is not always an f16) on sm_90+, K a
    multiple of 128, x rows and the packed weight as TMA reads them (unit stride, 16-byte aligned),
    and a shape whose tiles need at most MAX_SPLIT K splits (a few long weight rows, V4-Pro's wkv
    [512, 7168], are split so thin that the fix-up dominates: the Triton tiles keep them)."""
    K = x2.shape[1]
    if x2.is_cuda and wgmma_tiles(x2.shape[0], data.shape[0], K, num_sms(x2.device))["SPLIT"] > MAX_SPLIT:
        return False
    ok_dtype = x2.dtype == torch.bfloat16 or (x2.dtype == torch.float16 and fmt == "nvfp4")
    return (fmt in ("nvfp4", "mxfp4") and x2.is_cuda and ok_dtype and K % 128 == 0
            and x2.stride(-1) == 1 and (x2.stride(0) * x2.element_size()) % 16 == 0 and x2.data_ptr() % 16 == 0
            and data.is_contiguous() and data.data_ptr() % 16 == 0
            and device_capability(x2.device) >= (9, 0))


def launch_wgmma_gemm(x2: torch.Tensor, fmt: str, data: torch.Tensor, scale: torch.Tensor, gs: torch.Tensor | None,
                      y: torch.Tensor, cfg: dict | None = None) -> None:
    """y [M, N] = x2 [M, K] @ W^T for NVFP4 / MXFP4 W = (packed uint8 [N, K/2], scales) on sm_90
    (``wgmma_supported``); ``cfg`` overrides ``wgmma_tiles``."""
    if fmt not in ("nvfp4", "mxfp4") or x2.dtype not in (torch.bfloat16, torch.float16) \
            or (fmt == "mxfp4" and x2.dtype != torch.bfloat16):
        raise ValueError(f"launch_wgmma_gemm: format {fmt!r} with {x2.dtype} x is not supported "
                         "(NVFP4 with bf16 / fp16, MXFP4 with bf16); use linear_gemm.launch_gemm")
    M, K = x2.shape
    N = data.shape[0]
    c = {**wgmma_tiles(M, N, K, num_sms(x2.device)), **(cfg or {})}  # a copy: the cached dict stays as it is
    bm, bn, bk = c["BM"], c["BN"], c["BK"]
    kps = cdiv(cdiv(K, c["SPLIT"]), bk) * bk
    split = cdiv(K, kps)
    grid = (cdiv(M, bm) * cdiv(N, bn), split)
    dt = gl.bfloat16 if x2.dtype == torch.bfloat16 else gl.float16
    x_desc = TensorDescriptor.from_tensor(x2, [bm, bk], gl.NVMMASharedLayout.get_default_for([bm, bk], dt))
    w_desc = TensorDescriptor.from_tensor(data.view(torch.uint8), [bn, bk // 2],
                                          gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=8, rank=2))
    if split > 1:
        ws = torch.empty((grid[0], split, bn * bm), dtype=torch.float32, device=x2.device)
        cnt = counters(x2.device, grid[0])
    else:
        ws, cnt = y, y
    s = scale.view(torch.uint8)
    _wgmma_gemm_kernel[grid](x_desc, w_desc, s, gs if gs is not None else s, y, ws, cnt, M, N, K, kps, split,
                             s.stride(0), y.stride(0), FMT=FORMAT_CODES[fmt], BM=bm, BN=bn, BK=bk,
                             STAGES=c["STAGES"], USE_SPLIT=split > 1, PROBE=c.get("PROBE", 0),
                             num_warps=c["num_warps"])


__all__ = ["launch_wgmma_gemm", "wgmma_supported", "wgmma_tiles", "FMT_NVFP4", "FMT_MXFP4"]
