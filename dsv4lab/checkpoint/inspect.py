"""What is in a checkpoint, from headers only: config, formats, bytes per layer / kind, and how
it compares with what the config implies.

>>> rep = inspect_checkpoint("/ckpt/V4-Pro-NVFP4")    # a JSON-able dict
>>> print(render_inspect(rep))
"""
from __future__ import annotations

import os
from collections import Counter
from typing import Any

from .errors import CheckpointError
from .names import KIND_GROUPS, component_kind, is_linear, layer_of, natural_key
from .reader import CheckpointReader

# per-layer byte columns of the text table
_GROUPS = {**KIND_GROUPS, "other": ("norm", "mhc", "embed", "head")}
_ALGO_TO_FORMAT = {"NVFP4": "nvfp4", "MXFP4": "mxfp4", "FP8_BLOCK": "fp8_block", "FP8": "fp8_block",
                   "W4A16_MXFP4": "mxfp4"}


def _config_summary(cfg) -> dict[str, Any] | None:
    if cfg is None:
        return None
    types = Counter(cfg.layer_types)
    return {
        "source": cfg.source, "num_hidden_layers": cfg.num_hidden_layers, "hidden_size": cfg.hidden_size,
        "num_attention_heads": cfg.num_attention_heads, "head_dim": cfg.head_dim,
        "qk_rope_head_dim": cfg.qk_rope_head_dim, "q_lora_rank": cfg.q_lora_rank, "o_groups": cfg.o_groups,
        "o_lora_rank": cfg.o_lora_rank, "n_routed_experts": cfg.n_routed_experts,
        "num_experts_per_tok": cfg.num_experts_per_tok, "moe_intermediate_size": cfg.moe_intermediate_size,
        "n_shared_experts": cfg.n_shared_experts, "vocab_size": cfg.vocab_size, "hc_mult": cfg.hc_mult,
        "index_n_heads": cfg.index_n_heads, "index_head_dim": cfg.index_head_dim,
        "layer_types": dict(types), "compress_rates": dict(cfg.compress_rates),
        "num_hash_layers": cfg.num_hash_layers, "tie_word_embeddings": cfg.tie_word_embeddings,
    }


def inspect_checkpoint(path: str | os.PathLike, config: Any = None, limit: int = 50) -> dict[str, Any]:
    """Summarise a checkpoint without reading tensor data.

    Structural problems (missing shard, truncated file...) are reported under ``problems`` rather
    than raised; a path that is not a checkpoint at all still raises :class:`CheckpointError`.
    Lists of names are cut to ``limit`` entries (full counts under ``counts``).
    """
    r = CheckpointReader(path, config=config, strict=False)
    files = r.index.shards
    fmt_tensors: Counter = Counter()     # logical tensors per format
    fmt_bytes: Counter = Counter()
    linear_formats: Counter = Counter()  # linear weights per format
    kind_bytes: Counter = Counter()
    layer_bytes: dict[str, int] = {}
    layer_kind: dict[str, Counter] = {}
    bad_format: list[str] = []
    kind_cache: dict[str, str] = {}
    qc = r.quant_config
    check_quant = qc is not None and (qc.quantized_layers or qc.exclude_modules
                                      or qc.source.endswith("hf_quant_config.json"))
    quant_mismatch: list[dict] = []
    n_quant_mismatch = 0

    for base, parts in r.groups.items():
        try:
            fmt = r.format_of(base).format
        except CheckpointError as e:
            fmt = "unknown"
            bad_format.append(str(e))
        nbytes = 0
        for e in parts.values():
            nbytes += e.nbytes
        fmt_tensors[fmt] += 1
        fmt_bytes[fmt] += nbytes
        # kind without re-parsing every expert name: experts share a kind
        if ".mlp.experts." in base:
            kind = "experts"
        else:
            kind = kind_cache.get(base)
            if kind is None:
                kind = kind_cache[base] = component_kind(base)
        kind_bytes[kind] += nbytes
        li = layer_of(base)
        lk = "global" if li is None else str(li)
        layer_bytes[lk] = layer_bytes.get(lk, 0) + nbytes
        layer_kind.setdefault(lk, Counter())[kind] += nbytes
        linear = None not in parts and "weight" in parts and (kind == "experts" or is_linear(base)) \
            and len(parts["weight"].shape) == 2
        if linear:
            linear_formats[fmt] += 1
            w = parts["weight"]
            if check_quant and w.slice is None and w.raw_key.endswith(".weight"):
                module = w.raw_key[: -len(".weight")]
                claimed = qc.module_algo(module)
                want = None if claimed is None else _ALGO_TO_FORMAT.get(str(claimed).upper(), str(claimed).lower())
                have = None if fmt == "plain" else fmt
                if want != have and fmt != "unknown":
                    n_quant_mismatch += 1
                    if len(quant_mismatch) < limit:
                        quant_mismatch.append({"module": module, "file": w.file, "config_says": claimed or "unquantised",
                                               "stored_as": fmt})

    comparison = None
    counts: dict[str, int] = {}
    if r.config is not None:
        cmp = r.expected_vs_present()
        full = cmp.as_dict()
        counts = {k: len(v) for k, v in full.items()}
        comparison = {k: v[:limit] for k, v in full.items()}
        comparison["ok"] = cmp.ok
    layers_sorted = sorted(layer_bytes, key=lambda k: (k != "global", int(k) if k.isdigit() else -1))
    total = sum(layer_bytes.values())
    rep: dict[str, Any] = {
        "path": r.root,
        "index_file": r.index.index_file,
        "n_shards": len(files),
        "file_bytes": sum(s.file_size for s in files.values()),
        "n_raw_tensors": len(r.index.tensors),
        "n_tensors": len(r.entries),
        "n_logical_tensors": len(r.groups),
        "tensor_bytes": total,
        "layout": r.layout,
        "config": _config_summary(r.config),
        "quant_config": qc.summary() if qc is not None else None,
        "formats": {f: {"tensors": fmt_tensors[f], "bytes": fmt_bytes[f]} for f in sorted(fmt_tensors)},
        "linear_formats": dict(sorted(linear_formats.items())),
        "bytes_by_kind": dict(sorted(kind_bytes.items(), key=lambda kv: -kv[1])),
        "bytes_by_layer": {k: layer_bytes[k] for k in layers_sorted},
        "bytes_by_layer_kind": {k: dict(layer_kind[k]) for k in layers_sorted},
        "comparison": comparison,
        "counts": counts,
        "quant_mismatch": quant_mismatch,
        "n_quant_mismatch": n_quant_mismatch,
        "ignored_keys": sorted(r.ignored_keys, key=natural_key)[:limit],
        "n_ignored_keys": len(r.ignored_keys),
        "bad_format": bad_format[:limit],
        "problems": r.problems[:limit],
        "n_problems": len(r.problems),
    }
    rep["ok"] = bool(not r.problems and not bad_format and (comparison is None or comparison["ok"])
                     and not n_quant_mismatch)
    r.close()
    return rep


def _gb(n: int) -> str:
    if n >= 10**9:
        return f"{n / 1e9:.2f} GB"
    if n >= 10**6:
        return f"{n / 1e6:.2f} MB"
    if n >= 10**3:
        return f"{n / 1e3:.1f} kB"
    return f"{n} B"


def render_inspect(rep: dict[str, Any], max_layers: int | None = None) -> str:
    """Human-readable text of :func:`inspect_checkpoint`'s report."""
    L: list[str] = []
    L.append(f"checkpoint {rep['path']}")
    L.append(f"  {rep['n_shards']} shard(s), {rep['n_raw_tensors']} stored tensors, {_gb(rep['tensor_bytes'])} of "
             f"tensor data ({_gb(rep['file_bytes'])} on disk), layout: {rep['layout']}"
             + (f", index {os.path.basename(rep['index_file'])}" if rep["index_file"] else ""))
    c = rep["config"]
    if c is None:
        L.append("config: none (no config.json): cannot compare against expected tensors")
    else:
        short = {"sliding_attention": "sliding", "compressed_sparse_attention": "CSA",
                 "heavily_compressed_attention": "HCA"}
        lt = ", ".join(f"{short.get(k, k)} {v}" for k, v in c["layer_types"].items())
        L.append(f"config: {c['num_hidden_layers']} layers ({lt}), hidden {c['hidden_size']}, "
                 f"{c['num_attention_heads']} heads x {c['head_dim']}, {c['n_routed_experts']} experts top-"
                 f"{c['num_experts_per_tok']} (I={c['moe_intermediate_size']}), vocab {c['vocab_size']}, "
                 f"{c['num_hash_layers']} hash layers  [{c['source']}]")
    q = rep["quant_config"]
    if q is None:
        L.append("quantisation config: none")
    else:
        L.append(f"quantisation config: {q['quant_algo']} (method {q['quant_method'] or '-'}, group "
                 f"{q['group_size']}), {q['n_quantized_layers']} listed modules, {q['n_exclude_patterns']} "
                 f"exclude patterns  [{q['source']}]")
    L.append("formats (logical tensors / bytes):")
    for f, d in rep["formats"].items():
        lin = rep["linear_formats"].get(f, 0)
        L.append(f"  {f:10s} {d['tensors']:>8d} tensors ({lin} linears)  {_gb(d['bytes']):>10s}")
    L.append("bytes by component kind:")
    tot = max(rep["tensor_bytes"], 1)
    for k, n in rep["bytes_by_kind"].items():
        L.append(f"  {k:26s} {_gb(n):>10s}  {100 * n / tot:5.1f}%")
    L.append("bytes by layer:")
    cols = list(_GROUPS)
    L.append("  " + f"{'layer':>6s} {'total':>10s} " + " ".join(f"{c_:>10s}" for c_ in cols))
    rows = list(rep["bytes_by_layer"].items())
    if max_layers is not None and len(rows) > max_layers:
        rows = rows[:max_layers]
    for lk, n in rows:
        kinds = rep["bytes_by_layer_kind"][lk]
        vals = [sum(kinds.get(k, 0) for k in _GROUPS[g]) for g in cols]
        L.append("  " + f"{lk:>6s} {_gb(n):>10s} " + " ".join(f"{_gb(v) if v else '-':>10s}" for v in vals))
    cmp = rep["comparison"]
    if cmp is not None:
        n = rep["counts"]
        if cmp["ok"]:
            L.append("against config: OK (every expected tensor present with the expected shape)")
        else:
            L.append(f"against config: {n['missing']} missing, {n['unexpected']} unexpected, {n['mismatched']} "
                     f"shape mismatches, {n['unknown_keys']} unknown keys, {n['bad_format']} unknown formats")
            for name in cmp["missing"]:
                L.append(f"  missing     {name}")
            for name in cmp["unexpected"]:
                L.append(f"  unexpected  {name}")
            for m in cmp["mismatched"]:
                L.append(f"  shape       {m['file']}: tensor '{m['tensor']}': found {m['found']}, expected {m['expected']}")
            for k in cmp["unknown_keys"]:
                L.append(f"  unknown key {k}")
            for msg in cmp["bad_format"]:
                L.append(f"  format      {msg}")
    if rep["n_ignored_keys"]:
        L.append(f"ignored keys (mtp / rotary): {rep['n_ignored_keys']}")
    if rep["n_quant_mismatch"]:
        L.append(f"quantisation config vs stored formats: {rep['n_quant_mismatch']} disagreements")
        for m in rep["quant_mismatch"]:
            L.append(f"  {m['module']}: config says {m['config_says']}, stored as {m['stored_as']}")
    if rep["n_problems"]:
        L.append(f"problems: {rep['n_problems']}")
        for p in rep["problems"]:
            L.append(f"  {p}")
    L.append("status: OK" if rep["ok"] else "status: PROBLEMS FOUND")
    return "\n".join(L)
