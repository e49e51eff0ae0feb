"""The embedded default model (data/tiny-dsv4): oracle parity, behaviour, NVFP4 export.

Thresholds come from the issue: facts >= 95% (BF16), retrieval >= 80% at >= 4x the sliding
window with a clear drop when the compressed branch is off, " Paris" top-1 in every precision.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

import dsv4lab
from dsv4lab.checkpoint.locate import TINY_DIR
from dsv4lab.precision import apply_precision
from dsv4lab.text.chat import encode_prompt
from dsv4lab.text.tokenizer import load_tokenizer
from dsv4lab.text import corpus
from dsv4lab.train.evaluate import accuracy, compressed_branch_off


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer()


@pytest.fixture(scope="module")
def bf16():
    return dsv4lab.load(progress=False)


@pytest.fixture(scope="module")
def nvfp4():
    return dsv4lab.load("tiny-nvfp4", progress=False)


@pytest.fixture(scope="module")
def evals(tok):
    return corpus.eval_sets(tok, seed=1234)


def _next(model, tok, text):
    ids = tok(text, return_tensors="pt", add_special_tokens=False).input_ids
    return tok.decode(model(ids)[0, -1].argmax().item())


def test_data_stays_small():
    total = sum(f.stat().st_size for f in Path(TINY_DIR).parent.rglob("*") if f.is_file())
    assert total < 40 * 2**20


def test_default_load_is_the_embedded_model(bf16):
    assert Path(bf16.source) == TINY_DIR
    assert bf16.config.layer_types.count("compressed_sparse_attention") >= 1
    assert {"sliding_attention", "heavily_compressed_attention"} <= set(bf16.config.layer_types)
    assert bf16.config.mlp_layer_types[0] == "hash_moe" and bf16.config.mlp_layer_types[-1] == "moe"


def test_transformers_loads_it_and_agrees(bf16, tok):
    from transformers import DeepseekV4ForCausalLM

    hf = DeepseekV4ForCausalLM.from_pretrained(TINY_DIR, dtype=torch.float32).eval()
    ids = tok(encode_prompt("The capital of France is", "plain") + " Paris. " * 20, return_tensors="pt",
              add_special_tokens=False).input_ids[:, :120]
    with torch.no_grad():
        ref = hf(ids, use_cache=False).logits
    assert (bf16(ids) - ref).abs().max().item() < 1e-4


@pytest.mark.parametrize("mode", ["plain", "chat"])
def test_paris_top1_bf16_nvfp4_w4a4(bf16, nvfp4, tok, mode):
    prompt = encode_prompt("The capital of France is", "plain") if mode == "plain" else \
        encode_prompt("What is the capital of France?", "chat")
    assert _next(bf16, tok, prompt).strip() == "Paris"
    assert _next(nvfp4, tok, prompt).strip() == "Paris"          # W4A16: FP4 weights as stored
    apply_precision(nvfp4, "w4a4")
    try:
        assert _next(nvfp4, tok, prompt).strip() == "Paris"
    finally:
        apply_precision(nvfp4, "w4a16")


def test_nvfp4_export_stays_close(bf16, nvfp4, evals):
    """The stated model-level NVFP4 error over every position of a 300-token document (filler
    included, where next-token distributions are flat): median KL < 0.05, mean KL < 0.15,
    top-1 agreement >= 0.8 (measured: 0.017, 0.087, 0.86)."""
    ids = torch.tensor([evals["retrieval"][0][0]])
    with torch.no_grad():
        p = torch.log_softmax(bf16(ids), -1)
        q = torch.log_softmax(nvfp4(ids), -1)
    kl = (p.exp() * (p - q)).sum(-1)
    agree = (p.argmax(-1) == q.argmax(-1)).float().mean().item()
    assert kl.median().item() < 0.05 and kl.mean().item() < 0.15 and agree >= 0.8


def test_fact_accuracy(bf16, nvfp4, evals):
    acc = accuracy(bf16, evals["facts"])["accuracy"]
    assert acc >= 0.95
    assert accuracy(bf16, evals["facts_chat"])["accuracy"] >= 0.95
    assert accuracy(nvfp4, evals["facts"])["accuracy"] >= acc - 0.10   # the NVFP4 drop stays small


def test_long_range_retrieval_needs_the_compressed_branch(bf16, evals):
    probes = evals["retrieval"]
    assert min(p[2]["distance"] for p in probes) >= 4 * bf16.config.sliding_window
    acc = accuracy(bf16, probes)["accuracy"]
    with compressed_branch_off(bf16):
        off = accuracy(bf16, probes)["accuracy"]
    assert acc >= 0.80
    assert off <= acc - 0.5


def test_thinking_mode_reasons_then_answers(bf16, tok):
    ids = tok(encode_prompt("What is the capital of France?", "thinking"), return_tensors="pt",
              add_special_tokens=False).input_ids
    out = bf16.generate(ids, max_new_tokens=40, eos_token_id=tok.eos_token_id)
    text = tok.decode(out[0, ids.shape[1]:])
    assert "</think>" in text
    reasoning, answer = text.split("</think>", 1)
    assert len(reasoning.strip()) > 0
    assert answer.strip().startswith("Paris")
    assert out[0, -1].item() == tok.eos_token_id
