"""Layer-graph decode: graph units for unhooked layers, eager units where a Python hook listens."""
from __future__ import annotations

import pytest
import torch

from dsv4lab.decode.layer_graphs import LayerGraphDecoder
from dsv4lab.decode.taps import Tap
from dsv4lab.workbench import random_model
from oracle_util import tiny_config

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (run on the device machine)")


def _prefilled(device="cpu", prompt=24, extra=40):
    m = random_model(tiny_config(), seed=5).to(device)
    ids = torch.randint(2, 97, (1, prompt), generator=torch.Generator().manual_seed(0)).to(device)
    st = m.new_state(1, prompt + extra)
    m.prefill(ids, st)
    return m, st, ids[:, -1:]


def _greedy(step, st, tok, n):
    out = []
    for _ in range(n):
        lg = step(tok, st)[:, -1].clone()
        st.pos += 1
        tok = lg.argmax(-1, keepdim=True)
        out.append(lg)
    return torch.stack(out)


def _check_equal_to_eager(device, hooks=(), steps=12, exact=True):
    m, st, tok = _prefilled(device)
    ref_st = st.clone()
    seen_ref, seen = [], []
    with m.hooks([(n, lambda t, name: seen_ref.append(t.clone()) or fn(t)) for n, fn in hooks]):
        ref = _greedy(m.decode_step, ref_st, tok, steps)
    ld = LayerGraphDecoder(m, st)
    with m.hooks([(n, lambda t, name: seen.append(t.clone()) or fn(t)) for n, fn in hooks]):
        got = _greedy(ld.step, st, tok, steps)
        eager = ld.eager_units()
    if exact:
        assert torch.equal(got, ref)
    else:
        torch.testing.assert_close(got, ref, rtol=0, atol=1e-5)
    assert len(seen) == len(seen_ref) == steps * len(hooks)
    for a, b in zip(seen, seen_ref):
        assert torch.equal(a, b)
    for a, b in zip(st.tensors(), ref_st.tensors()):
        assert torch.equal(a, b)
    return ld, eager


def test_units_match_eager_decode_without_hooks():
    ld, eager = _check_equal_to_eager("cpu")
    assert eager == []
    layers = [f"layers.{i}" for i in range(ld.model.config.num_hidden_layers)]
    assert [u.name for u in ld.units()] == ["embed", *layers, "head"]


def test_hooked_layer_runs_eagerly_and_its_hook_patches_the_stream():
    halve = lambda t: t * 0.5  # noqa: E731  a patch: changes everything downstream
    ld, eager = _check_equal_to_eager("cpu", hooks=[("layers.1.hook_resid_post", halve)])
    assert eager == ["layers.1"]


def test_hooks_in_embed_and_head_units():
    keep = lambda t: None  # noqa: E731
    _, eager = _check_equal_to_eager("cpu", hooks=[("hook_embed", keep), ("hook_logits", keep)])
    assert eager == ["embed", "head"]


def test_tap_keeps_its_unit_a_graph_and_follows_each_step():
    m, st, tok = _prefilled()
    ld = LayerGraphDecoder(m, st)
    ref_st = st.clone()
    with Tap(m, "layers.2.attn.hook_q") as tap:
        assert ld.eager_units() == []
        for _ in range(3):
            ld.step(tok, st)
            st.pos += 1
            got = tap.value()
            m.decode_step(tok, ref_st)
            ref_st.pos += 1
            assert torch.equal(got, tap.value())


def test_a_change_recaptures_only_its_unit():
    m, st, tok = _prefilled()
    ld = LayerGraphDecoder(m, st)
    ld.step(tok, st)
    n_units = len(ld.units())
    assert ld.captures == n_units
    m.layers[2].attn.wq_a.set_mode("w4a4")
    ld.step(tok, st)
    assert ld.captures == n_units + 1
    with m.hooks([("layers.0.hook_resid_pre", lambda t, n: None)]):
        ld.step(tok, st)
        assert ld.eager_units() == ["layers.0"]
        assert ld.captures == n_units + 1  # turning a unit eager captures nothing
    ld.step(tok, st)
    assert ld.eager_units() == []
    assert ld.captures == n_units + 2  # layer 0 is a graph again
    ld.step(tok, st)
    assert ld.captures == n_units + 2  # nothing moved: no capture


def test_generate_with_layer_graphs_keeps_every_steps_logits():
    m, st, _ = _prefilled()
    ids = torch.randint(2, 97, (1, 10), generator=torch.Generator().manual_seed(1))
    st_a = m.new_state(1, 30)
    st_b = m.new_state(1, 30)
    ld = LayerGraphDecoder(m, st_b)
    out_a, lg_a = m.generate(ids, 12, state=st_a, return_logits=True)
    out_b, lg_b = m.generate(ids, 12, state=st_b, step_fn=ld.step, return_logits=True)
    assert torch.equal(out_a, out_b)
    assert torch.equal(lg_a, lg_b)
    assert not torch.equal(lg_b[:, -1], lg_b[:, -2])  # not one reused buffer


def test_bad_arguments_are_named():
    m, st, tok = _prefilled()
    with pytest.raises(ValueError, match="warmup=0"):
        LayerGraphDecoder(m, st, warmup=0)
    ld = LayerGraphDecoder(m, st)
    with pytest.raises(ValueError, match="different DecodeState"):
        ld.step(tok, st.clone())


@pytest.mark.gpu
@cuda
def test_layer_graphs_equal_eager_on_gpu_with_a_hooked_layer():
    halve = lambda t: t * 0.5  # noqa: E731
    ld, eager = _check_equal_to_eager("cuda", hooks=[("layers.2.hook_resid_mid", halve)], steps=48)
    assert eager == ["layers.2"]
    assert all(not isinstance(u.graph, type(None)) for u in ld.units() if not u.eager)


@pytest.mark.gpu
@cuda
def test_layer_graphs_equal_eager_on_gpu():
    _check_equal_to_eager("cuda", steps=64)


def test_generate_by_decode_mode_name():
    m, _, _ = _prefilled()
    ids = torch.randint(2, 97, (1, 9), generator=torch.Generator().manual_seed(2))
    ref = m.generate(ids, 10)
    seen = []
    with m.hooks([("layers.1.hook_resid_mid", lambda t, n: seen.append(1))]):
        got = m.generate(ids, 10, decode="layer-graphs")
    assert torch.equal(got, ref)
    assert len(seen) == 1 + 9  # the prefill fires it once, then each of the 9 decode steps
    with pytest.raises(ValueError, match=r"'layer_graph'.*did you mean 'layer-graphs'"):
        m.generate(ids, 10, decode="layer_graph")
    with pytest.raises(ValueError, match="step_fn"):
        m.generate(ids, 10, decode="layer-graphs", step_fn=m.decode_step)
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="CUDA"):
            m.generate(ids, 10, decode="graph")
    assert m.decoder(m.new_state(1, 4), "eager") == m.decode_step
