"""The bug zoo: known DSV4 inference bugs (DESIGN section 5, /work/shared/seeds) as injectable
component implementations, and a triage that must find each one.

    from dsv4lab.bugzoo import BUGS, inject, triage
    h = inject(model, "sink_scaled", layers=[0])   # swap in the buggy implementation
    h.restore()
    r = triage(model, "compressor_ape_on_kv", ids)
    r.first_divergence, r.localized                # 'layers.1.attn.compressor.hook_entries', True

A bug lives in one component kind; ``inject`` replaces the matching components (all layers, or
``layers``) with the buggy subclass (plus, for a bug with an ``arm``, a change outside the
component undone with it). Each bug carries its :class:`~dsv4lab.bugzoo.inputs.Trigger`: the
prompt, prompt length and input form it needs, which ``triage`` applies to the ids it is given.
``triage`` runs the clean model and the injected one on the same ids, finds the first hook point (in execution order) whose value differs, and checks that it
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
from ..model.compressor import Compressor
from ..model.linear import QLinear
from ..model.moe import Router
from ..model.rope import Rotary, inverse_frequencies
from ..model.validate import check_layers
from ..patterns import no_match_error
from . import variants as V
from .inputs import LIVE_PROMPT, Trigger, drop_ids_from_embeddings, from_embeddings, weights_in_place

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
    requires: str | None = None   # "nvfp4" / "fp8_wo_a": only linears with those weights can have it
    mixin: bool = False           # impl is a mixin put in front of each original's class
    symptom: str = ""             # what a user sees
    trigger: Trigger = Trigger()  # the input it needs (prompt, length residue, input form)
    arm: Callable | None = None   # f(model, handle) -> Restorable|None: the part outside the component

    def to_dict(self) -> dict:
        return {"name": self.name, "kind": self.kind, "description": self.description, "symptom": self.symptom,
                "trigger": self.trigger.to_dict(self.requires), "triggered_by": self.trigger.describe(self.requires),
                "seed": self.seed, "requires": self.requires}


def _is_linear(name, mod):
    return isinstance(mod, QLinear)


def _is_hash_router(name, mod):
    return isinstance(mod, Router) and mod.is_hash


def _is_compress_rotary(name, mod):
    return isinstance(mod, Rotary) and mod.kind == "compress"


def _is_csa_compressor(name, mod):
    return isinstance(mod, Compressor) and mod.overlap


def _main_theta(model, handle) -> None:
    """RotaryMainTheta needs the config: give each clone the main inverse frequencies (its own
    buffer dict; the original keeps its own)."""
    for n in handle.names:
        rot = model.get_submodule(n)
        rot._buffers["inv_freq"] = inverse_frequencies(model.config, "main").to(rot.inv_freq.device)


_CLAMP = LIVE_PROMPT
_FIELD = "public DSV4 ports (issue 22)"


_LIST = [
    Bug("compressor_ape_on_kv", "compressor", ("layers.{L}.attn.compressor",), V.CompressorApeOnKV,
        "compressor position bias (ape) added to the KV content C, not only to the softmax logits Z", SEEDS["000"],
        symptom="every compressed entry offset by its slot's bias: small drift of the CSA/HCA layers"),
    Bug("swiglu_clamp_after_silu", "experts", ("layers.{L}.mlp.experts.*",), V.ExpertClampAfterSilu,
        "routed experts clamp silu(gate) instead of clamping gate before SiLU", SEEDS["000"],
        symptom="wrong only on tokens whose gate passes swiglu_limit: rare spikes in the routed output",
        trigger=Trigger(prompt=_CLAMP)),
    Bug("shared_swiglu_clamp_after_silu", "shared_expert", ("layers.{L}.mlp.shared_expert",), V.SharedExpertClampAfterSilu,
        "shared expert clamps silu(gate) instead of clamping gate before SiLU", SEEDS["000"],
        symptom="wrong only on tokens whose shared gate passes swiglu_limit", trigger=Trigger(prompt=_CLAMP)),
    Bug("mhc_split_order", "mhc", ("layers.{L}.attn_hc", "layers.{L}.ffn_hc"), V.MHCSplitOrder,
        "mHC fn/base/scale split as [pre, comb, post] instead of [pre, post, comb]", SEEDS["002"],
        symptom="residual streams mixed with the wrong weights from layer 0: garbage output"),
    Bug("mhc_comb_not_transposed", "mhc", ("layers.{L}.attn_hc", "layers.{L}.ffn_hc"), V.MHCCombNotTransposed,
        "mHC comb applied as comb @ streams instead of comb^T @ streams", SEEDS["002"],
        symptom="streams mixed along the wrong axis: large error from layer 0"),
    Bug("mhc_sinkhorn_from_exp", "mhc", ("layers.{L}.attn_hc", "layers.{L}.ffn_hc"), V.MHCSinkhornFromExp,
        "Sinkhorn started from exp(logits) instead of softmax(logits)+eps", SEEDS["002"],
        symptom="stream mixing slightly off (the iterations mostly correct it): low KL, top-1 mostly unchanged"),
    Bug("mhc_pre_no_eps", "mhc", ("layers.{L}.attn_hc", "layers.{L}.ffn_hc"), V.MHCPreNoEps,
        "mHC pre weights without the +hc_eps guard", SEEDS["002"],
        symptom="tiny numeric drift (logits ~1e-6 relative): visible only hook by hook"),
    Bug("sink_scaled", "attn", ("layers.{L}.attn",), V.AttentionSinkScaled,
        "attention sink logit multiplied by the softmax scale", SEEDS["002"],
        symptom="sink too weak or strong: attention mass moves to/from the sink, mild KL"),
    Bug("padded_kv_in_softmax", "attn", ("layers.{L}.attn",), V.AttentionPaddedKVCounted,
        "padded/masked KV slots counted in the softmax (as zero keys) -- padded length passed as s_k", SEEDS["002"],
        symptom="attention diluted by the masked slots: large error, worst at early positions"),
    Bug("weight_scale_2_dropped", "linear", (_is_linear,), V.WeightScale2DroppedMixin,
        "NVFP4 dequant without weight_scale_2 (lut[w] * weight_scale only)", SEEDS["002"], requires="nvfp4", mixin=True,
        symptom="every NVFP4 linear scaled by 1/weight_scale_2: activations explode, output is garbage"),
    Bug("act_input_scale", "experts", ("layers.{L}.mlp.experts.*.*",), V.ActInputScaleMixin,
        "W4A4: checkpoint input_scale used as the activation global scale instead of amax/(6*448)", SEEDS["003"],
        mixin=True, symptom="expert activations clip where block scales saturate at 448: large error under w4a4"),
    Bug("indexer_keys_per_head", "indexer", ("layers.{L}.attn.indexer",), V.IndexerKeysPerHead,
        "indexer keys split per head (MHA-style) instead of one key shared by all heads", "DESIGN section 5",
        symptom="indexer picks the wrong compressed entries: drift once a CSA layer has more than index_topk entries"),
    Bug("indexer_off", "indexer", ("layers.{L}.attn.indexer",), V.IndexerOff,
        "indexer silently off: CSA attends every closed compressed entry instead of the top-k", "DESIGN section 5",
        symptom="CSA attends all entries: plausible text, slower, drifts once entries exceed index_topk"),
    Bug("indexer_q_no_rope", "indexer", ("layers.{L}.attn.indexer",), V.IndexerQNoRope,
        "indexer queries without RoPE (the compressed keys have it)", SEEDS["000"],
        symptom="indexer scores lose position: wrong entries chosen once there are more than index_topk entries"),
    Bug("moe_w1_w3_swapped", "experts", ("layers.{L}.mlp.experts.*",), V.ExpertW1W3Swapped,
        "MoE weight layout: gate (w1) and up (w3) halves of gate_up swapped", SEEDS["002"],
        symptom="every routed expert computes silu(up)*gate: large error from the first MoE layer"),
    Bug("router_bias_in_weights", "router", ("layers.{L}.mlp.router",), V.RouterBiasInWeights,
        "score-correction bias used in the routing weights too, not only for choosing (not from seeds: "
        "a classic DeepSeek-V3-port bug)", None,
        symptom="routing weights skewed toward bias-favoured experts: mild KL, same experts chosen"),
    # ---- from bugs reported against public DSV4 implementations (issue 22)
    Bug("shared_expert_no_clamp", "shared_expert", ("layers.{L}.mlp.shared_expert",), V.SharedExpertNoClamp,
        "shared expert SwiGLU without the clamp (neither gate max=limit nor up +-limit)", _FIELD,
        symptom="wrong only where the shared gate or up passes swiglu_limit: spikes on a few tokens, "
                "fine on most prompts", trigger=Trigger(prompt=_CLAMP)),
    Bug("fp8_wo_a_scale_layout", "linear", ("layers.{L}.attn.wo_a",), V.FP8ScaleLayoutMixin,
        "official FP8-block wo_a (grouped output projection): the [out/b, in/b] scale grid read transposed",
        _FIELD, requires="fp8_wo_a", mixin=True,
        symptom="each wo_a tile scaled by another tile's scale: attention output wrong in every layer; only "
                "with the official FP8 weights (NVFP4 or BF16 checkpoints are fine)"),
    Bug("compress_rope_main_theta", "rope", (_is_compress_rotary,), V.RotaryMainTheta,
        "CSA/HCA layers (attention, compressor, indexer) given the main rope_theta instead of compress_rope_theta",
        _FIELD, arm=_main_theta,
        symptom="compressed layers rotate at the wrong frequency: fine on short prompts, position-dependent "
                "drift that grows with context length"),
    Bug("index_topk_wrong_field", "indexer", ("layers.{L}.attn.indexer",), V.IndexerTopkWrongField,
        "index_topk taken from the wrong config field: twice the model's value (1024 for 512)", _FIELD,
        symptom="CSA attends twice as many entries once more than index_topk are closed: long prompts drift, "
                "short ones are exact"),
    Bug("compressor_window_off_by_one", "compressor", ("layers.{L}.attn.compressor",), V.CompressorWindowOffByOne,
        "a window counted as closed one token early; the short slot list padded at the front", _FIELD,
        symptom="exact for three prompt lengths in four; for S = 3 mod 4 every compressed entry is shifted by one "
                "token (length-dependent failures users cannot reproduce)", trigger=Trigger(residue=(4, 3))),
    Bug("compressor_uninit_first_entry", "compressor", (_is_csa_compressor,),
        V.CompressorUninitFirstEntry,
        "CSA window 0 pools the never-written Ca slots before position 0 (value 0, gate 0) instead of masking them",
        _FIELD,
        symptom="the first compressed entry (and the indexer's first key) diluted toward zero; later entries "
                "exact: a small error"),
    Bug("hash_expert0_from_embeddings", "router", (_is_hash_router,), V.HashRouterExpert0,
        "run from inputs_embeds the token ids are dropped and the hash router sends every token to expert 0",
        _FIELD, arm=lambda model, handle: drop_ids_from_embeddings(model),
        symptom="exact from token ids; from embeddings the hash layers use one expert for every token",
        trigger=Trigger(form="embeds")),
    Bug("hash_ids_wrong_dtype", "router", (_is_hash_router,), V.HashRouterIdsWrongDtype,
        "hash routing table (int64 tid2eid) read as int32: each token's second expert becomes expert 0", _FIELD,
        symptom="hash layers route half of each token's choices to expert 0: large error from layer 0"),
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


def _has_weights(mod, requires: str | None) -> bool:
    """Can ``mod`` carry a bug that ``requires`` these weights (None: any)?"""
    if requires is None:
        return True
    fmt = {"nvfp4": "nvfp4", "fp8_wo_a": "fp8_block"}[requires]
    return getattr(mod, "qweight", None) is not None and getattr(mod.qweight, "format", None) == fmt


_NEEDS = {"nvfp4": ("no NVFP4-quantised linear in the target (plain weights): quantise first, e.g. "
                    "dsv4lab.precision.quantize_linears(model)"),
          "fp8_wo_a": ("no FP8-block wo_a (the official format) in the target: quantise first, e.g. "
                       "dsv4lab.bugzoo.inputs.fp8_in_place(model)")}


def inject(model, bug: str | Bug, layers=None) -> BugHandle:
    """Replace the components ``bug`` lives in (all layers, or ``layers``) by its buggy
    implementation. Returns a handle (``restore()``, context manager); ``handle.applicable`` is
    False (and nothing changes) when the model has no such component, e.g. an NVFP4-only bug on
    plain weights."""
    b = bug_named(bug)
    layers = check_layers(layers, getattr(getattr(model, "config", None), "num_hidden_layers", None))
    layers = None if layers is None else set(layers)
    match = _matcher(b, layers)
    targets = {}
    for name, mod in iter_components(model):
        if any(name.startswith(t + ".") for t in targets):
            continue
        if match(name, mod) and _has_weights(mod, b.requires):
            targets[name] = mod
    h = BugHandle(b)
    if not targets:
        h.applicable = False
        h.reason = _NEEDS[b.requires] if b.requires else \
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
        if b.arm is not None:
            armed = b.arm(model, h)
            if armed is not None:
                h.handles.append(armed)
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
    seq_len: int | None = None    # the prompt length the bug ran on (its trigger may cut the prompt)
    form: str = "ids"             # the input form it ran on

    def to_dict(self) -> dict:
        d = {k: getattr(self, k) for k in ("bug", "kind", "applicable", "reason", "first_divergence", "expected",
                                           "localized", "rel_err", "kl", "top1", "quantized", "seq_len", "form")}
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
    if b.requires is None:
        return False
    match = _matcher(b, None if layers is None else set([layers] if isinstance(layers, int) else layers))
    return not any(match(n, m) and _has_weights(m, b.requires) for n, m in iter_components(model))


def bug_ids(bug: "str | Bug", ids: torch.Tensor) -> torch.Tensor:
    """The prompt ``bug`` runs on, built from ``ids`` by its trigger (e.g. cut to a length residue)."""
    return bug_named(bug).trigger.ids(ids)


@torch.no_grad()
def triage(clean_model, bug: str | Bug, ids: torch.Tensor, layers=None, tol: float = 0.0,
           quantize: bool = False) -> TriageResult:
    """Inject ``bug`` into ``clean_model`` (restored afterwards), diff against the clean run, and
    report the first divergent hook point and whether it lies inside the injected component.

    Both runs get the input the bug's trigger asks for: ``ids`` cut to its length residue, the
    model run from embeddings for ``form="embeds"``.

    ``tol`` = 0: on one device the clean and buggy runs are bitwise identical up to the bug.
    ``quantize``: for bugs that need NVFP4 linears or official FP8-block ``wo_a`` on a plain
    model, quantise those weights in place for the triage (``dsv4lab.bugzoo.inputs.weights_in_place``;
    the plain weights are put back after, also on an error) instead of reporting n/a -- no copy
    of the model.
    """
    b = bug_named(bug)
    ids = b.trigger.ids(ids)
    if not _needs_quant(clean_model, b, layers):
        return _triage(clean_model, b, ids, layers, tol, False)
    if not quantize:
        what = {"nvfp4": "NVFP4 weights", "fp8_wo_a": "official FP8-block wo_a weights"}[b.requires]
        return TriageResult(b.name, b.kind, False, f"needs {what} (pass quantize=True to quantise in memory)",
                            seq_len=ids.shape[-1], form=b.trigger.form)
    with weights_in_place(clean_model, b.requires):
        return _triage(clean_model, b, ids, layers, tol, True)


def _triage(model, b: Bug, ids: torch.Tensor, layers, tol: float, quantized: bool) -> TriageResult:
    holder = {}

    def intervention(m):
        holder["h"] = inject(m, b, layers)
        return holder["h"]

    form = from_embeddings(model) if b.trigger.form == "embeds" else None
    try:
        res = compare_runs(model, (model, intervention), ids, tol=tol)
    finally:
        if form is not None:
            form.restore()
    h = holder["h"]
    if not h.applicable:
        return TriageResult(b.name, b.kind, False, h.reason, quantized=quantized, seq_len=ids.shape[-1],
                            form=b.trigger.form)
    expected = sorted({owner_of(model, n) for n in h.names})
    fd = res.first_divergence
    localized = fd is not None and any(hook_inside(model, fd, n) for n in h.names)
    row = res.first_divergence_row or {}
    return TriageResult(b.name, b.kind, True, "", fd, expected, localized, row.get("rel_err"), res.kl_mean, res.top1,
                        quantized, res, ids.shape[-1], b.trigger.form)


def triage_all(model, ids: torch.Tensor, bugs=None, quantize: bool = True, progress: bool = False) -> list[TriageResult]:
    names = list(BUGS) if bugs is None else list(bugs)
    it = names
    if progress:
        it = tqdm(names, desc="bug zoo", leave=False)
    return [triage(model, n, ids, quantize=quantize) for n in it]


__all__ = ["BUGS", "Bug", "BugHandle", "Trigger", "TriageResult", "bug_ids", "inject", "triage", "triage_all",
           "list_bugs"]
