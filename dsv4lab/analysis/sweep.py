"""Precision ablations: flip one component kind at a time (optionally per layer) and measure,
against a reference run, next-token KL / top-1 agreement, the minimum per-layer cosine of the
residual streams, router top-k overlap and the weight-memory change; plus a greedy search for the
smallest set of kinds that must run in BF16 to bring KL under a threshold.

Two ways to read a sweep (``reference`` = the truth, ``base`` = what everything else runs in):
  * damage:  reference="bf16", base="bf16",  flip="w4a4"  -> what quantising ONE kind costs;
  * rescue:  reference="bf16", base="w4a4",  flip="bf16"  -> what restoring ONE kind to BF16 buys.
``reference_model`` compares against another model instead (e.g. the unquantised original, when
the model under test holds FP4 weights: with fp32/bf16 compute, ``bf16`` and ``w4a16`` use the
same dequantised weights and differ only through kernels, so their KL is 0 by construction).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..precision import (PrecisionPolicy, apply_precision, linear_kind, linear_kinds, linear_layer,
                         precision_state, restore_precision)
from .cache import run_with_cache
from .compare import _compare_against

SWEEP_HOOKS = ["layers.*.hook_resid_post", "layers.*.mlp.router.hook_ids"]


def _progress(iterable, enabled: bool, desc: str, total=None):
    if not enabled:
        return iterable
    from tqdm.auto import tqdm

    return tqdm(iterable, desc=desc, total=total, leave=False)


@torch.no_grad()
def _reference(model, ids, reference, reference_model):
    ref_model = reference_model if reference_model is not None else model
    saved = precision_state(ref_model)
    try:
        apply_precision(ref_model, reference)
        logits, cache = run_with_cache(ref_model, ids, names=SWEEP_HOOKS, device="cpu")
    finally:
        restore_precision(ref_model, saved)
    return logits.detach().cpu(), cache


def _row(res, **extra) -> dict:
    return {**extra, "kl": res.kl_mean, "kl_max": res.kl_max, "top1": res.top1, "topk": res.topk,
            "min_layer_cos": res.min_layer_cos, "router_overlap": res.mean_router_overlap}


@torch.no_grad()
def ablation_sweep(model, ids: torch.Tensor, kinds=None, reference="bf16", base=None, flip: str = "w4a16",
                   per_layer: bool = False, layers=None, reference_model=None, k: int = 5,
                   progress: bool = True, include_base: bool = True):
    """DataFrame with one row per (kind[, layer]) flipped to ``flip`` on top of ``base``:
    kind, layers, mode, base, kl, kl_max, top1, topk, min_layer_cos, router_overlap,
    mem_delta_bytes (vs the base policy), n_linears. The first row (kind ``(base)``) is the base
    policy itself. The model's precision modes are restored afterwards."""
    import pandas as pd

    base = reference if base is None else base
    base_pol = PrecisionPolicy.parse(base)
    all_kinds = linear_kinds(model)
    kinds = all_kinds if kinds is None else [kinds] if isinstance(kinds, str) else list(kinds)
    unknown = [x for x in kinds if x not in all_kinds]
    if unknown:
        raise KeyError(f"no linears of kind {unknown}; the model has {all_kinds}")
    layer_of = {}
    for name, _ in model.qlinears():
        layer_of.setdefault(linear_kind(name), set()).add(linear_layer(name))
    jobs = []
    for kind in kinds:
        if per_layer:
            ls = sorted(l for l in layer_of[kind] if l is not None and (layers is None or l in layers))
            jobs += [(kind, (l,)) for l in ls] or [(kind, None)]
        else:
            jobs.append((kind, None if layers is None else tuple(layers)))

    ref_logits, ref_cache = _reference(model, ids, reference, reference_model)
    saved = precision_state(model)
    rows = []
    try:
        base_rep = apply_precision(model, base_pol)
        if include_base:
            res = _compare_against(ref_logits, ref_cache, model, None, ids, SWEEP_HOOKS, 0.0, k)
            rows.append(_row(res, kind="(base)", layers=None, mode=base_pol.default, base=base_pol.describe(),
                             mem_delta_bytes=0, n_linears=0))
        for kind, ls in _progress(jobs, progress, f"sweep {flip}"):
            pol = base_pol.with_rule(kind, flip, ls)
            rep = apply_precision(model, pol)
            n = sum(1 for name, _ in model.qlinears() if linear_kind(name) == kind and (ls is None or linear_layer(name) in ls))
            res = _compare_against(ref_logits, ref_cache, model, None, ids, SWEEP_HOOKS, 0.0, k)
            rows.append(_row(res, kind=kind, layers=None if ls is None else list(ls), mode=flip,
                             base=base_pol.describe(), mem_delta_bytes=rep["bytes_after"] - base_rep["bytes_after"],
                             n_linears=n))
    finally:
        restore_precision(model, saved)
    cols = ["kind", "layers", "mode", "base", "kl", "kl_max", "top1", "topk", "min_layer_cos", "router_overlap",
            "mem_delta_bytes", "n_linears"]
    return pd.DataFrame(rows, columns=cols)


@dataclass
class FloorResult:
    kinds: list            # kinds switched to ``fix``, in the order chosen
    kl: float              # KL of the final policy
    reached: bool          # KL < threshold
    policy: PrecisionPolicy
    steps: object          # DataFrame: step, added, kl, top1, mem_delta_bytes

    def __str__(self) -> str:
        state = "reached" if self.reached else "NOT reached"
        return f"precision floor {state}: {self.kinds or 'nothing'} -> KL {self.kl:.3g} ({self.policy.describe()})"


@torch.no_grad()
def precision_floor(model, ids: torch.Tensor, threshold: float, base="w4a16", fix: str = "bf16", reference="bf16",
                    kinds=None, reference_model=None, max_kinds: int | None = None, progress: bool = True) -> FloorResult:
    """Greedy: starting from ``base``, repeatedly switch to ``fix`` the kind that lowers KL (vs the
    reference) the most, until KL < threshold (or nothing is left). Returns the chosen kinds, in
    order, with the KL after each step. The model's modes are restored afterwards."""
    import pandas as pd

    candidates = linear_kinds(model) if kinds is None else list(kinds)
    ref_logits, ref_cache = _reference(model, ids, reference, reference_model)
    saved = precision_state(model)
    pol = PrecisionPolicy.parse(base)
    steps = []
    chosen: list[str] = []
    try:
        base_rep = apply_precision(model, pol)
        res = _compare_against(ref_logits, ref_cache, model, None, ids, SWEEP_HOOKS, 0.0, 5)
        kl = res.kl_mean
        steps.append({"step": 0, "added": None, "kl": kl, "top1": res.top1, "mem_delta_bytes": 0})
        limit = len(candidates) if max_kinds is None else max_kinds
        bar = _progress(range(limit), progress, "precision floor")
        for step in bar:
            if kl < threshold or not candidates:
                break
            best = None
            for kind in candidates:
                trial = pol.with_rule(kind, fix)
                rep = apply_precision(model, trial)
                r = _compare_against(ref_logits, ref_cache, model, None, ids, SWEEP_HOOKS, 0.0, 5)
                if best is None or r.kl_mean < best[1]:
                    best = (kind, r.kl_mean, r.top1, rep["bytes_after"] - base_rep["bytes_after"])
            kind, kl, top1, mem = best
            pol = pol.with_rule(kind, fix)
            chosen.append(kind)
            candidates.remove(kind)
            steps.append({"step": step + 1, "added": kind, "kl": kl, "top1": top1, "mem_delta_bytes": mem})
    finally:
        restore_precision(model, saved)
    return FloorResult(chosen, kl, kl < threshold, pol, pd.DataFrame(steps))
