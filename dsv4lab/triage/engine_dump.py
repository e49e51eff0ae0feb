"""Notebook 8 "your engine against the reference": a demo dump when you have none, an overview
of a dump, the divergence pictures and the metrics (see docs/dumps.md for the format).

``demo_dump`` stands in for an engine without a second model: the session's model with a bug-zoo
bug injected in place (restored after) writes its hook points under transformers' module names,
so ``--mapping hf`` reads it as it would read a DeepseekV4ForCausalLM engine's dump.
"""
from __future__ import annotations

import math
from pathlib import Path

import pandas as pd
import torch
from safetensors import safe_open

from ..bugzoo import inject
from ..dump import DumpComparison, DumpReader, Dumper
from . import plots

# dsv4lab hook -> transformers module output (name[.item]), the inverse of dsv4lab/dump/mappings/hf.json
HF_NAMES = {
    "hook_embed": "model.embed_tokens",
    "layers.{L}.attn_hc.hook_post": "model.layers.{L}.attn_hc.0",
    "layers.{L}.attn_hc.hook_comb": "model.layers.{L}.attn_hc.1",
    "layers.{L}.attn_hc.hook_collapsed": "model.layers.{L}.attn_hc.2",
    "layers.{L}.attn.indexer.hook_indices": "model.layers.{L}.self_attn.compressor.indexer",
    "layers.{L}.attn.hook_out": "model.layers.{L}.self_attn.0",
    "layers.{L}.ffn_hc.hook_post": "model.layers.{L}.ffn_hc.0",
    "layers.{L}.ffn_hc.hook_comb": "model.layers.{L}.ffn_hc.1",
    "layers.{L}.ffn_hc.hook_collapsed": "model.layers.{L}.ffn_hc.2",
    "layers.{L}.mlp.router.hook_logits": "model.layers.{L}.mlp.gate.0",
    "layers.{L}.mlp.router.hook_weights": "model.layers.{L}.mlp.gate.1",
    "layers.{L}.mlp.router.hook_ids": "model.layers.{L}.mlp.gate.2",
    "layers.{L}.mlp.experts.hook_out": "model.layers.{L}.mlp.experts",
    "layers.{L}.mlp.shared_expert.hook_out": "model.layers.{L}.mlp.shared_experts",
    "layers.{L}.mlp.hook_out": "model.layers.{L}.mlp",
    "layers.{L}.hook_resid_post": "model.layers.{L}",
    "hook_final_hidden": "model.norm",
    "hook_logits": "lm_head",
}


def hf_names(n_layers: int) -> dict[str, str]:
    out = {}
    for hook, eng in HF_NAMES.items():
        for L in (range(n_layers) if "{L}" in hook else [None]):
            out[hook.format(L=L)] = eng.format(L=L)
    return out


@torch.no_grad()
def demo_dump(model, directory, ids: torch.Tensor, steps: int = 3, bug: str | None = None, layers=None) -> Path:
    """Write a dump of ``steps`` forward calls (prefill of ``ids``, then greedy decode steps) of
    ``model`` with ``bug`` injected (in place, restored on exit) under transformers' names."""
    names = hf_names(model.config.num_hidden_layers)
    dumper = Dumper(directory, metadata={"engine": "dsv4lab demo (transformers names)", "bug": bug or ""},
                    overwrite=True)

    def on(t, name):
        if name in names:
            dumper.add(names[name], t)

    handle = inject(model, bug, layers) if bug else None
    try:
        state = model.new_state(ids.shape[0], ids.shape[1] + steps)
        with model.hooks([("**", on)]):
            logits = model.prefill(ids, state)
            dumper.step(ids)
            for _ in range(steps - 1):
                nxt = logits[:, -1:].argmax(-1)
                logits = model.decode_step(nxt, state)
                state.pos += 1
                dumper.step(nxt)
    finally:
        if handle is not None:
            handle.restore()
    return Path(directory)


def overview(dump) -> pd.DataFrame:
    """Per step: tokens, tensors and bytes, from the headers (no tensor is read)."""
    reader = dump if isinstance(dump, DumpReader) else DumpReader(dump)
    rows = []
    for st in reader.steps:
        nbytes = 0
        with safe_open(str(st.path), framework="pt") as f:
            for n in st.names:
                sl = f.get_slice(n)
                nbytes += math.prod(sl.get_shape()) * _itemsize(sl.get_dtype())
        rows.append({"step": st.index, "file": st.path.name, "tokens": st.input_ids.shape[1],
                     "kind": "prefill" if st.index == 0 or st.input_ids.shape[1] > 1 else "decode",
                     "tensors": len(st.names), "MiB": round(nbytes / 2**20, 3)})
    return pd.DataFrame(rows)


_ITEMSIZE = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1,
             "F8_E4M3": 1, "F8_E5M2": 1}


def _itemsize(dtype: str) -> int:
    return _ITEMSIZE.get(str(dtype).upper(), 4)


# ------------------------------------------------------------------------------ pictures
def divergence_heatmap(res: DumpComparison, title: str | None = None):
    """Layer x component: log10 of the worst rel_err over the steps; a star marks a divergence."""
    import plotly.graph_objects as go  # lazy: heavy optional dependency

    t = res.per_layer()
    div = res.per_layer("diverged")
    z = t.map(lambda v: math.log10(max(v, 1e-12)) if pd.notna(v) and not math.isinf(v) else (3.0 if pd.notna(v) else None))
    text = [["*" if pd.notna(div.loc[i, c]) and bool(div.loc[i, c]) else "" for c in t.columns] for i in t.index]
    fig = go.Figure(go.Heatmap(z=z.values.tolist(), x=list(t.columns), y=[str(i) for i in t.index], text=text,
                               texttemplate="%{text}", colorscale="Reds", zmin=-8, zmax=0,
                               colorbar={"title": {"text": "log10 rel_err"}},
                               hovertemplate="layer %{y} %{x}<br>log10 rel_err %{z:.2f}<extra></extra>"))
    plots.style(fig, title or f"engine vs reference: worst relative error per layer and component (* = above tol {res.tol})",
                "component", "layer", height=160 + 36 * len(t.index))
    fig.update_yaxes(autorange="reversed", type="category")
    return fig


def divergence_by_step(res: DumpComparison, title: str | None = None):
    """rel_err of every compared tensor in execution order, one colour per step (log scale)."""
    import plotly.graph_objects as go  # lazy: heavy optional dependency

    df = res.table()
    fig = go.Figure()
    for step, g in df.groupby("step"):
        fig.add_trace(go.Scatter(x=g["order"], y=g["rel_err"].clip(lower=1e-12), mode="markers", name=f"step {step}",
                                 marker={"size": 6, "symbol": ["x" if d else "circle" for d in g["diverged"]]},
                                 text=g["hook"] + " <- " + g["engine"],
                                 hovertemplate="%{text}<br>rel_err %{y:.3g}<extra></extra>"))
    plots.style(fig, title or "relative error of every engine tensor, in execution order (x = diverged)",
                "compared tensor, execution order over all steps", "rel_err (log; 0 shown as 1e-12)", legend="step")
    fig.update_yaxes(type="log")
    return fig


# ------------------------------------------------------------------------------ metrics
def record_engine_dump(rec, res: DumpComparison, expected_components=None) -> bool | None:
    """Record what notebook 8 reports; returns whether the culprit lies in ``expected_components``
    (None when nothing was expected)."""
    fd = res.first_divergence
    rec.record("steps", res.steps)
    rec.record("compared", len(res.rows))
    rec.record("unmapped", len(res.unmapped))
    rec.record("first_divergence", None if fd is None else fd["hook"])
    rec.record("first_divergence_step", None if fd is None else fd["step"])
    rec.record("first_divergence_rel_err", None if fd is None else float(fd["rel_err"]), {"ignore": True})
    culprit = (res.isolation or {}).get("culprit")
    rec.record("culprit", culprit)
    if expected_components is None:
        return None
    ok = culprit is not None and any(c == e or c.startswith(e + ".") or e.startswith(c + ".")
                                     for c in culprit.split(", ") for e in expected_components)
    rec.record("localised", ok)
    return ok
