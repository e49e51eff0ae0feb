"""``report`` runs into a staging directory: a failed run never touches an existing report, a
partial run (``--only``) replaces only its own notebooks' files and the merged metrics / index
(issue 20). papermill is replaced by a fake that copies the notebook and writes its metrics.
Every report directory holds one plotly.js that its pages load; a heartbeat names the running cell."""
from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import pytest

pytest.importorskip("papermill")
import papermill  # noqa: E402

from dsv4lab.__main__ import main  # noqa: E402
from dsv4lab.triage import plots  # noqa: E402
from dsv4lab.triage import report as R  # noqa: E402

NAMES = ["01_alpha", "02_beta", "05_gamma"]


@pytest.fixture
def nb_dir(tmp_path) -> Path:
    d = tmp_path / "notebooks"
    d.mkdir()
    src = next(R.NOTEBOOK_DIR.glob("01_*.ipynb"))
    for n in NAMES:
        shutil.copy(src, d / f"{n}.ipynb")
    return d


@pytest.fixture
def fake_papermill(monkeypatch):
    """execute_notebook that copies the notebook and records metrics; ``fail`` lists stems that raise."""
    state = {"fail": set(), "value": 1, "env": []}

    def execute_notebook(src, dst, parameters, **kw):
        stem = Path(src).stem
        state["env"].append((os.environ.get(plots.PLOTLYJS_ENV), os.environ.get(plots.HEADLESS_ENV)))
        shutil.copy(src, dst)
        if stem in state["fail"]:
            raise RuntimeError(f"{stem} failed")
        Path(parameters["METRICS_OUT"]).write_text(json.dumps(
            {"notebook": stem, "model": parameters["MODEL"], "metrics": {"x": {"value": state["value"]}}}))

    monkeypatch.setattr(papermill, "execute_notebook", execute_notebook)
    return state


def snapshot(d: Path) -> dict[str, bytes]:
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


def test_failed_partial_run_leaves_report_byte_identical(tmp_path, nb_dir, fake_papermill):
    out = tmp_path / "reports"
    assert R.run_report(out, nb_dir=nb_dir, html_export=False, log=lambda *_: None)["ok"]
    before = snapshot(out)
    assert {"index.html", "summary.json", "metrics.json", "05_gamma.metrics.json"} <= set(before)
    fake_papermill["fail"] = {"05_gamma"}
    s = R.run_report(out, nb_dir=nb_dir, only=["05"], html_export=False, log=lambda *_: None)
    assert not s["ok"] and [r["name"] for r in s["notebooks"]] == ["05_gamma"]
    assert snapshot(out) == before
    assert (tmp_path / "reports.failed" / "05_gamma.ipynb").is_file()  # the failed run, kept to look at
    assert not list(tmp_path.glob(".reports.staging-*"))


def test_partial_run_updates_only_its_notebooks(tmp_path, nb_dir, fake_papermill):
    out = tmp_path / "reports"
    R.run_report(out, nb_dir=nb_dir, html_export=False, log=lambda *_: None)
    before = snapshot(out)
    fake_papermill["value"] = 2
    assert R.run_report(out, nb_dir=nb_dir, only=["02"], html_export=False, log=lambda *_: None)["ok"]
    after = snapshot(out)
    changed = {k for k in after if after[k] != before.get(k)}
    assert changed <= {"02_beta.metrics.json", "02_beta.ipynb", "metrics.json", "summary.json", "index.html"}
    assert "02_beta.metrics.json" in changed and set(after) == set(before)
    merged = json.loads((out / "metrics.json").read_text())["notebooks"]
    assert {nb: m["x"]["value"] for nb, m in merged.items()} == {"01_alpha": 1, "02_beta": 2, "05_gamma": 1}
    summary = json.loads((out / "summary.json").read_text())
    assert [r["name"] for r in summary["notebooks"]] == NAMES and summary["ok"]


def test_first_run_keeps_failures_visible(tmp_path, nb_dir, fake_papermill):
    fake_papermill["fail"] = {"02_beta"}
    out = tmp_path / "reports"
    s = R.run_report(out, nb_dir=nb_dir, html_export=False, log=lambda *_: None)
    assert not s["ok"]
    summary = json.loads((out / "summary.json").read_text())
    assert {r["name"]: r["status"] for r in summary["notebooks"]}["02_beta"] == "FAILED"


def test_cli_bad_model_leaves_report_byte_identical(tmp_path, nb_dir, fake_papermill, capsys, monkeypatch):
    out = tmp_path / "reports"
    R.run_report(out, nb_dir=nb_dir, html_export=False, log=lambda *_: None)
    before = snapshot(out)
    assert main(["report", "--only", "05", "--model", str(tmp_path / "no-such-model"), "--out", str(out)]) == 2
    assert snapshot(out) == before
    assert capsys.readouterr().err.startswith("dsv4lab report: --model")


def test_one_shared_plotlyjs_kept_by_partial_runs(tmp_path, nb_dir, fake_papermill, monkeypatch):
    """The kernels are told to load plotly.min.js (headless); the file is plotly's own, written once per
    report directory, and a partial run keeps it; the variables are gone after the run."""
    from plotly.offline import get_plotlyjs

    monkeypatch.delenv(plots.PLOTLYJS_ENV, raising=False)
    monkeypatch.delenv(plots.HEADLESS_ENV, raising=False)
    out = tmp_path / "reports"
    R.run_report(out, nb_dir=nb_dir, html_export=False, log=lambda *_: None)
    assert [p.name for p in out.glob("*.js")] == ["plotly.min.js"]
    assert (out / "plotly.min.js").read_text(encoding="utf-8") == get_plotlyjs()
    assert fake_papermill["env"] == [("plotly.min.js", "1")] * len(NAMES)
    assert plots.PLOTLYJS_ENV not in os.environ and plots.HEADLESS_ENV not in os.environ
    R.run_report(out, nb_dir=nb_dir, only=["02"], html_export=False, log=lambda *_: None)
    assert [p.name for p in out.glob("*.js")] == ["plotly.min.js"]
    assert (out / "plotly.min.js").read_text(encoding="utf-8") == get_plotlyjs()


def test_show_references_the_shared_file(monkeypatch):
    """Under the report runner the first figure loads plotly.js by URL, later ones not at all; elsewhere
    it is inlined once."""
    import IPython.display
    import plotly.graph_objects as go

    shown = []
    monkeypatch.setattr(IPython.display, "display", lambda obj: shown.append(obj.data))
    fig = go.Figure(go.Bar(x=[1], y=[2]))
    monkeypatch.setenv(plots.PLOTLYJS_ENV, "plotly.min.js")
    plots.reset()
    plots.show(fig)
    plots.show(fig)
    assert '<script charset="utf-8" src="plotly.min.js"></script>' in shown[0]
    assert all("plotly.js v" not in h for h in shown) and "plotly.min.js" not in shown[1]
    monkeypatch.delenv(plots.PLOTLYJS_ENV)
    plots.reset()
    plots.load_plotlyjs()
    plots.show(fig)
    assert "plotly.js v" in shown[2] and "plotly.js v" not in shown[3] and len(shown[3]) < 100_000
    plots.reset()


def test_heartbeat_names_the_running_cell():
    import nbformat

    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("1") for _ in range(3)])
    nb.cells[1].metadata["papermill"] = {"status": "running"}
    lines = []
    with R.Heartbeat("04_x", 0.05, lines.append) as hb:
        time.sleep(0.02)
        assert hb.line().endswith("starting the kernel")
        hb.watch(nb)
        time.sleep(0.3)
        nb.cells[1].metadata["papermill"]["status"] = "completed"
        assert hb.line().endswith("between cells")
        for c in nb.cells:
            c.metadata["papermill"] = {"status": "completed"}
        assert hb.line().endswith("all cells done, closing")
        nb.cells[1].metadata["papermill"]["status"] = "running"
        time.sleep(0.15)
    n = len(lines)
    time.sleep(0.15)
    assert n >= 2 and len(lines) == n  # stops with the notebook
    assert lines[-1].strip().startswith("04_x: 0 s, cell 2/3")
    with R.Heartbeat("quiet", 0, lines.append):
        time.sleep(0.1)
    assert len(lines) == n


def test_report_path_needs_no_gpu_extras():
    """`make report` installs neither triton nor nvidia-cutlass-dsl: every triage module imports, a
    session opens (``load`` installs kernels only on CUDA) and runs, with both made unimportable."""
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent('''
        import importlib, pkgutil, sys
        class Block:
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in ("triton", "cutlass"):
                    raise ImportError(f"{name} is not installed (make report)")
        sys.meta_path.insert(0, Block())
        import dsv4lab.triage as T
        for m in pkgutil.iter_modules(T.__path__):
            importlib.import_module(f"dsv4lab.triage.{m.name}")
        from dsv4lab.triage import decode_view
        from dsv4lab.triage.session import open_session
        S = open_session(None, "cpu")
        dc = decode_view.run(S, S.encode("The capital of France is"), steps=2)
        print("ok", S.model(S.encode("Hello")).shape[-1], [k for k in sys.modules if k.split(".")[0] in ("triton", "cutlass")])
    ''')
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                       cwd=Path(__file__).resolve().parents[1])
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split()[0] == "ok" and r.stdout.rstrip().endswith("[]"), r.stdout
