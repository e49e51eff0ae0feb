"""Where a checkpoint named on the command line or in a notebook lives on disk.

``None`` / ``"tiny"`` is the embedded model shipped in ``data/tiny-dsv4`` and ``"tiny-nvfp4"``
its NVFP4 export; anything else is a path. Kept in the checkpoint layer so plans, loaders and
triage sessions resolve names the same way. :func:`originals_of` says where the original
weights of a quantised checkpoint are, when they are known (the reference a triage compares with).
"""
from __future__ import annotations

import json
import os
import warnings
from pathlib import Path

from ..patterns import did_you_mean
from .errors import CheckpointError
from .identity import checkpoint_identity

TINY_DIR = Path(__file__).resolve().parents[2] / "data" / "tiny-dsv4"
EMBEDDED = {"tiny": TINY_DIR, "tiny-nvfp4": TINY_DIR / "nvfp4"}


def resolve_path(path: str | os.PathLike | None) -> Path:
    """``None`` or ``"tiny"`` -> the embedded default model; ``"tiny-nvfp4"`` -> its NVFP4 export.
    A bare name that is neither one nor on disk but close to one fails here, with did-you-mean."""
    if path is None:
        return TINY_DIR
    s = str(path)
    if s in EMBEDDED:
        return EMBEDDED[s]
    p = Path(path)
    if os.sep not in s and not p.exists() and (hint := did_you_mean(s, EMBEDDED)):
        raise CheckpointError(f"{s!r}: no such checkpoint file or directory{hint} (the embedded model: "
                              f"{', '.join(EMBEDDED)}; anything else is a path)")
    return p


# ------------------------------------------------------------------------------ originals
QUANTIZED_FROM = "quantized_from.json"   # written next to a checkpoint quantised from another one


def record_quantized_from(out: str | os.PathLike, src: str | os.PathLike, fmt: str) -> Path:
    """Record in checkpoint ``out`` that it is ``src``'s weights quantised to ``fmt`` (with ``src``'s
    identity), so :func:`originals_of` can find the weights it was quantised from."""
    src = Path(src).resolve()
    rec = {"source": str(src), "identity": checkpoint_identity(src).digest, "format": fmt}
    f = Path(out) / QUANTIZED_FROM
    f.write_text(json.dumps(rec, indent=1) + "\n")
    return f


def quantized_from(path: str | os.PathLike | None) -> Path | None:
    """The checkpoint whose weights the checkpoint at ``path`` quantises, as far as it is known:
    the embedded model for its NVFP4 export, else what ``dsv4lab.checkpoint.synth.quantize_checkpoint``
    recorded (whether or not it is still there, unchanged: :func:`originals_of` checks), else None."""
    p = resolve_path(path).resolve()
    if p == EMBEDDED["tiny-nvfp4"].resolve():
        return TINY_DIR
    f = p / QUANTIZED_FROM
    return Path(json.loads(f.read_text())["source"]) if f.is_file() else None


def originals_of(path: str | os.PathLike | None) -> Path | None:
    """The checkpoint holding the original (pre-quantisation) weights of the checkpoint at
    ``path`` (:func:`quantized_from`), when it is there and, for a recorded one, unchanged (same
    identity; changed: a warning and None); else None (a release does not know where its
    originals are: pass them, e.g. ``--reference``)."""
    src = quantized_from(path)
    if src is None or not (src / "config.json").is_file():
        return None
    f = resolve_path(path).resolve() / QUANTIZED_FROM
    if f.is_file() and checkpoint_identity(src).digest != json.loads(f.read_text()).get("identity"):
        warnings.warn(f"{f.parent} was quantised from {src}, which has changed since (its identity differs): not "
                      f"used as its originals; pass the reference checkpoint explicitly", stacklevel=2)
        return None
    return src
