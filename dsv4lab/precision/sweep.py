"""The one precision sweep and the one greedy precision floor (the model's ``precision_sweep`` /
``precision_floor`` and notebook 3's ``dsv4lab.triage.ablation`` both run these).

A sweep flips one component kind at a time (optionally one layer at a time) to ``flip`` on top of
``base`` and measures, against a reference run: next-token KL / top-1 agreement, the minimum
per-layer cosine of the residual streams, router top-k overlap and the weight-memory change. Two
ways to read one (``reference`` = the truth, ``base`` = what everything else runs in):

* damage:  reference="bf16", base="bf16", flip="w4a4" -> what quantising ONE kind costs;
* rescue:  reference="bf16", base="w4a4", flip="bf16" -> what restoring ONE kind to BF16 buys.

:func:`round_trip_sweep` does the same for DeepSeek's official round trips (dsv4lab.quant.modes.
RoundTrip): each one alone on ``base``, then all five, so a divergence can be blamed on one.

``reference_model`` measures against another model instead (the unquantised original, when the
model under test holds FP4 weights: in fp32/bf16 compute ``bf16`` and ``w4a16`` use the same
dequantised weights, so their KL is 0 by construction); its linears are then also the
``originals`` that ``orig`` swaps in, unless ``originals=`` says otherwise.
"""
from __future__ import annotations

import numbers
from dataclasses import dataclass

import pandas as pd
import torch
from tqdm.auto import tqdm

from ..analysis.cache import ActivationCache, run_with_cache
from ..analysis.compare import CompareResult, compare_against
from ..model.validate import InputError, check_int
from ..quant.modes import ROUND_TRIPS, Mode, as_round_trip, unknown_choice
from .apply import Originals, UnknownTargetError, linear_kinds
from .policy import PrecisionPolicy, linear_kind, linear_layer
from .streaming import fitting_precision

SWEEP_HOOKS = ["layers.*.hook_resid_post", "layers.*.mlp.router.hook_ids"]
SWEEP_COLUMNS = ["kind", "layers", "mode", "base", "kl", "kl_last", "kl_max", "top1", "topk", "min_layer_cos",
                 "router_overlap", "mem_delta_bytes", "n_linears"]


@dataclass
class ReferenceRun:
    """The truth a sweep measures against: logits and the SWEEP_HOOKS captures (on the CPU).
    ``streamed``: computed with one dense weight at a time (dsv4lab.precision.streaming);
    ``how``: which path ran and why, or where the cached run came from."""

    logits: torch.Tensor
    cache: ActivationCache
    streamed: bool = False
    how: str = ""


@torch.no_grad()
def reference_run(model, ids: torch.Tensor, policy=Mode.BF16, originals: Originals | None = None,
                  streaming="auto", free: "int | dict | None" = None, names=tuple(SWEEP_HOOKS)) -> ReferenceRun:
    """Run ``model`` under ``policy`` (restored afterwards), capturing ``names`` (what a sweep
    compares). ``streaming``: True streams every ``bf16`` / ``orig`` linear's dense weight one
    call at a time (peak: the largest one), False gives them all dense weights at once (fast, and
    the model's size again in BF16), ``"auto"`` streams when those would not fit the devices' free
    memory (``free`` overrides what the devices report; see ``choose_streaming``). Both paths give
    bitwise the same result; ``ReferenceRun.streamed`` / ``.how`` say which ran."""
    with fitting_precision(model, policy, originals, streaming, free) as report:
        names = [names] if isinstance(names, str) else list(names)
        logits, cache = run_with_cache(model, ids, names=names, device="cpu")
    return ReferenceRun(logits.detach().cpu(), cache, report["streamed"], report["how"])


@dataclass
class Trial:
    """One policy measured against the reference."""

    policy: PrecisionPolicy
    result: CompareResult
    bytes_after: int          # weight memory under the policy (apply_precision's report)


@torch.no_grad()
def evaluate(model, ids: torch.Tensor, policy, reference: ReferenceRun, originals: Originals | None = None,
             k: int = 5, streaming="auto") -> Trial:
    """Run ``model`` under ``policy`` (restored afterwards; streamed when its dense weights would
    not fit, see :func:`reference_run`) and compare it with ``reference``."""
    policy = PrecisionPolicy.parse(policy)
    with fitting_precision(model, policy, originals, streaming) as report:
        res = compare_against(reference.logits, reference.cache, model, None, ids, SWEEP_HOOKS, 0.0, k)
    return Trial(policy, res, report["bytes_after"])


def _reference(model, ids, reference, reference_model, originals) -> ReferenceRun:
    if isinstance(reference, ReferenceRun):
        return reference
    return reference_run(reference_model if reference_model is not None else model, ids, reference, originals)


def _originals(originals, reference_model):
    if originals is None and reference_model is not None:
        return Originals.from_model(reference_model)
    return originals


def _progress(iterable, enabled: bool, desc: str):
    if not enabled:
        return iterable

    return tqdm(iterable, desc=desc, leave=False)


def _check_kinds(model, kinds: list) -> None:
    known = linear_kinds(model)
    for kind in kinds:
        if kind not in known:
            raise UnknownTargetError(str(unknown_choice("component kind", kind, known)))


def _row(trial: Trial, **extra) -> dict:
    res = trial.result
    return {**extra, "kl": res.kl_mean, "kl_last": res.kl_per_pos[-1], "kl_max": res.kl_max, "top1": res.top1,
            "topk": res.topk, "min_layer_cos": res.min_layer_cos, "router_overlap": res.mean_router_overlap}


@torch.no_grad()
def precision_sweep(model, ids: torch.Tensor, kinds=None, reference=Mode.BF16, base=None, flip: str = Mode.W4A16,
                    per_layer: bool = False, layers=None, reference_model=None, originals: Originals | None = None,
                    k: int = 5, progress: bool = True, include_base: bool = True):
    """DataFrame with one row per (kind[, layer]) flipped to ``flip`` on top of ``base``
    (SWEEP_COLUMNS; ``mem_delta_bytes`` vs the base policy). The first row (kind ``(base)``) is
    the base policy itself, and then ``kl_change_vs_base`` is added. ``reference``: a policy spec
    run on ``reference_model`` (default the model itself) or a :class:`ReferenceRun`. The
    model's precision is restored afterwards."""
    base = reference if base is None and not isinstance(reference, ReferenceRun) else base
    base_pol = PrecisionPolicy.parse(Mode.BF16 if base is None else base)
    all_kinds = linear_kinds(model)
    kinds = all_kinds if kinds is None else [kinds] if isinstance(kinds, str) else list(kinds)
    _check_kinds(model, kinds)
    layers_of: dict = {}
    for name, _ in model.qlinears():
        layers_of.setdefault(linear_kind(name), set()).add(linear_layer(name))
    jobs = []
    for kind in kinds:
        if per_layer:
            ls = sorted(l for l in layers_of[kind] if l is not None and (layers is None or l in layers))
            jobs += [(kind, (l,)) for l in ls] or [(kind, None)]
        else:
            jobs.append((kind, None if layers is None else tuple(layers)))

    originals = _originals(originals, reference_model)
    ref = _reference(model, ids, reference, reference_model, originals)
    base_trial = evaluate(model, ids, base_pol, ref, originals, k)
    rows = []
    if include_base:
        rows.append(_row(base_trial, kind="(base)", layers=None, mode=base_pol.default, base=base_pol.describe(),
                         mem_delta_bytes=0, n_linears=0))
    for kind, ls in _progress(jobs, progress, f"sweep {flip}"):
        trial = evaluate(model, ids, base_pol.with_rule(kind, flip, ls), ref, originals, k)
        n = sum(1 for name, _ in model.qlinears() if linear_kind(name) == kind and (ls is None or linear_layer(name) in ls))
        rows.append(_row(trial, kind=kind, layers=None if ls is None else list(ls), mode=flip, base=base_pol.describe(),
                         mem_delta_bytes=trial.bytes_after - base_trial.bytes_after, n_linears=n))
    df = pd.DataFrame(rows, columns=SWEEP_COLUMNS)
    if include_base:
        df["kl_change_vs_base"] = df["kl"] - base_trial.result.kl_mean
    return df


ROUND_TRIP_COLUMNS = ["round_trip", "policy", "kl", "kl_last", "kl_max", "top1", "topk", "min_layer_cos",
                      "router_overlap", "kl_change_vs_base", "top1_change_vs_base"]


@torch.no_grad()
def round_trip_sweep(model, ids: torch.Tensor, base=Mode.W4A16, reference=Mode.BF16, round_trips=None,
                     reference_model=None, originals: Originals | None = None, k: int = 5,
                     progress: bool = True):
    """DataFrame (ROUND_TRIP_COLUMNS) with one row per official round trip switched on ALONE on
    top of ``base``, then all of them together (``official``), each against ``reference`` (as in
    :func:`precision_sweep`), the first row being ``base`` itself: which of DeepSeek's round trips
    moves KL and top-1 most. The model's precision is restored afterwards."""
    names = list(ROUND_TRIPS) if round_trips is None else [as_round_trip(r) for r in round_trips]
    base_pol = PrecisionPolicy.parse(base)
    originals = _originals(originals, reference_model)
    ref = _reference(model, ids, reference, reference_model, originals)
    trials = [("(base)", base_pol)] + [(str(n), base_pol.with_round_trip(n)) for n in names]
    official = base_pol
    for n in ROUND_TRIPS:
        official = official.with_round_trip(n)
    trials.append(("official (all five)", official))
    rows = []
    for label, pol in _progress(trials, progress, "round trips"):
        trial = evaluate(model, ids, pol, ref, originals, k)
        rows.append(_row(trial, round_trip=label, policy=pol.describe()))
    df = pd.DataFrame(rows)
    df["kl_change_vs_base"] = df["kl"] - df["kl"].iloc[0]
    df["top1_change_vs_base"] = df["top1"] - df["top1"].iloc[0]
    return df[ROUND_TRIP_COLUMNS]


@dataclass
class FloorResult:
    kinds: list            # kinds switched to ``fix``, in the order chosen
    kl: float              # KL of the final policy
    reached: bool          # KL < threshold
    policy: PrecisionPolicy
    steps: object          # DataFrame: step, added, kl, top1, min_layer_cos, mem_delta_bytes

    def __str__(self) -> str:
        state = "reached" if self.reached else "NOT reached"
        return f"precision floor {state}: {self.kinds or 'nothing'} -> KL {self.kl:.3g} ({self.policy.describe()})"


def _step(step: int, added: str, trial: Trial, base_bytes: int) -> dict:
    res = trial.result
    return {"step": step, "added": added, "kl": res.kl_mean, "top1": res.top1, "min_layer_cos": res.min_layer_cos,
            "mem_delta_bytes": trial.bytes_after - base_bytes}


@torch.no_grad()
def precision_floor(model, ids: torch.Tensor, threshold: float, base=Mode.W4A16, fix: str = Mode.BF16, reference=Mode.BF16,
                    kinds=None, reference_model=None, originals: Originals | None = None, max_steps: int | None = None,
                    progress: bool = True) -> FloorResult:
    """Greedy: starting from ``base``, repeatedly switch to ``fix`` the kind that lowers KL (vs the
    reference) the most, until KL < threshold, nothing is left or ``max_steps`` kinds were added.
    ``reference`` as in :func:`precision_sweep`. The model's precision is restored afterwards."""
    if isinstance(threshold, bool) or not isinstance(threshold, numbers.Real) or not threshold > 0:
        raise InputError(f"threshold must be a number > 0 (the mean KL vs the reference the floor stops below), "
                         f"got {threshold!r}")
    if max_steps is not None:
        check_int(max_steps, "max_steps", 0, "kinds to add; None: every kind")
    candidates = linear_kinds(model) if kinds is None else list(kinds)
    _check_kinds(model, candidates)
    originals = _originals(originals, reference_model)
    ref = _reference(model, ids, reference, reference_model, originals)
    pol = PrecisionPolicy.parse(base)
    trial = evaluate(model, ids, pol, ref, originals)
    base_bytes = trial.bytes_after
    kl = trial.result.kl_mean
    steps = [_step(0, "(none)", trial, base_bytes)]
    chosen: list[str] = []
    limit = len(candidates) if max_steps is None else max_steps
    for step in _progress(range(limit), progress, "precision floor"):
        if kl < threshold or not candidates:
            break
        best = None
        for kind in candidates:
            t = evaluate(model, ids, pol.with_rule(kind, fix), ref, originals)
            if best is None or t.result.kl_mean < best[1].result.kl_mean:
                best = (kind, t)
        kind, trial = best
        pol = trial.policy
        chosen.append(kind)
        candidates.remove(kind)
        kl = trial.result.kl_mean
        steps.append(_step(step + 1, kind, trial, base_bytes))
    return FloorResult(chosen, kl, kl < threshold, pol, pd.DataFrame(steps))
