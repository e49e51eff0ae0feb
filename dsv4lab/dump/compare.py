"""Compare an engine's dump with dsv4lab's reference, hook by hook, and isolate the culprit.

    res = compare_dump(model, "dumps/run1", mapping="hf", tol="1e-4")
    res.first_divergence      # the first mapped tensor (execution order) that differs, or None
    res.per_layer()           # DataFrame: layer x component, worst rel_err
    res = compare_dump(model, "dumps/run1", isolate=True)
    res.isolation["verdict"]  # "layers.3.attn is wrong: ..." / "... got wrong input ..."

The reference replays the dump's ``input_ids`` step by step (step 0 and any multi-token step as a
prefill against one decode state, one-token steps as ``decode_step``). Each mapped engine tensor
is read from disk when its hook point fires, put in dsv4lab's layout, compared
(:func:`dsv4lab.analysis.compare.tensor_diff`) and dropped: one engine tensor and no cache of the
reference are held at a time. ``isolate`` replays once more feeding the engine's tensor into the
reference at every diverging point (teacher forcing through the hook): what still diverges then is
wrong where it is computed (an origin); what no longer does only got wrong input (propagated).
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, field

import pandas as pd
import torch
from tqdm.auto import tqdm

from ..analysis.compare import tensor_diff
from ..analysis.hooks import hook_points, hooks
from ..checkpoint.names import layer_of
from ..model.validate import InputError
from ..patterns import close_names, did_you_mean, matches
from .mapping import Mapping, Target, load_mapping
from .reader import DumpError, DumpReader

DEFAULT_TOL = 1e-4


# ------------------------------------------------------------------------------ tolerance
@dataclass
class Tolerance:
    """A default relative error plus per-hook overrides (``pattern=value``, last match wins)."""
    default: float = DEFAULT_TOL
    overrides: list = field(default_factory=list)

    def __call__(self, hook: str) -> float:
        tol = self.default
        for pat, v in self.overrides:
            if matches(pat, hook):
                tol = v
        return tol

    def __str__(self) -> str:
        return ",".join([f"{self.default:g}"] + [f"{p}={v:g}" for p, v in self.overrides])


def parse_tol(spec: "str | float | Tolerance | None") -> Tolerance:
    """``1e-3`` or ``"1e-3,**.router.hook_ids=0.05,hook_logits=1e-2"`` (default first, then overrides)."""
    if spec is None:
        return Tolerance()
    if isinstance(spec, Tolerance):
        return spec
    if isinstance(spec, (int, float)):
        return Tolerance(float(spec))
    tol = Tolerance()
    for part in [p.strip() for p in str(spec).split(",") if p.strip()]:
        pat, _, val = part.rpartition("=")
        try:
            v = float(val)
        except ValueError:
            raise InputError(f"tol={spec!r}: {part!r} is not NUMBER or PATTERN=NUMBER "
                             f"(e.g. --tol 1e-3,**.router.hook_ids=0.05)") from None
        if not v >= 0:
            raise InputError(f"tol={spec!r}: tolerance {v} must be >= 0")
        if pat:
            tol.overrides.append((pat, v))
        else:
            tol.default = v
    return tol


# ------------------------------------------------------------------------------ naming helpers
def component_of(hook: str) -> str:
    """``layers.3.mlp.router.hook_ids`` -> ``mlp.router``; ``layers.3.hook_resid_post`` -> ``resid_post``;
    ``hook_logits`` -> ``logits``: the column of the per-layer table."""
    mod, _, leaf = hook.rpartition(".")
    parts = mod.split(".") if mod else []
    if len(parts) >= 2 and parts[0] == "layers":
        parts = parts[2:]
    return ".".join(parts) if parts else leaf.removeprefix("hook_")


def module_of(hook: str) -> str:
    """The module a hook point sits in (``layers.3.attn.hook_out`` -> ``layers.3.attn``)."""
    return hook.rpartition(".")[0] or hook


# ------------------------------------------------------------------------------ result
@dataclass
class DumpComparison:
    dump: str
    mapping: str
    tol: str
    steps: int
    rows: list                 # one dict per compared engine tensor, in execution order
    unmapped: list             # engine names no rule maps
    not_fired: list            # (step, hook, engine) mapped but the reference never fired that hook
    isolation: dict | None = None

    @property
    def first_divergence(self) -> dict | None:
        return next((r for r in self.rows if r["diverged"]), None)

    @property
    def diverged(self) -> bool:
        return self.first_divergence is not None

    def table(self) -> pd.DataFrame:
        return pd.DataFrame(self.rows)

    def per_layer(self, value: str = "rel_err") -> pd.DataFrame:
        """layer x component: the worst ``value`` over steps (rows ``-`` for global hooks)."""
        if not self.rows:
            return pd.DataFrame()
        df = self.table()
        df["layer"] = df["layer"].map(lambda v: "-" if v is None or (isinstance(v, float) and math.isnan(v)) else int(v))
        cols = list(dict.fromkeys(df["component"]))
        t = df.pivot_table(index="layer", columns="component", values=value, aggfunc="max", sort=False)
        order = sorted([x for x in t.index if x != "-"]) + (["-"] if "-" in t.index else [])
        return t.reindex(index=order, columns=cols)

    def to_dict(self) -> dict:
        def clean(v):
            if isinstance(v, float) and (math.isnan(v) or math.isinf(v)):
                return None if math.isnan(v) else ("inf" if v > 0 else "-inf")
            return v

        rows = [{k: (list(v) if isinstance(v, tuple) else clean(v)) for k, v in r.items()} for r in self.rows]
        fd = self.first_divergence
        return {"dump": self.dump, "mapping": self.mapping, "tol": self.tol, "steps": self.steps,
                "compared": len(self.rows), "diverged": sum(r["diverged"] for r in self.rows),
                "first_divergence": None if fd is None else rows[self.rows.index(fd)],
                "per_hook": rows, "unmapped": self.unmapped,
                "not_fired": [{"step": s, "hook": h, "engine": e} for s, h, e in self.not_fired],
                "isolation": self.isolation}

    def divergence_line(self) -> str:
        fd = self.first_divergence
        if fd is None:
            return f"no divergence: {len(self.rows)} engine tensors over {self.steps} steps agree (tol {self.tol})"
        return (f"first divergence: step {fd['step']} {fd['hook']} <- {fd['engine']} (layer "
                f"{'-' if fd['layer'] is None else fd['layer']}, {fd['component']}): rel_err {fd['rel_err']:.3g} "
                f"max_abs {fd['max_abs']:.3g} cos {fd['cos']:.6f} [{fd['status']}]; last agreeing point: "
                f"{fd['after'] or '(none)'}")

    def summary(self) -> str:
        lines = [f"dump {self.dump}: {self.steps} steps, {len(self.rows)} engine tensors compared "
                 f"(mapping {self.mapping}, tol {self.tol})", self.divergence_line()]
        t = self.per_layer()
        if not t.empty:
            lines.append("worst rel_err per layer and component (* = diverged):")
            div = self.per_layer("diverged")
            shown = t.copy().astype(object)
            for i in t.index:
                for c in t.columns:
                    v = t.loc[i, c]
                    shown.loc[i, c] = "" if pd.isna(v) else f"{v:.2e}" + ("*" if bool(div.loc[i, c]) else "")
            lines.append(shown.to_string())
        if self.isolation:
            lines.append("isolation: " + self.isolation["verdict"])
        if self.unmapped:
            lines.append(f"unmapped engine names ({len(self.unmapped)}): " + ", ".join(self.unmapped[:8])
                         + (" ..." if len(self.unmapped) > 8 else ""))
        if self.not_fired:
            lines.append(f"mapped but not fired by the reference ({len(self.not_fired)}): "
                         + ", ".join(f"step {s} {h}" for s, h, _ in self.not_fired[:5]))
        return "\n".join(lines)

    __str__ = summary


# ------------------------------------------------------------------------------ the replay
def _check_hooks(model, reader: DumpReader, mapping: Mapping) -> tuple[list, list]:
    """Per step its targets; all unmapped names. Unknown hook names fail here, before any compute."""
    known = set(model.hook_names())
    per_step, unmapped = [], []
    for st in reader.steps:
        targets, um = mapping.targets(st.names)
        for t in targets:
            if t.hook not in known:
                hint = did_you_mean(t.hook, known)
                raise DumpError(f"mapping {mapping.source}: engine tensor {t.engine!r} maps to {t.hook!r}, which is no "
                                f"dsv4lab hook point{hint} (see docs/hooks.md or model.hook_names())")
        per_step.append(targets)
        unmapped += [n for n in um if n not in unmapped]
    if not any(per_step):
        names = reader.names()
        raise DumpError(f"mapping {mapping.source} maps none of the dump's {len(names)} engine tensors (e.g. "
                        f"{', '.join(repr(n) for n in names[:3])}); write a mapping for your engine's names "
                        f"(docs/dumps.md) and pass --mapping FILE")
    return per_step, unmapped


def _shape_error(target: Target, step: int, eng_shape, ref_shape, fired_shapes: dict) -> DumpError:
    same = [h for h, s in fired_shapes.items() if s == tuple(eng_shape)]
    close = close_names(target.hook, same) or same[:3]
    hint = f"; did you mean {' or '.join(repr(c) for c in close)} (same shape)?" if close else ""
    fix = ("the element count matches: add a reshape/transpose op to the rule"
           if math.prod(eng_shape) == math.prod(ref_shape) else "check the rule's hook and ops")
    return DumpError(f"step {step}: engine tensor {target.engine!r} maps to {target.hook} with shape {list(eng_shape)} "
                     f"after mapping, the reference's is {list(ref_shape)}{hint} ({fix})")


@torch.no_grad()
def _replay(model, reader: DumpReader, mapping: Mapping, per_step: list, tol: Tolerance, force: bool,
            progress: bool) -> tuple[list, list]:
    rows: list[dict] = []
    not_fired: list = []
    device = model.device
    state = model.new_state(reader.batch, reader.total_tokens)
    last_compared = [None]   # the last compared point that agreed (or was forced): start of a suspect span
    between: list[str] = []  # hook points fired since then

    for st, targets in zip(tqdm(reader.steps, desc="compare-dump" + (" (isolate)" if force else ""),
                                disable=not progress), per_step):
        by_hook: dict[str, list[Target]] = {}
        for t in targets:
            by_hook.setdefault(t.hook, []).append(t)
        fired_shapes: dict[str, tuple] = {}
        bad: list = []
        ids = st.input_ids.to(device)
        model.check_ids(ids, argument=f"{st.path.name} input_ids")

        with st.open() as f:
            def on_fire(t, name, f=f):
                first = name not in fired_shapes
                fired_shapes.setdefault(name, tuple(t.shape))
                if not first or name not in by_hook:
                    between.append(name)
                    return None
                replacement = None
                for tg in by_hook[name]:
                    eng = mapping.assemble(tg, f.get_tensor, model.config, tuple(t.shape))
                    if tuple(eng.shape) != tuple(t.shape):
                        bad.append((tg, tuple(eng.shape), tuple(t.shape)))
                        continue
                    d = tensor_diff(t.detach(), eng)
                    tl = tol(name)
                    div = d["status"] != "ok" or d["rel_err"] > tl
                    suspects = list(dict.fromkeys(module_of(h) for h in between + [name]))
                    rows.append({"step": st.index, "order": len(rows), "hook": name, "engine": tg.engine,
                                 "layer": layer_of(name), "component": component_of(name), "shape": tuple(t.shape),
                                 **d, "tol": tl, "diverged": div, "after": last_compared[0], "suspects": suspects})
                    if div and force and replacement is None:
                        replacement = eng.to(device=t.device, dtype=t.dtype)
                    if not div or force:
                        last_compared[0] = f"step {st.index} {name}"
                        between.clear()
                return replacement

            with hooks(model, [("**", on_fire)]):
                if st.index == 0 or ids.shape[1] > 1:
                    model.prefill(ids, state)
                else:
                    model.decode_step(ids, state)
                    state.pos += 1
        if bad:
            raise _shape_error(bad[0][0], st.index, bad[0][1], bad[0][2], fired_shapes)
        not_fired += [(st.index, h, t.engine) for h, ts in by_hook.items() if h not in fired_shapes for t in ts]
    return rows, not_fired


def _verdict(plain: list, forced: list) -> dict:
    """What teacher forcing says about the first divergence and the rest (see module doc)."""
    key = lambda r: (r["step"], r["hook"], r["engine"])  # noqa: E731
    origins = [r for r in forced if r["diverged"]]
    origin_keys = {key(r) for r in origins}
    propagated = [key(r) for r in plain if r["diverged"] and key(r) not in origin_keys]
    first = next((r for r in plain if r["diverged"]), None)
    out = {"origins": [{"step": r["step"], "hook": r["hook"], "engine": r["engine"], "rel_err": r["rel_err"],
                        "after": r["after"], "suspects": r["suspects"]} for r in origins],
           "propagated": [{"step": s, "hook": h, "engine": e} for s, h, e in propagated]}
    if first is None:
        out["verdict"] = "nothing diverges; nothing to isolate"
        out["culprit"] = None
        return out
    o = origins[0] if origins else None
    own = module_of(first["hook"])
    inside = lambda m: m == own or m.startswith(own + ".")  # noqa: E731
    if o is not None and key(o) == key(first):
        up = [s for s in o["suspects"] if not inside(s)]
        if not up:
            head = (f"{own} is wrong: its input agreed at {o['after'] or 'the start'} and its output "
                    f"{first['hook']} diverges (rel_err {first['rel_err']:.3g})")
            out["culprit"] = own
        else:
            head = (f"{first['hook']} got wrong input or {own} is wrong: {o['after'] or 'the start'} agreed, and "
                    f"between them the reference runs {', '.join(up)}, which the dump does not show")
            out["culprit"] = ", ".join(up + [own])
    else:
        head = f"{first['hook']} diverges only in the plain run"
        out["culprit"] = None
    same = sorted({r["step"] for r in origins[1:] if inside(module_of(r["hook"]))})
    other = [r for r in origins[1:] if not inside(module_of(r["hook"]))]
    tail = f" (also on its own at step(s) {', '.join(map(str, same))})" if same else ""
    tail += (f"; with the engine's tensors fed in, everything else agrees ({len(propagated)} divergences of the "
             f"plain run were propagation)" if not other else
             f"; fed the engine's tensors, {len(other)} point(s) elsewhere still diverge on their own, first "
             f"step {other[0]['step']} {other[0]['hook']} (after {other[0]['after']})")
    out["verdict"] = head + tail
    return out


def _check_tol_patterns(model, tol: Tolerance) -> None:
    """Each PATTERN=NUMBER override must match a hook point: a typo would leave that hook at the
    default tolerance without a word."""
    names = [n for n, _ in hook_points(model)]
    for pat, _ in tol.overrides:
        if not any(matches(pat, n) for n in names):
            hint = did_you_mean(pat, names)
            raise InputError(f"tol pattern {pat!r} matches no hook point{hint} (see model.hook_names())")


def compare_dump(model, dump: "str | os.PathLike | DumpReader", mapping="hf", tol=None, isolate: bool = False,
                 progress: bool = True) -> DumpComparison:
    """Replay ``dump`` through ``model`` and compare every mapped engine tensor (module doc)."""
    reader = dump if isinstance(dump, DumpReader) else DumpReader(dump)
    mp = mapping if isinstance(mapping, Mapping) else load_mapping(mapping)
    tl = parse_tol(tol)
    _check_tol_patterns(model, tl)
    per_step, unmapped = _check_hooks(model, reader, mp)
    rows, not_fired = _replay(model, reader, mp, per_step, tl, force=False, progress=progress)
    res = DumpComparison(str(reader.directory), mp.source, str(tl), len(reader), rows, unmapped, not_fired)
    if isolate:
        forced = rows if not res.diverged else _replay(model, reader, mp, per_step, tl, force=True, progress=progress)[0]
        res.isolation = _verdict(rows, forced)
    return res
