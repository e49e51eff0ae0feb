"""Triton device decodes of the quantised weight formats: E4M3 / E8M0 scale bytes, E2M1 nibbles,
the prefill GEMMs' weight tiles (``dequant_tile``: NVFP4, MXFP4, FP8-block), the nibble planes and
row loop of the NVFP4 GEMVs, the TMA path's block scales and NVFP4 global scale, and the f16x2
group dot.

Layouts: NVFP4 weights as int64 words (16 nibbles = one e4m3 scale block); the batch-1 loops take
the activation as f16x2 pairs ``x' = x * xs`` (xs a power of two per 16-group, so x' is exact in
f16 for bf16 x: ``activation_pairs``); ``group_dot`` multiplies one word against a group's 8 pairs
with inline PTX (``fma.rn.f16x2``) on the GPU and an f16-rounding emulation under the interpreter.
See docs/kernels.md for the design and tolerances.
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def fp16_pair(w32, J: tl.constexpr):
    """int32 word holding 8 nibbles -> (fp32 of nibble J, fp32 of nibble J+4), each E2M1*2^-14."""
    # 0x80008000 as an int32 constant (keeps the arithmetic 32-bit)
    if J == 3:
        p = ((w32 >> 3) & 0x0E000E00) | (w32 & -2147450880)
    else:
        p = ((w32 << (9 - 4 * J)) & 0x0E000E00) | ((w32 << (12 - 4 * J)) & -2147450880)
    lo = p.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    hi = (p >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    return lo, hi


@triton.jit
def e4m3_to_f32(s_u8):
    return s_u8.to(tl.float8e4nv, bitcast=True).to(tl.float32)


@triton.jit
def e8m0_to_f32(e):
    """E8M0 byte -> 2^(e-127) as fp32 (e = 0: 2^-127, a subnormal; e = 255: NaN), like torch."""
    e = e.to(tl.int32)
    v = (e << 23).to(tl.float32, bitcast=True)
    v = tl.where(e == 0, tl.full(e.shape, 4194304, tl.int32).to(tl.float32, bitcast=True), v)
    return tl.where(e == 255, float("nan"), v)


@triton.jit
def nibble_plane_dots(w64, sc, xt, xm, acc, DOT_DTYPE: tl.constexpr):
    """acc [BN, BM] += the 16 nibble planes of the int64 words w64 [BN, W] (element 16w + j),
    each as exact E2M1 * 2^-14 * sc in DOT_DTYPE, through tl.dot against the x^T plane at
    xt + j ([W, BM] pointers, mask xm)."""
    w_lo = w64.to(tl.int32)
    w_hi = (w64 >> 32).to(tl.int32)
    for j in tl.static_range(4):
        a, b = fp16_pair(w_lo, j)
        acc = tl.dot((a * sc).to(DOT_DTYPE), tl.load(xt + j, mask=xm, other=0.0).to(DOT_DTYPE), acc)
        acc = tl.dot((b * sc).to(DOT_DTYPE), tl.load(xt + j + 4, mask=xm, other=0.0).to(DOT_DTYPE), acc)
        c, d = fp16_pair(w_hi, j)
        acc = tl.dot((c * sc).to(DOT_DTYPE), tl.load(xt + j + 8, mask=xm, other=0.0).to(DOT_DTYPE), acc)
        acc = tl.dot((d * sc).to(DOT_DTYPE), tl.load(xt + j + 12, mask=xm, other=0.0).to(DOT_DTYPE), acc)
    return acc


@triton.jit
def gemv_rows_m1(w_ptr, s_ptr, stride_wn, stride_sn, x_ptr, rows, row_ok, g_lo, g_hi, gps,
                  BN: tl.constexpr, G: tl.constexpr):
    """sum_k W'[rows, k] * x[k] over groups [g_lo, g_hi) for one activation row; W' = E2M1*s*2^-14.
    w_ptr: int64 words [N, K/16]; s_ptr: uint8 e4m3 [N, K/16]; x_ptr: fp row of K."""
    acc = tl.zeros((BN, G), dtype=tl.float32)
    offs_g = tl.arange(0, G)
    # software pipelining by hand: the next tile's weight/scale loads are issued before this
    # tile's decode (the loop has no tl.dot, so Triton's pipeliner leaves it alone)
    gg = g_lo + offs_g
    gm = gg < g_hi
    m2 = row_ok[:, None] & gm[None, :]
    w_nx = tl.load(w_ptr + rows[:, None] * stride_wn + gg[None, :], mask=m2, other=0)
    s_nx = tl.load(s_ptr + rows[:, None] * stride_sn + gg[None, :], mask=m2, other=0)
    for g0 in range(g_lo, g_lo + gps, G):
        gg = g0 + offs_g
        gm = gg < g_hi
        w64 = w_nx
        sc = e4m3_to_f32(s_nx)
        gn = gg + G
        mn = row_ok[:, None] & (gn < g_hi)[None, :]
        w_nx = tl.load(w_ptr + rows[:, None] * stride_wn + gn[None, :], mask=mn, other=0)
        s_nx = tl.load(s_ptr + rows[:, None] * stride_sn + gn[None, :], mask=mn, other=0)
        w_lo = w64.to(tl.int32)
        w_hi = (w64 >> 32).to(tl.int32)
        xb = x_ptr + gg * 16
        part = tl.zeros((BN, G), dtype=tl.float32)
        for j in tl.static_range(4):
            a, b = fp16_pair(w_lo, j)
            xa = tl.load(xb + j, mask=gm, other=0.0).to(tl.float32)
            xb4 = tl.load(xb + j + 4, mask=gm, other=0.0).to(tl.float32)
            part += a * xa[None, :] + b * xb4[None, :]
            c, d = fp16_pair(w_hi, j)
            xc = tl.load(xb + j + 8, mask=gm, other=0.0).to(tl.float32)
            xd = tl.load(xb + j + 12, mask=gm, other=0.0).to(tl.float32)
            part += c * xc[None, :] + d * xd[None, :]
        acc += part * sc
    return tl.sum(acc, axis=1)


# weight formats of the prefill GEMM tiles (``dequant_tile``)
FMT_NVFP4 = tl.constexpr(0)
FMT_MXFP4 = tl.constexpr(1)
FMT_FP8 = tl.constexpr(2)
FORMAT_CODES = {"nvfp4": 0, "mxfp4": 1, "fp8_block": 2}  # weight format name -> the FMT constexpr


@triton.jit
def fp4_nibbles_f32(b):
    """uint8/int32 bytes [R, C] -> (low, high nibble) as exact E2M1 * 2^-14 in fp32 (the f16 bit
    trick of ``fp16_pair``, one byte at a time: subnormal 0.5 included)."""
    b = b.to(tl.int32)
    lo = (((b & 7) << 9) | ((b & 8) << 12)).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    hi = (((b & 0x70) << 5) | ((b & 0x80) << 8)).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    return lo, hi


@triton.jit
def dequant_tile(w_ptr, s_ptr, rows, row_ok, k0, stride_wn, stride_sn, BN: tl.constexpr, BK: tl.constexpr,
                 FMT: tl.constexpr, DOT_DTYPE: tl.constexpr, WORDS: tl.constexpr = False):
    """Weight rows ``rows`` [BN], columns k0 .. k0 + BK (BK a multiple of 32; FP8 tiles inside one
    128-column scale block) as [BN, BK] DOT_DTYPE in K order, block scales applied (exact: E2M1
    times e4m3 / E8M0 has at most 6 significant bits; FP8 rounds e4m3 * fp32 scale once, like
    ``FP8BlockWeight.dequantize``); NVFP4's global scale is left to the caller.

    NVFP4: ``w_ptr`` bytes [N, K/2], ``s_ptr`` e4m3 bytes [N, K/16]. MXFP4: the same bytes, E8M0
    [N, K/32]. FP8: e4m3 bytes [N, K], ``s_ptr`` fp32 [ceil(N/128), ceil(K/128)]."""
    if FMT == FMT_FP8:
        offs_k = k0 + tl.arange(0, BK)
        w8 = tl.load(w_ptr + rows[:, None] * stride_wn + offs_k[None, :], mask=row_ok[:, None], other=0)
        sc = tl.load(s_ptr + (rows // 128) * stride_sn + k0 // 128, mask=row_ok, other=0.0)
        return (w8.to(tl.float8e4nv, bitcast=True).to(tl.float32) * sc[:, None]).to(DOT_DTYPE)
    else:
        if WORDS:
            # int32 words (8 codes): 4-byte shared-memory reads instead of single bytes; bytes 4w + i
            offs_w = k0 // 8 + tl.arange(0, BK // 8)
            w32 = tl.load(w_ptr + rows[:, None] * (stride_wn // 4) + offs_w[None, :], mask=row_ok[:, None], other=0)
            b = tl.join(tl.join(w32 & 0xFF, (w32 >> 8) & 0xFF), tl.join((w32 >> 16) & 0xFF, (w32 >> 24) & 0xFF))
            b = tl.reshape(tl.permute(b, (0, 1, 3, 2)), (BN, BK // 2))
        else:
            offs_b = k0 // 2 + tl.arange(0, BK // 2)
            b = tl.load(w_ptr + rows[:, None] * stride_wn + offs_b[None, :], mask=row_ok[:, None], other=0)
        lo, hi = fp4_nibbles_f32(b)
        w = tl.join(lo, hi)  # [BN, BK/2, 2]: element 2i (low nibble), 2i + 1 (high)
        if FMT == FMT_NVFP4:
            offs_g = k0 // 16 + tl.arange(0, BK // 16)
            sc = e4m3_to_f32(tl.load(s_ptr + rows[:, None] * stride_sn + offs_g[None, :], mask=row_ok[:, None],
                                     other=0)) * 16384.0
            w = tl.reshape(w, (BN, BK // 16, 16)) * sc[:, :, None]
        else:
            offs_g = k0 // 32 + tl.arange(0, BK // 32)
            sc = e8m0_to_f32(tl.load(s_ptr + rows[:, None] * stride_sn + offs_g[None, :], mask=row_ok[:, None],
                                     other=127)) * 16384.0
            w = tl.reshape(w, (BN, BK // 32, 32)) * sc[:, :, None]
        return tl.reshape(w, (BN, BK)).to(DOT_DTYPE)


# f16x2 path (M == 1 on the GPU): the nibbles of an int32 word are turned into E5M2-like bytes
# (sign at bit 7, e1 e0 m at bits 3..1), four at a time: the even nibbles of all four bytes with
# one pair of shifts and masks, the odd ones with another; prmt then puts two such bytes into the
# high bytes of an f16x2 register, which is E2M1 * 2^-14 exactly (subnormals included). Per 8
# weights: 3 shifts, 4 logic ops, 4 prmt, 4 hfma2 (the nibble-pair decode it replaced needed 7
# shifts and 8 logic ops: 1805 -> 1549 SASS instructions per 256x16-word box and thread).
# Pairs: (e0, e2), (e4, e6) from the even codes, (e1, e3), (e5, e7) from the odd ones.
# $1/$2: the group's low/high int32 word; $3..$6 / $7..$10: the matching x' pairs.
_H2_WORD = """
shl.b32 a, {w}, 1; shl.b32 b, {w}, 4; and.b32 b, b, 0x80808080; lop3.b32 e, a, b, 0x0E0E0E0E, 0xEC;
shr.b32 a, {w}, 3; and.b32 b, {w}, 0x80808080; lop3.b32 o, a, b, 0x0E0E0E0E, 0xEC;
prmt.b32 p, e, 0, 0x1404; fma.rn.f16x2 acc, p, {x0}, acc;
prmt.b32 p, e, 0, 0x3424; fma.rn.f16x2 acc, p, {x1}, acc;
prmt.b32 p, o, 0, 0x1404; fma.rn.f16x2 acc, p, {x2}, acc;
prmt.b32 p, o, 0, 0x3424; fma.rn.f16x2 acc, p, {x3}, acc;
"""
# element offsets (within an 8-element half group) of the low half of x' pairs 0..3; the high
# half is the element 2 further on
H2_PAIR_LO = (0, 4, 1, 5)
_H2_GROUP_ASM = tl.constexpr(
    "{ .reg .b32 a, b, e, o, p, acc; .reg .f16 hlo, hhi; .reg .f32 flo, fhi;\nmov.b32 acc, 0;\n"
    + _H2_WORD.format(w="$1", x0="$3", x1="$4", x2="$5", x3="$6")
    + _H2_WORD.format(w="$2", x0="$7", x1="$8", x2="$9", x3="$10")
    + "mov.b32 {hlo, hhi}, acc; cvt.f32.f16 flo, hlo; cvt.f32.f16 fhi, hhi; add.f32 flo, flo, fhi;\n"
    + "mov.b32 $0, flo; }")


@triton.jit
def _code_to_f32(c):
    """E5M2-like byte code (sign bit 7, e1 e0 m bits 3..1) -> the f16 with that high byte, as fp32."""
    return ((c & 0xFF) << 8).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _h2_word_emulated(w32, x0, x1, x2, x3, acc_lo, acc_hi):
    """What one _H2_WORD block computes, in plain Triton (the interpreter cannot run PTX): the
    even/odd byte codes, exact f16 products added to the f16 running sums in the same order
    (pair k: lo half element H2_PAIR_LO[k], hi half element H2_PAIR_LO[k] + 2)."""
    even = ((w32 << 1) & 0x0E0E0E0E) | ((w32 << 4) & -2139062144)   # -2139062144 = 0x80808080
    odd = ((w32 >> 3) & 0x0E0E0E0E) | (w32 & -2139062144)
    for k in tl.static_range(4):
        if k == 0:
            xp = x0
        elif k == 1:
            xp = x1
        elif k == 2:
            xp = x2
        else:
            xp = x3
        if k < 2:
            c = even >> (16 * k)
        else:
            c = odd >> (16 * (k - 2))
        lo = _code_to_f32(c)
        hi = _code_to_f32(c >> 8)
        xa = xp.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        xc = (xp >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        acc_lo = (acc_lo + lo * xa).to(tl.float16).to(tl.float32)
        acc_hi = (acc_hi + hi * xc).to(tl.float16).to(tl.float32)
    return acc_lo, acc_hi


@triton.jit
def group_dot(w64, x0, x1, x2, x3, x4, x5, x6, x7, BN: tl.constexpr, G: tl.constexpr, USE_ASM: tl.constexpr):
    """Per (row, group) sum of the 16 products of one int64 weight word [BN, G] with the group's
    x' pairs x0..x7 ([1, G] each), in units of 2^-14 / xs: ``_H2_GROUP_ASM`` on the GPU, its
    plain-Triton emulation under the interpreter (one running f16x2 sum over both halves)."""
    w_lo = w64.to(tl.int32)
    w_hi = (w64 >> 32).to(tl.int32)
    if USE_ASM:
        part = tl.inline_asm_elementwise(
            _H2_GROUP_ASM, "=r,r,r,r,r,r,r,r,r,r,r", [w_lo, w_hi, x0, x1, x2, x3, x4, x5, x6, x7],
            dtype=tl.int32, is_pure=True, pack=1).to(tl.float32, bitcast=True)
    else:
        z = tl.zeros((BN, G), dtype=tl.float32)
        a_lo, a_hi = _h2_word_emulated(w_lo, x0, x1, x2, x3, z, z)
        a_lo, a_hi = _h2_word_emulated(w_hi, x4, x5, x6, x7, a_lo, a_hi)
        part = a_lo + a_hi
    return part


@triton.jit
def block_scales(s_desc, n0, g0, BN: tl.constexpr, G: tl.constexpr, MX: tl.constexpr):
    """[BN, G] fp32 scales of the G 16-groups from g0: NVFP4 one e4m3 per group; MXFP4 one E8M0 per
    32 elements, i.e. per two groups (the descriptor's box is [BN, G/2])."""
    if MX:
        f = e8m0_to_f32(s_desc.load([n0, g0 // 2]))
        return tl.reshape(tl.join(f, f), (BN, G))
    else:
        return e4m3_to_f32(s_desc.load([n0, g0]))


@triton.jit
def weight_global_scale(gs_ptr, idx, MX: tl.constexpr):
    """The tensor-wide (per-expert: ``idx``) NVFP4 global scale; MXFP4 has none (1, no load, so a
    placeholder pointer is fine and no device-side constant has to exist before graph capture)."""
    if MX:
        return 1.0
    else:
        return tl.load(gs_ptr + idx).to(tl.float32)
