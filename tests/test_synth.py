"""``dsv4lab synth``: release-shaped checkpoints of random weights (issue 19 item 1).

CPU-sized: a small config with every layer kind goes through the library function (V4 widths
are too big for a CPU test even cut to 1 layer: the 129k x 4096 embedding alone is 1 GB); the
preset path is checked through :func:`preset_config` shapes and the CLI on its argument errors.
"""
from __future__ import annotations

import json
import os

import pytest
import torch

import dsv4lab.checkpoint.synth as synth
from dsv4lab.__main__ import main
from dsv4lab.checkpoint import CheckpointReader
from dsv4lab.checkpoint.fake import tiny_config
from dsv4lab.checkpoint.inspect import inspect_checkpoint
from dsv4lab.checkpoint.synth import SynthError, master_weights, preset_config, synth_checkpoint
from dsv4lab.config import CSA, HCA
from dsv4lab.loading import load
from dsv4lab.plan import plan


def synth_config(n_layers: int = 4, hidden: int = 64, experts: int = 8):
    types = [HCA, HCA] + [CSA if i % 2 == 0 else HCA for i in range(n_layers - 2)]
    return tiny_config(n_experts=experts, moe_intermediate_size=32, num_hidden_layers=n_layers, hidden_size=hidden,
                       layer_types=types, mlp_layer_types=["hash_moe"] * min(3, n_layers) + ["moe"] * (n_layers - 3))


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("synth")
    cfg = synth_config()
    nv = synth_checkpoint(root / "nvfp4", cfg, "nvfp4", seed=3, shard_bytes=60_000)
    off = synth_checkpoint(root / "official", cfg, "official", seed=3, shard_bytes=60_000)
    return cfg, nv, off


def test_written_like_a_release(pair):
    cfg, nv, off = pair
    for s in (nv, off):
        files = sorted(os.listdir(s["path"]))
        assert len(s["files"]) > 1 and "model.safetensors.index.json" in files and "config.json" in files
        assert not os.path.exists(s["path"] + ".tmp")
        rep = inspect_checkpoint(s["path"])
        assert rep["ok"], rep
        assert CheckpointReader(s["path"]).check().ok
    assert os.path.exists(os.path.join(nv["path"], "hf_quant_config.json"))
    assert not os.path.exists(os.path.join(off["path"], "hf_quant_config.json"))
    q = json.load(open(os.path.join(nv["path"], "hf_quant_config.json")))["quantization"]
    assert q["quant_algo"] == "NVFP4" and "head" in q["exclude_modules"]
    r_nv, r_off = CheckpointReader(nv["path"]), CheckpointReader(off["path"])
    assert r_nv.format_of("layers.1.attn.wq_a").format == "nvfp4"
    assert r_off.format_of("layers.1.attn.wq_a").format == "fp8_block"
    assert r_off.format_of("layers.1.mlp.experts.0.w1").format == "mxfp4"
    assert r_off.format_of("head").format == "plain"
    assert plan(nv["path"], gpus=1, gpu_memory="80GB", context=256).fits


def test_same_seed_same_master_weights(pair):
    cfg, nv, off = pair
    name = "layers.2.attn.wq_b.weight"
    master = master_weights(cfg, seed=3, names=[name])[name].float()
    w_nv = CheckpointReader(nv["path"]).weight(name).dequantize()
    w_off = CheckpointReader(off["path"]).weight(name).dequantize()
    # both are quantisations of the one master (errors of their formats, not different weights)
    for w in (w_nv, w_off):
        assert (w - master).norm() / master.norm() < 0.2
    assert not torch.equal(master, master_weights(cfg, seed=4, names=[name])[name].float())
    # plain tensors are the same bytes in both
    t = "layers.2.attn_norm.weight"
    assert torch.equal(CheckpointReader(nv["path"]).tensor(t), CheckpointReader(off["path"]).tensor(t))


def test_loads_and_runs_finite_with_routing_spread(tmp_path):
    cfg = synth_config(n_layers=24)
    s = synth_checkpoint(tmp_path / "deep", cfg, "nvfp4", seed=0)
    torch.set_num_threads(1)
    m = load(s["path"], device="cpu", dtype=torch.bfloat16, progress=False)
    picks = {}
    for name, mod in m.named_modules():
        if name.endswith("router.hook_ids"):
            mod.register_forward_hook(lambda mod, i, o, name=name: picks.__setitem__(name, o.flatten()))
    logits = m(torch.randint(0, cfg.vocab_size, (1, 48), generator=torch.Generator().manual_seed(0)))
    assert torch.isfinite(logits).all() and logits.float().std() > 0.1
    assert len(picks) == cfg.num_hidden_layers
    for name, ids in picks.items():
        counts = torch.bincount(ids, minlength=cfg.n_routed_experts)
        assert (counts > 0).sum() >= cfg.n_routed_experts - 1, (name, counts)
        assert counts.max() / counts.sum() < 0.5, (name, counts)


def test_failure_leaves_nothing(tmp_path, monkeypatch):
    def boom(*a, **k):
        raise RuntimeError("disk full")

    monkeypatch.setattr(synth, "save_file", boom)
    with pytest.raises(RuntimeError):
        synth_checkpoint(tmp_path / "x", synth_config(n_layers=2), "nvfp4")
    assert os.listdir(tmp_path) == []


def test_refuses_existing_out_and_bad_sizes(tmp_path):
    with pytest.raises(SynthError, match="already exists"):
        synth_checkpoint(tmp_path, synth_config(n_layers=2), "nvfp4")
    with pytest.raises(SynthError, match="--layers"):
        preset_config("v4-flash", layers=0)
    with pytest.raises(SynthError, match="did you mean 'v4-flash'"):
        preset_config("v4-flsh")
    cfg = preset_config("v4-pro", layers=5, experts=4)
    assert (cfg.num_hidden_layers, cfg.n_routed_experts, cfg.num_experts_per_tok) == (5, 4, 4)
    assert cfg.hidden_size == 7168 and cfg.mlp_layer_types[:4] == ["hash_moe"] * 3 + ["moe"]


def _exit_status(argv) -> int:
    try:
        return main(argv)
    except SystemExit as e:
        return e.code


@pytest.mark.parametrize("argv,words", [
    (["--preset", "v4-flsh"], "did you mean 'v4-flash'"),
    (["--preset", "v4-pro", "--layers", "0"], "--layers"),
    (["--preset", "v4-pro", "--experts", "-1"], "--experts"),
])
def test_cli_one_line_errors(capsys, tmp_path, argv, words):
    assert _exit_status(["synth", *argv, "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("dsv4lab synth: ") and words in err, err
    assert not os.path.exists(tmp_path / "o")


def test_cli_existing_out(capsys, tmp_path):
    assert _exit_status(["synth", "--preset", "v4-flash", "--layers", "1", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "already exists" in err
