"""Activation fake-quant and the reference quantised GEMM (dsv4lab.quant.activations / .linear)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dsv4lab.quant.activations import fake_quant_fp8_block, fake_quant_nvfp4, nvfp4_global_scale
from dsv4lab.quant.linear import qlinear
from dsv4lab.quant.weights import (
    PlainWeight,
    quantize_fp8_block,
    quantize_mxfp4,
    quantize_nvfp4,
)


def _x(seed=10, shape=(2, 3, 64), scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g) * scale


# ----------------------------------------------------------------------------- NVFP4 activations
def test_nvfp4_global_scale_formula():
    x = torch.tensor([[0.5, -5.376, 2.0], [1.0, 0.0, -3.0]])
    gs = nvfp4_global_scale(x)
    assert gs.dtype == torch.float32 and gs.dim() == 0
    assert gs == torch.tensor(5.376) / 2688.0
    assert nvfp4_global_scale(x.bfloat16()).dtype == torch.float32
    assert nvfp4_global_scale(torch.zeros(4, 16)).item() == 1.0  # documented guard


def test_fake_quant_nvfp4_matches_weight_quantiser():
    x = _x(shape=(8, 64))
    gs = nvfp4_global_scale(x)
    assert torch.equal(fake_quant_nvfp4(x, gs), quantize_nvfp4(x, gs).dequantize())


def test_fake_quant_nvfp4_idempotent_and_bounded():
    x = _x()
    gs = nvfp4_global_scale(x)
    y = fake_quant_nvfp4(x, gs)
    assert y.shape == x.shape and y.dtype == x.dtype
    assert torch.equal(fake_quant_nvfp4(y, gs), y)
    assert not torch.equal(y, x)
    blocks = x.view(-1, 16)
    amax = blocks.abs().amax(-1, keepdim=True)
    d = (amax / (6 * gs)).to(torch.float8_e4m3fn).float() * gs
    a = blocks.abs() / d
    half = torch.where(a <= 2, 0.25, torch.where(a <= 4, 0.5, 1.0))
    bound = torch.where(a > 6, a - 6, half) * d
    assert torch.all((y.view(-1, 16) - blocks).abs() <= bound + 1e-6 * blocks.abs())


def test_fake_quant_nvfp4_dtypes_and_shape_checks():
    x = _x().bfloat16()
    y = fake_quant_nvfp4(x, nvfp4_global_scale(x))
    assert y.dtype == torch.bfloat16 and y.shape == x.shape
    assert torch.equal(fake_quant_nvfp4(x, 0.01), fake_quant_nvfp4(x, torch.tensor([0.01])))
    with pytest.raises(ValueError):
        fake_quant_nvfp4(torch.randn(2, 24), 0.1)
    z = torch.zeros(2, 32)
    assert torch.equal(fake_quant_nvfp4(z, nvfp4_global_scale(z)), z)


def test_fake_quant_nvfp4_small_global_scale_clips():
    x = _x(shape=(4, 32))
    gs = nvfp4_global_scale(x)
    y = fake_quant_nvfp4(x, gs / 4)  # scales saturate at 448: values clip to 6*448*gs/4 = amax/4
    assert y.abs().max() <= x.abs().max() / 4 * (1 + 1e-6)
    assert not y.isnan().any()


# ----------------------------------------------------------------------------- FP8 activations
@pytest.mark.parametrize("scale_format", ["fp32", "e8m0"])
def test_fake_quant_fp8_matches_weight_quantiser_on_one_row(scale_format):
    x = _x(shape=(1, 300))  # partial last block (300 = 2*128 + 44)
    y = fake_quant_fp8_block(x, scale_format=scale_format)
    assert torch.equal(y, quantize_fp8_block(x, scale_format=scale_format).dequantize())


def test_fake_quant_fp8_per_row_blocks_bounded_idempotent():
    x = _x(shape=(2, 5, 256))
    x[0, 0, :128] *= 100  # a loud block must not affect its neighbours
    y = fake_quant_fp8_block(x)
    assert y.shape == x.shape and y.dtype == x.dtype
    assert torch.equal(y[0, 0, 128:], fake_quant_fp8_block(x[0, 0, 128:]))
    s = x.view(-1, 128).abs().amax(-1, keepdim=True) / 448
    bound = torch.maximum(x.view(-1, 128).abs() / 16, 2.0**-10 * s)
    assert torch.all((y.view(-1, 128) - x.view(-1, 128)).abs() <= bound * (1 + 1e-6))
    ye = fake_quant_fp8_block(x, scale_format="e8m0")
    assert torch.equal(fake_quant_fp8_block(ye, scale_format="e8m0"), ye)
    assert not torch.equal(ye, y)


def test_fake_quant_fp8_amax_floor_and_zero():
    x = torch.zeros(2, 128)
    x[1] = 1e-6
    y = fake_quant_fp8_block(x)
    assert torch.all(y[0] == 0) and not y.isnan().any()
    s = torch.tensor(1e-4) / 448  # official kernel floors amax at 1e-4
    assert torch.equal(y[1], (x[1] / s).to(torch.float8_e4m3fn).float() * s)
    assert not torch.equal(y[1], fake_quant_fp8_block(x, amax_floor=0.0)[1])
    assert fake_quant_fp8_block(x.bfloat16()).dtype == torch.bfloat16


# ----------------------------------------------------------------------------- qlinear
def _weights():
    g = torch.Generator().manual_seed(11)
    w = torch.randn(48, 64, generator=g) * 0.05
    return w, [PlainWeight(w), quantize_nvfp4(w), quantize_mxfp4(w), quantize_fp8_block(w, "e8m0")]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_qlinear_none_is_f_linear(dtype):
    w, qs = _weights()
    x = _x().to(dtype)
    for q in qs:
        y = qlinear(x, q)
        assert y.dtype == dtype and y.shape == (2, 3, 48)
        assert torch.equal(y, F.linear(x, q.dequantize(dtype)))
    assert torch.equal(qlinear(x, w.to(dtype)), F.linear(x, w.to(dtype)))  # bare tensor


def test_qlinear_act_modes():
    _, qs = _weights()
    x = _x()
    q = qs[1]
    wd = q.dequantize()
    assert torch.equal(qlinear(x, q, act="fp8"), F.linear(fake_quant_fp8_block(x), wd))
    assert torch.equal(qlinear(x, q, act="nvfp4"), F.linear(fake_quant_nvfp4(x, nvfp4_global_scale(x)), wd))
    assert not torch.equal(qlinear(x, q, act="nvfp4"), qlinear(x, q))
    with pytest.raises(ValueError):
        qlinear(x, q, act="int8")
    with pytest.raises(ValueError):
        qlinear(x, q, act="nvfp4", act_scale="max")


def test_qlinear_global_scale_choice_matters():
    w, _ = _weights()
    x = _x()
    runtime = nvfp4_global_scale(x)
    q = quantize_nvfp4(w, input_scale=runtime * 3)  # calibrated scale != runtime amax/(6*448)
    y_amax = qlinear(x, q, act="nvfp4", act_scale="amax")
    y_in = qlinear(x, q, act="nvfp4", act_scale="input_scale")
    assert not torch.equal(y_amax, y_in)
    assert torch.equal(y_in, F.linear(fake_quant_nvfp4(x, q.input_scale), q.dequantize()))
    same = quantize_nvfp4(w, input_scale=runtime)  # equal scales -> identical outputs
    assert torch.equal(qlinear(x, same, act="nvfp4", act_scale="input_scale"), qlinear(x, same, act="nvfp4"))
    with pytest.raises(ValueError, match="input_scale"):
        qlinear(x, quantize_nvfp4(w), act="nvfp4", act_scale="input_scale")


def test_qlinear_weight_cache_is_used():
    _, qs = _weights()
    x = _x()
    cache = torch.ones(48, 64)
    assert torch.equal(qlinear(x, qs[2], weight_cache=cache), F.linear(x, cache))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_qlinear_cuda_graph_capturable():
    w, _ = _weights()
    q = quantize_nvfp4(w.cuda(), input_scale=0.01)
    x = _x().cuda().bfloat16()
    for act, sc in [("nvfp4", "amax"), ("nvfp4", "input_scale"), ("fp8", "amax"), ("none", "amax")]:
        ref = qlinear(x, q, act=act, act_scale=sc)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = qlinear(x, q, act=act, act_scale=sc)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, ref)
