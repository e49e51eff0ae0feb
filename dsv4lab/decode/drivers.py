"""Pick a decode driver by name: what ``generate(decode=...)`` and ``model.decoder(...)`` take.

- ``eager``: ``model.decode_step``; every hook fires, nothing is captured.
- ``graph``: :class:`~dsv4lab.decode.graphs.GraphDecoder`, one CUDA graph per device; fastest,
  but only taps follow a replay (other Python hooks fired once, at capture).
- ``layer-graphs``: :class:`~dsv4lab.decode.layer_graphs.LayerGraphDecoder`, one CUDA graph per
  unhooked layer and the hooked layers eager; every hook fires, at close to graph speed.
"""
from __future__ import annotations

from typing import Callable

import torch

from ..model.state import DecodeState
from ..quant.modes import unknown_choice
from .graphs import GraphDecoder
from .layer_graphs import LayerGraphDecoder

DECODE_MODES = ("eager", "graph", "layer-graphs")

StepFn = Callable[[torch.Tensor, DecodeState], torch.Tensor]


def check_decode_mode(mode: str) -> None:
    if mode not in DECODE_MODES:
        raise unknown_choice("decode mode (argument decode)", mode, DECODE_MODES)


def decoder(model, state: DecodeState, mode: str = "layer-graphs") -> StepFn:
    """The ``step(ids, state) -> logits`` of decode driver ``mode`` over ``state``."""
    check_decode_mode(mode)
    if mode == "eager":
        return model.decode_step
    if mode == "graph":
        return GraphDecoder(model, state).step
    return LayerGraphDecoder(model, state).step
