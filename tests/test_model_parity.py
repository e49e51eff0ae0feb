"""Parity with transformers' DeepseekV4ForCausalLM (the oracle) on random tiny configs.

Tolerances: float32 logits within 1e-4 absolute for prefill (observed ~1e-6), chunked prefill +
decode within 1e-4 of a full forward, greedy tokens identical for >= 40 new tokens.
"""
from __future__ import annotations

import pytest
import torch

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


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def pair(request, tmp_path_factory):
    cfg = tiny_config(**CONFIGS[request.param])
    hf = oracle(cfg, seed=len(request.param))
    path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(path)
    ours = dsv4lab.load(path, progress=False)
    return cfg, hf, ours


def _ids(cfg, n=96, b=2, seed=7):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(2, cfg.vocab_size, (b, n), generator=g)


def test_prefill_logits_match_oracle(pair):
    cfg, hf, ours = pair
    ids = _ids(cfg)
    with torch.no_grad():
        ref = hf(ids, use_cache=False).logits
        got = ours(ids)
    assert got.shape == ref.shape
    assert (got - ref).abs().max().item() < 1e-4


def test_chunked_prefill_and_decode_equal_full_forward(pair):
    cfg, _, ours = pair
    ids = _ids(cfg, n=96)
    with torch.no_grad():
        full = ours(ids)
        st = ours.new_state(2, 96)
        parts = [ours.prefill(ids[:, :29], st), ours.prefill(ids[:, 29:61], st)]
        for t in range(61, 96):
            parts.append(ours.decode_step(ids[:, t : t + 1], st))
            st.pos += 1
    got = torch.cat(parts, dim=1)
    assert (got - full).abs().max().item() < 1e-4


def test_greedy_generate_matches_oracle(pair):
    cfg, hf, ours = pair
    ids = _ids(cfg, n=60, seed=11)
    n_new = 42
    hf.generation_config.eos_token_id = None  # no EOS suppression/stop: pure greedy on both sides
    with torch.no_grad():
        ref = hf.generate(ids, max_new_tokens=n_new, do_sample=False,
                          attention_mask=torch.ones_like(ids), pad_token_id=0)
        got = ours.generate(ids, max_new_tokens=n_new)
    assert got.shape == ref.shape
    assert torch.equal(got, ref)


def test_decode_state_never_grows(pair):
    cfg, _, ours = pair
    st = ours.new_state(1, 80)
    shapes = [t.shape for t in st.tensors()]
    ptrs = [t.data_ptr() for t in st.tensors()]
    ids = _ids(cfg, n=80, b=1)
    with torch.no_grad():
        ours.prefill(ids[:, :10], st)
        for t in range(10, 40):
            ours.decode_step(ids[:, t : t + 1], st)
            st.pos += 1
    assert [t.shape for t in st.tensors()] == shapes
    assert [t.data_ptr() for t in st.tensors()] == ptrs
    assert int(st.pos_t) == 40
