"""Behaviour metrics of a (tiny) DSV4: fact completion and long-range key retrieval.

A probe is ``(prompt_ids, answer_id, meta)``; accuracy = greedy next token equals the answer.
Probes are run one prompt at a time (no padding in DSV4's compressed attention), grouped by
length when several share it.
"""
from __future__ import annotations

from collections import defaultdict
from typing import Iterable, Sequence

import torch

Probe = tuple[Sequence[int], int, dict]


@torch.no_grad()
def next_token_predictions(model, prompts: Sequence[Sequence[int]], batch: int = 64) -> list[int]:
    """Greedy next token for each prompt (same-length prompts share a batch)."""
    by_len: dict[int, list[int]] = defaultdict(list)
    for i, p in enumerate(prompts):
        by_len[len(p)].append(i)
    out = [0] * len(prompts)
    dev = model.device
    for _, idxs in sorted(by_len.items()):
        for j in range(0, len(idxs), batch):
            chunk = idxs[j : j + batch]
            ids = torch.tensor([list(prompts[i]) for i in chunk], dtype=torch.long, device=dev)
            pred = model(ids)[:, -1].argmax(-1).tolist()
            for i, p in zip(chunk, pred):
                out[i] = p
    return out


def accuracy(model, probes: Iterable[Probe]) -> dict:
    probes = list(probes)
    if not probes:
        return {"accuracy": float("nan"), "n": 0, "wrong": []}
    preds = next_token_predictions(model, [p[0] for p in probes])
    ok = [pred == ans for pred, (_, ans, _) in zip(preds, probes)]
    wrong = [dict(meta, predicted=pred, expected=ans) for pred, (_, ans, meta), good in zip(preds, probes, ok) if not good]
    return {"accuracy": sum(ok) / len(ok), "n": len(ok), "wrong": wrong[:20]}


class compressed_branch_off:
    """Context manager: every CSA/HCA layer attends its sliding window only."""

    def __init__(self, model) -> None:
        self.attns = [layer.attn for layer in model.layers if layer.attn.compressor is not None]

    def __enter__(self):
        self.old = [a.use_compressed for a in self.attns]
        for a in self.attns:
            a.use_compressed = False
        return self

    def __exit__(self, *exc):
        for a, o in zip(self.attns, self.old):
            a.use_compressed = o
