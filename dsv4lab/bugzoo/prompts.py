"""Prompts on which every zoo bug is live.

A bug only shows where its code path changes numbers: the SwiGLU clamp-order bugs need an
expert (or the shared expert) whose gate/up pre-activation passes ``swiglu_limit`` somewhere in
the prompt, and random tokens rarely drive a trained model there. ``live_prompt`` builds a
natural prompt from the seeded corpus (retrieval documents: long enough for every CSA/HCA window
to close) and adds documents until the routed and the shared expert both cross the limit.
"""
from __future__ import annotations

import torch

from ..text import corpus
from ..text.tokenizer import load_tokenizer


def clamp_liveness(model, ids: torch.Tensor) -> dict[str, bool]:
    """Whether any routed / shared expert GATE pre-activation passes ``swiglu_limit`` on ``ids``
    (the clamp-order bugs differ from the reference only there: silu(g).clamp(L) != silu(clamp(g, L)))."""
    limit = model.config.swiglu_limit
    live = {"experts": False, "shared_expert": False}
    handles = []

    def watch(kind):
        def hook(mod, inp, out):
            if not live[kind] and bool((out.detach() > limit).any()):
                live[kind] = True
        return hook

    for layer in model.layers:
        for e in range(len(layer.mlp.experts)):
            handles.append(layer.mlp.experts[e].w1.register_forward_hook(watch("experts")))
        if layer.mlp.shared_expert is not None:
            handles.append(layer.mlp.shared_expert.w1.register_forward_hook(watch("shared_expert")))
    try:
        with torch.no_grad():
            model(ids.to(model.device))
    finally:
        for h in handles:
            h.remove()
    return live


def live_prompt(model, tokenizer=None, seed: int = 1234, max_docs: int = 48) -> torch.Tensor:
    """A [1, S] natural prompt (corpus retrieval documents) on which the clamp bugs are live."""
    tok = tokenizer or load_tokenizer()
    docs = [list(p[0]) for p in corpus.eval_sets(tok, seed=seed)["retrieval"][:max_docs]]
    chosen: list[list[int]] = []
    live = {"experts": False, "shared_expert": False}
    for d in docs:
        ids = torch.tensor([d])
        gain = {k: v for k, v in clamp_liveness(model, ids).items() if v and not live[k]}
        if gain or not chosen:
            chosen.append(d)
            live.update(gain)
        if all(live.values()):
            break
    return torch.tensor([sum(chosen, [])])
