"""Checkpoint I/O: key normalisation, header-only indexing, lazy reading, writing, inspection.

Every raw layout (official DeepSeek, transformers ``save_pretrained``, transformers module
layout) is normalised to the canonical names of docs/naming.md. Nothing here reads tensor data
unless asked for one tensor (:meth:`CheckpointReader.weight` / :meth:`CheckpointReader.tensor`).
"""
from __future__ import annotations

from .errors import CheckpointError, DeviceUnavailableError
from .expected import expected_tensors
from .inspect import inspect_checkpoint, render_inspect
from .names import component_kind, layer_of, normalize_key
from .reader import CheckpointReader
from .safetensors_index import scan_checkpoint
from .writer import save_checkpoint

__all__ = [
    "CheckpointError", "DeviceUnavailableError", "CheckpointReader", "save_checkpoint", "inspect_checkpoint", "render_inspect",
    "expected_tensors", "normalize_key", "component_kind", "layer_of", "scan_checkpoint",
]
