"""``python -m dsv4lab decode-check [--model PATH] [--device cuda] [--steps N] [--json]``.

On CUDA: N greedy decode steps eagerly and by CUDA-graph replay from the same prefilled state;
token agreement, max |logit difference| per step, per-step latency of each mode. On CPU: the
fixed-buffer decode path against full forwards (no graphs on a CPU). Exit 2 on token mismatch.
"""
from __future__ import annotations

import argparse
import json
import sys

import torch

from ..checkpoint.locate import resolve_path
from ..decode.check import decode_check
from ..loading import load
from ..text.tokenizer import load_tokenizer
from .args import positive_int


def register(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("decode-check", help="compare CUDA-graph and eager decode (CPU: decode buffers vs full forwards)")
    p.add_argument("--model", default=None, help="checkpoint path (default: the embedded tiny model)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--steps", type=positive_int, default=64, help="decode steps (a positive int, default 64)")
    p.add_argument("--prompt", default="The capital of France is")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=run)
    return p


def prompt_ids(model_path, prompt: str):
    try:
        tok = load_tokenizer(resolve_path(model_path))
        ids = tok(prompt, return_tensors="pt").input_ids
    except Exception:  # noqa: BLE001 - a checkpoint without a tokenizer: deterministic ids
        ids = torch.arange(2, 50).unsqueeze(0)
    return ids


def run(args) -> int:
    model = load(args.model, device=args.device, dtype=torch.float32 if args.device == "cpu" else torch.bfloat16,
                 progress=not args.json)
    res = decode_check(model, prompt_ids(args.model, args.prompt), steps=args.steps)
    out = res.summary()
    out["max_abs_logit_diff_per_step"] = res.max_abs_diff
    out["latency_ms"] = {res.mode_a: res.latency_a_ms, res.mode_b: res.latency_b_ms}
    if args.json:
        json.dump(out, sys.stdout, indent=1)
        sys.stdout.write("\n")
    else:
        for k, v in res.summary().items():
            print(f"{k:>34}: {v}")
    return 0 if out["token_agreement"] == 1.0 else 2
