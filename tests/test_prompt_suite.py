"""The prompt suite: every named prompt exists, starts with BOS, and the length prompts cover every
residue modulo each compression ratio of the config (the embedded one and V4-shaped ones)."""
from __future__ import annotations

import json
import math

import pytest
import torch

from dsv4lab.config import config_from_dict
from dsv4lab.text import load_tokenizer
from dsv4lab.text.chat import ASSISTANT, THINK_END, THINK_START
from dsv4lab.text.suite import compression_ratios, prompt_suite, residue_lengths, retrieval_distance
from oracle_util import tiny_config

EMBEDDED = config_from_dict(json.load(open("data/tiny-dsv4/config.json")))


@pytest.fixture(scope="module")
def suite():
    return prompt_suite(EMBEDDED)


def test_named_prompts(suite):
    tok = load_tokenizer()
    bos = tok.convert_tokens_to_ids("<｜begin▁of▁sentence｜>")
    assert {"plain", "chat", "thinking", "retrieval"} <= set(suite)
    for name, ids in suite.items():
        assert ids.dtype == torch.long and ids.dim() == 2 and ids.shape[0] == 1, name
        assert int(ids[0, 0]) == bos, name
        assert int(ids.max()) < EMBEDDED.vocab_size, name
    assert tok.decode(suite["chat"][0]).endswith(ASSISTANT + THINK_END)
    assert tok.decode(suite["thinking"][0]).endswith(ASSISTANT + THINK_START)
    assert ASSISTANT not in tok.decode(suite["plain"][0])


def test_retrieval_reaches_past_the_window(suite):
    d = retrieval_distance(EMBEDDED)
    assert d > 2 * EMBEDDED.sliding_window
    assert suite["retrieval"].shape[1] > d


def test_lengths_cover_every_residue(suite):
    ratios = compression_ratios(EMBEDDED)
    assert ratios == [4, 16]
    lengths = [v.shape[1] for k, v in suite.items() if k.startswith("len_")]
    assert lengths == residue_lengths(EMBEDDED) and all(f"len_{n}" in suite for n in lengths)
    for m in ratios:
        assert sorted({n % m for n in lengths}) == list(range(m)), m
    assert min(lengths) > EMBEDDED.sliding_window and min(lengths) >= 2 * max(ratios)
    # one natural text cut at each length: prefixes of each other
    longest = suite[f"len_{max(lengths)}"][0]
    assert all(torch.equal(suite[f"len_{n}"][0], longest[:n]) for n in lengths)


@pytest.mark.parametrize("over,period", [
    (dict(), 8),  # ratios 4 and 8
    (dict(compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 6}), 12),
    (dict(layer_types=["sliding_attention"] * 4), 1),
])
def test_residue_lengths_for_other_configs(over, period):
    cfg = tiny_config(**over)
    lengths = residue_lengths(cfg)
    assert len(lengths) == period and lengths == list(range(lengths[0], lengths[0] + period))
    assert lengths[0] % period == 0 and lengths[0] > cfg.sliding_window
    for m in compression_ratios(cfg):
        assert {n % m for n in lengths} == set(range(m))
    v4 = tiny_config(compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 128},
                     sliding_window=128)
    assert residue_lengths(v4)[0] == 256 and len(residue_lengths(v4)) == math.lcm(4, 128)


def test_bad_argument():
    with pytest.raises(TypeError, match="DSV4Config"):
        prompt_suite("data/tiny-dsv4")
