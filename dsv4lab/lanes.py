"""Decode lanes: a second CUDA stream per device that a decode layer forks independent work onto.

Why: at batch 1 a V4-Pro decode layer is a chain of ~22 small launches, each waiting for the one
before it. Part of the attention's chain does not depend on the rest: the compressors' step
(their BF16 projections, the window pooling) reads only the attention input x, and the
indexer's selection reads x and the latent query q_res, never the queries that the largest
GEMV (wq_b) makes. On a side lane they run beside wq_a / wkv -> norm -> wq_b; the decode
attention joins both lanes. In a captured CUDA graph the fork and the join are graph edges; eager
decode gets the same overlap.

Kernels keep their internal buffers per lane (``kernels.common.scratch``, ``counters`` and the
kept x-pairs buffers key on ``current_lane()``), because two lanes' launches run at the same
time. Off the GPU a ``Fork`` only switches the lane (no streams): the CPU tests run the same
order of calls and the same per-lane buffers.

``DSV4LAB_DECODE_LANES=1`` (read at import) or ``set_decode_lanes(True)`` turns them on.
"""
from __future__ import annotations

import contextlib
import os
from typing import Iterator

import torch

MAIN, SIDE = 0, 1
_enabled = os.environ.get("DSV4LAB_DECODE_LANES", "0") == "1"
_lane = MAIN
_SIDE_STREAMS: dict = {}  # device index -> the side lane's stream (kept: graphs captured over it)


def set_decode_lanes(enabled: bool) -> bool:
    """Switch decode lanes on or off for this process; returns the previous setting. A captured
    decode graph keeps what it captured (``GraphDecoder`` recaptures on a model change only)."""
    global _enabled
    prev = _enabled
    _enabled = bool(enabled)
    return prev


def decode_lanes_enabled() -> bool:
    return _enabled


def current_lane() -> int:
    """The lane whose buffers the launches issued now use (``MAIN`` outside a ``Fork.side``)."""
    return _lane


def side_stream(device: torch.device) -> torch.cuda.Stream:
    """The side lane's stream on a CUDA ``device`` (one per device, made on first use)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    s = _SIDE_STREAMS.get(index)
    if s is None:
        s = _SIDE_STREAMS[index] = torch.cuda.Stream(device=index)
    return s


class Fork:
    """Work forked from the current stream of ``device`` at construction: ``with fork.side():``
    issues onto the side lane (after everything issued on the main stream before the fork, or
    before the ``side(after_main=True)`` call), ``join()`` makes the main stream wait for it all.
    Call ``join()`` before anything on the main stream reads what the side lane wrote."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        if self.cuda:
            self.main = torch.cuda.current_stream(device)
            self.stream = side_stream(device)
            self.stream.wait_stream(self.main)
        self.joined = False

    @contextlib.contextmanager
    def side(self, after_main: bool = False) -> Iterator[None]:
        """Issue onto the side lane; ``after_main``: first wait for what the main stream has now."""
        global _lane
        if self.joined:
            raise RuntimeError("Fork.side after join(): make a new Fork")
        prev = _lane
        if self.cuda and after_main:
            self.stream.wait_stream(self.main)
        _lane = SIDE
        try:
            if self.cuda:
                with torch.cuda.stream(self.stream):
                    yield
            else:
                yield
        finally:
            _lane = prev

    def join(self) -> None:
        """The main stream waits for everything issued on the side lane so far."""
        if self.cuda and not self.joined:
            self.main.wait_stream(self.stream)
        self.joined = True
