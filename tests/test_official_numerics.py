"""The official round trips (RoundTrip) as policy switches, their arithmetic against references
written here from the equations (Hadamard matrix by its entry formula, E2M1 grid, power-of-two
scales), w4a8's power-of-two option and expert order, and the official edge cases of the MoE
(swiglu_limit <= 0, softmax scoring). The whole-model check is tests/model/test_official.py."""
from __future__ import annotations


import pytest
import torch
import torch.nn.functional as F

from dsv4lab.decode.graphs import model_signature
from dsv4lab.model.linear import QLinear
from dsv4lab.precision import (ROUND_TRIPS, Mode, PrecisionPolicy, RoundTrip, UnknownChoiceError, apply_precision,
                               precision_state, quantize_linears, using_precision)
from dsv4lab.quant.activations import fake_quant_fp4_pow2, fake_quant_fp8_block
from dsv4lab.quant.hadamard import hadamard
from dsv4lab.quant.weights import quantize_fp8_block
from dsv4lab.workbench import random_model
from official_ref import e2m1_nearest, hadamard_matrix
from oracle_util import random_ids, tiny_config

pytestmark = pytest.mark.usefixtures("one_thread")


# ------------------------------------------------------------------------------ arithmetic
@pytest.mark.parametrize("d", [1, 2, 8, 32, 128])
def test_hadamard_matches_the_explicit_matrix(d):
    x = torch.randn(3, 5, d, dtype=torch.float64, generator=torch.Generator().manual_seed(d))
    ref = x @ hadamard_matrix(d) * d ** -0.5
    got = hadamard(x.float()).double()
    assert torch.allclose(got, ref, atol=1e-5)
    assert torch.allclose(hadamard(hadamard(x.float())).double(), x, atol=1e-5)  # its own inverse
    assert torch.allclose(got.norm(dim=-1), x.norm(dim=-1), rtol=1e-5)           # orthonormal


def test_hadamard_rejects_other_sizes():
    with pytest.raises(ValueError, match="power-of-two"):
        hadamard(torch.zeros(4, 24))


def test_fp4_pow2_round_trip_matches_the_equation():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(6, 64, generator=g) * torch.logspace(-3, 2, 6).view(-1, 1)
    x[0, :32] = 0.0                                           # all-zero block: floored amax
    x[1, 5] = 6.0 * 2.0 ** 3                                  # amax/6 exactly a power of two
    blocks = x.double().view(6, 2, 32)
    amax = blocks.abs().amax(-1, keepdim=True).clamp_min(6 * 2.0 ** -126)
    s = 2.0 ** torch.ceil(torch.log2(amax / 6))
    ref = (e2m1_nearest(blocks / s) * s).view(6, 64)
    got = fake_quant_fp4_pow2(x)
    assert torch.equal(got.double(), ref)
    assert torch.equal(got[0, :32], torch.zeros(32))
    with pytest.raises(ValueError, match="% 32"):
        fake_quant_fp4_pow2(torch.zeros(2, 48))


def test_fp8_pow2_scales_are_powers_of_two_and_bound_amax():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(4, 200, generator=g) * 3                 # a partial last block of 72
    got = fake_quant_fp8_block(x, 128, scale_format="e8m0")
    for blk in (slice(0, 128), slice(128, 200)):
        xb = x[:, blk].double()
        amax = xb.abs().amax(-1, keepdim=True).clamp_min(1e-4)
        s = 2.0 ** torch.ceil(torch.log2(amax / 448))
        ref = (xb / s).float().to(torch.float8_e4m3fn).double() * s
        assert torch.equal(got[:, blk].double(), ref)


# ------------------------------------------------------------------------------ the policy words
def test_official_policy_and_round_trip_words():
    off = PrecisionPolicy.parse("official")
    assert off.default == Mode.W4A16 and set(off.round_trips) == set(ROUND_TRIPS)
    assert all(v is None for v in off.round_trips.values())
    one = PrecisionPolicy.parse("kv_fp8")
    assert one.default == Mode.W4A16 and one.round_trips == {RoundTrip.KV_FP8: None}
    pol = PrecisionPolicy.parse({"default": "official", "probs_bf16": False, ("head", None): "bf16"})
    assert RoundTrip.PROBS_BF16 not in pol.round_trips and len(pol.round_trips) == 4 and pol.default == Mode.W4A16
    pol = PrecisionPolicy.parse({"default": "w4a8", "act_fp8_pow2": True, ("indexer_fp4", 1): True, "kv_fp8": [2, 3]})
    assert pol.round_trips_for(1) == {RoundTrip.ACT_FP8_POW2, RoundTrip.INDEXER_FP4}
    assert pol.round_trips_for(3) == {RoundTrip.ACT_FP8_POW2, RoundTrip.KV_FP8}
    assert pol.describe() == "default=w4a8, act_fp8_pow2, kv_fp8[L2,L3], indexer_fp4[L1]"
    assert pol.with_round_trip("kv_fp8", False).round_trips_for(2) == {RoundTrip.ACT_FP8_POW2}
    assert PrecisionPolicy.parse({"experts": "official"}).rules[0].mode == Mode.OFFICIAL
    with pytest.raises(UnknownChoiceError, match="'kv_fp8'"):
        PrecisionPolicy.parse({"round_trips": ["kv_fp9"]})


# ------------------------------------------------------------------------------ on a model
@pytest.fixture(scope="module")
def model():
    m = random_model(tiny_config(moe_intermediate_size=32, index_head_dim=32), seed=3)
    quantize_linears(m, kinds=["experts"], fmt="mxfp4")
    quantize_linears(m, kinds=["attn.wq_a", "attn.wq_b", "attn.wkv", "attn.wo_b", "indexer.wq_b", "shared_expert"], fmt="fp8")
    return m


@pytest.fixture(scope="module")
def ids(model):
    return random_ids(model.config, n=40, b=1, seed=4)


def test_each_round_trip_moves_the_logits_and_comes_off_again(model, ids):
    with torch.no_grad():
        ref = model(ids)
        saved = precision_state(model)
        moved = {}
        for rt in ROUND_TRIPS:
            with using_precision(model, rt) as report:
                assert report["round_trips_changed"]
                moved[rt] = (model(ids) - ref).abs().max().item()
            assert precision_state(model) == saved
        assert torch.equal(model(ids), ref)
    assert all(v > 0 for v in moved.values()), moved


def test_round_trips_land_on_their_modules_per_layer(model):
    with using_precision(model, {"default": "w4a16", "kv_fp8": [1], "indexer_fp4": True, "weight_before_w2": [2]}):
        l1, l2 = model.layers[1], model.layers[2]
        assert l1.attn.round_trips == {RoundTrip.KV_FP8} and l1.attn.compressor.round_trips == {RoundTrip.KV_FP8}
        assert l1.attn.indexer.round_trips == {RoundTrip.INDEXER_FP4}
        assert l1.attn.indexer.compressor.round_trips == {RoundTrip.INDEXER_FP4}
        assert l2.attn.round_trips == frozenset() and l2.mlp.experts.weight_before_w2
        assert not l1.mlp.experts.weight_before_w2 and l1.attn.wkv.round_trips == frozenset()
    assert model.layers[1].attn.round_trips == frozenset()


def test_a_round_trip_toggled_after_capture_changes_the_signature(model):
    s0 = model_signature(model)
    for rt in ROUND_TRIPS:
        with using_precision(model, rt):
            assert model_signature(model) != s0, rt
        assert model_signature(model) == s0, rt


def test_official_linear_quantises_only_quantised_weights_and_never_wo_a():
    torch.manual_seed(0)
    ql = QLinear(256, 8)
    ql.set_weight(torch.randn(8, 256))
    x = torch.randn(3, 256) * 5
    ql.set_mode("official")
    assert torch.equal(ql(x), F.linear(x, ql.weight))             # plain weight: plain, as F.linear
    ql.set_weight(quantize_fp8_block(torch.randn(8, 256), "e8m0"))
    xq = fake_quant_fp8_block(x, 128, scale_format="e8m0")
    assert torch.equal(ql(x), F.linear(xq, ql.dense_weight(x.dtype)))
    wo_a = QLinear(128, 8)                                         # wo_a: a BF16 einsum upstream
    wo_a.set_weight(quantize_fp8_block(torch.randn(8, 128), "e8m0"))
    wo_a.set_mode("official")
    xg = x.view(3, 2, 128)
    ref = torch.einsum("tgi,goi->tgo", xg, wo_a.dense_weight(x.dtype).view(2, 4, 128))
    assert torch.allclose(wo_a.grouped(xg, 2), ref, atol=1e-5)


def test_w4a8_power_of_two_option():
    torch.manual_seed(1)
    ql = QLinear(256, 8)
    ql.set_weight(torch.randn(8, 256))
    x = torch.randn(3, 256) * 5
    ql.set_mode("w4a8")
    assert torch.equal(ql(x), F.linear(fake_quant_fp8_block(x), ql.weight))
    ql.round_trips = frozenset({RoundTrip.ACT_FP8_POW2})
    assert torch.equal(ql(x), F.linear(fake_quant_fp8_block(x, scale_format="e8m0"), ql.weight))
    assert not torch.equal(fake_quant_fp8_block(x), fake_quant_fp8_block(x, scale_format="e8m0"))


def _moe_inputs(cfg, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(1, 7, cfg.hidden_size, generator=g) * 3


def test_w4a8_experts_take_the_routing_weight_before_w2(model):
    moe = model.layers[2].mlp
    x = _moe_inputs(model.config).view(-1, model.config.hidden_size)
    with torch.no_grad(), using_precision(model, {"default": "w4a16", "experts": "w4a8"}):
        assert moe.experts.weight_before_w2
        ids, w = moe.router(x, None)
        got = moe.experts(x, ids, w)
        ref = torch.zeros_like(x)
        for t in range(x.shape[0]):
            for j in range(ids.shape[1]):
                e = moe.experts[int(ids[t, j])]
                xq = fake_quant_fp8_block(x[t:t + 1])
                h = F.silu(F.linear(xq, e.w1.dense_weight(x.dtype)).clamp(max=model.config.swiglu_limit)) * \
                    F.linear(xq, e.w3.dense_weight(x.dtype)).clamp(-model.config.swiglu_limit, model.config.swiglu_limit)
                ref[t] += F.linear(fake_quant_fp8_block(h * w[t, j]), e.w2.dense_weight(x.dtype))[0]
        assert torch.allclose(got, ref, atol=1e-5)
        for graph_safe in (True,):        # the masked decode loop gives the same
            assert torch.allclose(moe.experts(x, ids, w, graph_safe), ref, atol=1e-5)


# ------------------------------------------------------------------------------ edge cases
def test_swiglu_limit_zero_means_no_clamp():
    cfg = tiny_config(swiglu_limit=0.0)
    m = random_model(cfg, seed=1)
    x = _moe_inputs(cfg)
    e = m.layers[1].mlp.shared_expert
    with torch.no_grad():
        y = e(x)
        ref = F.linear(F.silu(F.linear(x, e.w1.weight)) * F.linear(x, e.w3.weight), e.w2.weight)
        assert torch.allclose(y, ref, atol=1e-6) and y.abs().max() > 0
        logits = m(random_ids(cfg, n=12, b=1))
    assert torch.isfinite(logits).all() and logits.std() > 0


def test_softmax_scoring_keeps_the_top_k_softmax_weights():
    cfg = tiny_config(scoring_func="softmax")
    m = random_model(cfg, seed=2)
    router = m.layers[1].mlp.router
    x = _moe_inputs(cfg).view(-1, cfg.hidden_size)
    with torch.no_grad():
        ids, w = router(x, None)
        probs = torch.softmax(F.linear(x, router.weight).float(), dim=-1)
    assert torch.allclose(w, probs.gather(1, ids) * cfg.routed_scaling_factor, atol=1e-6)
    assert (w.sum(-1) < cfg.routed_scaling_factor - 1e-3).all()   # not renormalised to the scale


def test_indexer_fp4_on_an_index_head_dim_it_cannot_rotate_says_so():
    m = random_model(tiny_config(), seed=0)              # index_head_dim 16
    saved = precision_state(m)
    with pytest.raises(ValueError, match=r"'indexer_fp4'.*has 16.*'indexer_fp4': False"):
        apply_precision(m, "official")
    assert precision_state(m) == saved
    apply_precision(m, {"default": "official", "indexer_fp4": False})   # the rest runs
