"""DecodeState (dsv4lab/model/state.py): fixed-shape decode buffers, per-device positions.

Checked against the module docstring (ring and entry shapes per layer type, positions on the
device) and by behaviour (it never grows during decode; a clone decodes identically, bit for bit).
"""
from __future__ import annotations

import torch

from dsv4lab.config import CSA, SLIDING
from dsv4lab.workbench import random_model
from dsv4lab.model.state import DecodeState
from oracle_util import random_ids, tiny_config


def test_decode_state_never_grows(pair):
    cfg, _, ours = pair
    st = ours.new_state(1, 80)
    shapes = [t.shape for t in st.tensors()]
    ptrs = [t.data_ptr() for t in st.tensors()]
    ids = random_ids(cfg, n=80, b=1)
    with torch.no_grad():
        ours.prefill(ids[:, :10], st)
        for t in range(10, 40):
            ours.decode_step(ids[:, t : t + 1], st)
            st.pos += 1
    assert [t.shape for t in st.tensors()] == shapes
    assert [t.data_ptr() for t in st.tensors()] == ptrs
    assert int(st.pos_t) == 40


def test_allocate_shapes_follow_the_layer_types():
    cfg = tiny_config()
    B, L = 2, 50
    st = DecodeState.allocate(cfg, B, L, torch.bfloat16)
    assert len(st.layers) == cfg.num_hidden_layers and st.batch == B and st.max_len == L
    for i, ls in enumerate(st.layers):
        t = cfg.layer_types[i]
        assert ls.kv_ring.shape == (B, cfg.sliding_window, cfg.head_dim) and ls.kv_ring.dtype == torch.bfloat16
        assert (ls.compressor is None) == (t == SLIDING)
        assert (ls.indexer is None) == (t != CSA)
        if ls.compressor is not None:
            m, c = cfg.compress_ratio(i), 2 if t == CSA else 1
            assert ls.compressor.ring_kv.shape == ls.compressor.ring_gate.shape == (B, c * m, c * cfg.head_dim)
            assert ls.compressor.ring_gate.dtype == torch.float32 and ls.compressor.ring_gate.isneginf().all()
            assert ls.compressor.entries.shape == (B, L // m, cfg.head_dim)
        if ls.indexer is not None:
            assert ls.indexer.entries.shape == (B, L // cfg.compress_ratio(i), cfg.index_head_dim)
    assert st.nbytes() == sum(t.numel() * t.element_size() for t in st.tensors())
    assert DecodeState.allocate(cfg, B, 3).layers[2].compressor.entries.shape[1] == 1  # at least one entry


def test_positions_clone_and_state_equal_the_model_prefill():
    cfg = tiny_config()
    m = random_model(cfg, seed=1)
    st = m.new_state(1, 30)
    assert st.pos_on("cpu") is st.pos_t
    ids = random_ids(cfg, n=30, b=1)
    with torch.no_grad():
        m.prefill(ids[:, :20], st)
    assert st.pos == 20 and int(st.pos_t) == 20
    snap = st.clone()
    assert all(a.data_ptr() != b.data_ptr() and torch.equal(a, b) for a, b in zip(st.tensors(), snap.tensors()))
    with torch.no_grad():
        a = m.decode_step(ids[:, 20:21], st)
        b = m.decode_step(ids[:, 20:21], snap)  # the clone decodes the same token the same way
    assert torch.equal(a, b) and int(st.pos_t) == int(snap.pos_t) == 21
    st.set_pos(5)
    assert st.pos == 5 and int(st.pos_t) == 5 and int(snap.pos_t) == 21
