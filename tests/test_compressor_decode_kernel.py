"""The compressor decode kernel (dsv4lab/kernels/compressor_decode.py) against the reference
``Compressor.decode``, and the ``Compressor.decode_kernel`` slot.

CPU: the kernel through Triton's interpreter in a subprocess (tests/compressor_decode_interp_check.py:
CSA ratio 4 with overlap, ratios 8 and 16 without; three windows of decode steps from an empty
state and after a prefill of each residue; fp32 and bf16), then the slot at model level.
GPU (@pytest.mark.gpu): V4-Pro shapes (the attention's compressors, d 512, ratios 4 and 128; the
indexer's, d = index_head_dim 128, ratio 4) in bf16, and CUDA-graph replay == eager bitwise.

Tolerances, every step, the kernel's state evolving on its own: the rings (raw kv, gate logits)
identical; entries the reference has not written identical; entry counts equal; written entries
|kernel - ref| <= 1e-5 * max(1, max|ref|) in fp32 (exp and the sums in another order) and
<= 1e-2 * max|ref| in bf16 (a weight or product rounding to the other side moves the entry by
about one bf16 ulp; the kernel rounds where the reference rounds). Measured under the interpreter
with round-to-nearest bf16 casts: fp32 <= 7.2e-7 (max|ref| ~ 4), bf16 bitwise equal.
"""
from __future__ import annotations

import pytest
import torch

from dsv4lab.analysis.components import components, replace
from dsv4lab.bugzoo.variants import CompressorApeOnKV
from dsv4lab.decode.graphs import model_signature
from dsv4lab.kernels.dispatch import compressor_decode
from dsv4lab.kernels.install import install_kernels
from dsv4lab.model.compressor import Compressor
from dsv4lab.quant.modes import RoundTrip
from dsv4lab.workbench import random_model
from oracle_util import interp_check_result, prefill_then_decode, random_ids, tiny_config
pytestmark = pytest.mark.usefixtures("one_thread")


def test_interp_compressor_decode_matches_reference():
    res = interp_check_result("compressor_decode_interp_check.py", timeout=900)
    wrong = res.pop("wrong_no_ape")
    assert len(res) == 51
    for case, v in res.items():
        ratio = int(case.split("_")[0][1:])
        assert v["rings_equal"] and v["unwritten_equal"] and v["n_equal"], (case, v)
        assert v["kernel_calls"] == 3 * ratio and v["closes"] == 3, (case, v)
        tol = 1e-5 * max(1.0, v["ref_max"]) if "_float32_st" in case else 1e-2 * v["ref_max"]
        assert v["entry_err"] <= tol, (case, v)
    # a kernel without the position bias in the gate logits fails the same comparison
    assert not wrong["rings_equal"] and wrong["entry_err"] > 0.1 * wrong["ref_max"]


def test_decode_kernel_slot_and_install():
    """``Compressor.decode_kernel`` replaces the reference decode (here the CPU dispatch, which is
    the reference: bitwise equal logits and state) for every compressor (attention and indexer),
    except while a hook listens, under a round trip, or where a fused method was replaced (a bug
    variant); install on CPU leaves it empty; components() and the graph signature see it."""
    cfg = tiny_config(index_head_dim=32)  # indexer_fp4 works in blocks of 32
    m = random_model(cfg, seed=4)
    comps = {n: c for n, c in m.named_modules() if isinstance(c, Compressor)}
    assert len(comps) == 5  # 2 CSA layers x (attention + indexer), 1 HCA
    assert install_kernels(m) == 0 and all(c.decode_kernel is None for c in comps.values())
    ids = random_ids(cfg, n=30, b=2)
    n_dec = 30 - 13
    ref, ref_st = prefill_then_decode(m, ids, 13)
    calls = []

    def counting(comp, kv, z, pos, st):
        calls.append(comp)
        return compressor_decode(comp, kv, z, pos, st)

    sig = model_signature(m)
    try:
        for c in comps.values():
            c.decode_kernel = counting
        assert model_signature(m) != sig  # a captured graph is not replayed across the switch
        assert set(components(m, "**.compressor").impl) == {"kernel:counting"}
        got, st = prefill_then_decode(m, ids, 13)
        assert torch.equal(got, ref) and len(calls) == n_dec * len(comps)
        assert all(torch.equal(a, b) for a, b in zip(st.tensors(), ref_st.tensors()))
        # listening hooks, round trips, a replaced method: the reference runs
        for hook in ("hook_weights", "hook_entries"):
            calls.clear()
            with m.hooks([(f"layers.1.attn.compressor.{hook}", lambda t, n: None)]):
                prefill_then_decode(m, ids, 13)
            assert len(calls) == n_dec * (len(comps) - 1) and comps["layers.1.attn.compressor"] not in calls
        calls.clear()
        comps["layers.3.attn.indexer.compressor"].round_trips = frozenset({RoundTrip.INDEXER_FP4})
        prefill_then_decode(m, ids, 13)
        assert len(calls) == n_dec * (len(comps) - 1)
        comps["layers.3.attn.indexer.compressor"].round_trips = frozenset()
        calls.clear()
        with replace(m, "layers.2.attn.compressor", CompressorApeOnKV):
            bad, _ = prefill_then_decode(m, ids, 13)
        assert len(calls) == n_dec * (len(comps) - 1) and not torch.equal(bad, ref)
    finally:
        assert install_kernels(m, enable=False) == len(comps)
    assert all(c.decode_kernel is None for c in comps.values())


# ----------------------------------------------------------------------------- GPU
def _v4_pro_compressor(kind: str) -> Compressor:
    from dsv4lab.config import named_config
    from dsv4lab.model.init import randomize_

    cfg = named_config("v4-pro")
    dim, ratio, overlap = {"csa": (cfg.head_dim, 4, True), "hca": (cfg.head_dim, 128, False),
                           "indexer": (cfg.index_head_dim, 4, True)}[kind]
    comp = Compressor(cfg, dim, ratio, overlap, rotate=kind == "indexer")
    holder = torch.nn.Module()
    holder.config, holder.comp = cfg, comp
    holder.qlinears = lambda: []
    randomize_(holder, seed=1)
    with torch.no_grad():
        comp.ape.mul_(3)  # a position bias large enough that misplacing it shows
    return comp.to("cuda", torch.bfloat16).eval()


def _state(comp, B, n_max, dtype):
    from dsv4lab.model.state import CompressorState

    return CompressorState.empty(B, comp.ratio, comp.dim, comp.overlap, n_max * comp.ratio, dtype, "cuda")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("kind", ["csa", "hca", "indexer"])
@pytest.mark.parametrize("prefill", [0, 1, 3])  # residues mod 4 (plus windows): from empty, mid-window
def test_gpu_compressor_decode_v4_pro_shapes(kind, prefill):
    from dsv4lab.kernels.compressor_decode import compressor_decode_triton

    torch.manual_seed(0)
    comp = _v4_pro_compressor(kind)
    m, B = comp.ratio, 2
    plen = prefill * (m + 1) if prefill else 0
    steps = 2 * m + 2 if m > 4 else 3 * m
    x = torch.randn(B, plen + steps, comp.wkv.in_features, device="cuda", dtype=torch.bfloat16)
    ref = _state(comp, B, (plen + steps) // m + 1, torch.bfloat16)
    with torch.no_grad():
        if plen:
            comp.prefill(x[:, :plen], 0, ref)
        ker = type(ref)(ref.ring_kv.clone(), ref.ring_gate.clone(), ref.entries.clone())
        worst = 0.0
        for t in range(plen, plen + steps):
            pos = torch.tensor(t, device="cuda")
            xt = x[:, t : t + 1]
            n_ref = comp.decode(xt, pos, ref)
            n_ker = compressor_decode_triton(comp.wkv(xt), comp.wgate(xt), pos, ker.ring_kv, ker.ring_gate, ker.entries,
                                             comp.ape, comp.norm.weight, comp.rotary.inv_freq, comp.norm.eps, comp.overlap)
            assert torch.equal(n_ref, n_ker)
            assert torch.equal(ref.ring_kv, ker.ring_kv) and torch.equal(ref.ring_gate, ker.ring_gate), t
            nw = (t + 1) // m
            assert torch.equal(ref.entries[:, nw:], ker.entries[:, nw:]), t
            if nw:
                e_ref, e_ker = ref.entries[:, :nw].float(), ker.entries[:, :nw].float()
                err = (e_ref - e_ker).abs().max().item()
                worst = max(worst, err / e_ref.abs().max().item())
                assert err <= 1e-2 * e_ref.abs().max().item(), (t, err)
    print(f"{kind} prefill {plen}: max |kernel - ref| / max|ref| = {worst:.2e}")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("kind", ["csa", "hca"])
def test_gpu_compressor_decode_graph_equals_eager(kind):
    """A captured decode step (the slot through ``Compressor.decode``, position advanced on the
    device) replayed over more than a window gives the eager run's state bit for bit."""
    from dsv4lab.kernels.dispatch import compressor_decode as slot

    torch.manual_seed(0)
    comp = _v4_pro_compressor(kind)
    comp.decode_kernel = slot
    m, B = comp.ratio, 1
    steps = m + 3
    xs = torch.randn(steps, B, 1, comp.wkv.in_features, device="cuda", dtype=torch.bfloat16)
    eager = _state(comp, B, steps // m + 2, torch.bfloat16)
    graph_st = type(eager)(eager.ring_kv.clone(), eager.ring_gate.clone(), eager.entries.clone())
    with torch.no_grad():
        pos = torch.zeros((), dtype=torch.long, device="cuda")
        for t in range(steps):
            comp.decode(xs[t], pos, eager)
            pos += 1
        gpos = torch.zeros((), dtype=torch.long, device="cuda")
        x_in = xs[0].clone()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):  # warm up (compiles), then restore the state
            snap = [t.clone() for t in (graph_st.ring_kv, graph_st.ring_gate, graph_st.entries)]
            comp.decode(x_in, gpos, graph_st)
            for t, v in zip((graph_st.ring_kv, graph_st.ring_gate, graph_st.entries), snap):
                t.copy_(v)
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            comp.decode(x_in, gpos, graph_st)
            gpos += 1
        for t in range(steps):
            x_in.copy_(xs[t])
            g.replay()
        torch.cuda.synchronize()
    assert int(gpos) == steps
    for a, b in zip((eager.ring_kv, eager.ring_gate, eager.entries), (graph_st.ring_kv, graph_st.ring_gate, graph_st.entries)):
        assert torch.equal(a, b)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_install_puts_the_decode_kernel_on_cuda_compressors():
    import dsv4lab

    m = dsv4lab.load("tiny-nvfp4", device="cuda", dtype=torch.bfloat16, progress=False)
    comps = [c for c in m.modules() if isinstance(c, Compressor)]
    assert comps and all(c.decode_kernel is compressor_decode for c in comps)
    assert all("compressor_decode" in lab for lab in components(m, "**.compressor").impl)
    assert m.use_kernels("**.compressor", enable=False) >= len(comps)
    assert all(c.decode_kernel is None for c in comps)
