"""Header-only view of a safetensors checkpoint (one file, a directory, or an index json).

A safetensors file is ``u64 little-endian header length`` + ``JSON header`` + data. Only the
headers are read here, so a 0.9 TB / 60-shard checkpoint is indexed in well under a second per
shard. Truncated files (header or a tensor's data past the end of the file), shards the index
names but that are missing, and keys the index maps to a shard that lacks them are reported with
the file and the tensor named: raised as :class:`CheckpointError` when ``strict``, else collected
in :attr:`SafetensorsIndex.problems`.
"""
from __future__ import annotations

import glob
import json
import math
import os
import struct
from dataclasses import dataclass, field

import torch

from .errors import CheckpointError

INDEX_NAME = "model.safetensors.index.json"

# bits per element of each safetensors dtype string
DTYPE_BITS = {
    "F64": 64, "F32": 32, "F16": 16, "BF16": 16, "I64": 64, "I32": 32, "I16": 16, "I8": 8, "U8": 8,
    "U16": 16, "U32": 32, "U64": 64, "BOOL": 8, "C64": 64, "F8_E4M3": 8, "F8_E5M2": 8,
    "F8_E4M3FNUZ": 8, "F8_E5M2FNUZ": 8, "F8_E8M0": 8, "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6,
}
_TORCH_NAMES = {
    "F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64",
    "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "U16": "uint16", "U32": "uint32",
    "U64": "uint64", "BOOL": "bool", "C64": "complex64", "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2", "F8_E4M3FNUZ": "float8_e4m3fnuz", "F8_E5M2FNUZ": "float8_e5m2fnuz",
    "F8_E8M0": "float8_e8m0fnu", "F4": "float4_e2m1fn_x2",
}
FLOAT_DTYPES = frozenset({"F64", "F32", "F16", "BF16"})


def torch_dtype(st_dtype: str):
    """torch dtype of a safetensors dtype string (``None`` if this torch lacks it)."""
    name = _TORCH_NAMES.get(st_dtype)
    return getattr(torch, name, None) if name else None


def st_dtype_of(dtype) -> str:
    """safetensors dtype string of a torch dtype."""
    name = str(dtype).replace("torch.", "")
    for k, v in _TORCH_NAMES.items():
        if v == name:
            return k
    raise KeyError(f"no safetensors dtype for {dtype}")


def nbytes_of(st_dtype: str, shape) -> int:
    return math.prod(int(s) for s in shape) * DTYPE_BITS[st_dtype] // 8


@dataclass(slots=True)
class TensorInfo:
    """One tensor as the header describes it; ``begin``/``end`` are absolute file offsets."""

    key: str
    dtype: str          # safetensors dtype string, e.g. "BF16", "U8", "F8_E4M3"
    shape: tuple[int, ...]
    file: str
    begin: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


@dataclass
class ShardInfo:
    path: str
    file_size: int
    header_len: int
    metadata: dict
    keys: list[str] = field(default_factory=list)

    @property
    def data_start(self) -> int:
        return 8 + self.header_len


@dataclass
class SafetensorsIndex:
    root: str                                   # directory of the checkpoint
    index_file: str | None                      # model.safetensors.index.json, if any
    shards: dict[str, ShardInfo]                # absolute path -> header info
    tensors: dict[str, TensorInfo]              # raw key -> info
    problems: list[str] = field(default_factory=list)
    index_metadata: dict = field(default_factory=dict)

    @property
    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())


def _problem(strict: bool, problems: list[str], msg: str) -> None:
    if strict:
        raise CheckpointError(msg)
    problems.append(msg)


def read_header(path: str, strict: bool = True, problems: list[str] | None = None
                ) -> tuple[ShardInfo, dict[str, TensorInfo]]:
    """Read one safetensors file's header (never its data)."""
    problems = [] if problems is None else problems
    path = os.path.abspath(path)
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise CheckpointError(f"{path}: truncated safetensors file ({size} bytes, no header length)")
            (n,) = struct.unpack("<Q", head)
            if 8 + n > size:
                raise CheckpointError(f"{path}: truncated safetensors file: header says {n} bytes but the "
                                      f"file has only {size - 8} after the length field")
            raw = f.read(n)
    except FileNotFoundError:
        raise CheckpointError(f"{path}: file not found") from None
    try:
        header = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: safetensors header is not valid JSON ({e})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: safetensors header is not a JSON object")
    meta = header.pop("__metadata__", None) or {}
    shard = ShardInfo(path=path, file_size=size, header_len=n, metadata=meta)
    start = 8 + n
    out: dict[str, TensorInfo] = {}
    bits = DTYPE_BITS
    keys = shard.keys
    for key, d in header.items():
        try:
            dtype, shape, (b, e) = d["dtype"], tuple(d["shape"]), d["data_offsets"]
            b, e = start + b, start + e
        except (KeyError, TypeError, ValueError):
            _problem(strict, problems, f"{path}: tensor '{key}': malformed header entry {d!r}")
            continue
        info = TensorInfo(key, dtype, shape, path, b, e)
        if e > size:
            _problem(strict, problems, f"{path}: truncated file: tensor '{key}' data ends at byte {e} "
                                       f"but the file has {size} bytes")
        nb = bits.get(dtype)
        if nb is None:
            _problem(strict, problems, f"{path}: tensor '{key}': unknown dtype {dtype!r}")
        else:
            n = nb
            for s in shape:
                n *= s
            if n // 8 != e - b:
                _problem(strict, problems, f"{path}: tensor '{key}': {dtype}{list(shape)} needs "
                                           f"{n // 8} bytes but data_offsets span {e - b}")
        out[key] = info
        keys.append(key)
    return shard, out


def scan_checkpoint(path: str | os.PathLike, strict: bool = True) -> SafetensorsIndex:
    """Index a checkpoint directory, an index json, or a single ``.safetensors`` file."""
    p = os.path.abspath(os.fspath(path))
    problems: list[str] = []
    index_file = None
    if os.path.isdir(p):
        root = p
        if os.path.exists(os.path.join(p, INDEX_NAME)):
            index_file = os.path.join(p, INDEX_NAME)
    elif p.endswith(".json"):
        root, index_file = os.path.dirname(p), p
    elif os.path.isfile(p):
        root = os.path.dirname(p)
    else:
        raise CheckpointError(f"{p}: no such checkpoint file or directory")

    shards: dict[str, ShardInfo] = {}
    tensors: dict[str, TensorInfo] = {}
    index_meta: dict = {}

    def add(shard_path: str) -> dict[str, TensorInfo] | None:
        try:
            shard, ts = read_header(shard_path, strict, problems)
        except CheckpointError as e:
            if strict:
                raise
            problems.append(str(e))
            return None
        shards[shard.path] = shard
        for k, t in ts.items():
            if k in tensors:
                _problem(strict, problems, f"{shard.path}: tensor '{k}' also in {tensors[k].file}")
                continue
            tensors[k] = t
        return ts

    if index_file is not None:
        try:
            with open(index_file) as f:
                idx = json.load(f)
            weight_map = idx["weight_map"]
        except (OSError, json.JSONDecodeError, KeyError, TypeError) as e:
            raise CheckpointError(f"{index_file}: not a safetensors index ({e!r})") from None
        index_meta = idx.get("metadata") or {}
        by_shard: dict[str, list[str]] = {}
        for key, fname in weight_map.items():
            by_shard.setdefault(fname, []).append(key)
        for fname, keys in by_shard.items():
            sp = os.path.join(root, fname)
            if not os.path.exists(sp):
                _problem(strict, problems, f"{sp}: shard named in {index_file} is missing "
                                           f"({len(keys)} tensors, e.g. '{keys[0]}')")
                continue
            ts = add(sp)
            if ts is None:
                continue
            for key in keys:
                if key not in ts:
                    _problem(strict, problems, f"{sp}: tensor '{key}' is mapped to this shard by "
                                               f"{index_file} but the shard does not contain it")
    elif os.path.isdir(p):
        files = sorted(glob.glob(os.path.join(p, "*.safetensors")))
        if not files:
            raise CheckpointError(f"{p}: no *.safetensors files and no {INDEX_NAME}")
        for sp in files:
            add(sp)
    else:
        add(p)
    return SafetensorsIndex(root=root, index_file=index_file, shards=shards, tensors=tensors,
                            problems=problems, index_metadata=index_meta)
