"""DecoderLayer (dsv4lab/model/decoder.py): mHC around attention and MoE, against the oracle's
DeepseekV4DecoderLayer fed the streams of its own forward (``mixed_calls``), prefill and decode;
a comb used untransposed is the known wrong variant.

Tolerances: float32 atol=1e-5, rtol=1e-5; a wrong variant must miss by more than 1e-3.
"""
from __future__ import annotations

import pytest
import torch

from dsv4lab.bugzoo.variants import MHCCombNotTransposed

ATOL, RTOL = 1e-5, 1e-5
WRONG = 1e-3
N_DECODE = 4


def _oracle_io(mixed_calls, layer):
    ids, calls = mixed_calls
    (call,) = calls[f"layers.{layer}"]
    return ids, call.args[0], call.output


@pytest.mark.parametrize("layer", range(4))
def test_layer_prefill_and_decode_match_oracle(mixed, mixed_calls, layer):
    cfg, _, ours = mixed
    ids, h, want = _oracle_io(mixed_calls, layer)
    B, S = ids.shape
    assert h.shape == (B, S, cfg.hc_mult, cfg.hidden_size)
    dec = ours.layers[layer]
    with torch.no_grad():
        got = dec.prefill(h, ids, 0, ours.new_state(B, S).layers[layer])
        torch.testing.assert_close(got, want, atol=ATOL, rtol=RTOL)
        st = ours.new_state(B, S).layers[layer]
        rows = [dec.prefill(h[:, : S - N_DECODE], ids[:, : S - N_DECODE], 0, st)]
        rows += [dec.decode(h[:, t : t + 1], ids[:, t : t + 1], torch.tensor(t), st) for t in range(S - N_DECODE, S)]
    torch.testing.assert_close(torch.cat(rows, 1), want, atol=ATOL, rtol=RTOL)


def test_comb_not_transposed_misses_the_oracle(mixed, mixed_calls):
    _, _, ours = mixed
    ids, h, want = _oracle_io(mixed_calls, 1)
    with ours.replace("layers.1.attn_hc", MHCCombNotTransposed), torch.no_grad():
        bad = ours.layers[1].prefill(h, ids, 0, ours.new_state(*ids.shape).layers[1])
    assert (bad - want).abs().max().item() > WRONG
    assert (ours.components()["impl"] == "reference").all()  # restored
