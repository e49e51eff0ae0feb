"""The precision vocabulary, PrecisionPolicy rules (incl. the old per-(kind, layer) toggles),
orig through Originals, and the errors for words and targets that do not exist."""
from __future__ import annotations

import copy

import pytest
import torch

from dsv4lab.workbench import random_model
from dsv4lab.model.linear import QLinear
from dsv4lab.precision import (Mode, Originals, PrecisionPolicy, UnknownChoiceError, UnknownTargetError,
                               apply_precision, linear_kind, linear_layer, precision_state, quantize_linears,
                               restore_precision, using_precision)
from dsv4lab.precision.sweep import precision_floor, precision_sweep
from oracle_util import tiny_config

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def plain():
    return random_model(tiny_config(), seed=0)


@pytest.fixture(scope="module")
def quant(plain):
    q = copy.deepcopy(plain)
    quantize_linears(q)
    return q


@pytest.fixture(scope="module")
def ids():
    return torch.randint(0, 97, (1, 24), generator=torch.Generator().manual_seed(5))


def _weights(model) -> dict:
    """name -> (the weight object held, a copy of its tensors) of every linear."""
    out = {}
    for name, ql in model.qlinears():
        w = ql.qweight if ql.quantized else ql.weight
        tensors = [t.clone() for t in vars(w).values() if isinstance(t, torch.Tensor)] if ql.quantized else [w.detach().clone()]
        out[name] = (w, tensors)
    return out


def _assert_same_weights(model, saved: dict) -> None:
    for name, ql in model.qlinears():
        w, tensors = saved[name]
        now = ql.qweight if ql.quantized else ql.weight
        if ql.quantized:
            assert now is w, name
            assert all(torch.equal(a, b) for a, b in zip(tensors, [t for t in vars(now).values() if isinstance(t, torch.Tensor)]))
        else:
            assert torch.equal(now, tensors[0]), name


# ------------------------------------------------------------------------------ did-you-mean
def test_unknown_words_name_the_value_and_suggest():
    with pytest.raises(UnknownChoiceError, match=r"'bf61'; did you mean 'bf16'"):
        PrecisionPolicy("bf61")
    with pytest.raises(UnknownChoiceError, match=r"'w4a5'.*did you mean"):
        PrecisionPolicy.parse({"head": "w4a5"})
    with pytest.raises(UnknownChoiceError, match=r"act_scale 'amx'; did you mean 'amax'"):
        PrecisionPolicy("w4a4", act_scale="amx")
    ql = QLinear(32, 16)
    with pytest.raises(ValueError, match="'dense'"):  # one word: bf16
        ql.set_mode("dense")
    with pytest.raises(UnknownChoiceError, match="'orig'"):  # a policy word; QLinear runs LINEAR_MODES
        ql.set_mode("orig")
    ql.set_mode("bf16", "input_scale")
    assert (ql.mode, ql.act_scale) == (Mode.BF16, "input_scale") and ql.mode == "bf16"


def test_unknown_targets_raise_instead_of_changing_nothing(quant, ids):
    saved = precision_state(quant)
    with pytest.raises(UnknownTargetError, match=r"'haed'; did you mean 'head'"):
        apply_precision(quant, {"haed": "bf16"})
    with pytest.raises(UnknownTargetError, match=r"'router'.*L9"):
        apply_precision(quant, PrecisionPolicy().with_rule("router", "bf16", layers=[9]))
    with pytest.raises(UnknownTargetError, match=r"'expert'; did you mean 'experts'"):
        precision_sweep(quant, ids, kinds=["expert"], progress=False)
    with pytest.raises(UnknownTargetError, match="'routr'"):
        precision_floor(quant, ids, 0.1, kinds=["routr"], progress=False)
    assert precision_state(quant) == saved
    apply_precision(quant, {"layers.2.attn.*": "bf16", "compressor.*": "w4a8"})  # patterns that match are fine
    restore_precision(quant, saved)


# ------------------------------------------------------------------------------ Toggles as rules
def _toggles_mode(default, kinds, layers, kind, layer):
    """What triage.ablation.Toggles.mode_for did: (kind, layer) over kind over default."""
    return layers.get((kind, layer), kinds.get(kind, default))


def test_per_kind_and_per_layer_modes_as_rules(quant):
    default, kinds, layers = "w4a4", {"head": "orig", "router": "bf16", "experts": "w4a8"}, \
        {("router", 2): "w4a16", ("experts", 0): "orig", ("head", None): "w4a16", ("attn.wkv", 3): "bf16"}
    # set in an order where per-layer overrides come first: they must still win
    pol = PrecisionPolicy(default)
    for (k, l), m in layers.items():
        pol = pol.set(k, m, [l])
    for k, m in kinds.items():
        pol = pol.set(k, m)
    parsed = PrecisionPolicy.parse({"default": default, **kinds, **layers})
    for name, _ in quant.qlinears():
        want = _toggles_mode(default, kinds, layers, linear_kind(name), linear_layer(name))
        assert pol.mode_for(name)[0] == want, name
        assert parsed.mode_for(name)[0] == want, name
    # changing a kind keeps its place; unset drops exactly one rule
    pol2 = pol.set("router", "w4a8").unset("experts", [0])
    assert pol2.mode_for("layers.2.mlp.router")[0] == "w4a16" and pol2.mode_for("layers.1.mlp.router")[0] == "w4a8"
    assert pol2.mode_for("layers.0.mlp.experts.1.w2")[0] == "w4a8"
    assert "router[L2]=w4a16" in pol.describe() and pol.describe().startswith("default=w4a4")
    assert pol.rule_for("head").mode == Mode.ORIG and pol.rule_for("attn.wq_a") is None


# ------------------------------------------------------------------------------ orig + Originals
def test_orig_swaps_original_weights_and_restores_them_bitwise(plain, quant, ids):
    originals = Originals.from_model(plain)
    before, modes = _weights(quant), precision_state(quant)
    pol = PrecisionPolicy("w4a4").set("head", "orig").set("experts", "orig", [1])
    with using_precision(quant, pol, originals) as report:
        assert torch.equal(quant.head.weight, plain.head.weight) and quant.head.mode == Mode.BF16
        e = quant.layers[1].mlp.experts[0].w1
        assert not e.quantized and torch.equal(e.weight, plain.layers[1].mlp.experts[0].w1.weight)
        assert quant.layers[0].mlp.experts[0].w1.quantized and quant.layers[0].mlp.experts[0].w1.mode == Mode.W4A4
        assert ("head", Mode.W4A16, Mode.ORIG) in report["changed"]
        # a later policy without orig puts the quantised weights back by itself
        apply_precision(quant, "w4a16", originals)
        assert quant.head.quantized
        apply_precision(quant, pol, originals)
        assert not quant.head.quantized
    _assert_same_weights(quant, before)
    assert precision_state(quant) == modes
    # all orig: the logits of the original model, bitwise
    with torch.no_grad(), using_precision(quant, "orig", originals):
        got = quant(ids)
    with torch.no_grad():
        assert torch.equal(got, plain(ids))
    _assert_same_weights(quant, before)


def test_orig_restored_when_the_body_raises_and_when_nested(plain, quant):
    originals = Originals.from_model(plain)
    before, modes = _weights(quant), precision_state(quant)
    with pytest.raises(RuntimeError, match="boom"):
        with using_precision(quant, {"default": "w4a8", "head": "orig", "router": "orig"}, originals):
            assert not quant.head.quantized
            raise RuntimeError("boom")
    _assert_same_weights(quant, before)
    assert precision_state(quant) == modes and "precision_policy" not in quant.__dict__
    with using_precision(quant, {"head": "orig"}, originals):
        with using_precision(quant, "w4a4", originals):
            assert quant.head.quantized and quant.head.mode == Mode.W4A4
        assert not quant.head.quantized and torch.equal(quant.head.weight, plain.head.weight)
    _assert_same_weights(quant, before)
    with pytest.raises(ValueError, match="'head'.*needs originals="):
        apply_precision(quant, {"head": "orig"})
    _assert_same_weights(quant, before)
    assert precision_state(quant) == modes


def test_apply_is_all_or_nothing(plain, quant):
    class Partial(Originals):  # a source that lacks one linear
        def weight(self, name):
            if name == "head":
                raise KeyError(name)
            return Originals.from_model(plain).weight(name)

    before, modes = _weights(quant), precision_state(quant)
    with pytest.raises(KeyError):
        apply_precision(quant, {"default": "w4a8", "router": "orig", "head": "orig"}, Partial())
    _assert_same_weights(quant, before)
    assert precision_state(quant) == modes
