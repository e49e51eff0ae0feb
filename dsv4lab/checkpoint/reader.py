"""Lazy, header-indexed reading of a DSV4 checkpoint in any layout and weight format.

>>> r = CheckpointReader("/ckpt/DeepSeek-V4-Pro-NVFP4")
>>> r.config.num_hidden_layers, r.quant_config.quant_algo
>>> w = r.weight("layers.3.mlp.experts.17.w1", device="cuda:0")   # NVFP4Weight, only its bytes read
>>> r.tensor("layers.3.attn.sink")                                   # plain parameter
>>> r.expected_vs_present().missing

Only headers are read on construction; each tensor access opens (and keeps, LRU) a
``safe_open`` handle on its shard and reads just that tensor (``get_slice`` for one expert of a
fused transformers tensor). Every access cross-checks shapes against the config.
"""
from __future__ import annotations

import fnmatch
import functools
import json
import os
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Iterable

import torch
from safetensors import safe_open

from ..config import load_config
from ..quant.weights import FP8BlockWeight, MXFP4Weight, NVFP4Weight, PlainWeight
from .errors import CheckpointError, DeviceUnavailableError
from .expected import expected_tensors
from .formats import FormatInfo, detect_format, shape_matches, stored_shapes
from .names import (
    FAST_EXPERT_RE,
    WEIGHT_SUFFIX_SET,
    NormKey,
    SliceSpec,
    layer_of,
    natural_key,
    normalize_key,
    split_name,
    to_raw_key,
)
from .safetensors_index import DTYPE_BITS, SafetensorsIndex, scan_checkpoint, torch_dtype

HF_QUANT_CONFIG = "hf_quant_config.json"
_FAST_LAYOUT = {(False, "ffn"): "official", (True, "ffn"): "transformers", (False, "mlp"): "canonical",
                (True, "mlp"): "modules"}


# ------------------------------------------------------------------------- quant config
@dataclass
class QuantConfig:
    """ModelOpt-style quantisation description (``hf_quant_config.json`` or config.json's
    ``quantization_config``). Module names are raw checkpoint module names (key minus ``.weight``)."""

    quant_algo: str | None = None
    group_size: int | None = None
    exclude_modules: list[str] = field(default_factory=list)
    quantized_layers: dict[str, dict] = field(default_factory=dict)
    producer: dict | None = None
    quant_method: str | None = None
    source: str = "<dict>"
    raw: dict = field(default_factory=dict)

    def is_excluded(self, module: str) -> bool:
        return any(fnmatch.fnmatchcase(module, p) for p in self.exclude_modules)

    def module_algo(self, module: str) -> str | None:
        """The algorithm the config claims for ``module`` (``None``: left unquantised)."""
        if module in self.quantized_layers:
            return self.quantized_layers[module].get("quant_algo", self.quant_algo)
        if self.quantized_layers:
            return None
        return None if self.is_excluded(module) else self.quant_algo

    def summary(self) -> dict[str, Any]:
        return {"source": self.source, "quant_method": self.quant_method, "quant_algo": self.quant_algo,
                "group_size": self.group_size, "n_exclude_patterns": len(self.exclude_modules),
                "n_quantized_layers": len(self.quantized_layers),
                "producer": self.producer}

    @classmethod
    def from_dict(cls, d: dict, source: str) -> "QuantConfig":
        if not isinstance(d, dict):
            raise CheckpointError(f"{source}: quantisation config is not a JSON object")
        q = d.get("quantization", d)
        if not isinstance(q, dict):
            raise CheckpointError(f"{source}: field 'quantization' is not a JSON object")
        algo = q.get("quant_algo")
        method = d.get("quant_method", q.get("quant_method"))
        if algo is None and method not in (None, "modelopt"):
            algo = str(method).upper()
        gs = q.get("group_size")
        if gs is None and isinstance(q.get("config_groups"), dict):
            gs = None
        excl = q.get("exclude_modules") or q.get("ignore") or []
        ql = q.get("quantized_layers") or {}
        if not isinstance(excl, list) or not isinstance(ql, dict):
            raise CheckpointError(f"{source}: 'exclude_modules' must be a list and 'quantized_layers' an object")
        return cls(quant_algo=algo, group_size=gs, exclude_modules=[str(x) for x in excl],
                   quantized_layers={str(k): dict(v) if isinstance(v, dict) else {"quant_algo": v}
                                     for k, v in ql.items()},
                   producer=d.get("producer"), quant_method=method, source=source, raw=d)


def read_quant_config(root: str) -> QuantConfig | None:
    """``hf_quant_config.json`` if present, else ``quantization_config`` of config.json, else None."""
    p = os.path.join(root, HF_QUANT_CONFIG)
    if os.path.exists(p):
        try:
            with open(p) as f:
                return QuantConfig.from_dict(json.load(f), p)
        except json.JSONDecodeError as e:
            raise CheckpointError(f"{p}: not valid JSON ({e})") from None
    p = os.path.join(root, "config.json")
    if os.path.exists(p):
        try:
            with open(p) as f:
                qc = json.load(f).get("quantization_config")
        except (json.JSONDecodeError, AttributeError):
            return None
        if qc:
            return QuantConfig.from_dict(qc, f"{p}: quantization_config")
    return None


# ------------------------------------------------------------------------------ entries
@dataclass(slots=True)
class Entry:
    """One canonical tensor: where it lives and what the header says about it."""

    name: str
    base: str
    suffix: str | None
    raw_key: str
    file: str
    dtype: str                      # safetensors dtype string
    shape: tuple[int, ...]          # stored shape (of the slice, for fused experts)
    layout: str
    slice: SliceSpec | None = None
    nbytes: int = 0                 # bytes of this tensor (of the slice, for fused experts)

    @property
    def torch_dtype(self):
        return torch_dtype(self.dtype)

    @property
    def where(self) -> str:
        sl = f" [{self.slice.index()}]" if self.slice else ""
        return f"{self.file}: tensor '{self.raw_key}'{sl}"


@dataclass
class Comparison:
    """Checkpoint contents against the tensors the config implies (logical names)."""

    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)          # canonical names not in the config
    unknown_keys: list[str] = field(default_factory=list)        # raw keys no layout knows
    ignored_keys: list[str] = field(default_factory=list)        # mtp.*, inv_freq
    mismatched: list[dict] = field(default_factory=list)         # name, file, tensor, expected, found
    bad_format: list[str] = field(default_factory=list)          # format detection errors

    @property
    def ok(self) -> bool:
        return not (self.missing or self.unexpected or self.unknown_keys or self.mismatched or self.bad_format)

    def as_dict(self) -> dict[str, Any]:
        return {"missing": self.missing, "unexpected": self.unexpected, "unknown_keys": self.unknown_keys,
                "ignored_keys": self.ignored_keys, "mismatched": self.mismatched, "bad_format": self.bad_format}


class CheckpointReader:
    """Header-indexed, lazily opened DSV4 checkpoint (directory, index json or one file).

    ``config``: a DSV4Config / dict / path to use instead of the checkpoint's config.json.
    ``strict``: raise :class:`CheckpointError` on structural problems (missing shard, truncated
    file, duplicate tensors); with ``strict=False`` they are collected in :attr:`problems`.
    """

    def __init__(self, path: str | os.PathLike, config: Any = None, strict: bool = True, max_open: int = 4):
        self.path = os.path.abspath(os.fspath(path))
        self.index: SafetensorsIndex = scan_checkpoint(self.path, strict=strict)
        self.root = self.index.root
        self.strict = strict
        self.problems: list[str] = list(self.index.problems)
        if config is not None:
            self.config = load_config(config)
        elif os.path.exists(os.path.join(self.root, "config.json")):
            self.config = load_config(self.root)
        else:
            self.config = None
        self.quant_config: QuantConfig | None = read_quant_config(self.root)
        self.entries: dict[str, Entry] = {}
        self.groups: dict[str, dict[str, Entry]] = {}      # base -> {suffix: entry}; bare params: {None: e}
        self.ignored_keys: list[str] = []
        self.unknown_keys: list[str] = []
        self.layouts: dict[str, int] = {}
        fast = FAST_EXPERT_RE.match
        entries, groups = self.entries, self.groups
        fast_layouts: dict[str, int] = {}
        for key, info in self.index.tensors.items():
            m = fast(key)  # fast path for the bulk (per-expert linears); same result as normalize_key
            if m is not None:
                pre, layer, ffn, ex, w, suffix = m.groups()
                if suffix in WEIGHT_SUFFIX_SET:
                    base = "layers." + layer + ".mlp.experts." + ex + "." + w
                    name = base + "." + suffix
                    if name not in entries:
                        lay = _FAST_LAYOUT[(pre is not None, ffn)]
                        e = Entry(name, base, suffix, key, info.file, info.dtype, info.shape, lay, None,
                                  info.end - info.begin)
                        entries[name] = e
                        g = groups.get(base)
                        if g is None:
                            groups[base] = g = {}
                        g[suffix] = e
                        fast_layouts[lay] = fast_layouts.get(lay, 0) + 1
                        continue
            nks = normalize_key(key, info.shape)
            if nks is None:
                self.unknown_keys.append(key)
                continue
            if not nks:
                self.ignored_keys.append(key)
                continue
            for nk in nks:
                self._add(nk, info)
        for lay, n in fast_layouts.items():
            self.layouts[lay] = self.layouts.get(lay, 0) + n
        self._expected = None
        self._formats: dict[str, FormatInfo] = {}
        self._by_sig: dict[tuple, FormatInfo] = {}
        self._handles: OrderedDict = OrderedDict()
        self._max_open = max(1, int(max_open))

    def _add(self, nk: NormKey, info) -> None:
        if nk.slice is None:
            shape, nbytes = info.shape, info.end - info.begin
        else:
            shape = nk.slice.shape(info.shape)
            nbytes = DTYPE_BITS.get(info.dtype, 0)
            for s in shape:
                nbytes *= s
            nbytes //= 8
        e = Entry(nk.name, nk.base, nk.suffix, info.key, info.file, info.dtype, shape, nk.layout, nk.slice, nbytes)
        old = self.entries.get(nk.name)
        if old is not None:
            msg = (f"{info.file}: tensor '{info.key}' and {old.file}: tensor '{old.raw_key}' "
                   f"both hold '{nk.name}'")
            if self.strict:
                raise CheckpointError(msg)
            self.problems.append(msg)
            return
        self.entries[nk.name] = e
        self.groups.setdefault(nk.base, {})[nk.suffix] = e
        self.layouts[nk.layout] = self.layouts.get(nk.layout, 0) + 1

    # ----------------------------------------------------------------------- metadata
    @property
    def expected(self) -> dict:
        """expected_tensors(config) (cached); CheckpointError without a config."""
        if self._expected is None:
            if self.config is None:
                raise CheckpointError(f"{self.root}: no config.json (pass config=...) to compare against")
            self._expected = expected_tensors(self.config)
        return self._expected

    @property
    def layout(self) -> str:
        """Raw layout all keys agree on ("official", "transformers", "modules", "canonical"),
        "mixed" if none fits every key, "empty" without tensors. Judged from all non-expert
        tensors and expert 0 of each layer."""
        valid = {"official", "transformers", "modules", "canonical"}
        seen = False
        for e in self.entries.values():
            if ".mlp.experts." in e.name and ".mlp.experts.0." not in e.name:
                continue
            seen = True
            ok = set()
            for lay in valid:
                if lay == "modules" and e.slice is not None:
                    ok.add(lay)
                    continue
                try:
                    if to_raw_key(e.name, lay) == e.raw_key:
                        ok.add(lay)
                except KeyError:
                    pass
            valid &= ok
            if not valid:
                return "mixed"
        if not seen:
            return "empty"
        for lay in ("official", "transformers", "modules", "canonical"):
            if lay in valid:
                return lay
        return "mixed"  # pragma: no cover

    def bases(self, layer: int | None | str = "all") -> list[str]:
        """Logical tensor names present: ``X`` for a linear/norm ``X.weight`` group, the full name
        for bare parameters. ``layer``: "all", ``None`` (global tensors only) or an index."""
        out = []
        for base, parts in self.groups.items():
            if layer != "all" and layer_of(base) != layer:
                continue
            out.append(base)
        return out

    def logical_name(self, base: str) -> str:
        return base if None in self.groups.get(base, {}) else base + ".weight"

    def _where(self, base: str) -> str:
        parts = self.groups.get(base)
        if parts:
            e = parts.get("weight") or next(iter(parts.values()))
            return e.where
        return f"{self.root}: tensor '{base}'"

    def format_of(self, base: str) -> FormatInfo:
        """Format of ``base``'s weight from header facts; CheckpointError if unknown."""
        base = base[:-len(".weight")] if base.endswith(".weight") else base
        fi = self._formats.get(base)
        if fi is None:
            parts = self.groups.get(base)
            if not parts:
                raise CheckpointError(f"{self.root}: tensor '{base}.weight' is not in the checkpoint")
            if None in parts:
                e = parts[None]
                fi = FormatInfo("plain", e.shape, {})
            else:
                sig = tuple((s, e.dtype, e.shape) for s, e in parts.items())
                fi = self._by_sig.get(sig)
                if fi is None:
                    try:
                        fi = detect_format({s: (d, sh) for s, d, sh in sig}, where=self._where(base))
                    except CheckpointError:
                        raise
                    self._by_sig[sig] = fi
            self._formats[base] = fi
        return fi

    def shape_problems(self, base: str) -> list[dict]:
        """Stored-shape mismatches of one logical tensor against the config (and its own format)."""
        fi = self.format_of(base)
        parts = self.groups[base]
        probs = []
        if None in parts:
            e = parts[None]
            exp = self.expected.get(base) if self.config is not None else None
            if exp is not None and tuple(e.shape) != exp.shape:
                probs.append({"name": base, "file": e.file, "tensor": e.raw_key,
                              "expected": list(exp.shape), "found": list(e.shape)})
            return probs
        logical = fi.logical_shape
        exp = self.expected.get(base + ".weight") if self.config is not None else None
        if exp is not None:
            logical = exp.shape
        want = _stored_shapes(fi.format, logical, fi.fp4_elements) if len(logical) == 2 or fi.format == "plain" else {}
        for role, suffix in fi.roles.items():
            e = parts[suffix]
            w = want.get(role)
            if w is not None and w != e.shape and not shape_matches(w, e.shape):
                probs.append({"name": e.name, "file": e.file, "tensor": e.raw_key, "format": fi.format,
                              "expected": list(w), "found": list(e.shape)})
        return probs

    def _check(self, base: str) -> FormatInfo:
        fi = self.format_of(base)
        probs = self.shape_problems(base)
        if probs:
            p = probs[0]
            fmt = f" ({p['format']})" if p.get("format") else ""
            raise CheckpointError(f"{p['file']}: tensor '{p['tensor']}'{fmt}: shape {p['found']} but the config "
                                  f"({getattr(self.config, 'source', 'header')}) implies {p['expected']}")
        return fi

    # ------------------------------------------------------------------------ reading
    def _handle(self, file: str, device: str):
        key = (file, device)
        h = self._handles.get(key)
        if h is not None:
            self._handles.move_to_end(key)
            return h
        try:
            h = safe_open(file, framework="pt", device=device)
        except Exception as e:  # noqa: BLE001 - report with the file named
            raise CheckpointError(f"{file}: cannot open ({e})") from None
        self._handles[key] = h
        while len(self._handles) > self._max_open:
            self._handles.popitem(last=False)
        return h

    def _load(self, e: Entry, device="cpu"):
        dev = f"cuda:{device}" if isinstance(device, int) else str(device)
        if torch.device(dev).type == "cpu":
            dev = "cpu"  # safetensors takes no index on the CPU; "cpu:1" marks a device-map entry (tests)
        if torch.device(dev).type == "cuda" and not torch.cuda.is_available():
            # safetensors pins host memory for a CUDA read, which fails without CUDA: say so, not "cannot read"
            raise DeviceUnavailableError(f"device={dev!r}: CUDA is not available on this machine, so no tensor "
                                         f"can be read to it (read with device='cpu')")
        h = self._handle(e.file, dev)
        try:
            if e.slice is not None:
                t = h.get_slice(e.raw_key)[e.slice.index()]
            else:
                t = h.get_tensor(e.raw_key)
        except Exception as ex:  # noqa: BLE001
            raise CheckpointError(f"{e.where}: cannot read ({ex})") from None
        want = tuple(e.shape)
        if e.dtype == "F4" and want:  # the header counts FP4 elements, torch two per byte
            want = want[:-1] + (want[-1] // 2,)
        if tuple(t.shape) != want:
            raise CheckpointError(f"{e.where}: read shape {tuple(t.shape)} but header says {e.shape}")
        return t

    def weight(self, name: str, device="cpu"):
        """QuantWeight (Plain/NVFP4/MXFP4/FP8Block) of a 2-D linear, e.g. ``layers.0.attn.wq_a``."""
        base = name[:-len(".weight")] if name.endswith(".weight") else name
        parts = self.groups.get(base)
        if not parts or "weight" not in parts and None not in parts:
            have = "" if not parts else f" (only {sorted(str(s) for s in parts)})"
            raise CheckpointError(f"{self.root}: tensor '{base}.weight' is not in the checkpoint{have}")
        if None in parts:
            raise CheckpointError(f"{parts[None].where}: '{base}' is a parameter, not a linear; use tensor()")
        fi = self._check(base)
        if len(fi.logical_shape) != 2:
            raise CheckpointError(f"{parts['weight'].where}: '{base}.weight' has shape {list(fi.logical_shape)}, "
                                  "not a 2-D linear weight; use tensor()")
        t = {role: self._load(parts[suffix], device) for role, suffix in fi.roles.items()}
        try:
            if fi.format == "plain":
                return PlainWeight(t["weight"])
            if fi.format == "nvfp4":
                return NVFP4Weight(t["weight"], t["weight_scale"], t["weight_scale_2"], t.get("input_scale"))
            if fi.format == "mxfp4":
                return MXFP4Weight(t["weight"], t["scale"])
            if fi.format == "fp8_block":
                return FP8BlockWeight(t["weight"], t["scale"])
        except (ValueError, TypeError) as ex:
            raise CheckpointError(f"{parts['weight'].where} ({fi.format}): {ex}") from None
        raise CheckpointError(f"{parts['weight'].where}: unsupported format {fi.format}")  # pragma: no cover

    def tensor(self, name: str, device="cpu"):
        """A plain tensor by canonical name (norm weights, sink, ape, router bias/tid2eid, mHC params).

        For the ``.weight`` of a quantised linear use :meth:`weight`; its raw stored tensors are
        reachable as ``tensor("X.weight_scale")`` etc.
        """
        e = self.entries.get(name)
        if e is None:
            raise CheckpointError(f"{self.root}: tensor '{name}' is not in the checkpoint")
        base, suffix = split_name(name)
        if suffix is None or suffix == "weight":
            self._check(base)
        return self._load(e, device)

    def load_layer(self, layer: int | None, device="cpu") -> dict[str, Any]:
        """All logical tensors of one layer (``None``: embed/head/norm/hc_head): 2-D ``.weight``
        groups as QuantWeight under ``X.weight``, everything else as tensors."""
        out: dict[str, Any] = {}
        for base in self.bases(layer):
            parts = self.groups[base]
            if None in parts:
                out[base] = self.tensor(base, device)
            elif "weight" in parts and len(self.format_of(base).logical_shape) == 2:
                out[base + ".weight"] = self.weight(base, device)
            else:
                out[base + ".weight"] = self.tensor(base + ".weight", device)
        return out

    # ----------------------------------------------------------------------- checking
    def expected_vs_present(self) -> Comparison:
        """Missing / unexpected / shape-mismatched tensors against the config (headers only)."""
        exp = self.expected
        cmp = Comparison(unknown_keys=sorted(self.unknown_keys), ignored_keys=sorted(self.ignored_keys))
        present = set()
        for base in self.groups:
            name = self.logical_name(base)
            present.add(name)
            if name not in exp:
                if not (name == "head.weight" and self.config.tie_word_embeddings):
                    cmp.unexpected.append(name)
                continue
            try:
                cmp.mismatched.extend(self.shape_problems(base))
            except CheckpointError as e:
                cmp.bad_format.append(str(e))
        cmp.missing = [n for n in exp if n not in present]
        cmp.unexpected.sort(key=natural_key)
        return cmp

    def check(self, limit: int = 10) -> Comparison:
        """:meth:`expected_vs_present`, raising :class:`CheckpointError` unless everything matches."""
        cmp = self.expected_vs_present()
        if cmp.ok:
            return cmp
        src = self.config.source
        lines = []
        for m in cmp.mismatched[:limit]:
            lines.append(f"{m['file']}: tensor '{m['tensor']}': shape {m['found']}, config {src} implies "
                         f"{m['expected']}")
        for n in cmp.missing[:limit]:
            lines.append(f"{self.root}: tensor '{n}' is missing (config {src} expects {list(self.expected[n].shape)})")
        for n in cmp.unexpected[:limit]:
            lines.append(f"{self._where(split_name(n)[0] if n.endswith('.weight') else n)}: unexpected tensor "
                         f"'{n}' (not implied by config {src})")
        for k in cmp.unknown_keys[:limit]:
            info = self.index.tensors[k]
            lines.append(f"{info.file}: tensor '{k}': unknown key")
        lines.extend(cmp.bad_format[:limit])
        n = len(cmp.mismatched) + len(cmp.missing) + len(cmp.unexpected) + len(cmp.unknown_keys) + len(cmp.bad_format)
        raise CheckpointError(f"checkpoint {self.root} does not match its config ({n} problems):\n  "
                              + "\n  ".join(lines))

    # -------------------------------------------------------------------------- misc
    def close(self) -> None:
        self._handles.clear()

    def __enter__(self) -> "CheckpointReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"CheckpointReader({self.root!r}, {len(self.index.shards)} shards, {len(self.entries)} tensors, "
                f"layout={self.layout})")


@functools.lru_cache(maxsize=4096)
def _stored_shapes(fmt: str, logical: tuple[int, ...], fp4_elements: bool = False) -> dict[str, tuple[int, ...]]:
    return stored_shapes(fmt, logical, fp4_elements)


def iter_sorted(names: Iterable[str]) -> list[str]:
    return sorted(names, key=natural_key)
