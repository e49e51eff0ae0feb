"""Streamed bf16 / orig reference runs (one dense weight at a time) and their on-disk cache
(issue 19, 2b). The model is the embedded NVFP4 export; ``orig`` reads the embedded BF16
checkpoint (the weights it was exported from) through ``Originals.from_checkpoint``."""
from __future__ import annotations

import json
import os
import shutil
import weakref

import pytest
import torch

import dsv4lab
from dsv4lab.bugzoo import inject
from dsv4lab.analysis.hooks import hooks
from dsv4lab.checkpoint.identity import checkpoint_identity
from dsv4lab.checkpoint.locate import TINY_DIR
from dsv4lab.model.moe import Experts
from dsv4lab.precision import Originals, precision_state, using_precision
from dsv4lab.precision import reference_cache
from dsv4lab.precision.reference_cache import cached_reference_run, reference_key
from dsv4lab.precision.streaming import choose_streaming, dequantize_rows, largest_dense_bytes, streaming_precision
from dsv4lab.precision.sweep import evaluate, reference_run
from dsv4lab.quant.weights import FP8BlockWeight, MXFP4Weight, quantize_nvfp4
from dsv4lab.triage import ablation as AB
from dsv4lab.triage.session import open_session

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def model():
    return dsv4lab.load("tiny-nvfp4", progress=False)


@pytest.fixture(scope="module")
def originals(model):
    return Originals.from_checkpoint(TINY_DIR, model.dtype)


def prompt(seed: int = 0, n: int = 20) -> torch.Tensor:
    return torch.randint(0, 400, (1, n), generator=torch.Generator().manual_seed(seed))


def same_run(a, b) -> bool:
    if not torch.equal(a.logits, b.logits) or set(a.cache) != set(b.cache) or a.cache.order != b.cache.order:
        return False
    return all(len(a.cache.all(k)) == len(b.cache.all(k)) and
               all(torch.equal(x, y) for x, y in zip(a.cache.all(k), b.cache.all(k))) for k in a.cache)


def snapshot(model) -> dict:
    """Everything the precision machinery may touch, compared bit for bit."""
    lin = {}
    for name, ql in model.qlinears():
        w = ql.qweight.tensors() if ql.qweight is not None else {"weight": ql.weight}
        lin[name] = (ql.mode, ql.act_scale, ql.weight_source, id(ql.qweight), ql.memory_bytes(),
                     {k: v.clone() for k, v in w.items()})
    ex = {n: (m.gather_in_decode, m.kernel) for n, m in model.named_modules() if isinstance(m, Experts)}
    return {"linears": lin, "experts": ex, "policy": model.__dict__.get("precision_policy")}


def assert_same_snapshot(a: dict, b: dict) -> None:
    assert a["experts"] == b["experts"] and a["policy"] == b["policy"]
    assert a["linears"].keys() == b["linears"].keys()
    for name, x in a["linears"].items():
        y = b["linears"][name]
        assert x[:5] == y[:5], name
        assert x[5].keys() == y[5].keys() and all(torch.equal(x[5][k], y[5][k]) for k in x[5]), name


# ------------------------------------------------------------------------------ streamed = dense
@pytest.mark.parametrize("policy", ["bf16", "orig", {"default": "w4a4", "head": "orig", "router": "bf16"},
                                    {"default": "bf16", "round_trips": ["kv_fp8", "probs_bf16"]}])
def test_streamed_run_is_bitwise_the_dense_run(model, originals, policy):
    ids = prompt()
    dense = reference_run(model, ids, policy, originals, streaming=False)
    streamed = reference_run(model, ids, policy, originals, streaming=True)
    assert not dense.streamed and streamed.streamed and streamed.how.startswith("streamed")
    assert len(dense.cache) > 0 and same_run(dense, streamed)
    plain = reference_run(model, ids, {"default": "bf16"}, originals, streaming=True)
    if isinstance(policy, dict) and "round_trips" in policy:   # the official round trips stream with it
        assert not same_run(plain, streamed)


def test_sweep_trials_stream_too(model, originals):
    """A sweep's trial under a policy with a big kind in orig (experts: ~3 TB on V4-Pro) streams
    and measures the same KL and the same weight memory as the dense trial."""
    ids = prompt()
    ref = reference_run(model, ids, "bf16", streaming=True)
    pol = {"default": "w4a4", "experts": "orig", "head": "bf16"}
    a = evaluate(model, ids, pol, ref, originals, streaming=False)
    b = evaluate(model, ids, pol, ref, originals, streaming=True)
    assert a.result.kl_mean > 0 and a.result.kl_per_pos == b.result.kl_per_pos
    assert a.result.layer_cos == b.result.layer_cos and a.bytes_after == b.bytes_after


@pytest.mark.parametrize("policy", ["bf16", "orig"])
def test_bug_zoo_linear_runs_the_same_streamed(model, originals, policy):
    """A linear with a replaced dense_weight (weight_scale_2 dropped) is not streamed through a
    source it would ignore: bf16 runs the bug per call, orig swaps it for real, as the dense run."""
    h = inject(model, "weight_scale_2_dropped", layers=[1])
    try:
        ids = prompt()
        dense = reference_run(model, ids, policy, originals, streaming=False)
        with streaming_precision(model, policy, originals) as report:
            pass
        streamed = reference_run(model, ids, policy, originals, streaming=True)
        assert same_run(dense, streamed)
        assert bool(report["swapped"]) == (policy == "orig") and all(".1." in n for n in report["swapped"])
        assert not set(report["swapped"]) & set(report["streamed_names"])
    finally:
        h.restore()


def test_orig_reads_the_original_checkpoint(model, originals):
    """orig is not bf16 under another name: the BF16 checkpoint's weights give other logits; the
    run read every non-expert linear from it, and of the routed experts only those it hit."""
    ids = prompt()
    src = Originals.from_checkpoint(TINY_DIR, model.dtype)
    orig = reference_run(model, ids, "orig", src, streaming=True)
    bf16 = reference_run(model, ids, "bf16", streaming=True)
    assert not torch.equal(orig.logits, bf16.logits)
    quantised = {n for n, ql in model.qlinears() if ql.quantized}
    assert {n for n in quantised if ".experts." not in n} <= set(src.reads) <= quantised


def test_orig_without_originals_says_so_before_changing_anything(model):
    before = snapshot(model)
    with pytest.raises(ValueError, match="needs originals="):
        with streaming_precision(model, "orig"):
            pass
    assert_same_snapshot(before, snapshot(model))


# ------------------------------------------------------------------------------ one dense weight at a time
class DenseCounter:
    """Every dense weight a source hands out is tracked by a weak reference; ``peak`` is the most
    alive at once, seen at every source call and every module entry / hook point."""

    def __init__(self, model) -> None:
        self.refs: list = []
        self.peak = 0
        self.called: set = set()
        self.holding_peak = 0   # QLinears holding more weight memory than they did before the run
        self.model = model
        self.base = {name: ql.memory_bytes() for name, ql in model.qlinears()}
        self.base_quantized = {name for name, ql in model.qlinears() if ql.quantized}

    def alive(self) -> int:
        return sum(r() is not None for r in self.refs)

    def look(self, *_) -> None:
        self.peak = max(self.peak, self.alive())
        holding = sum(ql.memory_bytes() > self.base[n] or ql.qweight is None and n in self.base_quantized
                      for n, ql in self.model.qlinears())
        self.holding_peak = max(self.holding_peak, holding)

    def wrap(self, name, source):
        def dense(dtype):
            self.look()
            w = source(dtype)
            self.called.add(name)
            self.refs.append(weakref.ref(w))
            self.look()
            return w
        return dense


def count_dense(model, ids, run) -> DenseCounter:
    c = DenseCounter(model)
    handles = [m.register_forward_pre_hook(lambda mod, args: c.look()) for m in model.modules()]
    try:
        with torch.no_grad(), hooks(model, [("**", lambda t, name: c.look())]):
            run(c)
    finally:
        for h in handles:
            h.remove()
    return c


@pytest.mark.parametrize("policy", ["bf16", "orig"])
def test_at_most_one_dense_weight_alive(model, originals, policy):
    ids = prompt()

    def streamed(c):
        with streaming_precision(model, policy, originals) as report:
            for name, ql in model.qlinears():
                if ql.weight_source is not None:
                    ql.weight_source = c.wrap(name, ql.weight_source)
            model(ids)
        c.report = report

    c = count_dense(model, ids, streamed)
    # every path went through its source: attention (wo_a grouped too), compressor, indexer,
    # router, shared expert, head, and the routed experts the prompt hit
    streamed = set(c.report["streamed_names"])
    assert {n for n in streamed if ".mlp.experts." not in n} <= c.called <= streamed
    assert {"head", "layers.0.mlp.router", "layers.0.attn.wo_a", "layers.0.mlp.shared_expert.w2"} <= c.called
    assert any(".compressor." in n for n in c.called) and any(".indexer." in n for n in c.called)
    assert any(".mlp.experts." in n for n in c.called)
    assert c.peak == 1 and c.holding_peak == 0
    assert c.report["peak_bytes"] == max(ql.out_features * ql.in_features * 4
                                         for _, ql in model.qlinears() if ql.quantized)

    def dense(c):   # the instrument can fail: the non-streamed run holds every dense weight
        with using_precision(model, policy, originals):
            model(ids)

    assert count_dense(model, ids, dense).holding_peak > 100


# ------------------------------------------------------------------------------ restore
@pytest.mark.parametrize("policy", ["bf16", "orig"])
def test_restored_bit_exactly_also_after_an_exception(model, originals, policy):
    before = snapshot(model)
    with streaming_precision(model, policy, originals):
        model(prompt())
    assert_same_snapshot(before, snapshot(model))

    def boom(t, name):
        raise RuntimeError("mid-forward")

    with pytest.raises(RuntimeError, match="mid-forward"):
        with streaming_precision(model, policy, originals), hooks(model, [("layers.1.hook_resid_post", boom)]):
            model(prompt())
    assert_same_snapshot(before, snapshot(model))


def test_nested_in_an_orig_swap_puts_the_swap_back(model, originals):
    ids = prompt()
    with using_precision(model, "orig", originals):
        outer = precision_state(model)
        ref = model(ids)
        with streaming_precision(model, "w4a16"):   # w4a16 inside: the swapped weights go back meanwhile
            assert all(ql.weight_source is None for _, ql in model.qlinears())
        with streaming_precision(model, "bf16"):
            model(ids)
        assert precision_state(model) == outer
        assert torch.equal(model(ids), ref)


def test_experts_take_the_per_expert_loop_while_streamed(model):
    ex = [m for m in model.modules() if isinstance(m, Experts)]
    ex[0].gather_in_decode, sentinel = True, object()
    ex[0].kernel = sentinel
    try:
        with streaming_precision(model, {"default": "w4a16", "experts": "bf16"}):
            assert all(not m.gather_in_decode and m.kernel is None for m in ex)
        assert ex[0].gather_in_decode and ex[0].kernel is sentinel
    finally:
        ex[0].kernel, ex[0].gather_in_decode = None, False


# ------------------------------------------------------------------------------ when to stream
def test_auto_streams_when_dense_weights_do_not_fit(model):
    assert choose_streaming(model, "bf16", "auto", free=0)[0] is True
    assert choose_streaming(model, "bf16", "auto", free=1 << 40)[0] is False
    assert choose_streaming(model, "w4a16", "auto", free=0)[0] is False      # nothing goes dense
    run = reference_run(model, prompt(), "bf16", streaming="auto", free={"cpu": 1024})
    assert run.streamed and "auto" in run.how
    with pytest.raises(ValueError, match="streaming='yes'"):
        choose_streaming(model, "bf16", "yes")
    assert largest_dense_bytes(model, "bf16") == max(ql.out_features * ql.in_features * 4
                                                     for _, ql in model.qlinears() if ql.quantized)


def test_dequantize_rows_is_bitwise_dequantize():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(300, 256, generator=g)
    nv = quantize_nvfp4(w)
    mx = MXFP4Weight(torch.randint(0, 256, (300, 128), dtype=torch.uint8, generator=g),
                     torch.randint(110, 135, (300, 8), dtype=torch.uint8, generator=g))
    fp8 = FP8BlockWeight(w.to(torch.float8_e4m3fn), torch.rand(3, 2, generator=g) + 0.5)
    for qw in (nv, mx, fp8):
        for dt in (torch.float32, torch.bfloat16):
            assert torch.equal(dequantize_rows(qw, dt, rows=128), qw.dequantize(dt)), qw.format


# ------------------------------------------------------------------------------ the cache
def test_cache_hit_does_not_run_the_model(model, originals, tmp_path, monkeypatch):
    ids = prompt(1)
    first = cached_reference_run(model, ids, "orig", originals, cache=tmp_path)
    assert "cached as" in first.how and len(list((tmp_path / "reference_runs").glob("*.safetensors"))) == 1

    def no_forward(*a, **k):
        raise AssertionError("the model ran on a cache hit")

    monkeypatch.setattr(model, "forward", no_forward)
    again = cached_reference_run(model, ids, "orig", originals, cache=tmp_path)
    assert again.how.startswith("cache hit") and same_run(first, again)
    assert again.streamed == first.streamed


def test_cache_keys_differ_by_prompt_policy_checkpoint(model, originals, tmp_path, monkeypatch):
    def k(m, ids, pol, orig=None, names=("layers.*.hook_resid_post",)):
        return reference_key(m, ids, pol, orig, names)[0]

    base = k(model, prompt(0), "bf16")
    assert base == k(model, prompt(0), "bf16")
    assert base == k(model, prompt(0), "bf16", originals)          # bf16 does not read the originals
    assert base != k(model, prompt(1), "bf16")
    assert base != k(model, prompt(0), "orig", originals)
    assert base != k(model, prompt(0), {"default": "bf16", "head": "w4a4"})
    assert base != k(model, prompt(0), "bf16", names=("layers.*.mlp.router.hook_ids",))
    with monkeypatch.context() as mp:                              # a change to the model code
        mp.setattr(reference_cache, "code_digest", lambda: "edited")
        assert base != k(model, prompt(0), "bf16")
    plain = dsv4lab.load("tiny", progress=False)
    assert base != k(plain, prompt(0), "bf16")
    # the reference checkpoint is part of an orig key: a copy elsewhere, then a rewritten shard
    copy = tmp_path / "ref"
    shutil.copytree(TINY_DIR, copy, ignore=shutil.ignore_patterns("nvfp4", "train_logs"))
    other = Originals.from_checkpoint(copy, model.dtype)
    assert k(model, prompt(0), "orig", originals) != k(model, prompt(0), "orig", other)
    ident = checkpoint_identity(copy)
    assert checkpoint_identity(copy) == ident
    shard = copy / "model.safetensors"
    st = shard.stat()
    os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    assert checkpoint_identity(copy) != ident


def test_corrupted_entry_is_recomputed(model, tmp_path):
    ids = prompt(2)
    first = cached_reference_run(model, ids, "bf16", cache=tmp_path)
    f = next((tmp_path / "reference_runs").glob("*.safetensors"))
    data = bytearray(f.read_bytes())
    data[-5] ^= 0xFF                                   # one flipped bit of a logit
    f.write_bytes(bytes(data))
    with pytest.warns(UserWarning, match="digest"):
        again = cached_reference_run(model, ids, "bf16", cache=tmp_path)
    assert "recomputed" in again.how and same_run(first, again)
    m = next((tmp_path / "reference_runs").glob("*.json"))
    m.write_text(m.read_text()[:40])                   # a truncated manifest
    with pytest.warns(UserWarning, match="unreadable"):
        third = cached_reference_run(model, ids, "bf16", cache=tmp_path)
    assert "recomputed" in third.how and same_run(first, third)
    assert json.loads(m.read_text())["key"]            # rewritten whole
    assert cached_reference_run(model, ids, "bf16", cache=tmp_path).how.startswith("cache hit")


def test_in_memory_model_is_not_cached(model, tmp_path):
    from dsv4lab.triage.session import random_tiny
    m = random_tiny()
    run = cached_reference_run(m, prompt(3), "bf16", cache=tmp_path)
    assert "not cached: in-memory model" in run.how
    assert not (tmp_path / "reference_runs").exists() or not any((tmp_path / "reference_runs").iterdir())


def test_ablation_setup_reads_the_cache(tmp_path, monkeypatch):
    """Notebook 3's flow: the second setup on the same session and prompt runs no reference."""
    session = open_session("tiny-nvfp4", reference=TINY_DIR)
    ids = prompt(4)
    first = AB.make_setup(session, ids, cache=tmp_path).reference_run()
    assert "cached as" in first.how and AB.make_setup(session, ids, cache=tmp_path).reference_policy == "orig"
    monkeypatch.setattr(session.model, "forward", lambda *a, **k: (_ for _ in ()).throw(AssertionError("ran")))
    again = AB.make_setup(session, ids, cache=tmp_path).reference_run()
    assert again.how.startswith("cache hit") and same_run(first, again)


# ------------------------------------------------------------------------------ on the GPU
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (run on the device machine)")


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("policy", ["bf16", "orig"])
def test_streamed_peak_on_gpu(policy):
    """On CUDA (where allocation is measured exactly): streamed == dense bitwise; the streamed
    run's peak is at most the w4a16 run's (which dequantises every call whole) plus the largest
    dense weight, while the dense run holds at least half of all dense weights more."""
    m = dsv4lab.load("tiny-nvfp4", device="cuda", progress=False, kernels=False)
    src = Originals.from_checkpoint(TINY_DIR, m.dtype)
    ids = prompt(n=64).cuda()

    def peak(fn):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        out = fn()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base, out

    floor, _ = peak(lambda: reference_run(m, ids, "w4a16", streaming=False))
    streamed_peak, streamed = peak(lambda: reference_run(m, ids, policy, src, streaming=True))
    dense_peak, dense = peak(lambda: reference_run(m, ids, policy, src, streaming=False))
    assert same_run(dense, streamed)
    assert streamed_peak <= floor + largest_dense_bytes(m, policy)
    from dsv4lab.precision.streaming import dense_bytes
    assert dense_peak >= streamed_peak + sum(dense_bytes(m, policy).values()) // 2


@pytest.mark.gpu
@cuda
def test_streamed_run_refuses_graph_capture():
    """A streamed linear builds its weight inside the call: under a CUDA graph capture it raises
    (the whole model's prefill is not capturable anyway, so the linear is captured alone)."""
    m = dsv4lab.load("tiny-nvfp4", device="cuda", progress=False, kernels=False)
    ql = m.layers[0].attn.wq_a
    x = torch.randn(1, 1, ql.in_features, device="cuda", dtype=m.dtype)
    with streaming_precision(m, "bf16"):
        ql(x)   # warm up outside the capture
        g = torch.cuda.CUDAGraph()
        with pytest.raises(RuntimeError) as err:
            with torch.cuda.graph(g):
                ql(x)
        # ending the aborted capture may raise CUDA's own error; ours is then its context
        chain = [err.value, err.value.__context__]
        assert any(e is not None and "captured in a CUDA graph" in str(e) for e in chain), chain
