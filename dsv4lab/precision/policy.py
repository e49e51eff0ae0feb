"""PrecisionPolicy: (linear name, component kind, layer) -> (mode, act_scale).

A policy is a default mode plus ordered rules; the LAST matching rule wins. A rule targets a
component kind (``head``, ``router``, ``experts``, ``attn.wq_a``, ``compressor.*`` ...; see
docs/naming.md) or a dotted-name fnmatch pattern (``layers.3.attn.*``), with an optional layer
set (``None`` in it stands for the global linears, e.g. ``head``). Modes and act scales are the
words of dsv4lab.quant.modes.
"""
from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field, replace
from typing import Iterable, Mapping

from ..checkpoint.names import layer_of, module_kind
from ..quant.modes import ActScale, Mode, as_act_scale, as_mode


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

    def __post_init__(self) -> None:
        self.default = as_mode(self.default)
        self.act_scale = as_act_scale(self.act_scale)

    @classmethod
    def parse(cls, spec) -> "PrecisionPolicy":
        """A mode string, a policy, or a mapping: ``default`` / ``act_scale`` keys, ``target: mode``
        and ``(target, layer): mode`` entries (rules in the mapping's order)."""
        if isinstance(spec, PrecisionPolicy):
            return spec
        if isinstance(spec, str):
            return cls(default=spec)
        if isinstance(spec, Mapping):
            spec = dict(spec)
            default = spec.pop("default", Mode.W4A16)
            act = spec.pop("act_scale", ActScale.AMAX)
            rules = [Rule(k[0], v, frozenset([k[1]])) if isinstance(k, tuple) else Rule(k, v) for k, v in spec.items()]
            return cls(default=default, rules=rules, act_scale=act)
        raise TypeError(f"cannot make a precision policy from {type(spec).__name__}")

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
        return ", ".join([f"default={self.default}"] + [r.describe() for r in self.rules])


def _layer_key(layer):
    return -1 if layer is None else layer
