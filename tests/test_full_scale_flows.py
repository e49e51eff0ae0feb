"""Pieces of the full-scale flows that are decided on the host: which dtype a session loads in,
and a nightly run on a model its baselines were not blessed on (a synth, the release)."""
from __future__ import annotations

import torch

from dsv4lab.config import load_config
from dsv4lab.triage.regression import baselines_model_mismatch, compare
from dsv4lab.triage.session import session_dtype


def test_session_dtype_auto():
    # the embedded model keeps fp32 everywhere (its baselines are fp32)
    assert session_dtype(None, "cuda", "auto") == torch.float32
    assert session_dtype("tiny-nvfp4", "cuda:0", "auto") == torch.float32
    # a checkpoint: bf16 on CUDA (a full-size model's BF16 tensors would double in fp32), fp32 on CPU
    assert session_dtype("/ckpt/V4-Pro-NVFP4", "cuda", "auto") == torch.bfloat16
    assert session_dtype("/ckpt/V4-Pro-NVFP4", "cpu", "auto") == torch.float32
    # an explicit dtype is kept
    assert session_dtype("/ckpt/V4-Pro-NVFP4", "cuda", torch.float16) == torch.float16


def _metrics(model: str, value: float) -> dict:
    return {"model": model, "notebooks": {"02_first_token_logits": {"plain.p_top1": {"value": value, "tolerance": {"abs": 1e-3}}}}}


def test_baselines_of_another_model_judge_nothing():
    base = _metrics("data/tiny-dsv4", 0.99)
    other = _metrics("/tmp/ckpt/pro-nvfp4", 0.01)
    why = baselines_model_mismatch(other, base)
    assert why is not None and "data/tiny-dsv4" in why and "/tmp/ckpt/pro-nvfp4" in why and "--bless" in why
    # the same model is compared, and a change there still regresses
    assert baselines_model_mismatch(_metrics("data/tiny-dsv4", 0.5), base) is None
    assert not compare(_metrics("data/tiny-dsv4", 0.5), base).ok


def test_session_device_auto_plans_over_the_visible_gpus():
    from dsv4lab.checkpoint.locate import TINY_DIR
    from dsv4lab.triage.session import session_device

    # a checkpoint over 2 GPUs: the plan's contiguous device map, both GPUs used, every layer placed
    m = session_device(str(TINY_DIR), "auto", gpus=2, gpu_memory="16GB")
    devs = [m[i] for i in sorted(m)] if isinstance(m, dict) else list(m)
    assert len(devs) == load_config(str(TINY_DIR)).num_hidden_layers and {str(d) for d in devs} == {"cuda:0", "cuda:1"}
    assert [str(d) for d in devs] == sorted(str(d) for d in devs)          # one run of layers per GPU
    # one GPU, the embedded model, no GPU, or an explicit device: no plan needed
    assert session_device(str(TINY_DIR), "auto", gpus=1) == "cuda"
    assert session_device(None, "auto", gpus=8) == "cuda"
    assert session_device(str(TINY_DIR), "auto", gpus=0) == "cpu"
    assert session_device(str(TINY_DIR), "cuda:3") == "cuda:3"
