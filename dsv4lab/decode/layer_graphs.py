"""Layer-graph decode: one CUDA graph per layer that no Python hook listens to; hooked layers eager.

Eager decode is where Python hooks fire, and a 61-layer V4-Pro step spends most of its eager time
on the host (launches, allocations, module calls: ~3.6 ms a layer). A triage session hooks a few
layers, not 61. This decoder splits the step into units (the embedding, each layer, the head),
replays a CUDA graph for every unit whose modules carry no Python hook, and runs the hooked units
eagerly with fresh tensors, exactly as :meth:`~dsv4lab.model.model.DSV4Model.decode_step` does. A
:class:`~dsv4lab.decode.taps.Tap` does not make its unit eager: its copy is recorded in the graph.

Units exchange the hidden streams through one buffer per device (``h``), which each graph unit
overwrites as its last op, so no graph keeps a live output in the shared pool and units may be
recaptured in any order. A change (component swap, precision mode, hook added or removed) recaptures
only the units whose signature moved: hooking layer 30 turns layer 30 eager and captures nothing.
Capture transient: one unit's decode state (its snapshot) plus its warm-up intermediates.
"""
from __future__ import annotations

import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Callable

import torch

from .. import lanes
from ..model.component import changes
from ..model.state import DecodeState
from .graphs import module_entry, untracked_modules, untracked_signature
from .taps import Tap

EMBED_MODULES = ("embed", "hook_embed")
HEAD_MODULES = ("hc_head", "norm", "head", "hook_final_hidden", "hook_logits")


def python_hooked(mod: torch.nn.Module) -> bool:
    """Whether ``mod`` carries a forward (pre-)hook other than a tap's: such a hook runs Python
    that a graph replay would skip."""
    hooks = list(mod._forward_hooks.values()) + list(mod._forward_pre_hooks.values())  # no public accessor
    return any(not isinstance(getattr(h, "__self__", None), Tap) for h in hooks)


class _Rerun:
    """Stand-in for a CUDA graph off CUDA: ``replay`` runs the unit again (same buffers)."""

    def __init__(self, run: Callable[[], None]) -> None:
        self.run = run

    def replay(self) -> None:
        self.run()


@dataclass
class _Unit:
    name: str
    device: torch.device
    modules: list[tuple[str, torch.nn.Module]]
    state_tensors: list[torch.Tensor]
    run_graph: Callable[[], None]     # reads/writes the device buffers; what a graph captures
    run_eager: Callable[[], None]     # the same on fresh tensors, for hooks that keep them
    signature: tuple | None = None
    eager: bool = False
    graph: object | None = None
    captures: int = 0

    def current_signature(self) -> tuple:
        return tuple(module_entry(n, m) for n, m in self.modules)

    def hooked(self) -> bool:
        return any(python_hooked(m) for _, m in self.modules)


@dataclass
class _DeviceBuffers:
    ids: torch.Tensor
    h: torch.Tensor
    stream: torch.cuda.Stream | None
    pool: object | None
    units: list[_Unit] = field(default_factory=list)


class LayerGraphDecoder:
    """``step(ids, state)``: a drop-in for ``decode_step`` (and ``generate(step_fn=...)``).

    The returned logits live in a buffer the next step overwrites (as :class:`GraphDecoder`'s).
    Off CUDA every unit runs eagerly through the same buffers (what the CPU tests exercise)."""

    def __init__(self, model, state: DecodeState, warmup: int = 2) -> None:
        if warmup < 1:
            raise ValueError(f"warmup={warmup}: a unit needs at least one eager run before its capture (use 1 or more)")
        self.model = model
        self.state = state
        self.warmup = warmup
        self.segments: list[tuple[torch.device, range, _DeviceBuffers]] = []
        self.logits: torch.Tensor | None = None
        self.changes_seen = -1
        self.untracked_mods: list = []
        self.untracked: tuple | None = None
        self.capture_s = 0.0
        self._build()

    # ------------------------------------------------------------------ units
    def _build(self) -> None:
        model, state = self.model, self.state
        segs = model.decode_segments()
        named = dict(model.named_children())
        B, D, hc = state.batch, model.config.hidden_size, model.config.hc_mult
        for k, (dev, layers) in enumerate(segs):
            cuda = dev.type == "cuda"
            with torch.cuda.device(dev) if cuda else nullcontext():
                bufs = _DeviceBuffers(ids=torch.zeros(B, 1, dtype=torch.long, device=dev),
                                      h=torch.zeros(B, 1, hc, D, dtype=model.dtype, device=dev),
                                      stream=torch.cuda.Stream(device=dev) if cuda else None,
                                      pool=torch.cuda.graph_pool_handle() if cuda else None)
            if k == 0:
                bufs.units.append(self._embed_unit(dev, bufs, named))
            for i in layers:
                bufs.units.append(self._layer_unit(i, dev, bufs))
            if k == len(segs) - 1:
                bufs.units.append(self._head_unit(dev, bufs, named))
            self.segments.append((dev, layers, bufs))
        head = self.segments[-1][2]
        self.logits = torch.zeros(B, 1, model.config.vocab_size, dtype=torch.float32, device=head.h.device)

    def _embed_unit(self, dev, bufs: _DeviceBuffers, named: dict) -> _Unit:
        model = self.model

        def run_graph() -> None:
            bufs.h.copy_(model._embed(bufs.ids))

        def run_eager() -> None:
            bufs.h.copy_(model._embed(bufs.ids.clone()))

        mods = _named_modules(named, EMBED_MODULES)
        return _Unit("embed", dev, mods, [], run_graph, run_eager)

    def _layer_unit(self, i: int, dev, bufs: _DeviceBuffers) -> _Unit:
        layer, st = self.model.layers[i], self.state.layers[i]
        pos = self.state.pos_on(dev)

        def run_graph() -> None:
            bufs.h.copy_(layer.decode(bufs.h, bufs.ids, pos, st))

        def run_eager() -> None:
            bufs.h.copy_(layer.decode(bufs.h.clone(), bufs.ids.clone(), pos, st))

        mods = list(layer.named_modules(prefix=f"layers.{i}"))
        return _Unit(f"layers.{i}", dev, mods, st.tensors(), run_graph, run_eager)

    def _head_unit(self, dev, bufs: _DeviceBuffers, named: dict) -> _Unit:
        model = self.model

        def run_graph() -> None:
            self.logits.copy_(model._final(bufs.h))

        def run_eager() -> None:
            self.logits.copy_(model._final(bufs.h.clone()))

        return _Unit("head", dev, _named_modules(named, HEAD_MODULES), [], run_graph, run_eager)

    def units(self) -> list[_Unit]:
        return [u for _, _, bufs in self.segments for u in bufs.units]

    def eager_units(self) -> list[str]:
        """Names of the units that run eagerly (a Python hook listens inside them)."""
        self.ensure_current()
        return [u.name for u in self.units() if u.eager]

    @property
    def captures(self) -> int:
        return sum(u.captures for u in self.units())

    # ---------------------------------------------------------------- capture
    @torch.no_grad()
    def ensure_current(self) -> None:
        """Re-decide and recapture the units whose signature moved; the signatures are compared
        only when a component counted a change or an untracked module changed (as GraphDecoder)."""
        if changes() == self.changes_seen and untracked_signature(self.untracked_mods) == self.untracked:
            return
        for _, _, bufs in self.segments:
            for u in bufs.units:
                sig = u.current_signature()
                if sig != u.signature:
                    u.signature, u.eager = sig, u.hooked()
                    u.graph = None if u.eager else self._capture(u, bufs)
        self.changes_seen, self.untracked_mods = changes(), untracked_modules(self.model)
        self.untracked = untracked_signature(self.untracked_mods)

    def _capture(self, u: _Unit, bufs: _DeviceBuffers):
        u.captures += 1
        if bufs.stream is None:
            return _Rerun(u.run_graph)
        t0 = time.perf_counter()
        snap = [t.clone() for t in [bufs.h, *u.state_tensors]]  # warm-up and capture write these
        u.graph = None  # let the old graph's memory go back to the pool first
        with torch.cuda.device(u.device), lanes.capturing():  # warm-up and capture fork onto decode lanes
            cur = torch.cuda.current_stream(u.device)
            bufs.stream.wait_stream(cur)
            with torch.cuda.stream(bufs.stream):
                for _ in range(self.warmup):
                    u.run_graph()
            bufs.stream.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=bufs.pool, stream=bufs.stream):
                u.run_graph()
            bufs.stream.synchronize()
            for t, s in zip([bufs.h, *u.state_tensors], snap):
                t.copy_(s)
            torch.cuda.synchronize(u.device)
        self.capture_s += time.perf_counter() - t0
        return graph

    # ----------------------------------------------------------------- replay
    @torch.no_grad()
    def step(self, input_ids: torch.Tensor, state: DecodeState | None = None) -> torch.Tensor:
        if state is not None and state is not self.state:
            raise ValueError("this LayerGraphDecoder was built over a different DecodeState "
                             "(build one per state: LayerGraphDecoder(model, state))")
        self.ensure_current()
        prev: _DeviceBuffers | None = None
        for dev, _, bufs in self.segments:
            with torch.cuda.device(dev) if dev.type == "cuda" else nullcontext():
                bufs.ids.copy_(input_ids, non_blocking=True)
                if prev is not None:
                    bufs.h.copy_(prev.h, non_blocking=True)
                for u in bufs.units:
                    if u.eager:
                        u.run_eager()
                    else:
                        u.graph.replay()
                self.state.pos_on(dev).add_(1)
            prev = bufs
        return self.logits


def _named_modules(named: dict, children: tuple[str, ...]) -> list[tuple[str, torch.nn.Module]]:
    out = []
    for child in children:
        if child in named:
            out += list(named[child].named_modules(prefix=child))
    return out

