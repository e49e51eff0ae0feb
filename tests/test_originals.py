"""``orig`` from a second checkpoint, in-place swaps, and flows that copy no model (issue 19).

The pair is an NVFP4 synth checkpoint and its official (FP8 block + MXFP4 experts) twin of the
same seed: the same BF16 master weights, so the official one is the NVFP4 one's reference.
"""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from dsv4lab.bugzoo import triage
from dsv4lab.checkpoint import CheckpointReader
from dsv4lab.checkpoint.fake import tiny_config
from dsv4lab.checkpoint.synth import synth_checkpoint
from dsv4lab.config import CSA, HCA
from dsv4lab.loading import load
from dsv4lab.precision import (
    Originals,
    apply_precision,
    dequantize_linears,
    precision_state,
    quantized_in_place,
    using_precision,
)
from dsv4lab.quant.weights import quantize_nvfp4
from dsv4lab.triage import ablation as AB
from dsv4lab.triage.session import open_session, quantized_twin

DTYPE = torch.float32


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("pair")
    cfg = tiny_config(n_experts=8, moe_intermediate_size=32, hidden_size=64, layer_types=[HCA, HCA, CSA, HCA],
                      mlp_layer_types=["hash_moe", "moe", "moe", "moe"])
    nv = synth_checkpoint(root / "nvfp4", cfg, "nvfp4", seed=7)["path"]
    off = synth_checkpoint(root / "official", cfg, "official", seed=7)["path"]
    return nv, off


@pytest.fixture
def model(pair):
    torch.set_num_threads(1)
    return load(pair[0], device="cpu", dtype=DTYPE, progress=False)


def plain_model(pair):
    """The NVFP4 synth model with its weights dequantised: a plain model to quantise in place."""
    m = load(pair[0], device="cpu", dtype=DTYPE, progress=False)
    dequantize_linears(m)
    return m


def ids(n: int = 20) -> torch.Tensor:
    return torch.randint(0, 64, (1, n), generator=torch.Generator().manual_seed(1))


def test_orig_from_checkpoint_is_the_official_weights_exactly(pair, model):
    official = CheckpointReader(pair[1])
    originals = Originals.from_checkpoint(pair[1], DTYPE)
    quantised = [name for name, ql in model.qlinears() if ql.quantized]
    assert quantised
    apply_precision(model, "orig", originals)
    assert sorted(originals.reads) == sorted(quantised)        # nothing else read
    for name, ql in model.qlinears():
        if name in quantised:
            assert torch.equal(ql.weight, official.weight(name).dequantize(DTYPE)), name


def test_reference_run_from_checkpoint_equals_the_official_model(pair, model):
    setup = AB.make_setup(open_session(model, reference=pair[1]), ids())
    assert setup.reference is setup.model and setup.reference_policy == "orig"
    ref_model = load(pair[1], device="cpu", dtype=DTYPE, progress=False)
    with torch.no_grad():
        want = ref_model(ids())
    torch.testing.assert_close(setup.reference_run().logits, want.cpu(), rtol=0, atol=1e-5)
    # the model under test is back to its NVFP4 weights after the reference run
    assert all(ql.quantized for name, ql in model.qlinears() if name not in ("head",) and ".router" not in name)


def test_orig_swap_restores_bit_exactly_after_an_exception(pair, model):
    before = {name: (ql.qweight, ql.weight) for name, ql in model.qlinears()}
    modes = precision_state(model)
    with pytest.raises(RuntimeError, match="in the body"):
        with using_precision(model, "orig", Originals.from_checkpoint(pair[1], DTYPE)):
            assert not any(ql.quantized for _, ql in model.qlinears())
            raise RuntimeError("in the body")
    for name, ql in model.qlinears():
        assert ql.qweight is before[name][0] and ql.weight is before[name][1], name
    assert precision_state(model) == modes


def test_quantized_in_place_restores_bit_exactly_after_an_exception(pair):
    plain = plain_model(pair)
    saved = {name: ql.weight.detach().clone() for name, ql in plain.qlinears()}
    ptrs = {name: ql.weight.data_ptr() for name, ql in plain.qlinears()}
    with pytest.raises(ValueError, match="boom"):
        with quantized_in_place(plain) as names:
            assert names and all(plain.get_submodule(n).quantized for n in names)
            raise ValueError("boom")
    for name, ql in plain.qlinears():
        assert not ql.quantized and torch.equal(ql.weight, saved[name]) and ql.weight.data_ptr() == ptrs[name]


@pytest.fixture
def no_model_copies(monkeypatch):
    real = copy.deepcopy

    def guarded(obj, *a, **k):
        if isinstance(obj, nn.Module):
            raise AssertionError(f"deep copy of a {type(obj).__name__}")
        return real(obj, *a, **k)

    monkeypatch.setattr(copy, "deepcopy", guarded)


@pytest.mark.parametrize("reference", [True, False], ids=["reference-checkpoint", "self-dequantised"])
def test_ablation_copies_no_model(pair, model, no_model_copies, reference):
    session = open_session(model, reference=pair[1] if reference else None)
    setup = AB.make_setup(session, ids())
    for policy in ("w4a16", {"default": "w4a4", "attn.wq_a": "orig"}, "orig"):
        r = AB.evaluate(setup, policy)
        assert torch.isfinite(torch.tensor(r["kl"]))
    assert AB.evaluate(setup, "orig" if reference else "bf16")["kl"] == pytest.approx(0.0, abs=1e-9)


def test_bugzoo_localisation_copies_no_model(pair, no_model_copies):
    plain = plain_model(pair)
    before = {name: ql.weight.detach().clone() for name, ql in plain.qlinears()}
    r = triage(plain, "weight_scale_2_dropped", ids(), quantize=True)
    assert r.applicable and r.quantized and r.localized, r.line()
    assert all(not ql.quantized and torch.equal(ql.weight, before[n]) for n, ql in plain.qlinears())


def test_quantized_twin_of_a_random_session_rebuilds_instead_of_copying(no_model_copies):
    session = open_session("random")
    q = quantized_twin(session)
    assert q is not session.model
    for name, ql in session.model.qlinears():
        twin = q.get_submodule(name)
        if twin.quantized:
            want = quantize_nvfp4(ql.weight.detach().float())
            assert all(torch.equal(a, b) for a, b in zip(twin.qweight.tensors().values(), want.tensors().values())), name


def test_nvfp4_twin_of_an_in_memory_model_shares_tensors_and_equals_a_quantised_copy():
    """open_session(model) with a model built in memory: the NVFP4 twin is the quantised copy
    the old code made with copy.deepcopy, without the copy (non-linear tensors are shared)."""
    import copy

    from dsv4lab.precision import quantize_linears
    from dsv4lab.triage.session import nvfp4_twin
    from dsv4lab.workbench import random_model
    from oracle_util import tiny_config

    plain = random_model(tiny_config(), seed=0)
    before = {k: v.clone() for k, v in plain.state_dict().items()}
    twin = nvfp4_twin(plain)
    expected = copy.deepcopy(plain)
    quantize_linears(expected, fmt="nvfp4")
    ids = torch.randint(0, plain.config.vocab_size, (1, 40), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert torch.equal(twin(ids), expected(ids))
    assert all(ql.quantized for _, ql in twin.qlinears() if ql.in_features % 16 == 0)
    assert twin.embed.weight.data_ptr() == plain.embed.weight.data_ptr()
    assert twin.layers[1].attn.sink.data_ptr() == plain.layers[1].attn.sink.data_ptr()
    assert all(torch.equal(before[k], v) for k, v in plain.state_dict().items())  # the original is untouched
    assert not any(ql.quantized for _, ql in plain.qlinears())
