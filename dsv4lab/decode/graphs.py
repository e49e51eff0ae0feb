"""CUDA-graph decode: one graph per device segment, explicit streams and events.

Each device's contiguous layers are captured once on that device's own (non-default) stream,
over the fixed-shape decode state. Inputs enter through static buffers; hidden states cross
devices between replays with a copy ordered by events. Capturing on the default/legacy stream
of a non-default GPU is what made our users' replays return zeros, so every capture and replay
here names its stream and device explicitly.

The graphs are rebuilt automatically when anything they baked in changes: a component swap, a
precision mode, the set of registered hooks (``signature``).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import lanes
from ..model.component import PER_RUN_ATTRIBUTES, Component, changes
from ..model.state import DecodeState
PLAIN = (bool, int, float, str, type(None))


def module_switches(mod: torch.nn.Module) -> tuple:
    """Every public attribute of ``mod`` that can steer its forward: plain values (flags such as
    ``Attention.use_compressed``, ``Indexer.enabled``, ``QLinear.mode``, ``round_trips``) by value, objects
    (weights, kernels, sub-configs) by identity. Listed generically so a new flag cannot be missed."""
    out = []
    for key, value in vars(mod).items():
        if key.startswith("_") or key in PER_RUN_ATTRIBUTES:
            continue
        if isinstance(value, (frozenset, tuple)) and all(isinstance(v, PLAIN) for v in value):
            value = tuple(sorted(map(str, value))) if isinstance(value, frozenset) else value  # e.g. round_trips
        out.append((key, value if isinstance(value, (PLAIN, tuple)) else id(value)))
    return tuple(out)


def module_entry(name: str, mod: torch.nn.Module) -> tuple:
    entry = (name, type(mod).__qualname__, id(mod), module_switches(mod))
    if mod._forward_hooks or mod._forward_pre_hooks:  # torch's hook dicts: no public accessor
        entry += (tuple(id(h) for h in mod._forward_hooks.values()),
                  tuple(id(h) for h in mod._forward_pre_hooks.values()))
    return entry


def model_signature(model) -> tuple:
    """What a captured graph depends on besides the state: modules, their switches and hooks."""
    return tuple(module_entry(name, mod) for name, mod in model.named_modules())


def untracked_modules(model) -> list[tuple[str, torch.nn.Module]]:
    """The modules that do not count their own changes (not a :class:`Component`: the embedding,
    layer lists, a user's implementations). A new one can only appear through a counted change of a
    component parent or a changed child of an untracked one, so the list is taken at capture."""
    return [(name, mod) for name, mod in model.named_modules() if not isinstance(mod, Component)]


def untracked_signature(mods: list[tuple[str, torch.nn.Module]]) -> tuple:
    """Signature entries of ``mods`` with their children's identities (an item assigned into an
    ``nn.ModuleList`` changes its parent's entry)."""
    return tuple(module_entry(name, mod) + (tuple(id(c) for c in mod.children()),) for name, mod in mods)


@dataclass
class _Segment:
    device: torch.device
    stream: torch.cuda.Stream
    graph: torch.cuda.CUDAGraph
    static_in: torch.Tensor     # ids (first segment) or hidden streams
    static_ids: torch.Tensor    # token ids on this device (hash routing)
    static_out: torch.Tensor
    done: torch.cuda.Event


class GraphDecoder:
    """Replays captured decode steps; ``step(ids, state)`` is a drop-in for ``decode_step``."""

    def __init__(self, model, state: DecodeState, warmup: int = 2) -> None:
        if not all(d.type == "cuda" for d, _ in model.decode_segments()):
            raise RuntimeError("CUDA-graph decode needs every layer on a CUDA device")
        self.model = model
        self.state = state
        self.warmup = warmup
        self.segments: list[_Segment] = []
        self.signature = None
        self.untracked = None
        self.untracked_mods: list = []
        self.changes_seen = -1
        self.captures = 0

    # ------------------------------------------------------------- capture
    def _snapshot(self) -> list[torch.Tensor]:
        return [t.clone() for t in self.state.tensors()]

    def _restore(self, snap: list[torch.Tensor]) -> None:
        for t, s in zip(self.state.tensors(), snap):
            t.copy_(s)

    def capture(self) -> None:
        model, state = self.model, self.state
        segs = model.decode_segments()
        snap = self._snapshot()  # warm-up runs write the state; put it back afterwards
        self.segments = []
        B = state.batch
        ids0 = torch.zeros(B, 1, dtype=torch.long, device=segs[0][0])
        h_prev = None
        for k, (dev, _) in enumerate(segs):
            with torch.cuda.device(dev), lanes.capturing():  # warm-up and capture fork onto decode lanes
                stream = torch.cuda.Stream(device=dev)
                static_ids = torch.zeros(B, 1, dtype=torch.long, device=dev)
                static_in = ids0 if k == 0 else torch.zeros_like(h_prev, device=dev)
                stream.wait_stream(torch.cuda.current_stream(dev))
                with torch.cuda.stream(stream):
                    for _ in range(self.warmup):
                        out = model.decode_segment(k, static_in, static_ids, state)
                stream.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, stream=stream):
                    out = model.decode_segment(k, static_in, static_ids, state)
                stream.synchronize()
                self.segments.append(_Segment(dev, stream, graph, static_in, static_ids, out, torch.cuda.Event()))
                h_prev = out
        self._restore(snap)
        for dev in {s.device for s in self.segments}:
            torch.cuda.synchronize(dev)
        self.signature = model_signature(model)
        self._note_current()
        self.captures += 1

    def ensure_current(self) -> None:
        """Recapture when anything the graphs baked in changed: the full signature is compared only
        when a component counted a change (``model.component``) or an untracked module changed."""
        if not self.segments:
            self.capture()
            return
        if changes() == self.changes_seen and untracked_signature(self.untracked_mods) == self.untracked:
            return
        if model_signature(self.model) != self.signature:
            self.capture()
            return
        self._note_current()

    def _note_current(self) -> None:
        self.changes_seen, self.untracked_mods = changes(), untracked_modules(self.model)
        self.untracked = untracked_signature(self.untracked_mods)

    # -------------------------------------------------------------- replay
    @torch.no_grad()
    def step(self, input_ids: torch.Tensor, state: DecodeState | None = None) -> torch.Tensor:
        if state is not None and state is not self.state:
            raise ValueError("this GraphDecoder was captured over a different DecodeState")
        self.ensure_current()
        prev: _Segment | None = None
        for k, seg in enumerate(self.segments):
            cur = torch.cuda.current_stream(seg.device)
            seg.stream.wait_stream(cur)
            with torch.cuda.stream(seg.stream):
                if prev is not None:
                    seg.stream.wait_event(prev.done)
                    seg.static_in.copy_(prev.static_out, non_blocking=True)
                elif k == 0:
                    seg.static_in.copy_(input_ids, non_blocking=True)
                seg.static_ids.copy_(input_ids, non_blocking=True)
                seg.graph.replay()
                seg.done.record(seg.stream)
            prev = seg
        last = self.segments[-1]
        torch.cuda.current_stream(last.device).wait_event(last.done)
        return last.static_out
