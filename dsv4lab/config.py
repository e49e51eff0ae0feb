"""DSV4 model configuration: one dataclass, read from either config.json dialect.

Two dialects exist in the wild: the transformers one (`layer_types`, `compress_rates`,
`mlp_layer_types`, `partial_rotary_factor`) and the official/legacy one (`compress_ratios` per
layer, `num_hash_layers`, `qk_rope_head_dim`, `n_hash_layers`, ...). Both normalise to
:class:`DSV4Config`; errors name the file and the field.
"""
from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SLIDING = "sliding_attention"
CSA = "compressed_sparse_attention"
HCA = "heavily_compressed_attention"
LAYER_TYPES = (SLIDING, CSA, HCA)
HASH_MOE = "hash_moe"
MOE = "moe"
MLP_LAYER_TYPES = (HASH_MOE, MOE)
# packaged configs of the released models (dsv4lab/configs/*.json), by preset name
CONFIG_DIR = Path(__file__).resolve().parent / "configs"
NAMED_CONFIGS = {"v4-pro": "v4_pro.json", "v4_pro": "v4_pro.json", "pro": "v4_pro.json",
                 "deepseek-v4-pro": "v4_pro.json", "v4-flash": "v4_flash.json", "v4_flash": "v4_flash.json",
                 "flash": "v4_flash.json", "deepseek-v4-flash": "v4_flash.json"}
PRESET_NAMES = ("v4-pro", "v4-flash")  # the names errors list and suggest; NAMED_CONFIGS also takes aliases


class ConfigError(ValueError):
    """A config.json that cannot describe a DSV4 model; the message names file and field."""


@dataclass
class DSV4Config:
    vocab_size: int = 129280
    hidden_size: int = 4096
    moe_intermediate_size: int = 2048
    num_hidden_layers: int = 43
    num_attention_heads: int = 64
    head_dim: int = 512
    qk_rope_head_dim: int = 64
    q_lora_rank: int = 1024
    o_groups: int = 8
    o_lora_rank: int = 1024
    num_experts_per_tok: int = 6
    n_routed_experts: int = 256
    n_shared_experts: int = 1
    scoring_func: str = "sqrtsoftplus"
    routed_scaling_factor: float = 1.5
    norm_topk_prob: bool = True
    swiglu_limit: float = 10.0
    rope_theta: float = 10000.0
    compress_rope_theta: float = 160000.0
    rope_scaling: dict | None = None  # yarn params for the compress rope, if any
    layer_types: list[str] = field(default_factory=list)
    compress_rates: dict[str, int] = field(default_factory=lambda: {CSA: 4, HCA: 128})
    mlp_layer_types: list[str] = field(default_factory=list)
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    sliding_window: int = 128
    index_n_heads: int = 64
    index_head_dim: int = 128
    index_topk: int = 512
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 1048576
    bos_token_id: int | None = 0
    eos_token_id: int | list[int] | None = 1
    tie_word_embeddings: bool = False
    source: str = "<dict>"  # where it was read from, for error messages

    # ----------------------------------------------------------------- derived
    def compress_ratio(self, layer: int) -> int:
        """0 for sliding-only layers, else the layer type's compression rate."""
        t = self.layer_types[layer]
        return 0 if t == SLIDING else int(self.compress_rates[t])

    @property
    def num_hash_layers(self) -> int:
        return sum(t == HASH_MOE for t in self.mlp_layer_types)

    # ---------------------------------------------------------------- checking
    def validate(self) -> "DSV4Config":
        def bad(fieldname: str, msg: str) -> ConfigError:
            return ConfigError(f"{self.source}: field '{fieldname}': {msg}")

        positive = ("vocab_size", "hidden_size", "moe_intermediate_size", "num_hidden_layers",
                    "num_attention_heads", "head_dim", "q_lora_rank", "o_groups", "o_lora_rank",
                    "num_experts_per_tok", "n_routed_experts", "hc_mult", "sliding_window",
                    "index_n_heads", "index_head_dim", "index_topk", "hc_sinkhorn_iters")
        for name in positive:
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise bad(name, f"must be a positive integer, got {v!r}")
        n = self.num_hidden_layers
        if len(self.layer_types) != n:
            raise bad("layer_types", f"has {len(self.layer_types)} entries but num_hidden_layers is {n}")
        unknown = sorted(set(self.layer_types) - set(LAYER_TYPES))
        if unknown:
            raise bad("layer_types", f"unknown types {unknown}; allowed {list(LAYER_TYPES)}")
        if len(self.mlp_layer_types) != n:
            raise bad("mlp_layer_types", f"has {len(self.mlp_layer_types)} entries but num_hidden_layers is {n}")
        unknown = sorted(set(self.mlp_layer_types) - set(MLP_LAYER_TYPES))
        if unknown:
            raise bad("mlp_layer_types", f"unknown types {unknown}; allowed {list(MLP_LAYER_TYPES)}")
        for t in (CSA, HCA):
            if t in self.layer_types:
                r = self.compress_rates.get(t)
                if not isinstance(r, int) or r <= 0:
                    raise bad("compress_rates", f"needs a positive rate for '{t}', got {r!r}")
        if self.num_experts_per_tok > self.n_routed_experts:
            raise bad("num_experts_per_tok", f"{self.num_experts_per_tok} > n_routed_experts {self.n_routed_experts}")
        if self.num_attention_heads % self.o_groups:
            raise bad("o_groups", f"{self.o_groups} does not divide num_attention_heads {self.num_attention_heads}")
        if self.qk_rope_head_dim % 2 or not 0 < self.qk_rope_head_dim <= self.head_dim:
            raise bad("qk_rope_head_dim", f"must be even and in (0, head_dim={self.head_dim}], got {self.qk_rope_head_dim}")
        if self.qk_rope_head_dim > self.index_head_dim:
            raise bad("index_head_dim", f"{self.index_head_dim} is smaller than qk_rope_head_dim {self.qk_rope_head_dim}")
        if self.scoring_func not in ("sqrtsoftplus", "softmax", "sigmoid"):
            raise bad("scoring_func", f"unknown scoring function {self.scoring_func!r}")
        if self.n_shared_experts not in (0, 1):
            raise bad("n_shared_experts", f"only 0 or 1 supported, got {self.n_shared_experts}")
        return self

    # ------------------------------------------------------------------ output
    def to_transformers_dict(self) -> dict[str, Any]:
        """config.json in transformers' field names (what DeepseekV4Config accepts)."""
        d = {
            "architectures": ["DeepseekV4ForCausalLM"],
            "model_type": "deepseek_v4",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "moe_intermediate_size": self.moe_intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": 1,
            "head_dim": self.head_dim,
            "partial_rotary_factor": self.qk_rope_head_dim / self.head_dim,
            "q_lora_rank": self.q_lora_rank,
            "o_groups": self.o_groups,
            "o_lora_rank": self.o_lora_rank,
            "num_experts_per_tok": self.num_experts_per_tok,
            "n_routed_experts": self.n_routed_experts,
            "n_shared_experts": self.n_shared_experts,
            "scoring_func": self.scoring_func,
            "routed_scaling_factor": self.routed_scaling_factor,
            "norm_topk_prob": self.norm_topk_prob,
            "swiglu_limit": self.swiglu_limit,
            "rope_theta": self.rope_theta,
            "compress_rope_theta": self.compress_rope_theta,
            "layer_types": list(self.layer_types),
            "compress_rates": dict(self.compress_rates),
            "mlp_layer_types": list(self.mlp_layer_types),
            "hc_mult": self.hc_mult,
            "hc_sinkhorn_iters": self.hc_sinkhorn_iters,
            "hc_eps": self.hc_eps,
            "sliding_window": self.sliding_window,
            "index_n_heads": self.index_n_heads,
            "index_head_dim": self.index_head_dim,
            "index_topk": self.index_topk,
            "rms_norm_eps": self.rms_norm_eps,
            "max_position_embeddings": self.max_position_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "tie_word_embeddings": self.tie_word_embeddings,
        }
        if self.rope_scaling:
            d["rope_parameters"] = dict(self.rope_scaling)
        return d

    def replace(self, **changes: Any) -> "DSV4Config":
        return dataclasses.replace(self, **changes).validate()


_RATIO_TO_TYPE = {0: SLIDING}

# official / legacy name -> our field
_ALIASES = {
    "dim": "hidden_size",
    "n_layers": "num_hidden_layers",
    "n_heads": "num_attention_heads",
    "moe_inter_dim": "moe_intermediate_size",
    "n_activated_experts": "num_experts_per_tok",
    "route_scale": "routed_scaling_factor",
    "score_func": "scoring_func",
    "window_size": "sliding_window",
    "index_n_heads": "index_n_heads",
    "index_head_dim": "index_head_dim",
    "index_topk": "index_topk",
    "o_lora_rank": "o_lora_rank",
    "n_routed_experts": "n_routed_experts",
    "norm_eps": "rms_norm_eps",
    "hc_sinkhorn_iters": "hc_sinkhorn_iters",
    "hc_eps": "hc_eps",
    "hc_mult": "hc_mult",
    "max_seq_len": "max_position_embeddings",
}


def config_from_dict(raw: dict[str, Any], source: str = "<dict>") -> DSV4Config:
    """Normalise a config dict in either dialect to a validated :class:`DSV4Config`."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: expected a JSON object, got {type(raw).__name__}")
    d = dict(raw)
    mt = d.get("model_type")
    if mt is not None and mt not in ("deepseek_v4", "deepseek_v4_flash", "deepseek_v4_pro", "dsv4"):
        raise ConfigError(f"{source}: field 'model_type': {mt!r} is not a DeepSeek-V4 config")
    for alias, name in _ALIASES.items():
        if alias in d and name not in d:
            d[name] = d[alias]
    kw: dict[str, Any] = {"source": source}
    fields = {f.name for f in dataclasses.fields(DSV4Config)}
    for name in fields - {"layer_types", "compress_rates", "mlp_layer_types", "qk_rope_head_dim",
                          "rope_scaling", "source"}:
        if name in d and d[name] is not None:
            kw[name] = d[name]
    if "num_hidden_layers" not in kw:
        raise ConfigError(f"{source}: field 'num_hidden_layers' is missing")
    n = int(kw["num_hidden_layers"])

    rates = dict(d.get("compress_rates") or {CSA: 4, HCA: 128})
    if d.get("compress_rate_csa") is not None:
        rates[CSA] = int(d["compress_rate_csa"])
    if d.get("compress_rate_hca") is not None:
        rates[HCA] = int(d["compress_rate_hca"])
    layer_types = d.get("layer_types")
    if layer_types is None and d.get("compress_ratios") is not None:
        ratios = list(d["compress_ratios"])[:n]
        nonzero = sorted({int(r) for r in ratios if r})
        if len(nonzero) > 2:
            raise ConfigError(f"{source}: field 'compress_ratios': more than two nonzero ratios {nonzero}")
        # the smaller nonzero ratio is CSA (overlapping + indexer), the larger HCA
        if nonzero:
            rates[CSA] = nonzero[0] if len(nonzero) == 2 or nonzero[0] < 16 else rates.get(CSA, 4)
            if len(nonzero) == 2 or nonzero[0] >= 16:
                rates[HCA] = nonzero[-1]
        r2t = {0: SLIDING, rates.get(CSA): CSA, rates.get(HCA): HCA}
        try:
            layer_types = [r2t[int(r)] for r in ratios]
        except KeyError as e:
            raise ConfigError(f"{source}: field 'compress_ratios': unsupported ratio {e.args[0]}") from None
    if layer_types is None:
        inter = [CSA if i % 2 else HCA for i in range(max(n - 2, 0))]
        layer_types = [HCA] * min(n, 2) + inter
    kw["layer_types"] = list(layer_types)[:n]
    kw["compress_rates"] = {k: int(v) for k, v in rates.items()}

    mlp = d.get("mlp_layer_types")
    if mlp is None:
        n_hash = d.get("num_hash_layers", d.get("n_hash_layers", 3))
        mlp = [HASH_MOE] * min(n, int(n_hash)) + [MOE] * max(0, n - int(n_hash))
    kw["mlp_layer_types"] = list(mlp)[:n]

    head_dim = int(kw.get("head_dim", 512))
    if d.get("qk_rope_head_dim") is not None:
        kw["qk_rope_head_dim"] = int(d["qk_rope_head_dim"])
    elif d.get("rope_head_dim") is not None:
        kw["qk_rope_head_dim"] = int(d["rope_head_dim"])
    elif d.get("partial_rotary_factor") is not None:
        kw["qk_rope_head_dim"] = int(round(head_dim * float(d["partial_rotary_factor"])))
    rp = d.get("rope_parameters") or d.get("rope_scaling")
    if isinstance(rp, dict):
        if isinstance(rp.get("compress"), dict):
            comp = rp["compress"]
            if comp.get("rope_type", "default") != "default":
                kw["rope_scaling"] = {k: v for k, v in comp.items() if k not in ("rope_theta", "partial_rotary_factor")}
            if comp.get("rope_theta") is not None:
                kw["compress_rope_theta"] = comp["rope_theta"]
            if isinstance(rp.get("main"), dict) and rp["main"].get("rope_theta") is not None:
                kw["rope_theta"] = rp["main"]["rope_theta"]
        elif rp.get("rope_type", rp.get("type", "default")) != "default":
            kw["rope_scaling"] = dict(rp)
    try:
        cfg = DSV4Config(**kw)
    except TypeError as e:  # pragma: no cover - defensive
        raise ConfigError(f"{source}: {e}") from None
    for k in ("rope_theta", "compress_rope_theta", "routed_scaling_factor", "swiglu_limit", "rms_norm_eps", "hc_eps"):
        setattr(cfg, k, float(getattr(cfg, k)))
    if cfg.rope_scaling and cfg.rope_scaling.get("rope_type", cfg.rope_scaling.get("type")) not in (None, "default", "yarn"):
        raise ConfigError(f"{source}: field 'rope_scaling': rope type {cfg.rope_scaling} is not supported "
                          "(default or yarn)")
    return cfg.validate()


def load_config(path_or_dict: str | os.PathLike | dict | DSV4Config) -> DSV4Config:
    """Read a DSV4 config from a checkpoint dir, a config.json path, a dict, or pass one through."""
    if isinstance(path_or_dict, DSV4Config):
        return path_or_dict
    if isinstance(path_or_dict, dict):
        return config_from_dict(path_or_dict)
    p = os.fspath(path_or_dict)
    if os.path.isdir(p):
        p = os.path.join(p, "config.json")
    if not os.path.exists(p):
        raise ConfigError(f"{p}: config.json not found")
    try:
        with open(p) as f:
            raw = json.load(f)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{p}: not valid JSON ({e})") from None
    return config_from_dict(raw, source=p)


def named_config(name: str) -> DSV4Config:
    """``"v4-pro"`` / ``"v4-flash"`` -> the packaged config (dsv4lab/configs/*.json)."""
    key = str(name).lower()
    if key not in NAMED_CONFIGS:
        raise KeyError(f"no packaged config {name!r}; known: {sorted(set(NAMED_CONFIGS))}")
    return load_config(CONFIG_DIR / NAMED_CONFIGS[key])
