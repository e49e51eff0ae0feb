"""Per-notebook metrics recorder: ``rec.record(name, value, tolerance=...)`` -> JSON file.

Each notebook creates one recorder (its path comes from the ``METRICS_OUT`` parameter that the
report runner injects, or from ``$DSV4LAB_METRICS_OUT``); every ``record`` rewrites the file so a
notebook that dies half-way still leaves what it measured. The file::

    {"notebook": "02_first_token_logits", "model": "...",
     "metrics": {"top1_token": {"value": " Paris", "tolerance": {"exact": true}, "note": "..."}}}

Tolerances (see :func:`dsv4lab.triage.regression.within`): ``{"exact": true}``,
``{"abs": a, "rel": r}`` (pass when |cur-base| <= a + r*|base|), optional ``"direction"``
``"up"``/``"down"`` (only a move that way counts: e.g. KL going up), ``{"ignore": true}``
(informational, e.g. latencies). A bare number means ``{"abs": number}``.
"""
from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import pandas as pd

METRICS_ENV = "DSV4LAB_METRICS_OUT"


def to_jsonable(v: Any) -> Any:
    """Python scalars / lists / dicts from tensors, numpy values and the like (NaN -> None)."""
    try:
        import torch

        if isinstance(v, torch.Tensor):
            v = v.detach().cpu().tolist()
    except ImportError:  # pragma: no cover
        pass
    if hasattr(v, "item") and not isinstance(v, (list, dict, str)) and getattr(v, "ndim", 0) == 0:
        v = v.item()
    if hasattr(v, "tolist") and not isinstance(v, (list, dict, str)):
        v = v.tolist()
    if isinstance(v, float):
        return None if math.isnan(v) else (v if math.isfinite(v) else (1e308 if v > 0 else -1e308))
    if isinstance(v, (list, tuple)):
        return [to_jsonable(x) for x in v]
    if isinstance(v, dict):
        return {str(k): to_jsonable(x) for k, x in v.items()}
    if isinstance(v, (bool, int, str)) or v is None:
        return v
    return str(v)


def normalize_tolerance(tol) -> dict | None:
    if tol is None:
        return None
    if isinstance(tol, (int, float)) and not isinstance(tol, bool):
        return {"abs": float(tol)}
    if tol == "exact" or tol is True:
        return {"exact": True}
    if tol == "ignore":
        return {"ignore": True}
    if isinstance(tol, dict):
        return dict(tol)
    raise TypeError(f"tolerance must be None, a number, 'exact', 'ignore' or a dict, got {tol!r}")


class MetricsRecorder:
    """Collects one notebook's metrics; writes them to ``path`` (if any) after every record."""

    def __init__(self, notebook: str, path: str | os.PathLike | None = None, model: str | None = None) -> None:
        self.notebook = notebook
        self.path = Path(path) if path else None
        self.model = model
        self.metrics: dict[str, dict] = {}

    def record(self, name: str, value, tolerance=None, note: str = ""):
        """Store ``value`` under ``name`` (tolerance: see module doc; strings/ints/lists default
        to exact, floats to ``{"abs": 1e-4, "rel": 1e-3}``). Returns the value."""
        v = to_jsonable(value)
        tol = normalize_tolerance(tolerance)
        if tol is None:
            tol = {"abs": 1e-4, "rel": 1e-3} if isinstance(v, float) else {"exact": True}
        self.metrics[name] = {"value": v, "tolerance": tol, **({"note": note} if note else {})}
        self.save()
        return value

    def scoped(self, prefix: str) -> "ScopedRecorder":
        """A view that records into this recorder under ``prefix + name``: the nightly records a
        notebook's metrics with that notebook's own ``record_*`` function, in its own namespace."""
        return ScopedRecorder(self, prefix)

    def get(self, name: str, default=None):
        m = self.metrics.get(name)
        return default if m is None else m["value"]

    def as_dict(self) -> dict:
        return {"notebook": self.notebook, "model": self.model, "metrics": self.metrics}

    def save(self) -> None:
        if self.path is None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(self.path.suffix + ".tmp")
        tmp.write_text(json.dumps(self.as_dict(), indent=1) + "\n")
        os.replace(tmp, self.path)

    def table(self):
        rows = [{"metric": k, "value": short_value(m["value"]), "tolerance": tolerance_text(m["tolerance"]), "note": m.get("note", "")}
                for k, m in self.metrics.items()]
        return pd.DataFrame(rows, columns=["metric", "value", "tolerance", "note"])


class ScopedRecorder:
    """``record(name, ...)`` -> ``parent.record(prefix + name, ...)`` (see MetricsRecorder.scoped)."""

    def __init__(self, parent: MetricsRecorder, prefix: str) -> None:
        self.parent, self.prefix = parent, prefix

    def record(self, name: str, value, tolerance=None, note: str = ""):
        return self.parent.record(self.prefix + name, value, tolerance, note)


def short_value(v, n: int = 80):
    s = v if isinstance(v, (int, float, bool)) or v is None else json.dumps(v)
    return s if not isinstance(s, str) or len(s) <= n else s[: n - 3] + "..."


def tolerance_text(t: dict | None) -> str:
    if not t:
        return "-"
    if t.get("ignore"):
        return "informational"
    if t.get("exact"):
        return "exact"
    parts = []
    if t.get("abs"):
        parts.append(f"±{t['abs']:g}")
    if t.get("rel"):
        parts.append(f"±{100 * t['rel']:g}%")
    if t.get("direction"):
        parts.append({"up": "(only increases fail)", "down": "(only decreases fail)"}[t["direction"]])
    return " ".join(parts) or "exact"


def recorder(notebook: str, path: str | os.PathLike | None = None, model: str | None = None) -> MetricsRecorder:
    """The notebook's recorder: ``path`` (the METRICS_OUT parameter) or ``$DSV4LAB_METRICS_OUT``
    (a directory: ``<dir>/<notebook>.metrics.json``); neither -> kept in memory only."""
    if path is None and os.environ.get(METRICS_ENV):
        path = Path(os.environ[METRICS_ENV]) / f"{notebook}.metrics.json"
    return MetricsRecorder(notebook, path, model)


def load_metrics(path: str | os.PathLike) -> dict:
    return json.loads(Path(path).read_text())


def portable_path(source) -> str | None:
    """A checkpoint path relative to the repo when inside it (clones live anywhere)."""
    if source is None:
        return None
    root = Path(__file__).resolve().parents[2]
    try:
        return str(Path(source).resolve().relative_to(root))
    except (ValueError, TypeError, OSError):
        return str(source)


def merge(files_or_dicts) -> dict:
    """Merge per-notebook metric files into ``{"model": ..., "notebooks": {nb: {metric: {...}}}}``."""
    out: dict = {"model": None, "notebooks": {}}
    for f in files_or_dicts:
        d = f if isinstance(f, dict) else load_metrics(f)
        out["model"] = out["model"] or portable_path(d.get("model"))
        out["notebooks"][d["notebook"]] = d["metrics"]
    return out


def flatten(merged: dict) -> dict[str, dict]:
    """``{"nb/metric": {"value", "tolerance"}}`` of a merged metrics dict."""
    flat = {}
    for nb, ms in merged.get("notebooks", {}).items():
        for k, m in ms.items():
            flat[f"{nb}/{k}"] = m
    return flat
