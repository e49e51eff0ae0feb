"""Keep a regression's failing tensors for offline diagnosis, in a bounded, compressed file.

What is kept, in priority order: the capture at the first diverging hook point (what the
fingerprint named), then the residual streams leaving each layer (``layers.N.hook_resid_post``),
nearest the diverging layer first (its layer, the one before, the one after, ...). The total
(uncompressed) never exceeds ``budget`` bytes: what does not fit is listed, not written. The
file is safetensors bytes, gzip-compressed (``failing.safetensors.gz``; :func:`load_failing`
reads it back). Transient memory: one forward with those captures offloaded to the CPU as they
fire, the residual streams limited beforehand to the layers the budget can hold.
"""
from __future__ import annotations

import gzip
import re
from pathlib import Path

import torch
from safetensors.torch import load, save

from ..analysis.cache import run_with_cache

FILE = "failing.safetensors.gz"
DEFAULT_BUDGET = 64 << 20   # bytes, uncompressed: 64 MiB
RESID = "layers.{}.hook_resid_post"
_LAYER = re.compile(r"^layers\.(\d+)\.")


def layer_priority(n_layers: int, first_hook: str | None) -> list[int]:
    """Layers by distance from the first diverging hook's layer (ties: the earlier layer first);
    0..n-1 when the first hook is in no layer or unknown."""
    m = _LAYER.match(first_hook or "")
    if not m:
        return list(range(n_layers))
    at = int(m.group(1))
    return sorted(range(n_layers), key=lambda i: (abs(i - at), i))


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


@torch.no_grad()
def capture_failing(model, ids: torch.Tensor, first_hook: str | None, out: str | Path,
                    budget: int = DEFAULT_BUDGET) -> dict:
    """Run ``model`` on ``ids``, keep the first diverging hook's capture and the residual streams
    within ``budget`` bytes (see the module doc) and write them to ``out`` (a directory).
    Returns {"file", "budget", "bytes", "compressed_bytes", "kept", "dropped"}."""
    if budget <= 0:
        raise ValueError(f"budget={budget}: expected a positive number of bytes")
    cfg = model.config
    # a residual capture is [B, S, hc, hidden] at most in fp32: pick as many layers as fit beside the first hook
    per_layer = ids.numel() * cfg.hc_mult * cfg.hidden_size * 4
    order = layer_priority(cfg.num_hidden_layers, first_hook)
    chosen = order[:max(1, budget // max(per_layer, 1))]
    names = sorted({RESID.format(i) for i in chosen} | ({first_hook} if first_hook else set()))
    _, cache = run_with_cache(model, ids, names=names, device="cpu")
    wanted = ([first_hook] if first_hook else []) + [RESID.format(i) for i in order]
    tensors = {"input_ids": ids.detach().cpu().long().contiguous()}
    dropped, total = [], nbytes(tensors["input_ids"])
    for name in wanted:
        t = cache.all(name)[0].contiguous() if name in cache else None
        if t is None or total + nbytes(t) > budget:   # not captured (over the budget), or does not fit
            dropped.append(name)
            continue
        tensors[name] = t
        total += nbytes(t)
    blob = gzip.compress(save(tensors, metadata={"first_hook": first_hook or "", "budget": str(budget)}), 6)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / FILE).write_bytes(blob)
    return {"file": FILE, "budget": budget, "bytes": total, "compressed_bytes": len(blob),
            "kept": [n for n in tensors if n != "input_ids"], "dropped": dropped}


def load_failing(path: str | Path) -> dict[str, torch.Tensor]:
    """The tensors of a ``failing.safetensors.gz`` (a file, or the run directory holding it)."""
    p = Path(path)
    p = p / FILE if p.is_dir() else p
    return load(gzip.decompress(p.read_bytes()))


__all__ = ["DEFAULT_BUDGET", "FILE", "capture_failing", "layer_priority", "load_failing"]
