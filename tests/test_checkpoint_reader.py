"""CheckpointReader: formats, fused experts, lazy handles, and the errors it must name."""
from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import save_file

from dsv4lab.checkpoint import CheckpointError
from dsv4lab.checkpoint.fake import random_state, tiny_config
from dsv4lab.checkpoint.formats import detect_format
from dsv4lab.checkpoint.reader import CheckpointReader
from dsv4lab.checkpoint.writer import save_checkpoint
from dsv4lab.quant.weights import (
    FP8BlockWeight, NVFP4Weight, PlainWeight, quantize_fp8_block, quantize_mxfp4, quantize_nvfp4,
)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    a, b = a.detach().contiguous(), b.detach().contiguous()
    if a.dtype != b.dtype or a.numel() != b.numel():
        return False
    return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def same_weight(a, b) -> bool:
    ta, tb = a.tensors(), b.tensors()
    return type(a) is type(b) and ta.keys() == tb.keys() and all(
        same_bits(ta[k].reshape(-1), tb[k].reshape(-1)) for k in ta)


@pytest.fixture(scope="module")
def cfg():
    return tiny_config()


def test_official_fp8_and_mxfp4(tmp_path):
    cfg = tiny_config(moe_intermediate_size=32)
    st = random_state(cfg, seed=1)
    q = {}
    for name, t in st.items():
        base = name[: -len(".weight")]
        if ".mlp.experts." in name:
            q[name] = quantize_mxfp4(t)
        elif name.endswith(".weight") and t.dim() == 2 and not name.startswith(("embed", "head")) \
                and "router" not in name:
            q[name] = quantize_fp8_block(t, scale_format="e8m0" if "wq" in base else "fp32")
        else:
            q[name] = t
    save_checkpoint(tmp_path, cfg, q, layout="official", shard_bytes=40_000)
    r = CheckpointReader(tmp_path)
    assert r.layout == "official"
    r.check()
    for name, v in q.items():
        if isinstance(v, torch.Tensor):
            assert same_bits(r.tensor(name), v), name
        else:
            w = r.weight(name)
            assert same_weight(w, v), name
    assert r.format_of("layers.1.mlp.experts.2.w2").format == "mxfp4"
    assert r.format_of("layers.1.attn.wq_a").format == "fp8_block"
    assert r.format_of("layers.1.attn.wo_b").format == "fp8_block"
    assert r.format_of("head").format == "plain"


def test_weight_scale_inv_and_detect_rules(tmp_path):
    w = quantize_fp8_block(torch.randn(40, 64))
    save_file({"layers.0.attn.wq_a.weight": w.data, "layers.0.attn.wq_a.weight_scale_inv": w.scale},
              str(tmp_path / "m.safetensors"))
    r = CheckpointReader(tmp_path / "m.safetensors")
    got = r.weight("layers.0.attn.wq_a")
    assert isinstance(got, FP8BlockWeight) and torch.equal(got.dequantize(), w.dequantize())
    assert detect_format({"weight": ("BF16", (4, 4))}).format == "plain"
    f = detect_format({"weight": ("U8", (4, 8)), "weight_scale": ("F8_E4M3", (4, 1)),
                       "weight_scale_2": ("F32", ()), "input_scale": ("F32", (1,))})
    assert (f.format, f.logical_shape) == ("nvfp4", (4, 16))
    assert detect_format({"weight": ("I8", (4, 16)), "scale": ("F8_E8M0", (4, 1))}).format == "mxfp4"
    with pytest.raises(CheckpointError, match="where: unknown weight format.*weight=I32"):
        detect_format({"weight": ("I32", (4, 4))}, where="where")
    with pytest.raises(CheckpointError, match=r"no rule matches.*found weight=F8_E4M3\[4, 4\]"):
        detect_format({"weight": ("F8_E4M3", (4, 4))}, where="w")


def test_fused_module_layout_reads_one_expert(tmp_path, cfg):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = transformers.DeepseekV4ForCausalLM(transformers.DeepseekV4Config(**cfg.to_transformers_dict()))
    sd = {k: v.contiguous() for k, v in model.state_dict().items()}
    save_file(sd, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(cfg.to_transformers_dict()))
    r = CheckpointReader(tmp_path)
    assert r.layout == "modules"
    assert r.check().ok
    I = cfg.moe_intermediate_size
    gu = sd["model.layers.2.mlp.experts.gate_up_proj"]
    e = r.entries["layers.2.mlp.experts.1.w3.weight"]
    assert e.shape == (I, cfg.hidden_size) and e.slice is not None
    assert e.nbytes == I * cfg.hidden_size * 4
    assert torch.equal(r.weight("layers.2.mlp.experts.1.w3").data, gu[1, I:])
    assert torch.equal(r.weight("layers.2.mlp.experts.3.w1").data, gu[3, :I])
    assert torch.equal(r.weight("layers.0.mlp.experts.2.w2").data, sd["model.layers.0.mlp.experts.down_proj"][2])
    assert torch.equal(r.tensor("layers.2.attn.compressor.ape"), sd["model.layers.2.self_attn.compressor.position_bias"])
    assert torch.equal(r.weight("head").data, sd["lm_head.weight"])


def test_lazy_handles_lru_and_load_layer(tmp_path, cfg):
    st = random_state(cfg)
    save_checkpoint(tmp_path, cfg, st, layout="official", nvfp4=["layers.*.mlp.experts.*"], shard_bytes=8_000)
    r = CheckpointReader(tmp_path, max_open=2)
    assert len(r.index.shards) > 4
    layer = r.load_layer(2)
    assert len(r._handles) <= 2
    assert isinstance(layer["layers.2.mlp.experts.0.w1.weight"], NVFP4Weight)
    assert isinstance(layer["layers.2.attn.wq_a.weight"], PlainWeight)
    assert torch.equal(layer["layers.2.attn_norm.weight"], st["layers.2.attn_norm.weight"])
    assert torch.equal(layer["layers.2.mlp.router.bias"], st["layers.2.mlp.router.bias"])
    assert set(r.load_layer(None)) == {"embed.weight", "head.weight", "norm.weight", "hc_head.fn",
                                      "hc_head.base", "hc_head.scale"}
    with pytest.raises(CheckpointError, match="is a parameter, not a linear"):
        r.weight("layers.2.attn.sink")
    with pytest.raises(CheckpointError, match="not a 2-D linear weight; use tensor"):
        r.weight("layers.2.attn_norm")


def test_missing_tensor(tmp_path, cfg):
    st = random_state(cfg)
    del st["layers.1.attn.wq_b.weight"]
    save_checkpoint(tmp_path, cfg, st, layout="transformers")
    r = CheckpointReader(tmp_path)
    with pytest.raises(CheckpointError, match=r"tensor 'layers.1.attn.wq_b.weight' is not in the checkpoint"):
        r.weight("layers.1.attn.wq_b")
    with pytest.raises(CheckpointError, match=str(tmp_path)):
        r.tensor("layers.1.attn.wq_b.weight")
    cmp = r.expected_vs_present()
    assert cmp.missing == ["layers.1.attn.wq_b.weight"] and not cmp.unexpected and not cmp.mismatched
    with pytest.raises(CheckpointError, match=r"tensor 'layers.1.attn.wq_b.weight' is missing"):
        r.check()


def test_wrong_shape_names_file_tensor_expected_found(tmp_path, cfg):
    st = random_state(cfg)
    st["layers.2.attn.wkv.weight"] = torch.randn(cfg.head_dim + 1, cfg.hidden_size)
    save_checkpoint(tmp_path, cfg, st, layout="transformers")
    r = CheckpointReader(tmp_path)
    with pytest.raises(CheckpointError, match=r"model\.safetensors: tensor 'model\.layers\.2\.attn\.wkv\.weight'.*"
                                              r"shape \[33, 32\].*implies \[32, 32\]"):
        r.weight("layers.2.attn.wkv")
    m = r.expected_vs_present().mismatched
    assert [(x["tensor"], x["expected"], x["found"]) for x in m] == \
        [("model.layers.2.attn.wkv.weight", [32, 32], [33, 32])]
    # a quantised weight whose block scale has the wrong shape
    st = random_state(cfg)
    q = quantize_nvfp4(st.pop("layers.1.attn.wq_a.weight"))
    st["layers.1.attn.wq_a.weight"] = q.packed
    st["layers.1.attn.wq_a.weight_scale"] = q.block_scale[:, :1].contiguous()
    st["layers.1.attn.wq_a.weight_scale_2"] = q.global_scale
    d2 = tmp_path / "q"
    save_checkpoint(d2, cfg, st, layout="official")
    r2 = CheckpointReader(d2)
    with pytest.raises(CheckpointError, match=r"tensor 'layers\.1\.attn\.wq_a\.weight_scale' \(nvfp4\): "
                                              r"shape \[16, 1\].*implies \[16, 2\]"):
        r2.weight("layers.1.attn.wq_a")


def test_unknown_format_names_file_and_tensor(tmp_path, cfg):
    st = random_state(cfg)
    st["layers.0.attn.wo_a.weight"] = torch.zeros(st["layers.0.attn.wo_a.weight"].shape, dtype=torch.int32)
    st["layers.3.attn.wkv.weight"] = st["layers.3.attn.wkv.weight"].to(torch.float8_e4m3fn)
    save_checkpoint(tmp_path, cfg, st, layout="official")
    r = CheckpointReader(tmp_path)
    with pytest.raises(CheckpointError, match=r"model\.safetensors: tensor 'layers\.0\.attn\.wo_a\.weight'.*"
                                              r"unknown weight format.*weight=I32\[16, 64\]"):
        r.weight("layers.0.attn.wo_a")
    with pytest.raises(CheckpointError, match=r"tensor 'layers\.3\.attn\.wkv\.weight'.*unknown weight format"):
        r.weight("layers.3.attn.wkv")
    assert len(r.expected_vs_present().bad_format) == 2


def test_config_checkpoint_mismatch(tmp_path):
    big = tiny_config(n_experts=8)
    save_checkpoint(tmp_path, big, random_state(big), layout="official")
    r = CheckpointReader(tmp_path, config=tiny_config(n_experts=4))
    cmp = r.expected_vs_present()
    assert not cmp.missing
    assert len(cmp.unexpected) == 4 * 4 * 3   # experts 4..7, w1/w2/w3, 4 layers
    assert "layers.0.mlp.experts.7.w2.weight" in cmp.unexpected
    routers = {m["tensor"]: (m["expected"], m["found"]) for m in cmp.mismatched}
    assert routers["layers.1.ffn.gate.weight"] == ([4, 32], [8, 32])
    assert routers["layers.1.ffn.gate.bias"] == ([4], [8])
    with pytest.raises(CheckpointError, match=r"model\.safetensors: tensor 'layers\.\d\.ffn\.gate\.weight': shape "
                                              r"\[8, 32\], config <tiny> implies \[4, 32\]"):
        r.check()
    with pytest.raises(CheckpointError, match=r"tensor 'layers\.1\.ffn\.gate\.weight'.*\[8, 32\].*\[4, 32\]"):
        r.weight("layers.1.mlp.router")


def test_quant_config_from_config_json(tmp_path, cfg):
    save_checkpoint(tmp_path, cfg, random_state(cfg), layout="official", nvfp4=["*"], exclude=["head"])
    os.remove(tmp_path / "hf_quant_config.json")
    r = CheckpointReader(tmp_path)
    qc = r.quant_config
    assert qc.quant_method == "modelopt" and qc.quant_algo == "NVFP4" and qc.group_size == 16
    assert qc.module_algo("layers.0.attn.wq_a") == "NVFP4" and qc.module_algo("head") is None
    assert "head" in qc.exclude_modules


def test_mxfp4_and_plain_weights_roundtrip_dtype(tmp_path, cfg):
    st = random_state(cfg, dtype=torch.bfloat16)
    save_checkpoint(tmp_path, cfg, st, layout="canonical")
    r = CheckpointReader(tmp_path)
    assert r.layout == "canonical"
    w = r.weight("layers.3.mlp.shared_expert.w2")
    assert w.data.dtype == torch.bfloat16 and torch.equal(w.data, st["layers.3.mlp.shared_expert.w2.weight"])
    assert r.tensor("layers.0.mlp.router.tid2eid").dtype == torch.int64
