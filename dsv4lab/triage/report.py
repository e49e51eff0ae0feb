"""``python -m dsv4lab report``: run every notebook in ``notebooks/`` with papermill on one
model, export each to offline HTML, merge the metrics, write an index.

    reports/<name>.ipynb   executed notebook          reports/<name>.html   its HTML export
    reports/<name>.metrics.json                       reports/metrics.json  all metrics merged
    reports/index.html     links, status, time per notebook, the nightly regression verdict
    reports/plotly.min.js  the one copy of plotly.js that every page and notebook above loads

While a notebook runs, a heartbeat line every ``heartbeat`` seconds says for how long and which cell.
"""
from __future__ import annotations

import html
import json
import logging
import os
import re
import shutil
import tempfile
import threading
import time
from contextlib import contextmanager
from functools import partial
from pathlib import Path

from ..checkpoint.locate import resolve_path
from .metrics import merge
from .plots import HEADLESS_ENV, PLOTLYJS_ENV

PLOTLYJS = "plotly.min.js"     # the report directory's shared plotly.js (a URL relative to every page)
ENGINE = "dsv4lab-heartbeat"   # papermill engine: nbclient's, telling the heartbeat which cell runs
# the kernel's own log stays out of the report's lines: "running over TCP without encryption" at each start,
# "KeyboardInterrupt caught" when jupyter_client interrupts it on shutdown; a failing cell is reported anyway
KERNEL_ARGS = ["--IPKernelApp.log_level=CRITICAL"]

REPO = Path(__file__).resolve().parents[2]
NOTEBOOK_DIR = REPO / "notebooks"


def discover(nb_dir: str | Path = NOTEBOOK_DIR, only=None) -> list[Path]:
    """Notebooks ``NN_name.ipynb`` in order; ``only``: names / stems / numbers to keep."""
    nbs = sorted(p for p in Path(nb_dir).glob("[0-9][0-9]_*.ipynb"))
    if only:
        keys = {str(o) for o in ([only] if isinstance(only, str) else only)}
        nbs = [p for p in nbs if p.stem in keys or p.name in keys or p.stem[:2] in keys or p.stem[3:] in keys
               or p.stem.split("_")[0].lstrip("0") in keys]
    return nbs


_REMOTE_SCRIPT = re.compile(r'<script[^>]*src="https?://[^"]*"[^>]*>\s*</script>')


def to_html(executed: str | Path, out: str | Path) -> Path:
    """nbconvert HTML of an executed notebook, usable offline: plotly figures are inline HTML that
    load plotly.js from the report directory's :data:`PLOTLYJS` (see :mod:`dsv4lab.triage.plots`); the CDN require.js tag of the
    template is dropped (with it loaded, plotly.js would register as an AMD module instead of
    ``window.Plotly``; offline it would just fail to load), as is the CDN MathJax (no maths here):
    the page loads nothing from the network."""
    import nbformat  # lazy: heavy optional dependency
    from nbconvert import HTMLExporter  # lazy: heavy optional dependency

    nb = nbformat.read(str(executed), as_version=4)
    body, _ = HTMLExporter(template_name="lab").from_notebook_node(nb)
    body = _REMOTE_SCRIPT.sub("", body)
    Path(out).write_text(body, encoding="utf-8")
    return Path(out)


def _error_of(nb_path: Path) -> str:
    import nbformat  # lazy: heavy optional dependency

    try:
        nb = nbformat.read(str(nb_path), as_version=4)
    except Exception:  # noqa: BLE001
        return ""
    for c in nb.cells:
        for o in c.get("outputs", []):
            if o.get("output_type") == "error":
                return f"{o.get('ename')}: {o.get('evalue')}"
    return ""


class ReportError(ValueError):
    """A report that cannot start as asked (no such notebook, no such model); names the argument."""


def select(nb_dir: str | Path = NOTEBOOK_DIR, only=None) -> list[Path]:
    """:func:`discover`, but an ``only`` entry that matches no notebook is an error listing the valid ones."""
    nbs = discover(nb_dir)
    keys = [] if not only else [str(o) for o in ([only] if isinstance(only, str) else only)]
    unknown = [k for k in keys if not discover(nb_dir, [k])]
    if unknown or not nbs:
        valid = ", ".join(p.stem for p in nbs) or f"none in {nb_dir}"
        raise ReportError(f"--only {' '.join(unknown)}: no such notebook; valid: {valid} "
                          f"(a name, a stem or a number)")
    return discover(nb_dir, only) if keys else nbs


def check_model(model: str | None) -> None:
    """Fail before any notebook runs when ``model`` names no checkpoint directory or file."""
    path = resolve_path(model)
    if not path.exists():
        raise ReportError(f"--model {model}: no such checkpoint ({path} does not exist)")


def write_plotlyjs(report_dir: Path) -> Path:
    """The plotly.js of the installed plotly, once per report directory (~4.6 MB)."""
    from plotly.offline import get_plotlyjs  # lazy: heavy optional dependency

    p = Path(report_dir) / PLOTLYJS
    p.write_text(get_plotlyjs(), encoding="utf-8")
    return p


@contextmanager
def kernel_env(**env: str):
    """Set environment variables for the kernels started inside the block (they inherit ours)."""
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


class Heartbeat:
    """While a notebook runs, one line every ``every`` seconds: elapsed seconds and the running cell
    (papermill marks it ``running`` in the notebook it executes, which :meth:`watch` is handed).
    Quiet for notebooks shorter than ``every``; ``every=0`` turns it off."""

    def __init__(self, name: str, every: float, log=print) -> None:
        self.name, self.every, self.log = name, every, log
        self.nb = None
        self._stop = threading.Event()
        self._t0 = time.perf_counter()

    def watch(self, nb) -> None:
        self.nb = nb

    def line(self) -> str:
        cells = list(self.nb.cells) if self.nb is not None else []
        status = [c.get("metadata", {}).get("papermill", {}).get("status") for c in cells]
        if "running" in status:
            where = f"cell {status.index('running') + 1}/{len(cells)}"
        elif all(st in (None, "pending") for st in status):
            where = "starting the kernel"
        elif all(st in ("completed", "failed") for st in status):
            where = "all cells done, closing"
        else:
            where = "between cells"
        return f"      {self.name}: {time.perf_counter() - self._t0:.0f} s, {where}"

    def _beat(self) -> None:
        while not self._stop.wait(self.every):
            self.log(self.line())

    def __enter__(self) -> "Heartbeat":
        self._t0 = time.perf_counter()
        if self.every > 0:
            self._thread = threading.Thread(target=self._beat, name=f"heartbeat-{self.name}", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self.every > 0:
            self._thread.join()


def register_engine() -> str:
    """Register (once) papermill's nbclient engine that hands the executed notebook to a :class:`Heartbeat`."""
    from papermill.engines import NBClientEngine, papermill_engines  # lazy: heavy optional dependency

    class HeartbeatEngine(NBClientEngine):
        @classmethod
        def execute_managed_notebook(cls, nb_man, kernel_name, heartbeat: Heartbeat | None = None, **kwargs):
            if heartbeat is not None:
                heartbeat.watch(nb_man.nb)
            return super().execute_managed_notebook(nb_man, kernel_name, **kwargs)

    papermill_engines.register(ENGINE, HeartbeatEngine)  # a dict entry: registering again replaces it
    return ENGINE


def run_report(out: str | Path = "reports", model: str | None = None, device: str = "cpu", only=None,
               parameters: dict | None = None, html_export: bool = True, nb_dir: str | Path = NOTEBOOK_DIR,
               timeout: int = 900, heartbeat: float = 15, log=partial(print, flush=True)) -> dict:
    """Run the notebooks; returns ``{"ok", "notebooks": [{name, status, seconds, error, ...}], "metrics"}``.

    Each notebook's cells run under ``timeout`` seconds each; ``heartbeat``: seconds between the
    progress lines while one runs (0: none). Every page loads the one ``plotly.min.js`` of ``out``.

    The run goes into a staging directory next to ``out``. It replaces ``out`` when ``out`` holds
    no report yet or every notebook ran; a partial run (``only``) replaces only its notebooks'
    files and re-merges ``metrics.json``, ``summary.json`` and the index. A failed run over an
    existing report leaves ``out`` untouched and is kept in ``<out>.failed`` to look at.
    """
    import papermill as pm  # lazy: heavy optional dependency

    logging.getLogger("papermill").setLevel(logging.ERROR)
    nbs = select(nb_dir, only)
    check_model(model)
    out = Path(out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    stage = Path(tempfile.mkdtemp(prefix=f".{out.name}.staging-", dir=out.parent))
    for f in out.glob("*.metrics.json"):  # the nightly notebook reads the other notebooks' metrics
        if f.name.removesuffix(".metrics.json") not in {nb.stem for nb in nbs}:
            shutil.copy2(f, stage / f.name)
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # the kernels inherit it (see session.set_threads)
    write_plotlyjs(stage)
    engine = register_engine()
    results = []
    t_all = time.perf_counter()
    for i, nb in enumerate(nbs, 1):
        stem = nb.stem
        mfile = stage / f"{stem}.metrics.json"
        params = {"MODEL": model, "DEVICE": device, "METRICS_OUT": str(mfile), "REPORT_DIR": str(stage),
                  "INTERACTIVE": False, **(parameters or {})}
        t0 = time.perf_counter()
        status, err = "ok", ""
        try:
            with kernel_env(**{PLOTLYJS_ENV: PLOTLYJS, HEADLESS_ENV: "1"}), Heartbeat(stem, heartbeat, log) as hb:
                pm.execute_notebook(str(nb), str(stage / nb.name), parameters=params, kernel_name="python3",
                                    cwd=str(stage), progress_bar=False, log_output=False, execution_timeout=timeout,
                                    engine_name=engine, heartbeat=hb, extra_arguments=KERNEL_ARGS)
        except Exception as e:  # noqa: BLE001 - papermill error: keep going, report it
            status = "FAILED"
            err = _error_of(stage / nb.name) or f"{type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e).strip() else ''}"
        secs = time.perf_counter() - t0
        n_metrics = len(json.loads(mfile.read_text())["metrics"]) if mfile.exists() else 0
        if html_export and (stage / nb.name).exists():
            try:
                to_html(stage / nb.name, stage / f"{stem}.html")
            except Exception as e:  # noqa: BLE001
                err = (err + "; " if err else "") + f"html export failed: {e}"
        results.append({"name": stem, "status": status, "seconds": round(secs, 1), "metrics": n_metrics, "error": err})
        line = f"[{i}/{len(nbs)}] {stem:34s} {status:6s} {secs:6.1f}s  {n_metrics:4d} metrics"
        log(line + (f"  -- {err.splitlines()[0][:160]}" if err else ""))
    total = time.perf_counter() - t_all
    ok = all(r["status"] == "ok" for r in results)
    previous = out / "summary.json"
    if not ok and previous.exists():
        failed = out.parent / f"{out.name}.failed"
        shutil.rmtree(failed, ignore_errors=True)
        stage.rename(failed)
        log(f"report: {sum(r['status'] == 'ok' for r in results)}/{len(results)} notebooks ok; the report in {out} "
            f"is left as it was, this run is in {failed}")
        return {"ok": False, "notebooks": results, "seconds": round(total, 1), "model": model or "embedded",
                "device": device, "out": str(failed)}
    kept = json.loads(previous.read_text())["notebooks"] if previous.exists() else []
    ran = {r["name"] for r in results}
    for stem in ran:
        for suffix in (".ipynb", ".html", ".metrics.json"):
            (out / f"{stem}{suffix}").unlink(missing_ok=True)
    for f in stage.iterdir():
        target = out / f.name
        if target.is_dir():
            shutil.rmtree(target)
        os.replace(f, target)
    stage.rmdir()
    rows = sorted([r for r in kept if r["name"] not in ran] + results, key=lambda r: r["name"])
    merged = merge(sorted(p for p in out.glob("*.metrics.json") if p.name != "metrics.json"))
    (out / "metrics.json").write_text(json.dumps(merged, indent=1) + "\n")
    summary = {"ok": all(r["status"] == "ok" for r in rows), "notebooks": rows, "seconds": round(total, 1),
               "model": model or "embedded", "device": device}
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    write_index(out, summary, merged)
    log(f"report: {sum(r['status'] == 'ok' for r in results)}/{len(results)} notebooks ok in {total:.1f}s -> {out / 'index.html'}")
    return {**summary, "ok": ok, "notebooks": results}


def write_index(out: Path, summary: dict, merged: dict) -> Path:
    rows = []
    for r in summary["notebooks"]:
        link = f'<a href="{r["name"]}.html">{html.escape(r["name"])}</a>' if (out / f"{r['name']}.html").exists() else html.escape(r["name"])
        color = "#2ca02c" if r["status"] == "ok" else "#d62728"
        rows.append(f'<tr><td>{link}</td><td style="color:{color};font-weight:bold">{r["status"]}</td><td>{r["seconds"]}</td>'
                    f'<td>{r["metrics"]}</td><td>{html.escape(r["error"][:300])}</td>'
                    f'<td><a href="{r["name"]}.ipynb">ipynb</a></td></tr>')
    mrows = []
    for nb, ms in merged.get("notebooks", {}).items():
        for k, m in ms.items():
            if k.startswith("fp."):
                continue
            v = json.dumps(m["value"])
            mrows.append(f"<tr><td>{html.escape(nb)}</td><td>{html.escape(k)}</td><td>{html.escape(v[:120])}</td></tr>")
    page = f"""<!doctype html><html><head><meta charset="utf-8"><title>dsv4lab report</title>
<style>body{{font-family:sans-serif;margin:2em}} table{{border-collapse:collapse}} td,th{{border:1px solid #ccc;padding:4px 8px;text-align:left}}</style>
</head><body><h1>dsv4lab triage report</h1>
<p>model: <b>{html.escape(str(merged.get('model') or summary['model']))}</b>, device {html.escape(summary['device'])},
{summary['seconds']} s in all. Status: <b>{'all notebooks ok' if summary['ok'] else 'SOME NOTEBOOKS FAILED'}</b>.
All pages work offline (they load plotly.js from <code>plotly.min.js</code> beside them).</p>
<table><tr><th>notebook</th><th>status</th><th>seconds</th><th>metrics</th><th>error</th><th>source</th></tr>
{''.join(rows)}</table>
<h2>Metrics</h2><p>All metrics in <a href="metrics.json">metrics.json</a> (component fingerprints <code>fp.*</code> omitted here).</p>
<table><tr><th>notebook</th><th>metric</th><th>value</th></tr>{''.join(mrows)}</table></body></html>"""
    p = out / "index.html"
    p.write_text(page, encoding="utf-8")
    return p

