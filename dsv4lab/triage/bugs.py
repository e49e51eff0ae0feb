"""Bug-zoo glue for notebooks 6 and 7 (on top of :mod:`dsv4lab.bugzoo`)."""
from __future__ import annotations

from ..analysis.components import owner_of
from ..bugzoo import inject as _inject
from ..bugzoo import list_bugs
from .plots import style


def bug_table():
    return list_bugs()


def inject(model, bug: str | None, layers=None):
    """Inject ``bug`` (None / "" -> nothing); returns the handle (``.names``, ``.restore()``) or None."""
    if not bug:
        return None

    if isinstance(layers, int):
        layers = [layers]
    h = _inject(model, bug, layers=layers)
    if not getattr(h, "applicable", True):
        raise ValueError(f"bug {bug!r} does not apply to this model: {h.reason}")
    return h


def injected_components(model, handle) -> list[str]:
    """The components the bug went into, as the hook owners where it first shows."""
    return sorted({owner_of(model, n) for n in handle.names}) if handle is not None else []


def component_of_hook(hook: str | None) -> str | None:
    """``layers.2.attn.compressor.hook_entries`` -> ``layers.2.attn.compressor``."""
    if hook is None:
        return None
    return hook.rsplit(".", 1)[0] if "." in hook else "(model)"


def divergence_figure(table, title: str):
    """rel_err per hook point in execution order (first firing), log scale."""
    import plotly.graph_objects as go  # lazy: heavy optional dependency


    t = table[table["firing"] == 0].copy()
    t = t[t["status"] == "ok"]
    y = t["rel_err"].clip(lower=1e-12)
    colors = ["#d62728" if d else "#2ca02c" for d in t["diverged"]]
    fig = go.Figure(go.Scatter(x=list(range(len(t))), y=y, mode="markers", marker={"color": colors, "size": 6},
                               text=t["name"], hovertemplate="%{text}<br>rel err %{y:.3g}<extra></extra>"))
    style(fig, title, "hook point, in execution order (hover for the name)", "relative error vs clean (log; 0 shown as 1e-12)")
    fig.update_yaxes(type="log")
    return fig
