"""PrecisionPolicy: (linear name, component kind, layer) -> (mode, act_scale).

A policy is a default mode plus ordered rules; the LAST matching rule wins. A rule targets a
component kind (``head``, ``router``, ``experts``, ``attn.wq_a``, ``compressor.*`` ...; see
docs/naming.md) or a dotted-name fnmatch pattern (``layers.3.attn.*``), with an optional layer
set (``None`` in it stands for the global linears, e.g. ``head``). Modes and act scales are the
words of dsv4lab.quant.modes.

Round trips (``RoundTrip``: ``act_fp8_pow2``, ``weight_before_w2``, ``kv_fp8``, ``indexer_fp4``,
``probs_bf16``) are switches on top of the modes, each on for all layers or a layer set. The
word ``official`` as a whole policy (or as a mapping's ``default``) means ``w4a16`` with all five
round trips on: what DeepSeek's reference inference code computes (so ``{"default": "official",
"kv_fp8": False}`` is the reference without one of them). As a rule's mode, ``official`` puts
those linears in the official linear (``act_fp8_pow2`` for them; routed experts also take the
routing weight before w2).
"""
from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field, replace
from typing import Iterable, Mapping

from ..checkpoint.names import layer_of, module_kind
from ..quant.modes import ROUND_TRIPS, ActScale, Mode, RoundTrip, as_act_scale, as_mode, as_round_trip


def linear_kind(name: str) -> str:
    """Component kind of a linear's dotted module name (``layers.3.mlp.experts.7.w1`` -> ``experts``)."""
    return module_kind(name)


def linear_layer(name: str) -> int | None:
    """Layer index of a linear's dotted module name, ``None`` for the global ones (``head``)."""
    return layer_of(name)


@dataclass(frozen=True)
class Rule:
    target: str                           # component kind or dotted-name fnmatch pattern
    mode: Mode
    layers: frozenset | None = None       # layer indices (None inside = global linears); None = all
    act_scale: ActScale | None = None     # None: the policy's

    def __post_init__(self) -> None:
        object.__setattr__(self, "mode", as_mode(self.mode))
        if self.act_scale is not None:
            object.__setattr__(self, "act_scale", as_act_scale(self.act_scale))
        if self.layers is not None:
            object.__setattr__(self, "layers", frozenset(self.layers))

    def matches(self, name: str, kind: str, layer: int | None) -> bool:
        if self.layers is not None and layer not in self.layers:
            return False
        return fnmatch.fnmatchcase(kind, self.target) or fnmatch.fnmatchcase(name, self.target)

    def describe(self) -> str:
        where = "" if self.layers is None else \
            "[" + ",".join("global" if l is None else f"L{l}" for l in sorted(self.layers, key=_layer_key)) + "]"
        return f"{self.target}{where}={self.mode}"


@dataclass
class PrecisionPolicy:
    default: Mode = Mode.W4A16
    rules: list[Rule] = field(default_factory=list)
    act_scale: ActScale = ActScale.AMAX
    round_trips: dict = field(default_factory=dict)   # RoundTrip -> frozenset of layers | None (all)

    def __post_init__(self) -> None:
        self.default = as_mode(self.default)
        self.act_scale = as_act_scale(self.act_scale)
        self.round_trips = {as_round_trip(k): None if v is None else frozenset(v) for k, v in dict(self.round_trips).items()}

    @classmethod
    def official(cls) -> "PrecisionPolicy":
        """What DeepSeek's reference computes: ``w4a16`` with all five round trips on."""
        return cls(default=Mode.W4A16, round_trips={rt: None for rt in ROUND_TRIPS})

    @classmethod
    def parse(cls, spec) -> "PrecisionPolicy":
        """A mode string, a policy, or a mapping: ``default`` / ``act_scale`` keys, ``target: mode``
        and ``(target, layer): mode`` entries (rules in the mapping's order).
        A round-trip name as the whole spec is ``w4a16`` plus that round trip; in a mapping,
        ``name: True | False | [layers]`` and ``(name, layer): True`` switch round trips, and
        ``round_trips: [names]`` switches several on. ``official`` (whole spec or default) also
        switches all five on, unless the mapping says ``name: False``."""
        if isinstance(spec, PrecisionPolicy):
            return spec
        if isinstance(spec, str):
            if spec == Mode.OFFICIAL:
                return cls.official()
            if spec in ROUND_TRIPS:
                return cls(round_trips={spec: None})
            return cls(default=spec)
        if isinstance(spec, Mapping):
            spec = dict(spec)
            default = spec.pop("default", Mode.W4A16)
            act = spec.pop("act_scale", ActScale.AMAX)
            trips: dict = {rt: None for rt in ROUND_TRIPS} if default == Mode.OFFICIAL else {}
            default = Mode.W4A16 if default == Mode.OFFICIAL else default
            for name in spec.pop("round_trips", ()):
                trips[as_round_trip(name)] = None
            rules = []
            for k, v in spec.items():
                target = k[0] if isinstance(k, tuple) else k
                if target in ROUND_TRIPS:
                    cls._switch(trips, RoundTrip(target), v if not isinstance(k, tuple) else ([k[1]] if v else False))
                elif isinstance(k, tuple):
                    rules.append(Rule(k[0], v, frozenset([k[1]])))
                else:
                    rules.append(Rule(k, v))
            return cls(default=default, rules=rules, act_scale=act, round_trips=trips)
        raise TypeError(f"cannot make a precision policy from {type(spec).__name__}")

    @staticmethod
    def _switch(trips: dict, rt: RoundTrip, value) -> None:
        """trips[rt] from a mapping value: True (all layers), False (off) or layers (added)."""
        if value is True:
            trips[rt] = None
        elif value is False or value is None:
            trips.pop(rt, None)
        else:
            if trips.get(rt, frozenset()) is None:  # already on everywhere
                return
            trips[rt] = frozenset(trips.get(rt, frozenset())) | frozenset(value)

    def with_round_trip(self, name: str, on=True) -> "PrecisionPolicy":
        """A copy with round trip ``name`` switched: True (all layers), False (off) or a layer set."""
        trips = dict(self.round_trips)
        self._switch(trips, as_round_trip(name), on if isinstance(on, bool) else list(on))
        return replace(self, rules=list(self.rules), round_trips=trips)

    def round_trips_for(self, layer: int | None) -> frozenset:
        """The round trips on for ``layer`` (``None``: the global components)."""
        return frozenset(rt for rt, ls in self.round_trips.items() if ls is None or layer in ls)

    def with_rule(self, target: str, mode: str, layers: Iterable | None = None) -> "PrecisionPolicy":
        """A copy with one more rule at the end (it wins over every earlier one)."""
        return replace(self, rules=self.rules + [Rule(target, mode, None if layers is None else frozenset(layers))])

    def set(self, target: str, mode: str, layers: Iterable | None = None) -> "PrecisionPolicy":
        """A copy whose rule for exactly (target, layers) is ``mode``: replaced where it stands,
        else added; a new rule for all layers goes before the per-layer ones, so per-layer
        overrides stay stronger than per-kind modes whatever order they were set in."""
        rule = Rule(target, mode, None if layers is None else frozenset(layers))
        rules = list(self.rules)
        for i, r in enumerate(rules):
            if (r.target, r.layers) == (rule.target, rule.layers):
                rules[i] = rule
                return replace(self, rules=rules)
        at = next((i for i, r in enumerate(rules) if r.layers is not None), len(rules)) if rule.layers is None else len(rules)
        rules.insert(at, rule)
        return replace(self, rules=rules)

    def unset(self, target: str, layers: Iterable | None = None) -> "PrecisionPolicy":
        """A copy without the rule for exactly (target, layers)."""
        key = (target, None if layers is None else frozenset(layers))
        return replace(self, rules=[r for r in self.rules if (r.target, r.layers) != key])

    def rule_for(self, target: str, layers: Iterable | None = None) -> Rule | None:
        key = (target, None if layers is None else frozenset(layers))
        return next((r for r in self.rules if (r.target, r.layers) == key), None)

    def mode_for(self, name: str) -> tuple[Mode, ActScale]:
        mode, act, _ = self.resolve(name)
        return mode, act

    def resolve(self, name: str) -> tuple[Mode, ActScale, int | None]:
        """(mode, act_scale, index of the winning rule or None for the default) of one linear."""
        kind, layer = linear_kind(name), linear_layer(name)
        mode, act, won = self.default, self.act_scale, None
        for i, r in enumerate(self.rules):
            if r.matches(name, kind, layer):
                mode, act, won = r.mode, r.act_scale or act, i
        return mode, act, won

    def uses(self, mode: Mode) -> bool:
        return self.default == mode or any(r.mode == mode for r in self.rules)

    def describe(self) -> str:
        trips = []
        for rt in ROUND_TRIPS:
            if rt in self.round_trips:
                ls = self.round_trips[rt]
                trips.append(str(rt) if ls is None else
                             f"{rt}[" + ",".join("global" if l is None else f"L{l}" for l in sorted(ls, key=_layer_key)) + "]")
        return ", ".join([f"default={self.default}"] + [r.describe() for r in self.rules] + trips)


def _layer_key(layer):
    return -1 if layer is None else layer
