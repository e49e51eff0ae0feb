"""Where a checkpoint named on the command line or in a notebook lives on disk.

``None`` / ``"tiny"`` is the embedded model shipped in ``data/tiny-dsv4`` and ``"tiny-nvfp4"``
its NVFP4 export; anything else is a path. Kept in the checkpoint layer so plans, loaders and
triage sessions resolve names the same way.
"""
from __future__ import annotations

import os
from pathlib import Path

TINY_DIR = Path(__file__).resolve().parents[2] / "data" / "tiny-dsv4"
EMBEDDED = {"tiny": TINY_DIR, "tiny-nvfp4": TINY_DIR / "nvfp4"}


def resolve_path(path: str | os.PathLike | None) -> Path:
    """``None`` or ``"tiny"`` -> the embedded default model; ``"tiny-nvfp4"`` -> its NVFP4 export."""
    if path is None:
        return TINY_DIR
    return EMBEDDED.get(str(path), Path(path))
