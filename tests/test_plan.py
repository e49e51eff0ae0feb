"""Memory plans at full V4 size, from sparse-file checkpoints (headers only) and from configs."""
from __future__ import annotations

import json
import os
import struct
import subprocess
import sys

import pytest
import torch

import dsv4lab
from dsv4lab.checkpoint.fake import make_sparse_checkpoint, v4_flash_config, v4_pro_config
from dsv4lab.config import CSA, HCA, HASH_MOE, MOE, ConfigError
from dsv4lab.model import DSV4Model
from dsv4lab.model.state import DecodeState
from dsv4lab.plan import MemoryPlan, PlanError, named_config, parse_bytes, place, plan, state_bytes


@pytest.fixture(scope="module")
def pro_nvfp4(tmp_path_factory):
    """V4-Pro NVFP4 (~0.89 TB) as sparse files: real headers, no data on disk."""
    path = tmp_path_factory.mktemp("v4pro_nvfp4")
    info = make_sparse_checkpoint(path, named_config("v4-pro"), fmt="nvfp4")
    return path, info


def _independent_index_sum(path) -> tuple[int, int]:
    """Sum of tensor data bytes over every shard header (not through dsv4lab): (loaded, mtp)."""
    with open(os.path.join(path, "model.safetensors.index.json")) as f:
        shards = sorted(set(json.load(f)["weight_map"].values()))
    loaded = mtp = 0
    for name in shards:
        with open(os.path.join(path, name), "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(n))
        for key, d in header.items():
            if key == "__metadata__":
                continue
            b, e = d["data_offsets"]
            if key.startswith("mtp."):
                mtp += e - b
            else:
                loaded += e - b
    return loaded, mtp


def test_packaged_configs():
    pro, flash = named_config("v4-pro"), named_config("v4-flash")
    assert (pro.num_hidden_layers, pro.hidden_size, pro.num_attention_heads, pro.head_dim) == (61, 7168, 128, 512)
    assert (pro.n_routed_experts, pro.num_experts_per_tok, pro.moe_intermediate_size) == (384, 6, 3072)
    assert (pro.q_lora_rank, pro.o_groups, pro.o_lora_rank, pro.qk_rope_head_dim) == (1536, 16, 1024, 64)
    assert (pro.index_n_heads, pro.index_head_dim, pro.index_topk, pro.vocab_size) == (64, 128, 1024, 129280)
    assert pro.layer_types[:4] == [HCA, HCA, CSA, HCA] and pro.layer_types[2:] == [CSA, HCA] * 29 + [CSA]
    assert pro.mlp_layer_types == [HASH_MOE] * 3 + [MOE] * 58 and pro.sliding_window == 128
    assert pro.compress_rates == {CSA: 4, HCA: 128} and pro.hc_mult == 4
    assert (flash.num_hidden_layers, flash.hidden_size, flash.num_attention_heads, flash.n_routed_experts) == (43, 4096, 64, 256)
    assert (flash.moe_intermediate_size, flash.q_lora_rank, flash.o_groups, flash.index_topk) == (2048, 1024, 8, 512)
    # the same shapes as the checkpoint package's fake configs (index_topk aside)
    assert pro.replace(index_topk=512) == v4_pro_config().replace(source=pro.source)
    assert flash == v4_flash_config().replace(source=flash.source)


@pytest.mark.slow  # > 10 s on the shared 2-core CPU (--durations)
def test_pro_nvfp4_checkpoint_plan_fits_8x141_and_total_matches_index(pro_nvfp4):
    path, info = pro_nvfp4
    loaded, mtp = _independent_index_sum(path)
    p = plan(path, gpus=8, gpu_memory="141GB", context=65536)
    assert isinstance(p, MemoryPlan) and p.fits and p.weight_source == "checkpoint"
    assert p.weight_bytes == loaded == info["total_bytes"] - mtp
    assert 0.85e12 < p.weight_bytes < 0.92e12
    # per-GPU accounting adds up; every GPU used, placement contiguous, embed first / head last
    assert sum(p.gpu_load(g)["weights"] for g in range(8)) == p.weight_bytes
    assert sum(p.gpu_load(g)["state"] for g in range(8)) == p.state_bytes
    assert p.placement == sorted(p.placement) and set(p.placement) == set(range(8))
    assert all(h >= 0 for h in p.headroom())
    dm = p.device_map()
    assert len(dm) == 61 and dm[0] == "cuda:0" and dm[-1] == "cuda:7"
    # balanced: 61 layers of ~14.5 GB over 8 GPUs -> the fullest holds 8 layers
    assert max(p.gpu_load(g)["total"] for g in range(8)) < 8 * 14.6e9
    # the same numbers from the config alone (format rules = the sparse checkpoint's)
    q = plan("v4-pro", gpus=8, gpu_memory="141GB", context=65536, fmt="nvfp4")
    assert q.weight_bytes == p.weight_bytes and q.placement == p.placement
    assert q.bytes_by_kind() == p.bytes_by_kind()
    # table / summary / json
    t = p.table()
    assert len(t) == 63 and int(t["weights"].sum()) == p.weight_bytes
    assert int(t["experts"].sum()) == p.bytes_by_kind()["experts"]
    s = p.summary()
    assert "FITS" in s and "checkpoint headers" in s
    json.dumps(p.to_dict())


def test_pro_on_one_gpu_refused_with_reasons():
    with pytest.raises(PlanError) as ei:
        plan("v4-pro", gpus=1, gpu_memory="141GB")
    msg = str(ei.value)
    assert "does not fit on 1 GPU(s) of 141.00 GB" in msg and "over" in msg
    assert "would fit: 7 GPUs" in msg          # 888 GB over 135 GB usable each
    assert "shorter context does not help" in msg and "fp8_mxfp4" in msg
    assert ei.value.plan is not None and not ei.value.plan.fits
    # without check the plan comes back with fits == False
    assert not plan("v4-pro", gpus=1, gpu_memory="141GB", check=False).fits


def test_refusal_suggests_shorter_context():
    # V4-Flash NVFP4 on 2 GPUs of 96 GB fits at a short context but not at 16M tokens x batch 8
    with pytest.raises(PlanError, match=r"would fit: context <= \d+ tokens"):
        plan("v4-flash", gpus=2, gpu_memory="96GB", context=2**24, batch=8)


def test_pro_formats_and_gpus():
    nv = plan("v4-pro", fmt="nvfp4", gpus=8, gpu_memory="141GB")
    off = plan("v4-pro", fmt="fp8_mxfp4", gpus=8, gpu_memory="141GB")
    assert off.fits and off.weight_bytes < nv.weight_bytes            # e4m3/fp32 scales vs MXFP4 e8m0
    assert plan("v4-pro", gpus=8, gpu_memory="192GB").fits
    bf = plan("v4-pro", fmt="bf16", gpus=8, gpu_memory="192GB", check=False)
    assert not bf.fits and bf.weight_bytes > 3e12
    # nvfp4 experts: 0.5 B/param + e4m3 per 16 + 2 fp32 scalars per matrix
    cfg = named_config("v4-pro")
    n_exp = cfg.n_routed_experts * cfg.num_hidden_layers * 3
    per = cfg.moe_intermediate_size * cfg.hidden_size
    assert nv.bytes_by_kind()["experts"] == n_exp * (per // 2 + per // 16 + 8)
    assert off.bytes_by_kind()["experts"] == n_exp * (per // 2 + per // 32)


def test_flash_on_one_and_two_gpus(tmp_path):
    with pytest.raises(PlanError, match="would fit: 2 GPUs"):
        plan("v4-flash", gpus=1, gpu_memory="141GB")
    p2 = plan("v4-flash", gpus=2, gpu_memory="141GB")
    assert p2.fits and p2.device_map()[0] == "cuda:0" and p2.device_map()[-1] == "cuda:1"
    assert plan("v4-flash", gpus=1, gpu_memory="192GB").fits
    # from a sparse official-format (FP8 + MXFP4) Flash checkpoint: matches the config path
    make_sparse_checkpoint(tmp_path, named_config("v4-flash"), fmt="official")
    pc = plan(tmp_path, gpus=2, gpu_memory="141GB")
    pf = plan("v4-flash", gpus=2, gpu_memory="141GB", fmt="fp8_mxfp4")
    assert pc.weight_bytes == pf.weight_bytes and pc.placement == pf.placement
    assert set(pc.weights.by_format) == {"fp8_block", "mxfp4", "plain"}


def test_state_bytes_match_decode_state_and_meta_model():
    cfg = named_config("v4-pro")
    st = DecodeState.allocate(cfg, 2, 65536, torch.bfloat16, devices="meta")
    sb = state_bytes(cfg, 65536, batch=2, kv_dtype="bf16")
    pos = sum(t.numel() * t.element_size() for t in st.extra["pos_by_device"].values())
    assert sum(sb) == st.nbytes() - pos
    # CSA layer: window ring + entries (ctx/4 x 512) + indexer entries (ctx/4 x 128), bf16, batch 2
    assert sb[2] > 2 * 2 * 16384 * (512 + 128) and sb[2] < 2 * 2 * 16384 * (512 + 128) + 10**6
    # weight numel per layer kind = parameters of a full-width V4-Pro model built on meta
    # (4 layers: HCA/hash, HCA/hash, CSA/hash, HCA/top-k: every layer signature of V4-Pro)
    small = cfg.replace(num_hidden_layers=4, layer_types=cfg.layer_types[:4], mlp_layer_types=cfg.mlp_layer_types[:4])
    with torch.device("meta"):
        m = DSV4Model(small)
    bf = plan(small, fmt="bf16", gpus=1, gpu_memory="1TB", context=1024)
    fp32 = ("_hc.", "hc_head.", "attn.sink", ".ape", "router.bias")
    for i in range(4):
        want = 0
        for name, t in m.layers[i].named_parameters():
            full = f"layers.{i}.{name}"
            want += t.numel() * (4 if any(s in full for s in fp32) else 2)
        for name, t in m.layers[i].named_buffers():
            if name.endswith("tid2eid"):
                want += t.numel() * 4
            elif name.endswith("router.bias"):
                want += t.numel() * 4
        assert bf.layer_weight_bytes(i) == want, i
    emb = m.embed.weight.numel() * 2
    assert bf.embed_bytes == emb


def test_place_is_optimal_and_contiguous():
    loads = [5, 1, 1, 1, 1, 1, 5, 2, 2]
    out, r = place(loads, [10, 10, 10])
    assert out == sorted(out)
    per = [sum(x for x, g in zip(loads, out) if g == k) for k in range(3)]
    import itertools

    brute = min(max(sum(loads[:a]), sum(loads[a:b]), sum(loads[b:]))
                for a, b in itertools.combinations_with_replacement(range(len(loads) + 1), 2))
    assert max(per) == brute == 8 and r == 0.8
    # heterogeneous: the big GPU takes more
    out, r = place([1] * 10, [2, 8])
    assert out.count(1) == 8 and r == 1.0
    assert parse_bytes("141GB") == 141 * 10**9 and parse_bytes("1GiB") == 2**30 and parse_bytes(141) == 141 * 10**9
    assert parse_bytes("1.5TB") == 15 * 10**11


def test_cli_plan(pro_nvfp4):
    path, _ = pro_nvfp4
    py = [sys.executable, "-m", "dsv4lab", "plan"]
    r = subprocess.run(py + ["v4-flash", "--gpus", "2", "--json"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert d["fits"] and len(d["device_map"]) == 43 and len(d["gpus"]) == 2
    r = subprocess.run(py + ["v4-pro", "--gpus", "1", "--gpu-memory", "141GB"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "does not fit" in r.stderr and "would fit: 7 GPUs" in r.stderr
    assert dsv4lab.plan is not None and callable(dsv4lab.plan)


def test_plan_unknown_name_says_what_is_accepted(tmp_path):
    """A name that is neither a path nor packaged: one error naming it, the closest packaged names
    and the list; the CLI prints that line, no traceback, and exits non-zero."""
    with pytest.raises(ConfigError, match=r"'v4-prp' is no checkpoint.*did you mean 'v4-pro'\?.*tiny-nvfp4"):
        plan("v4-prp", gpus=8)
    with pytest.raises(ConfigError, match=r"'zzz' is no checkpoint, config.json or packaged name \(packaged"):
        plan("zzz", gpus=8)
    r = subprocess.run([sys.executable, "-m", "dsv4lab", "plan", "tiny-nvfp"], capture_output=True, text=True,
                       timeout=60, cwd=tmp_path)
    assert r.returncode != 0 and "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines()[-1].startswith("dsv4lab plan: 'tiny-nvfp' is no checkpoint")
    assert "did you mean 'tiny-nvfp4'" in r.stderr


def test_plan_dense_kind_misspelt_is_named():
    """``dense=`` patterns name linear component kinds; one that matches none (a typo) fails with
    did-you-mean instead of planning no copy. A linear kind this format leaves unquantised
    (head, router in the NVFP4 export) is valid and costs 0 bytes."""
    with pytest.raises(ValueError, match=r"dense='compresor\.\*' matches no linear component kind; did you mean "
                                         r"'compressor\.wkv'"):
        plan("v4-pro", gpus=8, dense=["compresor.*"])
    with pytest.raises(ValueError, match=r"dense='heda'.*did you mean 'head'\?"):
        plan("v4-pro", gpus=8, fmt="bf16", check=False, dense=["heda"])   # checked without quantised weights too
    base = plan("v4-pro", gpus=8)
    ok = plan("v4-pro", gpus=8, dense=["head", "router", "compressor.*"])
    assert ok.dense_bytes > 0 and plan("v4-pro", gpus=8, dense=["head", "router"]).dense_bytes == 0
    assert base.dense_bytes == 0
