"""Precision policies: (component kind, layer) -> how each linear runs; see docs/precision.md.

* the words (``orig``, ``bf16``, ``w4a16``, ``w4a4``, ``w4a8``, ``official``; act scale ``amax``
  / ``input_scale``; the official round trips): :class:`Mode`, :class:`ActScale`,
  :class:`RoundTrip` (defined once in dsv4lab.quant.modes, which the model shares);
* :class:`PrecisionPolicy` (policy.py): a default plus ordered rules, the last match wins;
* apply.py: :func:`apply_precision`, :func:`precision_state` / :func:`restore_precision`, the
  :func:`using_precision` context manager, :class:`Originals` for ``orig``;
* quantize.py: in-memory quantise / dequantise; sweep.py (imported on its own, it needs
  dsv4lab.analysis): the one-at-a-time sweep and the greedy precision floor.
"""
from __future__ import annotations

from ..quant.modes import ACT_SCALES, LINEAR_MODES, MODES, ROUND_TRIPS, ActScale, Mode, RoundTrip, UnknownChoiceError
from .apply import (
    CheckpointOriginals,
    ModelOriginals,
    Originals,
    PrecisionState,
    UnknownTargetError,
    apply_precision,
    check_targets,
    linear_kinds,
    model_memory,
    precision_state,
    restore_precision,
    using_precision,
)
from .policy import PrecisionPolicy, Rule, linear_kind, linear_layer
from .quantize import dequantize_linears, quantize_linears, quantized_in_place, select_linears

__all__ = ["ACT_SCALES", "LINEAR_MODES", "MODES", "ROUND_TRIPS", "ActScale", "Mode", "RoundTrip", "UnknownChoiceError",
           "CheckpointOriginals", "ModelOriginals", "Originals", "PrecisionState", "UnknownTargetError", "apply_precision", "check_targets",
           "linear_kinds", "model_memory", "precision_state", "restore_precision", "using_precision",
           "PrecisionPolicy", "Rule", "linear_kind", "linear_layer",
           "dequantize_linears", "quantize_linears", "quantized_in_place", "select_linears"]
