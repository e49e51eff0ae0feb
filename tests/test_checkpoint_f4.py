"""What DeepSeek's convert.py writes, read like the release: packed FP4 as safetensors ``F4``
(``float4_e2m1fn_x2``, header shape = ELEMENT shape [out, in]) instead of the release's ``I8``
[out, in/2], scales as ``F8_E8M0``, wo_a dequantised to BF16. The same weights in both encodings
must read to the same bytes and run to bitwise the same logits."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

import dsv4lab
from dsv4lab.checkpoint.fake import random_state
from dsv4lab.checkpoint.formats import detect_format
from dsv4lab.checkpoint.reader import CheckpointReader
from dsv4lab.checkpoint.writer import save_checkpoint
from dsv4lab.quant.weights import quantize_fp8_block, quantize_mxfp4
from oracle_util import random_ids, tiny_config

pytestmark = pytest.mark.usefixtures("one_thread")


def header(path):
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        return json.loads(f.read(n))


def convert_like_official(src, dst) -> None:
    """Rewrite a release-layout checkpoint as convert.py does (coded here with safetensors only):
    1-byte packed FP4 weights -> float4_e2m1fn_x2 (same bytes), uint8 E8M0 scales ->
    float8_e8m0fnu, wo_a (FP8 + scale) -> BF16."""
    dst.mkdir()
    for p in src.iterdir():
        if p.suffix != ".safetensors":
            shutil.copy(p, dst / p.name)
            continue
        with safe_open(str(p), "pt") as f:
            t = {k: f.get_tensor(k) for k in f.keys()}
        out = {}
        for k, v in t.items():
            if ".wo_a." in k and k.endswith(".weight") and v.dtype == torch.float8_e4m3fn:
                s = t[k[: -len("weight")] + "scale"]
                s = (s.view(torch.float8_e8m0fnu) if s.dtype == torch.uint8 else s).float()
                w = v.float() * s.repeat_interleave(128, 0).repeat_interleave(128, 1)[: v.shape[0], : v.shape[1]]
                out[k] = w.to(torch.bfloat16)
            elif ".wo_a." in k and k.endswith(".scale"):
                continue
            elif k.endswith(".weight") and v.dtype in (torch.int8, torch.uint8):
                out[k] = v.view(torch.uint8).view(torch.float4_e2m1fn_x2)
            elif k.endswith(".scale") and v.dtype == torch.uint8:
                out[k] = v.view(torch.float8_e8m0fnu)
            else:
                out[k] = v
        save_file(out, str(dst / p.name), metadata={"format": "pt"})
    idx = dst / "model.safetensors.index.json"
    if idx.exists():
        m = json.loads(idx.read_text())
        m["weight_map"] = {k: v for k, v in m["weight_map"].items() if not (".wo_a." in k and k.endswith(".scale"))}
        idx.write_text(json.dumps(m))


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    cfg = tiny_config(moe_intermediate_size=32, index_head_dim=32)
    st = random_state(cfg, seed=4)
    q = {}
    for name, t in st.items():
        if name.endswith(".weight") and t.dim() == 2 and ".mlp.experts." in name:
            q[name] = quantize_mxfp4(t * 10)
        elif name.endswith(".weight") and t.dim() == 2 and ".attn.w" in name:
            q[name] = quantize_fp8_block(t * 10, scale_format="e8m0")
        else:
            q[name] = t * 10 if name.endswith(".weight") and t.dim() == 2 else t
    root = tmp_path_factory.mktemp("f4")
    save_checkpoint(root / "release", cfg, q, layout="official", shard_bytes=60_000, progress=False)
    convert_like_official(root / "release", root / "converted")
    return cfg, root / "release", root / "converted"


def test_converted_headers_are_f4_element_shapes(pair):
    cfg, rel, conv = pair
    seen = {}
    for p in conv.glob("*.safetensors"):
        for k, v in header(p).items():
            if k != "__metadata__":
                seen[k] = (v["dtype"], v["shape"])
    w1 = next(k for k in seen if ".experts.0.w1.weight" in k)
    assert seen[w1] == ("F4", [cfg.moe_intermediate_size, cfg.hidden_size])          # elements, not bytes
    assert seen[w1.replace("weight", "scale")] == ("F8_E8M0", [cfg.moe_intermediate_size, cfg.hidden_size // 32])
    wo_a = next(k for k in seen if ".wo_a.weight" in k)
    assert seen[wo_a][0] == "BF16"
    fi = detect_format({"weight": ("F4", (64, 256)), "scale": ("F8_E8M0", (64, 8))})
    assert fi.format == "mxfp4" and fi.logical_shape == (64, 256)
    assert detect_format({"weight": ("I8", (64, 128)), "scale": ("F8_E8M0", (64, 8))}).logical_shape == (64, 256)


def test_both_encodings_read_to_the_same_bytes(pair):
    cfg, rel, conv = pair
    a, b = CheckpointReader(rel), CheckpointReader(conv)
    a.check()
    b.check()                                      # no shape problems against the config
    n = 0
    for layer in range(cfg.num_hidden_layers):
        for e in range(cfg.n_routed_experts):
            for p in ("w1", "w2", "w3"):
                name = f"layers.{layer}.mlp.experts.{e}.{p}"
                wa, wb = a.weight(name), b.weight(name)
                assert wa.format == wb.format == "mxfp4" and wa.shape == wb.shape
                assert torch.equal(wa.packed.view(torch.uint8), wb.packed.view(torch.uint8))
                assert torch.equal(wa.scale.view(torch.uint8), wb.scale.view(torch.uint8))
                n += 1
        name = f"layers.{layer}.attn.wo_a"
        assert torch.equal(a.weight(name).dequantize(torch.float32), b.weight(name).dequantize(torch.float32))
    assert n == cfg.num_hidden_layers * cfg.n_routed_experts * 3


@pytest.mark.parametrize("precision", ["w4a16", "official"])
def test_both_encodings_give_bitwise_the_same_logits(pair, precision):
    cfg, rel, conv = pair
    ids = random_ids(cfg, n=24, b=1, seed=2)
    with torch.no_grad():
        la = dsv4lab.load(rel, precision=precision, progress=False)(ids)
        lb = dsv4lab.load(conv, precision=precision, progress=False)(ids)
    assert torch.equal(la, lb) and la.std() > 0
