"""Fixtures of the per-component tests: the transformers oracle and our model on the same weights.

``pair`` (three random tiny configs) is the whole-model parity pair; ``mixed`` is one pair for the
component tests (sliding, CSA and HCA layers, hash and top-k MoE); ``mixed_calls`` holds what the
oracle's own forward fed its attention blocks and decoder layers (and what they returned). Session scope: building and
saving an oracle is the slow part, and every component file reuses the same ones.
"""
from __future__ import annotations

import pytest

import dsv4lab
from oracle_util import capture, oracle, random_ids, tiny_config

CONFIGS = {
    "mixed": {},
    "csa_heavy": dict(num_hidden_layers=3, layer_types=["compressed_sparse_attention"] * 3,
                      mlp_layer_types=["hash_moe", "hash_moe", "moe"], index_topk=4, sliding_window=6),
    "hca_first": dict(num_hidden_layers=3, layer_types=["heavily_compressed_attention", "sliding_attention",
                                                        "compressed_sparse_attention"],
                      compress_rates={"compressed_sparse_attention": 2, "heavily_compressed_attention": 16},
                      mlp_layer_types=["moe", "moe", "moe"], n_routed_experts=6, num_experts_per_tok=3,
                      o_groups=4, scoring_func="sqrtsoftplus"),
}


def build_pair(name: str, tmp_path_factory):
    """(config, oracle, ours): ours loaded from the oracle's save_pretrained output."""
    cfg = tiny_config(**CONFIGS[name])
    hf = oracle(cfg, seed=len(name))
    path = tmp_path_factory.mktemp(name)
    hf.save_pretrained(path)
    ours = dsv4lab.load(path, progress=False)
    return cfg, hf, ours


@pytest.fixture(scope="session", params=sorted(CONFIGS))
def pair(request, tmp_path_factory):
    return build_pair(request.param, tmp_path_factory)


@pytest.fixture(scope="session")
def mixed(tmp_path_factory):
    return build_pair("mixed", tmp_path_factory)


# 42 tokens: > the sliding window (8), CSA (ratio 4) gets 10 entries > index_topk (3), HCA (8) 5,
# and an open window left over in both
MIXED_IDS = dict(n=42, b=2, seed=3)


@pytest.fixture(scope="session")
def mixed_calls(mixed):
    """(ids, {"layers.i": [Call], "layers.i.self_attn": [Call]}) from one oracle prefill."""
    cfg, hf, _ = mixed
    ids = random_ids(cfg, **MIXED_IDS)
    mods = {}
    for i, layer in enumerate(hf.model.layers):
        mods[f"layers.{i}"] = layer
        mods[f"layers.{i}.self_attn"] = layer.self_attn
    return ids, capture(mods, lambda: hf(ids, use_cache=False))
