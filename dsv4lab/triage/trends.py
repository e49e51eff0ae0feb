"""Trend plots over the nightly's stored runs and the history's ``index.html``.

Per series (model + policy), x = the runs oldest first:

* ``kl`` / ``top1``: next-token KL and top-1 agreement against the reference (``vsref.*``);
* ``lens_kl``, ``lens_top1`` (logit lens on both runs' streams), ``layer_cos`` (as 1 - cosine, log),
  ``router_overlap``, ``indexer_overlap``: one line per layer;
* ``metrics``: every scalar metric of the nightly notebook, one at a time (a dropdown);
* ``first_divergence`` (per regressed run and the newest one): the component fingerprint's change
  against the run's baseline laid out as components x layers, the first diverging hook point
  marked; ``rel_err``: each component's relative error against the reference, per layer.

The page loads the history directory's one ``plotly.min.js`` (as the report's pages do).
"""
from __future__ import annotations

import html
import json
import math
from pathlib import Path

from .history import Run, runs
from .plots import heatmap, lines, style, to_html
from .reference_view import split_hook
from .regression import NIGHTLY, fp_prefix

SKIP_PREFIXES = ("fp.", "inputs.", "regression.", "model.", "vsref.rel_err")
PER_LAYER = {"lens_kl": "vsref.lens_kl", "lens_top1": "vsref.lens_top1", "layer_cos": "vsref.layer_cos",
             "router_overlap": "vsref.router_overlap", "indexer_overlap": "vsref.indexer_overlap"}
PER_LAYER_TEXT = {"lens_kl": ("next-token KL (logit lens) against the reference", "KL (nats, log)", True),
                  "lens_top1": ("top-1 agreement (logit lens) with the reference", "fraction of positions", False),
                  "router_overlap": ("router top-k overlap with the reference", "overlap", False),
                  "indexer_overlap": ("indexer top-k overlap with the reference", "overlap", False)}
BASELINE_FILE = "baseline.metrics.json"   # the metrics a run was compared against, kept beside it


def nightly_metrics_of(merged: dict) -> dict:
    """{metric: value} of the nightly notebook in a merged metrics dict."""
    return {k: m["value"] for k, m in merged.get("notebooks", {}).get(NIGHTLY, {}).items()}


def label(run: Run) -> str:
    m = run.manifest
    commit = (m.get("git", {}).get("commit") or "nogit")[:7]
    bug = f" +{m['inject']['bug']}" if m.get("inject") else ""
    return f"{run.date:%m-%d %H:%M:%S} {commit}{bug}"


def is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def series_data(series_runs: list[Run]) -> dict:
    """{"x": labels, "metrics": {name: [value or None per run]}, "per_layer": {kind: {layer: [...]}}}."""
    values = [nightly_metrics_of(r.metrics()) if (r.path / "metrics.json").is_file() else {} for r in series_runs]
    scalars = sorted({k for v in values for k, x in v.items() if is_number(x) and not k.startswith(SKIP_PREFIXES)})
    per_layer = {}
    for kind, key in PER_LAYER.items():
        layers = sorted({l for v in values for l in (v.get(key) or {})}, key=int)
        if layers:
            per_layer[kind] = {l: [(v.get(key) or {}).get(l) for v in values] for l in layers}
    return {"x": [label(r) for r in series_runs], "metrics": {k: [v.get(k) if is_number(v.get(k)) else None for v in values]
                                                              for k in scalars},
            "per_layer": per_layer}


def metric_figure(data: dict, first: str | None = None):
    """Every scalar metric over the runs, one shown at a time (dropdown)."""
    import plotly.graph_objects as go  # lazy: heavy optional dependency

    names = list(data["metrics"])
    first = first if first in names else (names[0] if names else None)
    fig = go.Figure([go.Scatter(x=data["x"], y=data["metrics"][n], mode="lines+markers", name=n, visible=n == first)
                     for n in names])
    buttons = [{"label": n, "method": "update", "args": [{"visible": [m == n for m in names]}, {"yaxis.title.text": n}]}
               for n in names]
    fig.update_layout(updatemenus=[{"buttons": buttons, "direction": "down", "x": 1.0, "xanchor": "right", "y": 1.15,
                                    "active": names.index(first) if first else 0}], showlegend=False)
    return style(fig, "Every nightly metric over the stored runs (pick one)", "run", first)


def trend_figures(data: dict) -> dict:
    """name -> figure for one series (see the module doc); per-layer kinds only where recorded."""
    figs = {}
    for key, title, y in (("vsref.kl", "Next-token KL against the reference", "KL (nats)"),
                          ("vsref.top1", "Top-1 agreement with the reference", "fraction of positions")):
        if key in data["metrics"]:
            figs[key.split(".")[1]] = lines(data["x"], {key: data["metrics"][key]}, title, "run", y)
    for kind, by_layer in data["per_layer"].items():
        if kind == "layer_cos":
            series = {f"L{l}": [None if c is None else max(1 - c, 1e-12) for c in v] for l, v in by_layer.items()}
            figs[kind] = lines(data["x"], series, "Per layer: 1 - cosine(residual streams, reference)", "run",
                               "1 - cosine (log)", log_y=True, legend="layer")
        else:
            what, y, log_y = PER_LAYER_TEXT[kind]
            figs[kind] = lines(data["x"], {f"L{l}": v for l, v in by_layer.items()}, f"Per layer: {what}", "run", y,
                               log_y=log_y, legend="layer")
    figs["metrics"] = metric_figure(data, "vsref.kl")
    for f in figs.values():
        f.update_xaxes(type="category")   # run labels, in storage order
    return figs


def layer_grid(values: dict) -> tuple[list[str], list[int], dict]:
    """{hook name: v} (execution order) -> (component rows in a layer's execution order, layers,
    {(row, layer): v}); hooks outside the layers dropped. A hook that only some layers have (the
    compressor) goes after the hook it follows in those layers."""
    rows, seqs, cells = [], {}, {}
    for name, v in values.items():
        layer, hook = split_hook(name)
        if layer is None:
            continue
        seqs.setdefault(layer, []).append(hook)
        cells[(hook, layer)] = v
    for seq in seqs.values():
        for i, hook in enumerate(seq):
            if hook not in rows:
                rows.insert(rows.index(seq[i - 1]) + 1 if i else 0, hook)
    return rows, sorted(seqs), cells


def fingerprint_change(current: dict, baseline: dict, input: str = "") -> dict:
    """{hook: |fp_cur - fp_base| / max(|fp_base|, 1e-6)} (integer checksums: 0 or 1) in execution order,
    on one fingerprint input ("": the chat prompt, keys ``fp.<hook>``; else keys ``fp.<input>.<hook>``)."""
    others = {k[3:-6] for k in current if k.startswith("fp.") and k.endswith(".order") and k != "fp.order"}
    pre = fp_prefix(input)
    out = {}
    for k, v in current.items():
        if not k.startswith(pre) or k.endswith(".order") or k not in baseline:
            continue
        hook = k[len(pre):]
        if not input and any(hook.startswith(o + ".") for o in others):
            continue
        b = baseline[k]
        if isinstance(v, float) or isinstance(b, float):
            out[hook] = abs(float(v) - float(b)) / max(abs(float(b)), 1e-6) if is_number(v) and is_number(b) else float("inf")
        else:
            out[hook] = float(v != b)
    return out


def first_divergence_figure(run: Run):
    """Components x layers: log10 of the fingerprint's relative change against the run's baseline,
    the first diverging hook point (the manifest's) outlined; None without a stored baseline."""
    bfile = run.path / BASELINE_FILE
    if not bfile.is_file() or not (run.path / "metrics.json").is_file():
        return None
    change = fingerprint_change(nightly_metrics_of(run.metrics()), nightly_metrics_of(json.loads(bfile.read_text())),
                                run.manifest.get("first_input") or "")
    rows, layers, cells = layer_grid(change)
    if not rows:
        return None
    z = [[None if (r, l) not in cells else math.log10(max(min(cells[(r, l)], 1e6), 1e-12)) for l in layers] for r in rows]
    first = run.manifest.get("first_hook")
    fig = heatmap(z, f"First divergence against the baseline: {label(run)}", "layer", "component hook point",
                  x=[f"L{l}" for l in layers], y=rows, colorbar="log10 rel. change", colorscale="Reds",
                  height=max(420, 22 * len(rows) + 140))
    layer, hook = split_hook(first) if first else (None, None)
    if layer is not None and hook in rows:
        fig.add_shape(type="rect", x0=layers.index(layer) - 0.5, x1=layers.index(layer) + 0.5, y0=rows.index(hook) - 0.5,
                      y1=rows.index(hook) + 0.5, line={"color": "#1f77b4", "width": 3})
        fig.add_annotation(x=f"L{layer}", y=hook, text=f"first: {first}", showarrow=True, ax=60, ay=-30)
    return fig


def rel_err_figure(run: Run):
    """Components x layers: each component's relative error against the reference (``vsref.rel_err``)."""
    if not (run.path / "metrics.json").is_file():
        return None
    rel = nightly_metrics_of(run.metrics()).get("vsref.rel_err") or {}
    rows, layers, cells = layer_grid(rel)
    if not rows:
        return None
    z = [[None if (r, l) not in cells else math.log10(max(cells[(r, l)], 1e-12)) for l in layers] for r in rows]
    fig = heatmap(z, f"Relative error against the reference, per layer: {label(run)}", "layer", "component output",
                  x=[f"L{l}" for l in layers], y=rows, colorbar="log10 rel. err", height=max(420, 22 * len(rows) + 140))
    return fig


def _runs_table(all_runs: list[Run], history: Path) -> str:
    rows = []
    for r in reversed(all_runs):
        m = r.manifest
        color = {"ok": "#2ca02c", "regressed": "#d62728"}.get(m.get("status"), "#ff7f0e")
        rel = r.path.relative_to(history).as_posix()
        nb = f'<a href="{rel}/{NIGHTLY}.html">notebook</a>' if (r.path / f"{NIGHTLY}.html").is_file() else ""
        ft = m.get("failing_tensors") or {}
        tens = f'{ft.get("compressed_bytes", 0) / 1e6:.2f} MB ({len(ft.get("kept", []))} tensors)' if ft else ""
        rows.append(
            f"<tr><td>{html.escape(label(r))}</td><td>{html.escape(m['model'])}</td><td>{html.escape(m['policy'])}</td>"
            f"<td style=\"color:{color};font-weight:bold\">{html.escape(str(m.get('status')))}</td>"
            f"<td>{html.escape(m.get('line', ''))}</td><td>{tens}</td>"
            f'<td>{nb} <a href="{rel}/manifest.json">manifest</a></td></tr>')
    return ("<table><tr><th>run</th><th>model</th><th>policy</th><th>status</th><th>verdict</th><th>failing tensors</th>"
            f"<th>files</th></tr>{''.join(rows)}</table>")


def write_index(history: str | Path) -> tuple[Path, dict]:
    """Write ``HISTORY/index.html`` (expects ``HISTORY/plotly.min.js``); returns (path, {series: {name: figure}})."""
    history = Path(history)
    all_runs = runs(history)
    by_series: dict[tuple, list[Run]] = {}
    for r in all_runs:
        by_series.setdefault(r.series, []).append(r)
    parts, figures = [], {}
    for (model, policy), rs in by_series.items():
        figs = trend_figures(series_data(rs))
        for r in rs:
            if r.manifest.get("status") == "regressed" or r is rs[-1]:
                for name, f in (("first_divergence", first_divergence_figure(r)), ("rel_err", rel_err_figure(r))):
                    if f is not None:
                        figs[f"{name} {r.id}"] = f
        figures[f"{model} / {policy}"] = figs
        body = "".join(f'<div class="fig">{to_html(f, include_plotlyjs=False)}</div>' for f in figs.values())
        parts.append(f"<h2>{html.escape(model)} &mdash; policy {html.escape(policy)} ({len(rs)} runs)</h2>{body}")
    page = f"""<!doctype html><html><head><meta charset="utf-8"><title>dsv4lab nightly history</title>
<script charset="utf-8" src="plotly.min.js"></script>
<style>body{{font-family:sans-serif;margin:2em}} table{{border-collapse:collapse}} td,th{{border:1px solid #ccc;padding:4px 8px;text-align:left}}</style>
</head><body><h1>dsv4lab nightly history</h1>
<p>{len(all_runs)} stored runs in {html.escape(str(history))}; the page works offline (plotly.js from <code>plotly.min.js</code> beside it).</p>
{_runs_table(all_runs, history)}
{''.join(parts)}</body></html>"""
    p = history / "index.html"
    p.write_text(page, encoding="utf-8")
    return p, figures


__all__ = ["BASELINE_FILE", "fingerprint_change", "first_divergence_figure", "metric_figure", "rel_err_figure",
           "series_data", "trend_figures", "write_index"]
