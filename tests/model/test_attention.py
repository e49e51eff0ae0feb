"""Attention (dsv4lab/model/attention.py), sliding / CSA / HCA layers, against the oracle's
DeepseekV4Attention fed the inputs of its own forward (``mixed_calls``): prefill, and decode of
the last tokens against the fixed-shape state; a scaled sink and padded KV slots counted in the
softmax are the known wrong variants.

Tolerances: float32 atol=1e-5, rtol=1e-5; a wrong variant must miss by more than 1e-3.
"""
from __future__ import annotations

import pytest
import torch

from dsv4lab.analysis.components import shallow_clone
from dsv4lab.bugzoo.variants import AttentionPaddedKVCounted, AttentionSinkScaled

ATOL, RTOL = 1e-5, 1e-5
WRONG = 1e-3
LAYERS = {"sliding": 0, "csa": 1, "hca": 2}
N_DECODE = 6


def _oracle_io(mixed_calls, layer):
    _, calls = mixed_calls
    (call,) = calls[f"layers.{layer}.self_attn"]
    return call.args[0], call.output[0]


@pytest.mark.parametrize("kind", sorted(LAYERS))
def test_prefill_matches_oracle(mixed, mixed_calls, kind):
    cfg, _, ours = mixed
    layer = LAYERS[kind]
    attn = ours.layers[layer].attn
    assert attn.layer_type == cfg.layer_types[layer]
    x, want = _oracle_io(mixed_calls, layer)
    with torch.no_grad():
        got = attn.prefill(x, 0, ours.new_state(x.shape[0], x.shape[1]).layers[layer])
    torch.testing.assert_close(got, want, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("kind", sorted(LAYERS))
def test_decode_matches_oracle(mixed, mixed_calls, kind):
    _, _, ours = mixed
    layer = LAYERS[kind]
    attn = ours.layers[layer].attn
    x, want = _oracle_io(mixed_calls, layer)
    S = x.shape[1]
    st = ours.new_state(x.shape[0], S).layers[layer]
    with torch.no_grad():
        rows = [attn.prefill(x[:, : S - N_DECODE], 0, st)]
        rows += [attn.decode(x[:, t : t + 1], torch.tensor(t), st) for t in range(S - N_DECODE, S)]
    torch.testing.assert_close(torch.cat(rows, 1), want, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("cls", [AttentionSinkScaled, AttentionPaddedKVCounted], ids=lambda c: c.__name__)
def test_wrong_attention_misses_the_oracle(mixed, mixed_calls, cls):
    _, _, ours = mixed
    layer = LAYERS["sliding"]  # 42 tokens > window 8: masked slots exist
    attn = ours.layers[layer].attn
    assert attn.sink.abs().max() > 0
    x, want = _oracle_io(mixed_calls, layer)
    with torch.no_grad():
        bad = shallow_clone(attn, cls).prefill(x, 0, ours.new_state(x.shape[0], x.shape[1]).layers[layer])
    assert (bad - want).abs().max().item() > WRONG
