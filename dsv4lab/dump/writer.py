"""``Dumper``: the optional writer of the dump format (docs/dumps.md) for an engine that wants one.

    dumper = Dumper("dumps/run1", metadata={"engine": "mine", "tp": "8"})
    handles = dumper.hook_modules(model, r"model\\.layers\\.\\d+\\.(self_attn|mlp)$")  # torch modules
    logits = model(ids); dumper.step(ids)        # one safetensors file per forward call
    dumper.add("blk.3.attn_out.rank0", t)        # or add tensors yourself, by your own names

No model and no dsv4lab import needed (torch and safetensors only). ``add`` copies into a buffer
allocated on the first (eager) call for that name and shape and reuses it after, so inside a
CUDA-graph capture it records only a ``copy_`` and every replay refreshes the buffer; ``step``
(outside the graph) writes the buffers. Python hooks do not run on a replay, so say which
capture a replayed step comes from::

    with dumper.graph("decode"):                 # around the capture (after one eager warm-up step)
        with torch.cuda.graph(g): logits = step_fn(static_ids)
    g.replay(); dumper.step(static_ids, graph="decode")   # writes the buffers that capture recorded
 A step's tensors pass through host memory once, one step
at a time; the file is written under a temporary name and renamed, so a crash leaves no half file.
"""
from __future__ import annotations

import contextlib
import os
import re
from pathlib import Path
from typing import Callable, Iterable

import torch
from safetensors.torch import save_file

FORMAT = "dsv4lab-dump"
VERSION = "1"
INPUT_IDS = "input_ids"


def step_file(directory: str | os.PathLike, step: int) -> Path:
    """``DIR/step_000.safetensors`` for step 0 (three digits, more when needed)."""
    return Path(directory) / f"step_{step:03d}.safetensors"


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


class Dumper:
    """Collect named tensors of one forward call, then ``step(input_ids)`` writes them.

    ``names``: a regex (or predicate) on names; others are ignored by ``add`` (nothing copied).
    A tuple/list output is written as ``name.0``, ``name.1``, ... (None elements skipped).
    """

    def __init__(self, directory: str | os.PathLike, metadata: dict | None = None, names=None,
                 overwrite: bool = False) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        existing = sorted(self.directory.glob("step_*.safetensors"))
        if existing and not overwrite:
            raise FileExistsError(f"dump directory {self.directory} already holds {len(existing)} step files "
                                  f"(pass overwrite=True or choose an empty directory)")
        for p in existing:
            p.unlink()
        self.metadata = {str(k): str(v) for k, v in (metadata or {}).items()}
        if names is None:
            self.keep: Callable[[str], bool] = lambda n: True
        elif callable(names):
            self.keep = names
        else:
            rx = re.compile(names)
            self.keep = lambda n: rx.search(n) is not None
        self.n_steps = 0
        self._buffers: dict[tuple, torch.Tensor] = {}   # (name, shape, dtype, device) -> buffer
        self._current: dict[str, torch.Tensor] = {}     # name -> buffer holding this step's value
        self._graphs: dict[str, dict[str, torch.Tensor]] = {}  # capture label -> the buffers it copies into
        self._recording: dict[str, torch.Tensor] | None = None

    # ---------------------------------------------------------------- collecting
    def add(self, name: str, value) -> None:
        """Copy ``value`` (a tensor, or a tuple/list of them) into this step's buffer(s)."""
        if isinstance(value, (tuple, list)):
            for i, v in enumerate(value):
                if isinstance(v, torch.Tensor):
                    self.add(f"{name}.{i}", v)
            return
        if not isinstance(value, torch.Tensor) or not self.keep(name):
            return
        if name == INPUT_IDS:
            raise ValueError(f"{INPUT_IDS!r} is reserved for the tokens of the call: pass them to step()")
        t = value.detach()
        key = (name, tuple(t.shape), t.dtype, t.device)
        buf = self._buffers.get(key)
        if buf is None:
            if _capturing():
                raise RuntimeError(f"Dumper.add({name!r}) needs a buffer of shape {list(t.shape)} during CUDA-graph "
                                   f"capture: run one eager step with the same shapes first (buffers are allocated there)")
            buf = self._buffers[key] = torch.empty_like(t, memory_format=torch.contiguous_format)
        buf.copy_(t)
        self._current[name] = buf
        if self._recording is not None:
            self._recording[name] = buf

    @contextlib.contextmanager
    def graph(self, label: str = "graph"):
        """Remember what ``add`` copies into while a CUDA graph is captured in this block, so that
        ``step(ids, graph=label)`` after each replay writes those buffers."""
        self._recording = self._graphs[label] = {}
        try:
            yield self
        finally:
            self._recording = None

    def hook(self, module: torch.nn.Module, name: str):
        """A forward hook on ``module`` adding its output under ``name``; returns the handle."""
        return module.register_forward_hook(lambda mod, args, out: self.add(name, out))

    def hook_modules(self, model: torch.nn.Module, pattern: str = ".*") -> list:
        """Forward hooks on every named submodule whose name matches ``pattern`` (regex search)."""
        rx = re.compile(pattern)
        return [self.hook(m, n) for n, m in model.named_modules() if n and rx.search(n)]

    # ---------------------------------------------------------------- writing
    def step(self, input_ids: torch.Tensor, metadata: dict | None = None, graph: str | None = None) -> Path:
        """Write this call's tensors with ``input_ids`` (the tokens it consumed) as the next step
        file; ``graph``: the call was a replay of the capture made under ``self.graph(graph)``."""
        if not isinstance(input_ids, torch.Tensor) or input_ids.is_floating_point():
            raise ValueError("step(input_ids): the integer token ids [B, S] this forward call consumed")
        if graph is not None and graph not in self._graphs:
            raise ValueError(f"step(graph={graph!r}): no capture was recorded under that label "
                             f"(recorded: {sorted(self._graphs)}); wrap the capture in dumper.graph({graph!r})")
        tensors = {INPUT_IDS: input_ids.detach().to("cpu", torch.long).contiguous()}
        for name, buf in (self._graphs[graph] if graph is not None else self._current).items():
            tensors[name] = buf.to("cpu").contiguous()
        meta = {"format": FORMAT, "version": VERSION, "step": str(self.n_steps), **self.metadata,
                **{str(k): str(v) for k, v in (metadata or {}).items()}}
        path = step_file(self.directory, self.n_steps)
        tmp = path.with_suffix(".tmp")
        save_file(tensors, str(tmp), metadata=meta)
        os.replace(tmp, path)
        self.n_steps += 1
        self._current = {}
        return path

    def names(self) -> Iterable[str]:
        """Names collected so far in this step."""
        return list(self._current)
