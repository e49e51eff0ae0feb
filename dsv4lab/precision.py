"""Precision policies: (component kind, layer) -> how each linear runs.

A policy is a default mode plus ordered rules; the LAST matching rule wins. A rule's target is a
component kind (``head``, ``router``, ``experts``, ``attn.wq_a``, ``compressor.*``,
``indexer.wq_b`` ...; see docs/naming.md) or a dotted-name pattern (``layers.3.attn.*``), with an
optional layer set. Modes: ``bf16`` (dense cached; the compute dtype), ``w4a16``, ``w4a4``,
``w4a8``; ``act_scale`` picks the W4A4 activation global scale: ``amax`` (runtime) or
``input_scale`` (checkpoint).
"""
from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field
from typing import Iterable, Mapping

from .model.linear import QLinear


def linear_kind(name: str) -> str:
    """Component kind of a linear's dotted name (``layers.3.mlp.experts.7.w1`` -> ``experts``)."""
    from .checkpoint.names import component_kind

    return component_kind(name + ".weight")


def linear_layer(name: str) -> int | None:
    parts = name.split(".")
    return int(parts[1]) if parts[0] == "layers" else None


@dataclass
class Rule:
    target: str
    mode: str
    layers: frozenset[int] | None = None
    act_scale: str | None = None

    def matches(self, name: str, kind: str, layer: int | None) -> bool:
        if self.layers is not None and layer not in self.layers:
            return False
        return fnmatch.fnmatchcase(kind, self.target) or fnmatch.fnmatchcase(name, self.target)


@dataclass
class PrecisionPolicy:
    default: str = "w4a16"
    rules: list[Rule] = field(default_factory=list)
    act_scale: str = "amax"

    @classmethod
    def parse(cls, spec) -> "PrecisionPolicy":
        """A mode string, a {target: mode} mapping, or a policy."""
        if isinstance(spec, PrecisionPolicy):
            return spec
        if isinstance(spec, str):
            return cls(default=spec)
        if isinstance(spec, Mapping):
            spec = dict(spec)
            default = spec.pop("default", "w4a16")
            act = spec.pop("act_scale", "amax")
            return cls(default=default, rules=[Rule(k, v) for k, v in spec.items()], act_scale=act)
        raise TypeError(f"cannot make a precision policy from {type(spec).__name__}")

    def with_rule(self, target: str, mode: str, layers: Iterable[int] | None = None) -> "PrecisionPolicy":
        return PrecisionPolicy(self.default, self.rules + [Rule(target, mode, None if layers is None else frozenset(layers))],
                               self.act_scale)

    def mode_for(self, name: str) -> tuple[str, str]:
        kind, layer = linear_kind(name), linear_layer(name)
        mode, act = self.default, self.act_scale
        for r in self.rules:
            if r.matches(name, kind, layer):
                mode, act = r.mode, r.act_scale or act
        return mode, act

    def describe(self) -> str:
        parts = [f"default={self.default}"] + [f"{r.target}{'' if r.layers is None else sorted(r.layers)}={r.mode}" for r in self.rules]
        return ", ".join(parts)


def model_memory(model) -> int:
    return sum(ql.memory_bytes() for _, ql in model.qlinears())


def apply_precision(model, policy) -> dict:
    """Set every linear's mode; dense caches build lazily on the next forward. Returns a report
    with the linears whose mode changed and the weight memory before/after (after = once each
    ``bf16`` linear has built its dense copy)."""
    policy = PrecisionPolicy.parse(policy)
    before = model_memory(model)
    changed = []
    after = 0
    for name, ql in model.qlinears():
        mode, act = policy.mode_for(name)
        mode = "dense" if mode == "bf16" else mode
        if (ql.mode, ql.act_scale) != (mode, act):
            changed.append((name, ql.mode, mode))
        ql.set_mode(mode, act)
        if ql.quantized and mode == "dense":
            after += ql.qweight.nbytes + ql.out_features * ql.in_features * model.dtype.itemsize
        else:
            after += ql.memory_bytes()
    model.precision_policy = policy
    return {"changed": changed, "bytes_before": before, "bytes_after": after, "delta_bytes": after - before}


# ------------------------------------------------------------------------------ helpers
def linear_kinds(model) -> list[str]:
    """The component kinds of the model's linears, in first-seen (execution-ish) order."""
    seen: dict[str, None] = {}
    for name, _ in model.qlinears():
        seen.setdefault(linear_kind(name), None)
    return list(seen)


def precision_state(model) -> dict:
    """Every linear's (mode, act_scale), to put back with :func:`restore_precision`."""
    return {name: (ql.mode, ql.act_scale) for name, ql in model.qlinears()}


def restore_precision(model, saved: dict) -> None:
    for name, ql in model.qlinears():
        if name in saved:
            mode, act = saved[name]
            ql.set_mode(mode, act)
    model.__dict__.pop("precision_policy", None)


def _select_linears(model, kinds=None, pattern=None):
    kinds = None if kinds is None else ({kinds} if isinstance(kinds, str) else set(kinds))
    for name, ql in model.qlinears():
        if kinds is not None and linear_kind(name) not in kinds:
            continue
        if pattern is not None and not fnmatch.fnmatchcase(name, pattern):
            continue
        yield name, ql


def quantize_linears(model, kinds=None, fmt: str = "nvfp4", pattern: str | None = None,
                     input_scale: float | None = None) -> list[str]:
    """Quantise plain linear weights in memory (tests / what-if studies before a checkpoint
    exists): every linear, or those of ``kinds`` / matching ``pattern``. ``fmt``: ``nvfp4``
    (ModelOpt recipe, global scale amax/(6*448)), ``mxfp4`` or ``fp8``. Linears already quantised,
    or whose in_features the format cannot block, are left alone. Returns the names changed."""
    from .quant import weights as W

    qfn = {"nvfp4": lambda w: W.quantize_nvfp4(w, input_scale=input_scale), "mxfp4": W.quantize_mxfp4,
           "fp8": W.quantize_fp8_block}[fmt]
    block = {"nvfp4": 16, "mxfp4": 32, "fp8": 1}[fmt]
    done = []
    for name, ql in _select_linears(model, kinds, pattern):
        if ql.quantized or ql.in_features % block:
            continue
        ql.set_weight(qfn(ql.weight.detach().float()))
        done.append(name)
    return done


def dequantize_linears(model, dtype=None) -> list[str]:
    """Replace every quantised linear weight by its dequantised plain tensor (in ``dtype``,
    default the model dtype). Returns the names changed."""
    dtype = dtype or model.dtype
    done = []
    for name, ql in model.qlinears():
        if ql.quantized:
            ql.set_weight(ql.qweight.dequantize(dtype).to(ql.qweight.device))
            done.append(name)
    return done
