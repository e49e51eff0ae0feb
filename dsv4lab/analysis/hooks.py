"""Hook plumbing: name filters, temporary forward hooks (interventions), execution order, schema.

Hook points are :class:`dsv4lab.model.hooks.HookPoint` identity modules; a hook's name is the
module's dotted path (``layers.1.attn.hook_probs``). Name filters are the one pattern dialect of
:mod:`dsv4lab.patterns` (``*`` within a segment, ``**`` across segments):
``"layers.*.attn.hook_probs"``, ``"**.router.hook_ids"``.
"""
from __future__ import annotations

import contextlib
from typing import Callable, Iterable, Iterator

import pandas as pd
import torch

from ..checkpoint.names import layer_of
from ..model.hooks import HookPoint
from ..patterns import name_matcher, no_match_error, unmatched

NameFilter = "str | Sequence[str] | Callable[[str], bool] | None"


def name_filter(names) -> Callable[[str], bool]:
    """None -> everything; a pattern or list of patterns (exact names work too); a predicate."""
    return name_matcher(names)


def check_hook_names(model, names, argument: str = "names") -> None:
    """Raise one KeyError, with did-you-mean, for the first pattern in ``names`` that matches no
    hook point of ``model`` (a typo would otherwise give an empty cache and no word)."""
    all_names = [n for n, _ in hook_points(model)]
    for pat in unmatched(names, all_names):
        raise no_match_error("hook point", argument, pat, all_names, "see model.hook_names()")


def hook_points(model) -> list[tuple[str, object]]:
    return [(n, m) for n, m in model.named_modules() if isinstance(m, HookPoint)]


def resolve(model, names) -> list[tuple[str, object]]:
    keep = name_filter(names)
    return [(n, hp) for n, hp in hook_points(model) if keep(n)]


def _wrap(fn: Callable, name: str):
    def hook(module, inputs, output):
        return fn(output, name)

    return hook


@contextlib.contextmanager
def hooks(model, fwd_hooks: Iterable[tuple] = (), strict: bool = True) -> Iterator[list]:
    """Temporarily attach ``fn(tensor, hook_name)`` to every hook point matching each pattern.

    ``fn`` may return a replacement tensor (used downstream) or ``None`` (observe only). Works
    in ``forward``, ``prefill``, ``decode_step`` and ``generate``. All hooks are removed on exit,
    also when the body raises. ``strict``: a pattern that matches no hook point is an error.
    """
    handles = []
    try:
        for pattern, fn in fwd_hooks:
            matched = resolve(model, pattern)
            if not matched and strict:
                check_hook_names(model, pattern, "fwd_hooks pattern")
                raise KeyError(f"no hook point matches {pattern!r}; see model.hook_names()")
            for name, hp in matched:
                handles.append(hp.register_forward_hook(_wrap(fn, name)))
        yield handles
    finally:
        for h in handles:
            h.remove()


@contextlib.contextmanager
def record_order(model, names=None) -> Iterator[list[str]]:
    """Collect hook names in the order they fire (repeats included: one entry per firing)."""
    order: list[str] = []

    def rec(t, name):
        order.append(name)

    with hooks(model, [(names if names is not None else "**", rec)], strict=False):
        yield order


def default_prompt(config, batch: int = 1, seed: int = 0, length: int | None = None) -> torch.Tensor:
    """Deterministic token ids long enough that every CSA/HCA window closes at least twice and
    the sliding window is exceeded (so every hook point fires)."""
    if length is None:
        ratios = [config.compress_ratio(i) for i in range(config.num_hidden_layers)]
        m = max([r for r in ratios if r] or [1])
        length = max(2 * config.sliding_window, 4 * m) + 1
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, config.vocab_size, (batch, length), generator=g)


@torch.no_grad()
def hook_schema(model, ids: torch.Tensor | None = None, decode: bool = False):
    """DataFrame: name, component, layer, order (first firing), shape, dtype, meaning.

    Shapes come from one traced forward on ``ids`` (default: :func:`default_prompt`); with
    ``decode=True`` a second column set ``decode_shape`` comes from one decode step after it.
    Hook points that did not fire show shape ``None`` (e.g. indexer hooks before any entry).
    """
    if ids is None:
        ids = default_prompt(model.config).to(model.device)
    model.check_ids(ids)
    seen: dict[str, tuple] = {}
    seen_dec: dict[str, tuple] = {}
    order: list[str] = []

    def rec(t, name, store=seen):
        if name not in store:
            store[name] = (tuple(t.shape), str(t.dtype).replace("torch.", ""))
            if store is seen:
                order.append(name)

    with hooks(model, [("**", rec)]):
        state = model.new_state(ids.shape[0], ids.shape[1] + 1)
        logits = model.prefill(ids, state)
    if decode:
        with hooks(model, [("**", lambda t, n: rec(t, n, seen_dec))]):
            model.decode_step(logits[:, -1:].argmax(-1), state)
    rows = []
    pos = {n: i for i, n in enumerate(order)}
    for name, hp in hook_points(model):
        shape, dtype = seen.get(name, (None, None))
        row = {"name": name, "component": name.rsplit(".", 1)[0] if "." in name else "",
               "layer": layer_of(name), "order": pos.get(name), "shape": shape, "dtype": dtype,
               "meaning": getattr(hp, "meaning", "")}
        if decode:
            row["decode_shape"] = seen_dec.get(name, (None,))[0]
        rows.append(row)
    df = pd.DataFrame(rows)
    df["order"] = df["order"].astype("Int64")
    df["layer"] = df["layer"].astype("Int64")
    return df.sort_values("order", na_position="last", kind="stable").reset_index(drop=True)


def schema_markdown(df) -> str:
    cols = [c for c in ("order", "name", "shape", "dtype", "decode_shape", "meaning") if c in df.columns]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for _, r in df.iterrows():
        cells = []
        for c in cols:
            v = r[c]
            if c in ("shape", "decode_shape"):
                v = "-" if v is None else "[" + ",".join(str(x) for x in v) + "]"
            elif c == "name":
                v = f"`{v}`"
            elif v is None or (not isinstance(v, str) and pd_isna(v)):
                v = "-"
            cells.append(str(v).replace("|", "\\|"))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def pd_isna(v) -> bool:
    try:
        return bool(pd.isna(v))
    except (TypeError, ValueError):
        return False
