"""Precision sweeps and the greedy precision floor; bf16 on NVFP4 == dequantised plain weights."""
from __future__ import annotations

import time

import pytest
import torch

from dsv4lab.precision.sweep import precision_floor, precision_sweep
from dsv4lab.workbench import random_model
from dsv4lab.precision import (dequantize_linears, linear_kinds, precision_state, quantize_linears)
from oracle_util import tiny_config

pytest.importorskip("dsv4lab.quant.weights")


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def qmodel():
    m = random_model(tiny_config(), seed=0)
    names = quantize_linears(m)
    assert len(names) == len(list(m.qlinears()))
    return m


@pytest.fixture(scope="module")
def ids():
    return torch.randint(0, 97, (1, 64), generator=torch.Generator().manual_seed(3))


def test_bf16_on_nvfp4_equals_dequantised_plain_weights(qmodel, ids):
    import copy

    from dsv4lab.precision import apply_precision, restore_precision

    saved = precision_state(qmodel)
    apply_precision(qmodel, "bf16")
    plain = copy.deepcopy(qmodel)
    assert dequantize_linears(plain) and not any(q.quantized for _, q in plain.qlinears())
    with torch.no_grad():
        a, b = qmodel(ids), plain(ids)
    restore_precision(qmodel, saved)
    assert torch.equal(a, b)
    # w4a16 keeps the weight quantised but (fp32 compute) uses the same values
    with torch.no_grad():
        assert torch.equal(qmodel(ids), a)


def test_sweep_table(qmodel, ids):
    modes = precision_state(qmodel)
    t0 = time.perf_counter()
    df = precision_sweep(qmodel, ids, reference="bf16", flip="w4a4", progress=False)
    elapsed = time.perf_counter() - t0
    kinds = linear_kinds(qmodel)
    assert list(df["kind"]) == ["(base)"] + kinds
    assert {"kind", "layers", "mode", "kl", "top1", "min_layer_cos", "router_overlap", "mem_delta_bytes"} <= set(df.columns)
    assert df.iloc[0]["kl"] == 0 and df.iloc[0]["top1"] == 1
    body = df.iloc[1:]
    assert (body["kl"] >= 0).all() and (body["kl"] > 0).any()
    assert body.set_index("kind").loc["head", "min_layer_cos"] == pytest.approx(1.0, abs=1e-12)  # after every layer
    assert (body["mem_delta_bytes"] < 0).all()  # leaving bf16 drops that kind's dense copies
    assert elapsed < 60
    assert precision_state(qmodel) == modes  # restored
    # the reverse direction (rescue): base w4a4, one kind back to bf16 -> memory grows by its dense copy
    rev = precision_sweep(qmodel, ids, reference="bf16", base="w4a4", flip="bf16", kinds=["head", "experts"], progress=False)
    assert list(rev["kind"]) == ["(base)", "head", "experts"]
    assert (rev.iloc[1:]["kl"] <= rev.iloc[0]["kl"] + 1e-12).all()
    assert rev.set_index("kind").loc["head", "mem_delta_bytes"] == 97 * 32 * 4


def test_per_layer_sweep(qmodel, ids):
    df = precision_sweep(qmodel, ids, kinds=["router", "compressor.wkv"], flip="w4a8", per_layer=True, progress=False)
    got = [(k, tuple(l) if l is not None else None) for k, l in zip(df["kind"], df["layers"])]
    assert got == [("(base)", None), ("router", (0,)), ("router", (1,)), ("router", (2,)), ("router", (3,)),
                   ("compressor.wkv", (1,)), ("compressor.wkv", (2,)), ("compressor.wkv", (3,))]
    assert (df["kl"] >= 0).all() and df.iloc[0]["kl"] == 0


def test_precision_floor(qmodel, ids):
    full = precision_sweep(qmodel, ids, flip="w4a4", kinds=["head"], include_base=False, progress=False)
    res = precision_floor(qmodel, ids, threshold=0.02, base="w4a4", fix="bf16", progress=False)
    assert res.reached and res.kl < 0.02 and 0 < len(res.kinds) < len(linear_kinds(qmodel))
    assert list(res.steps["step"]) == list(range(len(res.kinds) + 1))
    assert res.steps["kl"].iloc[-1] == res.kl and res.steps["added"].iloc[1:].tolist() == res.kinds
    assert "bf16" in res.policy.describe()
    loose = precision_floor(qmodel, ids, threshold=10.0, base="w4a4", progress=False)
    assert loose.kinds == [] and loose.reached
    assert full.iloc[0]["kind"] == "head"
    assert "precision floor" in str(res)
