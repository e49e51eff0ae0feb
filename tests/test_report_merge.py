"""``report`` runs into a staging directory: a failed run never touches an existing report, a
partial run (``--only``) replaces only its own notebooks' files and the merged metrics / index
(issue 20). papermill is replaced by a fake that copies the notebook and writes its metrics."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

pytest.importorskip("papermill")
import papermill  # noqa: E402

from dsv4lab.__main__ import main  # noqa: E402
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
    state = {"fail": set(), "value": 1}

    def execute_notebook(src, dst, parameters, **kw):
        stem = Path(src).stem
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
