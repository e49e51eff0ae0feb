"""Synthetic checkpoints for tests and planning: random small states and SPARSE full-size files.

:func:`make_sparse_checkpoint` writes every shard's real safetensors header and then
``truncate``\\ s the file to its full length, so a 0.9 TB V4-Pro NVFP4 checkpoint costs a few MB
of disk and can be indexed / inspected / planned exactly like the real one (its data reads as
zeros). :func:`v4_pro_config` / :func:`v4_flash_config` give the published shapes.
"""
from __future__ import annotations

import fnmatch
import json
import os
from typing import Any, Sequence

import torch

from ..config import CSA, HCA, DSV4Config, config_from_dict, load_config
from .expected import expected_tensors
from .formats import stored_shapes
from .names import is_linear, to_raw_key
from .safetensors_index import INDEX_NAME, nbytes_of

# dtype of plain tensors by kind/name in a released-style checkpoint
FP32_PARAMS = ("mhc", "attn.sink", "compressor.ape", "indexer.compressor.ape")
# config.json ``quantization_config`` of the official DeepSeek release (FP8 block weights)
OFFICIAL_QUANTIZATION_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128],
                                "activation_scheme": "dynamic"}


def v4_pro_config() -> DSV4Config:
    """DeepSeek-V4-Pro shapes (61 layers, hidden 7168, 384 experts top-6...)."""
    n = 61
    return config_from_dict({
        "model_type": "deepseek_v4", "vocab_size": 129280, "hidden_size": 7168, "num_hidden_layers": n,
        "num_attention_heads": 128, "head_dim": 512, "qk_rope_head_dim": 64, "q_lora_rank": 1536,
        "o_groups": 16, "o_lora_rank": 1024, "n_routed_experts": 384, "num_experts_per_tok": 6,
        "moe_intermediate_size": 3072, "index_n_heads": 64, "index_head_dim": 128, "hc_mult": 4,
        "layer_types": [HCA, HCA] + [CSA if i % 2 == 0 else HCA for i in range(n - 2)],
        "compress_rates": {CSA: 4, HCA: 128}, "num_hash_layers": 3,
    }, source="<v4-pro>")


def v4_flash_config() -> DSV4Config:
    """DeepSeek-V4-Flash shapes (43 layers, hidden 4096, 256 experts, o_groups 8)."""
    n = 43
    return config_from_dict({
        "model_type": "deepseek_v4", "vocab_size": 129280, "hidden_size": 4096, "num_hidden_layers": n,
        "num_attention_heads": 64, "head_dim": 512, "qk_rope_head_dim": 64, "q_lora_rank": 1024,
        "o_groups": 8, "o_lora_rank": 1024, "n_routed_experts": 256, "num_experts_per_tok": 6,
        "moe_intermediate_size": 2048, "index_n_heads": 64, "index_head_dim": 128, "hc_mult": 4,
        "layer_types": [HCA, HCA] + [CSA if i % 2 == 0 else HCA for i in range(n - 2)],
        "compress_rates": {CSA: 4, HCA: 128}, "num_hash_layers": 3,
    }, source="<v4-flash>")


def tiny_config(n_experts: int = 4, **changes: Any) -> DSV4Config:
    """A 4-layer toy config with every layer kind (sliding, HCA, CSA; hash and top-k MoE)."""
    d = {
        "model_type": "deepseek_v4", "vocab_size": 64, "hidden_size": 32, "moe_intermediate_size": 16,
        "num_hidden_layers": 4, "num_attention_heads": 4, "head_dim": 32, "qk_rope_head_dim": 8,
        "q_lora_rank": 16, "o_groups": 2, "o_lora_rank": 8, "num_experts_per_tok": 2,
        "n_routed_experts": n_experts, "index_n_heads": 2, "index_head_dim": 16, "index_topk": 4,
        "sliding_window": 8, "layer_types": ["sliding_attention", HCA, CSA, HCA],
        "compress_rates": {CSA: 4, HCA: 8}, "mlp_layer_types": ["hash_moe", "moe", "moe", "moe"],
    }
    d.update(changes)
    return config_from_dict(d, source="<tiny>")


def random_state(config: Any, seed: int = 0, dtype=None, scale: float = 0.05) -> dict:
    """A random canonical state (name -> tensor) with every tensor ``config`` implies."""
    cfg = load_config(config)
    dtype = dtype or torch.float32
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, (shape, kind) in expected_tensors(cfg).items():
        if name.endswith("tid2eid"):
            out[name] = torch.randint(0, cfg.n_routed_experts, shape, generator=g, dtype=torch.int64)
        elif kind == "norm":
            out[name] = (1.0 + 0.1 * torch.randn(shape, generator=g)).to(dtype)
        else:
            out[name] = (scale * torch.randn(shape, generator=g)).to(dtype)
    return out


# Linears the official release ships in BF16 (no FP8 scale): the head, the router gates and the
# compressor / indexer helper projections (transformers' DeepseekV4 keeps the latter out of its
# FP8 conversion for that reason).
OFFICIAL_PLAIN_KINDS = ("head", "router", "compressor.wkv", "compressor.wgate", "indexer.compressor.wkv",
                        "indexer.compressor.wgate", "indexer.weights_proj")


def tensor_specs(config: Any, fmt: str = "nvfp4", layout: str = "official", dtype: str = "BF16",
                 nvfp4: Sequence[str] = ("*",), exclude: Sequence[str] = ("head", "layers.*.mlp.router"),
                 input_scale: bool = True) -> list[tuple[str, str, tuple[int, ...]]]:
    """(raw key, safetensors dtype, shape) of every stored tensor of a synthetic checkpoint.

    ``fmt``: "nvfp4" (linears matching ``nvfp4`` and not ``exclude`` as ModelOpt NVFP4, the rest
    ``dtype``), "official" (FP8 block e4m3 + fp32 scale for non-expert linears, MXFP4 + e8m0 for
    experts, like the DeepSeek release) or "plain" (everything ``dtype``). Norms and embeddings
    are ``dtype``; mHC params, sinks and ape are F32; router bias F32; tid2eid I32.
    """
    cfg = load_config(config)
    if layout not in ("official", "transformers", "canonical"):
        raise ValueError(f"sparse checkpoints support layouts official/transformers/canonical, not {layout!r}")
    specs = []

    def add(name: str, dt: str, shape) -> None:
        specs.append((to_raw_key(name, layout), dt, tuple(int(s) for s in shape)))

    for name, (shape, kind) in expected_tensors(cfg).items():
        base = name[:-len(".weight")] if name.endswith(".weight") else name
        if name.endswith("tid2eid"):
            add(name, "I32", shape)
        elif name.endswith("router.bias") or kind in FP32_PARAMS:
            add(name, "F32", shape)
        elif not (name.endswith(".weight") and is_linear(base)) or fmt == "plain":
            add(name, dtype, shape)
        elif fmt == "nvfp4":
            if any(fnmatch.fnmatchcase(base, p) for p in nvfp4) and not any(fnmatch.fnmatchcase(base, p) for p in exclude):
                ss = stored_shapes("nvfp4", shape)
                add(base + ".weight", "U8", ss["weight"])
                add(base + ".weight_scale", "F8_E4M3", ss["weight_scale"])
                add(base + ".weight_scale_2", "F32", ())
                if input_scale:
                    add(base + ".input_scale", "F32", ())
            else:
                add(name, dtype, shape)
        elif fmt == "official":
            if kind == "experts":
                ss = stored_shapes("mxfp4", shape)
                add(base + ".weight", "I8", ss["weight"])
                add(base + ".scale", "F8_E8M0", ss["scale"])
            elif kind in OFFICIAL_PLAIN_KINDS:
                add(name, dtype, shape)
            else:
                ss = stored_shapes("fp8_block", shape)
                add(base + ".weight", "F8_E4M3", ss["weight"])
                add(base + ".scale", "F32", ss["scale"])
        else:
            raise ValueError(f"unknown fmt {fmt!r}; expected 'nvfp4', 'official' or 'plain'")
    return specs


def _write_sparse_shard(path: str, specs: Sequence[tuple[str, str, tuple[int, ...]]]) -> int:
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    off = 0
    for key, dt, shape in specs:
        n = nbytes_of(dt, shape)
        header[key] = {"dtype": dt, "shape": list(shape), "data_offsets": [off, off + n]}
        off += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little"))
        f.write(raw)
        f.truncate(8 + len(raw) + off)
    return off


def make_sparse_checkpoint(path: str | os.PathLike, config: Any = None, fmt: str = "nvfp4",
                           layout: str = "official", shard_bytes: int = 14 * 10**9, dtype: str = "BF16",
                           nvfp4: Sequence[str] = ("*",), exclude: Sequence[str] = ("head", "layers.*.mlp.router"),
                           input_scale: bool = True) -> dict[str, Any]:
    """Write a sparse (header-only, truncated-to-size) checkpoint with index json and configs.

    Defaults to V4-Pro in NVFP4 (router gates and lm head left BF16). Returns
    ``{"path", "files", "n_tensors", "total_bytes"}``; ``total_bytes`` is the data bytes.
    """
    cfg = load_config(config) if config is not None else v4_pro_config()
    path = os.fspath(path)
    os.makedirs(path, exist_ok=True)
    specs = tensor_specs(cfg, fmt, layout, dtype, nvfp4, exclude, input_scale)
    shards: list[list] = [[]]
    size = 0
    for s in specs:
        n = nbytes_of(s[1], s[2])
        if shards[-1] and size + n > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(s)
        size += n
    names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    total = 0
    weight_map = {}
    for fname, sh in zip(names, shards):
        total += _write_sparse_shard(os.path.join(path, fname), sh)
        for key, _, _ in sh:
            weight_map[key] = fname
    with open(os.path.join(path, INDEX_NAME), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f)
    cdict = cfg.to_transformers_dict()
    if fmt == "nvfp4":
        quantized, excluded = {}, []
        for key, dt, _ in specs:
            if key.endswith(".weight_scale_2"):
                quantized[key[: -len(".weight_scale_2")]] = {"quant_algo": "NVFP4", "group_size": 16}
        for key, dt, shape in specs:
            if key.endswith(".weight") and dt == dtype and len(shape) == 2:
                mod = key[: -len(".weight")]
                if mod not in quantized and not mod.endswith("embed") and "embed_tokens" not in mod:
                    excluded.append(mod)
        quant = {"quant_algo": "NVFP4", "kv_cache_quant_algo": None, "group_size": 16,
                 "exclude_modules": excluded, "quantized_layers": quantized}
        with open(os.path.join(path, "hf_quant_config.json"), "w") as f:
            json.dump({"producer": {"name": "dsv4lab.fake", "version": "0"}, "quantization": quant}, f)
        cdict["quantization_config"] = {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16,
                                        "exclude_modules": excluded}
    elif fmt == "official":
        cdict["quantization_config"] = dict(OFFICIAL_QUANTIZATION_CONFIG)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cdict, f, indent=1)
    return {"path": os.path.abspath(path), "files": names, "n_tensors": len(specs), "total_bytes": total}
