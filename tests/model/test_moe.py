"""Gathered (graph-safe, reads only the chosen experts) MoE decode equals the reference loop."""
from __future__ import annotations

import torch

from dsv4lab.model.init import random_model
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
