"""DecodeState (dsv4lab/model/state.py): fixed-shape decode buffers, per-device positions."""
from __future__ import annotations

import torch

from oracle_util import random_ids


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
