"""Plotly helpers: consistent titles / axis labels and display that works offline.

``show(fig)`` emits the figure as HTML and loads plotly.js once per kernel (later figures reuse
``window.Plotly``), so the executed notebook and its nbconvert HTML export need no CDN:

* under the report runner (``$DSV4LAB_PLOTLYJS`` set, e.g. ``plotly.min.js``) the first figure
  references that one shared file of the report directory: no page carries its own 4.6 MB copy;
* anywhere else (JupyterLab, a bare papermill run) plotly.js is embedded inline once.

``headless()`` is true under the report runner (``$DSV4LAB_HEADLESS``): no front end is there to
show a widget's Output area. ``write_html`` writes a standalone offline page.
"""
from __future__ import annotations

import os
from typing import Sequence

PLOTLYJS_ENV = "DSV4LAB_PLOTLYJS"   # URL (relative to the page) of the shared plotly.js
HEADLESS_ENV = "DSV4LAB_HEADLESS"   # "1": no front end (papermill under the report runner)

_PLOTLYJS_SENT = False
_HEIGHT = 420


def headless() -> bool:
    """True when no front end renders widgets (the report runner sets ``$DSV4LAB_HEADLESS``)."""
    return os.environ.get(HEADLESS_ENV, "") not in ("", "0")


def plotlyjs_source() -> bool | str:
    """``include_plotlyjs`` for the first figure: the shared file's URL, or True (inline)."""
    return os.environ.get(PLOTLYJS_ENV) or True


def style(fig, title: str, x: str | None = None, y: str | None = None, height: int | None = None, legend: str | None = None):
    fig.update_layout(title={"text": title, "x": 0.01, "xanchor": "left"}, template="plotly_white",
                      height=height or _HEIGHT, margin={"l": 70, "r": 30, "t": 60, "b": 60},
                      font={"size": 13})
    if x is not None:
        fig.update_xaxes(title_text=x)
    if y is not None:
        fig.update_yaxes(title_text=y)
    if legend is not None:
        fig.update_layout(legend_title_text=legend)
    return fig


def reset() -> None:
    """Forget that plotly.js was sent (the next ``show`` embeds it again)."""
    global _PLOTLYJS_SENT
    _PLOTLYJS_SENT = False


def to_html(fig, include_plotlyjs: bool | str = True) -> str:
    return fig.to_html(full_html=False, include_plotlyjs=include_plotlyjs, config={"displaylogo": False, "responsive": True})


def load_plotlyjs() -> None:
    """Display the plotly.js loader as an output of its own (once per kernel), so a figure shown
    later inside a widget's Output area carries no 4.6 MB of script (the same tag plotly writes)."""
    global _PLOTLYJS_SENT
    from IPython.display import HTML, display  # lazy: heavy optional dependency

    if _PLOTLYJS_SENT:
        return
    src = plotlyjs_source()
    if src is True:
        from plotly.offline import get_plotlyjs  # lazy: heavy optional dependency

        tag = f'<script type="text/javascript">{get_plotlyjs()}</script>'
    else:
        tag = f'<script charset="utf-8" src="{src}"></script>'
    display(HTML('<script type="text/javascript">window.PlotlyConfig = {MathJaxConfig: \'local\'};</script>' + tag))
    _PLOTLYJS_SENT = True


def show(fig) -> None:
    """Display ``fig`` in a notebook as HTML that works offline (plotly.js loaded once per kernel)."""
    global _PLOTLYJS_SENT
    from IPython.display import HTML, display  # lazy: heavy optional dependency

    html = to_html(fig, include_plotlyjs=False if _PLOTLYJS_SENT else plotlyjs_source())
    _PLOTLYJS_SENT = True
    display(HTML(html))


def write_html(fig, path) -> str:
    fig.write_html(str(path), include_plotlyjs=True, full_html=True)
    return str(path)


# ------------------------------------------------------------------------------ builders
def bar(x: Sequence, y: Sequence, title: str, xlabel: str, ylabel: str, text=None, color=None, horizontal: bool = False):
    import plotly.graph_objects as go  # lazy: heavy optional dependency

    if horizontal:
        fig = go.Figure(go.Bar(x=list(y), y=list(x), orientation="h", text=text, marker_color=color))
        style(fig, title, ylabel, xlabel)
        fig.update_yaxes(autorange="reversed", type="category")
    else:
        fig = go.Figure(go.Bar(x=list(x), y=list(y), text=text, marker_color=color))
        style(fig, title, xlabel, ylabel)
        fig.update_xaxes(type="category")
    return fig


def lines(x: Sequence, series: dict, title: str, xlabel: str, ylabel: str, log_y: bool = False, markers: bool = True,
          legend: str | None = None):
    import plotly.graph_objects as go  # lazy: heavy optional dependency

    fig = go.Figure()
    for name, ys in series.items():
        fig.add_trace(go.Scatter(x=list(x), y=list(ys), name=str(name), mode="lines+markers" if markers else "lines"))
    style(fig, title, xlabel, ylabel, legend=legend)
    if log_y:
        fig.update_yaxes(type="log")
    return fig


def heatmap(z, title: str, xlabel: str, ylabel: str, x=None, y=None, colorbar: str = "", colorscale: str = "Viridis",
            zmin=None, zmax=None, height: int | None = None, hover: str | None = None):
    import plotly.graph_objects as go  # lazy: heavy optional dependency

    fig = go.Figure(go.Heatmap(z=z, x=x, y=y, colorscale=colorscale, zmin=zmin, zmax=zmax,
                               colorbar={"title": {"text": colorbar}}, hovertemplate=hover))
    style(fig, title, xlabel, ylabel, height=height)
    fig.update_yaxes(autorange="reversed")
    return fig
