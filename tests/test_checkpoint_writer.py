"""save_checkpoint: layouts, NVFP4 quantisation, ModelOpt configs, round trips, transformers loading."""
from __future__ import annotations

import json
import os

import pytest
import torch

from dsv4lab.checkpoint.fake import random_state, tiny_config
from dsv4lab.checkpoint.names import is_linear, normalize_key, split_name
from dsv4lab.checkpoint.reader import CheckpointReader
from dsv4lab.checkpoint.writer import save_checkpoint
from dsv4lab.quant.weights import NVFP4Weight, quantize_nvfp4


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    a, b = a.detach().contiguous(), b.detach().contiguous()
    if a.dtype != b.dtype or a.numel() != b.numel():
        return False
    return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


CFG = tiny_config()
STATE = random_state(CFG, seed=3)


@pytest.mark.parametrize("layout,nvfp4", [
    ("official", None), ("official", ["*"]), ("transformers", None), ("transformers", ["*"]),
    ("canonical", ["layers.*.mlp.experts.*"]), ("modules", None),
])
def test_round_trip_bit_exact(tmp_path, layout, nvfp4):
    res = save_checkpoint(tmp_path, CFG, STATE, layout=layout, nvfp4=nvfp4, shard_bytes=30_000)
    assert len(res["files"]) > 1 and os.path.exists(tmp_path / "model.safetensors.index.json")
    r = CheckpointReader(tmp_path)
    assert r.layout == layout
    assert r.check().ok
    n_quant = 0
    for name, t in STATE.items():
        base, suffix = split_name(name)
        if suffix == "weight" and t.dim() == 2:
            w = r.weight(base)
            if nvfp4 and is_linear(base) and any(
                    __import__("fnmatch").fnmatchcase(base, p) for p in nvfp4):
                want = quantize_nvfp4(t)
                assert isinstance(w, NVFP4Weight), name
                assert w.tensors().keys() == want.tensors().keys()
                assert all(same_bits(w.tensors()[k], want.tensors()[k]) for k in want.tensors()), name
                n_quant += 1
            else:
                assert w.format == "plain" and same_bits(w.data, t), name
        else:
            assert same_bits(r.tensor(name), t), name
    if nvfp4 == ["*"]:
        # every linear is quantised; nothing else is
        assert n_quant == sum(1 for n, t in STATE.items() if n.endswith(".weight") and is_linear(n))
        for n in ("embed", "norm", "layers.0.attn_norm", "layers.2.attn.compressor.norm"):
            assert r.format_of(n).format == "plain"
    elif nvfp4:
        assert n_quant == CFG.num_hidden_layers * CFG.n_routed_experts * 3
    else:
        assert r.quant_config is None and not os.path.exists(tmp_path / "hf_quant_config.json")


def test_transformers_from_pretrained_loads_it(tmp_path):
    transformers = pytest.importorskip("transformers")
    save_checkpoint(tmp_path, CFG, STATE, layout="transformers", shard_bytes=50_000)
    model, info = transformers.DeepseekV4ForCausalLM.from_pretrained(str(tmp_path), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    n = 0
    for k, v in model.state_dict().items():
        for nk in normalize_key(k, tuple(v.shape)):
            got = v[nk.slice.index()] if nk.slice else v
            assert torch.equal(got, STATE[nk.name]), (k, nk.name)
            n += 1
    assert n == len(STATE)


def test_modelopt_configs(tmp_path):
    save_checkpoint(tmp_path, CFG, STATE, layout="transformers", nvfp4=["layers.*.mlp.experts.*", "*.attn.wq_b"],
                    exclude=["layers.0.*"])
    hq = json.loads((tmp_path / "hf_quant_config.json").read_text())
    q = hq["quantization"]
    assert q["quant_algo"] == "NVFP4" and q["group_size"] == 16
    assert "model.layers.1.ffn.experts.3.w2" in q["quantized_layers"]
    assert q["quantized_layers"]["model.layers.2.attn.wq_b"]["quant_algo"] == "NVFP4"
    assert "model.layers.0.ffn.experts.0.w1" not in q["quantized_layers"]
    assert {"model.layers.0.ffn.experts.0.w1", "model.layers.0.attn.wq_b", "model.layers.1.attn.wq_a",
            "head", "model.layers.3.ffn.gate", "model.layers.2.attn.indexer.weights_proj"} <= set(q["exclude_modules"])
    assert not any("norm" in m or "embed" in m for m in q["exclude_modules"])
    n_lin = sum(1 for n in STATE if n.endswith(".weight") and is_linear(n))
    assert len(q["quantized_layers"]) + len(q["exclude_modules"]) == n_lin
    cj = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    assert cj["quant_method"] == "modelopt" and cj["quant_algo"] == "NVFP4"
    assert cj["exclude_modules"] == q["exclude_modules"]
    from dsv4lab.checkpoint.inspect import inspect_checkpoint

    rep = inspect_checkpoint(tmp_path)
    assert rep["ok"] and rep["n_quant_mismatch"] == 0
    assert rep["linear_formats"]["nvfp4"] == 3 * 3 * CFG.n_routed_experts + 3


def test_prequantised_passthrough_dtype_and_errors(tmp_path):
    st = dict(STATE)
    q = quantize_nvfp4(st["layers.1.attn.wo_b.weight"], input_scale=0.25)
    st["layers.1.attn.wo_b.weight"] = q
    save_checkpoint(tmp_path, CFG, st, layout="official", dtype=torch.bfloat16)
    r = CheckpointReader(tmp_path)
    w = r.weight("layers.1.attn.wo_b")
    assert all(same_bits(w.tensors()[k], v) for k, v in q.tensors().items())
    assert float(w.input_scale) == 0.25
    assert r.weight("layers.1.attn.wo_a").data.dtype == torch.bfloat16
    assert r.tensor("layers.0.mlp.router.tid2eid").dtype == torch.int64
    assert r.entries["layers.1.attn.wo_b.weight"].dtype == "U8"
    with pytest.raises(ValueError, match="fuses experts"):
        save_checkpoint(tmp_path / "m", CFG, STATE, layout="modules", nvfp4=["*"])
    with pytest.raises(ValueError, match="not a canonical tensor name"):
        save_checkpoint(tmp_path / "x", CFG, {"model.layers.0.self_attn.q_a_proj.weight": torch.zeros(2, 2)})
    with pytest.raises(ValueError, match="layout"):
        save_checkpoint(tmp_path / "y", CFG, STATE, layout="bogus")
