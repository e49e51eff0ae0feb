"""Checkpoint I/O: key normalisation, header-only indexing, lazy reading, writing, inspection.

Every raw layout (official DeepSeek, transformers ``save_pretrained``, transformers module
layout) is normalised to the canonical names of docs/naming.md. Nothing here reads tensor data
unless asked for one tensor (:meth:`CheckpointReader.weight` / :meth:`CheckpointReader.tensor`).
"""
from __future__ import annotations


class CheckpointError(ValueError):
    """A checkpoint that cannot be read as asked; the message names the file and the tensor."""


__all__ = [
    "CheckpointError", "CheckpointReader", "save_checkpoint", "inspect_checkpoint", "render_inspect",
    "expected_tensors", "normalize_key", "component_kind", "layer_of", "scan_checkpoint",
]


def __getattr__(name):  # lazy: importing the package stays cheap and cycle-free
    if name == "CheckpointReader":
        from .reader import CheckpointReader
        return CheckpointReader
    if name == "save_checkpoint":
        from .writer import save_checkpoint
        return save_checkpoint
    if name in ("inspect_checkpoint", "render_inspect"):
        from . import inspect as _inspect
        return getattr(_inspect, name)
    if name == "expected_tensors":
        from .expected import expected_tensors
        return expected_tensors
    if name in ("normalize_key", "component_kind", "layer_of"):
        from . import names
        return getattr(names, name)
    if name == "scan_checkpoint":
        from .safetensors_index import scan_checkpoint
        return scan_checkpoint
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
