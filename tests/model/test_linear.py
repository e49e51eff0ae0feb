"""QLinear (dsv4lab/model/linear.py): each precision mode is the equation of the module docstring
computed here from the quant primitives; the grouped projection equals the oracle's
DeepseekV4GroupedLinear; NVFP4 dequantisation without weight_scale_2 is the known wrong variant.

Tolerances: identical computations bit for bit (torch.equal); grouped vs the oracle and vs the
block-diagonal einsum float32 atol=1e-6, rtol=1e-6; a wrong variant must miss by more than 1e-3.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4GroupedLinear

from dsv4lab.analysis.components import shallow_clone
from dsv4lab.bugzoo.variants import WeightScale2DroppedMixin
from dsv4lab.model.linear import QLinear
from dsv4lab.quant.activations import fake_quant_fp8_block, fake_quant_nvfp4, nvfp4_global_scale
from dsv4lab.quant.weights import quantize_mxfp4, quantize_nvfp4

ATOL, RTOL = 1e-6, 1e-6
WRONG = 1e-3
IN, OUT = 128, 48


def _w(seed=0):
    return torch.randn(OUT, IN, generator=torch.Generator().manual_seed(seed)) * 0.1


def _x(seed=1, shape=(2, 3, IN)):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _linear(w) -> QLinear:
    ql = QLinear(IN, OUT)
    ql.set_weight(w)
    return ql


def test_modes_are_the_docstring_equations():
    x = _x()
    for w in (_w(), quantize_nvfp4(_w()), quantize_mxfp4(_w())):
        ql = _linear(w)
        wd = ql.dense_weight(torch.float32)
        if ql.quantized:
            assert torch.equal(wd, w.dequantize(torch.float32))
        with torch.no_grad():
            for mode, x_used in [("bf16", x), ("w4a16", x),
                                 ("w4a4", fake_quant_nvfp4(x, nvfp4_global_scale(x))),
                                 ("w4a8", fake_quant_fp8_block(x))]:
                ql.set_mode(mode)
                assert torch.equal(ql(x), F.linear(x_used, wd)), (ql.format, mode)
        ql.set_mode("w4a16")
        assert not torch.equal(F.linear(fake_quant_nvfp4(x, nvfp4_global_scale(x)), wd), ql(x))  # w4a4 is not a no-op


def test_dense_mode_caches_only_there():
    ql = _linear(quantize_nvfp4(_w()))
    packed = ql.memory_bytes()
    ql(_x())
    assert ql.memory_bytes() == packed  # w4a16: dequantised per call, nothing kept
    ql.set_mode("bf16")  # the bf16 policy name
    assert ql.mode == "bf16"
    ql(_x())
    assert ql.memory_bytes() == packed + OUT * IN * 4
    ql.set_mode("w4a16")
    assert ql.memory_bytes() == packed


def test_act_scale_input_scale_and_errors():
    x = _x()
    w = _w()
    ql = _linear(quantize_nvfp4(w, input_scale=0.004))
    ql.set_mode("w4a4", act_scale="input_scale")
    with torch.no_grad():
        assert torch.equal(ql(x), F.linear(fake_quant_nvfp4(x, torch.tensor(0.004)), ql.dense_weight(torch.float32)))
    no_scale = _linear(quantize_nvfp4(w))
    no_scale.set_mode("w4a4", act_scale="input_scale")
    with pytest.raises(ValueError, match="input_scale"):
        no_scale(x)
    with pytest.raises(ValueError):
        ql.set_mode("int8")
    with pytest.raises(ValueError):
        ql.set_mode("w4a4", act_scale="max")
    with pytest.raises(ValueError):
        QLinear(IN, OUT).set_weight(torch.zeros(IN, OUT))


def test_grouped_matches_oracle_grouped_linear():
    groups = 4
    w = _w(seed=3)  # [OUT, IN]: groups row blocks of OUT/groups, each reading IN features
    x = _x(seed=4, shape=(2, 5, groups, IN))
    ref = DeepseekV4GroupedLinear(IN, OUT, groups)
    with torch.no_grad():
        ref.weight.copy_(w)
        want = ref(x)
        for wt in (w, quantize_nvfp4(w)):
            ql = _linear(wt)
            got = ql.grouped(x, groups)
            wd = ql.dense_weight(torch.float32)
            torch.testing.assert_close(got, torch.einsum("bsgi,goi->bsgo", x, wd.view(groups, -1, IN)),
                                       atol=ATOL, rtol=RTOL)
            if not ql.quantized:
                torch.testing.assert_close(got, want, atol=ATOL, rtol=RTOL)
        # rows interleaved across groups (g, g+G, ...) instead of contiguous blocks: the wrong layout
        interleaved = torch.einsum("bsgi,goi->bsgo", x, w.view(-1, groups, IN).transpose(0, 1))
        assert (interleaved - want).abs().max().item() > WRONG


def test_weight_scale_2_dropped_misses():
    q = quantize_nvfp4(_w())
    assert abs(q.global_scale.item() - 1.0) > 1e-3  # a per-tensor scale that matters
    ql = _linear(q)
    cls = type("NoWs2", (WeightScale2DroppedMixin, QLinear), {})
    with torch.no_grad():
        good, bad = ql(_x()), shallow_clone(ql, cls)(_x())
    assert (good - bad).abs().max().item() > WRONG
