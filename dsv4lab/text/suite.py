"""The prompt suite: the inputs that break DSV4 implementations in practice, as named [1, S] ids.

* ``plain`` -- a completion prompt (BOS + "The capital of France is");
* ``chat`` / ``thinking`` -- the same question in the DSV4 chat encoding, ending
  ``<｜Assistant｜></think>`` / ``<｜Assistant｜><think>``;
* ``retrieval`` -- a document cut right before a recalled value that was planted more than
  ``2 * sliding_window`` tokens earlier: only the compressed entries (CSA/HCA) can reach it;
* ``len_<S>`` -- natural text cut to length S, one S for every residue modulo the lcm of the
  config's compression ratios (so every residue mod each ratio: window-boundary bugs show for one
  residue only). Lengths start at a multiple of that lcm past the sliding window and two of the
  largest windows, so every compressor has closed entries.

Every prompt starts with BOS; the texts are the seeded toy corpus (``corpus``), tokenised with the
model's tokenizer (the embedded one by default).
"""
from __future__ import annotations

import math

import torch

from ..config import DSV4Config
from .chat import BOS
from .corpus import ToyWorld, make_retrieval_samples
from .tokenizer import encode_chat, load_tokenizer

MIN_LENGTH = 64


def compression_ratios(config: DSV4Config) -> list[int]:
    """The distinct compression ratios of the config's CSA/HCA layers, ascending."""
    return sorted({config.compress_ratio(i) for i in range(config.num_hidden_layers)} - {0})


def residue_lengths(config: DSV4Config) -> list[int]:
    """One prompt length per residue modulo lcm(ratios), starting at a multiple of it that lets
    every window close and exceeds the sliding window."""
    ratios = compression_ratios(config) or [1]
    period = math.lcm(*ratios)
    need = max(MIN_LENGTH, 2 * max(ratios), config.sliding_window + 1)
    base = period * math.ceil(need / period)
    return [base + r for r in range(period)]


def _config(model_or_config) -> DSV4Config:
    cfg = model_or_config if isinstance(model_or_config, DSV4Config) else getattr(model_or_config, "config", None)
    if not isinstance(cfg, DSV4Config):
        raise TypeError(f"prompt_suite takes a model (with .config) or a DSV4Config, "
                        f"got {type(model_or_config).__name__}")
    return cfg


def _ids(tok, text: str) -> list[int]:
    return list(tok.encode(text, add_special_tokens=False))


def prompt_suite(model_or_config, tokenizer=None, seed: int = 0) -> dict[str, torch.Tensor]:
    """Named [1, S] long tensors (CPU; move with ``.to(model.device)``): see the module doc.
    ``tokenizer``: default the model's (``model.source``) if it has one, else the embedded model's."""
    cfg = _config(model_or_config)
    if tokenizer is None:
        src = getattr(model_or_config, "source", None)
        try:
            tokenizer = load_tokenizer(src) if src else load_tokenizer()
        except FileNotFoundError:
            tokenizer = load_tokenizer()
    world = ToyWorld()
    country = world.countries[seed % len(world.countries)]
    question = world.question(country, "capital")
    out = {"plain": _ids(tokenizer, BOS + world.fact(country, "capital", 0)[0]),
           "chat": encode_chat(tokenizer, question, "chat"),
           "thinking": encode_chat(tokenizer, question, "thinking")}
    window = cfg.sliding_window
    lengths = residue_lengths(cfg)
    seq_len = _doc_len(cfg)
    doc = _retrieval_doc(cfg, tokenizer, seed, world)
    out["retrieval"] = doc.ids[: doc.meta["queries"][0]["answer_pos"]]
    text: list[int] = []
    k = 0
    while len(text) < lengths[-1]:  # natural text: retrieval documents back to back
        more = make_retrieval_samples(4, seq_len, 2 * window + 1, seed + 1 + k, tokenizer=tokenizer,
                                      modes=("plain",), world=world)
        text += sum((d.ids if not text else d.ids[1:] for d in more), [])  # one BOS, at the start
        k += 1
    for n in lengths:
        out[f"len_{n}"] = text[:n]
    return {name: torch.tensor([ids], dtype=torch.long) for name, ids in out.items()}


def _doc_len(cfg: DSV4Config) -> int:
    return max(512, 4 * cfg.sliding_window + 192)


def _retrieval_doc(cfg: DSV4Config, tokenizer, seed: int, world: ToyWorld):
    return make_retrieval_samples(1, _doc_len(cfg), 2 * cfg.sliding_window + 1, seed, tokenizer=tokenizer,
                                  modes=("plain",), n_queries=(1, 1), world=world)[0]


def retrieval_distance(model_or_config, tokenizer=None, seed: int = 0) -> int:
    """How far back (tokens) the ``retrieval`` prompt's answer was planted (same seed, same
    tokenizer as :func:`prompt_suite`)."""
    doc = _retrieval_doc(_config(model_or_config), tokenizer or load_tokenizer(), seed, ToyWorld())
    return int(doc.meta["queries"][0]["distance"])
