"""Taps: hooks that work under CUDA graphs.

A Python hook runs only while a graph is captured, so a hook that keeps a reference to the
tensor would keep the capture-time value forever. A tap instead copies the hook point's tensor
into its own buffer with ``copy_``: eagerly that is a copy per step, under a graph the copy is
recorded and every replay refreshes the buffer. Registering or removing a tap changes the
model's graph signature, so :class:`~dsv4lab.decode.graphs.GraphDecoder` recaptures.
"""
from __future__ import annotations

import torch


class Tap:
    def __init__(self, model, name: str) -> None:
        points = dict(model.hook_points())
        if name not in points:
            raise KeyError(f"no hook point {name!r}; see model.hook_names()")
        self.name = name
        self.buffer: torch.Tensor | None = None
        self.count = 0
        self._handle = points[name].register_forward_hook(self._hook)

    def _hook(self, module, inputs, output):
        if self.buffer is None or self.buffer.shape != output.shape or self.buffer.device != output.device:
            self.buffer = torch.empty_like(output)  # first (warm-up) call, before any capture
        self.buffer.copy_(output)
        self.count += 1

    def value(self) -> torch.Tensor:
        """A copy of the last value (the buffer itself is overwritten by the next step/replay)."""
        if self.buffer is None:
            raise RuntimeError(f"tap {self.name!r} has not fired yet")
        return self.buffer.clone()

    def remove(self) -> None:
        self._handle.remove()

    def __enter__(self) -> "Tap":
        return self

    def __exit__(self, *exc) -> None:
        self.remove()
