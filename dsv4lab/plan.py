"""Memory plan for DSV4 over 1..N GPUs: bytes per layer and component, decode state, placement.

>>> p = plan("v4-pro", gpus=8, gpu_memory="141GB", context=65536)        # from the config + a format
>>> p = plan("/ckpt/DeepSeek-V4-Pro-NVFP4", gpus=8)                       # from the checkpoint headers
>>> print(p.summary()); p.table(); model = dsv4lab.load(path, device_map=p.device_map())

Weights come from the checkpoint's safetensors headers when there is a checkpoint (exact stored
bytes, any layout and format; ``mtp.*`` is counted separately and not placed), otherwise from
``expected_tensors(config)`` shapes in a format (:data:`FORMATS`), using the same per-tensor dtype
rules as :func:`dsv4lab.checkpoint.fake.tensor_specs`:

* ``nvfp4`` (the users' engine): every linear except ``head`` and the router gates is ModelOpt
  NVFP4 = uint8 ``[out, in/2]`` (0.5 byte/param) + e4m3 ``weight_scale`` per 16 + fp32
  ``weight_scale_2`` and ``input_scale`` per matrix; embed, head, router gate, norms: BF16;
  mHC fn/base/scale, attention sink, compressor ``ape``, router bias: FP32; ``tid2eid``: int32.
* ``fp8_mxfp4`` (the official release): routed experts MXFP4 = packed e2m1 (0.5 byte/param) +
  e8m0 scale per 32; other linears (not head / router) FP8 e4m3 + fp32 scale per 128x128 block;
  the rest as above.
* ``bf16``: every linear BF16, the rest as above.

Decode state is :meth:`dsv4lab.model.state.DecodeState.allocate` on the meta device (the exact
buffers ``model.new_state`` makes) for ``batch`` x ``context`` tokens in ``kv_dtype``.

Placement is contiguous (embed with layer 0; head, norm, hc_head with the last layer; what
:func:`dsv4lab.load` does with a ``device_map``) and minimises the largest per-GPU load relative to
its usable memory (capacity - ``reserve``), by dynamic programming over the split points.
"""
from __future__ import annotations

import fnmatch
import functools
import json
import math
import os
import re
import sys
from dataclasses import dataclass, field
from typing import Any, Sequence

import pandas as pd

from .checkpoint import CheckpointError
from .checkpoint.fake import tensor_specs
from .checkpoint.locate import EMBEDDED, resolve_path
from .checkpoint.names import KIND_GROUPS, LINEAR_KINDS, component_kind, layer_of, split_name
from .checkpoint.reader import CheckpointReader
from .checkpoint.safetensors_index import FLOAT_DTYPES, nbytes_of
from .config import NAMED_CONFIGS, PRESET_NAMES, ConfigError, DSV4Config, config_from_dict, load_config, named_config
from .model.state import DecodeState
from .model.validate import check_int, parse_dtype
from .patterns import did_you_mean

FORMATS = ("nvfp4", "fp8_mxfp4", "bf16")
_FAKE_FMT = {"nvfp4": "nvfp4", "fp8_mxfp4": "official", "bf16": "plain"}
_FMT_ALIASES = {"nvfp4": "nvfp4", "fp4": "nvfp4", "modelopt": "nvfp4", "fp8_mxfp4": "fp8_mxfp4", "official": "fp8_mxfp4",
                "fp8": "fp8_mxfp4", "mxfp4": "fp8_mxfp4", "fp8+mxfp4": "fp8_mxfp4", "bf16": "bf16", "plain": "bf16"}
# default per-GPU headroom kept free for the CUDA context, cuBLAS workspace and the activations of a
# ~4k-token prefill chunk at batch 1 (V4-Pro: fp32 logits 4096x129280 = 2.1 GB, attention
# probabilities 128 heads x 4096 x (128 + 1024) fp32 = 2.4 GB)
DEFAULT_RESERVE = 6 * 10**9
# per-layer byte columns of the table (component kinds of dsv4lab.checkpoint.names)
GROUPS = {**KIND_GROUPS, "embed/head": ("embed", "head"), "norm/mhc": ("norm", "mhc")}


class PlanError(ValueError):
    """The model does not fit; the message says by how much and what would fit. ``.plan`` holds
    the best (non-fitting) plan."""

    def __init__(self, message: str, plan: "MemoryPlan | None" = None) -> None:
        super().__init__(message)
        self.plan = plan


# ---------------------------------------------------------------------------------- units
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12, "kib": 2**10, "mib": 2**20,
          "gib": 2**30, "tib": 2**40, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}


def parse_bytes(x: Any) -> int:
    """``141e9``, ``"141GB"`` (decimal), ``"139 GiB"`` (binary), ``"1.5TB"`` -> bytes. A bare number
    below 10**5 is taken as GB (``--gpu-memory 141``)."""
    if isinstance(x, bool):
        raise ValueError(f"not a byte size: {x!r}")
    if isinstance(x, (int, float)):
        return int(x * 10**9) if 0 < x < 10**5 else int(x)
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-zA-Z]*)\s*", str(x))
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"not a byte size: {x!r} (use e.g. 141GB, 139GiB, 1.5TB or a number of bytes)")
    v = float(m.group(1))
    unit = m.group(2).lower()
    if not unit:
        return parse_bytes(v)
    return int(v * _UNITS[unit])


def fmt_bytes(n: float) -> str:
    n = float(n)
    if abs(n) >= 10**9:
        return f"{n / 1e9:.2f} GB"
    if abs(n) >= 10**6:
        return f"{n / 1e6:.2f} MB"
    if abs(n) >= 10**3:
        return f"{n / 1e3:.1f} kB"
    return f"{int(n)} B"


# --------------------------------------------------------------------------------- inputs
def _is_checkpoint(p: str) -> bool:
    if os.path.isdir(p):
        return any(f.endswith(".safetensors") or f == "model.safetensors.index.json" for f in os.listdir(p))
    return p.endswith(".safetensors") or p.endswith(".index.json")


def _resolve(config_or_path: Any):
    """-> (config, reader or None, label)."""
    if isinstance(config_or_path, DSV4Config):
        return config_or_path, None, config_or_path.source
    if isinstance(config_or_path, dict):
        return config_from_dict(config_or_path), None, "<dict>"
    s = os.fspath(config_or_path)
    if s.lower() in NAMED_CONFIGS:
        return named_config(s), None, s.lower()
    if s in EMBEDDED:
        s = str(resolve_path(s))
    if _is_checkpoint(s):
        reader = CheckpointReader(s, strict=True)
        if reader.config is None:
            raise ValueError(f"{s}: checkpoint has no config.json; pass the config instead")
        return reader.config, reader, reader.root
    if not os.path.exists(s):  # neither a path nor a name: say what is accepted, with the closest names
        names = (*PRESET_NAMES, *EMBEDDED)
        hint = did_you_mean(s.lower(), names)
        raise ConfigError(f"{s!r} is no checkpoint, config.json or packaged name{hint} "
                          f"(packaged: {', '.join(names)})")
    return load_config(s), None, s


# ------------------------------------------------------------------------- weight bytes
@dataclass
class WeightBytes:
    layers: list[dict[str, int]]            # per layer: component kind -> bytes
    embed: dict[str, int]                   # placed with layer 0
    final: dict[str, int]                   # head / norm / hc_head, placed with the last layer
    by_format: dict[str, int]               # format -> bytes
    source: str                             # "checkpoint" or the format
    ignored: int = 0                        # bytes present but not loaded (mtp.*, rotary buffers)
    unknown: int = 0                        # bytes of keys no layout knows (not loaded)
    dense_numel: list[dict[str, int]] = field(default_factory=list)  # per item: kind -> numel of quantised linears


def _kind(base: str, cache: dict) -> str:
    if ".mlp.experts." in base:
        return "experts"
    k = cache.get(base)
    if k is None:
        k = cache[base] = component_kind(base)
    return k


def weights_from_checkpoint(reader) -> WeightBytes:
    """Stored bytes per layer / kind from a :class:`CheckpointReader`'s headers (no tensor data)."""
    n = reader.config.num_hidden_layers
    items: list[dict[str, int]] = [dict() for _ in range(n + 2)]
    dense: list[dict[str, int]] = [dict() for _ in range(n + 2)]
    by_fmt: dict[str, int] = {}
    cache: dict[str, str] = {}
    for base, parts in reader.groups.items():
        nbytes = sum(e.nbytes for e in parts.values())
        kind = _kind(base, cache)
        li = layer_of(base)
        idx = li if li is not None else (n if kind == "embed" else n + 1)
        if idx >= n and li is not None:
            raise CheckpointError(f"{reader.root}: tensor '{base}' is for layer {li} but the config has {n} layers")
        items[idx][kind] = items[idx].get(kind, 0) + nbytes
        try:
            fi = reader.format_of(base)
            fmt = fi.format
        except CheckpointError:
            fi, fmt = None, "unknown"
        by_fmt[fmt] = by_fmt.get(fmt, 0) + nbytes
        if fi is not None and fmt != "plain" and len(fi.logical_shape) == 2:
            dense[idx][kind] = dense[idx].get(kind, 0) + math.prod(fi.logical_shape)
    tens = reader.index.tensors
    ignored = sum(tens[k].nbytes for k in reader.ignored_keys if k in tens)
    unknown = sum(tens[k].nbytes for k in reader.unknown_keys if k in tens)
    return WeightBytes(items[:n], items[n], items[n + 1], by_fmt, "checkpoint", ignored, unknown, dense)


def _signature(c: DSV4Config, i: int) -> tuple:
    return (c.layer_types[i], c.mlp_layer_types[i], c.compress_ratio(i))


@functools.lru_cache(maxsize=16)
def _weights_from_config_cached(cfg_json: str, fmt: str) -> WeightBytes:
    c = config_from_dict(json.loads(cfg_json))
    n = c.num_hidden_layers
    # layers with the same (attention type, MoE type, ratio) have the same tensors: compute one
    # representative layer per signature on a reduced config, then map back
    reps: dict[tuple, int] = {}
    for i in range(n):
        reps.setdefault(_signature(c, i), len(reps))
    order = sorted(reps, key=reps.get)
    small = c.replace(num_hidden_layers=len(order), layer_types=[s[0] for s in order],
                      mlp_layer_types=[s[1] for s in order])
    per_rep: list[dict[str, int]] = [dict() for _ in range(len(order) + 2)]
    dense: list[dict[str, int]] = [dict() for _ in range(len(order) + 2)]
    by_fmt: dict[str, int] = {}
    bases: dict[str, dict[str, tuple]] = {}
    for key, dt, shape in tensor_specs(small, _FAKE_FMT[fmt], layout="canonical"):
        base, suffix = split_name(key)
        bases.setdefault(base, {})[suffix] = (dt, shape)
    kcache: dict[str, str] = {}
    reps_n = len(order)
    for base, parts in bases.items():
        nbytes = sum(nbytes_of(dt, sh) for dt, sh in parts.values())
        kind = _kind(base, kcache)
        li = layer_of(base)
        idx = li if li is not None else (reps_n if kind == "embed" else reps_n + 1)
        per_rep[idx][kind] = per_rep[idx].get(kind, 0) + nbytes
        w = parts.get("weight")
        quant = w is not None and len(parts) > 1 and w[0] not in FLOAT_DTYPES
        f = "plain"
        if quant:
            f = "nvfp4" if "weight_scale" in parts else ("mxfp4" if kind == "experts" else "fp8_block")
            logical = (w[1][0], w[1][1] * (2 if f in ("nvfp4", "mxfp4") else 1))
            dense[idx][kind] = dense[idx].get(kind, 0) + math.prod(logical)
        per_rep[idx].setdefault("_fmt", {})  # type: ignore[arg-type]
        fm = per_rep[idx]["_fmt"]  # type: ignore[index]
        fm[f] = fm.get(f, 0) + nbytes
    layers, dlayers = [], []
    for i in range(n):
        r = reps[_signature(c, i)]
        layers.append({k: v for k, v in per_rep[r].items() if k != "_fmt"})
        dlayers.append(dict(dense[r]))
        for f, b in per_rep[r]["_fmt"].items():
            by_fmt[f] = by_fmt.get(f, 0) + b
    for idx in (reps_n, reps_n + 1):
        for f, b in per_rep[idx].get("_fmt", {}).items():
            by_fmt[f] = by_fmt.get(f, 0) + b
    strip = lambda d: {k: v for k, v in d.items() if k != "_fmt"}  # noqa: E731
    return WeightBytes(layers, strip(per_rep[reps_n]), strip(per_rep[reps_n + 1]), by_fmt, fmt, 0, 0,
                       dlayers + [dense[reps_n], dense[reps_n + 1]])


def weights_from_config(config: DSV4Config, fmt: str = "nvfp4") -> WeightBytes:
    """Bytes per layer / kind implied by ``config`` in ``fmt`` (see the module docstring)."""
    fmt = normalize_format(fmt)
    return _weights_from_config_cached(json.dumps(config.to_transformers_dict(), sort_keys=True), fmt)


def normalize_format(fmt: str) -> str:
    f = _FMT_ALIASES.get(str(fmt).lower().replace("-", "_"))
    if f is None:
        raise ValueError(f"unknown format {fmt!r}; choose from {list(FORMATS)}")
    return f


# ---------------------------------------------------------------------------- state bytes
def state_bytes(config: DSV4Config, context: int, batch: int = 1, kv_dtype="bf16") -> list[int]:
    """Decode-state bytes per layer: the buffers ``DecodeState.allocate`` makes (built on meta)."""
    st = DecodeState.allocate(config, batch, max(int(context), 1), dtype=parse_dtype(kv_dtype, "kv_dtype"),
                              devices="meta")
    out = []
    for ls in st.layers:
        ts = [ls.kv_ring]
        for cs in (ls.compressor, ls.indexer):
            if cs is not None:
                ts += [cs.ring_kv, cs.ring_gate, cs.entries]
        out.append(sum(t.numel() * t.element_size() for t in ts))
    return out


# ------------------------------------------------------------------------------ placement
def place(loads: Sequence[float], usable: Sequence[float]) -> tuple[list[int], float]:
    """Contiguous split of ``loads`` (in order) over GPUs 0..G-1 minimising max(load_g / usable_g).

    Returns (item -> gpu, the optimal max ratio). A GPU may be left empty. Exact DP, O(G N^2).
    """
    n, G = len(loads), len(usable)
    if G == 0:
        raise ValueError("no GPUs")
    pre = [0.0]
    for x in loads:
        pre.append(pre[-1] + float(x))
    inf = float("inf")

    def ratio(j, i, g):  # items j..i-1 on gpu g
        s = pre[i] - pre[j]
        if s <= 0:
            return 0.0
        return s / usable[g] if usable[g] > 0 else inf

    best = [[inf] * (n + 1) for _ in range(G + 1)]
    arg = [[0] * (n + 1) for _ in range(G + 1)]
    best[0][0] = 0.0
    for g in range(1, G + 1):
        for i in range(n + 1):
            b, a = inf, 0
            for j in range(i + 1):
                prev = best[g - 1][j]
                if prev >= b:
                    continue
                v = max(prev, ratio(j, i, g - 1))
                if v < b:
                    b, a = v, j
            best[g][i], arg[g][i] = b, a
    out = [0] * n
    i = n
    for g in range(G, 0, -1):
        j = arg[g][i]
        for k in range(j, i):
            out[k] = g - 1
        i = j
    return out, best[G][n]


# ---------------------------------------------------------------------------------- plan
@dataclass
class MemoryPlan:
    """A placement of a DSV4 model over GPUs, with bytes per layer / component / GPU."""

    label: str
    config: DSV4Config
    weight_source: str                       # "checkpoint" or the format
    weights: WeightBytes
    state: list[int]                         # decode-state bytes per layer
    dense: list[int]                         # extra dense (BF16) copies per layer (``dense=`` kinds)
    dense_embed: int
    dense_final: int
    context: int
    batch: int
    kv_dtype: str
    capacity: list[int]                      # bytes per GPU
    reserve: list[int]                       # bytes kept free per GPU
    placement: list[int]                     # layer -> gpu index
    max_ratio: float                         # largest load / usable over GPUs

    # ---------------------------------------------------------------- numbers
    @property
    def num_layers(self) -> int:
        return self.config.num_hidden_layers

    @property
    def gpus(self) -> int:
        return len(self.capacity)

    def layer_weight_bytes(self, i: int) -> int:
        return sum(self.weights.layers[i].values())

    @property
    def embed_bytes(self) -> int:
        return sum(self.weights.embed.values())

    @property
    def final_bytes(self) -> int:
        return sum(self.weights.final.values())

    def item_loads(self) -> list[int]:
        """Bytes placed with each layer (layer 0 carries embed, the last layer head/norm/hc_head)."""
        out = [self.layer_weight_bytes(i) + self.state[i] + self.dense[i] for i in range(self.num_layers)]
        out[0] += self.embed_bytes + self.dense_embed
        out[-1] += self.final_bytes + self.dense_final
        return out

    @property
    def weight_bytes(self) -> int:
        return sum(self.layer_weight_bytes(i) for i in range(self.num_layers)) + self.embed_bytes + self.final_bytes

    @property
    def state_bytes(self) -> int:
        return sum(self.state)

    @property
    def dense_bytes(self) -> int:
        return sum(self.dense) + self.dense_embed + self.dense_final

    @property
    def total_bytes(self) -> int:
        return self.weight_bytes + self.state_bytes + self.dense_bytes

    def bytes_by_kind(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for d in self.weights.layers + [self.weights.embed, self.weights.final]:
            for k, v in d.items():
                out[k] = out.get(k, 0) + v
        return dict(sorted(out.items(), key=lambda kv: -kv[1]))

    def layers_on(self, g: int) -> list[int]:
        return [i for i, p in enumerate(self.placement) if p == g]

    def gpu_load(self, g: int) -> dict[str, int]:
        ls = self.layers_on(g)
        w = sum(self.layer_weight_bytes(i) for i in ls)
        d = sum(self.dense[i] for i in ls)
        if ls and ls[0] == 0:
            w += self.embed_bytes
            d += self.dense_embed
        if ls and ls[-1] == self.num_layers - 1:
            w += self.final_bytes
            d += self.dense_final
        s = sum(self.state[i] for i in ls)
        total = w + s + d
        usable = self.capacity[g] - self.reserve[g]
        return {"weights": w, "state": s, "dense": d, "total": total, "capacity": self.capacity[g],
                "reserve": self.reserve[g], "usable": usable, "headroom": usable - total}

    def headroom(self) -> list[int]:
        """Free bytes per GPU after weights, state and the reserve (negative: over)."""
        return [self.gpu_load(g)["headroom"] for g in range(self.gpus)]

    @property
    def fits(self) -> bool:
        return all(h >= 0 for h in self.headroom())

    def device_map(self, prefix: str = "cuda", devices: Sequence[Any] | None = None) -> list[str]:
        """Layer -> device string, for ``dsv4lab.load(path, device_map=...)``: ``f"{prefix}:{gpu}"``,
        or ``devices[gpu]`` when a list of devices (one per planned GPU) is given."""
        if devices is not None:
            if len(devices) < self.gpus:
                raise ValueError(f"{len(devices)} devices for a plan over {self.gpus} GPUs")
            return [str(devices[g]) for g in self.placement]
        return [f"{prefix}:{g}" for g in self.placement]

    # ----------------------------------------------------------------- output
    def _layer_row(self, i: int) -> dict[str, Any]:
        w = self.weights.layers[i]
        row: dict[str, Any] = {"layer": str(i), "gpu": self.placement[i], "type": _short(self.config.layer_types[i]),
                               "moe": "hash" if self.config.mlp_layer_types[i] == "hash_moe" else "topk"}
        for col, kinds in GROUPS.items():
            row[col] = sum(w.get(k, 0) for k in kinds)
        row["weights"] = sum(w.values())
        row["state"] = self.state[i]
        row["dense"] = self.dense[i]
        row["total"] = row["weights"] + row["state"] + row["dense"]
        return row

    def rows(self) -> list[dict[str, Any]]:
        """Per-layer rows (plus ``embed`` and ``final``), bytes per component group."""
        def glob_row(name: str, w: dict, gpu: int, dense: int) -> dict[str, Any]:
            row: dict[str, Any] = {"layer": name, "gpu": gpu, "type": "", "moe": ""}
            for col, kinds in GROUPS.items():
                row[col] = sum(w.get(k, 0) for k in kinds)
            row["weights"] = sum(w.values())
            row["state"] = 0
            row["dense"] = dense
            row["total"] = row["weights"] + dense
            return row

        out = [glob_row("embed", self.weights.embed, self.placement[0], self.dense_embed)]
        out += [self._layer_row(i) for i in range(self.num_layers)]
        out.append(glob_row("final", self.weights.final, self.placement[-1], self.dense_final))
        return out

    def table(self):
        """pandas DataFrame: one row per layer (+ embed, final), bytes per component group."""
        return pd.DataFrame(self.rows()).set_index("layer")

    def gpu_table(self):
        """pandas DataFrame: one row per GPU (layers, weights, state, total, usable, headroom)."""
        rows = []
        for g in range(self.gpus):
            ls = self.layers_on(g)
            rows.append({"gpu": g, "layers": _ranges(ls), **self.gpu_load(g)})
        return pd.DataFrame(rows).set_index("gpu")

    def to_dict(self) -> dict[str, Any]:
        return {
            "label": self.label, "weight_source": self.weight_source, "formats": dict(self.weights.by_format),
            "num_layers": self.num_layers, "context": self.context, "batch": self.batch, "kv_dtype": self.kv_dtype,
            "weight_bytes": self.weight_bytes, "state_bytes": self.state_bytes, "dense_bytes": self.dense_bytes,
            "total_bytes": self.total_bytes, "ignored_bytes": self.weights.ignored,
            "unknown_bytes": self.weights.unknown, "bytes_by_kind": self.bytes_by_kind(),
            "gpus": [{"gpu": g, "layers": self.layers_on(g), **self.gpu_load(g)} for g in range(self.gpus)],
            "fits": self.fits, "max_ratio": self.max_ratio, "device_map": self.device_map(), "rows": self.rows(),
        }

    def summary(self) -> str:
        c = self.config
        L = []
        src = ("checkpoint headers (" + ", ".join(f"{f} {fmt_bytes(b)}" for f, b in
                                                sorted(self.weights.by_format.items(), key=lambda kv: -kv[1])) + ")"
               if self.weight_source == "checkpoint" else f"config in format {self.weight_source}")
        L.append(f"memory plan: {self.label}")
        L.append(f"  {c.num_hidden_layers} layers, hidden {c.hidden_size}, {c.n_routed_experts} experts; weights from {src}")
        if self.weights.ignored or self.weights.unknown:
            L.append(f"  not loaded: {fmt_bytes(self.weights.ignored)} ignored (mtp.*), "
                     f"{fmt_bytes(self.weights.unknown)} unknown keys")
        L.append(f"  weights {fmt_bytes(self.weight_bytes)} + decode state {fmt_bytes(self.state_bytes)} "
                 f"(context {self.context} x batch {self.batch}, {self.kv_dtype})"
                 + (f" + dense copies {fmt_bytes(self.dense_bytes)}" if self.dense_bytes else "")
                 + f" = {fmt_bytes(self.total_bytes)}")
        caps = sorted(set(self.capacity))
        cap_s = f"{self.gpus} x {fmt_bytes(caps[0])}" if len(caps) == 1 else ", ".join(fmt_bytes(x) for x in self.capacity)
        L.append(f"  on {cap_s}, reserve {fmt_bytes(self.reserve[0])} per GPU for activations/workspace")
        L.append(f"  {'gpu':>3s} {'layers':>12s} {'weights':>11s} {'state':>10s} {'total':>11s} {'usable':>11s} "
                 f"{'headroom':>11s} {'use':>6s}")
        for g in range(self.gpus):
            d = self.gpu_load(g)
            ls = self.layers_on(g)
            extra = ("+E" if ls and ls[0] == 0 else "") + ("+H" if ls and ls[-1] == self.num_layers - 1 else "")
            use = d["total"] / d["usable"] if d["usable"] > 0 else float("inf")
            L.append(f"  {g:>3d} {(_ranges(ls) or '-') + extra:>12s} {fmt_bytes(d['weights']):>11s} "
                     f"{fmt_bytes(d['state']):>10s} {fmt_bytes(d['total']):>11s} {fmt_bytes(d['usable']):>11s} "
                     f"{fmt_bytes(d['headroom']):>11s} {100 * use:5.1f}%")
        L.append("  (+E: with the embedding, +H: with head/norm/hc_head)")
        hr = self.headroom()
        if self.fits:
            L.append(f"  FITS: min headroom {fmt_bytes(min(hr))} (GPU {hr.index(min(hr))})")
        else:
            L.append(f"  DOES NOT FIT: GPU {hr.index(min(hr))} is {fmt_bytes(-min(hr))} over")
        return "\n".join(L)

    def __repr__(self) -> str:
        return (f"MemoryPlan({self.label!r}, {self.gpus} GPUs, total {fmt_bytes(self.total_bytes)}, "
                f"fits={self.fits}, headroom={[round(h / 1e9, 2) for h in self.headroom()]} GB)")


def _short(t: str) -> str:
    return {"sliding_attention": "SWA", "compressed_sparse_attention": "CSA",
            "heavily_compressed_attention": "HCA"}.get(t, t)


def _ranges(ls: list[int]) -> str:
    if not ls:
        return ""
    return f"{ls[0]}-{ls[-1]}" if len(ls) > 1 else str(ls[0])


# ---------------------------------------------------------------------------- entry point
def _capacities(gpus: int | None, gpu_memory) -> list[int]:
    if isinstance(gpu_memory, (list, tuple)):
        caps = [parse_bytes(x) for x in gpu_memory]
        if gpus is not None and gpus != len(caps):
            raise ValueError(f"gpus={gpus} but {len(caps)} gpu_memory entries")
        return caps
    if gpus is None or int(gpus) < 1:
        raise ValueError(f"gpus must be >= 1, got {gpus!r}")
    return [parse_bytes(gpu_memory)] * int(gpus)


def _dense_extra(wb: WeightBytes, n: int, patterns: Sequence[str], bytes_per: int = 2) -> tuple[list[int], int, int]:
    kinds = sorted(LINEAR_KINDS)   # a linear kind left unquantised in this format gets no copy: 0 bytes
    for p in patterns:
        if not any(fnmatch.fnmatchcase(k, p) for k in kinds):
            hint = did_you_mean(p, kinds)
            raise ValueError(f"dense={p!r} matches no linear component kind{hint} (kinds: {', '.join(kinds)})")
    if not patterns or not wb.dense_numel:
        return [0] * n, 0, 0

    def f(d):
        return bytes_per * sum(v for k, v in d.items() if any(fnmatch.fnmatchcase(k, p) for p in patterns))

    return [f(wb.dense_numel[i]) for i in range(n)], f(wb.dense_numel[n]), f(wb.dense_numel[n + 1])


def _build(config, wb, label, caps, reserve, context, batch, kv_dtype, dense) -> MemoryPlan:
    n = config.num_hidden_layers
    st = state_bytes(config, context, batch, kv_dtype)
    dl, de, dfin = _dense_extra(wb, n, dense)
    res = [parse_bytes(r) for r in reserve] if isinstance(reserve, (list, tuple)) else [parse_bytes(reserve)] * len(caps)
    p = MemoryPlan(label, config, wb.source, wb, st, dl, de, dfin, int(context), int(batch), str(kv_dtype).replace("torch.", ""),
                   caps, res, [0] * n, 0.0)
    p.placement, p.max_ratio = place(p.item_loads(), [c - r for c, r in zip(caps, res)])
    return p


def plan(config_or_path: Any = "v4-pro", gpus: int | None = 8, gpu_memory: Any = "141GB", context: int = 65536,
         batch: int = 1, fmt: str | None = None, reserve: Any = DEFAULT_RESERVE, kv_dtype: Any = "bf16",
         dense: Sequence[str] = (), check: bool = True) -> MemoryPlan:
    """Plan a DSV4 model over ``gpus`` GPUs of ``gpu_memory`` each (or a list of capacities).

    ``config_or_path``: a checkpoint (directory / index json / .safetensors; bytes from its headers),
    a config (DSV4Config, dict, config.json path) or a packaged name ("v4-pro", "v4-flash").
    ``fmt``: weight format when there is no checkpoint (:data:`FORMATS`, default ``nvfp4``).
    ``context``/``batch``/``kv_dtype``: decode state to hold. ``reserve``: bytes kept free per GPU
    (activations, workspace, CUDA context). ``dense``: component-kind patterns (e.g. ``["head",
    "router", "compressor.*"]``) whose quantised linears also get a BF16 dense copy (precision
    policy ``bf16`` caches one). ``check``: raise :class:`PlanError` when it does not fit;
    otherwise return the best plan with ``fits == False``.
    """
    check_int(context, "context", 1, "tokens of decode state per sequence")
    check_int(batch, "batch", 1, "sequences")
    config, reader, label = _resolve(config_or_path)
    if reader is not None:
        if fmt is not None:
            raise ValueError("fmt= applies only without a checkpoint (a checkpoint's headers say its format)")
        wb = weights_from_checkpoint(reader)
        if hasattr(reader, "close"):
            reader.close()
    else:
        wb = weights_from_config(config, fmt or "nvfp4")
    caps = _capacities(gpus, gpu_memory)
    p = _build(config, wb, label, caps, reserve, context, batch, kv_dtype, dense)
    if check and not p.fits:
        raise PlanError(refusal_message(p, fmt_given=fmt, has_checkpoint=reader is not None, reserve=reserve, dense=dense), p)
    return p


def refusal_message(p: MemoryPlan, fmt_given, has_checkpoint: bool, reserve, dense) -> str:
    hr = p.headroom()
    worst = hr.index(min(hr))
    usable = sum(c - r for c, r in zip(p.capacity, p.reserve))
    cap = min(p.capacity)
    L = [f"{p.label}: does not fit on {p.gpus} GPU(s) of {fmt_bytes(cap)}"
         + ("" if len(set(p.capacity)) == 1 else " (smallest)") + f" with context {p.context} x batch {p.batch}: "
         f"needs {fmt_bytes(p.total_bytes)} (weights {fmt_bytes(p.weight_bytes)}, decode state "
         f"{fmt_bytes(p.state_bytes)}) against {fmt_bytes(usable)} usable after a {fmt_bytes(p.reserve[0])} reserve "
         f"per GPU; the fullest GPU ({worst}) is {fmt_bytes(-hr[worst])} over."]
    loads = p.item_loads()
    biggest = max(loads)
    if biggest > cap - p.reserve[0]:
        L.append(f"  one layer alone needs {fmt_bytes(biggest)}, more than a GPU holds: no number of GPUs of "
                 "this size helps.")
    else:
        for g in range(p.gpus + 1, 257):
            _, r = place(loads, [cap - p.reserve[0]] * g)
            if r <= 1.0:
                L.append(f"  would fit: {g} GPUs of {fmt_bytes(cap)} (same context and format).")
                break
    # shorter context on the same GPUs
    def fits_ctx(ctx: int) -> bool:
        q = _build(p.config, p.weights, p.label, p.capacity, p.reserve, ctx, p.batch, p.kv_dtype, dense)
        return q.fits

    if p.context > 1:
        lo, hi = 0, p.context
        if fits_ctx(1):
            lo = 1
            while hi - lo > 1:
                mid = (lo + hi) // 2
                if fits_ctx(mid):
                    lo = mid
                else:
                    hi = mid
            L.append(f"  would fit: context <= {lo} tokens on these GPUs.")
        else:
            L.append("  a shorter context does not help: the weights alone do not fit these GPUs.")
    # other formats (from the config)
    cur = p.weight_source
    alts = []
    for f in FORMATS:
        if f == cur:
            continue
        q = _build(p.config, weights_from_config(p.config, f), p.label, p.capacity, p.reserve, p.context, p.batch,
                   p.kv_dtype, dense)
        alts.append(f"{f} ({fmt_bytes(q.weight_bytes)} weights: {'fits' if q.fits else 'does not fit'})")
    if alts:
        L.append("  other formats of this config: " + "; ".join(alts) + ".")
    L.append("  (or lower --reserve, now " + fmt_bytes(p.reserve[0]) + " per GPU, or use bigger GPUs)")
    return "\n".join(L)


__all__ = ["plan", "MemoryPlan", "PlanError", "FORMATS", "state_bytes", "weights_from_checkpoint",
           "weights_from_config", "place", "parse_bytes", "named_config"]


# ``dsv4lab.plan`` is this module (the package attribute a submodule import binds); make it
# callable so ``dsv4lab.plan(...)`` is the plan function too.
class _CallableModule(type(json)):
    def __call__(self, *args, **kwargs):
        return plan(*args, **kwargs)



sys.modules[__name__].__class__ = _CallableModule
