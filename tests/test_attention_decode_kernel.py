"""The decode attention kernel (dsv4lab/kernels/attention_decode.py) and the indexer's decode scores
(dsv4lab/kernels/indexer_decode.py) against their references ``dsv4lab.model.decode_attention.
decode_attention`` / ``dsv4lab.model.indexer.index_scores_decode``, and the ``decode_kernel`` slots
of ``Attention`` and ``Indexer``.

CPU: the kernels through Triton's interpreter in a subprocess (tests/attention_decode_interp_check.py:
pos < window, pos > window with the ring wrapped, no entry closed yet, HCA all entries, CSA selected
with -1s (scattered, and all -1), one and three splits; indexer scores with 0 / some / all entries
valid; the output's inverse RoPE in the combine: the bits of norm_rope's launch, with the row's x_pairs
emitted at one batch row; q taken raw and normalised + rotated in the split programs), and the slots in a tiny model (reference-equal callables: bitwise the reference; hooks,
``probs_bf16`` and replaced math force the reference; install / uninstall through ``use_kernels``).
GPU (@pytest.mark.gpu): V4-Pro shapes (128 heads x 512, window 128, CSA top-k 1024 of 64 x 128
index heads, HCA ratio 128) at batch 1 and 4, and CUDA-graph replay bitwise equal to eager.

Tolerances: attention fp32 |kernel - ref| <= 1e-5 * max(1, max|ref|) (online softmax, another
order); bf16 <= 2e-2 * max|ref| (the reference rounds logits and probabilities to bf16, the kernel
keeps them fp32 and rounds P to bf16 per tile against its running maximum; interpreter: at most
1 bf16 ulp of the output, 4.9e-3 * max|ref|). Indexer scores (fp32 sums of exact products in
another order) <= 1e-5 * max(1, max|ref|); the -inf pattern and the selected set are exact.
"""
from __future__ import annotations


import pytest
import torch

from dsv4lab.kernels import install as install_mod
from dsv4lab.kernels.device import triton_importable
from dsv4lab.kernels.install import install_kernels
from dsv4lab.model.attention import Attention
from dsv4lab.model.compressor import Compressor
from dsv4lab.model.decode_attention import decode_attention
from dsv4lab.model.indexer import Indexer, index_scores_decode
from dsv4lab.model.linear import QLinear
from dsv4lab.model.moe import Experts, Router, SharedExpert
from dsv4lab.quant.modes import RoundTrip
from dsv4lab.workbench import random_model
from oracle_util import decode_logits as _decode_logits, interp_check_result, random_ids, tiny_config

def test_interp_decode_kernels_match_reference():
    assert triton_importable(), "triton is part of the test set-up (pip install -e '.[kernels]')"
    res = interp_check_result("attention_decode_interp_check.py")
    assert len(res) == 38
    for case, v in res.items():
        if case.startswith("index_qrope"):  # the indexer's q RoPE in the scores kernel: the two launches' bits
            assert v == {"equal": True}, (case, v)
        elif case.startswith("unrope"):  # the inverse RoPE in the combine: the two launches' bits, and the pairs
            want = {"equal": True} | ({"pairs_skipped": True, "pairs_equal": True} if "_b1_" in case else {})
            assert v == want, (case, v)
        elif case.startswith("index"):
            assert v["same_inf"] and v["same_set"], (case, v)
            assert v["max_abs"] <= 1e-5 * max(1.0, v["ref_max"]), (case, v)
        else:
            tol = 1e-5 * max(1.0, v["ref_max"]) if "float32" in case else 2e-2 * v["ref_max"]
            assert v["max_abs"] <= tol, (case, v)


# ----------------------------------------------------------------------------- slots in a model
@pytest.fixture(scope="module")
def tiny():
    cfg = tiny_config()
    return random_model(cfg, seed=3), random_ids(cfg, n=30, b=2)  # 24 prompt tokens: window 8 wrapped, entries closed


def _counting(fn, calls, key):
    def wrapped(*args):
        calls[key] = calls.get(key, 0) + 1
        return fn(*args)
    return wrapped


def test_decode_kernel_slots_run_and_equal_the_reference(tiny):
    """Reference-equal callables in ``Attention.decode_kernel`` / ``Indexer.decode_kernel`` give the
    reference logits bitwise, called once per layer per step; a listening ``hook_probs`` (that
    layer), an indexer hook, ``probs_bf16`` or a replaced ``_attend`` keep the reference."""
    m, ids = tiny
    attns = [a for a in m.modules() if isinstance(a, Attention)]
    idxs = [i for i in m.modules() if isinstance(i, Indexer)]
    ref = _decode_logits(m, ids)
    calls: dict = {}
    try:
        for i, a in enumerate(attns):
            a.decode_kernel = _counting(decode_attention, calls, f"attn{i}")
        for i, ix in enumerate(idxs):
            ix.decode_kernel = _counting(index_scores_decode, calls, f"index{i}")
        assert torch.equal(_decode_logits(m, ids), ref)
        assert calls == {**{f"attn{i}": 6 for i in range(len(attns))}, **{f"index{i}": 6 for i in range(len(idxs))}}

        calls.clear()
        seen = []
        h1 = m.layers[1].attn.hook_probs.register_forward_hook(lambda mod, inp, out: seen.append(out.shape))
        h2 = m.layers[3].attn.indexer.hook_scores.register_forward_hook(lambda mod, inp, out: None)
        try:
            assert torch.equal(_decode_logits(m, ids), ref)
        finally:
            h1.remove()
            h2.remove()
        assert "attn1" not in calls and calls["attn0"] == 6 and seen  # prefill + decode firings
        assert calls.get("index1", 0) == 0 and calls["index0"] == 6

        calls.clear()
        m.layers[2].attn.round_trips = frozenset({RoundTrip.PROBS_BF16})
        _decode_logits(m, ids)
        assert "attn2" not in calls and calls["attn3"] == 6
        assert not m.layers[2].attn.decode_takes_kernel()
    finally:
        m.layers[2].attn.round_trips = frozenset()
        for mod in attns + idxs:
            mod.decode_kernel = None


def test_indexer_decode_kernel_rotates_raw_queries(tiny):
    """An ``Indexer.decode_kernel`` declaring the indexer's ``rope_kernel`` (``ropes_q_with``) is handed
    wq_b's raw q with ``positions`` / ``inv_freq`` and no RoPE launch runs for it at decode: the same
    logits (CPU references: bitwise); ``indexer_fp4`` (after the RoPE) or an undeclared kernel keep
    the RoPE launch."""
    from dsv4lab.kernels.dispatch import index_scores_decode as scores_entry
    from dsv4lab.kernels.dispatch import norm_rope

    m, ids = tiny
    idxs = [i for i in m.modules() if isinstance(i, Indexer)]
    ref = _decode_logits(m, ids)
    kwargs, ropes = [], []

    def scores(*a, **k):
        kwargs.append(sorted(k))
        return scores_entry(*a, **k)

    def rope(*a, **k):
        ropes.append(a[0].shape[1])
        return norm_rope(*a, **k)

    scores.ropes_q_with = rope
    try:
        for ix in idxs:
            ix.decode_kernel, ix.rope_kernel = scores, rope
        assert torch.equal(_decode_logits(m, ids), ref)
        assert kwargs == [["inv_freq", "positions"]] * (6 * len(idxs))
        assert ropes == [24] * len(idxs)                    # the prefill's queries only
        assert idxs[0]._decode_ropes_q()
        idxs[0].round_trips = frozenset({RoundTrip.INDEXER_FP4})  # its round trip comes after the RoPE
        assert not idxs[0]._decode_ropes_q()
        idxs[0].round_trips = frozenset()
        scores.ropes_q_with = None
        kwargs.clear()
        ropes.clear()
        assert torch.equal(_decode_logits(m, ids), ref) and kwargs == [[]] * (6 * len(idxs))
        assert ropes.count(1) == 6 * len(idxs)               # each decode step's RoPE launch is back
    finally:
        for ix in idxs:
            ix.round_trips = frozenset()
            ix.decode_kernel = ix.rope_kernel = None


def test_replaced_attention_math_keeps_the_reference():
    """A bug-zoo-style subclass that replaces ``_attend`` (or the indexer's ``scores``) never runs the
    decode kernel, so the variant's math is what decode computes."""
    cfg = tiny_config()

    class SinkX2(Attention):
        def _attend(self, q, keys, bias):
            return super()._attend(q, keys, bias)

    class Scores(Indexer):
        def scores(self, x, q_res, positions, keys):
            return super().scores(x, q_res, positions, keys)

    a = SinkX2(cfg, 1)
    a.decode_kernel = decode_attention
    assert not a.decode_takes_kernel()
    ix = Scores(cfg, 4)
    ix.decode_kernel = index_scores_decode
    assert not ix.decode_takes_kernel()
    ix2 = Indexer(cfg, 4)
    ix2.decode_kernel = index_scores_decode
    assert ix2.decode_takes_kernel()
    with ix2.hook_q.register_forward_hook(lambda *a: None):
        assert not ix2.decode_takes_kernel()


def _plain_linears(mod) -> int:
    """Unquantised QLinears other than routers (those count once as routers): each takes ``plain_kernel``."""
    return sum(isinstance(q, QLinear) and q.qweight is None and not isinstance(q, Router) for q in mod.modules())


def test_use_kernels_installs_and_removes_the_decode_slots(tiny, monkeypatch):
    """With triton "on CUDA" (patched: the dispatchers still take the reference on CPU tensors),
    ``use_kernels`` puts ``decode_attention`` / ``index_scores_decode`` in the slots of the matching
    layers, ``components()`` shows them, the logits stay the reference's, and disabling clears them."""
    from dsv4lab.kernels.dispatch import decode_attention as dispatch_decode, index_scores_decode as dispatch_scores

    m, ids = tiny
    ref = _decode_logits(m, ids)
    monkeypatch.setattr(install_mod, "have_triton_cuda", lambda: True)
    monkeypatch.setattr(install_mod, "_on_cuda", lambda t: t is not None)
    monkeypatch.setattr(install_mod.pool_cute, "have_cute", lambda: False)
    try:
        # attn (prefill + decode + glue slots), its indexer, their two compressors, the router, the two mHC
        # sites, the two layer norms, the plain routed experts (``moe_decode``), the shared expert (pair +
        # SwiGLU) and every other unquantised linear (``plain_kernel``)
        assert m.use_kernels("layers.1") == 10 + (m.layers[1].mlp.shared_expert is not None) + _plain_linears(m.layers[1])
        attn, ix = m.layers[1].attn, m.layers[1].attn.indexer
        assert attn.decode_kernel is dispatch_decode and ix.decode_kernel is dispatch_scores
        assert m.layers[3].attn.decode_kernel is None
        impl = m.components().set_index("name").impl
        assert impl["layers.1.attn"] == "kernel:prefill_attention+decode_attention"
        assert impl["layers.1.attn.indexer"] == "kernel:index_scores_decode"
        assert torch.equal(_decode_logits(m, ids), ref)
        # every attention, indexer, compressor and router; two mHC sites and two norms per layer, the head's
        # mHC and the final norm
        n = (sum(isinstance(mod, (Attention, Indexer, Compressor, Router, Experts, SharedExpert)) for mod in m.modules())
             + 4 * len(m.layers) + 2 + _plain_linears(m))
        assert install_kernels(m) == n
    finally:
        assert m.use_kernels(enable=False) == n
    assert all(getattr(mod, "decode_kernel", None) is None for mod in m.modules())


# ----------------------------------------------------------------------------- GPU: V4-Pro shapes
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _v4_pro_case(kind: str, B: int, pos: int, g: torch.Generator, max_len: int = 65536):
    dev = torch.device("cuda")
    H, D, W = 128, 512, 128
    q = torch.randn(B, 1, H, D, device=dev, generator=g).bfloat16()
    ring = torch.randn(B, W, D, device=dev, generator=g).bfloat16()
    sink = torch.randn(H, device=dev, generator=g)
    ratio = {"sliding": 0, "hca": 128, "csa": 4}[kind]
    ent = n_ent = sel = None
    if ratio:
        T = max_len // ratio
        ent = torch.randn(B, T, D, device=dev, generator=g).bfloat16()
        n_ent = torch.tensor((pos + 1) // ratio, device=dev)
    if kind == "csa":
        sc = torch.randn(B, 1, T, device=dev, generator=g).masked_fill(torch.arange(T, device=dev) >= n_ent, float("-inf"))
        top = sc.topk(1024, dim=-1).indices
        sel = torch.where(top < n_ent, top, torch.full_like(top, -1))
    return q, sink, D ** -0.5, ring, torch.tensor(pos, device=dev), ent, n_ent, sel


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("B", [1, 4])
@pytest.mark.parametrize("kind,pos", [("sliding", 77), ("sliding", 5000), ("hca", 5000), ("hca", 60000),
                                      ("csa", 2000), ("csa", 40000)])
def test_gpu_decode_attention_v4_pro_shapes(kind, pos, B):
    from dsv4lab.kernels.attention_decode import decode_attention_triton

    g = torch.Generator(device="cuda").manual_seed(0)
    args = _v4_pro_case(kind, B, pos, g)
    want = decode_attention(*args).float()
    got = decode_attention_triton(*args).float()
    assert (got - want).abs().max().item() <= 2e-2 * want.abs().max().item()
    one = decode_attention_triton(*args, splits=1).float()  # the one-launch path
    assert (one - want).abs().max().item() <= 2e-2 * want.abs().max().item()
    # CUDA graph replay == eager, bitwise (device-side pos, fixed grid)
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        decode_attention_triton(*args)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=s):
            static = decode_attention_triton(*args)
    torch.cuda.current_stream().wait_stream(s)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(static.float(), got)
    # the output's inverse RoPE folded into the combine: the bits of norm_rope's launch after it
    from dsv4lab.kernels.norm_rope import NORM_NONE, launch_norm_rope
    inv = (1.0 / (160000.0 ** (torch.arange(0, 64, 2, dtype=torch.float) / 64))).cuda()
    plain = decode_attention_triton(*args)
    want_rot = launch_norm_rope(plain, plain.dtype, norm=NORM_NONE, positions=args[4].view(1), inv_freq=inv,
                                inverse=True, inplace=True)
    assert torch.equal(decode_attention_triton(*args, inv_freq=inv), want_rot)
    # ... and q taken raw (q_eps=): normalised + rotated in the split programs, within the attention's
    # bf16 tolerance of the separate launch's q (its sum of squares runs in another order)
    from dsv4lab.kernels.norm_rope import NORM_PLAIN
    raw = args[0] * 3
    roped = launch_norm_rope(raw, raw.dtype, norm=NORM_PLAIN, eps=1e-6, positions=args[4].view(1), inv_freq=inv)
    want_q = decode_attention_triton(roped, *args[1:], inv_freq=inv).float()
    got_q = decode_attention_triton(raw, *args[1:], inv_freq=inv, q_eps=1e-6).float()
    assert (got_q - want_q).abs().max().item() <= 2e-2 * want_q.abs().max().item()
    assert torch.equal(decode_attention_triton(raw, *args[1:], inv_freq=inv, q_eps=1e-6).float(), got_q)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("B", [1, 4])
@pytest.mark.parametrize("n_valid", [700, 16383])
def test_gpu_index_scores_v4_pro_shapes(B, n_valid):
    from dsv4lab.kernels.indexer_decode import index_scores_decode_triton

    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(1)
    Hi, Ih, T, k = 64, 128, 65536 // 4, 1024
    q = torch.randn(B, 1, Hi, Ih, device=dev, generator=g).bfloat16()
    w_raw = torch.randn(B, 1, Hi, device=dev, generator=g).bfloat16()
    keys = torch.randn(B, T, Ih, device=dev, generator=g).bfloat16()
    nv = torch.tensor(n_valid, device=dev)
    want = index_scores_decode(q, w_raw, keys, nv, Hi ** -0.5)
    got = index_scores_decode_triton(q, w_raw, keys, nv, Hi ** -0.5)
    fin = torch.isfinite(want)
    assert torch.equal(fin, torch.isfinite(got))
    assert (got[fin] - want[fin]).abs().max().item() <= 1e-5 * max(1.0, want[fin].abs().max().item())
    ix = Indexer(tiny_config(index_topk=k), 4).to(dev)
    ref_sel = ix.select(want, nv.view(1)).sort(-1).values
    got_sel = ix.select(got, nv.view(1)).sort(-1).values
    assert torch.equal(got_sel, ref_sel)
    # q taken raw and rotated in the kernel (V4-Pro's indexer: rope 64 of 128): within the scores'
    # tolerance of the separate RoPE launch + scores (this variant runs without FMA contraction)
    from dsv4lab.kernels.norm_rope import NORM_NONE, launch_norm_rope
    inv = (1.0 / (160000.0 ** (torch.arange(0, 64, 2, dtype=torch.float) / 64))).to(dev)
    p1 = torch.tensor([n_valid * 4 + 3], device=dev)
    sep = index_scores_decode_triton(launch_norm_rope(q, q.dtype, norm=NORM_NONE, positions=p1, inv_freq=inv),
                                     w_raw, keys, nv, Hi ** -0.5)
    fold = index_scores_decode_triton(q, w_raw, keys, nv, Hi ** -0.5, positions=p1, inv_freq=inv)
    assert torch.equal(torch.isfinite(fold), torch.isfinite(sep))
    assert (fold[fin] - sep[fin]).abs().max().item() <= 1e-5 * max(1.0, sep[fin].abs().max().item())
