"""Decode drivers: fixed-buffer decode vs full forwards (CPU), graph signature, GPU capture."""
from __future__ import annotations

import pytest
import torch

from dsv4lab.decode.check import decode_check
from dsv4lab.decode.graphs import model_signature
from dsv4lab.workbench import random_model
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


def test_tap_follows_each_decode_step():
    from dsv4lab.decode.taps import Tap

    m = _model()
    ids = torch.randint(2, 97, (1, 30), generator=torch.Generator().manual_seed(0))
    st = m.new_state(1, 40)
    m.prefill(ids[:, :20], st)
    seen = []
    with Tap(m, "layers.2.attn.compressor.hook_entries") as tap, \
            m.hooks([("layers.2.attn.compressor.hook_entries", lambda t, n: seen.append(t.clone()))]):
        for t in range(20, 30):
            m.decode_step(ids[:, t : t + 1], st)
            st.pos += 1
            assert torch.equal(tap.value(), seen[-1])
    assert tap.count == 10
    with pytest.raises(KeyError):
        Tap(m, "layers.2.attn.no_such_hook")


@pytest.mark.gpu
@cuda
def test_tap_under_graph_replay():
    from dsv4lab.decode.graphs import GraphDecoder
    from dsv4lab.decode.taps import Tap

    m = _model("cuda")
    ids = torch.randint(2, 97, (1, 30), generator=torch.Generator().manual_seed(0)).cuda()
    st = m.new_state(1, 60)
    m.prefill(ids, st)
    ref_state = st.clone()
    tap = Tap(m, "hook_final_hidden")
    gd = GraphDecoder(m, st)
    tok = ids[:, -1:]
    for _ in range(5):
        gd.step(tok, st)
        st.pos += 1
        got = tap.value()
        m.decode_step(tok, ref_state)  # eager on a copy of the state: the tap fires eagerly too
        ref_state.pos += 1
        assert torch.equal(got, tap.value())


def _flags(m):
    """(module name, attribute) of every plain-valued public switch on the model's modules."""
    from dsv4lab.decode.graphs import PER_RUN_ATTRIBUTES

    for name, mod in m.named_modules():
        for key, value in vars(mod).items():
            if not key.startswith("_") and key not in PER_RUN_ATTRIBUTES and isinstance(value, (bool, int, float, str)):
                yield name, key


def _toggled(value):
    return (not value) if isinstance(value, bool) else value + 1 if isinstance(value, (int, float)) else value + "x"


def test_signature_tracks_every_switch():
    """Flipping any module flag after capture changes the signature (-> recapture): named ones first."""
    m = _model()
    s0 = model_signature(m)
    attn = m.layers[1].attn
    named = [(attn, "use_compressed"), (attn.indexer, "enabled"), (attn.indexer, "train_dense"),
             (attn.wq_a, "act_scale"), (m.layers[1].mlp.experts, "gather_in_decode"), (m.layers[1].mlp.router, "top_k")]
    for mod, key in named:
        old = getattr(mod, key)
        setattr(mod, key, _toggled(old))
        assert model_signature(m) != s0, key
        setattr(mod, key, old)
        assert model_signature(m) == s0, key
    flags = list(_flags(m))
    assert len(flags) > 100
    for name, key in flags:
        mod = m.get_submodule(name)
        old = getattr(mod, key)
        setattr(mod, key, _toggled(old))
        changed = model_signature(m) != s0
        setattr(mod, key, old)
        assert changed, f"{name}.{key}"
    h = m.layers[0].attn.register_forward_pre_hook(lambda mod, args: None)
    assert model_signature(m) != s0
    h.remove()
    m.layers[0].attn.wq_a.kernel = lambda *a: None
    assert model_signature(m) != s0


def test_graph_decoder_recaptures_after_a_toggle(monkeypatch):
    """ensure_current (called by every replay) recaptures once the signature moved, and compares the
    whole signature only after a component counted a change; CPU: capture stubbed."""
    import copy

    from dsv4lab.decode import graphs
    from dsv4lab.decode.graphs import GraphDecoder

    m = _model()
    dec = object.__new__(GraphDecoder)  # __init__ insists on CUDA; only the bookkeeping is tested here
    dec.model, dec.segments, dec.captures = m, [], 0
    full = []
    monkeypatch.setattr(graphs, "model_signature", lambda model: full.append(1) or model_signature(model))

    def capture():
        dec.segments, dec.signature = ["graph"], model_signature(m)
        dec._note_current()
        dec.captures += 1

    monkeypatch.setattr(dec, "capture", capture)
    dec.ensure_current()
    for _ in range(3):
        dec.ensure_current()
    assert dec.captures == 1 and full == []          # no change: no whole-model walk per step
    m.layers[1].attn.use_compressed = False           # a flag set on a component
    dec.ensure_current()
    assert dec.captures == 2
    m.layers[1].attn.use_compressed = False           # set again, same value: compared, not recaptured
    dec.ensure_current()
    assert dec.captures == 2 and len(full) == 2   # one walk per counted change
    with m.layers[0].attn.hook_q.register_forward_hook(lambda *a: None):
        dec.ensure_current()
        assert dec.captures == 3                      # a hook registered
    dec.ensure_current()
    assert dec.captures == 4                          # and removed
    m.layers[2] = copy.deepcopy(m.layers[2])          # into the (untracked) ModuleList
    dec.ensure_current()
    assert dec.captures == 5


def test_decode_check_reports_first_token_and_a_speedup_of_at_least_one():
    """Notebook 5 printed the generation without the prefill's token, and "speedup" read < 1
    when the first path was the faster one."""
    from dsv4lab.decode.check import DecodeCheck

    dc = DecodeCheck("decode_buffers", "full_forward", 2, [5, 6], [5, 6], [0.0, 0.0], [1.0, 1.0], [4.0, 4.0], 9)
    assert dc.generated == [9, 5, 6]
    s = dc.summary()
    assert s["faster_path"] == "decode_buffers" and s["speedup"] == 4.0
    s = DecodeCheck("eager", "graph", 1, [1], [1], [0.0], [3.0], [1.5], 2).summary()
    assert s["faster_path"] == "graph" and s["speedup"] == 2.0


def test_prefill_and_decode_steps_count_no_change():
    """A forward writes no public attribute of a component: otherwise every graph replay would walk
    the whole model again (dsv4lab.model.component)."""
    from dsv4lab.model.component import changes

    m = _model()
    st = m.new_state(1, 24)
    ids = torch.randint(0, m.config.vocab_size, (1, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        m.prefill(ids[:, :8], st)
        st.pos += 8
        c0 = changes()
        for _ in range(3):
            m.decode_step(ids[:, 8:], st)
            st.pos += 1
    assert changes() == c0
