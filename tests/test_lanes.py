"""Decode lanes (dsv4lab/lanes.py): the compressors' step and the indexer's selection forked onto a
side stream beside the attention's q path.

CPU (always): the kernels' internal buffers are kept per lane; the embedded model with every
kernel slot installed (on CPU each slot runs its reference math) decodes the same bits with lanes
on and off, forking once per compressed layer and step ("graph" mode: only inside
``lanes.capturing()``), a listening hook keeps its layer on one lane, and an exception inside the
side lane leaves the main lane current. GPU (@pytest.mark.gpu): the same model with the Triton
kernels, lanes on against off eagerly, and the CUDA-graph decoder (lanes in its capture) against
one-lane eager: bitwise equal logits.
"""
from __future__ import annotations

import contextlib

import pytest
import torch

import dsv4lab
from dsv4lab import lanes
from dsv4lab.kernels import activation_pairs, host, install
from dsv4lab.kernels.install import install_kernels

pytestmark = pytest.mark.usefixtures("one_thread")


@contextlib.contextmanager
def lanes_set(mode: str):
    prev = lanes.set_decode_lanes(mode)
    try:
        yield
    finally:
        lanes.set_decode_lanes(prev)


def test_buffers_are_kept_per_lane():
    dev = torch.device("cpu")
    main = host.scratch("lanes_test", (8,), torch.float32, dev)
    cnt = host.counters(dev, 4)
    fork = lanes.Fork(dev)
    with fork.side():
        assert lanes.current_lane() == lanes.SIDE
        side = host.scratch("lanes_test", (8,), torch.float32, dev)
        side_cnt = host.counters(dev, 4)
        xp_side, _ = activation_pairs.pairs_buffers(4, dev)
    fork.join()
    assert lanes.current_lane() == lanes.MAIN
    assert side is not main and side.data_ptr() != main.data_ptr()
    assert side_cnt.data_ptr() != cnt.data_ptr()
    assert host.scratch("lanes_test", (8,), torch.float32, dev) is main     # kept, per lane
    assert activation_pairs.pairs_buffers(4, dev)[0] is not xp_side


class _FakeStream:
    """Records which stream waited for which (a CPU stand-in for ``torch.cuda.Stream`` and the
    fork's reused events: ``record`` notes the recording stream, ``wait_event`` logs the pair)."""

    device_index = 0

    def __init__(self, name, log):
        self.name, self.log = name, log

    def wait_event(self, event):
        self.log.append((self.name, event.by))


class _FakeEvent:
    def record(self, stream):
        self.by = stream.name


def _fake_cuda_fork(log, monkeypatch):
    monkeypatch.setattr(torch.cuda, "set_stream", lambda s: None)
    monkeypatch.setattr(lanes, "_current_device", lambda: 0)
    fork = lanes.Fork(torch.device("cpu"))
    fork.cuda, fork.main, fork.stream = True, _FakeStream("main", log), _FakeStream("side", log)
    fork.to_side, fork.to_main = _FakeEvent(), _FakeEvent()
    return fork


def test_side_lane_borrows_the_main_lanes_emitted_pairs(monkeypatch):
    """The side lane reads pairs the main lane emitted in place (no launch), waiting for the main
    stream only when they were written after its last wait; a main-lane write to them then waits
    for the side lane first."""
    dev, KG = torch.device("cpu"), 6
    x = torch.randn(KG * 16)
    log = []
    activation_pairs.pairs_written(KG, dev, x)           # an emitting main-lane launch, before the fork
    xp0, inv0 = activation_pairs.pairs_buffers(KG, dev)
    fork = _fake_cuda_fork(log, monkeypatch)
    with fork.side():
        xp, inv = activation_pairs.x_pairs(x)            # would launch the kernel if not borrowed
    assert xp is xp0 and inv is inv0 and log == []       # in place; written before the fork: no wait
    assert (KG, dev) in fork.borrowed
    y = torch.randn((KG + 1) * 16)
    activation_pairs.pairs_written(KG + 1, dev, y)        # another size, after the fork
    with fork.side():
        activation_pairs.x_pairs(y)
    assert log == [("side", "main")]                     # written after the side's last wait: wait now
    activation_pairs.pairs_buffers(KG, dev)              # a main-lane launch about to write them
    assert log[-1] == ("main", "side") and not fork.borrowed
    fork.join()
    assert lanes._open is None


def test_side_lane_gives_back_the_current_device(monkeypatch):
    """``torch.cuda.set_stream`` makes the stream's device current: a fork of a layer on GPU 0
    issued while GPU 1 is current leaves GPU 1 current after each side block."""
    log, devices = [], []
    fork = _fake_cuda_fork(log, monkeypatch)
    monkeypatch.setattr(lanes, "_current_device", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_device", devices.append)
    with fork.side():
        pass
    fork.join()
    assert devices == [1]


def test_side_lane_restored_after_an_error():
    fork = lanes.Fork(torch.device("cpu"))
    with pytest.raises(ZeroDivisionError):
        with fork.side():
            1 / 0
    assert lanes.current_lane() == lanes.MAIN
    fork.join()
    with pytest.raises(RuntimeError, match="after join"):
        with fork.side():
            pass


def _cpu_installed(monkeypatch):
    """The embedded model with every kernel slot installed on CPU (each slot falls back to its
    reference math there), so ``Attention.decode`` takes the fused path that lanes fork."""
    m = dsv4lab.load("tiny-nvfp4", dtype=torch.bfloat16, kernels=False, progress=False)
    monkeypatch.setattr(install, "_on_cuda", lambda t: t is not None)
    monkeypatch.setattr(install, "have_triton_cuda", lambda: True)
    assert install_kernels(m) > 0
    return m


def _decode(m, ids, steps):
    st = m.new_state(1, ids.shape[1] + steps + 1)
    with torch.no_grad():
        tok = m.prefill(ids, st)[:, -1:].argmax(-1)
        out = []
        for _ in range(steps):
            lg = m.decode_step(tok, st)
            out.append(lg)
            tok = lg[:, -1:].argmax(-1)
    return torch.cat(out, 1), st


def test_embedded_model_decodes_the_same_bits_on_lanes(monkeypatch):
    m = _cpu_installed(monkeypatch)
    compressed = [i for i, layer in enumerate(m.layers) if layer.attn.compressor is not None]
    assert compressed and all(m.layers[i].attn.fused_rows() for i in compressed)
    ids = torch.randint(2, m.config.vocab_size, (1, 37), generator=torch.Generator().manual_seed(0))
    steps = 9  # past a CSA (ratio 4) and an HCA (ratio 8) window close
    with lanes_set("off"):
        want, st_off = _decode(m, ids, steps)
    forks = _count_forks(monkeypatch)
    with lanes_set("all"):
        got, st_on = _decode(m, ids, steps)
    assert len(forks) == len(compressed) * steps
    assert torch.equal(got, want)
    for a, b in zip(st_off.layers, st_on.layers):
        assert torch.equal(a.kv_ring, b.kv_ring)
        if a.compressor is not None:
            assert torch.equal(a.compressor.entries, b.compressor.entries)
        if a.indexer is not None:
            assert torch.equal(a.indexer.entries, b.indexer.entries)


def _count_forks(monkeypatch) -> list:
    forks = []
    real = lanes.Fork.__init__

    def counted(self, device):
        forks.append(device)
        real(self, device)

    monkeypatch.setattr(lanes.Fork, "__init__", counted)
    return forks


def test_graph_mode_forks_only_while_capturing(monkeypatch):
    m = _cpu_installed(monkeypatch)
    ids = torch.randint(2, m.config.vocab_size, (1, 13), generator=torch.Generator().manual_seed(5))
    forks = _count_forks(monkeypatch)
    compressed = sum(layer.attn.compressor is not None for layer in m.layers)
    with lanes_set("graph"):
        _decode(m, ids, 2)
        assert forks == []                               # eager decode: one stream
        with lanes.capturing():
            _decode(m, ids, 2)
        assert len(forks) == compressed * 2
    with pytest.raises(ValueError, match="must be one of.*'graph'.*got 'on'"):
        lanes.set_decode_lanes("on")
    assert lanes.decode_lanes_mode() == lanes.MODES[1]   # unchanged by the refused call


def test_a_listening_hook_keeps_its_layer_on_one_lane(monkeypatch):
    m = _cpu_installed(monkeypatch)
    ids = torch.randint(2, m.config.vocab_size, (1, 21), generator=torch.Generator().manual_seed(3))
    hooked = next(i for i, layer in enumerate(m.layers) if layer.attn.indexer is not None)
    seen = []
    m.layers[hooked].attn.indexer.hook_indices.register_forward_hook(lambda mod, a, out: seen.append(lanes.current_lane()))
    forks = _count_forks(monkeypatch)
    compressed = sum(layer.attn.compressor is not None for layer in m.layers)
    with lanes_set("all"):
        _decode(m, ids, 3)
    assert len(forks) == (compressed - 1) * 3          # every compressed layer but the hooked one
    assert seen and set(seen) == {lanes.MAIN}


# ----------------------------------------------------------------------------- GPU
@pytest.mark.gpu
def test_gpu_lanes_equal_one_lane_eager_and_graph():
    from dsv4lab.decode.graphs import GraphDecoder

    m = dsv4lab.load("tiny-nvfp4", device="cuda", dtype=torch.bfloat16, progress=False)
    assert m.load_stats["kernels"] > 0
    ids = torch.randint(2, m.config.vocab_size, (1, 61), generator=torch.Generator().manual_seed(1)).cuda()
    steps = 24
    with lanes_set("off"):
        want, _ = _decode(m, ids, steps)
    with lanes_set("all"):
        got, _ = _decode(m, ids, steps)
    assert torch.equal(got, want)
    with lanes_set("graph"):                            # the graph decoder forks in its capture
        st = m.new_state(1, ids.shape[1] + steps + 1)
        with torch.no_grad():
            tok = m.prefill(ids, st)[:, -1:].argmax(-1)
            g = GraphDecoder(m, st)
            out = []
            for _ in range(steps):
                lg = g.step(tok).clone()
                out.append(lg)
                tok = lg[:, -1:].argmax(-1)
        assert torch.equal(torch.cat(out, 1), want)
