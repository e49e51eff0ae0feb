"""Component-name patterns, matched per dotted segment: ``*`` within ONE segment, ``**`` any number
of segments (``layers.*.mlp.experts.*`` = every routed expert; ``**.wq_b`` = every wq_b). A list of
patterns or a predicate ``f(name, module)`` also work. Here, below analysis and kernels, because
both select components by name."""
from __future__ import annotations

import fnmatch
from typing import Callable

from torch import nn


def segments_match(pat: list[str], name: list[str]) -> bool:
    if not pat:
        return not name
    if pat[0] == "**":
        return any(segments_match(pat[1:], name[i:]) for i in range(len(name) + 1))
    return bool(name) and fnmatch.fnmatchcase(name[0], pat[0]) and segments_match(pat[1:], name[1:])


def component_matcher(pattern) -> Callable[[str, nn.Module], bool]:
    if callable(pattern) and not isinstance(pattern, str):
        return pattern
    pats = [pattern] if isinstance(pattern, str) else list(pattern)
    split = [p.split(".") for p in pats]
    return lambda name, mod: any(name == p or segments_match(s, name.split(".")) for p, s in zip(pats, split))
