"""MoE (dsv4lab/model/moe.py, expert_stack.py): hash and top-k routers, Expert / SharedExpert and
the MoE block against the oracle's DeepseekV4HashRouter / TopKRouter / MLP / Experts /
SparseMoeBlock on the same weights; gathered (graph-safe, reads only the chosen experts) MoE
decode equals the reference loop.

Tolerances: oracle comparisons in float32 atol=1e-5, rtol=1e-5 (routing ids exact); decode vs
full forward < 1e-4 absolute (as before); a wrong variant must miss by more than 1e-3.
"""
from __future__ import annotations

import pytest
import torch

from dsv4lab.analysis.components import shallow_clone
from dsv4lab.bugzoo.variants import ExpertW1W3Swapped, RouterBiasInWeights, SharedExpertClampAfterSilu
from dsv4lab.workbench import random_model
from dsv4lab.quant.weights import quantize_mxfp4, quantize_nvfp4
from oracle_util import tiny_config


def _model(quant: bool | str):
    """quant: False (plain), True / "nvfp4", or "mxfp4" (the official checkpoint's expert format)."""
    cfg = tiny_config(n_routed_experts=24, num_experts_per_tok=3, moe_intermediate_size=32)
    m = random_model(cfg, seed=2)
    if quant:
        q = quantize_mxfp4 if quant == "mxfp4" else quantize_nvfp4
        for layer in m.layers:
            for e in range(cfg.n_routed_experts):
                for p in ("w1", "w2", "w3"):
                    ql = getattr(layer.mlp.experts[e], p)
                    ql.set_weight(q(ql.weight.data))
    return m


def _decode_vs_full(m):
    ids = torch.randint(2, 97, (2, 50), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = m(ids)
        st = m.new_state(2, 50)
        parts = [m.prefill(ids[:, :20], st)]
        for t in range(20, 50):
            parts.append(m.decode_step(ids[:, t : t + 1], st))
            st.pos += 1
    return (torch.cat(parts, 1) - full).abs().max().item()


@pytest.mark.slow  # > 10 s on the shared 2-core CPU (--durations)
def test_gathered_decode_plain_and_nvfp4():
    for quant in (False, True):
        m = _model(quant)
        assert m.layers[1].mlp.experts.gather_in_decode
        assert _decode_vs_full(m) < 1e-4
        stack = m.layers[1].mlp.experts.stack()
        assert stack is not None and stack.formats["w1"] == ("nvfp4" if quant else "plain")
        # experts now view the stack: no duplicated storage
        e3 = m.layers[1].mlp.experts[3].w1
        t = e3.qweight.packed if quant else e3.weight
        assert t.untyped_storage().data_ptr() == next(iter(stack.tensors["w1"].values())).untyped_storage().data_ptr()


def test_stack_rebuilt_after_weight_swap():
    m = _model(True)
    ex = m.layers[2].mlp.experts
    s1 = ex.stack()
    ex[5].w2.set_weight(quantize_nvfp4(torch.randn(32, 32) * 0.1).dequantize())  # now plain: mixed formats
    assert ex.stack() is None
    assert _decode_vs_full(m) < 1e-4  # falls back to the masked loop
    assert s1 is not None


def test_stack_answer_kept_until_a_counted_change(monkeypatch):
    """stack() walks every expert only after a component counted a change (swap, mode, replace):
    repeated eager steps reuse the answer, and replace / restore (which write ``_modules``
    directly) are counted, so a replaced expert is noticed at once."""
    from dsv4lab.analysis.components import replace
    from dsv4lab.model import expert_stack
    from dsv4lab.model.component import changes
    from dsv4lab.model.moe import Expert

    m = _model(True)
    ex = m.layers[2].mlp.experts
    s1 = ex.stack()
    walks = []
    real = expert_stack.ExpertStack.identity
    monkeypatch.setattr(expert_stack.ExpertStack, "identity", classmethod(lambda cls, e: walks.append(1) or real(e)))
    assert ex.stack() is s1 and ex.stack() is s1 and walks == []
    c0 = changes()
    with replace(m, "layers.2.mlp.experts.4", type("OtherExpert", (Expert,), {})):
        assert changes() > c0
        assert ex.stack() is None  # a replaced expert implementation cannot share the stack
    assert changes() > c0 + 1
    assert ex.stack() is s1 and walks == [1]  # decided again once: the weights did not move


def test_gathered_decode_mxfp4():
    """MXFP4 experts stack too (gathered decode instead of the masked loop over every expert), the
    gathered weights equal each expert's own dequantisation, and the experts view the stack."""
    m = _model("mxfp4")
    ex = m.layers[1].mlp.experts
    assert _decode_vs_full(m) < 1e-4
    stack = ex.stack()
    assert stack is not None and set(stack.formats.values()) == {"mxfp4"}
    assert ex[3].w1.qweight.packed.untyped_storage().data_ptr() == stack.tensors["w1"]["packed"].untyped_storage().data_ptr()
    ids = torch.tensor([3, 0, 23])
    for p in ("w1", "w3", "w2"):
        got = stack.gather(p, ids, torch.float32)
        want = torch.stack([getattr(ex[i], p).qweight.dequantize(torch.float32) for i in ids.tolist()])
        assert torch.equal(got, want), p


# ----------------------------------------------------------------------------- against the oracle
ATOL, RTOL = 1e-5, 1e-5
WRONG = 1e-3


def _hidden(cfg, seed=0, shape=(2, 9), scale=2.0):
    """Block inputs loud enough that the SwiGLU clamp (limit 1.0) bites."""
    return torch.randn(*shape, cfg.hidden_size, generator=torch.Generator().manual_seed(seed)) * scale


def _by_expert(ids, w):
    order = ids.argsort(-1)
    return ids.gather(-1, order), w.gather(-1, order)


@pytest.mark.parametrize("layer", [0, 1], ids=["hash", "topk"])
def test_router_matches_oracle(mixed, layer):
    cfg, hf, ours = mixed
    x = _hidden(cfg, seed=layer)
    ids_in = torch.randint(0, cfg.vocab_size, x.shape[:2], generator=torch.Generator().manual_seed(9))
    router, gate = ours.layers[layer].mlp.router, hf.model.layers[layer].mlp.gate
    assert router.is_hash == (layer == 0)
    with torch.no_grad():
        ids, w = router(x, ids_in)
        ref = gate(x, ids_in) if router.is_hash else gate(x)
    ref_logits, ref_w, ref_ids = ref
    got_ids, got_w = _by_expert(ids, w)
    want_ids, want_w = _by_expert(ref_ids, ref_w)
    assert torch.equal(got_ids, want_ids)
    torch.testing.assert_close(got_w, want_w, atol=ATOL, rtol=RTOL)
    if router.is_hash:
        assert torch.equal(ids, router.tid2eid[ids_in.reshape(-1)])
        with pytest.raises(ValueError):
            router(x, None)
    else:  # the correction bias only chooses; in the weights it is a known bug
        assert router.bias.abs().max() > 0
        with torch.no_grad():
            _, bad_w = _by_expert(*shallow_clone(router, RouterBiasInWeights)(x, None))
        assert (bad_w - want_w).abs().max().item() > WRONG


def test_shared_expert_matches_oracle_mlp_and_wrong_swiglus_miss(mixed):
    cfg, hf, ours = mixed
    x = _hidden(cfg, seed=2)
    shared, ref_mlp = ours.layers[1].mlp.shared_expert, hf.model.layers[1].mlp.shared_experts
    with torch.no_grad():
        want = ref_mlp(x)
        torch.testing.assert_close(shared(x), want, atol=ATOL, rtol=RTOL)
        for cls in (SharedExpertClampAfterSilu, ExpertW1W3Swapped):
            assert (shallow_clone(shared, cls)(x) - want).abs().max().item() > WRONG, cls.__name__


@pytest.mark.parametrize("graph_safe", [False, True], ids=["sparse", "masked"])
def test_experts_match_oracle(mixed, graph_safe):
    cfg, hf, ours = mixed
    x = _hidden(cfg, seed=3).reshape(-1, cfg.hidden_size)
    T, k = x.shape[0], cfg.num_experts_per_tok
    g = torch.Generator().manual_seed(4)
    ids = torch.stack([torch.randperm(cfg.n_routed_experts, generator=g)[:k] for _ in range(T)])
    w = torch.rand(T, k, generator=g)
    with torch.no_grad():
        got = ours.layers[2].mlp.experts(x, ids, w, graph_safe)
        want = hf.model.layers[2].mlp.experts(x, ids, w)
    torch.testing.assert_close(got, want, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("layer", [0, 1], ids=["hash", "topk"])
def test_moe_block_matches_oracle(mixed, layer):
    cfg, hf, ours = mixed
    x = _hidden(cfg, seed=5 + layer)
    ids_in = torch.randint(0, cfg.vocab_size, x.shape[:2], generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        want = hf.model.layers[layer].mlp(x, input_ids=ids_in)
        torch.testing.assert_close(ours.layers[layer].mlp(x, ids_in), want, atol=ATOL, rtol=RTOL)
        torch.testing.assert_close(ours.layers[layer].mlp(x, ids_in, graph_safe=True), want, atol=ATOL, rtol=RTOL)
