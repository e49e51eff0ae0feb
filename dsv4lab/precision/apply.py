"""Putting a PrecisionPolicy on a model, in place, and taking it off again.

``orig`` linears get their original (unquantised) weights from an :class:`Originals` source; the
quantised weight they held is put aside on the model (``model.precision_displaced``) and comes
back as soon as a later policy, :func:`restore_precision` or the :func:`using_precision` exit
says so. Only quantised linears are swapped: a plain weight already is the original.
"""
from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, field
from typing import Iterator

import torch

from ..checkpoint.reader import CheckpointReader
from ..model.linear import QLinear
from ..quant.modes import Mode, RoundTrip, unknown_choice
from .policy import PrecisionPolicy, linear_kind, linear_layer


class Originals:
    """Where ``orig`` linears take their original weights from: ``weight(name)`` -> dense
    tensor. A source reads one linear at a time, so it may sit on another checkpoint instead of
    a second model in memory."""

    def weight(self, name: str) -> torch.Tensor:
        raise NotImplementedError

    def weight_on(self, name: str, device: torch.device | str) -> torch.Tensor:
        """``weight(name)`` on ``device``; a source that can read straight there overrides it."""
        return self.weight(name).to(device)

    @staticmethod
    def from_model(reference_model) -> "Originals":
        """The linears of a model holding the original weights (e.g. the BF16 reference)."""
        return ModelOriginals(reference_model)

    @staticmethod
    def from_checkpoint(path_or_reader: "str | os.PathLike | CheckpointReader",
                        dtype: torch.dtype = torch.bfloat16) -> "Originals":
        """The linears of a second checkpoint (official FP8 + MXFP4, or BF16), read one at a time
        by name, dequantised to ``dtype`` on the asking component's device: no second model."""
        return CheckpointOriginals(path_or_reader, dtype)


class ModelOriginals(Originals):
    def __init__(self, model) -> None:
        self.model = model
        self.linears = dict(model.qlinears())

    def weight(self, name: str) -> torch.Tensor:
        if name not in self.linears:
            raise KeyError(f"the originals model has no linear {name!r}")
        return self.linears[name].dense_weight(self.model.dtype).detach()


class CheckpointOriginals(Originals):
    """Originals read lazily from a checkpoint: only the asked linear's tensors are read."""

    def __init__(self, path_or_reader: "str | os.PathLike | CheckpointReader", dtype: torch.dtype) -> None:
        self.reader = path_or_reader if isinstance(path_or_reader, CheckpointReader) else CheckpointReader(path_or_reader)
        self.dtype = dtype
        self.reads: list[str] = []   # linears read so far, in order (what a flow cost in I/O)

    def weight(self, name: str) -> torch.Tensor:
        return self.weight_on(name, "cpu")

    def weight_on(self, name: str, device: torch.device | str) -> torch.Tensor:
        w = self.reader.weight(name, device)   # CheckpointError naming the file if absent
        self.reads.append(name)
        return w.dequantize(self.dtype)

    def __repr__(self) -> str:
        return f"CheckpointOriginals({self.reader.root}, {self.dtype})"


class NoOriginals(Originals):
    def weight(self, name: str) -> torch.Tensor:
        raise ValueError(f"policy mode 'orig' for the quantised linear {name!r} needs originals= "
                         "(e.g. Originals.from_model(reference_model))")


class UnknownTargetError(ValueError):
    """A policy rule that matches no linear of the model (a typo would otherwise change nothing)."""


@dataclass(frozen=True)
class ModelTargets:
    """One walk of the model: its quantised linears and the modules a round trip can switch.
    A 61-layer model has ~7k modules and a walk costs ~30 ms; putting a policy on and taking it
    off used to walk them eight times per evaluation, so the context managers walk once and pass
    this down. Valid while no component is swapped (taken fresh on every call)."""

    linears: list      # (name, QLinear)
    trips: list        # (name, module) with a non-empty ROUND_TRIPS

    @staticmethod
    def of(model) -> "ModelTargets":
        linears, trips = [], []
        for name, m in model.named_modules():
            if isinstance(m, QLinear):
                linears.append((name, m))
            if getattr(m, "ROUND_TRIPS", None):
                trips.append((name, m))
        return ModelTargets(linears, trips)


def _targets(model, targets: ModelTargets | None) -> ModelTargets:
    return ModelTargets.of(model) if targets is None else targets


def linear_kinds(model, targets: ModelTargets | None = None) -> list[str]:
    """The component kinds of the model's linears, in first-seen (execution-ish) order."""
    seen: dict[str, None] = {}
    for name, _ in _targets(model, targets).linears:
        seen.setdefault(linear_kind(name), None)
    return list(seen)


def model_memory(model, targets: ModelTargets | None = None) -> int:
    return sum(ql.memory_bytes() for _, ql in _targets(model, targets).linears)


def check_targets(model, policy: PrecisionPolicy, targets: ModelTargets | None = None) -> None:
    """UnknownTargetError (with did-you-mean over the model's kinds) for a rule matching no linear."""
    targets = _targets(model, targets)
    linears = [(name, linear_kind(name), linear_layer(name)) for name, _ in targets.linears]
    for r in policy.rules:
        if not any(r.matches(name, kind, layer) for name, kind, layer in linears):
            err = unknown_choice("policy target", r.target, linear_kinds(model, targets))
            where = "" if r.layers is None else f" in layers {sorted(r.layers, key=lambda l: -1 if l is None else l)}"
            raise UnknownTargetError(f"{err} -- the rule {r.describe()!r} matches no linear of the model{where}")


def round_trip_modules(model) -> list:
    """(name, module) of every module a round trip can switch (``ROUND_TRIPS`` non-empty):
    QLinears, attentions, compressors, indexers, routed experts."""
    return ModelTargets.of(model).trips


def check_round_trips(model, policy: PrecisionPolicy, targets: ModelTargets | None = None) -> None:
    """ValueError naming the round trip, the size and the fix when the model cannot run one:
    ``indexer_fp4`` rotates by a Hadamard transform (power-of-two size) and rounds per 32."""
    d = model.config.index_head_dim
    if (d % 32 or d & (d - 1)) and any(
            RoundTrip.INDEXER_FP4 in policy.round_trips_for(linear_layer(n)) for n, m in _targets(model, targets).trips
            if isinstance(getattr(m, "ROUND_TRIPS", None), tuple) and RoundTrip.INDEXER_FP4 in m.ROUND_TRIPS):
        raise ValueError(f"round trip 'indexer_fp4' needs index_head_dim a power of two and a multiple of 32, "
                         f"this model has {d}; switch it off (e.g. {{'default': 'official', 'indexer_fp4': False}})")


def set_round_trips(model, policy: PrecisionPolicy, targets: ModelTargets | None = None) -> list:
    """Each module's ``round_trips`` = the policy's round trips on for its layer that it has.
    Returns (name, before, after) of the modules that changed."""
    changed = []
    for name, m in _targets(model, targets).trips:
        on = policy.round_trips_for(linear_layer(name)) & frozenset(m.ROUND_TRIPS)
        if on != m.round_trips:
            changed.append((name, m.round_trips, on))
            m.round_trips = on
    return changed


def displaced(model) -> dict:
    """name -> the quantised weight an ``orig`` swap put aside (held on the model)."""
    d = model.__dict__.get("precision_displaced")
    if d is None:
        d = model.__dict__["precision_displaced"] = {}
    return d


def apply_precision(model, policy, originals: Originals | None = None, targets: ModelTargets | None = None) -> dict:
    """Set every linear's mode (and, for ``orig``, its weight); dense caches build lazily on the
    next forward. All or nothing: on an error the model is left as it was. Returns a report with
    the linears whose mode changed and the weight memory before/after (after = once each
    ``bf16``/``orig`` linear holds its dense copy)."""
    policy = PrecisionPolicy.parse(policy)
    targets = _targets(model, targets)
    check_targets(model, policy, targets)
    check_round_trips(model, policy, targets)
    plan = [(name, ql, *policy.mode_for(name)) for name, ql in targets.linears]
    aside = displaced(model)
    if originals is None:
        originals = NoOriginals()
        for name, ql, mode, _ in plan:
            if mode == Mode.ORIG and ql.quantized and name not in aside:
                originals.weight(name)  # raises: say so before anything changed
    saved = precision_state(model, targets)
    before = model_memory(model, targets)
    changed = []
    after = 0
    try:
        for name, ql, mode, act in plan:
            was = (Mode.ORIG if name in aside else ql.mode, ql.act_scale)
            if mode == Mode.ORIG:
                if name not in aside and ql.quantized:
                    w = originals.weight_on(name, ql.qweight.device).to(device=ql.qweight.device, dtype=model.dtype)
                    aside[name] = ql.qweight
                    ql.set_weight(w)
                ql.set_mode(Mode.BF16, act)
            else:
                if name in aside:
                    ql.set_weight(aside.pop(name))
                ql.set_mode(mode, act)
            if was != (mode, act):
                changed.append((name, was[0], mode))
            held = aside.get(name, ql.qweight)
            if held is not None and ql.mode == Mode.BF16:
                after += held.nbytes + ql.out_features * ql.in_features * model.dtype.itemsize
            else:
                after += ql.memory_bytes()
        trips = set_round_trips(model, policy, targets)
    except BaseException:
        restore_precision(model, saved, targets)
        raise
    model.precision_policy = policy
    return {"changed": changed, "round_trips_changed": trips, "bytes_before": before, "bytes_after": after, "delta_bytes": after - before}


@dataclass(eq=False)
class PrecisionState:
    """What :func:`restore_precision` puts back: every linear's (mode, act_scale), the weights
    ``orig`` swaps displaced (and the originals they hold), every module's round trips and the
    model's policy."""

    modes: dict                                        # name -> (mode, act_scale)
    swapped: dict = field(default_factory=dict)        # name -> (displaced qweight, original weight held)
    policy: PrecisionPolicy | None = None
    round_trips: dict = field(default_factory=dict)    # module name -> frozenset of RoundTrip

    def __eq__(self, other) -> bool:
        return isinstance(other, PrecisionState) and self.modes == other.modes and \
            set(self.swapped) == set(other.swapped) and self.round_trips == other.round_trips


def precision_state(model, targets: ModelTargets | None = None) -> PrecisionState:
    """Every linear's mode and swapped weight, to put back with :func:`restore_precision`."""
    aside = displaced(model)
    targets = _targets(model, targets)
    lin = dict(targets.linears)
    return PrecisionState({name: (ql.mode, ql.act_scale) for name, ql in lin.items()},
                          {name: (qw, lin[name].weight) for name, qw in aside.items()},
                          model.__dict__.get("precision_policy"),
                          {name: m.round_trips for name, m in targets.trips})


def restore_precision(model, saved: PrecisionState, targets: ModelTargets | None = None) -> None:
    """Put back what :func:`precision_state` saw: modes, quantised weights, ``orig`` swaps."""
    aside = displaced(model)
    targets = _targets(model, targets)
    for name, ql in targets.linears:
        if name in aside and name not in saved.swapped:
            ql.set_weight(aside.pop(name))
        elif name in saved.swapped and aside.get(name) is not saved.swapped[name][0]:
            qw, original = saved.swapped[name]
            if name in aside:
                ql.set_weight(aside.pop(name))
            aside[name] = qw
            ql.set_weight(original.detach())
        if name in saved.modes:
            ql.set_mode(*saved.modes[name])
    for name, m in targets.trips:
        m.round_trips = saved.round_trips.get(name, frozenset())
    if saved.policy is None:
        model.__dict__.pop("precision_policy", None)
    else:
        model.precision_policy = saved.policy


@contextlib.contextmanager
def using_precision(model, policy, originals: Originals | None = None) -> Iterator[dict]:
    """``with using_precision(model, policy, originals=...) as report:`` -- the policy in place for
    the body; modes and swapped weights are put back on exit, also on an exception."""
    targets = ModelTargets.of(model)
    saved = precision_state(model, targets)
    try:
        yield apply_precision(model, policy, originals, targets)
    finally:
        restore_precision(model, saved, targets)


__all__ = ["CheckpointOriginals", "ModelOriginals", "ModelTargets", "Originals", "PrecisionState", "UnknownTargetError",
           "apply_precision", "check_targets", "displaced", "round_trip_modules", "set_round_trips", "linear_kinds", "model_memory", "precision_state",
           "restore_precision", "using_precision"]
