"""inspect: a full-size sparse V4-Pro NVFP4 checkpoint in seconds, from headers only; CLI."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from dsv4lab.__main__ import main
from dsv4lab.checkpoint.fake import make_sparse_checkpoint, random_state, tiny_config, v4_pro_config
from dsv4lab.checkpoint.inspect import inspect_checkpoint, render_inspect
from dsv4lab.checkpoint.writer import save_checkpoint

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def v4_pro_nvfp4_bytes() -> tuple[int, dict[str, int]]:
    """Bytes of a V4-Pro checkpoint with every linear NVFP4 except lm head and router gates (BF16),
    written out from the published shapes, independently of the library's tables."""
    D, H, Dh, Q, G, R, I, NE = 7168, 128, 512, 1536, 16, 1024, 3072, 384
    Hi, Ih, V, hc, L, topk = 64, 128, 129280, 4, 61, 6

    def fp4(o, i):       # packed e2m1 + e4m3 per 16 + fp32 weight_scale_2 + fp32 input_scale
        return o * i // 2 + o * i // 16 + 4 + 4

    def bf16(*s):
        n = 2
        for x in s:
            n *= x
        return n

    per_layer = []
    for i in range(L):
        kind = "HCA" if i < 2 or i % 2 == 1 else "CSA"
        b = 2 * 4 * ((2 + hc) * hc * hc * D + (2 + hc) * hc + 3)            # attn_hc + ffn_hc (fp32)
        b += bf16(D) * 2 + bf16(Q) + bf16(Dh)                               # attn/ffn/q/kv norms
        b += fp4(Q, D) + fp4(H * Dh, Q) + fp4(Dh, D) + fp4(G * R, H * Dh // G) + fp4(D, G * R)
        b += 4 * H                                                          # sink
        c, m = (2, 4) if kind == "CSA" else (1, 128)
        b += 2 * fp4(c * Dh, D) + 4 * m * c * Dh + bf16(Dh)                 # compressor
        if kind == "CSA":
            b += fp4(Hi * Ih, Q) + fp4(Hi, D) + 2 * fp4(2 * Ih, D) + 4 * m * 2 * Ih + bf16(Ih)
        b += bf16(NE, D) + (4 * V * topk if i < 3 else 4 * NE)              # router (+tid2eid i32 | bias)
        b += NE * (2 * fp4(I, D) + fp4(D, I))                               # routed experts
        b += 2 * fp4(I, D) + fp4(D, I)                                      # shared expert
        per_layer.append(b)
    glob = bf16(V, D) * 2 + bf16(D) + 4 * (hc * hc * D + hc + 1)            # embed, head, norm, hc_head
    return glob + sum(per_layer), {"global": glob, **{str(i): b for i, b in enumerate(per_layer)}}


@pytest.fixture(scope="module")
def pro_ckpt(tmp_path_factory):
    d = tmp_path_factory.mktemp("v4pro")
    info = make_sparse_checkpoint(d, v4_pro_config(), fmt="nvfp4")
    return d, info


def test_sparse_v4_pro_inspect_is_fast_and_exact(pro_ckpt, monkeypatch):
    d, info = pro_ckpt
    # sparse: ~0.9 TB logical, almost nothing on disk
    logical = sum(os.path.getsize(d / f) for f in info["files"])
    assert logical > 8 * 10**11 and len(info["files"]) >= 60
    on_disk = sum(os.stat(d / f).st_blocks * 512 for f in info["files"])
    assert on_disk < 200 * 2**20
    # headers only: opening a tensor would fail
    import safetensors

    def boom(*a, **k):
        raise AssertionError("inspect must not open tensor data")

    monkeypatch.setattr(safetensors, "safe_open", boom)
    t0 = time.perf_counter()
    rep = inspect_checkpoint(d)
    dt = time.perf_counter() - t0
    assert dt < 25, f"inspect took {dt:.1f}s"
    total, per_layer = v4_pro_nvfp4_bytes()
    assert rep["tensor_bytes"] == total == info["total_bytes"]
    assert rep["bytes_by_layer"] == per_layer
    # and equals what the files hold after their headers (file size - 8 - header length)
    data = 0
    for f in info["files"]:
        with open(d / f, "rb") as fh:
            data += os.path.getsize(d / f) - 8 - int.from_bytes(fh.read(8), "little")
    assert data == total
    assert sum(rep["bytes_by_kind"].values()) == total
    assert rep["ok"], render_inspect(rep)
    assert rep["layout"] == "official" and rep["n_shards"] == len(info["files"])
    assert rep["config"]["layer_types"] == {"heavily_compressed_attention": 31, "compressed_sparse_attention": 30}
    n_lin_fp4 = 61 * (5 + 3 * 384 + 3 + 2) + 30 * 4           # attn, experts, shared, compressor, indexer
    assert rep["linear_formats"] == {"nvfp4": n_lin_fp4, "plain": 61 + 1}
    assert rep["quant_config"]["quant_algo"] == "NVFP4" and rep["n_quant_mismatch"] == 0
    assert rep["bytes_by_kind"]["experts"] == 61 * 384 * 3 * (3072 * 7168 * 9 // 16 + 8)
    text = render_inspect(rep)
    assert "status: OK" in text and "nvfp4" in text and "experts" in text


def test_cli_json(tmp_path, capsys):
    cfg = tiny_config()
    res = save_checkpoint(tmp_path, cfg, random_state(cfg), layout="official", nvfp4=["layers.*.mlp.experts.*"],
                          shard_bytes=40_000)
    assert main(["inspect", str(tmp_path), "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["tensor_bytes"] == res["total_bytes"] and rep["comparison"]["ok"] and rep["ok"]
    assert rep["n_shards"] == len(res["files"]) > 1
    assert rep["linear_formats"]["nvfp4"] == 4 * 4 * 3
    assert rep["bytes_by_layer"]["0"] > 0 and rep["bytes_by_kind"]["experts"] > 0


def test_inspect_reports_problems(tmp_path, capsys):
    cfg = tiny_config()
    st = random_state(cfg)
    del st["layers.2.attn.indexer.wq_b.weight"]
    st["layers.1.attn.wkv.weight"] = st["layers.1.attn.wkv.weight"][:-1]
    save_checkpoint(tmp_path, cfg, st, layout="official", shard_bytes=30_000, nvfp4=["layers.3.*"])
    files = sorted(f for f in os.listdir(tmp_path) if f.endswith(".safetensors"))
    os.remove(tmp_path / files[-1])          # a missing shard
    rep = inspect_checkpoint(tmp_path)
    assert not rep["ok"]
    assert "layers.2.attn.indexer.wq_b.weight" in rep["comparison"]["missing"]
    assert any(m["tensor"] == "layers.1.attn.wkv.weight" and m["found"] == [31, 32]
               for m in rep["comparison"]["mismatched"])
    assert rep["n_problems"] == 1 and files[-1] in rep["problems"][0]
    assert main(["inspect", str(tmp_path)]) == 2
    out = capsys.readouterr().out
    assert "missing     layers.2.attn.indexer.wq_b.weight" in out and "PROBLEMS FOUND" in out
    assert "found [31, 32], expected [32, 32]" in out
    assert main(["inspect", str(tmp_path / "nothing")]) == 1


def test_python_m_entry_point(tmp_path):
    cfg = tiny_config()
    save_checkpoint(tmp_path, cfg, random_state(cfg), layout="transformers", nvfp4=["*"])
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.run([sys.executable, "-m", "dsv4lab", "inspect", str(tmp_path)], capture_output=True,
                       text=True, env=env, cwd=REPO, timeout=120)
    assert p.returncode == 0, p.stderr
    assert "layout: transformers" in p.stdout and "status: OK" in p.stdout
    p = subprocess.run([sys.executable, "-m", "dsv4lab", "--help"], capture_output=True, text=True, env=env,
                       cwd=REPO, timeout=120)
    assert p.returncode == 0 and "inspect" in p.stdout


def test_cli_registry_survives_broken_module(monkeypatch, capsys):
    from dsv4lab import cli

    monkeypatch.setattr(cli, "COMMAND_MODULES", cli.COMMAND_MODULES + ["dsv4lab.cli.does_not_exist_cmd"])
    assert main(["does-not-exist"]) == 1
    assert "failed to import" in capsys.readouterr().err


@pytest.mark.parametrize("fmt,layout", [("official", "official"), ("nvfp4", "transformers"), ("plain", "canonical")])
def test_small_sparse_variants(tmp_path, fmt, layout):
    from dsv4lab.checkpoint.reader import CheckpointReader

    cfg = tiny_config(moe_intermediate_size=32)
    info = make_sparse_checkpoint(tmp_path, cfg, fmt=fmt, layout=layout, shard_bytes=20_000)
    rep = inspect_checkpoint(tmp_path)
    assert rep["ok"], render_inspect(rep)
    assert rep["layout"] == layout and rep["tensor_bytes"] == info["total_bytes"]
    want = {"official": {"mxfp4", "fp8_block", "plain"}, "nvfp4": {"nvfp4", "plain"}, "plain": {"plain"}}[fmt]
    assert set(rep["linear_formats"]) == want
    w = CheckpointReader(tmp_path).weight("layers.1.mlp.experts.0.w2")   # sparse data reads as zeros
    assert w.shape == (32, 32) and not w.dequantize().any()
