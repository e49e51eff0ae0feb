"""The base of every model part: counts the changes a captured CUDA graph depends on.

A CUDA graph bakes in the modules, their switches (flags, modes, kernels, weights) and the hooks
registered when it was captured. Comparing the whole model's signature before every replay costs
O(modules): 80 ms a step on a 61-layer V4-Pro-shaped model with 8 experts (measured on the H200:
graph replay 106.6 ms/token for 23.1 ms of kernels), about a second with 384 experts. Instead every
:class:`Component` bumps one process-wide counter when a public attribute is set on it (a flag, a
weight, a kernel slot, a child module: swaps) or a hook is registered on it or removed, and the
graph decoder compares the full signature only when the counter moved (plus, each step, the few
modules that are not components: the embedding, layer lists, a user's own implementations).
"""
from __future__ import annotations

from typing import Any

from torch import nn

# attributes a forward writes (results, statistics), not switches a captured graph bakes in
PER_RUN_ATTRIBUTES = frozenset({"aux_loss", "load_stats"})

_changes = 0


def changes() -> int:
    """How many graph-relevant changes every component in this process has seen so far."""
    return _changes


def note_change() -> None:
    global _changes
    _changes += 1


class _CountedHandle:
    """A hook's removal handle that also counts the removal (``with`` works as torch's does)."""

    def __init__(self, handle) -> None:
        self.handle = handle
        self.id = handle.id

    def remove(self) -> None:
        self.handle.remove()
        note_change()

    def __enter__(self) -> "_CountedHandle":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.remove()


class Component(nn.Module):
    """``nn.Module`` whose graph-relevant changes are counted (see the module docstring)."""

    def __setattr__(self, name: str, value: Any) -> None:
        super().__setattr__(name, value)
        if not name.startswith("_") and name not in PER_RUN_ATTRIBUTES:
            note_change()

    def __delattr__(self, name: str) -> None:
        super().__delattr__(name)
        note_change()

    def register_forward_hook(self, *args: Any, **kwargs: Any) -> _CountedHandle:
        handle = _CountedHandle(super().register_forward_hook(*args, **kwargs))
        note_change()
        return handle

    def register_forward_pre_hook(self, *args: Any, **kwargs: Any) -> _CountedHandle:
        handle = _CountedHandle(super().register_forward_pre_hook(*args, **kwargs))
        note_change()
        return handle
