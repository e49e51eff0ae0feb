"""Header-only indexing and its structural errors: missing shard, truncated file, index lies."""
from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import save_file

from dsv4lab.checkpoint import CheckpointError
from dsv4lab.checkpoint.safetensors_index import read_header, scan_checkpoint


def _two_shards(d):
    save_file({"a": torch.zeros(4, 4), "b": torch.ones(3, dtype=torch.bfloat16)}, str(d / "s1.safetensors"))
    save_file({"c": torch.zeros(2, 8, dtype=torch.uint8)}, str(d / "s2.safetensors"))
    idx = {"metadata": {}, "weight_map": {"a": "s1.safetensors", "b": "s1.safetensors", "c": "s2.safetensors"}}
    (d / "model.safetensors.index.json").write_text(json.dumps(idx))


def test_scan_index_dir_and_single_file(tmp_path):
    _two_shards(tmp_path)
    ix = scan_checkpoint(tmp_path)
    assert ix.index_file and set(ix.tensors) == {"a", "b", "c"}
    a = ix.tensors["a"]
    assert (a.dtype, a.shape, a.nbytes) == ("F32", (4, 4), 64)
    assert ix.total_bytes == 64 + 6 + 16
    # the offsets are absolute: the bytes there are the tensor's
    with open(a.file, "rb") as f:
        f.seek(ix.tensors["b"].begin)
        assert torch.frombuffer(bytearray(f.read(6)), dtype=torch.bfloat16).tolist() == [1.0, 1.0, 1.0]
    assert set(scan_checkpoint(tmp_path / "s2.safetensors").tensors) == {"c"}
    os.remove(tmp_path / "model.safetensors.index.json")
    assert set(scan_checkpoint(tmp_path).tensors) == {"a", "b", "c"}  # glob without an index


def test_missing_shard_named(tmp_path):
    _two_shards(tmp_path)
    os.remove(tmp_path / "s2.safetensors")
    with pytest.raises(CheckpointError, match=r"s2\.safetensors.*missing.*'c'"):
        scan_checkpoint(tmp_path)
    ix = scan_checkpoint(tmp_path, strict=False)
    assert set(ix.tensors) == {"a", "b"} and len(ix.problems) == 1 and "s2.safetensors" in ix.problems[0]


def test_index_maps_key_to_wrong_shard(tmp_path):
    _two_shards(tmp_path)
    idx = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    idx["weight_map"]["zz"] = "s2.safetensors"
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(idx))
    with pytest.raises(CheckpointError, match=r"s2\.safetensors: tensor 'zz' is mapped"):
        scan_checkpoint(tmp_path)


def test_truncated_data_names_file_and_tensor(tmp_path):
    p = tmp_path / "m.safetensors"
    save_file({"first": torch.zeros(8), "last": torch.zeros(100)}, str(p))
    size = os.path.getsize(p)
    with open(p, "r+b") as f:
        f.truncate(size - 10)
    with pytest.raises(CheckpointError, match=r"m\.safetensors: truncated file: tensor '(first|last)'"):
        read_header(str(p))
    ix = scan_checkpoint(p, strict=False)
    assert any("truncated" in x and "m.safetensors" in x for x in ix.problems)


def test_truncated_header_and_garbage(tmp_path):
    p = tmp_path / "h.safetensors"
    save_file({"x": torch.zeros(8)}, str(p))
    with open(p, "r+b") as f:
        f.truncate(20)
    with pytest.raises(CheckpointError, match=r"h\.safetensors: truncated safetensors file: header says"):
        scan_checkpoint(p)
    q = tmp_path / "g.safetensors"
    q.write_bytes((8).to_bytes(8, "little") + b"not json")
    with pytest.raises(CheckpointError, match=r"g\.safetensors: safetensors header is not valid JSON"):
        scan_checkpoint(q)
    e = tmp_path / "e.safetensors"
    e.write_bytes(b"abc")
    with pytest.raises(CheckpointError, match="e.safetensors: truncated"):
        scan_checkpoint(e)


def test_not_a_checkpoint(tmp_path):
    with pytest.raises(CheckpointError, match="no \\*.safetensors"):
        scan_checkpoint(tmp_path)
    with pytest.raises(CheckpointError, match="no such checkpoint"):
        scan_checkpoint(tmp_path / "nope")
