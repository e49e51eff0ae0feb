"""The model split over several devices, on a CPU-only machine.

Real splits here are "cpu" for every layer (loader path, device maps as list / dict / plan);
multi-segment decode is exercised with two distinct device objects that are both the CPU
(``cpu`` and ``cpu:0`` compare unequal, so the model sees two devices and runs one decode segment
per run, each with its own position counter); placement without compute uses ``meta``.
The host-memory test measures a streaming load in a fresh process.
"""
from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import dsv4lab
from dsv4lab.checkpoint import save_checkpoint
from dsv4lab.checkpoint.fake import random_state
from dsv4lab.model import DSV4Model
from dsv4lab.workbench import random_model
from dsv4lab.multidevice import devices_of, dispatch, gather_to, model_devices, normalize_device_map, segments
from oracle_util import benchmark_module, tiny_config

CPU, CPU0 = torch.device("cpu"), torch.device("cpu", 0)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    cfg = tiny_config()
    path = tmp_path_factory.mktemp("tiny_ckpt")
    save_checkpoint(path, cfg, random_state(cfg, seed=3, scale=0.3), layout="official", shard_bytes=40_000,
                    progress=False)
    return path


@pytest.fixture(scope="module")
def ckpt_nvfp4(tmp_path_factory):
    cfg = tiny_config()
    path = tmp_path_factory.mktemp("tiny_nvfp4")
    save_checkpoint(path, cfg, random_state(cfg, seed=4, scale=0.3), layout="transformers", nvfp4=["*"],
                    exclude=["head"], shard_bytes=30_000, progress=False)
    return path


def _ids(cfg, n=11, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, cfg.vocab_size, (2, n), generator=g)


def _fake_split(model, devs):
    """Make ``model`` report ``devs`` as its layer devices (all are the CPU for compute)."""
    model.layer_devices = lambda: list(devs)
    return model


# --------------------------------------------------------------------------- device maps
def test_normalize_device_map():
    assert normalize_device_map("cpu", 3) == [CPU] * 3
    assert normalize_device_map({0: "cpu", 1: "cpu", 2: "meta"}, 3) == [CPU, CPU, torch.device("meta")]
    with pytest.raises(ValueError, match="no device for layers"):
        normalize_device_map({0: "cpu"}, 3)
    with pytest.raises(ValueError, match="3 entries for 4 layers"):
        normalize_device_map(["cpu"] * 3, 4)
    with pytest.raises(ValueError, match="not contiguous"):
        normalize_device_map(["cpu", "meta", "cpu"], 3)


# ------------------------------------------------------------------ loader with device maps
@pytest.mark.parametrize("which", ["bf16", "nvfp4"])
def test_load_with_device_map_same_logits(ckpt, ckpt_nvfp4, which):
    path = ckpt if which == "bf16" else ckpt_nvfp4
    ref = dsv4lab.load(path, progress=False)
    ids = _ids(ref.config)
    want = ref(ids)
    n = ref.config.num_hidden_layers
    for dm in (["cpu"] * n, {i: "cpu" for i in range(n)}):
        m = dsv4lab.load(path, device_map=dm, progress=False)
        assert torch.equal(m(ids), want)
    # a plan's device map, with each planned GPU mapped to a device
    p = dsv4lab.plan(path, gpus=2, gpu_memory="1GB", reserve=0, context=64)
    assert sorted(set(p.placement)) == [0, 1] and p.placement == sorted(p.placement)
    m = dsv4lab.load(path, device_map=p.device_map(devices=["cpu", "cpu"]), progress=False)
    assert torch.equal(m(ids), want)
    assert torch.equal(m.generate(ids[:, :5], 6), ref.generate(ids[:, :5], 6))


# ------------------------------------------------------------ multi-segment compute on CPU
@pytest.mark.parametrize("devs", [[CPU, CPU, CPU0, CPU0], [CPU, CPU0, CPU0, CPU0], [CPU0, CPU0, CPU0, CPU]])
def test_split_segments_forward_generate_identical(devs):
    cfg = tiny_config()
    ref = random_model(cfg, seed=1)
    split = _fake_split(random_model(cfg, seed=1), devs)
    runs = [(d, r) for d, r in split.decode_segments()]
    assert len(runs) == 2 and runs[0][0] == devs[0] and runs[1][0] == devs[-1]
    assert runs[0][1].start == 0 and runs[-1][1].stop == 4 and runs[0][1].stop == runs[1][1].start
    ids = _ids(cfg, 13)
    assert torch.equal(split(ids), ref(ids))
    # generate long enough for the HCA layer (ratio 8) and CSA (ratio 4) to emit entries
    out_s, lg_s = split.generate(ids[:, :6], 20, return_logits=True)
    out_r, lg_r = ref.generate(ids[:, :6], 20, return_logits=True)
    assert torch.equal(out_s, out_r) and torch.equal(lg_s, lg_r)
    # one position counter per device, each advanced once per step
    st = split.new_state(2, 12)
    split.prefill(ids[:, :5], st)
    for _ in range(3):
        split.decode_step(ids[:, :1], st)
        st.pos += 1
    assert set(st.extra["pos_by_device"]) == set(devs)
    assert all(int(t) == 8 for t in st.extra["pos_by_device"].values())


def test_decode_step_by_segments_matches_unsplit():
    cfg = tiny_config()
    ref = random_model(cfg, seed=2)
    split = _fake_split(random_model(cfg, seed=2), [CPU, CPU, CPU0, CPU0])
    ids = _ids(cfg, 9)
    s_ref, s_split = ref.new_state(2, 30), split.new_state(2, 30)
    ref.prefill(ids, s_ref)
    split.prefill(ids, s_split)
    tok = ids[:, -1:]
    for _ in range(12):
        a = ref.decode_step(tok, s_ref)
        h = split.decode_segment(0, tok, tok, s_split)      # stream leaves segment 0 ...
        assert h.shape == (2, 1, cfg.hc_mult, cfg.hidden_size)
        b = split.decode_segment(1, h.to(CPU0), tok, s_split)  # ... and enters segment 1
        s_ref.pos += 1
        s_split.pos += 1
        assert torch.equal(a, b)
        tok = a[:, -1].argmax(-1, keepdim=True)


# ----------------------------------------------------------------- placement (no compute)
def test_dispatch_meta_segments():
    cfg = tiny_config()
    with torch.device("meta"):
        m = DSV4Model(cfg)
    dispatch(m, ["cpu", "cpu", "meta", "meta"])
    assert segments(m) == [(CPU, 0, 1), (torch.device("meta"), 2, 3)]
    md = model_devices(m)
    assert md["embed"] == CPU and md["head"] == torch.device("meta")
    assert all(p.device == CPU for p in m.layers[1].parameters())
    assert all(p.device.type == "meta" for p in m.layers[2].parameters())
    assert m.head_device().type == "meta"
    # the state follows the layers
    st = m.new_state(1, 16)
    assert [ls.kv_ring.device.type for ls in st.layers] == ["cpu", "cpu", "meta", "meta"]
    assert len(segments(dispatch(m, "meta"))) == 1


def test_dispatch_real_model_identical():
    cfg = tiny_config()
    ref = random_model(cfg, seed=5)
    m = dispatch(random_model(cfg, seed=5), {0: "cpu", 1: "cpu", 2: "cpu", 3: "cpu"})
    ids = _ids(cfg)
    assert torch.equal(m(ids), ref(ids))


# ------------------------------------------------------------------------- gathering
def test_gather_state_and_cache():
    cfg = tiny_config()
    with torch.device("meta"):
        m = DSV4Model(cfg)
    dispatch(m, ["cpu", "cpu", "meta", "meta"])
    st = m.new_state(1, 16)
    assert devices_of(st) == {CPU, torch.device("meta")}
    g = gather_to(st, "meta")
    assert devices_of(g) == {torch.device("meta")} and g.max_len == 16
    assert g.nbytes() <= st.nbytes()
    # a real split model: captures gathered to one device, values unchanged
    real = _fake_split(random_model(cfg, seed=1), [CPU, CPU, CPU0, CPU0])
    logits, cache = real.run_with_cache(_ids(cfg), names="**.attn.hook_*", device=None)
    gc = gather_to(cache, "cpu", dtype=torch.float64)
    assert set(gc) == set(cache) and len(gc) > 0
    for k in cache:
        a, b = cache[k], gc[k]
        if isinstance(a, torch.Tensor):
            assert b.device == CPU and torch.equal(a.double() if a.is_floating_point() else a, b)
    nested = gather_to({"x": [torch.ones(2)], "y": (torch.zeros(1, device=CPU0),)}, "meta")
    assert devices_of(nested) == {torch.device("meta")} and isinstance(nested["y"], tuple)


# ------------------------------------------------------------------------- host memory
_MEASURE = textwrap.dedent(r'''
    import gc, json, sys, threading, time
    import torch
    import dsv4lab

    def status():
        d = {}
        for line in open("/proc/self/status"):
            k, _, v = line.partition(":")
            if k in ("VmHWM", "VmRSS", "RssAnon", "RssFile"):
                d[k] = int(v.split()[0]) * 1024
        return d

    path, n = sys.argv[1], int(sys.argv[2])
    dm = {i: "cpu" for i in range(n)}
    m = dsv4lab.load(path, device_map=dm, dtype=torch.float32, progress=False)   # warm-up: imports, caches
    del m
    gc.collect()
    peak, stop = [0], [False]

    def sampler():
        while not stop[0]:
            a = status()["RssAnon"]
            peak[0] = max(peak[0], a)
            time.sleep(0.0002)

    try:
        open("/proc/self/clear_refs", "w").write("5")   # reset VmHWM
        hwm = True
    except OSError:
        hwm = False
    s0 = status()
    peak[0] = s0["RssAnon"]
    th = threading.Thread(target=sampler, daemon=True)
    th.start()
    t0 = time.perf_counter()
    m = dsv4lab.load(path, device_map=dm, dtype=torch.float32, progress=True)   # progress bar shows GB/s
    dt = time.perf_counter() - t0
    stop[0] = True
    th.join()
    s1 = status()
    model_bytes = sum(t.numel() * t.element_size() for t in list(m.parameters()) + list(m.buffers()))
    model_bytes += sum(ql.qweight.nbytes for _, ql in m.qlinears() if ql.qweight is not None)
    print(json.dumps({"peak_anon": max(peak[0], s1["RssAnon"]) - s0["RssAnon"], "final_anon": s1["RssAnon"] - s0["RssAnon"],
                      "peak_rss": (s1["VmHWM"] - s0["VmRSS"]) if hwm else None, "model_bytes": model_bytes,
                      "seconds": dt, "load_stats": m.load_stats}))
''')


def _measure(path, n_layers):
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536")  # freed buffers leave RSS at once (no heap reuse)
    r = subprocess.run([sys.executable, "-c", _MEASURE, str(path), str(n_layers)], capture_output=True, text=True,
                       env=env, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="needs Linux /proc")
def test_streaming_load_peak_host_memory(tmp_path):
    """Peak host memory of a load = the loaded model + at most 2 x the largest tensor + 16 MB.

    Loading to "cpu" in fp32 from a BF16 checkpoint (every tensor converted: the worst case), the
    anonymous resident memory above the model's own bytes stays under the bound; the whole
    checkpoint (several times the bound) never passes through host memory at once. On GPUs the
    model's bytes are not on the host, so the host peak is the bound itself.
    """
    cfg = tiny_config(hidden_size=256, moe_intermediate_size=384, n_routed_experts=32, vocab_size=2048)
    state = random_state(cfg, seed=0, dtype=torch.bfloat16)
    info = save_checkpoint(tmp_path, cfg, state, layout="official", shard_bytes=12 * 10**6, progress=False)
    ckpt_bytes = sum(t.numel() * t.element_size() for t in state.values())
    largest_fp32 = max(t.numel() for t in state.values()) * 4
    bound = 2 * largest_fp32 + 16 * 2**20
    assert len(info["files"]) >= 3 and ckpt_bytes > 2 * bound  # the bound discriminates
    r = _measure(tmp_path, cfg.num_hidden_layers)
    over = r["peak_anon"] - r["model_bytes"]
    print(f"\nstreaming load: checkpoint {ckpt_bytes / 1e6:.1f} MB, model fp32 {r['model_bytes'] / 1e6:.1f} MB, "
          f"peak anon RSS {r['peak_anon'] / 1e6:.1f} MB, over the model {over / 1e6:.2f} MB, bound {bound / 1e6:.1f} MB, "
          f"peak RSS incl. mmapped file pages {(r['peak_rss'] or 0) / 1e6:.1f} MB, {r['seconds']:.2f} s")
    assert r["final_anon"] >= 0.9 * r["model_bytes"]  # the measurement sees the model
    assert over <= bound, r


_ROOT = Path(__file__).resolve().parents[1]


def _multi_gpu_benchmark():
    """benchmarks/multi_gpu.py as a module (benchmarks/ is not a package on the test path)."""
    return benchmark_module("multi_gpu")


def test_multi_gpu_benchmark_split_map_and_cpu_smoke(tmp_path):
    """benchmarks/multi_gpu.py (issue #9's run): contiguous split maps, and its CPU smoke run
    (eager only) reports identical tokens and bitwise-equal logits for the split placement."""
    mg = _multi_gpu_benchmark()
    for n_dev in (1, 2, 3, 4, 8):
        devs = [f"cuda:{i}" for i in range(n_dev)]
        m = mg.split_map(6, devs)
        normalize_device_map(m, 6)  # raises unless contiguous
        assert m[0] == "cuda:0" and len(set(m)) == min(n_dev, 6)
    out = tmp_path / "mg.json"
    assert mg.main(["--devices", "cpu,cpu", "--steps", "4", "--json", str(out)]) == 0
    rep = json.loads(out.read_text())
    assert rep["all_tokens_identical"] is True
    for name in ("single", "split"):
        assert rep[name]["eager"]["bitwise_equal_steps"] == 4 and rep[name]["load_s"] > 0
    assert "graph" not in rep["split"]  # no CUDA graphs on a CPU


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                    reason="needs two CUDA GPUs (device kind nvidia-h200-x2)")
@pytest.mark.parametrize("model", [None, "data/tiny-dsv4/nvfp4"])
def test_gpu_two_devices_match_one(tmp_path, model):
    """The embedded model (BF16, and NVFP4 with the kernels installed by ``load``) split over two
    GPUs, eager and per-device CUDA graphs, against the one-GPU eager run: identical tokens and
    bitwise-equal logits for 64 greedy steps (the same kernels on the same data)."""
    mg = _multi_gpu_benchmark()
    out = tmp_path / "mg.json"
    args = ["--devices", "cuda:0,cuda:1", "--steps", "64", "--json", str(out)]
    assert mg.main(args + (["--model", str(_ROOT / model)] if model else [])) == 0
    rep = json.loads(out.read_text())
    assert rep["split"]["device_map"][0] == "cuda:0" and rep["split"]["device_map"][-1] == "cuda:1"
    for name in ("single", "split"):
        for mode in ("eager", "graph"):
            r = rep[name][mode]
            assert r["tokens_identical"] and r["bitwise_equal_steps"] == r["steps"] == 64, (name, mode, r)
    assert rep["split"]["graph"]["graphs"] == 2  # one graph per device


# ------------------------------------------ CUDA-graph decode over 8 devices (torch.cuda stand-ins)
class _FakeCuda:
    """Stand-ins for ``torch.cuda``'s streams, events, graphs and device/stream contexts that log,
    in order, what ``GraphDecoder`` asks of them. A graph "captures" the model's decode_segment
    calls made while its capture context is open and replays them over the same static buffers
    (what a CUDA graph does), so the numbers can be checked against eager decode as well."""

    def __init__(self):
        self.log: list[tuple] = []
        self.device = None                    # current device
        self.current: dict = {}               # device -> current stream
        self.defaults: dict = {}              # device -> its default stream
        self.capturing = None                 # (graph, stream) while a capture context is open
        fake = self

        class Stream:
            def __init__(self, device=None, default=False):
                self.device, self.default = torch.device(device), default
                fake.log.append(("stream", self))

            def wait_stream(self, other):
                fake.log.append(("wait_stream", self, other))

            def wait_event(self, event):
                fake.log.append(("wait_event", self, event))

            def synchronize(self):
                fake.log.append(("stream_sync", self))

        class Event:
            def record(self, stream=None):
                fake.log.append(("record", self, stream))

        class CUDAGraph:
            def __init__(self):
                self.ops = []

            def replay(self):
                fake.log.append(("replay", self, fake.current_stream(fake.device), fake.device))
                for op in self.ops:
                    op()

        self.Stream, self.Event, self.CUDAGraph = Stream, Event, CUDAGraph

    def current_stream(self, device=None):
        d = torch.device(device) if device is not None else self.device
        if d not in self.current:
            self.current[d] = self.defaults[d] = self.Stream(d, default=True)
        return self.current[d]

    def synchronize(self, device=None):
        self.log.append(("device_sync", None if device is None else torch.device(device)))

    @contextlib.contextmanager
    def device_ctx(self, device):
        old, self.device = self.device, torch.device(device)
        try:
            yield
        finally:
            self.device = old

    @contextlib.contextmanager
    def stream_ctx(self, stream):
        # like torch.cuda.StreamContext: the stream's device becomes current too
        old_dev, self.device = self.device, stream.device
        old = self.current_stream(stream.device)
        self.current[stream.device] = stream
        try:
            yield
        finally:
            self.current[stream.device], self.device = old, old_dev

    @contextlib.contextmanager
    def graph_ctx(self, graph, stream=None):
        self.log.append(("capture", graph, stream, self.device))
        with self.stream_ctx(stream):
            self.capturing = (graph, stream)
            try:
                yield
            finally:
                self.capturing = None

    def install(self, monkeypatch, model):
        for name, value in (("Stream", self.Stream), ("Event", self.Event), ("CUDAGraph", self.CUDAGraph),
                            ("current_stream", self.current_stream), ("synchronize", self.synchronize),
                            ("device", self.device_ctx), ("stream", self.stream_ctx), ("graph", self.graph_ctx)):
            monkeypatch.setattr(torch.cuda, name, value)
        real = model.decode_segment

        def decode_segment(k, h, ids, state):
            self.log.append(("run", k, self.current_stream(self.device), self.device,
                             None if self.capturing is None else self.capturing[0]))
            out = real(k, h, ids, state)
            if self.capturing is not None:  # replay: the same segment over the same static buffers
                self.capturing[0].ops.append(lambda: out.copy_(real(k, h, ids, state)))
            return out

        monkeypatch.setattr(model, "decode_segment", decode_segment)


def test_graph_decoder_eight_segments_streams_capture_order_and_handoffs(monkeypatch):
    """GraphDecoder over an 8-device map (the 8-GPU placement: one segment per GPU), with
    torch.cuda replaced by loggers: each segment is warmed up and captured on its own non-default
    stream with its device current, segments in layer order; every replay waits for the previous
    segment's event before its graph runs, records its own after, and the caller's stream waits
    for the last one. The replayed steps equal eager decode of the unsplit model bit for bit."""
    from dsv4lab.decode.graphs import GraphDecoder

    n = 8
    cfg = tiny_config(num_hidden_layers=n, layer_types=["sliding_attention", "compressed_sparse_attention",
                                                        "heavily_compressed_attention", "compressed_sparse_attention"] * 2,
                      mlp_layer_types=["hash_moe"] + ["moe"] * (n - 1))
    devs = [torch.device("cpu", k) for k in range(n)]  # eight distinct device objects, all the CPU
    ref = random_model(cfg, seed=6)
    split = _fake_split(random_model(cfg, seed=6), devs)
    assert [d for d, _ in split.decode_segments()] == devs
    ids = _ids(cfg, 9)[:1]
    s_ref, s_split = ref.new_state(1, 40), split.new_state(1, 40)
    ref.prefill(ids, s_ref)
    split.prefill(ids, s_split)

    fake = _FakeCuda()
    fake.install(monkeypatch, split)
    gd = object.__new__(GraphDecoder)  # __init__ insists on CUDA devices; the rest runs on the stand-ins
    gd.model, gd.state, gd.warmup, gd.segments, gd.signature, gd.captures = split, s_split, 2, [], None, 0
    gd.capture()
    cap = list(fake.log)
    fake.log.clear()

    # capture: its own stream per segment, on its device, ordered after the device's current stream
    streams = [s.stream for s in gd.segments]
    assert [s.device for s in gd.segments] == devs and len({id(s) for s in streams}) == n
    assert all(s.device == d and not s.default for s, d in zip(streams, devs))
    captures = [i for i, e in enumerate(cap) if e[0] == "capture"]
    assert [cap[i][1] for i in captures] == [s.graph for s in gd.segments]
    assert all(cap[i][2] is s.stream and cap[i][3] == s.device for i, s in zip(captures, gd.segments))
    runs = [e for e in cap if e[0] == "run"]
    assert [e[1] for e in runs] == [k for k in range(n) for _ in range(gd.warmup + 1)]  # warm-ups, then capture
    for e in runs:
        seg = gd.segments[e[1]]
        assert e[2] is seg.stream and e[3] == seg.device, e  # never on a default stream, never another device
    for k, seg in enumerate(gd.segments):
        first_run = next(i for i, e in enumerate(cap) if e[0] == "run" and e[1] == k)
        waited = next(i for i, e in enumerate(cap) if e[0] == "wait_stream" and e[1] is seg.stream)
        assert cap[waited][2].default and cap[waited][2].device == seg.device and waited < first_run
        assert [e[4] for e in cap if e[0] == "run" and e[1] == k] == [None] * gd.warmup + [seg.graph]
    assert {e[1] for e in cap if e[0] == "device_sync"} >= set(devs)  # all captures done before use

    # replay: event-ordered hand-offs in layer order, the caller's stream waits for the last graph
    tok = ids[:, -1:]
    for step in range(6):
        fake.log.clear()
        got = gd.step(tok, s_split)
        want = ref.decode_step(tok, s_ref)
        assert torch.equal(got, want), step
        log = fake.log
        replays = [i for i, e in enumerate(log) if e[0] == "replay"]
        assert [log[i][1] for i in replays] == [s.graph for s in gd.segments]
        for k, (i, seg) in enumerate(zip(replays, gd.segments)):
            assert log[i][2] is seg.stream and log[i][3] == seg.device
            rec = [j for j, e in enumerate(log) if e[0] == "record" and e[1] is seg.done]
            assert len(rec) == 1 and log[rec[0]][2] is seg.stream and rec[0] > i
            if k:
                prev = gd.segments[k - 1]
                waits = [j for j, e in enumerate(log) if e[0] == "wait_event" and e[1] is seg.stream]
                prev_rec = next(j for j, e in enumerate(log) if e[0] == "record" and e[1] is prev.done)
                assert len(waits) == 1 and log[waits[0]][2] is prev.done and prev_rec < waits[0] < i
        last = gd.segments[-1]
        assert log[-1][0] == "wait_event" and log[-1][1] is fake.defaults[last.device] and log[-1][2] is last.done
        s_ref.pos += 1
        s_split.pos += 1
        tok = want[:, -1].argmax(-1, keepdim=True)
    assert gd.captures == 1
