"""The precision vocabulary, defined once: how a linear runs and where its W4A4 activation scale
comes from. Lives here (layer 2) so that ``QLinear`` (dsv4lab.model) and the policies
(dsv4lab.precision) share the same words; docs/precision.md explains each one.
"""
from __future__ import annotations

import difflib
from enum import StrEnum
from typing import Iterable


class Mode(StrEnum):
    """How one linear runs. ``ORIG`` is a policy word: the linear gets its original weights
    (dsv4lab.precision.Originals) and then runs ``BF16``; a QLinear itself runs LINEAR_MODES."""

    ORIG = "orig"      # original (unquantised) weights swapped in, run as BF16
    BF16 = "bf16"      # weight dequantised once, cached in the compute dtype
    W4A16 = "w4a16"    # quantised weight as stored, dequantised per call
    W4A4 = "w4a4"      # + activations fake-quantised to NVFP4
    W4A8 = "w4a8"      # + activations fake-quantised to FP8 per 128 block (fp32 or power-of-two scales)
    OFFICIAL = "official"  # DeepSeek's reference linear: FP8/FP4 weights get FP8 pow2 activations


class ActScale(StrEnum):
    """Where the W4A4 activation global scale comes from."""

    AMAX = "amax"                # runtime amax(|x|) / (6 * 448)
    INPUT_SCALE = "input_scale"  # the checkpoint's calibrated input_scale


class RoundTrip(StrEnum):
    """One quantisation round trip of DeepSeek's reference inference code (docs/precision.md has
    each equation). A policy switches them on per layer; ``official`` switches on all five."""

    ACT_FP8_POW2 = "act_fp8_pow2"          # FP8/FP4-weight linears: input FP8 e4m3 per 128, 2^k scales
    WEIGHT_BEFORE_W2 = "weight_before_w2"  # routed experts: routing weight times SiLU(gate)*up, then w2
    KV_FP8 = "kv_fp8"                      # window KV and compressed entries: FP8 per 64 on non-RoPE dims
    INDEXER_FP4 = "indexer_fp4"            # indexer q and k: Hadamard rotation, then FP4 per 32
    PROBS_BF16 = "probs_bf16"              # attention probabilities cast to bf16 before P.V


MODES: tuple[Mode, ...] = tuple(Mode)
LINEAR_MODES: tuple[Mode, ...] = (Mode.BF16, Mode.W4A16, Mode.W4A4, Mode.W4A8, Mode.OFFICIAL)
ROUND_TRIPS: tuple[RoundTrip, ...] = tuple(RoundTrip)
ACT_SCALES: tuple[ActScale, ...] = tuple(ActScale)


class UnknownChoiceError(ValueError):
    """A word outside its vocabulary (a mode, an act scale, a policy target); says which, and the
    nearest valid words."""


def unknown_choice(what: str, value, choices: Iterable[str]) -> UnknownChoiceError:
    """The error for ``value`` not being one of ``choices``, with a did-you-mean."""
    choices = [str(c) for c in choices]
    near = difflib.get_close_matches(str(value), choices, n=3, cutoff=0.5)
    hint = f"; did you mean {' or '.join(repr(n) for n in near)}?" if near else ""
    return UnknownChoiceError(f"unknown {what} {value!r}{hint} (choose from {', '.join(choices)})")


def as_mode(value, allowed: Iterable[Mode] = MODES) -> Mode:
    """``value`` as a Mode, if it is one of ``allowed``; else UnknownChoiceError."""
    allowed = tuple(allowed)
    if isinstance(value, str) and value in allowed:
        return Mode(value)
    raise unknown_choice("precision mode", value, allowed)


def as_act_scale(value) -> ActScale:
    if isinstance(value, str) and value in ACT_SCALES:
        return ActScale(value)
    raise unknown_choice("act_scale", value, ACT_SCALES)


def as_round_trip(value) -> RoundTrip:
    if isinstance(value, str) and value in ROUND_TRIPS:
        return RoundTrip(value)
    raise unknown_choice("round trip", value, ROUND_TRIPS)
