"""The input a zoo bug needs to show, carried in its definition so every runner (``triage``, the
``bugzoo`` command, the nightly) builds it the same way from one base prompt.

A :class:`Trigger` says which prompt (any closing-window prompt, or the live one of
``prompts.live_prompt``), which prompt length (a residue modulo a window size: the prompt is cut
to the longest length with that residue), and which input form (``ids``, or ``embeds``: the model
run from ``inputs_embeds``). The weights a bug needs (``Bug.requires``: NVFP4 linears, official
FP8-block ``wo_a``) are put in place here too, in place and undone after, never on a copy.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Iterator

import torch

from ..handles import Restorable
from ..precision import quantized_in_place
from ..quant.weights import FP8_BLOCK, quantize_fp8_block

FORMS = ("ids", "embeds")
WEIGHTS = ("nvfp4", "fp8_wo_a")
ZOO_PROMPT = "the zoo prompt (live_prompt with a tokenizer, else random ids; every CSA/HCA window closes)"
LIVE_PROMPT = ("the live prompt (bugzoo.prompts.live_prompt: natural text on which a routed and the shared "
               "expert's gate pass swiglu_limit)")


@dataclass(frozen=True)
class Trigger:
    """What a bug needs in its input to change the output (see module doc)."""

    prompt: str = ZOO_PROMPT
    residue: tuple[int, int] | None = None  # (modulus, r): prompt length S = r (mod modulus)
    form: str = "ids"

    def __post_init__(self) -> None:
        if self.form not in FORMS:
            raise ValueError(f"Trigger form must be one of {FORMS}, got {self.form!r}")

    def to_dict(self, requires: str | None = None) -> dict:
        length = None if self.residue is None else f"S = {self.residue[1]} mod {self.residue[0]}"
        weights = {"nvfp4": "NVFP4 linears (quantised in memory if plain)",
                   "fp8_wo_a": "official FP8-block wo_a (quantised in memory if plain)"}.get(requires, "as loaded")
        return {"prompt": self.prompt, "length": length, "form": self.form, "weights": weights}

    def describe(self, requires: str | None = None) -> str:
        d = self.to_dict(requires)
        parts = [d["prompt"]] + ([f"length {d['length']}"] if d["length"] else [])
        parts += ["run from inputs_embeds"] if self.form == "embeds" else []
        parts += [f"weights: {d['weights']}"] if requires else []
        return "; ".join(parts)

    def ids(self, ids: torch.Tensor) -> torch.Tensor:
        """``ids`` cut to the longest prefix whose length has the trigger's residue."""
        if self.residue is None:
            return ids
        mod, r = self.residue
        n = ids.shape[-1]
        keep = n - ((n - r) % mod)
        if keep < mod:
            raise ValueError(f"prompt of {n} tokens is too short for a length = {r} mod {mod}: give at least "
                             f"{mod + r} tokens")
        return ids[..., :keep]


# ------------------------------------------------------------------------------ input form
class _PreHook(Restorable):
    """A forward pre-hook on the model, removed by ``restore()`` (no component: ``names`` empty)."""

    def __init__(self, model, fn) -> None:
        self._h = model.register_forward_pre_hook(fn, with_kwargs=True)

    @property
    def names(self) -> list[str]:
        return []

    def restore(self) -> None:
        if self._h is not None:
            self._h.remove()
            self._h = None


def from_embeddings(model) -> Restorable:
    """``model(ids)`` runs as ``model(ids, inputs_embeds=model.embed(ids))`` until restored: the
    same numbers through the embeddings entry (the ids still go along, for the hash routers)."""

    def pre(mod, args, kwargs):
        if kwargs.get("inputs_embeds") is not None or not args or args[0] is None:
            return None
        return args, {**kwargs, "inputs_embeds": mod.embed(args[0])}

    return _PreHook(model, pre)


def drop_ids_from_embeddings(model) -> Restorable:
    """Until restored, a run from ``inputs_embeds`` loses its token ids on the way in (the
    plumbing half of the bug ``hash_expert0_from_embeddings``)."""

    def pre(mod, args, kwargs):
        if kwargs.get("inputs_embeds") is None:
            return None
        kwargs = {k: v for k, v in kwargs.items() if k != "input_ids"}
        return (None,) + tuple(args[1:]), kwargs

    return _PreHook(model, pre)


# ------------------------------------------------------------------------------ weights
def fp8_block_for(out_features: int, in_features: int) -> int:
    """The official 128 block, or a smaller power of two when a side has fewer than two 128
    tiles (a tiny model): a scale-layout bug needs at least a 2x2 grid to show."""
    b = FP8_BLOCK
    while b > 1 and (out_features < 2 * b or in_features < 2 * b):
        b //= 2
    return b


@contextlib.contextmanager
def fp8_in_place(model, suffix: str = ".attn.wo_a", scale_format: str = "fp32") -> Iterator[list[str]]:
    """Plain linears named ``*suffix`` quantised to official FP8-block in place for the body
    (fp32 scales: E8M0 would round neighbouring tiles to one power of two and could hide a
    layout bug); the plain weights are put back on exit."""
    plain = {n: q.weight for n, q in model.qlinears() if n.endswith(suffix) and not q.quantized}
    try:
        for n, q in model.qlinears():
            if n in plain:
                q.set_weight(quantize_fp8_block(q.weight.detach().float(), scale_format,
                                                fp8_block_for(q.out_features, q.in_features)))
        yield list(plain)
    finally:
        for n, q in model.qlinears():
            if n in plain:
                q.set_weight(plain[n])


def weights_in_place(model, requires: str | None):
    """The context putting the weights ``requires`` names in place (nothing for None)."""
    if requires is None:
        return contextlib.nullcontext([])
    if requires == "nvfp4":
        return quantized_in_place(model)
    if requires == "fp8_wo_a":
        return fp8_in_place(model)
    raise ValueError(f"requires must be one of {WEIGHTS} or None, got {requires!r}")
