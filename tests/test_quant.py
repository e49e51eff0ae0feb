"""Bit-exactness tests for dsv4lab.quant formats (E2M1, NVFP4, MXFP4, FP8 block).

Reference implementations here are deliberately naive Python loops over the format definitions,
independent of the vectorised code under test.
"""
from __future__ import annotations

import math

import pytest
import torch

from dsv4lab.quant.fp4 import E2M1_VALUES, e2m1_decode, e2m1_encode, pack_fp4, unpack_fp4
from dsv4lab.quant.weights import (
    FP8BlockWeight,
    MXFP4Weight,
    NVFP4Weight,
    PlainWeight,
    QuantWeight,
    as_quant_weight,
    quantize_fp8_block,
    quantize_mxfp4,
    quantize_nvfp4,
)

SPEC_TABLE = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def ref_e2m1(code: int) -> float:
    v = SPEC_TABLE[code & 7]
    return -v if code & 8 else v


def ref_e4m3(byte: int) -> float:
    """float8_e4m3fn by hand: s eeee mmm, bias 7, no inf, 0x7F/0xFF NaN."""
    s = -1.0 if byte & 0x80 else 1.0
    e, m = (byte >> 3) & 0xF, byte & 7
    if e == 15 and m == 7:
        return math.nan
    if e == 0:
        return s * (m / 8) * 2.0**-6
    return s * (1 + m / 8) * 2.0 ** (e - 7)


def ref_e8m0(byte: int) -> float:
    return math.nan if byte == 255 else 2.0 ** (byte - 127)


def half_step(a: torch.Tensor) -> torch.Tensor:
    """Half the E2M1 grid spacing around magnitude a (in units of the block scale)."""
    return torch.where(a <= 2, 0.25, torch.where(a <= 4, 0.5, 1.0))


def assert_nearest_code(a_scaled: torch.Tensor, decoded: torch.Tensor) -> None:
    """Every decoded value is (one of) the nearest E2M1 grid points to the scaled input."""
    grid = torch.tensor(SPEC_TABLE)
    best = (a_scaled.abs().unsqueeze(-1) - grid).abs().min(-1).values
    got = (a_scaled.abs() - decoded.abs()).abs()
    assert torch.all(got <= best + 1e-5 * (1 + a_scaled.abs()))


# ----------------------------------------------------------------------------- E2M1
def test_e2m1_values_constant():
    assert tuple(E2M1_VALUES) == tuple(SPEC_TABLE)


def test_e2m1_decode_all_codes():
    got = e2m1_decode(torch.arange(16, dtype=torch.uint8))
    assert got.dtype == torch.float32
    assert got.tolist() == [ref_e2m1(c) for c in range(16)]
    assert torch.signbit(got[8]) and not torch.signbit(got[0])  # code 8 is -0


def test_e2m1_encode_representable_values():
    codes = torch.arange(16, dtype=torch.uint8)
    vals = torch.tensor([ref_e2m1(c) for c in range(16)])
    enc = e2m1_encode(vals)
    assert enc.dtype == torch.uint8
    # -0.0 canonicalises to code 0 (documented); everything else round-trips to its own code
    assert enc.tolist() == [0] + codes[1:8].tolist() + [0] + codes[9:].tolist()
    for dt in (torch.bfloat16, torch.float16, torch.float64):
        assert torch.equal(e2m1_encode(vals.to(dt)), enc)


@pytest.mark.parametrize(
    "x,val",
    [(0.25, 0.0), (0.75, 1.0), (1.25, 1.0), (1.75, 2.0), (2.5, 2.0), (3.5, 4.0), (5.0, 4.0),
     (0.2500001, 0.5), (1.2500001, 1.5), (4.9999, 4.0), (5.0001, 6.0)],
)
def test_e2m1_ties_to_even(x, val):
    for s in (1.0, -1.0):
        code = e2m1_encode(torch.tensor([s * x]))
        assert e2m1_decode(code).item() == s * val or (val == 0.0 and code.item() == 0)


def test_e2m1_saturation_and_nan():
    x = torch.tensor([6.0, 6.5, 100.0, float("inf"), -7.0, -float("inf"), float("nan"), -0.1, -0.0])
    assert e2m1_encode(x).tolist() == [7, 7, 7, 7, 15, 15, 0, 0, 0]


def test_e2m1_encode_random_nearest():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4096, generator=g) * 3
    assert_nearest_code(x, e2m1_decode(e2m1_encode(x)))
    dec = e2m1_decode(e2m1_encode(x))
    assert torch.all((dec == 0) | (torch.sign(dec) == torch.sign(x)))


def test_pack_nibble_order():
    p = pack_fp4(torch.tensor([1, 2], dtype=torch.uint8))
    assert p.dtype == torch.uint8 and p.tolist() == [0x21]
    assert unpack_fp4(torch.tensor([0x21, 0xF0], dtype=torch.uint8)).tolist() == [1, 2, 0, 15]


def test_pack_unpack_roundtrip():
    g = torch.Generator().manual_seed(1)
    codes = torch.randint(0, 16, (3, 5, 64), generator=g, dtype=torch.uint8)
    packed = pack_fp4(codes)
    assert packed.shape == (3, 5, 32)
    assert torch.equal(unpack_fp4(packed), codes)
    assert torch.equal(unpack_fp4(packed.view(torch.int8)), codes)
    with pytest.raises(ValueError):
        pack_fp4(codes[..., :3])


# ----------------------------------------------------------------------------- NVFP4
def _rand_e4m3_bytes(shape, g):
    b = torch.randint(0, 0x7F, shape, generator=g, dtype=torch.uint8)  # positive, never NaN (0x7F)
    return b


def test_nvfp4_dequant_matches_loop_reference():
    g = torch.Generator().manual_seed(2)
    out, inn = 3, 48
    packed = torch.randint(0, 256, (out, inn // 2), generator=g, dtype=torch.uint8)
    bs_bytes = _rand_e4m3_bytes((out, inn // 16), g)
    gs = torch.tensor(0.0123, dtype=torch.float32)
    q = NVFP4Weight(packed, bs_bytes.view(torch.float8_e4m3fn), gs)
    got = q.dequantize()
    pl, bl, gsf = packed.tolist(), bs_bytes.tolist(), float(gs)
    ref = [[0.0] * inn for _ in range(out)]
    for i in range(out):
        for j in range(inn):
            byte = pl[i][j // 2]
            code = byte & 0xF if j % 2 == 0 else byte >> 4
            ref[i][j] = ref_e2m1(code) * ref_e4m3(bl[i][j // 16]) * gsf
    assert torch.equal(got, torch.tensor(ref, dtype=torch.float32))  # exact product -> one rounding
    assert torch.equal(q.dequantize(torch.bfloat16), got.to(torch.bfloat16))


def _nvfp4_weight(seed=3, out=32, inn=64):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out, inn, generator=g)
    w[0, 5] = 9.0  # an outlier sets the global amax
    return w


def test_nvfp4_quantize_recipe_and_error_bound():
    w = _nvfp4_weight()
    q = quantize_nvfp4(w)
    t = q.tensors()
    assert set(t) == {"weight", "weight_scale", "weight_scale_2"}
    assert t["weight"].dtype == torch.uint8 and t["weight"].shape == (32, 32)
    assert t["weight_scale"].dtype == torch.float8_e4m3fn and t["weight_scale"].shape == (32, 4)
    assert t["weight_scale_2"].dtype == torch.float32 and t["weight_scale_2"].dim() == 0
    gs = w.abs().max() / (6 * 448)
    assert torch.equal(q.global_scale, gs)
    blocks = w.view(32, 4, 16)
    bs_ref = (blocks.abs().amax(-1) / (6 * gs)).to(torch.float8_e4m3fn)
    assert torch.equal(q.block_scale.view(torch.uint8), bs_ref.view(torch.uint8))
    d = (q.block_scale.float() * gs).unsqueeze(-1)  # per-element step unit
    a = blocks.abs() / d
    deq = q.dequantize().view(32, 4, 16)
    err = (deq - blocks).abs()
    bound = torch.where(a > 6, a - 6, half_step(a)) * d
    assert torch.all(err <= bound + 1e-6 * blocks.abs())  # slack: fp32 rounding of w/d and of d
    assert_nearest_code(blocks / d, deq / d)
    assert q.nbytes == 32 * 32 + 32 * 4 + 4


def test_nvfp4_idempotent():
    w = _nvfp4_weight()
    q = quantize_nvfp4(w)
    q2 = quantize_nvfp4(q.dequantize(), global_scale=q.global_scale)
    assert torch.equal(q2.packed, q.packed)
    assert torch.equal(q2.block_scale.view(torch.uint8), q.block_scale.view(torch.uint8))
    assert torch.equal(q2.global_scale, q.global_scale)
    q3 = quantize_nvfp4(q.dequantize())  # recomputed global scale: same up to fp32 rounding
    assert torch.allclose(q3.global_scale, q.global_scale, rtol=1e-6, atol=0)
    assert torch.equal(q3.packed, q.packed)


def test_nvfp4_weight_scale_2_is_applied():
    """Regression for the "weight_scale_2 dropped" bug: it must scale the dequantised weight."""
    w = _nvfp4_weight() * 1e-3  # realistic magnitudes: weight_scale_2 far from 1
    q = quantize_nvfp4(w)
    dropped = NVFP4Weight(q.packed, q.block_scale, 1.0).dequantize()
    good = q.dequantize()
    rel = lambda a: ((a - w).norm() / w.norm()).item()  # noqa: E731
    assert rel(good) < 0.15  # FP4 noise
    assert rel(dropped) > 100  # off by 1/weight_scale_2 ~ 3e5
    assert torch.equal(dropped * q.global_scale, good)  # gs is applied last, exactly once


def test_nvfp4_zero_and_tiny_blocks_never_nan():
    w = _nvfp4_weight()
    w[1] = 0.0  # all-zero blocks -> scale 0, codes 0
    w[2, :16] = 1e-9  # block scale underflows e4m3 -> codes 0
    q = quantize_nvfp4(w)
    deq = q.dequantize()
    assert not deq.isnan().any()
    assert torch.all(deq[1] == 0) and torch.all(deq[2, :16] == 0)
    assert torch.all(q.codes()[1] == 0)
    huge = quantize_nvfp4(torch.full((2, 16), 0.5), global_scale=1e6)  # every block scale underflows
    assert torch.all(huge.block_scale.float() == 0) and torch.all(huge.codes() == 0)
    z = quantize_nvfp4(torch.zeros(4, 32))
    assert z.global_scale.item() == 1.0 and torch.all(z.dequantize() == 0)


def test_nvfp4_explicit_scales_and_views():
    w = _nvfp4_weight()
    q = quantize_nvfp4(w, global_scale=0.01, input_scale=torch.tensor([0.5]))
    assert q.global_scale.item() == pytest.approx(0.01) and q.global_scale.dim() == 0
    assert q.input_scale.shape == () and "input_scale" in q.tensors()
    alt = NVFP4Weight(q.packed.view(torch.int8), q.block_scale.view(torch.uint8), q.global_scale.reshape(1))
    assert torch.equal(alt.dequantize(), q.dequantize())
    if hasattr(torch, "float4_e2m1fn_x2"):
        alt4 = NVFP4Weight(q.packed.view(torch.float4_e2m1fn_x2), q.block_scale, q.global_scale)
        assert alt4.packed.dtype == torch.uint8 and torch.equal(alt4.dequantize(), q.dequantize())
    with pytest.raises(ValueError):
        NVFP4Weight(q.packed, q.block_scale[:, :2], q.global_scale)
    with pytest.raises(ValueError):
        quantize_nvfp4(torch.randn(4, 24))


# ----------------------------------------------------------------------------- MXFP4
def test_mxfp4_dequant_matches_loop_reference():
    g = torch.Generator().manual_seed(4)
    out, inn = 3, 64
    packed = torch.randint(0, 256, (out, inn // 2), generator=g, dtype=torch.uint8)
    sc = torch.randint(100, 150, (out, inn // 32), generator=g, dtype=torch.uint8)
    sc[0, 0], sc[1, 1], sc[2, 0] = 0, 254, 255  # extremes: 2^-127, 2^127, NaN
    got = MXFP4Weight(packed, sc).dequantize()
    pl, sl = packed.tolist(), sc.tolist()
    ref = [[ref_e2m1(pl[i][j // 2] & 0xF if j % 2 == 0 else pl[i][j // 2] >> 4) * ref_e8m0(sl[i][j // 32])
            for j in range(inn)] for i in range(out)]
    ref = torch.tensor(ref, dtype=torch.float32)
    assert torch.equal(got.isnan(), ref.isnan()) and got[2, :32].isnan().all()
    m = ~ref.isnan()
    assert torch.equal(got[m], ref[m])


def test_mxfp4_shared_exponent_rule():
    w = torch.zeros(2, 64)
    w[0, :32] = torch.linspace(-5.0, 0.0, 32)  # amax 5 -> floor(log2 5) - 2 = 0 -> byte 127
    w[0, 32:] = 0.3 * torch.linspace(-1, 1, 32)  # amax 0.3 -> -2 - 2 = -4 -> byte 123
    w[1, :32] = 7.9  # amax 7.9 -> X=0, saturates to 6
    # w[1, 32:] all zero -> X = 0 (documented), codes 0
    q = quantize_mxfp4(w)
    assert q.scale.dtype == torch.float8_e8m0fnu
    assert q.scale.view(torch.uint8).tolist() == [[127, 123], [127, 127]]
    deq = q.dequantize()
    assert torch.all(deq[1, :32] == 6.0) and torch.all(deq[1, 32:] == 0)
    assert deq[0, 0].item() == -4.0  # 5 / 2^0 = 5 ties to 4


def test_mxfp4_error_bound_and_idempotent():
    g = torch.Generator().manual_seed(5)
    w = torch.randn(16, 128, generator=g) * torch.logspace(-3, 1, 16).unsqueeze(1)
    q = quantize_mxfp4(w)
    assert q.packed.shape == (16, 64) and q.scale.shape == (16, 4)
    blocks = w.view(16, 4, 32)
    d = q.scale.float().unsqueeze(-1)
    a = blocks.abs() / d
    assert torch.all(blocks.abs().amax(-1) / q.scale.float() >= 4)
    assert torch.all(blocks.abs().amax(-1) / q.scale.float() < 8)
    deq = q.dequantize().view(16, 4, 32)
    bound = torch.where(a > 6, a - 6, half_step(a)) * d
    assert torch.all((deq - blocks).abs() <= bound)  # power-of-two scales: no rounding slack
    assert_nearest_code(blocks / d, deq / d)
    q2 = quantize_mxfp4(q.dequantize())
    assert torch.equal(q2.packed, q.packed)
    assert torch.equal(q2.scale.view(torch.uint8), q.scale.view(torch.uint8))


def test_mxfp4_accepts_byte_views():
    g = torch.Generator().manual_seed(6)
    q = quantize_mxfp4(torch.randn(8, 64, generator=g))
    ref = q.dequantize()
    views = [
        (q.packed.view(torch.int8), q.scale.view(torch.uint8)),
        (q.packed, q.scale.view(torch.int8)),
        (q.packed.view(torch.int8), q.scale),
    ]
    if hasattr(torch, "float4_e2m1fn_x2"):
        views.append((q.packed.view(torch.float4_e2m1fn_x2), q.scale.view(torch.uint8)))
    for p, s in views:
        alt = MXFP4Weight(p, s)
        assert alt.packed.dtype == torch.uint8 and alt.scale.dtype == torch.float8_e8m0fnu
        assert torch.equal(alt.dequantize(), ref)
    with pytest.raises(ValueError):
        MXFP4Weight(q.packed, q.scale[:, :1])
    with pytest.raises(TypeError):
        MXFP4Weight(q.packed, q.scale.float())


def test_mxfp4_nan_block_visible():
    w = torch.randn(2, 64)
    w[1, 40] = float("nan")
    deq = quantize_mxfp4(w).dequantize()
    assert deq[1, 32:].isnan().all() and not deq[1, :32].isnan().any() and not deq[0].isnan().any()


# ----------------------------------------------------------------------------- FP8 block
@pytest.mark.parametrize("scale_format", ["fp32", "e8m0"])
def test_fp8_dequant_matches_loop_reference(scale_format):
    g = torch.Generator().manual_seed(7)
    out, inn = 130, 200  # partial edge blocks in both dims
    data = (torch.randn(out, inn, generator=g) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
    if scale_format == "fp32":
        scale = torch.rand(2, 2, generator=g) * 1e-2 + 1e-4
        sl = scale.tolist()
    else:
        scale = torch.randint(110, 140, (2, 2), generator=g, dtype=torch.uint8)
        sl = [[ref_e8m0(b) for b in row] for row in scale.tolist()]
        scale = scale.view(torch.float8_e8m0fnu)
    got = FP8BlockWeight(data, scale).dequantize()
    dl = [[ref_e4m3(b) for b in row] for row in data.view(torch.uint8).tolist()]
    ref = torch.tensor([[dl[i][j] * sl[i // 128][j // 128] for j in range(inn)] for i in range(out)],
                       dtype=torch.float32)
    assert torch.equal(got, ref)


@pytest.mark.parametrize("scale_format", ["fp32", "e8m0"])
def test_fp8_quantize_scales_error_and_idempotent(scale_format):
    g = torch.Generator().manual_seed(8)
    w = torch.randn(130, 200, generator=g) * 0.02
    w[129, 199] = 0.7  # the small corner tile has its own amax
    w[:128, :128] = 0.0  # an all-zero tile -> scale 1.0
    q = quantize_fp8_block(w, scale_format=scale_format)
    assert q.data.dtype == torch.float8_e4m3fn and q.scale.shape == (2, 2)
    s = q.scale_float()
    for bi in range(2):
        for bj in range(2):
            tile = w[bi * 128:(bi + 1) * 128, bj * 128:(bj + 1) * 128]
            amax = tile.abs().max()
            if amax == 0:
                assert s[bi, bj].item() == 1.0
            elif scale_format == "fp32":
                assert s[bi, bj] == amax / 448
            else:
                k = math.log2(s[bi, bj].item())
                assert k == int(k) and s[bi, bj] >= amax / 448 > s[bi, bj] / 2
    assert q.scale.dtype == (torch.float32 if scale_format == "fp32" else torch.float8_e8m0fnu)
    assert not q.data.float().isnan().any() and q.data.float().abs().max() <= 448
    deq = q.dequantize()
    sfull = s.repeat_interleave(128, 0)[:130].repeat_interleave(128, 1)[:, :200]
    bound = torch.maximum(w.abs() / 16, 2.0**-10 * sfull)  # half an e4m3 step (normal / subnormal)
    assert torch.all((deq - w).abs() <= bound * (1 + 1e-6))
    q2 = quantize_fp8_block(deq, scale_format=scale_format)
    assert torch.equal(q2.data.view(torch.uint8), q.data.view(torch.uint8))
    if scale_format == "e8m0":
        assert torch.equal(q2.scale.view(torch.uint8), q.scale.view(torch.uint8))
    else:
        assert torch.allclose(q2.scale, q.scale, rtol=2.0**-22, atol=0)


def test_fp8_accepts_byte_views():
    g = torch.Generator().manual_seed(9)
    q = quantize_fp8_block(torch.randn(64, 300, generator=g), scale_format="e8m0")
    ref = q.dequantize()
    for data, scale in [(q.data.view(torch.uint8), q.scale.view(torch.uint8)),
                        (q.data, q.scale.view(torch.int8)), (q.data.view(torch.int8), q.scale)]:
        alt = FP8BlockWeight(data, scale)
        assert alt.scale_format == "e8m0" and alt.data.dtype == torch.float8_e4m3fn
        assert torch.equal(alt.dequantize(), ref)
    qf = quantize_fp8_block(torch.randn(64, 300, generator=g))
    assert torch.equal(FP8BlockWeight(qf.data, qf.scale.to(torch.float64)).dequantize(), qf.dequantize())
    with pytest.raises(ValueError):
        FP8BlockWeight(q.data, q.scale[:, :1])
    with pytest.raises(ValueError):
        quantize_fp8_block(torch.randn(4, 4), scale_format="ue8m0")


def test_fp8_custom_block():
    w = torch.randn(10, 20)
    q = quantize_fp8_block(w, block=8)
    assert q.scale.shape == (2, 3) and q.block == 8
    assert torch.allclose(q.dequantize(), w, rtol=1 / 16, atol=1e-3)
    assert q.to("cpu").block == 8


# ----------------------------------------------------------------------------- container API
def test_container_api():
    w = torch.randn(16, 64)
    qs = [PlainWeight(w.bfloat16()), quantize_nvfp4(w, input_scale=0.1), quantize_mxfp4(w),
          quantize_fp8_block(w), quantize_fp8_block(w, "e8m0")]
    fmts = ["plain", "nvfp4", "mxfp4", "fp8_block", "fp8_block"]
    for q, f in zip(qs, fmts):
        assert isinstance(q, QuantWeight) and q.format == f and q.shape == (16, 64)
        assert q.device == torch.device("cpu")
        assert q.nbytes == sum(t.numel() * t.element_size() for t in q.tensors().values())
        assert q.dequantize(torch.bfloat16).dtype == torch.bfloat16
        m = q.to("meta")
        assert type(m) is type(q) and m.device.type == "meta" and m.shape == q.shape
        assert {k: v.dtype for k, v in m.tensors().items()} == {k: v.dtype for k, v in q.tensors().items()}
        assert as_quant_weight(q) is q
    assert qs[0].tensors() == {"weight": qs[0].data}
    assert isinstance(as_quant_weight(w), PlainWeight) and torch.equal(as_quant_weight(w).dequantize(), w)
    assert qs[2].nbytes < qs[3].nbytes < w.numel() * 4
    with pytest.raises(TypeError):
        as_quant_weight([1, 2])
