"""Fixtures of the per-component tests: the transformers oracle and our model on the same weights.

``pair`` (three random tiny configs) is the whole-model parity pair; ``mixed`` is one pair for the
component tests (sliding, CSA and HCA layers, hash and top-k MoE). Session scope: building and
saving an oracle is the slow part, and every component file reuses the same ones.
"""
from __future__ import annotations

import pytest

import dsv4lab
from oracle_util import oracle, tiny_config

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
