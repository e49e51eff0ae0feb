"""Notebook 1: what is in a checkpoint (headers only), and how it would sit on the devices.

Nothing here reads tensor data: :func:`dsv4lab.checkpoint.inspect_checkpoint` reads safetensors
headers, the decode-state size comes from allocating the state on the ``meta`` device, so all of
it works on a 0.9 TB V4-Pro checkpoint as on the embedded model.
"""
from __future__ import annotations

import os
import time

import pandas as pd

from ..checkpoint.fake import make_sparse_checkpoint, v4_flash_config, v4_pro_config
from ..checkpoint.inspect import inspect_checkpoint
from ..checkpoint.names import KIND_GROUPS
from ..plan import plan
from .plots import style

# the shared kind groups of the inspect / plan tables, under labels a reader scans faster
_LABELS = {"attn": "attention", "experts": "routed experts", "shared": "shared expert"}
GROUPS = {_LABELS.get(g, g): kinds for g, kinds in KIND_GROUPS.items()}


def inspect(path) -> dict:
    """The JSON-able report of :func:`dsv4lab.checkpoint.inspect.inspect_checkpoint`, timed."""
    t0 = time.perf_counter()
    rep = inspect_checkpoint(os.fspath(path))
    rep["inspect_seconds"] = time.perf_counter() - t0
    return rep


def overview_table(rep: dict):
    c = rep.get("config") or {}
    rows = [("path", rep["path"]), ("layout", rep["layout"]), ("shards", rep["n_shards"]),
            ("stored tensors", rep["n_raw_tensors"]), ("logical tensors", rep["n_logical_tensors"]),
            ("tensor data", gb(rep["tensor_bytes"])), ("layers", c.get("num_hidden_layers")),
            ("hidden size", c.get("hidden_size")), ("routed experts", f"{c.get('n_routed_experts')} (top-{c.get('num_experts_per_tok')})"),
            ("layer types", c.get("layer_types")), ("quantisation", (rep.get("quant_config") or {}).get("quant_algo", "none")),
            ("matches config", rep["ok"]), ("inspect time", f"{rep.get('inspect_seconds', 0):.2f} s (headers only)")]
    return pd.DataFrame(rows, columns=["field", "value"]).set_index("field")


def formats_table(rep: dict):
    rows = [{"format": f, "tensors": d["tensors"], "linears": rep["linear_formats"].get(f, 0), "bytes": d["bytes"],
             "size": gb(d["bytes"]), "share %": round(100 * d["bytes"] / max(rep["tensor_bytes"], 1), 2)}
            for f, d in rep["formats"].items()]
    return pd.DataFrame(rows)


def kinds_table(rep: dict):
    tot = max(rep["tensor_bytes"], 1)
    rows = [{"component kind": k, "bytes": n, "size": gb(n), "share %": round(100 * n / tot, 2)} for k, n in rep["bytes_by_kind"].items()]
    return pd.DataFrame(rows)


def layers_table(rep: dict):
    """Bytes per layer and component group (rows: layers, 'global' = embed / head / final norm)."""
    rows = []
    for lk, kinds in rep["bytes_by_layer_kind"].items():
        row = {"layer": lk}
        used = 0
        for g, ks in GROUPS.items():
            row[g] = sum(kinds.get(k, 0) for k in ks)
            used += row[g]
        row["other"] = sum(kinds.values()) - used
        row["total"] = sum(kinds.values())
        rows.append(row)
    return pd.DataFrame(rows).set_index("layer")


def layer_bytes_figure(rep: dict, title: str | None = None):
    import plotly.graph_objects as go  # lazy: heavy optional dependency


    df = layers_table(rep)
    fig = go.Figure()
    for col in [c for c in df.columns if c != "total"]:
        fig.add_trace(go.Bar(x=df.index.astype(str), y=df[col] / 2**20, name=col))
    fig.update_layout(barmode="stack")
    style(fig, title or "Checkpoint bytes per layer and component", "layer ('global' = embed, head, final norm)",
          "MiB", legend="component")
    fig.update_xaxes(type="category")
    return fig


# ------------------------------------------------------------------------------ memory plan
def memory_plan(path_or_config, gpus: int = 8, gpu_memory="141GB", context: int = 65536, batch: int = 1, **kw):
    """:func:`dsv4lab.plan.plan` (headers only for a checkpoint) without raising when it does not
    fit: the plan says ``fits`` and where it overflows."""
    return plan(path_or_config, gpus=gpus, gpu_memory=gpu_memory, context=context, batch=batch, check=False, **kw)


def plan_figure(p, title: str | None = None):
    """Stacked bars per GPU: weights, decode state, reserve, headroom (GB)."""
    import plotly.graph_objects as go  # lazy: heavy optional dependency


    t = p.gpu_table()
    fig = go.Figure()
    x = [f"GPU {g}: layers {r}" for g, r in zip(t.index, t["layers"])]
    for col, name in (("weights", "weights"), ("state", "decode state"), ("reserve", "reserve"), ("headroom", "headroom")):
        if col in t:
            fig.add_trace(go.Bar(x=x, y=t[col].clip(lower=0) / 1e9, name=name))
    fig.update_layout(barmode="stack")
    return style(fig, title or "Memory plan: bytes per GPU", "GPU (contiguous layer range)", "GB", legend="")


def sparse_v4_checkpoint(path, which: str = "pro") -> dict:
    """A header-only (sparse, nothing written but headers) V4-Pro / V4-Flash NVFP4 checkpoint of
    the real size, to show inspection and planning at scale without the data."""
    cfg = v4_pro_config() if which == "pro" else v4_flash_config()
    t0 = time.perf_counter()
    info = make_sparse_checkpoint(path, cfg)
    info["seconds"] = time.perf_counter() - t0
    return info


def gb(n) -> str:
    n = float(n)
    for unit, s in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= s:
            return f"{n / s:.2f} {unit}"
    return f"{int(n)} B"
