"""Write a canonical state (tensors and QuantWeights) as a DSV4 checkpoint.

Layouts: ``official`` (DeepSeek names), ``transformers`` (exactly what ``save_pretrained`` of
``DeepseekV4ForCausalLM`` writes, so ``from_pretrained`` loads it), ``modules`` (a transformers
``state_dict()`` with fused experts; plain weights only) and ``canonical`` (our own names).
Optionally quantises linear weights to NVFP4 and writes the ModelOpt ``hf_quant_config.json``.
"""
from __future__ import annotations

import fnmatch
import glob
import json
import os
import re
from typing import Any, Mapping, Sequence

import torch
from safetensors.torch import save_file
from tqdm.auto import tqdm

from ..config import load_config
from ..quant.weights import QuantWeight, quantize_nvfp4
from .formats import detect_format
from .names import AUX_SUFFIXES, component_kind, fused_key, is_linear, layer_of, natural_key, split_name, to_raw_key
from .safetensors_index import INDEX_NAME, st_dtype_of

QUANT_ALGO = {"nvfp4": "NVFP4", "mxfp4": "MXFP4", "fp8_block": "FP8_BLOCK"}
DEFAULT_SHARD_BYTES = 5 * 2**30
_PRODUCER = {"name": "dsv4lab", "version": "0.1.0"}


def _matches(name: str, patterns: Sequence[str]) -> bool:
    return any(fnmatch.fnmatchcase(name, p) or fnmatch.fnmatchcase(name + ".weight", p) for p in patterns)


def _order_key(name: str):
    layer = layer_of(name)
    parts = [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name)]
    # embed first, layers in order, then norm / hc_head / head
    return (0 if name.startswith("embed") else 1 if layer is not None else 2, layer or 0, parts)


def save_checkpoint(
    path: str | os.PathLike,
    config: Any,
    state: Mapping[str, Any],
    layout: str = "official",
    nvfp4: Sequence[str] | None = None,
    exclude: Sequence[str] = (),
    shard_bytes: int = DEFAULT_SHARD_BYTES,
    dtype=None,
    progress: bool | None = None,
) -> dict[str, Any]:
    """Write ``state`` (canonical name -> Tensor | QuantWeight) to ``path``.

    ``nvfp4``: fnmatch patterns over canonical base names (``"*"``, ``"layers.*.mlp.experts.*"``)
    of plain 2-D linear weights to quantise with ``quantize_nvfp4``; ``exclude`` patterns keep
    matching linears unquantised. Embeddings, norms, mHC params, ape, sink and router bias are
    never quantised. QuantWeight values are written as they are. ``dtype`` casts plain floating
    tensors (not quantised data or scales). Existing ``model*.safetensors`` / index files in
    ``path`` are replaced. Returns a summary (files, tensors, bytes, quantised modules).
    """
    if layout not in ("official", "transformers", "modules", "canonical"):
        raise ValueError(f"layout must be 'official', 'transformers', 'modules' or 'canonical', got {layout!r}")
    cfg = load_config(config)
    path = os.fspath(path)
    os.makedirs(path, exist_ok=True)
    patterns = list(nvfp4 or ())
    exclude = list(exclude or ())

    # ---- 1. canonical groups: base -> {suffix: tensor} (suffix None for bare parameters)
    groups: dict[str, dict[str | None, torch.Tensor]] = {}
    fmt_of: dict[str, str] = {}
    for key, value in state.items():
        if isinstance(value, QuantWeight):
            base = key[:-len(".weight")] if key.endswith(".weight") else key
            _kind(base + ".weight", key)
            if not is_linear(base):
                raise ValueError(f"state['{key}']: a {value.format} QuantWeight for a non-linear tensor")
            if value.format == "plain":
                groups.setdefault(base, {})["weight"] = value.tensors()["weight"]
            else:
                groups.setdefault(base, {}).update(value.tensors())
                fmt_of[base] = value.format
            continue
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"state['{key}']: expected a Tensor or QuantWeight, got {type(value).__name__}")
        _kind(key, key)
        base, suffix = split_name(key)
        g = groups.setdefault(base, {})
        if suffix in g:
            raise ValueError(f"state['{key}']: given twice")
        g[suffix] = value

    # raw aux tensors given next to a weight: detect the format from dtypes/shapes
    for base, g in groups.items():
        if base not in fmt_of and any(s in AUX_SUFFIXES for s in g if s):
            fi = detect_format({s: (st_dtype_of(t.dtype), tuple(t.shape)) for s, t in g.items()},
                               where=f"state['{base}']")
            fmt_of[base] = fi.format

    # ---- 2. quantise selected plain linears
    quantised_now = []
    if patterns:
        for base, g in groups.items():
            if base in fmt_of or None in g or not is_linear(base):
                continue
            w = g.get("weight")
            if w is None or w.dim() != 2 or not _matches(base, patterns) or _matches(base, exclude):
                continue
            if w.shape[1] % 16:
                raise ValueError(f"state['{base}.weight']: in_features {w.shape[1]} is not a multiple of 16; "
                                 "cannot quantise to NVFP4 (exclude it)")
            q = quantize_nvfp4(w)
            groups[base] = dict(q.tensors())
            fmt_of[base] = "nvfp4"
            quantised_now.append(base)

    # ---- 3. raw keys
    tensors: dict[str, torch.Tensor] = {}
    quantized_layers: dict[str, dict] = {}
    excluded: list[str] = []

    def put(raw: str, t: torch.Tensor, plain: bool) -> None:
        t = t.detach()
        if plain and dtype is not None and t.is_floating_point():
            t = t.to(dtype)
        t = t.to("cpu").contiguous()
        if t.untyped_storage().nbytes() != t.numel() * t.element_size():
            t = t.clone()
        if raw in tensors:
            raise ValueError(f"two canonical tensors map to raw key '{raw}'")
        tensors[raw] = t

    fused: dict[int, dict[str, dict[int, torch.Tensor]]] = {}
    for base in sorted(groups, key=_order_key):
        g = groups[base]
        fmt = fmt_of.get(base, "plain")
        if None in g:
            put(to_raw_key(base, layout), g[None], True)
            continue
        if layout == "modules" and component_kind(base) == "experts":
            if fmt != "plain":
                raise ValueError(f"state['{base}']: layout 'modules' fuses experts; quantised ({fmt}) experts "
                                 "cannot be written in it (use layout='transformers' or 'official')")
            layer, e, proj = layer_of(base), int(base.split(".")[-2]), base.split(".")[-1]
            fused.setdefault(layer, {}).setdefault(proj, {})[e] = g["weight"]
            continue
        for suffix, t in g.items():
            put(to_raw_key(f"{base}.{suffix}", layout), t, fmt == "plain")
        if is_linear(base) and "weight" in g and g["weight"].dim() == 2:
            module = to_raw_key(base + ".weight", layout)[: -len(".weight")]
            if fmt == "plain":
                excluded.append(module)
            else:
                quantized_layers[module] = {"quant_algo": QUANT_ALGO[fmt]}
                if fmt == "nvfp4":
                    quantized_layers[module]["group_size"] = 16
    for layer, projs in sorted(fused.items()):
        ne = cfg.n_routed_experts
        for proj in ("w1", "w2", "w3"):
            have = projs.get(proj, {})
            if sorted(have) != list(range(ne)):
                miss = sorted(set(range(ne)) - set(have))
                raise ValueError(f"layout 'modules' fuses experts: layer {layer} {proj} lacks experts {miss[:8]}")
        gate_up = torch.stack([torch.cat([projs["w1"][e], projs["w3"][e]], 0) for e in range(ne)])
        down = torch.stack([projs["w2"][e] for e in range(ne)])
        put(fused_key(layer, "gate_up_proj"), gate_up, True)
        put(fused_key(layer, "down_proj"), down, True)
        excluded.append(f"model.layers.{layer}.mlp.experts")

    # ---- 4. shards
    for old in glob.glob(os.path.join(path, "model*.safetensors")) + [os.path.join(path, INDEX_NAME)]:
        if os.path.exists(old):
            os.remove(old)
    shards: list[list[str]] = [[]]
    size = 0
    for raw, t in tensors.items():
        n = t.numel() * t.element_size()
        if shards[-1] and size + n > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(raw)
        size += n
    n_sh = len(shards)
    names = ["model.safetensors"] if n_sh == 1 else [f"model-{i + 1:05d}-of-{n_sh:05d}.safetensors" for i in range(n_sh)]
    show = progress if progress is not None else len(tensors) > 512
    bar = None
    if show:
        bar = tqdm(total=len(tensors), desc=f"writing {os.path.basename(os.path.abspath(path))}", unit="tensor")
    weight_map = {}
    for fname, keys in zip(names, shards):
        save_file({k: tensors[k] for k in keys}, os.path.join(path, fname), metadata={"format": "pt"})
        for k in keys:
            weight_map[k] = fname
        if bar is not None:
            bar.update(len(keys))
    if bar is not None:
        bar.close()
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    if n_sh > 1:
        with open(os.path.join(path, INDEX_NAME), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)

    # ---- 5. configs
    write_configs(path, cfg, quantized_layers, excluded)
    return {"path": os.path.abspath(path), "layout": layout, "files": names, "n_tensors": len(tensors),
            "total_bytes": total, "quantized": sorted(quantized_layers, key=natural_key),
            "quantized_now": quantised_now}


def write_configs(path: str, config: Any, quantized_layers: Mapping[str, dict], excluded: Sequence[str]) -> None:
    """config.json, plus ModelOpt ``hf_quant_config.json`` (and the same ``quantization_config``
    in config.json) when any module is quantised; a stale hf_quant_config.json is removed.

    ``quantized_layers``: raw module -> ``{"quant_algo": ..., ["group_size": 16]}``;
    ``excluded``: raw modules of 2-D linears kept unquantised.
    """
    cfg = load_config(config)
    cdict = cfg.to_transformers_dict()
    qpath = os.path.join(path, "hf_quant_config.json")
    if quantized_layers:
        algos = {v["quant_algo"] for v in quantized_layers.values()}
        algo = algos.pop() if len(algos) == 1 else "MIXED_PRECISION"
        quant = {"quant_algo": algo, "kv_cache_quant_algo": None, "group_size": 16,
                 "exclude_modules": sorted(excluded, key=natural_key), "quantized_layers": dict(quantized_layers)}
        with open(qpath, "w") as f:
            json.dump({"producer": _PRODUCER, "quantization": quant}, f, indent=2)
        cdict["quantization_config"] = {"quant_method": "modelopt", **quant}
    elif os.path.exists(qpath):
        os.remove(qpath)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cdict, f, indent=2)


def _kind(name: str, key: str) -> str:
    try:
        return component_kind(name)
    except KeyError:
        raise ValueError(f"state['{key}']: not a canonical tensor name (see docs/naming.md)") from None
