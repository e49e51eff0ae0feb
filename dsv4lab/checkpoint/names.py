"""Checkpoint key normalisation: any DSV4 layout -> canonical names (docs/naming.md) and back.

Three raw layouts exist:

* ``official``: DeepSeek's release (``layers.N.attn.wq_a.weight``, ``ffn.experts.E.w1``,
  ``hc_attn_fn``, ``embed.weight``, ``head.weight``...);
* ``transformers`` (what ``save_pretrained`` writes for ``DeepseekV4ForCausalLM``): the official
  names under a ``model.`` prefix (except ``head.weight``) with ``model.embed_tokens.weight`` and
  ``model.hc_head.hc_{fn,base,scale}``;
* ``modules``: a plain transformers ``model.state_dict()`` (``self_attn.q_a_proj``,
  ``mlp.experts.gate_up_proj`` fused 3-D, ``attn_hc.fn``, ``lm_head.weight``...).

Canonical names themselves also normalise to themselves (layout ``canonical``).

:func:`normalize_key` maps one raw key to a list of :class:`NormKey` (several for a fused expert
tensor, each with a :class:`SliceSpec` that reads one expert lazily), ``[]`` for keys that are
deliberately ignored (``mtp.*``, rotary ``inv_freq``) and ``None`` for keys it does not know.
:func:`to_raw_key` is the inverse used by the writer.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Sequence

# aux tensors stored next to a quantised linear's ``X.weight``
AUX_SUFFIXES = ("weight_scale", "weight_scale_2", "input_scale", "scale", "weight_scale_inv")
WEIGHT_SUFFIXES = ("weight",) + AUX_SUFFIXES
WEIGHT_SUFFIX_SET = frozenset(WEIGHT_SUFFIXES)

LAYOUTS = ("official", "transformers", "modules", "canonical")

# ----------------------------------------------------------------------------- data types


@dataclass(frozen=True)
class SliceSpec:
    """Which part of a fused raw tensor a canonical tensor is: ``raw[expert, rows[0]:rows[1]]``."""

    expert: int
    rows: tuple[int, int] | None = None

    def index(self):
        """The index to apply to a safetensors ``get_slice`` object (or a tensor)."""
        if self.rows is None:
            return self.expert
        return (self.expert, slice(self.rows[0], self.rows[1]))

    def shape(self, raw_shape: Sequence[int]) -> tuple[int, ...]:
        rest = tuple(int(s) for s in raw_shape[1:])
        if self.rows is None:
            return rest
        return (self.rows[1] - self.rows[0],) + rest[1:]


@dataclass(slots=True)
class NormKey:
    """One canonical tensor a raw key holds.

    ``name`` is the full canonical name (``layers.3.attn.wq_a.weight_scale``), ``base`` the module
    or parameter it belongs to (``layers.3.attn.wq_a``; for a bare parameter such as
    ``layers.3.attn.sink`` the name itself) and ``suffix`` the part after the base (``weight``,
    an aux suffix, or ``None`` for a bare parameter).
    """

    raw: str
    name: str
    base: str
    suffix: str | None
    layout: str
    slice: SliceSpec | None = None


# ------------------------------------------------------------------- translation tables
# layer-relative module paths (the part between ``layers.N.`` and ``.weight``/aux suffix)
_MODULES: dict[str, tuple[str, str]] = {}  # raw module -> (canonical module, layout)
# layer-relative bare parameters (no suffix)
_PARAMS: dict[str, tuple[str, str]] = {}

_CANON_MODULES = [
    "attn.wq_a", "attn.q_norm", "attn.wq_b", "attn.wkv", "attn.kv_norm", "attn.wo_a", "attn.wo_b",
    "attn.compressor.wkv", "attn.compressor.wgate", "attn.compressor.norm",
    "attn.indexer.wq_b", "attn.indexer.weights_proj",
    "attn.indexer.compressor.wkv", "attn.indexer.compressor.wgate", "attn.indexer.compressor.norm",
    "mlp.router", "mlp.shared_expert.w1", "mlp.shared_expert.w2", "mlp.shared_expert.w3",
    "attn_norm", "ffn_norm",
]
_CANON_PARAMS = [
    "attn.sink", "attn.compressor.ape", "attn.indexer.compressor.ape", "mlp.router.bias",
    "mlp.router.tid2eid",
    "attn_hc.fn", "attn_hc.base", "attn_hc.scale", "ffn_hc.fn", "ffn_hc.base", "ffn_hc.scale",
]
# canonical module -> official module
_OFFICIAL_MODULES = {
    "attn.wq_a": "attn.wq_a", "attn.q_norm": "attn.q_norm", "attn.wq_b": "attn.wq_b",
    "attn.wkv": "attn.wkv", "attn.kv_norm": "attn.norm", "attn.wo_a": "attn.wo_a", "attn.wo_b": "attn.wo_b",
    "attn.compressor.wkv": "attn.compressor.wkv", "attn.compressor.wgate": "attn.compressor.wgate",
    "attn.compressor.norm": "attn.compressor.norm",
    "attn.indexer.wq_b": "attn.indexer.wq_b", "attn.indexer.weights_proj": "attn.indexer.weights_proj",
    "attn.indexer.compressor.wkv": "attn.indexer.compressor.wkv",
    "attn.indexer.compressor.wgate": "attn.indexer.compressor.wgate",
    "attn.indexer.compressor.norm": "attn.indexer.compressor.norm",
    "mlp.router": "ffn.gate", "mlp.shared_expert.w1": "ffn.shared_experts.w1",
    "mlp.shared_expert.w2": "ffn.shared_experts.w2", "mlp.shared_expert.w3": "ffn.shared_experts.w3",
    "attn_norm": "attn_norm", "ffn_norm": "ffn_norm",
}
_OFFICIAL_PARAMS = {
    "attn.sink": "attn.attn_sink", "attn.compressor.ape": "attn.compressor.ape",
    "attn.indexer.compressor.ape": "attn.indexer.compressor.ape", "mlp.router.bias": "ffn.gate.bias",
    "mlp.router.tid2eid": "ffn.gate.tid2eid",
    "attn_hc.fn": "hc_attn_fn", "attn_hc.base": "hc_attn_base", "attn_hc.scale": "hc_attn_scale",
    "ffn_hc.fn": "hc_ffn_fn", "ffn_hc.base": "hc_ffn_base", "ffn_hc.scale": "hc_ffn_scale",
}
# canonical module -> transformers module-layout module
_HF_MODULES = {
    "attn.wq_a": "self_attn.q_a_proj", "attn.q_norm": "self_attn.q_a_norm", "attn.wq_b": "self_attn.q_b_proj",
    "attn.wkv": "self_attn.kv_proj", "attn.kv_norm": "self_attn.kv_norm",
    "attn.wo_a": "self_attn.o_a_proj", "attn.wo_b": "self_attn.o_b_proj",
    "attn.compressor.wkv": "self_attn.compressor.kv_proj",
    "attn.compressor.wgate": "self_attn.compressor.gate_proj",
    "attn.compressor.norm": "self_attn.compressor.kv_norm",
    "attn.indexer.wq_b": "self_attn.compressor.indexer.q_b_proj",
    "attn.indexer.weights_proj": "self_attn.compressor.indexer.scorer.weights_proj",
    "attn.indexer.compressor.wkv": "self_attn.compressor.indexer.kv_proj",
    "attn.indexer.compressor.wgate": "self_attn.compressor.indexer.gate_proj",
    "attn.indexer.compressor.norm": "self_attn.compressor.indexer.kv_norm",
    "mlp.router": "mlp.gate", "mlp.shared_expert.w1": "mlp.shared_experts.gate_proj",
    "mlp.shared_expert.w2": "mlp.shared_experts.down_proj", "mlp.shared_expert.w3": "mlp.shared_experts.up_proj",
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
}
_HF_PARAMS = {
    "attn.sink": "self_attn.sinks", "attn.compressor.ape": "self_attn.compressor.position_bias",
    "attn.indexer.compressor.ape": "self_attn.compressor.indexer.position_bias",
    "mlp.router.bias": "mlp.gate.e_score_correction_bias", "mlp.router.tid2eid": "mlp.gate.tid2eid",
    "attn_hc.fn": "attn_hc.fn", "attn_hc.base": "attn_hc.base", "attn_hc.scale": "attn_hc.scale",
    "ffn_hc.fn": "ffn_hc.fn", "ffn_hc.base": "ffn_hc.base", "ffn_hc.scale": "ffn_hc.scale",
}

for _c, _r in _OFFICIAL_MODULES.items():
    _MODULES[_r] = (_c, "official")
_MODULES["attn.kv_norm"] = ("attn.kv_norm", "official")  # both spellings exist
for _c, _r in _OFFICIAL_PARAMS.items():
    _PARAMS[_r] = (_c, "official")
_CANON_PARAM_SET = frozenset(_CANON_PARAMS)
for _c in _CANON_MODULES:
    _MODULES.setdefault(_c, (_c, "canonical"))
for _c in _CANON_PARAMS:
    _PARAMS.setdefault(_c, (_c, "canonical"))
for _c, _r in _HF_MODULES.items():
    _MODULES.setdefault(_r, (_c, "modules"))
for _c, _r in _HF_PARAMS.items():
    _PARAMS.setdefault(_r, (_c, "modules"))

# top-level (non-layer) keys: raw -> (canonical name, base, suffix, layout)
_GLOBAL: dict[str, tuple[str, str, str | None, str]] = {}
for _layout, _names in {
    "canonical": {"hc_head.fn": "hc_head.fn", "hc_head.base": "hc_head.base", "hc_head.scale": "hc_head.scale"},
    "official": {"embed.weight": "embed.weight", "head.weight": "head.weight", "norm.weight": "norm.weight",
                 "hc_head_fn": "hc_head.fn", "hc_head_base": "hc_head.base", "hc_head_scale": "hc_head.scale"},
    "transformers": {"model.embed_tokens.weight": "embed.weight", "model.norm.weight": "norm.weight",
                     "model.hc_head.hc_fn": "hc_head.fn", "model.hc_head.hc_base": "hc_head.base",
                     "model.hc_head.hc_scale": "hc_head.scale", "model.embed.weight": "embed.weight",
                     "model.head.weight": "head.weight", "model.hc_head_fn": "hc_head.fn",
                     "model.hc_head_base": "hc_head.base", "model.hc_head_scale": "hc_head.scale"},
    "modules": {"lm_head.weight": "head.weight", "embed_tokens.weight": "embed.weight"},
}.items():
    for _r, _c in _names.items():
        if _c.endswith(".weight"):
            _GLOBAL[_r] = (_c, _c[: -len(".weight")], "weight", _layout)
        else:
            _GLOBAL[_r] = (_c, _c, None, _layout)
# aux tensors of a quantised head (embed is never quantised)
for _r, _lay in (("head", "official"), ("lm_head", "modules"), ("model.head", "transformers")):
    for _s in AUX_SUFFIXES:
        _GLOBAL[f"{_r}.{_s}"] = (f"head.{_s}", "head", _s, _lay)

_LAYER_RE = re.compile(r"^(model\.)?layers\.(\d+)\.(.+)$")
_EXPERT_RE = re.compile(r"^(ffn|mlp)\.experts\.(\d+)\.(w1|w2|w3|gate_proj|up_proj|down_proj)$")
_EXPERT_PROJ = {"w1": "w1", "w2": "w2", "w3": "w3", "gate_proj": "w1", "down_proj": "w2", "up_proj": "w3"}
_FUSED = {"mlp.experts.gate_up_proj", "mlp.experts.down_proj"}


FAST_EXPERT_RE = re.compile(r"^(model\.)?layers\.(\d+)\.(ffn|mlp)\.experts\.(\d+)\.(w[123])\.(\w+)$")


def is_ignored(key: str) -> bool:
    """Keys deliberately skipped: multi-token-prediction heads and rotary caches."""
    return key.startswith(("mtp.", "model.mtp.")) or key.endswith("inv_freq") or ".mtp." in key


def normalize_key(key: str, shape: Sequence[int] | None = None) -> list[NormKey] | None:
    """Canonical name(s) of one raw checkpoint key.

    Returns ``[]`` for ignored keys (``mtp.*``, ``inv_freq``), ``None`` for unknown keys, and for a
    fused transformers expert tensor (``mlp.experts.gate_up_proj`` [E, 2I, D] /
    ``mlp.experts.down_proj`` [E, D, I]) one :class:`NormKey` per expert (and per w1/w3 half),
    which needs ``shape``.
    """
    fm = FAST_EXPERT_RE.match(key)  # the bulk of a checkpoint: per-expert w1/w2/w3 (+ aux)
    if fm is not None and fm.group(6) in WEIGHT_SUFFIX_SET:
        base = f"layers.{fm.group(2)}.mlp.experts.{fm.group(4)}.{fm.group(5)}"
        if fm.group(3) == "ffn":
            layout = "transformers" if fm.group(1) else "official"
        else:
            layout = "modules" if fm.group(1) else "canonical"
        return [NormKey(key, f"{base}.{fm.group(6)}", base, fm.group(6), layout)]
    if is_ignored(key):
        return []
    g = _GLOBAL.get(key)
    if g is not None:
        name, base, suffix, layout = g
        return [NormKey(key, name, base, suffix, layout)]
    m = _LAYER_RE.match(key)
    if m is None:
        return None
    prefixed, layer, rest = m.group(1) is not None, m.group(2), m.group(3)
    pre = f"layers.{layer}."

    def lay(layout: str) -> str:
        # official names under ``model.`` are what save_pretrained writes
        if prefixed and layout == "official":
            return "transformers"
        if prefixed and layout == "canonical":
            return "modules"
        return layout

    p = _PARAMS.get(rest)
    if p is not None:
        return [NormKey(key, pre + p[0], pre + p[0], None, lay(p[1]))]
    if rest in _FUSED:
        if shape is None or len(shape) != 3:
            return None
        n_exp = int(shape[0])
        out = []
        if rest.endswith("gate_up_proj"):
            half = int(shape[1]) // 2
            for e in range(n_exp):
                for w, rows in (("w1", (0, half)), ("w3", (half, 2 * half))):
                    b = f"{pre}mlp.experts.{e}.{w}"
                    out.append(NormKey(key, b + ".weight", b, "weight", "modules", SliceSpec(e, rows)))
        else:
            for e in range(n_exp):
                b = f"{pre}mlp.experts.{e}.w2"
                out.append(NormKey(key, b + ".weight", b, "weight", "modules", SliceSpec(e)))
        return out
    module, dot, suffix = rest.rpartition(".")
    if not dot or suffix not in WEIGHT_SUFFIXES:
        return None
    mm = _MODULES.get(module)
    if mm is not None:
        base = pre + mm[0]
        return [NormKey(key, f"{base}.{suffix}", base, suffix, lay(mm[1]))]
    em = _EXPERT_RE.match(module)
    if em is not None:
        base = f"{pre}mlp.experts.{em.group(2)}.{_EXPERT_PROJ[em.group(3)]}"
        if em.group(1) == "ffn":
            layout = lay("official")
        else:
            layout = lay("canonical") if em.group(3).startswith("w") else "modules"
        return [NormKey(key, f"{base}.{suffix}", base, suffix, layout)]
    return None


def split_name(name: str) -> tuple[str, str | None]:
    """Canonical full name -> (base, suffix); bare parameters give (name, None)."""
    base, dot, suffix = name.rpartition(".")
    if dot and suffix in WEIGHT_SUFFIXES and not _is_param(name):
        return base, suffix
    return name, None


def _is_param(name: str) -> bool:
    if name in ("hc_head.fn", "hc_head.base", "hc_head.scale"):
        return True
    m = _LAYER_RE.match(name)
    return m is not None and not m.group(1) and m.group(3) in _CANON_PARAM_SET


# ------------------------------------------------------------------- canonical -> raw
_TOP = {
    "official": {"embed": "embed", "head": "head", "norm": "norm", "hc_head.fn": "hc_head_fn",
                 "hc_head.base": "hc_head_base", "hc_head.scale": "hc_head_scale"},
    "transformers": {"embed": "model.embed_tokens", "head": "head", "norm": "model.norm",
                     "hc_head.fn": "model.hc_head.hc_fn", "hc_head.base": "model.hc_head.hc_base",
                     "hc_head.scale": "model.hc_head.hc_scale"},
    "modules": {"embed": "model.embed_tokens", "head": "lm_head", "norm": "model.norm",
                "hc_head.fn": "model.hc_head.hc_fn", "hc_head.base": "model.hc_head.hc_base",
                "hc_head.scale": "model.hc_head.hc_scale"},
}
_CANON_EXPERT_RE = re.compile(r"^mlp\.experts\.(\d+)\.(w[123])$")


def to_raw_key(name: str, layout: str) -> str:
    """Raw key of a canonical tensor name in ``layout`` ("official", "transformers", "canonical").

    The ``modules`` layout fuses experts and has no per-expert key; use :func:`fused_key` there.
    """
    if layout == "canonical":
        return name
    if layout not in ("official", "transformers", "modules"):
        raise ValueError(f"unknown layout {layout!r}; expected one of {LAYOUTS}")
    base, suffix = split_name(name)
    tail = f".{suffix}" if suffix else ""
    top = _TOP[layout]
    if base in top:
        return top[base] + tail
    m = _LAYER_RE.match(base)
    if m is None or m.group(1):
        raise KeyError(f"{name!r} is not a canonical tensor name")
    layer, rest = m.group(2), m.group(3)
    prefix = f"layers.{layer}." if layout == "official" else f"model.layers.{layer}."
    if suffix is None:
        table = _HF_PARAMS if layout == "modules" else _OFFICIAL_PARAMS
        if rest not in table:
            raise KeyError(f"{name!r} is not a canonical tensor name")
        return prefix + table[rest]
    em = _CANON_EXPERT_RE.match(rest)
    if em is not None:
        if layout == "modules":
            raise KeyError(f"{name!r}: the transformers module layout fuses experts; no per-expert key")
        return f"{prefix}ffn.experts.{em.group(1)}.{em.group(2)}{tail}"
    table = _HF_MODULES if layout == "modules" else _OFFICIAL_MODULES
    if rest not in table:
        raise KeyError(f"{name!r} is not a canonical tensor name")
    return prefix + table[rest] + tail


def fused_key(layer: int, proj: str) -> str:
    """Transformers module-layout fused expert key for ``proj`` in {"gate_up_proj", "down_proj"}."""
    return f"model.layers.{layer}.mlp.experts.{proj}"


# ------------------------------------------------------------------- kinds and layers
_KIND_BY_MODULE = {
    "attn.wq_a": "attn.wq_a", "attn.wq_b": "attn.wq_b", "attn.wkv": "attn.wkv", "attn.wo_a": "attn.wo_a",
    "attn.wo_b": "attn.wo_b", "attn.sink": "attn.sink",
    "attn.q_norm": "norm", "attn.kv_norm": "norm", "attn.compressor.norm": "norm",
    "attn.indexer.compressor.norm": "norm", "attn_norm": "norm", "ffn_norm": "norm",
    "attn.compressor.wkv": "compressor.wkv", "attn.compressor.wgate": "compressor.wgate",
    "attn.compressor.ape": "compressor.ape",
    "attn.indexer.wq_b": "indexer.wq_b", "attn.indexer.weights_proj": "indexer.weights_proj",
    "attn.indexer.compressor.wkv": "indexer.compressor.wkv",
    "attn.indexer.compressor.wgate": "indexer.compressor.wgate",
    "attn.indexer.compressor.ape": "indexer.compressor.ape",
    "mlp.router": "router", "mlp.router.bias": "router", "mlp.router.tid2eid": "router",
    "mlp.shared_expert.w1": "shared_expert", "mlp.shared_expert.w2": "shared_expert",
    "mlp.shared_expert.w3": "shared_expert",
    "attn_hc.fn": "mhc", "attn_hc.base": "mhc", "attn_hc.scale": "mhc",
    "ffn_hc.fn": "mhc", "ffn_hc.base": "mhc", "ffn_hc.scale": "mhc",
}
KINDS = ("embed", "head", "norm", "mhc", "attn.wq_a", "attn.wq_b", "attn.wkv", "attn.wo_a", "attn.wo_b",
         "attn.sink", "compressor.wkv", "compressor.wgate", "compressor.ape", "indexer.wq_b",
         "indexer.weights_proj", "indexer.compressor.wkv", "indexer.compressor.wgate",
         "indexer.compressor.ape", "router", "experts", "shared_expert")
# kinds whose ``.weight`` is a linear layer (may be quantised); the router bias / tid2eid are
# router-kind parameters but not linears, see :func:`is_linear`.
LINEAR_KINDS = frozenset({"head", "attn.wq_a", "attn.wq_b", "attn.wkv", "attn.wo_a", "attn.wo_b",
                          "compressor.wkv", "compressor.wgate", "indexer.wq_b", "indexer.weights_proj",
                          "indexer.compressor.wkv", "indexer.compressor.wgate", "router", "experts",
                          "shared_expert"})


def component_kind(name: str) -> str:
    """Component kind (docs/naming.md) of a canonical name, base name or aux tensor name."""
    try:
        return module_kind(split_name(name)[0])
    except KeyError:
        raise KeyError(f"{name!r} is not a canonical tensor name") from None


def module_kind(module_name: str) -> str:
    """Component kind of a module's (or bare parameter's) dotted name as the model names it
    (``layers.3.mlp.experts.7.w1`` -> ``experts``); no tensor suffix is stripped first."""
    if module_name in ("embed", "head", "norm"):
        return {"embed": "embed", "head": "head", "norm": "norm"}[module_name]
    if module_name.startswith("hc_head."):
        return "mhc"
    m = _LAYER_RE.match(module_name)
    if m is None or m.group(1):
        raise KeyError(f"{module_name!r} is not a canonical module name")
    rest = m.group(3)
    if rest.startswith("mlp.experts."):
        return "experts"
    kind = _KIND_BY_MODULE.get(rest)
    if kind is None:
        raise KeyError(f"{module_name!r} is not a canonical module name")
    return kind


def is_linear(name: str) -> bool:
    """True for the base (or ``.weight``) of a linear layer: those are the ones that may be quantised."""
    base, suffix = split_name(name)
    if suffix not in (None, "weight") or _is_param(base):
        return False
    try:
        return component_kind(base) in LINEAR_KINDS
    except KeyError:
        return False


_LAYER_INDEX_RE = re.compile(r"^(?:model\.)?layers\.(\d+)(?:\.|$)")


def layer_of(name: str) -> int | None:
    """Layer index of any dotted name -- tensor, module or hook point, canonical or raw
    (``layers.3``, ``layers.3.attn.hook_probs``, ``model.layers.3.mlp``) -- ``None`` for global ones.
    The one place that answers "which layer is this" for checkpoints, plans, policies and hooks."""
    m = _LAYER_INDEX_RE.match(name)
    return int(m.group(1)) if m else None


# component kinds grouped into the per-layer byte columns of inspect / plan tables
KIND_GROUPS: dict[str, tuple[str, ...]] = {
    "attn": ("attn.wq_a", "attn.wq_b", "attn.wkv", "attn.wo_a", "attn.wo_b", "attn.sink"),
    "compressor": ("compressor.wkv", "compressor.wgate", "compressor.ape"),
    "indexer": ("indexer.wq_b", "indexer.weights_proj", "indexer.compressor.wkv", "indexer.compressor.wgate",
                "indexer.compressor.ape"),
    "experts": ("experts",),
    "shared": ("shared_expert",),
    "router": ("router",),
}


def natural_key(name: str) -> list:
    """Sort key that orders ``layers.10`` after ``layers.9`` (digit runs compare as numbers)."""
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name)]
