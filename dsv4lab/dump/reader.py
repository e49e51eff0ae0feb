"""Read a dump directory lazily (docs/dumps.md): one ``safe_open`` per step, one tensor at a time.

Everything wrong with a dump is a :class:`DumpError` naming the file and the fix: no step files,
a gap in the numbering, a truncated or non-safetensors file, missing or malformed ``input_ids``,
a batch size that changes between steps.
"""
from __future__ import annotations

import contextlib
import os
import re
from pathlib import Path
from typing import Iterator

import torch
from safetensors import SafetensorError, safe_open

from ..model.validate import InputError
from .writer import INPUT_IDS

_STEP = re.compile(r"^step_(\d+)\.safetensors$")


class DumpError(InputError):
    """A dump (or its mapping) that cannot be compared; the message names the file and the fix."""


class DumpStep:
    """One forward call of the engine: ``input_ids`` [B, S] and its tensors' names (header only)."""

    def __init__(self, path: Path, index: int) -> None:
        self.path, self.index = path, index
        try:
            with safe_open(str(path), framework="pt") as f:
                self.names = [k for k in f.keys() if k != INPUT_IDS]
                has_ids = INPUT_IDS in f.keys()
                self.metadata = f.metadata() or {}
                ids = f.get_tensor(INPUT_IDS) if has_ids else None
        except (SafetensorError, OSError) as e:
            raise DumpError(f"{path}: not a readable safetensors file ({' '.join(str(e).split())}); "
                            f"the file is truncated or not written by safetensors -- rewrite this step") from None
        if ids is None:
            raise DumpError(f"{path}: no {INPUT_IDS!r} tensor; every step file holds the token ids [B, S] its "
                            f"forward call consumed (Dumper.step(input_ids) writes them)")
        if ids.is_floating_point() or ids.dim() not in (1, 2) or ids.numel() == 0:
            raise DumpError(f"{path}: {INPUT_IDS!r} must be integer token ids [B, S] (or [S]), got "
                            f"{str(ids.dtype).replace('torch.', '')} {list(ids.shape)}")
        self.input_ids = (ids if ids.dim() == 2 else ids.unsqueeze(0)).long()

    @contextlib.contextmanager
    def open(self) -> Iterator[object]:
        """The step's safetensors handle (tensors read one by one with ``get_tensor``)."""
        with safe_open(str(self.path), framework="pt") as f:
            yield f


class DumpReader:
    """The steps of a dump directory in order; tensors stay on disk until asked for."""

    def __init__(self, directory: str | os.PathLike) -> None:
        d = Path(directory)
        if not d.is_dir():
            raise DumpError(f"dump={str(directory)!r} is not a directory (a dump is a directory of "
                            f"step_000.safetensors, step_001.safetensors, ...; see docs/dumps.md)")
        found = {}
        for p in d.iterdir():
            m = _STEP.match(p.name)
            if m:
                found[int(m.group(1))] = p
        if not found:
            raise DumpError(f"dump={str(directory)!r} holds no step_NNN.safetensors files (see docs/dumps.md)")
        missing = sorted(set(range(max(found) + 1)) - set(found))
        if missing:
            raise DumpError(f"dump={str(directory)!r}: step {missing[0]} is missing (steps are numbered from "
                            f"step_000 without gaps: one file per forward call, in order)")
        self.directory = d
        self.steps = [DumpStep(found[i], i) for i in range(len(found))]
        b0 = self.steps[0].input_ids.shape[0]
        for s in self.steps[1:]:
            if s.input_ids.shape[0] != b0:
                raise DumpError(f"{s.path}: batch {s.input_ids.shape[0]} but step 0 has batch {b0} "
                                f"(a dump replays one batch of sequences: prefill, then decode steps)")

    def __len__(self) -> int:
        return len(self.steps)

    @property
    def batch(self) -> int:
        return self.steps[0].input_ids.shape[0]

    @property
    def total_tokens(self) -> int:
        return sum(s.input_ids.shape[1] for s in self.steps)

    def names(self) -> list[str]:
        """Every engine tensor name in the dump (first seen order)."""
        return list(dict.fromkeys(n for s in self.steps for n in s.names))

    def get(self, step: int, name: str) -> torch.Tensor:
        with self.steps[step].open() as f:
            return f.get_tensor(name)
