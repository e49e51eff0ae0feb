"""Dotted-name patterns: ONE dialect for hook filters, component patterns and policy targets.

A pattern is matched segment by segment against a dotted name:

* ``*``, ``?``, ``[...]`` match within ONE segment (fnmatch rules): ``layers.*.attn.hook_probs``;
* ``**`` matches any number of segments, none included: ``**.router.hook_ids``, ``**.wq_b``;
* a name matches itself exactly.

So ``layers.*.mlp.experts.*`` is every routed expert but not the experts' linears
(``layers.1.mlp.experts.3.w1`` has one segment more). A pattern that matches nothing is almost
always a typo: :func:`no_match_error` builds the one error every caller raises, with the closest
names (layer numbers folded to ``*``) as did-you-mean.
"""
from __future__ import annotations

import difflib
import fnmatch
import re
from typing import Callable, Iterable, Sequence

Pattern = "str | Sequence[str] | Callable[[str], bool] | None"


def segments_match(pattern: Sequence[str], name: Sequence[str]) -> bool:
    """Segment-wise match of a split pattern against a split name (``**`` = any run of segments)."""
    if not pattern:
        return not name
    if pattern[0] == "**":
        return any(segments_match(pattern[1:], name[i:]) for i in range(len(name) + 1))
    return bool(name) and fnmatch.fnmatchcase(name[0], pattern[0]) and segments_match(pattern[1:], name[1:])


def matches(pattern: str, name: str) -> bool:
    """Does ``name`` match ``pattern`` (exactly, or by the segment rules above)?"""
    return name == pattern or segments_match(pattern.split("."), name.split("."))


def name_matcher(patterns: Pattern) -> Callable[[str], bool]:
    """A predicate on names: ``None`` = everything; a pattern or a list of them; a predicate as is."""
    if patterns is None:
        return lambda name: True
    if callable(patterns) and not isinstance(patterns, str):
        return patterns
    pats = [patterns] if isinstance(patterns, str) else list(patterns)
    split = [p.split(".") for p in pats]
    return lambda name: any(name == p or segments_match(s, name.split(".")) for p, s in zip(pats, split))


def component_matcher(patterns: Pattern) -> Callable[[str, object], bool]:
    """``f(name, module)``: a pattern, a list of them, or a predicate ``f(name, module)`` as is
    (component selection passes the module too, e.g. to select by class)."""
    if callable(patterns) and not isinstance(patterns, str):
        return patterns
    keep = name_matcher(patterns)
    return lambda name, mod: keep(name)


def pattern_list(patterns: Pattern) -> list[str]:
    """The string patterns in ``patterns`` (a predicate has none to check)."""
    if patterns is None or (callable(patterns) and not isinstance(patterns, str)):
        return []
    return [patterns] if isinstance(patterns, str) else [p for p in patterns if isinstance(p, str)]


def generalise(name: str) -> str:
    """``layers.12.mlp.experts.3.w1`` -> ``layers.*.mlp.experts.*.w1`` (for suggestions)."""
    return re.sub(r"(?<=\.)\d+(?=\.|$)", "*", name)


def close_names(word: str, names: Iterable[str], n: int = 3) -> list[str]:
    """The closest of ``names`` (and of their layer-folded forms) to ``word``."""
    names = list(names)
    pool = list(dict.fromkeys(names + [generalise(x) for x in names]))
    if "." not in word:  # a bare word: compare with last segments too
        pool += [x.rsplit(".", 1)[-1] for x in names]
    return difflib.get_close_matches(word, list(dict.fromkeys(pool)), n=n, cutoff=0.6)


def did_you_mean(word: str, names: Iterable[str]) -> str:
    """``"; did you mean 'a' or 'b'?"`` with the closest of ``names`` to ``word`` (``close_names``), or
    "" when none is close: the hint every did-you-mean error of the package appends."""
    close = close_names(word, names)
    return f"; did you mean {' or '.join(repr(c) for c in close)}?" if close else ""


def no_match_error(what: str, argument: str, pattern: str, names: Iterable[str], fix: str) -> KeyError:
    """KeyError: ``{argument}={pattern!r} matches no {what}; did you mean ...? {fix}``."""
    hint = did_you_mean(pattern, names)
    return KeyError(f"{argument}={pattern!r} matches no {what}{hint} ({fix})")


def unmatched(patterns: Pattern, names: Iterable[str]) -> list[str]:
    """The string patterns that match none of ``names``."""
    names = list(names)
    return [p for p in pattern_list(patterns) if not any(matches(p, n) for n in names)]
