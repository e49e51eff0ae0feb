"""`python -m dsv4lab nightly`: three stored runs of the embedded model on CPU (clean, a zoo bug
injected, clean) give trend plots with three points per metric; the bugged run exits 1 with one
line naming the component; its failing tensors are kept within the budget; the manifest says
what ran where. Pruning and the failing-tensor budget are also checked on their own, without
running a notebook."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest
import torch

from dsv4lab.triage import history as H
from dsv4lab.triage.failing import FILE, capture_failing, layer_priority, load_failing

REPO = Path(__file__).resolve().parents[1]
BUG, BUG_LAYERS, BUG_COMPONENT = "compressor_ape_on_kv", [2], "layers.2.attn.compressor"
NOW = datetime(2026, 12, 2, 3, 0, tzinfo=timezone.utc)


# ------------------------------------------------------------------------------ pruning (pure)
def _day(d: int) -> datetime:
    return NOW - timedelta(days=d)


def _at(text: str, good: bool = True, series=("m", "w4a16")) -> H.Stored:
    return H.Stored(text, datetime.fromisoformat(text.split("/")[0]).replace(tzinfo=timezone.utc), series, good)


def test_prune_plan_daily_then_weekly():
    """NOW is Wed 2026-12-02: every run after 11-02 (30 days); then, per ISO week down to 10-05
    (4 weeks more), the newest good run; nothing older (the newest good run is recent)."""
    stored = [_at("2026-12-01T03:00"), _at("2026-11-05T03:00"), _at("2026-11-20T03:00"), _at("2026-11-20T09:00"),
              _at("2026-10-30T03:00"), _at("2026-10-28T03:00"),                        # ISO week 44: newest kept
              _at("2026-10-20T03:00"), _at("2026-10-22T03:00", good=False),           # week 43: the good one kept
              _at("2026-09-01T03:00")]                                                 # beyond the weekly tier
    keep = H.prune_plan(stored, NOW, keep_daily=30, keep_weekly=4)
    assert keep == {"2026-12-01T03:00", "2026-11-05T03:00", "2026-11-20T03:00", "2026-11-20T09:00",
                    "2026-10-30T03:00", "2026-10-20T03:00"}
    assert H.prune_plan(stored, NOW, keep_daily=60, keep_weekly=0) == {x.id for x in stored} - {"2026-09-01T03:00"}


def test_prune_plan_keeps_each_series_baseline_and_weekly_forever():
    a, b = ("m1", "w4a16"), ("m2", "w4a16")
    stored = [_at("2026-03-01T00:00", series=a), _at("2026-12-01T00:00", good=False, series=a),
              _at("2026-01-02T00:00", series=b), _at("2026-01-05T00:00", series=b), _at("2026-01-06T00:00", series=b),
              _at("2026-08-01T00:00", series=b)]
    # a's only good run is its rolling baseline: kept however old; b's newest good run likewise
    assert H.prune_plan(stored, NOW, keep_daily=30, keep_weekly=0) == {"2026-03-01T00:00", "2026-12-01T00:00",
                                                                       "2026-08-01T00:00"}
    # weekly for ever: one per ISO week (2026-01-02 is in week 1, 01-05 and 01-06 in week 2)
    assert H.prune_plan(stored, NOW, keep_daily=30, keep_weekly=None) == {x.id for x in stored} - {"2026-01-05T00:00"}


def test_prune_deletes_folders(tmp_path):
    for i, d in enumerate((0, 45, 46)):
        run = tmp_path / H.RUNS / f"r{i}"
        run.mkdir(parents=True)
        H.write_manifest(run, {"run": f"r{i}", "date": _day(d).isoformat(), "model": "m", "policy": "p",
                               "status": "regressed", "inject": None})
    gone = H.prune(tmp_path, NOW, keep_daily=30, keep_weekly=0, also=("r2",))   # r2: the run just made
    assert gone == ["r1"] and [r.id for r in H.runs(tmp_path)] == ["r2", "r0"]


# ------------------------------------------------------------------------------ arguments and the page (no notebook)
def _exit_status(argv) -> int:
    from dsv4lab.__main__ import main

    try:
        return main(argv)
    except SystemExit as e:  # argparse-level refusals exit through SystemExit
        return e.code


@pytest.mark.parametrize("argv, words", [
    ([], "--history"),
    (["--inject", "compresor_ape_on_kv"], "did you mean 'compressor_ape_on_kv'"),
    (["--inject-layers", "2"], "--inject-layers without --inject"),
    (["--inject", "compressor_ape_on_kv", "--inject-layers", "2", "99"], "99 is no layer index of this model (use "
                                                                          "ints in 0..5"),
    (["--policy", "w4a17"], "did you mean 'w4a16'"),
    (["--keep-daily", "-1"], "--keep-daily"),
    (["--model", "/no/such/ckpt"], "--model /no/such/ckpt"),
    (["--device", "cuda:x"], "--device cuda:x"),
])
def test_bad_arguments_one_line_exit_2(capsys, tmp_path, argv, words):
    h = [] if not argv else ["--history", str(tmp_path / "h")]
    assert _exit_status(["nightly", *h, *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("dsv4lab nightly: ") and words in err, err
    assert not (tmp_path / "h").exists()                 # refused before anything ran


def _fake_run(history, i: int, status: str, value: float | None):
    run = history / H.RUNS / f"r{i}"
    run.mkdir(parents=True)
    H.write_manifest(run, {"run": f"r{i}", "date": _day(3 - i).isoformat(), "model": "m", "policy": "p",
                           "status": status, "inject": None, "git": {"commit": "abc"}, "line": status})
    if value is not None:
        nb = {"vsref.kl": {"value": value}, "vsref.layer_cos": {"value": {"0": 1 - value, "1": 1 - 2 * value}},
              "fp.layers.0.attn.hook_out": {"value": value}}
        (run / "metrics.json").write_text(json.dumps({"model": "m", "notebooks": {"07_nightly_regression": nb}}))


def test_trend_page_tolerates_a_failed_run(tmp_path):
    """A run that failed before writing metrics is a gap in the trends, not a broken page."""
    from dsv4lab.triage.trends import write_index

    for i, (status, v) in enumerate([("ok", 0.1), ("failed", None), ("ok", 0.3)]):
        _fake_run(tmp_path, i, status, v)
    page, figures = write_index(tmp_path)
    figs = figures["m / p"]
    assert list(figs["kl"].data[0].y) == [0.1, None, 0.3] and len(figs["layer_cos"].data) == 2
    assert "failed" in page.read_text()


# ------------------------------------------------------------------------------ failing tensors (no notebook)
def test_failing_tensors_bounded_and_prioritised(tmp_path):
    from dsv4lab.triage.session import open_session

    S = open_session("random")
    m = S.model
    ids = S.encode("What is the capital of France?", "chat")
    first = "layers.2.attn.compressor.hook_entries"
    assert layer_priority(6, first) == [2, 1, 3, 0, 4, 5]
    full = capture_failing(m, ids, first, tmp_path / "full", budget=64 << 20)
    assert full["dropped"] == [] and full["kept"][:2] == [first, "layers.2.hook_resid_post"]
    resid = ids.numel() * m.config.hc_mult * m.config.hidden_size * 4
    budget = full["bytes"] - 2 * resid                 # room for all but two residual streams
    small = capture_failing(m, ids, first, tmp_path / "small", budget=budget)
    assert small["bytes"] <= budget and len(small["dropped"]) == 2
    assert set(small["dropped"]) == {"layers.4.hook_resid_post", "layers.5.hook_resid_post"}   # the farthest layers
    t = load_failing(tmp_path / "small")
    assert set(t) == set(small["kept"]) | {"input_ids"} and torch.equal(t["input_ids"], ids)
    assert sum(v.numel() * v.element_size() for v in t.values()) == small["bytes"] <= budget
    assert (tmp_path / "small" / FILE).stat().st_size == small["compressed_bytes"]
    _, cache = m.run_with_cache(ids, names=[first])
    assert torch.equal(t[first], cache[first])         # what was kept is the capture itself
    with pytest.raises(ValueError, match="budget"):
        capture_failing(m, ids, first, tmp_path / "x", budget=0)


# ------------------------------------------------------------------------------ three stored runs (notebooks)
@pytest.fixture(scope="module")
def history(tmp_path_factory):
    pytest.importorskip("papermill")
    from dsv4lab.triage.nightly import run_nightly

    h = tmp_path_factory.mktemp("history")
    quiet = {"log": lambda *_: None, "heartbeat": 0}
    first = run_nightly(h, fallback=None, now=datetime.now(timezone.utc) - timedelta(days=2), **quiet)
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    cli = subprocess.run([sys.executable, "-m", "dsv4lab", "nightly", "--history", str(h), "--inject", BUG,
                          "--inject-layers", *map(str, BUG_LAYERS), "--max-failing-mb", "1"],
                         capture_output=True, text=True, env=env, cwd=REPO, timeout=900)
    third = run_nightly(h, **quiet)
    return h, first, cli, third


def test_first_run_starts_the_history(history):
    _, first, _, _ = history
    assert first.exit_code == 0 and first.status == "ok"
    assert "nothing compared" in first.line and first.manifest["baseline"] is None


def test_bugged_run_exits_1_naming_the_component(history):
    h, first, cli, _ = history
    assert cli.returncode == 1, cli.stderr[-2000:]
    out = cli.stdout.strip().splitlines()
    assert len(out) == 1 and out[0].startswith("nightly: REGRESSED")
    assert f"(component {BUG_COMPONENT})" in out[0] and f"first diverging hook point {BUG_COMPONENT}." in out[0]
    assert f"against run {first.run.name}" in out[0]          # the rolling baseline: the first run
    [bug_run] = [r for r in H.runs(h) if r.manifest.get("inject")]
    m = bug_run.manifest
    assert m["status"] == "regressed" and m["first_component"] == BUG_COMPONENT
    assert m["inject"] == {"bug": BUG, "layers": BUG_LAYERS} and m["line"] == out[0]


def test_failing_tensors_stored_and_bounded(history):
    h = history[0]
    [bug_run] = [r for r in H.runs(h) if r.manifest.get("inject")]
    ft = bug_run.manifest["failing_tensors"]
    assert ft["budget"] == 1 << 20 and 0 < ft["bytes"] <= ft["budget"]
    assert ft["kept"][0] == bug_run.manifest["first_hook"] and "layers.2.hook_resid_post" in ft["kept"]
    t = load_failing(bug_run.path)
    assert set(t) == set(ft["kept"]) | {"input_ids"}
    assert (bug_run.path / FILE).stat().st_size == ft["compressed_bytes"]
    clean = [r for r in H.runs(h) if not r.manifest.get("inject")]
    assert all(r.manifest["failing_tensors"] is None and not (r.path / FILE).exists() for r in clean)


def test_third_run_compares_with_the_last_good_run(history):
    _, first, _, third = history
    assert third.exit_code == 0 and third.status == "ok", third.line
    assert third.manifest["baseline"] == f"run {first.run.name}"   # not the bugged run
    assert third.manifest["n_regressed"] == 0 and third.manifest["n_compared"] > 100


def test_manifest_contents(history):
    _, _, _, third = history
    m = json.loads((third.run / "manifest.json").read_text())
    assert m["model"] == "data/tiny-dsv4" and m["policy"] == "default=w4a16" and m["device"]["requested"] == "cpu"
    assert m["versions"]["torch"] == torch.__version__
    assert {"dsv4lab", "transformers", "triton", "python"} <= set(m["versions"])
    git = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    assert m["git"]["commit"] == git and isinstance(m["git"]["dirty"], bool)
    assert m["seeds"]["fingerprint"] == 1234 and m["argv"]
    assert third.run.name.startswith(datetime.fromisoformat(m["date"]).strftime("%Y%m%dT%H%M%SZ"))
    assert f"_{git[:10]}" in third.run.name and third.run.name.endswith("_w4a16")
    assert (third.run / "plotly.min.js").resolve() == (third.run.parents[1] / "plotly.min.js").resolve()


def test_trend_plots_three_points_per_metric(history):
    from dsv4lab.triage.trends import write_index

    h = history[0]
    page, figures = write_index(h)
    [figs] = figures.values()                  # one series: the embedded model in w4a16
    for name in ("kl", "top1", "lens_kl", "lens_top1", "layer_cos", "router_overlap", "indexer_overlap", "metrics"):
        assert name in figs, sorted(figs)
        for tr in figs[name].data:
            assert len(tr.x) == 3 and len(tr.y) == 3, (name, tr.name)
    names = {tr.name for tr in figs["metrics"].data}              # every scalar metric, one trace each
    assert {"vsref.kl", "vsref.top1", "precision.kl_w4a16", "precision.kl_w4a4", "logits.plain.p_top1"} <= names, names
    assert len(figs["layer_cos"].data) == 6 and len(figs["indexer_overlap"].data) >= 1
    div = [k for k in figs if k.startswith("first_divergence")]
    assert len(div) == 2                                          # the regressed run and the newest
    bug_fig = next(figs[k] for k in div if BUG in json.dumps(figs[k].layout.title.text))
    assert bug_fig.layout.annotations[0].text.endswith(f"{BUG_COMPONENT}.hook_entries")
    text = page.read_text()
    assert text.count("Plotly.newPlot") == len(figs) and 'src="plotly.min.js"' in text and "plotly.js v" not in text
    assert (h / "plotly.min.js").is_file()

