"""Engine names and layouts -> dsv4lab hook points (docs/dumps.md, "Mapping").

A mapping is JSON: ``{"description": ..., "rules": [...], "ignore": [regex, ...]}``. A rule::

    {"engine": "blk\\.(?P<layer>\\d+)\\.attn_out\\.rank(?P<rank>\\d+)",   # regex, whole name
     "hook": "layers.{layer}.attn.hook_out",                              # named groups fill it
     "item": 0,               # optional: element 0 of a tuple output, written NAME.0 (or NAME alone)
     "shards": "cat:-1",      # with a (?P<rank>...) group: "sum" or "cat:DIM" of ranks 0..R-1
     "ops": [{"transpose": [1, 2]}, {"unflatten": [-1, ["num_attention_heads", "head_dim"]]},
             {"dtype": "float32"}]}

Rules are tried in order; the first that matches a name wins. Ops run after the shards are put
together, in order: ``transpose [a,b]``, ``permute [...]``, ``reshape [...]`` (0 keeps that input
dim, -1 infers), ``unflatten [dim, [sizes]]``, ``flatten [start, end]``, ``select [dim, index]``,
``squeeze dim``, ``unsqueeze dim``, ``pad [dim, size, value]`` (pad that dim at its end up to
size; size ``"ref"`` = the reference's size there), ``dtype NAME``; a size may be a config field
name (``"head_dim"``). ``--mapping hf`` is :data:`BUILTIN` ``hf`` (transformers' module names), the
worked example in ``dsv4lab/dump/mappings/hf.json``.
"""
from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .reader import DumpError

MAPPINGS_DIR = Path(__file__).resolve().parent / "mappings"
BUILTIN = {p.stem: p for p in sorted(MAPPINGS_DIR.glob("*.json"))}
OPS = ("transpose", "permute", "reshape", "unflatten", "flatten", "select", "squeeze", "unsqueeze", "pad", "dtype")
_RULE_KEYS = {"engine", "hook", "item", "shards", "ops"}


@dataclass
class Rule:
    engine: re.Pattern
    hook: str
    item: int | None = None
    shards: tuple | None = None      # ("sum",) or ("cat", dim)
    ops: list = field(default_factory=list)
    index: int = 0

    def match(self, name: str) -> re.Match | None:
        if self.item is not None:
            suffix = f".{self.item}"
            if name.endswith(suffix) and (m := self.engine.fullmatch(name[: -len(suffix)])):
                return m
            return self.engine.fullmatch(name) if self.item == 0 else None  # an engine that dumped output[0] only
        return self.engine.fullmatch(name)


@dataclass
class Target:
    """One comparison: engine tensor(s) (rank order) that together give ``hook`` after ``rule``."""
    hook: str
    names: list
    rule: Rule

    @property
    def engine(self) -> str:
        """The engine name as shown in reports (shards folded to ``rank{r}``)."""
        if len(self.names) == 1:
            return self.names[0]
        return _fold_rank(self.rule, self.names[0])


def _fold_rank(rule: Rule, name: str) -> str:
    m = rule.match(name)
    if m is None or "rank" not in m.groupdict():
        return name
    a, b = m.span("rank")
    return name[:a] + "{r}" + name[b:]


def _bad(source: str, msg: str) -> DumpError:
    return DumpError(f"mapping {source}: {msg} (see docs/dumps.md, 'Mapping')")


def _parse_shards(spec, source: str, i: int):
    if spec is None:
        return None
    if spec == "sum":
        return ("sum",)
    if isinstance(spec, str) and spec.startswith("cat:"):
        try:
            return ("cat", int(spec[4:]))
        except ValueError:
            pass
    raise _bad(source, f"rule {i}: shards={spec!r} is not 'sum' or 'cat:DIM'")


class Mapping:
    def __init__(self, spec: dict, source: str = "<dict>") -> None:
        if not isinstance(spec, dict) or not isinstance(spec.get("rules"), list) or not spec["rules"]:
            raise _bad(source, "expected a JSON object with a non-empty 'rules' list")
        self.source = source
        self.description = spec.get("description", "")
        self.rules: list[Rule] = []
        for i, r in enumerate(spec["rules"]):
            if not isinstance(r, dict) or "engine" not in r or "hook" not in r:
                raise _bad(source, f"rule {i} needs 'engine' (regex) and 'hook' (dsv4lab hook name), got {r!r}")
            extra = set(r) - _RULE_KEYS
            if extra:
                raise _bad(source, f"rule {i} has unknown field(s) {sorted(extra)}; fields: {sorted(_RULE_KEYS)}")
            try:
                rx = re.compile(r["engine"])
            except re.error as e:
                raise _bad(source, f"rule {i}: engine regex {r['engine']!r} does not compile ({e})") from None
            ops = r.get("ops", [])
            for op in ops:
                if not isinstance(op, dict) or len(op) != 1 or next(iter(op)) not in OPS:
                    raise _bad(source, f"rule {i}: op {op!r} is not one of {list(OPS)} as {{name: argument}}")
            shards = _parse_shards(r.get("shards"), source, i)
            if shards and "rank" not in rx.groupindex:
                raise _bad(source, f"rule {i}: shards need a (?P<rank>\\d+) group in the engine regex")
            self.rules.append(Rule(rx, r["hook"], r.get("item"), shards, ops, i))
        self.ignore = [re.compile(x) for x in spec.get("ignore", [])]

    # ---------------------------------------------------------------- names
    def targets(self, names) -> tuple[list[Target], list[str]]:
        """(comparisons, unmapped names) for the engine names of one step."""
        groups: dict[tuple, dict[int, str]] = {}
        hooks_of: dict[tuple, tuple[str, Rule]] = {}
        unmapped = []
        for name in names:
            for rule in self.rules:
                m = rule.match(name)
                if m is None:
                    continue
                gd = m.groupdict()
                try:
                    hook = rule.hook.format(**gd)
                except (KeyError, IndexError) as e:
                    raise _bad(self.source, f"rule {rule.index}: hook {rule.hook!r} uses {e} which the engine regex "
                                            f"does not capture as a named group") from None
                rank = int(gd["rank"]) if rule.shards and gd.get("rank") is not None else 0
                key = (hook, rule.index, _fold_rank(rule, name) if rule.shards else name)
                groups.setdefault(key, {})[rank] = name
                hooks_of[key] = (hook, rule)
                break
            else:
                if not any(rx.fullmatch(name) for rx in self.ignore):
                    unmapped.append(name)
        out = []
        for key, by_rank in groups.items():
            hook, rule = hooks_of[key]
            missing = sorted(set(range(max(by_rank) + 1)) - set(by_rank))
            if missing:
                raise DumpError(f"engine tensor {key[2]!r}: rank {missing[0]} of {max(by_rank) + 1} is missing "
                                f"(tensor-parallel shards must be rank0..rank{max(by_rank)})")
            out.append(Target(hook, [by_rank[r] for r in range(len(by_rank))], rule))
        return out, unmapped

    # ---------------------------------------------------------------- layouts
    def assemble(self, target: Target, get, config=None, ref_shape=None) -> torch.Tensor:
        """The engine tensor of ``target`` in dsv4lab's layout; ``get(name)`` reads one tensor;
        ``ref_shape``: the reference's shape at the hook (for ``pad`` to ``"ref"``)."""
        parts = [get(n) for n in target.names]
        rule = target.rule
        if rule.shards is None or len(parts) == 1:
            t = parts[0]
        elif rule.shards[0] == "sum":
            t = torch.stack([p.double() if p.is_floating_point() else p for p in parts]).sum(0).to(parts[0].dtype)
        else:
            try:
                t = torch.cat(parts, dim=rule.shards[1])
            except RuntimeError as e:
                raise DumpError(f"engine tensor {target.engine!r}: shards of shapes {[list(p.shape) for p in parts]} "
                                f"do not concatenate on dim {rule.shards[1]} ({' '.join(str(e).split())})") from None
        for op in rule.ops:
            (kind, arg), = op.items()
            try:
                t = _apply(t, kind, arg, config, ref_shape)
            except (RuntimeError, IndexError, ValueError, TypeError) as e:
                raise DumpError(f"engine tensor {target.engine!r} -> {target.hook}: op {op} fails on shape "
                                f"{list(t.shape)} ({' '.join(str(e).split())})") from None
        return t


def _size(v, config):
    if isinstance(v, str):
        if config is None or not hasattr(config, v):
            raise ValueError(f"size {v!r} is not a config field")
        return int(getattr(config, v))
    return int(v)


def _apply(t: torch.Tensor, kind: str, arg, config, ref_shape=None) -> torch.Tensor:
    if kind == "transpose":
        return t.transpose(int(arg[0]), int(arg[1]))
    if kind == "permute":
        return t.permute(*[int(a) for a in arg])
    if kind == "reshape":
        return t.reshape([t.shape[i] if a == 0 else _size(a, config) for i, a in enumerate(arg)])
    if kind == "unflatten":
        return t.unflatten(int(arg[0]), [_size(a, config) for a in arg[1]])
    if kind == "flatten":
        return t.flatten(int(arg[0]), int(arg[1]))
    if kind == "select":
        return t.select(int(arg[0]), int(arg[1]))
    if kind == "squeeze":
        return t.squeeze(int(arg))
    if kind == "unsqueeze":
        return t.unsqueeze(int(arg))
    if kind == "pad":
        dim = int(arg[0]) % t.dim()
        if arg[1] == "ref":
            if ref_shape is None or len(ref_shape) != t.dim():
                return t
            size = int(ref_shape[dim])
        else:
            size = _size(arg[1], config)
        value = arg[2]
        if t.shape[dim] >= size:
            return t
        fill = t.new_full((*t.shape[:dim], size - t.shape[dim], *t.shape[dim + 1:]), value)
        return torch.cat([t, fill], dim=dim)
    if kind == "dtype":
        dt = getattr(torch, str(arg), None)
        if not isinstance(dt, torch.dtype):
            raise ValueError(f"unknown dtype {arg!r}")
        return t.to(dt)
    raise ValueError(f"unknown op {kind!r}")


def load_mapping(spec: "str | os.PathLike | dict") -> Mapping:
    """``"hf"`` (a built-in name), a JSON file path, or an already parsed dict."""
    if isinstance(spec, dict):
        return Mapping(spec)
    s = str(spec)
    if s in BUILTIN:
        return Mapping(json.loads(BUILTIN[s].read_text()), s)
    p = Path(s)
    if not p.is_file():
        raise DumpError(f"mapping={s!r} is neither a built-in mapping ({', '.join(BUILTIN)}) nor a JSON file")
    try:
        spec = json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise DumpError(f"mapping={s!r}: not valid JSON ({e})") from None
    return Mapping(spec, s)
