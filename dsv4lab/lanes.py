"""Decode lanes: a second CUDA stream per device that a decode layer forks independent work onto.

Why: at batch 1 a V4-Pro decode layer is a chain of ~22 small launches, each waiting for the one
before it. Part of the attention's chain does not depend on the rest: the compressors' step
(their BF16 projections, the window pooling) reads only the attention input x, and the
indexer's selection reads x and the latent query q_res, never the queries that the largest
GEMV (wq_b) makes. On a side lane they run beside wq_a / wkv -> norm -> wq_b; the decode
attention joins both lanes. In a captured CUDA graph the fork and the join are graph edges.

Kernels keep their internal buffers per lane (``kernels.host.scratch``, ``counters`` and the
kept x-pairs buffers key on ``current_lane()``), because two lanes' launches run at the same
time. Off the GPU a ``Fork`` only switches the lane (no streams): the CPU tests run the same
order of calls and the same per-lane buffers.

Modes (``DSV4LAB_DECODE_LANES``, read at import, or ``set_decode_lanes``): "graph" (default) forks
only inside ``capturing()``, which the graph decoders hold around their warm-up and capture:
captured decode gains (H100, full depth V4-Pro-shaped: 17.48 -> 16.78 ms a token, the same 1376
kernels; docs/benchmarks_journal.md "Stop 52"), while eager decode, host-bound and where hooks fire, keeps
one stream and its exact order of launches. "all" forks in eager decode too (tests, A/B runs);
"off" never forks.
"""
from __future__ import annotations

import contextlib
import os
from typing import Iterator

import torch

MAIN, SIDE = 0, 1
MODES = ("off", "graph", "all")


def _checked(mode: str, argument: str) -> str:
    if mode not in MODES:
        raise ValueError(f"{argument} must be one of {MODES} (decode lanes: never, in captured graphs only, "
                         f"also in eager decode); got {mode!r}")
    return mode


_mode = _checked(os.environ.get("DSV4LAB_DECODE_LANES", "graph"), "DSV4LAB_DECODE_LANES")
_capturing = 0  # depth of ``capturing()`` blocks
_current_device = getattr(torch._C, "_cuda_getDevice", torch.cuda.current_device)  # the fast getter where built
_lane = MAIN
_SIDE_STREAMS: dict = {}  # device index -> (the side lane's stream, to-side event, to-main event), kept
_open: "Fork | None" = None  # the fork whose side lane may still run (made, not yet joined)
_main_writes = 0  # kept-buffer writes issued on the main lane so far (``note_main_write``)


def set_decode_lanes(mode: str) -> str:
    """Set the decode lanes' mode for this process ("off", "graph", "all": see the module
    docstring); returns the previous one. A captured decode graph keeps what it captured."""
    global _mode
    prev, _mode = _mode, _checked(mode, "set_decode_lanes(mode)")
    return prev


def decode_lanes_mode() -> str:
    return _mode


def forks_now() -> bool:
    """Does a decode layer fork onto lanes now? ("all"; "graph" inside ``capturing()``.)"""
    return _mode == "all" or (_mode == "graph" and _capturing > 0)


@contextlib.contextmanager
def capturing() -> Iterator[None]:
    """Held by a graph decoder around the eager warm-up and the capture of its decode step, so
    that in "graph" mode both take the lanes (the warm-up makes the side lane's kept buffers
    outside the capture, where a first allocation would be captured with its zero fill)."""
    global _capturing
    _capturing += 1
    try:
        yield
    finally:
        _capturing -= 1


def current_lane() -> int:
    """The lane whose buffers the launches issued now use (``MAIN`` outside a ``Fork.side``)."""
    return _lane


def _side(device: torch.device) -> tuple:
    """(side stream, to-side event, to-main event) of a CUDA device. The events are reused: a wait
    takes the event's latest record, so one per direction does (``Stream.wait_stream`` would
    create an event per call, host time on every eager step)."""
    index = device.index if device.index is not None else _current_device()
    s = _SIDE_STREAMS.get(index)
    if s is None:
        s = _SIDE_STREAMS[index] = (torch.cuda.Stream(device=index), torch.cuda.Event(), torch.cuda.Event())
    return s


class Fork:
    """Work forked from the current stream of ``device`` at construction: ``with fork.side():``
    issues onto the side lane (after everything issued on the main stream before the fork, or
    before the ``side(after_main=True)`` call), ``join()`` makes the main stream wait for it all.
    Call ``join()`` before anything on the main stream reads what the side lane wrote."""

    def __init__(self, device: torch.device):
        global _open
        self.cuda = device.type == "cuda"
        if self.cuda:
            self.main = torch.cuda.current_stream(device)
            self.stream, self.to_side, self.to_main = _side(device)
            self._side_waits()
        self.joined = False
        self.borrowed: set = set()  # main-lane buffers the side lane reads (``borrow``)
        self.synced = _main_writes  # the main-lane writes the side lane has waited for
        _open = self

    @contextlib.contextmanager
    def side(self, after_main: bool = False) -> Iterator[None]:
        """Issue onto the side lane; ``after_main``: first wait for what the main stream has now."""
        global _lane
        if self.joined:
            raise RuntimeError("Fork.side after join(): make a new Fork")
        prev = _lane
        if after_main:
            self._wait_main()
        if self.cuda:
            device = _current_device()
            torch.cuda.set_stream(self.stream)  # also makes the stream's device current
        _lane = SIDE
        try:
            yield
        finally:
            _lane = prev
            if self.cuda:
                torch.cuda.set_stream(self.main)
                if device != self.main.device_index:  # a layer on another GPU than the current one
                    torch.cuda.set_device(device)

    def _side_waits(self) -> None:
        self.to_side.record(self.main)
        self.stream.wait_event(self.to_side)

    def _main_waits(self) -> None:
        self.to_main.record(self.stream)
        self.main.wait_event(self.to_main)

    def _wait_main(self) -> None:
        if self.cuda:
            self._side_waits()
        self.synced = _main_writes

    def join(self) -> None:
        """The main stream waits for everything issued on the side lane so far."""
        global _open
        if self.cuda and not self.joined:
            self._main_waits()
        self.joined = True
        self.borrowed.clear()
        if _open is self:
            _open = None


def note_main_write() -> int:
    """Count a kept-buffer write issued on the main lane; returns its number (for ``borrow``)."""
    global _main_writes
    _main_writes += 1
    return _main_writes


def borrow(key: object, written: int) -> None:
    """The side lane is about to read a main-lane buffer named ``key``, last written by the main
    lane's write number ``written``: the side lane first waits for the main stream if it has not
    since that write, and a later ``main_writes(key)`` waits for the side lane."""
    f = _open
    if f is not None and _lane == SIDE:
        if written > f.synced:
            f._wait_main()
        f.borrowed.add(key)


def main_writes(key: object) -> None:
    """A main-lane launch is about to write the buffer named ``key``: if the open fork's side lane
    borrowed it, the main stream first waits for what the side lane has issued (a partial join)."""
    f = _open
    if f is not None and _lane == MAIN and key in f.borrowed:
        if f.cuda:
            f._main_waits()
        f.borrowed.clear()
