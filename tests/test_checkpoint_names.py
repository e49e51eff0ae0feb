"""Key normalisation: official, transformers save_pretrained, transformers module layout."""
from __future__ import annotations

import pytest
import torch

from dsv4lab.checkpoint.expected import expected_tensors
from dsv4lab.checkpoint.fake import tiny_config
from dsv4lab.checkpoint.names import (
    KINDS, component_kind, is_linear, layer_of, normalize_key, split_name, to_raw_key,
)


def one(key, shape=None):
    r = normalize_key(key, shape)
    assert r is not None and len(r) == 1, (key, r)
    return r[0]


@pytest.mark.parametrize("raw,name", [
    ("layers.3.attn.wq_a.weight", "layers.3.attn.wq_a.weight"),
    ("layers.3.attn.wq_a.scale", "layers.3.attn.wq_a.scale"),
    ("layers.3.attn.wq_b.weight_scale_2", "layers.3.attn.wq_b.weight_scale_2"),
    ("layers.3.attn.wkv.input_scale", "layers.3.attn.wkv.input_scale"),
    ("layers.3.attn.norm.weight", "layers.3.attn.kv_norm.weight"),
    ("layers.3.attn.kv_norm.weight", "layers.3.attn.kv_norm.weight"),
    ("layers.3.attn.q_norm.weight", "layers.3.attn.q_norm.weight"),
    ("layers.3.attn.wo_a.weight_scale", "layers.3.attn.wo_a.weight_scale"),
    ("layers.3.attn.attn_sink", "layers.3.attn.sink"),
    ("layers.3.attn.compressor.wkv.weight", "layers.3.attn.compressor.wkv.weight"),
    ("layers.3.attn.compressor.wgate.weight", "layers.3.attn.compressor.wgate.weight"),
    ("layers.3.attn.compressor.norm.weight", "layers.3.attn.compressor.norm.weight"),
    ("layers.3.attn.compressor.ape", "layers.3.attn.compressor.ape"),
    ("layers.3.attn.indexer.wq_b.weight", "layers.3.attn.indexer.wq_b.weight"),
    ("layers.3.attn.indexer.weights_proj.weight", "layers.3.attn.indexer.weights_proj.weight"),
    ("layers.3.attn.indexer.compressor.ape", "layers.3.attn.indexer.compressor.ape"),
    ("layers.3.attn.indexer.compressor.norm.weight", "layers.3.attn.indexer.compressor.norm.weight"),
    ("layers.3.ffn.gate.weight", "layers.3.mlp.router.weight"),
    ("layers.3.ffn.gate.bias", "layers.3.mlp.router.bias"),
    ("layers.0.ffn.gate.tid2eid", "layers.0.mlp.router.tid2eid"),
    ("layers.3.ffn.shared_experts.w2.weight", "layers.3.mlp.shared_expert.w2.weight"),
    ("layers.3.ffn.experts.17.w3.weight_scale", "layers.3.mlp.experts.17.w3.weight_scale"),
    ("layers.3.ffn.experts.17.w1.scale", "layers.3.mlp.experts.17.w1.scale"),
    ("layers.3.hc_attn_fn", "layers.3.attn_hc.fn"),
    ("layers.3.hc_ffn_scale", "layers.3.ffn_hc.scale"),
    ("layers.3.attn_norm.weight", "layers.3.attn_norm.weight"),
    ("layers.3.ffn_norm.weight", "layers.3.ffn_norm.weight"),
    ("embed.weight", "embed.weight"), ("head.weight", "head.weight"), ("norm.weight", "norm.weight"),
    ("head.weight_scale", "head.weight_scale"),
    ("hc_head_fn", "hc_head.fn"), ("hc_head_base", "hc_head.base"), ("hc_head_scale", "hc_head.scale"),
    # transformers module layout
    ("model.layers.2.self_attn.q_a_proj.weight", "layers.2.attn.wq_a.weight"),
    ("model.layers.2.self_attn.q_a_norm.weight", "layers.2.attn.q_norm.weight"),
    ("model.layers.2.self_attn.kv_norm.weight", "layers.2.attn.kv_norm.weight"),
    ("model.layers.2.self_attn.o_b_proj.weight", "layers.2.attn.wo_b.weight"),
    ("model.layers.2.self_attn.sinks", "layers.2.attn.sink"),
    ("model.layers.2.self_attn.compressor.kv_norm.weight", "layers.2.attn.compressor.norm.weight"),
    ("model.layers.2.self_attn.compressor.position_bias", "layers.2.attn.compressor.ape"),
    ("model.layers.2.self_attn.compressor.indexer.q_b_proj.weight", "layers.2.attn.indexer.wq_b.weight"),
    ("model.layers.2.self_attn.compressor.indexer.gate_proj.weight", "layers.2.attn.indexer.compressor.wgate.weight"),
    ("model.layers.2.self_attn.compressor.indexer.scorer.weights_proj.weight",
     "layers.2.attn.indexer.weights_proj.weight"),
    ("model.layers.2.mlp.gate.e_score_correction_bias", "layers.2.mlp.router.bias"),
    ("model.layers.2.mlp.shared_experts.up_proj.weight", "layers.2.mlp.shared_expert.w3.weight"),
    ("model.layers.2.input_layernorm.weight", "layers.2.attn_norm.weight"),
    ("model.layers.2.post_attention_layernorm.weight", "layers.2.ffn_norm.weight"),
    ("model.layers.2.attn_hc.base", "layers.2.attn_hc.base"),
    ("lm_head.weight", "head.weight"), ("model.embed_tokens.weight", "embed.weight"),
    ("model.hc_head.hc_scale", "hc_head.scale"),
    # save_pretrained's mix
    ("model.layers.2.attn.attn_sink", "layers.2.attn.sink"),
    ("model.layers.2.ffn.experts.1.w2.weight", "layers.2.mlp.experts.1.w2.weight"),
    ("model.layers.2.hc_ffn_fn", "layers.2.ffn_hc.fn"),
])
def test_normalize_known_keys(raw, name):
    nk = one(raw)
    assert nk.name == name
    base, suffix = split_name(name)
    assert (nk.base, nk.suffix) == (base, suffix)


def test_ignored_and_unknown():
    assert normalize_key("mtp.0.attn.wq_a.weight") == []
    assert normalize_key("model.mtp.1.ffn.gate.weight") == []
    assert normalize_key("model.layers.0.self_attn.rotary_emb.inv_freq") == []
    assert normalize_key("layers.0.attn.wq_z.weight") is None
    assert normalize_key("something.else") is None
    assert normalize_key("model.layers.0.mlp.experts.gate_up_proj") is None  # fused needs its shape


def test_fused_experts_expand_with_slices():
    r = normalize_key("model.layers.1.mlp.experts.gate_up_proj", (3, 10, 8))
    assert [n.name for n in r[:2]] == ["layers.1.mlp.experts.0.w1.weight", "layers.1.mlp.experts.0.w3.weight"]
    assert len(r) == 6
    t = torch.arange(3 * 10 * 8).view(3, 10, 8)
    w1_2 = r[4]
    assert w1_2.name == "layers.1.mlp.experts.2.w1.weight"
    assert torch.equal(t[w1_2.slice.index()], t[2, :5])
    assert torch.equal(t[r[5].slice.index()], t[2, 5:])
    assert w1_2.slice.shape((3, 10, 8)) == (5, 8)
    d = normalize_key("model.layers.1.mlp.experts.down_proj", (3, 8, 5))
    assert [n.name for n in d] == [f"layers.1.mlp.experts.{e}.w2.weight" for e in range(3)]
    assert d[1].slice.shape((3, 8, 5)) == (8, 5)


@pytest.mark.parametrize("layout", ["official", "transformers", "canonical"])
def test_to_raw_key_inverts_normalize(layout):
    names = list(expected_tensors(tiny_config()))
    for name in names:
        raw = to_raw_key(name, layout)
        assert one(raw).name == name, (layout, name, raw)
        base, suffix = split_name(name)
        if suffix == "weight" and is_linear(base):
            for aux in ("weight_scale", "weight_scale_2", "input_scale", "scale"):
                assert one(to_raw_key(f"{base}.{aux}", layout)).name == f"{base}.{aux}"


def test_transformers_save_pretrained_and_state_dict_keys(tmp_path):
    transformers = pytest.importorskip("transformers")
    from safetensors import safe_open

    cfg = tiny_config()
    hf = transformers.DeepseekV4Config(**cfg.to_transformers_dict())
    torch.manual_seed(0)
    model = transformers.DeepseekV4ForCausalLM(hf)
    want = set(expected_tensors(cfg))
    # the module layout (fused experts)
    got = set()
    for k, v in model.state_dict().items():
        r = normalize_key(k, tuple(v.shape))
        assert r, k
        got.update(n.name for n in r)
    assert got == want
    # what save_pretrained writes; our transformers layout writes exactly these keys
    model.save_pretrained(tmp_path)
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        keys = list(f.keys())
    got = set()
    for k in keys:
        nk = one(k)
        got.add(nk.name)
        assert to_raw_key(nk.name, "transformers") == k
    assert got == want


def test_kinds_and_layers():
    cfg = tiny_config()
    for name, (shape, kind) in expected_tensors(cfg).items():
        assert component_kind(name) == kind, name
        assert kind in KINDS
    assert component_kind("layers.2.attn.wq_a.weight_scale") == "attn.wq_a"
    assert component_kind("layers.2.mlp.experts.3.w2") == "experts"
    assert layer_of("layers.12.attn.sink") == 12
    assert layer_of("head.weight") is None
    assert is_linear("layers.0.mlp.router") and is_linear("head.weight") and is_linear("layers.0.attn.wo_b")
    for name in ("embed.weight", "norm.weight", "layers.0.attn_norm.weight", "layers.0.mlp.router.bias",
                 "layers.0.attn.compressor.ape", "layers.0.attn_hc.fn", "layers.0.attn.sink", "hc_head.scale"):
        assert not is_linear(name), name
    with pytest.raises(KeyError):
        component_kind("layers.0.attn.nope.weight")
