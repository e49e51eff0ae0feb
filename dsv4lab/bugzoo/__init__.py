"""The bug zoo: known DSV4 inference bugs (DESIGN section 5, /work/shared/seeds) as injectable
component implementations, and a triage that must find each one.

    from dsv4lab.bugzoo import BUGS, inject, triage
    h = inject(model, "sink_scaled", layers=[0])   # swap in the buggy implementation
    h.restore()
    r = triage(model, "compressor_ape_on_kv", ids)
    r.first_divergence, r.localized                # 'layers.1.attn.compressor.hook_entries', True

A bug lives in one component kind; ``inject`` replaces the matching components (all layers, or
``layers``) with the buggy subclass. ``triage`` runs the clean model and the injected one on the
same ids, finds the first hook point (in execution order) whose value differs, and checks that it
lies inside a component the bug was injected into (the nearest enclosing component with hook
points, e.g. a linear's attention block).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import pandas as pd
import torch
from tqdm.auto import tqdm

from ..analysis.compare import compare_runs
from ..analysis.components import component_matcher, hook_inside, iter_components, owner_of, replace
from ..handles import Restorable
from ..model.linear import QLinear
from ..patterns import no_match_error
from ..precision import quantized_in_place
from . import variants as V

SEEDS = {
    "000": "seeds/000_132ad209e9be1d42 (fix: compressor pos bias on KV + SwiGLU clamp ordering)",
    "001": "seeds/001_9997a25f7295c918 (same fix, CUDA-graph branch)",
    "002": "seeds/002_3b49d35347402715 (NVFP4 GEMM/FMHA/mHC fixes)",
    "003": "seeds/003_ab85d8f52cca1ebd (runtime activation global scale instead of input_scale)",
}


@dataclass(frozen=True)
class Bug:
    name: str
    kind: str                     # component kind the bug lives in
    targets: tuple                # component patterns with {L} for the layer (or a predicate)
    impl: type                    # buggy class (or mixin, see ``mixin``)
    description: str
    seed: str | None              # where it comes from (seeds/ file), None if not from seeds
    requires: str | None = None   # "nvfp4": only NVFP4-quantised linears can have it
    mixin: bool = False           # impl is a mixin put in front of each original's class

    def to_dict(self) -> dict:
        return {"name": self.name, "kind": self.kind, "description": self.description, "seed": self.seed,
                "requires": self.requires}


def _is_linear(name, mod):
    return isinstance(mod, QLinear)


_LIST = [
    Bug("compressor_ape_on_kv", "compressor", ("layers.{L}.attn.compressor",), V.CompressorApeOnKV,
        "compressor position bias (ape) added to the KV content C, not only to the softmax logits Z", SEEDS["000"]),
    Bug("swiglu_clamp_after_silu", "experts", ("layers.{L}.mlp.experts.*",), V.ExpertClampAfterSilu,
        "routed experts clamp silu(gate) instead of clamping gate before SiLU", SEEDS["000"]),
    Bug("shared_swiglu_clamp_after_silu", "shared_expert", ("layers.{L}.mlp.shared_expert",), V.SharedExpertClampAfterSilu,
        "shared expert clamps silu(gate) instead of clamping gate before SiLU", SEEDS["000"]),
    Bug("mhc_split_order", "mhc", ("layers.{L}.attn_hc", "layers.{L}.ffn_hc"), V.MHCSplitOrder,
        "mHC fn/base/scale split as [pre, comb, post] instead of [pre, post, comb]", SEEDS["002"]),
    Bug("mhc_comb_not_transposed", "mhc", ("layers.{L}.attn_hc", "layers.{L}.ffn_hc"), V.MHCCombNotTransposed,
        "mHC comb applied as comb @ streams instead of comb^T @ streams", SEEDS["002"]),
    Bug("mhc_sinkhorn_from_exp", "mhc", ("layers.{L}.attn_hc", "layers.{L}.ffn_hc"), V.MHCSinkhornFromExp,
        "Sinkhorn started from exp(logits) instead of softmax(logits)+eps", SEEDS["002"]),
    Bug("mhc_pre_no_eps", "mhc", ("layers.{L}.attn_hc", "layers.{L}.ffn_hc"), V.MHCPreNoEps,
        "mHC pre weights without the +hc_eps guard", SEEDS["002"]),
    Bug("sink_scaled", "attn", ("layers.{L}.attn",), V.AttentionSinkScaled,
        "attention sink logit multiplied by the softmax scale", SEEDS["002"]),
    Bug("padded_kv_in_softmax", "attn", ("layers.{L}.attn",), V.AttentionPaddedKVCounted,
        "padded/masked KV slots counted in the softmax (as zero keys) -- padded length passed as s_k", SEEDS["002"]),
    Bug("weight_scale_2_dropped", "linear", (_is_linear,), V.WeightScale2DroppedMixin,
        "NVFP4 dequant without weight_scale_2 (lut[w] * weight_scale only)", SEEDS["002"], requires="nvfp4", mixin=True),
    Bug("act_input_scale", "experts", ("layers.{L}.mlp.experts.*.*",), V.ActInputScaleMixin,
        "W4A4: checkpoint input_scale used as the activation global scale instead of amax/(6*448)", SEEDS["003"],
        mixin=True),
    Bug("indexer_keys_per_head", "indexer", ("layers.{L}.attn.indexer",), V.IndexerKeysPerHead,
        "indexer keys split per head (MHA-style) instead of one key shared by all heads", "DESIGN section 5"),
    Bug("indexer_off", "indexer", ("layers.{L}.attn.indexer",), V.IndexerOff,
        "indexer silently off: CSA attends every closed compressed entry instead of the top-k", "DESIGN section 5"),
    Bug("indexer_q_no_rope", "indexer", ("layers.{L}.attn.indexer",), V.IndexerQNoRope,
        "indexer queries without RoPE (the compressed keys have it)", SEEDS["000"]),
    Bug("moe_w1_w3_swapped", "experts", ("layers.{L}.mlp.experts.*",), V.ExpertW1W3Swapped,
        "MoE weight layout: gate (w1) and up (w3) halves of gate_up swapped", SEEDS["002"]),
    Bug("router_bias_in_weights", "router", ("layers.{L}.mlp.router",), V.RouterBiasInWeights,
        "score-correction bias used in the routing weights too, not only for choosing (not from seeds: "
        "a classic DeepSeek-V3-port bug)", None),
]
BUGS: dict[str, Bug] = {b.name: b for b in _LIST}


class UnknownBugError(KeyError):
    """A bug name not in :data:`BUGS`; the message names ``bug=`` and the closest names."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


def bug_named(bug: "str | Bug", argument: str = "bug") -> Bug:
    """The :class:`Bug` called ``bug`` (a Bug passes through); UnknownBugError with did-you-mean."""
    if isinstance(bug, Bug):
        return bug
    if not isinstance(bug, str) or bug not in BUGS:
        err = no_match_error("known bug", argument, bug if isinstance(bug, str) else repr(bug), BUGS,
                             "dsv4lab.bugzoo.BUGS or `python -m dsv4lab bugzoo --list` lists them")
        raise UnknownBugError(err.args[0])
    return BUGS[bug]


def list_bugs():
    return pd.DataFrame([b.to_dict() for b in BUGS.values()])


# ------------------------------------------------------------------------------ inject
@dataclass
class BugHandle(Restorable):
    bug: Bug
    handles: list = field(default_factory=list)
    applicable: bool = True
    reason: str = ""

    @property
    def names(self) -> list[str]:
        return [n for h in self.handles for n in h.names]

    def restore(self) -> None:
        for h in reversed(self.handles):
            h.restore()

    def __repr__(self) -> str:
        state = f"{len(self.names)} modules" if self.applicable else f"not applicable: {self.reason}"
        return f"BugHandle({self.bug.name}, {state})"


def _layer_ok(name: str, layers) -> bool:
    if layers is None:
        return True
    parts = name.split(".")
    return len(parts) > 1 and parts[0] == "layers" and parts[1].isdigit() and int(parts[1]) in layers


def _matcher(bug: Bug, layers) -> Callable:
    preds = []
    for t in bug.targets:
        if callable(t):
            preds.append(t)
        else:
            preds.append(component_matcher(t.replace("{L}", "*")))
    return lambda name, mod: _layer_ok(name, layers) and any(p(name, mod) for p in preds)


def _is_nvfp4(mod) -> bool:
    return getattr(mod, "qweight", None) is not None and getattr(mod.qweight, "format", None) == "nvfp4"


def inject(model, bug: str | Bug, layers=None) -> BugHandle:
    """Replace the components ``bug`` lives in (all layers, or ``layers``) by its buggy
    implementation. Returns a handle (``restore()``, context manager); ``handle.applicable`` is
    False (and nothing changes) when the model has no such component, e.g. an NVFP4-only bug on
    plain weights."""
    b = bug_named(bug)
    if isinstance(layers, int):
        layers = [layers]
    layers = None if layers is None else set(layers)
    match = _matcher(b, layers)
    targets = {}
    for name, mod in iter_components(model):
        if any(name.startswith(t + ".") for t in targets):
            continue
        if match(name, mod) and (b.requires != "nvfp4" or _is_nvfp4(mod)):
            targets[name] = mod
    h = BugHandle(b)
    if not targets:
        h.applicable = False
        h.reason = ("no NVFP4-quantised linear in the target (plain weights): quantise first, e.g. "
                    "dsv4lab.precision.quantize_linears(model)") if b.requires == "nvfp4" else \
            f"no {b.kind} component in layers {sorted(layers) if layers else 'any'}"
        return h
    by_class: dict[type, list[str]] = {}
    for name, mod in targets.items():
        by_class.setdefault(type(mod), []).append(name)
    try:
        for cls, names in by_class.items():
            impl = b.impl
            if b.mixin:
                impl = type(f"{b.impl.__name__.replace('Mixin', '')}{cls.__name__}", (b.impl, cls),
                            {"_reference_class": cls})
            keep = set(names)
            h.handles.append(replace(model, lambda n, m, keep=keep: n in keep, impl, label=f"bug:{b.name}"))
    except Exception:
        h.restore()
        raise
    return h


# ------------------------------------------------------------------------------ triage
@dataclass
class TriageResult:
    bug: str
    kind: str
    applicable: bool
    reason: str = ""
    first_divergence: str | None = None
    expected: list = field(default_factory=list)   # components the bug was injected into (hook owners)
    localized: bool = False
    rel_err: float | None = None
    kl: float | None = None
    top1: float | None = None
    quantized: bool = False
    compare: object = None

    def to_dict(self) -> dict:
        d = {k: getattr(self, k) for k in ("bug", "kind", "applicable", "reason", "first_divergence", "expected",
                                           "localized", "rel_err", "kl", "top1", "quantized")}
        if d["rel_err"] is not None and d["rel_err"] != d["rel_err"] or d["rel_err"] == float("inf"):
            d["rel_err"] = None
        return d

    def line(self) -> str:
        if not self.applicable:
            return f"{self.bug:32s} n/a   ({self.reason})"
        fd = self.first_divergence or ""
        hit = [o for o in self.expected if fd.startswith(o + ".")]
        where = f"inside {hit[0]}" if self.localized and hit else "inside" if self.localized else \
            f"OUTSIDE {', '.join(self.expected[:3])}{'...' if len(self.expected) > 3 else ''}"
        return (f"{self.bug:32s} {'OK ' if self.localized else 'BAD'}  first divergence {self.first_divergence} "
                f"({where}); "
                f"KL {self.kl:.3g}, top-1 {self.top1:.2f}")


def _needs_quant(model, b: Bug, layers) -> bool:
    if b.requires != "nvfp4":
        return False

    match = _matcher(b, None if layers is None else set([layers] if isinstance(layers, int) else layers))
    return not any(match(n, m) and _is_nvfp4(m) for n, m in iter_components(model))


@torch.no_grad()
def triage(clean_model, bug: str | Bug, ids: torch.Tensor, layers=None, tol: float = 0.0,
           quantize: bool = False) -> TriageResult:
    """Inject ``bug`` into ``clean_model`` (restored afterwards), diff against the clean run, and
    report the first divergent hook point and whether it lies inside the injected component.

    ``tol`` = 0: on one device the clean and buggy runs are bitwise identical up to the bug.
    ``quantize``: for NVFP4-only bugs on a plain model, quantise its linears in place for the
    triage (``dsv4lab.precision.quantized_in_place``; the plain weights are put back after, also
    on an error) instead of reporting n/a -- no copy of the model.
    """
    b = bug_named(bug)
    if not _needs_quant(clean_model, b, layers):
        return _triage(clean_model, b, ids, layers, tol, False)
    if not quantize:
        return TriageResult(b.name, b.kind, False, "needs NVFP4 weights (pass quantize=True to quantise in memory)")
    with quantized_in_place(clean_model):
        return _triage(clean_model, b, ids, layers, tol, True)


def _triage(model, b: Bug, ids: torch.Tensor, layers, tol: float, quantized: bool) -> TriageResult:
    holder = {}

    def intervention(m):
        holder["h"] = inject(m, b, layers)
        return holder["h"]

    res = compare_runs(model, (model, intervention), ids, tol=tol)
    h = holder["h"]
    if not h.applicable:
        return TriageResult(b.name, b.kind, False, h.reason, quantized=quantized)
    expected = sorted({owner_of(model, n) for n in h.names})
    fd = res.first_divergence
    localized = fd is not None and any(hook_inside(model, fd, n) for n in h.names)
    row = res.first_divergence_row or {}
    return TriageResult(b.name, b.kind, True, "", fd, expected, localized, row.get("rel_err"), res.kl_mean, res.top1,
                        quantized, res)


def triage_all(model, ids: torch.Tensor, bugs=None, quantize: bool = True, progress: bool = False) -> list[TriageResult]:
    names = list(BUGS) if bugs is None else list(bugs)
    it = names
    if progress:
        it = tqdm(names, desc="bug zoo", leave=False)
    return [triage(model, n, ids, quantize=quantize) for n in it]


__all__ = ["BUGS", "Bug", "BugHandle", "TriageResult", "inject", "triage", "triage_all", "list_bugs"]
