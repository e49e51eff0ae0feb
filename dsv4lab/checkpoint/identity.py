"""What a checkpoint IS, cheaply: its path plus a digest of its headers, never of its data.

A cache of results computed from a checkpoint (reference runs) must notice when the checkpoint
changed, but hashing 0.9 TB of shards is not an option. The digest covers what the headers and
the small JSON files say (every tensor's name, dtype, shape and offsets, each shard's size and
modification time, the safetensors index, config.json, hf_quant_config.json): a rewritten shard
changes its size or mtime, a re-exported checkpoint its headers.
"""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass

from .safetensors_index import scan_checkpoint

SMALL_FILES = ("config.json", "hf_quant_config.json")


@dataclass(frozen=True)
class CheckpointIdentity:
    path: str      # absolute checkpoint directory
    digest: str    # sha256 over headers, shard sizes / mtimes and the small JSON files

    def as_dict(self) -> dict:
        return {"path": self.path, "digest": self.digest}


def checkpoint_identity(path: str | os.PathLike) -> CheckpointIdentity:
    """The identity of the checkpoint at ``path`` (reads headers only: milliseconds per shard)."""
    index = scan_checkpoint(path)
    h = hashlib.sha256()
    for shard_path in sorted(index.shards):
        shard = index.shards[shard_path]
        st = os.stat(shard_path)
        h.update(json.dumps([os.path.relpath(shard_path, index.root), shard.file_size, st.st_mtime_ns,
                             shard.metadata], sort_keys=True).encode())
        for key in shard.keys:
            t = index.tensors.get(key)
            if t is not None and t.file == shard_path:
                h.update(json.dumps([key, t.dtype, list(t.shape), t.begin, t.end]).encode())
    for name in ([os.path.basename(index.index_file)] if index.index_file else []) + list(SMALL_FILES):
        f = os.path.join(index.root, name)
        if os.path.isfile(f):
            with open(f, "rb") as fh:
                h.update(name.encode() + b"\0" + fh.read())
    return CheckpointIdentity(os.path.abspath(index.root), h.hexdigest())


__all__ = ["CheckpointIdentity", "checkpoint_identity"]
