"""Synthetic checkpoints with real data: random weights a full-depth model can run on.

:func:`synth_checkpoint` writes a sharded safetensors checkpoint with the release's names,
config.json, index (and ``hf_quant_config.json`` for NVFP4) that ``inspect`` / ``plan`` /
``load`` treat as a release. Every tensor is drawn from a generator seeded by (seed, name), so
the BF16 master weights do not depend on the format: ``fmt="nvfp4"`` and ``fmt="official"``
(FP8 block + MXFP4 experts, like the DeepSeek release) of one seed are quantisations of the same
weights -- a test pair for the ``orig`` precision mode. Shards are generated one at a time
(never the whole model in memory) into ``DIR.tmp``, renamed to ``DIR`` on success.
:func:`quantize_checkpoint` writes the weights of an existing plain checkpoint (the embedded
model) the same way: a real release-format model whose format-specific bugs can be tested.
"""
from __future__ import annotations

import fnmatch
import json
import math
import os
import shutil
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
from safetensors.torch import save_file
from tqdm.auto import tqdm

from ..config import HASH_MOE, NAMED_CONFIGS, PRESET_NAMES, DSV4Config, load_config, named_config
from ..patterns import did_you_mean
from ..quant.weights import quantize_fp8_block, quantize_mxfp4, quantize_nvfp4
from .errors import CheckpointError
from .expected import expected_tensors
from .fake import FP32_PARAMS, OFFICIAL_PLAIN_KINDS, OFFICIAL_QUANTIZATION_CONFIG
from .formats import stored_shapes
from .locate import record_quantized_from, resolve_path
from .names import is_linear, natural_key, to_raw_key
from .reader import CheckpointReader
from .safetensors_index import INDEX_NAME, nbytes_of
from .writer import write_configs

SYNTH_FORMATS = ("nvfp4", "official")
PRESETS = PRESET_NAMES
NVFP4_EXCLUDE = ("head", "layers.*.mlp.router")       # kept BF16 in the NVFP4 export (as ModelOpt does)
DEFAULT_SHARD_BYTES = 4 * 2**30
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
PLAIN_DTYPES = {"BF16": torch.bfloat16, "F32": torch.float32, "I32": torch.int32}
# ModelOpt input_scale = amax(x) / (6 * 448); no calibration here: a fixed activation amax
INPUT_AMAX = 16.0


class SynthError(CheckpointError):
    """Bad synth arguments (unknown preset, non-positive sizes, existing output)."""


@dataclass(frozen=True)
class Planned:
    """One canonical tensor and how it is stored (``plain`` BF16/F32/I32, nvfp4, fp8_block, mxfp4)."""

    name: str
    shape: tuple[int, ...]
    kind: str
    store: str

    @property
    def base(self) -> str:
        return self.name[:-len(".weight")] if self.name.endswith(".weight") else self.name

    def nbytes(self) -> int:
        if self.store in ("BF16", "F32", "I32"):
            return nbytes_of(self.store, self.shape)
        ss = stored_shapes(self.store, self.shape)
        dt = {"nvfp4": {"weight": "U8", "weight_scale": "F8_E4M3", "weight_scale_2": "F32", "input_scale": "F32"},
              "fp8_block": {"weight": "F8_E4M3", "scale": "F32"},
              "mxfp4": {"weight": "I8", "scale": "F8_E8M0"}}[self.store]
        return sum(nbytes_of(dt[role], shape) for role, shape in ss.items())


# --------------------------------------------------------------------------- config
def preset_config(preset: str, layers: int | None = None, experts: int | None = None) -> DSV4Config:
    """The packaged config of ``preset`` (v4-pro / v4-flash), cut to its first ``layers`` layers
    and ``experts`` routed experts (top-k clipped to it)."""
    key = str(preset).lower()
    if key not in NAMED_CONFIGS:
        hint = did_you_mean(key, PRESETS)
        raise SynthError(f"--preset {preset!r} is not a known preset{hint} (known: {', '.join(PRESETS)})")
    return shrink(named_config(key), layers, experts, source=f"<synth {key}>")


def shrink(config: Any, layers: int | None = None, experts: int | None = None, source: str | None = None) -> DSV4Config:
    """``config`` with its first ``layers`` layers and ``experts`` routed experts."""
    cfg = load_config(config)
    for flag, v in (("--layers", layers), ("--experts", experts)):
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v <= 0):
            raise SynthError(f"{flag} must be a positive integer, got {v!r}")
    n = cfg.num_hidden_layers if layers is None else min(layers, cfg.num_hidden_layers)
    ne = cfg.n_routed_experts if experts is None else experts
    return cfg.replace(num_hidden_layers=n, layer_types=list(cfg.layer_types[:n]),
                       mlp_layer_types=list(cfg.mlp_layer_types[:n]), n_routed_experts=ne,
                       num_experts_per_tok=min(cfg.num_experts_per_tok, ne), source=source or cfg.source)


# ----------------------------------------------------------------------------- plan
def store_of(name: str, kind: str, fmt: str) -> str:
    """How ``fmt`` stores one canonical tensor (see :func:`dsv4lab.checkpoint.fake.tensor_specs`)."""
    base = name[:-len(".weight")] if name.endswith(".weight") else name
    if name.endswith("tid2eid"):
        return "I32"
    if name.endswith("router.bias") or kind in FP32_PARAMS:
        return "F32"
    if not (name.endswith(".weight") and is_linear(base)):
        return "BF16"
    if fmt == "nvfp4":
        return "BF16" if any(fnmatch.fnmatchcase(base, p) for p in NVFP4_EXCLUDE) else "nvfp4"
    if fmt == "official":
        return "mxfp4" if kind == "experts" else "BF16" if kind in OFFICIAL_PLAIN_KINDS else "fp8_block"
    raise SynthError(f"--format {fmt!r} is not one of {', '.join(SYNTH_FORMATS)}")


def plan_tensors(config: Any, fmt: str) -> list[Planned]:
    """Every tensor of ``config`` in checkpoint order, with its storage in ``fmt``."""
    return [Planned(name, shape, kind, store_of(name, kind, fmt))
            for name, (shape, kind) in expected_tensors(load_config(config)).items()]


def plan_shards(planned: Sequence[Planned], shard_bytes: int) -> list[list[Planned]]:
    """Consecutive groups of at most ``shard_bytes`` (a tensor is never split)."""
    shards: list[list[Planned]] = [[]]
    size = 0
    for p in planned:
        n = p.nbytes()
        if shards[-1] and size + n > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(p)
        size += n
    return shards


# ------------------------------------------------------------------------ weights
def generator_for(seed: int, name: str, device: str | torch.device = "cpu") -> torch.Generator:
    """A generator that depends only on (seed, tensor name): same master weights in any format."""
    return torch.Generator(device=device).manual_seed((int(seed) * 0x9E3779B1 + zlib.crc32(name.encode())) % 2**63)


def master_tensor(config: DSV4Config, p: Planned, seed: int, device: str | torch.device = "cpu") -> torch.Tensor:
    """The BF16 master value (F32 for fp32 parameters, int for tid2eid) of one tensor.

    Scales keep a full-depth stack finite with routing spread: linears ~ N(0, 1/in), the
    residual-writing projections (``wo_b``, expert/shared ``w2``) also / sqrt(2 * layers);
    router ~ N(0, 1/D) so scores differ by O(1), bias 0; norms ~ 1 + 0.1 N; mHC / sink / bias ~ 0.3 N;
    mHC scales 1 + 0.1 N; hash tables distinct random experts per token.
    """
    g = generator_for(seed, p.name, device)
    if p.name.endswith("tid2eid"):
        V, k = p.shape
        ids = torch.rand((V, config.n_routed_experts), generator=g, device=device).topk(k, dim=1).indices
        return ids.to(torch.int32)

    def randn(shape) -> torch.Tensor:
        return torch.randn(tuple(shape), generator=g, device=device)

    if p.name.endswith("router.bias"):
        val = torch.zeros(p.shape, device=device)  # no expert favoured: selection by scores alone
    elif p.kind == "norm":
        val = 1.0 + 0.1 * randn(p.shape)
    elif p.name.endswith(".scale"):
        val = 1.0 + 0.1 * randn(p.shape)
    elif p.kind == "embed":
        val = randn(p.shape)
    elif len(p.shape) >= 2:
        val = randn(p.shape) * p.shape[-1] ** -0.5
        if p.base.endswith(("attn.wo_b", ".w2")):
            val = val / math.sqrt(2 * config.num_hidden_layers)
    else:
        val = 0.3 * randn(p.shape)
    return val.float() if p.store == "F32" else val.to(torch.bfloat16)


def stored_tensors(p: Planned, master: torch.Tensor) -> dict[str, torch.Tensor]:
    """suffix-less canonical name -> stored tensors of one planned tensor (raw keys not applied)."""
    if p.store in ("BF16", "F32", "I32"):
        return {p.name: master}
    w = master.float()
    if p.store == "nvfp4":
        q = quantize_nvfp4(w, input_scale=torch.tensor(INPUT_AMAX / (6 * 448)))
        parts = q.tensors()
    elif p.store == "fp8_block":
        parts = quantize_fp8_block(w).tensors()
    elif p.store == "mxfp4":
        parts = quantize_mxfp4(w).tensors()
        parts = {"weight": parts["weight"].view(torch.int8), "scale": parts["scale"]}
    else:  # pragma: no cover - store_of gives no other value
        raise ValueError(p.store)
    return {f"{p.base}.{suffix}": t for suffix, t in parts.items()}


def master_weights(config: Any, seed: int = 0, names: Sequence[str] | None = None) -> dict[str, torch.Tensor]:
    """The master (pre-quantisation) values of ``names`` (default all): what both formats encode."""
    cfg = load_config(config)
    planned = plan_tensors(cfg, "official")
    wanted = None if names is None else set(names)
    return {p.name: master_tensor(cfg, p, seed) for p in planned if wanted is None or p.name in wanted}


# ------------------------------------------------------------------------- writing
def synth_checkpoint(out: str | os.PathLike, config: Any, fmt: str = "nvfp4", seed: int = 0,
                     shard_bytes: int = DEFAULT_SHARD_BYTES, device: str | torch.device = "cpu",
                     progress: bool | None = None) -> dict[str, Any]:
    """Write the synthetic checkpoint of ``config`` in ``fmt`` (nvfp4 / official) to ``out``.

    ``out`` must not exist; it is written as ``out.tmp`` and renamed when complete (removed on
    any error). ``device`` generates and quantises there (a GPU makes V4-Pro minutes, not
    hours). Returns ``{"path", "format", "files", "n_tensors", "total_bytes"}``.
    """
    cfg = load_config(config)
    return _write_new(out, cfg, fmt, lambda p: master_tensor(cfg, p, seed, device), shard_bytes, progress)


def quantize_checkpoint(src: str | os.PathLike, out: str | os.PathLike, fmt: str = "official",
                        shard_bytes: int = DEFAULT_SHARD_BYTES, progress: bool | None = None) -> dict[str, Any]:
    """Write the weights of checkpoint ``src`` as a release in ``fmt`` to ``out`` (which must not
    exist): ``official`` = FP8-block linears (fp32 128x128 tile scales) + MXFP4 experts, the
    helper projections, head and routers BF16, as DeepSeek ships V4; ``nvfp4`` = the ModelOpt
    export. Quantised linears of ``src`` are dequantised first; its tokenizer files are copied and
    ``src`` is recorded as the originals (``checkpoint.locate.originals_of``: the reference a
    triage of ``out`` compares with). E.g. the embedded model in the official format, for the
    bugs only that format has."""
    src = resolve_path(src)
    reader = CheckpointReader(src)

    def master(p: Planned) -> torch.Tensor:
        if p.store in PLAIN_DTYPES:
            return reader.tensor(p.name).to(PLAIN_DTYPES[p.store])
        return reader.weight(p.base).dequantize(torch.float32)

    def finish(tmp: str) -> None:
        for name in TOKENIZER_FILES:
            if (src / name).is_file():
                shutil.copy(src / name, Path(tmp) / name)
        record_quantized_from(tmp, src, fmt)

    try:
        return _write_new(out, reader.config, fmt, master, shard_bytes, progress, finish)
    finally:
        reader.close()


def _write_new(out: str | os.PathLike, cfg: DSV4Config, fmt: str, master: Callable[[Planned], torch.Tensor],
               shard_bytes: int, progress: bool | None, finish: Callable[[str], None] | None = None) -> dict[str, Any]:
    """:func:`write_shards` (then ``finish(tmp)``: extra files) into ``out.tmp``, renamed to ``out``
    when complete (removed on any error)."""
    if fmt not in SYNTH_FORMATS:
        raise SynthError(f"--format {fmt!r} is not one of {', '.join(SYNTH_FORMATS)}")
    if shard_bytes <= 0:
        raise SynthError(f"shard_bytes must be positive, got {shard_bytes}")
    out = os.path.abspath(os.fspath(out))
    if os.path.exists(out):
        raise SynthError(f"--out {out} already exists; remove it or choose another directory")
    tmp = out + ".tmp"
    if os.path.exists(tmp):
        shutil.rmtree(tmp)
    os.makedirs(tmp)
    try:
        summary = write_shards(tmp, cfg, fmt, master, shard_bytes, progress)
        if finish is not None:
            finish(tmp)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return {**summary, "path": out}


def write_shards(path: str, cfg: DSV4Config, fmt: str, master: Callable[[Planned], torch.Tensor], shard_bytes: int,
                 progress: bool | None) -> dict[str, Any]:
    """Shards, index and configs into an existing directory, each tensor's master value from
    ``master`` (quantised here when ``fmt`` stores it quantised)."""
    planned = plan_tensors(cfg, fmt)
    shards = plan_shards(planned, shard_bytes)
    n_sh = len(shards)
    files = ["model.safetensors"] if n_sh == 1 else [f"model-{i + 1:05d}-of-{n_sh:05d}.safetensors" for i in range(n_sh)]
    show = progress if progress is not None else sum(p.nbytes() for p in planned) > 2**30
    bar = tqdm(total=len(planned), desc=f"synth {fmt} -> {os.path.basename(path.removesuffix('.tmp'))}",
               unit="tensor", disable=not show)
    weight_map: dict[str, str] = {}
    quantized: dict[str, dict] = {}
    excluded: list[str] = []
    total = n_tensors = 0
    for fname, shard in zip(files, shards):
        tensors: dict[str, torch.Tensor] = {}
        for p in shard:
            for name, t in stored_tensors(p, master(p)).items():
                tensors[to_raw_key(name, "official")] = t.detach().to("cpu").contiguous()
            if len(p.shape) == 2 and is_linear(p.base):
                module = to_raw_key(p.base + ".weight", "official")[: -len(".weight")]
                if p.store == "nvfp4":
                    quantized[module] = {"quant_algo": "NVFP4", "group_size": 16}
                elif p.store == "BF16":
                    excluded.append(module)
            bar.update(1)
        save_file(tensors, os.path.join(path, fname), metadata={"format": "pt"})
        for k, t in tensors.items():
            weight_map[k] = fname
            total += t.numel() * t.element_size()
        n_tensors += len(tensors)
        del tensors
    bar.close()
    if n_sh > 1:
        with open(os.path.join(path, INDEX_NAME), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    if fmt == "nvfp4":
        write_configs(path, cfg, quantized, sorted(excluded, key=natural_key))
    else:
        cdict = cfg.to_transformers_dict()
        cdict["quantization_config"] = dict(OFFICIAL_QUANTIZATION_CONFIG)
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump(cdict, f, indent=2)
    return {"format": fmt, "files": files, "n_tensors": n_tensors, "total_bytes": total,
            "hash_layers": sum(t == HASH_MOE for t in cfg.mlp_layer_types)}
