"""NVFP4 (ModelOpt) export of a tiny oracle model, loaded back with weights kept in FP4.

Stated quantisation error: every exported weight is exactly the NVFP4 quantisation of the
original (ModelOpt recipe; per element within half a grid step times its block scale), read back
bit-exactly; the ``bf16`` (dense-dequantised) mode equals transformers run on the dequantised
weights to 1e-4. Random tiny nets amplify 4-bit noise chaotically, so the model-level error is
stated on the trained embedded model instead (tests/test_embedded_model.py: KL < 0.05).
"""
from __future__ import annotations

import pytest
import torch

import dsv4lab
from dsv4lab.checkpoint import save_checkpoint
from dsv4lab.precision import apply_precision
from oracle_util import oracle, tiny_config


@pytest.mark.slow  # > 10 s on the shared 2-core CPU (--durations)
def test_nvfp4_roundtrip_and_oracle_on_dequantised(tmp_path):
    from transformers import DeepseekV4ForCausalLM

    cfg = tiny_config()
    hf = oracle(cfg, seed=3)
    hf.save_pretrained(tmp_path / "bf16")
    ref_model = dsv4lab.load(tmp_path / "bf16", progress=False)
    state = {k: v for k, v in ref_model.state_dict().items() if not k.endswith("inv_freq")}
    save_checkpoint(tmp_path / "nvfp4", cfg, state, layout="official", nvfp4=["*"], progress=False)
    q = dsv4lab.load(tmp_path / "nvfp4", progress=False)
    linears = dict(q.qlinears())
    assert all(ql.format == "nvfp4" for ql in linears.values())          # stays FP4 in memory

    from dsv4lab.quant.weights import quantize_nvfp4

    for name, ql in linears.items():
        expect = quantize_nvfp4(state[name + ".weight"].float())
        assert torch.equal(ql.qweight.packed, expect.packed), name
        assert torch.equal(ql.qweight.block_scale.view(torch.uint8), expect.block_scale.view(torch.uint8)), name
        assert torch.equal(ql.qweight.global_scale, expect.global_scale), name
    ids = torch.randint(2, cfg.vocab_size, (2, 90), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got = q(ids)

    # dense-dequantised mode == the oracle on the dequantised weights
    deq = dict(state)
    for name, ql in linears.items():
        deq[name + ".weight"] = ql.qweight.dequantize(torch.float32)
    save_checkpoint(tmp_path / "deq", cfg, deq, layout="transformers", progress=False)
    hf_deq = DeepseekV4ForCausalLM.from_pretrained(tmp_path / "deq", dtype=torch.float32).eval()
    apply_precision(q, "bf16")
    with torch.no_grad():
        dense = q(ids)
        oracle_deq = hf_deq(ids, use_cache=False).logits
    assert (dense - oracle_deq).abs().max() < 1e-4
    assert torch.equal(dense, got) or (dense - got).abs().max() < 1e-5   # w4a16 == dense in fp32
