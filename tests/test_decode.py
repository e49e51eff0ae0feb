"""Decode drivers: fixed-buffer decode vs full forwards (CPU), graph signature, GPU capture."""
from __future__ import annotations

import pytest
import torch

from dsv4lab.decode.check import decode_check
from dsv4lab.decode.graphs import model_signature
from dsv4lab.model.init import random_model
from oracle_util import tiny_config

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (run on the device machine)")


def _model(device="cpu"):
    return random_model(tiny_config(), seed=5).to(device)


def test_cpu_decode_buffers_match_full_forward():
    m = _model()
    ids = torch.randint(2, 97, (1, 40), generator=torch.Generator().manual_seed(0))
    res = decode_check(m, ids, steps=30)
    s = res.summary()
    assert s["modes"] == ["decode_buffers", "full_forward"]
    assert s["token_agreement"] == 1.0
    assert s["max_abs_logit_diff"] < 1e-4
    assert len(res.latency_a_ms) == 30


def test_signature_tracks_hooks_modes_and_components():
    m = _model()
    s0 = model_signature(m)
    h = m.layers[1].attn.hook_q.register_forward_hook(lambda mod, i, o: None)
    assert model_signature(m) != s0
    h.remove()
    assert model_signature(m) == s0
    m.layers[0].attn.wq_a.set_mode("w4a4")
    assert model_signature(m) != s0
    m.layers[0].attn.wq_a.set_mode("w4a16")
    assert model_signature(m) == s0
    m.layers[1].attn.indexer.enabled = False
    assert model_signature(m) != s0


@pytest.mark.gpu
@cuda
def test_graph_equals_eager_on_gpu():
    m = _model("cuda")
    ids = torch.randint(2, 97, (1, 40), generator=torch.Generator().manual_seed(0))
    s = decode_check(m, ids, steps=96).summary()
    assert s["token_agreement"] == 1.0
    assert s["max_abs_logit_diff"] == 0.0
    assert s["memory_growth_during_replay_bytes"] == 0


@pytest.mark.gpu
@cuda
def test_decode_step_has_no_host_syncs():
    from dsv4lab.decode.check import sync_inventory

    m = _model("cuda")
    ids = torch.randint(2, 97, (1, 40), generator=torch.Generator().manual_seed(0))
    assert sync_inventory(m, ids, steps=3) == []
