"""Compare two runs hook by hook: next-token KL / agreement, per-hook cosine and relative error,
router top-k overlap per layer, and the first point of divergence in execution order.

    res = compare_runs(clean, (clean, lambda m: inject(m, "sink_scaled")), ids)
    res.first_divergence     # 'layers.0.attn.hook_probs'
    res.table()              # per-hook DataFrame in execution order
    print(res.summary())

Side B may be another model or ``(model, intervention)``; an intervention is a list of
``(pattern, fn)`` forward hooks, a ``{component_pattern: impl}`` dict of replacements or a
callable ``f(model)`` returning a handle with ``restore()`` (or a context manager, or None) --
for a precision policy ``lambda m: dsv4lab.precision.using_precision(m, "w4a4")``.
Run A is captured (offloaded to ``device``); run B is compared on the fly as each hook fires, so
only one side's activations are held at a time.
"""
from __future__ import annotations

import contextlib
import math
import numbers
import re
from dataclasses import dataclass, field

import pandas as pd
import torch

from ..model import DSV4Model
from ..model.validate import InputError, check_int
from ..quant.modes import ACT_SCALES, MODES
from .cache import run_with_cache
from .components import replace
from .hooks import hooks, name_filter

_ROUTER_IDS = re.compile(r"^layers\.(\d+)\.mlp\.router\.hook_ids$")
_RESID_POST = re.compile(r"^layers\.(\d+)\.hook_resid_post$")


# ------------------------------------------------------------------------------ interventions
def _is_hook_list(x) -> bool:
    return isinstance(x, (list, tuple)) and len(x) > 0 and all(isinstance(e, tuple) and len(e) == 2 for e in x)


@contextlib.contextmanager
def applied(model, intervention):
    """Context manager applying one intervention (see module doc) and undoing it on exit."""
    if intervention is None or (isinstance(intervention, (list, tuple)) and not intervention):
        yield None
        return
    if _is_hook_list(intervention):
        with hooks(model, intervention) as hs:
            yield hs
        return
    if isinstance(intervention, str) or (isinstance(intervention, dict) and _looks_like_policy(intervention)):
        raise TypeError(f"{intervention!r} looks like a precision policy: pass it as a callable, "
                        "lambda m: dsv4lab.precision.using_precision(m, policy)")
    if isinstance(intervention, dict):
        handles = []
        try:
            for pat, impl in intervention.items():
                handles.append(replace(model, pat, impl))
            yield handles
        finally:
            for h in reversed(handles):
                h.restore()
        return
    if callable(intervention):
        r = intervention(model)
        try:
            if r is not None and not hasattr(r, "restore") and hasattr(r, "__enter__"):
                with r as v:
                    yield v
            else:
                yield r
        finally:
            if r is not None and hasattr(r, "restore"):
                r.restore()
        return
    raise TypeError(f"unsupported intervention {type(intervention).__name__}")


def _looks_like_policy(d: dict) -> bool:
    words = {*MODES, *ACT_SCALES}
    return all(isinstance(v, str) and v in words for v in d.values())


def _side(x, argument: str):
    """(model, intervention or None) of a compared side: a model or (model, intervention)."""
    m, i = (x[0], x[1]) if isinstance(x, tuple) and len(x) == 2 and not isinstance(x[0], torch.Tensor) else (x, None)
    if not isinstance(m, DSV4Model):
        raise InputError(f"{argument} must be a DSV4 model or (model, intervention), got {type(m).__name__} "
                         f"(e.g. dsv4lab.load(...), or (model, [(hook pattern, fn)]))")
    return m, i


# ------------------------------------------------------------------------------ metrics
def tensor_diff(a: torch.Tensor, b: torch.Tensor) -> dict:
    """cos, rel_err (||a-b||/||a||), max_abs and a status for one pair of captures."""
    if tuple(a.shape) != tuple(b.shape):
        return {"cos": float("nan"), "rel_err": float("inf"), "max_abs": float("inf"), "status": "shape"}
    if not a.is_floating_point() or not b.is_floating_point():
        a2, b2 = a.long().cpu(), b.long().cpu()  # captures may be offloaded while live ones are not
        if a2.dim() >= 1:  # sets (expert ids, chosen entries): order-insensitive
            a2, b2 = a2.sort(-1).values, b2.sort(-1).values
        frac = (a2 != b2).double().mean().item() if a2.numel() else 0.0
        return {"cos": float("nan"), "rel_err": frac, "max_abs": float((a2 - b2).abs().max().item()) if a2.numel() else 0.0,
                "status": "ok"}
    a64, b64 = a.double().cpu(), b.double().cpu()
    fin = torch.isfinite(a64) & torch.isfinite(b64)
    same = (a64 == b64) | (torch.isnan(a64) & torch.isnan(b64))
    if bool((~fin & ~same).any()):
        return {"cos": float("nan"), "rel_err": float("inf"), "max_abs": float("inf"), "status": "nonfinite"}
    x, y = a64[fin], b64[fin]
    d = x - y
    na, nb = x.norm().item(), y.norm().item()
    rel = d.norm().item() / max(na, 1e-30) if na > 0 else (0.0 if d.norm().item() == 0 else float("inf"))
    cos = (x @ y).item() / (na * nb) if na > 0 and nb > 0 else (1.0 if na == nb else 0.0)
    return {"cos": cos, "rel_err": rel, "max_abs": d.abs().max().item() if d.numel() else 0.0, "status": "ok"}


def next_token_metrics(la: torch.Tensor, lb: torch.Tensor, k: int = 5) -> dict:
    """KL(p_a || p_b) per position (mean over batch), top-1 and top-k agreement."""
    la, lb = la.detach().double().cpu(), lb.detach().double().cpu()
    lpa, lpb = torch.log_softmax(la, -1), torch.log_softmax(lb, -1)
    kl = (lpa.exp() * (lpa - lpb)).sum(-1).clamp(min=0)  # [B,S]
    top1 = (la.argmax(-1) == lb.argmax(-1)).double()
    k = min(k, la.shape[-1])
    ta, tb = la.topk(k, -1).indices, lb.topk(k, -1).indices
    topk = (ta.unsqueeze(-1) == tb.unsqueeze(-2)).any(-1).double().mean(-1)
    return {"kl_mean": kl.mean().item(), "kl_max": kl.max().item(), "kl_per_pos": kl.mean(0).tolist(),
            "top1": top1.mean().item(), "top1_per_pos": top1.mean(0).tolist(), "topk": topk.mean().item(), "k": k}


def router_overlap(ids_a: torch.Tensor, ids_b: torch.Tensor) -> float:
    """Mean over tokens of |chosen_a & chosen_b| / k."""
    a, b = ids_a.long().cpu(), ids_b.long().cpu()
    return (a.unsqueeze(-1) == b.unsqueeze(-2)).any(-1).double().mean().item()


# ------------------------------------------------------------------------------ result
@dataclass
class CompareResult:
    kl_mean: float
    kl_max: float
    kl_per_pos: list
    top1: float
    topk: float
    k: int
    rows: list                      # one dict per (hook, firing) in A's execution order
    router_overlap: dict            # layer -> overlap
    layer_cos: dict                 # layer -> cosine of hook_resid_post
    first_divergence: str | None
    tol: float
    order_a: list = field(default_factory=list)
    order_b: list = field(default_factory=list)
    last_logits_b: torch.Tensor | None = None   # [batch, vocab] fp32 on the CPU: B's logits at the last position

    @property
    def min_layer_cos(self) -> float:
        return min(self.layer_cos.values()) if self.layer_cos else float("nan")

    @property
    def mean_router_overlap(self) -> float:
        return sum(self.router_overlap.values()) / len(self.router_overlap) if self.router_overlap else float("nan")

    @property
    def missing_in_b(self) -> list:
        return [r["name"] for r in self.rows if r["status"] == "missing_in_b"]

    @property
    def missing_in_a(self) -> list:
        return [r["name"] for r in self.rows if r["status"] == "missing_in_a"]

    @property
    def first_divergence_row(self) -> dict | None:
        for r in self.rows:
            if r["name"] == self.first_divergence:
                return r
        return None

    def table(self):
        return pd.DataFrame(self.rows, columns=["order", "name", "firing", "shape", "cos", "rel_err", "max_abs", "status", "diverged"])

    def to_dict(self) -> dict:
        def clean(v):
            return None if isinstance(v, float) and (math.isnan(v) or math.isinf(v)) else v

        return {"kl_mean": self.kl_mean, "kl_max": self.kl_max, "top1": self.top1, "topk": self.topk, "k": self.k,
                "min_layer_cos": clean(self.min_layer_cos), "router_overlap": self.router_overlap,
                "first_divergence": self.first_divergence, "tol": self.tol,
                "first_divergence_rel_err": clean((self.first_divergence_row or {}).get("rel_err"))}

    def summary(self) -> str:
        lines = [f"next-token KL mean {self.kl_mean:.3g} (max {self.kl_max:.3g}); top-1 agreement {self.top1:.3f}; "
                 f"top-{self.k} overlap {self.topk:.3f}"]
        if self.layer_cos:
            lines.append("layer cosine (resid_post): " + " ".join(f"L{l}={c:.4f}" for l, c in sorted(self.layer_cos.items())))
        if self.router_overlap:
            lines.append("router top-k overlap: " + " ".join(f"L{l}={o:.3f}" for l, o in sorted(self.router_overlap.items())))
        fd = self.first_divergence_row
        if fd is None:
            lines.append(f"no hook point diverges (tol {self.tol:g})")
        else:
            lines.append(f"first divergence (tol {self.tol:g}): {fd['name']} [{fd['status']}] rel_err={fd['rel_err']:.3g} "
                         f"cos={fd['cos']:.4f} (hook #{fd['order']} in execution order)")
        return "\n".join(lines)

    __str__ = summary


# ------------------------------------------------------------------------------ the comparison
@torch.no_grad()
def compare_runs(model_a, model_b, ids: torch.Tensor, names=None, tol: float = 1e-4, k: int = 5,
                 device="cpu", ids_b: torch.Tensor | None = None) -> CompareResult:
    """Run A (captured) then B (compared as it runs) on ``ids``; see module doc.

    names: which hook points to compare (fnmatch patterns / predicate; default all). tol: a hook
    diverges when rel_err > tol (or shape/non-finite mismatch, or it fired on one side only).
    """
    ma, ia = _side(model_a, "model_a")
    mb, ib = _side(model_b, "model_b (model.compare's other)")
    if isinstance(tol, bool) or not isinstance(tol, numbers.Real) or not tol >= 0:
        raise InputError(f"tol must be a number >= 0 (the rel_err above which a hook diverges), got {tol!r}")
    check_int(k, "k", 1, "the top-k logits compared")
    with applied(ma, ia):
        logits_a, cache_a = run_with_cache(ma, ids, names=names, device=device)
    return compare_against(logits_a.detach().to(device or logits_a.device), cache_a, mb, ib,
                           ids if ids_b is None else ids_b, names, tol, k)


def compare_against(logits_a, cache_a, mb, ib, ids, names=None, tol: float = 1e-4, k: int = 5) -> CompareResult:
    """Run B (``mb`` under intervention ``ib``) on ``ids`` and compare it, hook by hook as it
    fires, with an already captured run A (``logits_a``, ``cache_a``); what compare_runs does
    after capturing A, for callers that reuse one A run (sweeps)."""
    keep = name_filter(names)
    fired_b: dict[str, int] = {}
    order_b: list[str] = []
    metrics: dict[tuple[str, int], dict] = {}
    router_b: dict[int, torch.Tensor] = {}

    def on_b(t, name):
        order_b.append(name)
        i = fired_b.get(name, 0)
        fired_b[name] = i + 1
        if not keep(name):
            return None
        m = _ROUTER_IDS.match(name)
        if m and i == 0:
            router_b[int(m.group(1))] = t.detach().cpu()
        if name in cache_a and i < len(cache_a.all(name)):
            a = cache_a.all(name)[i]
            metrics[(name, i)] = {**tensor_diff(a, t.detach()), "shape": tuple(t.shape)}
        else:
            metrics[(name, i)] = {"cos": float("nan"), "rel_err": float("inf"), "max_abs": float("inf"),
                                  "status": "missing_in_a", "shape": tuple(t.shape)}
        return None

    with applied(mb, ib):
        with hooks(mb, [("**" if names is None else names, on_b)], strict=False):  # listen only where compared
            logits_b = mb(ids)
    nt = next_token_metrics(logits_a, logits_b, k)

    rows = []
    seen_a: dict[str, int] = {}
    first = None
    for order, name in enumerate(cache_a.order):
        if not keep(name):
            continue
        i = seen_a.get(name, 0)
        seen_a[name] = i + 1
        r = metrics.pop((name, i), None)
        if r is None:
            r = {"cos": float("nan"), "rel_err": float("inf"), "max_abs": float("inf"), "status": "missing_in_b",
                 "shape": tuple(cache_a.all(name)[i].shape) if name in cache_a and i < len(cache_a.all(name)) else None}
        div = r["status"] != "ok" or r["rel_err"] > tol
        rows.append({"order": order, "name": name, "firing": i, **r, "diverged": div})
        if div and first is None:
            first = name
    for (name, i), r in metrics.items():  # fired only in B
        rows.append({"order": None, "name": name, "firing": i, **r, "diverged": True})
        if first is None:
            first = name

    layer_cos = {}
    for r in rows:
        m = _RESID_POST.match(r["name"])
        if m and r["firing"] == 0 and r["status"] == "ok":
            layer_cos[int(m.group(1))] = r["cos"]
    overlap = {}
    for name in cache_a:
        m = _ROUTER_IDS.match(name)
        if m and int(m.group(1)) in router_b:
            overlap[int(m.group(1))] = router_overlap(cache_a.all(name)[0], router_b[int(m.group(1))])
    return CompareResult(nt["kl_mean"], nt["kl_max"], nt["kl_per_pos"], nt["top1"], nt["topk"], nt["k"], rows,
                         overlap, layer_cos, first, tol, list(cache_a.order), order_b,
                         logits_b[:, -1].detach().float().cpu())
