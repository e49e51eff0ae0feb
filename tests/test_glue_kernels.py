"""The decode glue kernels: ``Attention.norm_kernel`` / ``rope_kernel`` (q_norm; per-head norm +
RoPE of q; kv_norm + RoPE + kv_fp8; inverse RoPE of the output: dsv4lab/kernels/norm_rope.py) and
``Router.route_kernel`` (scores + top-k / hash + weights: dsv4lab/kernels/router_topk.py).

CPU: the kernels through Triton's interpreter in a subprocess (tests/glue_interp_check.py), and the
slots at model level with the dispatch entry points installed (on CPU they are the references, so
the model must equal itself bit for bit), hooks forcing the reference, install/uninstall.
GPU (@pytest.mark.gpu): V4-Pro shapes, CUDA-graph replay bitwise equal to eager.

Tolerances: norm/RoPE |y - ref| <= u|ref| + 2u max|ref|, u = 2^-7 in bf16 (one ulp of the value,
two of the largest: the norm's fp32 sum runs in another order), 1e-6 in fp32; kv_fp8 channels one
e4m3 step (u = 2^-3); the kv_fp8 round trip alone and unnormalised RoPE at position 0 bit-exact.
Router: ids exactly the reference's (sets on CPU, where torch.topk's order is arbitrary; sets and
order on the GPU), weights within 1e-6 of max|w| (fp32 sums in another order).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dsv4lab.analysis.components import components
from dsv4lab.decode.graphs import model_signature
from dsv4lab.kernels.device import triton_importable
from dsv4lab.kernels import dispatch
from dsv4lab.kernels.dispatch import norm_rope, plain_linear, rms_norm, route
from dsv4lab.kernels.install import install_kernels
from dsv4lab.model.attention import Attention
from dsv4lab.model.moe import Router
from dsv4lab.quant.modes import RoundTrip
from dsv4lab.workbench import random_model
from oracle_util import decode_logits, graph_equals_eager, random_ids, tiny_config
from test_kernels_model import Counting
from test_kernels_model import _prefill_decode as _run

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.usefixtures("one_thread")


def test_interp_glue_kernels_match_reference():
    assert triton_importable(), "triton is part of the test set-up (pip install -e '.[kernels]')"
    r = subprocess.run([sys.executable, str(ROOT / "tests" / "glue_interp_check.py")], cwd=ROOT,
                       capture_output=True, text=True, timeout=600,
                       env={**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)})
    assert r.returncode == 0, r.stderr[-4000:]
    res = json.loads([ln for ln in r.stdout.splitlines() if ln.startswith("RESULT")][-1][len("RESULT"):])
    norm_cases = [k for k in res if "bad" in res[k]]
    assert len(norm_cases) == 15  # 2 dtypes x (q, kv, kv+fp8, fp8, unrope, unrope in place) + 3 q_norm
    for case in norm_cases:
        assert res[case]["bad"] == 0, (case, res[case])
        assert res[case].get("dtype_ok", True), case
    assert res["fp8_float32"]["exact"] and res["fp8_bfloat16"]["exact"]  # the e4m3 bit arithmetic
    for dt in ("float32", "bfloat16"):  # the in-place inverse RoPE: bitwise the copy, written into x
        assert res[f"unrope_inplace_{dt}"]["equal_out_of_place"] and res[f"unrope_inplace_{dt}"]["in_x"], dt
    for dt in ("float32", "bfloat16"):  # a decode RMSNorm's emitted pairs: x_pairs' bits, no launch for them
        assert res[f"pairs_{dt}"] == {"skipped": True, "same_buffers": True, "rows_equal": True, "inv_equal": True,
                                      "changed_relaunched": True}, dt
        assert res[f"unrope_pairs_{dt}"] == {"same_y": True, "in_x": True, "skipped": True, "rows_equal": True,
                                             "inv_equal": True}, dt
    for dt in ("float32", "bfloat16"):  # q_norm + kv norm/RoPE/ring as one launch: each half its own launch's bits
        assert res[f"norm_pair_{dt}"] == {"q_equal": True, "kv_equal": True, "ring_row": True, "others_kept": True,
                                          "pairs_skipped": True, "pairs_equal": True, "declines_two_rows": True}, dt
    for dt in ("float32", "bfloat16"):  # kv also written into the decode ring: the same bits, only its slots
        assert res[f"ring_{dt}"] == {"same_y": True, "ring_rows": True, "others_kept": True}, dt
    route_cases = [k for k in res if k.startswith(("topk_", "hash_"))]
    assert len(route_cases) == 12
    for case in route_cases:
        assert res[case]["ids_equal"] and res[case]["w_max_rel"] <= 1e-6, (case, res[case])
    assert res["ties"]["ids"] == [[1, 4, 0, 2]] * 2 and res["ties"]["w"] == [[0.25] * 4] * 2
    gate_cases = [k for k in res if k.startswith("gate_route_") and k != "gate_route_takes"]
    assert len(gate_cases) == 5 and {res[k]["split"] for k in gate_cases} == {1, 7}
    for case in gate_cases:   # one launch: bitwise plain_gemv then route_triton, its counters back at zero
        assert res[case]["ids_equal"] and res[case]["w_equal"] and res[case]["counters_zero"], (case, res[case])
    # declined: 5 tokens, an fp32 weight for bf16 x, top_k above E, an unknown scoring; taken: 4 tokens, k = E
    assert res["gate_route_takes"] == [False, False, False, False, True]


@pytest.fixture(scope="module")
def tiny():
    cfg = tiny_config()
    return random_model(cfg, seed=4), random_ids(cfg, n=28, b=2)


@pytest.mark.parametrize("kv_fp8", [False, True])
def test_decode_folds_the_glue_launches(tiny, kv_fp8):
    """At decode, q_norm + kv's norm/RoPE/ring write run as one ``norm_pair_kernel`` call (while
    ``norm_kernel`` / ``rope_kernel`` declare it: ``pairs_with``), and a ``decode_kernel`` declaring the
    rope_kernel takes wq_b's raw q (``q_eps=``) and inverse-rotates its output: no
    norm or RoPE call of its own at decode (``ropes_q_with`` / ``unropes_with``), the same logits (CPU
    references: bitwise). A listening
    ``hook_q`` puts that layer's glue back on the separate slots, the kernel handed q as rotated."""
    from dsv4lab.kernels.dispatch import decode_attention

    m, ids = tiny
    attns = [a for a in m.modules() if isinstance(a, Attention)]

    def pair_ref(a, qw, qe, kv, positions, inv, kvw, kve, fp8, ring):
        return rms_norm(a, qw, qe), norm_rope(kv, positions, inv, kve, kvw, fp8_nope=fp8, ring=ring)

    for a in attns:
        a.round_trips = frozenset({RoundTrip.KV_FP8}) if kv_fp8 else frozenset()
    try:
        ref = _run(m, ids, 20)
        pair, norm, rope, dec = Counting(pair_ref), Counting(rms_norm), Counting(norm_rope), Counting(decode_attention)
        norm.pairs_with = rope.pairs_with = pair
        dec.unropes_with = dec.ropes_q_with = rope
        for a in attns:
            a.norm_kernel, a.rope_kernel, a.norm_pair_kernel, a.decode_kernel = norm, rope, pair, dec
        assert torch.equal(_run(m, ids, 20), ref)
        decodes = ids.shape[1] - 20
        assert pair.calls == len(attns) * decodes and dec.keywords.get("q_eps") == len(attns) * decodes
        assert norm.calls == len(attns) and rope.calls == 3 * len(attns)   # the prefill call only
        pair.calls = norm.calls = rope.calls = 0
        dec.keywords.clear()
        with m.hooks([("layers.1.attn.hook_q", lambda t, n: None)]):
            assert torch.equal(_run(m, ids, 20), ref)
        assert pair.calls == (len(attns) - 1) * decodes and dec.keywords.get("q_eps") == (len(attns) - 1) * decodes
        dec.ropes_q_with = None  # declares the output's inverse RoPE only: q rotated by rope_kernel
        pair.calls = rope.calls = 0
        dec.keywords.clear()
        assert torch.equal(_run(m, ids, 20), ref)
        assert "q_eps" not in dec.keywords and dec.keywords["inv_freq"] == len(attns) * decodes
        assert rope.calls == len(attns) * (3 + decodes) and pair.calls == len(attns) * decodes
        dec.unropes_with = None  # declares neither: q and the output rotated by rope_kernel
        rope.calls = 0
        dec.keywords.clear()
        assert torch.equal(_run(m, ids, 20), ref)
        assert not dec.keywords and rope.calls == len(attns) * (3 + 2 * decodes)
    finally:
        for a in attns:
            a.round_trips = frozenset()
        install_kernels(m, "layers.*.attn", enable=False)


@pytest.mark.parametrize("kv_fp8", [False, True])
def test_attention_glue_slots(tiny, kv_fp8):
    """``norm_kernel`` / ``rope_kernel`` replace the glue of ``_q_kv`` and ``_output`` in prefill
    and decode (the dispatch entry points are the references on CPU: bitwise the same model); a
    listening ``hook_q`` or ``hook_kv`` puts that layer back on the reference; CPU install puts
    nothing there and uninstall clears the slots."""
    m, ids = tiny
    attns = [a for a in m.modules() if isinstance(a, Attention)]
    for a in attns:
        a.round_trips = frozenset({RoundTrip.KV_FP8}) if kv_fp8 else frozenset()
    try:
        assert install_kernels(m) == 0 and all(a.norm_kernel is None and a.rope_kernel is None for a in attns)
        ref = _run(m, ids, 20)
        s0 = model_signature(m)
        norm, rope = Counting(rms_norm), Counting(norm_rope)
        for a in attns:
            a.norm_kernel, a.rope_kernel = norm, rope
        assert model_signature(m) != s0  # CUDA graphs recapture after a switch
        assert torch.equal(_run(m, ids, 20), ref)
        steps = 1 + ids.shape[1] - 20  # one prefill call, then decode steps
        assert norm.calls == len(attns) * steps and rope.calls == 3 * len(attns) * steps
        assert rope.keywords["ring"] == len(attns) * (steps - 1)  # each decode step's kv launch writes the ring
        norm.calls = rope.calls = 0
        with m.hooks([("layers.1.attn.hook_kv", lambda t, n: None)]):
            assert torch.equal(_run(m, ids, 20), ref)
        assert rope.calls == 3 * (len(attns) - 1) * steps  # layer 1 ran the reference
        rope.calls = 0
        m.train()
        try:
            m(ids[:, :8])  # training with grad: the kernels have no backward
        finally:
            m.eval()
        assert rope.calls == 0
        assert set(components(m, "layers.*.attn").impl) == {"kernel:counting_rms_norm"}
    finally:
        for a in attns:
            a.round_trips = frozenset()
        assert install_kernels(m, "layers.*.attn", enable=False) == len(attns)
    assert all(a.norm_kernel is None and a.rope_kernel is None for a in attns)


def test_router_route_kernel_slot(tiny):
    """``route_kernel`` replaces the router after its gate matmul (hash and top-k layers; the
    entry point is the reference on CPU: bitwise the same model); any router hook listening puts
    that router back on the reference; uninstall clears the slot."""
    m, ids = tiny
    routers = [r for r in m.modules() if isinstance(r, Router)]
    assert any(r.is_hash for r in routers) and not all(r.is_hash for r in routers)
    ref = _run(m, ids, 20)
    kern = Counting(route)
    try:
        for r in routers:
            r.route_kernel = kern
        assert torch.equal(_run(m, ids, 20), ref)
        steps = 1 + ids.shape[1] - 20
        assert kern.calls == len(routers) * steps
        assert components(m, "layers.0.mlp.router").impl.iloc[0] == "kernel:counting_route"  # plain gate: the route slot
        for hook in ("hook_logits", "hook_ids", "hook_weights"):
            kern.calls = 0
            with m.hooks([(f"layers.2.mlp.router.{hook}", lambda t, n: None)]):
                assert torch.equal(_run(m, ids, 20), ref)
            assert kern.calls == (len(routers) - 1) * steps, hook
        with pytest.raises(ValueError, match="input_ids"):
            m.layers[0].mlp.router(torch.zeros(1, 1, m.config.hidden_size), None)
    finally:
        assert install_kernels(m, "layers.*.mlp.router", enable=False) == len(routers)
    assert all(r.route_kernel is None for r in routers)


def test_router_gate_and_route_as_one_call(tiny):
    """Where the route slot declares the gate's plain slot (``with_gate`` / ``gate_fuses_with``), a
    router whose gate runs that slot makes one call for the gate and the route (CPU stand-in: the
    two references: bitwise the same model); a router hook, an output offered to the gate or an
    undeclared plain slot give that router its two calls back."""
    m, ids = tiny
    routers = [r for r in m.modules() if isinstance(r, Router)]
    ref = _run(m, ids, 20)
    steps = 1 + ids.shape[1] - 20

    def gate_route_ref(x, w, top_k, scoring, scale, bias=None, tid2eid=None, input_ids=None):
        return route(plain_linear(x, w), top_k, scoring, scale, bias, tid2eid, input_ids)

    plain_k, route_k, fused = Counting(plain_linear), Counting(route), Counting(gate_route_ref)
    route_k.with_gate, route_k.gate_fuses_with = fused, plain_k
    try:
        for r in routers:
            r.plain_kernel, r.route_kernel = plain_k, route_k
        assert torch.equal(_run(m, ids, 20), ref)
        assert fused.calls == len(routers) * steps and route_k.calls == 0 and plain_k.calls == 0
        fused.calls = 0
        with m.hooks([("layers.2.mlp.router.hook_ids", lambda t, n: None)]):
            assert torch.equal(_run(m, ids, 20), ref)
        assert fused.calls == (len(routers) - 1) * steps and route_k.calls == 0   # the hooked router: reference
        fused.calls = 0
        r0 = routers[0]
        x = torch.randn(1, 1, m.config.hidden_size)
        flat = x.reshape(1, -1)
        r0.offer(flat, torch.zeros(1, r0.out_features))   # an offered output is the gate's: the route runs alone
        assert r0._gate_route(flat, torch.zeros(1, 1, dtype=torch.long)) is None
        r0.offer(None)
        route_k.gate_fuses_with = Counting(plain_linear)   # a plain slot the route does not declare
        plain_k.calls = 0
        assert torch.equal(_run(m, ids, 20), ref)
        assert fused.calls == 0 and route_k.calls == len(routers) * steps and plain_k.calls == len(routers) * steps
    finally:
        assert install_kernels(m, "layers.*.mlp.router", enable=False) == len(routers)
    assert all(r.route_kernel is None and r.plain_kernel is None for r in routers)


def test_gate_route_switch():
    """``set_gate_route``: on (``DSV4LAB_GATE_ROUTE=1`` at import), the route slot offers the one launch
    (``with_gate``) with the plain slot it fuses with; off (the default) it offers nothing; a non-bool
    is refused."""
    prev = dispatch.set_gate_route(True)
    try:
        assert dispatch.route.with_gate is dispatch.gate_route and dispatch.route.gate_fuses_with is plain_linear
        assert dispatch.set_gate_route(False) is True and dispatch.route.with_gate is None
        with pytest.raises(TypeError, match="set_gate_route"):
            dispatch.set_gate_route(1)
    finally:
        dispatch.set_gate_route(prev)
    # on CPU the entry point declines (the caller then runs the gate and the route)
    assert dispatch.gate_route(torch.zeros(1, 8, dtype=torch.bfloat16), torch.zeros(4, 8, dtype=torch.bfloat16), 2,
                               "sigmoid", 1.0, torch.zeros(4)) is None


def test_glue_entry_points_name_bad_arguments():
    x = torch.zeros(1, 3, 2, 16)
    with pytest.raises(ValueError, match="len\\(positions\\)"):
        norm_rope(x, torch.arange(2), torch.ones(4))
    with pytest.raises(ValueError, match="unsqueeze"):
        norm_rope(torch.zeros(3, 16), torch.arange(3), torch.ones(4))
    with pytest.raises(ValueError, match="top_k"):
        route(torch.zeros(2, 4), 5, "sigmoid", 1.0, torch.zeros(4))
    with pytest.raises(ValueError, match="input_ids"):
        route(torch.zeros(2, 4), 2, "sigmoid", 1.0, None, torch.zeros(9, 2, dtype=torch.long))


# ----------------------------------------------------------------------------- GPU, V4-Pro shapes
gpu = pytest.mark.skipif(not (torch.cuda.is_available() and triton_importable()), reason="needs CUDA + triton")


def _within(y, r, u):
    y, r = y.float(), r.float()
    return bool(((y - r).abs() <= u * r.abs() + 2 * u * r.abs().max()).all())


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("pos", [0, 5, 70000])
def test_gpu_norm_rope_v4_pro_shapes(pos):
    from dsv4lab.kernels.norm_rope_ref import norm_rope_ref
    from dsv4lab.model.norms import rms_norm as rms_ref

    # V4-Pro (dsv4lab/configs/v4_pro.json): 128 heads x 512, rope 512 * 0.125 = 64, q_lora 1536
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(pos)
    H, D, RD, QL, B = 128, 512, 64, 1536, 1
    inv = (1.0 / (160000.0 ** (torch.arange(0, RD, 2, dtype=torch.float) / RD))).to(dev)
    positions = torch.tensor([pos], device=dev)
    bf = torch.bfloat16
    a = torch.randn(B, 1, QL, device=dev, generator=g).to(bf) * 3
    wq = (torch.rand(QL, device=dev, generator=g) + 0.5).to(bf)
    q = torch.randn(B, 1, H, D, device=dev, generator=g).to(bf) * 2
    kv = torch.randn(B, 1, 1, D, device=dev, generator=g).to(bf)
    wkv = (torch.rand(D, device=dev, generator=g) + 0.5).to(bf)
    u = 2.0 ** -7
    assert _within(rms_norm(a, wq, 1e-6), rms_ref(a, wq, 1e-6), u)
    assert _within(norm_rope(q, positions, inv, 1e-6), norm_rope_ref(q, positions, inv, 1e-6), u)
    assert _within(norm_rope(kv, positions, inv, 1e-6, wkv), norm_rope_ref(kv, positions, inv, 1e-6, wkv), u)
    assert _within(norm_rope(kv, positions, inv, 1e-6, wkv, fp8_nope=True),
                   norm_rope_ref(kv, positions, inv, 1e-6, wkv, fp8_nope=True), 2.0 ** -3)
    # no norm: the same libdevice cos/sin and unfused products as torch -> expected bit-exact
    # (asserted within 1 ulp; the message says whether it was exact)
    got, ref = norm_rope(q, positions, inv, inverse=True), norm_rope_ref(q, positions, inv, inverse=True)
    assert _within(got, ref, u), (got.float() - ref.float()).abs().max().item()
    assert torch.equal(norm_rope(q.clone(), positions, inv, inverse=True, inplace=True), got)
    # a prefill chunk: the rule's 16 heads a program give the same bits as 2 (whole-row loads)
    from dsv4lab.kernels.norm_rope import NORM_PLAIN, WIDE_ROWS, launch_norm_rope
    qp = torch.randn(1, WIDE_ROWS, H, D, device=dev, generator=g).to(bf)
    pp = torch.arange(WIDE_ROWS, device=dev) + pos
    assert torch.equal(launch_norm_rope(qp, bf, norm=NORM_PLAIN, eps=1e-6, positions=pp, inv_freq=inv),
                       launch_norm_rope(qp, bf, norm=NORM_PLAIN, eps=1e-6, positions=pp, inv_freq=inv,
                                        heads_per_program=2))
    assert torch.equal(norm_rope(kv, positions[:1] * 0, inv, fp8_nope=True),
                       norm_rope_ref(kv, positions[:1] * 0, inv, fp8_nope=True))
    assert graph_equals_eager(lambda: norm_rope(q, positions, inv, 1e-6))
    assert graph_equals_eager(lambda: norm_rope(kv, positions, inv, 1e-6, wkv, fp8_nope=True))
    assert graph_equals_eager(lambda: rms_norm(a, wq, 1e-6))
    # q_norm + kv norm/RoPE/kv_fp8/ring as one launch (norm_pair): q_res the bits of rms_norm's launch
    # (same tile and warps), kv within the reference's tolerance (the q half's 8 warps sum its norm in
    # another order than its own launch's 2), the ring slot written, graph == eager
    from dsv4lab.kernels.dispatch import norm_pair
    ring = torch.zeros(1, 128, D, device=dev, dtype=bf)
    q_res, kv_out = norm_pair(a, wq, 1e-6, kv, positions, inv, wkv, 1e-6, True, ring)
    assert torch.equal(q_res, rms_norm(a, wq, 1e-6))
    assert _within(kv_out, norm_rope_ref(kv, positions, inv, 1e-6, wkv, fp8_nope=True), 2.0 ** -3)
    assert torch.equal(ring[0, pos % 128], kv_out.reshape(D)) and int((ring.abs().sum(-1) > 0).sum()) == 1
    assert graph_equals_eager(lambda: norm_pair(a, wq, 1e-6, kv, positions, inv, wkv, 1e-6, True, ring))


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("T", [1, 4, 64])
def test_gpu_route_v4_pro_shapes(T):
    from dsv4lab.model.moe import route as route_ref

    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(T)
    E, k, D, V = 384, 6, 7168, 129280
    x = torch.randn(T, D, device=dev, generator=g).bfloat16()
    gate = (torch.randn(E, D, device=dev, generator=g) / D ** 0.5).bfloat16()
    logits = torch.nn.functional.linear(x, gate)  # bf16, as a plain gate gives them
    bias = torch.randn(E, device=dev, generator=g) * 0.01
    for scoring in ("sqrtsoftplus", "sigmoid", "softmax"):
        ri, rw = route_ref(logits, k, scoring, 1.5, bias)
        ki, kw = route(logits, k, scoring, 1.5, bias)
        assert torch.equal(ri.sort(1).values, ki.sort(1).values), scoring
        assert torch.equal(ri, ki), (scoring, "ids as torch.topk(sorted=False) writes them on CUDA")
        assert (kw - rw).abs().max().item() <= 1e-6 * rw.abs().max().item(), scoring
    tid = torch.randint(0, E, (V, k), device=dev, generator=g)
    toks = torch.randint(0, V, (1, T), device=dev, generator=g)
    ri, rw = route_ref(logits, k, "sqrtsoftplus", 1.5, None, tid, toks)
    ki, kw = route(logits, k, "sqrtsoftplus", 1.5, None, tid, toks)
    assert torch.equal(ri, ki) and (kw - rw).abs().max().item() <= 1e-6 * rw.abs().max().item()
    assert graph_equals_eager(lambda: route(logits, k, "sqrtsoftplus", 1.5, bias))


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("T", [1, 4])
def test_gpu_gate_route_v4_pro_is_the_two_launches(T):
    """The gate GEMV and the route in one launch (``dispatch.gate_route``) at V4-Pro's router (384 x
    7168, top-6): ids and weights bitwise ``plain_linear`` then ``route`` (the same warps: 384
    experts), top-k and hash; CUDA-graph replay bitwise eager."""
    from dsv4lab.kernels.gate_route import same_bits_as_two_launches

    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(T)
    E, k, D, V = 384, 6, 7168, 129280
    assert same_bits_as_two_launches(E)
    x = torch.randn(T, D, device=dev, generator=g).bfloat16()
    gate = (torch.randn(E, D, device=dev, generator=g) / D ** 0.5).bfloat16()
    bias = torch.randn(E, device=dev, generator=g) * 0.01
    for scoring in ("sqrtsoftplus", "sigmoid", "softmax"):
        ri, rw = route(plain_linear(x, gate), k, scoring, 1.5, bias)
        ki, kw = dispatch.gate_route(x, gate, k, scoring, 1.5, bias)
        assert torch.equal(ri, ki) and torch.equal(rw, kw), scoring
    tid = torch.randint(0, E, (V, k), device=dev, generator=g)
    toks = torch.randint(0, V, (1, T), device=dev, generator=g)
    ri, rw = route(plain_linear(x, gate), k, "sqrtsoftplus", 1.5, None, tid, toks)
    ki, kw = dispatch.gate_route(x, gate, k, "sqrtsoftplus", 1.5, None, tid, toks)
    assert torch.equal(ri, ki) and torch.equal(rw, kw)
    assert graph_equals_eager(lambda: dispatch.gate_route(x, gate, k, "sqrtsoftplus", 1.5, bias))


@pytest.mark.gpu
@gpu
def test_gpu_embedded_model_gate_route():
    """The embedded model in bf16 (its original weights: an unquantised gate, as V4-Pro's export keeps
    it; 8 experts: the route kernel would run 1 warp, this launch 4) with the gate and route in one
    launch: one call a router and step, greedy tokens and ids those of the two launches, logits
    within 1e-3 (weights may differ in a sum's last bit); graph replay bitwise eager."""
    import dsv4lab
    from dsv4lab.decode.check import decode_check

    m = dsv4lab.load("tiny", device="cuda", dtype=torch.bfloat16, progress=False)
    assert all(r.weight is not None for r in m.modules() if isinstance(r, Router))  # tiny-nvfp4 quantises it
    ids = torch.randint(2, m.config.vocab_size, (1, 33), generator=torch.Generator().manual_seed(3)).cuda()
    routers = [r for r in m.modules() if isinstance(r, Router)]
    prev = dispatch.set_gate_route(False)
    calls = []
    try:
        two = decode_logits(m, ids, steps=16)
        dispatch.set_gate_route(True)
        real = dispatch.gate_route
        dispatch.route.with_gate = lambda *a, **kw: calls.append(1) or real(*a, **kw)   # counted; reset below
        one = decode_logits(m, ids, steps=16)
        assert len(calls) == len(routers) * 17   # the prefill asks too (declined: 17 tokens) and 16 steps
        assert (one.float() - two.float()).abs().max().item() <= 1e-3 * two.float().abs().max().item()
        assert torch.equal(one.argmax(-1), two.argmax(-1))
        s = decode_check(m, ids.cpu(), steps=16).summary()
        assert s["token_agreement"] == 1.0 and s["max_abs_logit_diff"] == 0.0
    finally:
        dispatch.set_gate_route(prev)


@pytest.mark.gpu
@gpu
def test_gpu_install_puts_glue_kernels_on_cuda_components():
    import dsv4lab

    m = dsv4lab.load("tiny-nvfp4", device="cuda", dtype=torch.bfloat16, progress=False)
    attns = [a for a in m.modules() if isinstance(a, Attention)]
    routers = [r for r in m.modules() if isinstance(r, Router)]
    assert all(a.norm_kernel is rms_norm and a.rope_kernel is norm_rope for a in attns)
    assert all(r.route_kernel is route for r in routers)
    m.use_kernels(enable=False)
    assert all(a.rope_kernel is None for a in attns) and all(r.route_kernel is None for r in routers)
