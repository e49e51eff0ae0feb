"""``python -m dsv4lab nightly``: the regression notebook against a rolling baseline, with history.

One call: run notebook 7 (through :func:`dsv4lab.triage.report.run_report`) into a new run folder
of the history (dsv4lab.triage.history: date + commit + model + policy, a manifest), compare its
metrics with the series' rolling baseline (the newest good run of the same model + policy; the
packaged ``data/baselines`` for the embedded model until it has one; nothing for another model,
whose first run starts its own history), keep the failing tensors of a regression
(dsv4lab.triage.failing), prune old runs, and redraw the history's trend page
(dsv4lab.triage.trends). The verdict is one line; :data:`EXIT` maps it to the exit status.
"""
from __future__ import annotations

import json
import os
import platform
import shutil
import sys
import tempfile
from dataclasses import dataclass
from datetime import datetime, timezone
from functools import partial
from pathlib import Path

import torch

from ..bugzoo import bug_named
from ..bugzoo.inputs import from_embeddings
from ..checkpoint.locate import TINY_DIR, resolve_path
from ..config import load_config
from ..model.validate import check_layers
from ..precision import PrecisionPolicy
from . import history as H
from .bugs import inject as inject_bug
from .failing import DEFAULT_BUDGET, capture_failing
from .metrics import portable_path
from .regression import (
    BASELINE_DIR,
    EMBEDS,
    FINGERPRINT_SEED,
    NIGHTLY,
    POLICY,
    baselines_model_mismatch,
    compare,
    fingerprint_inputs,
    load_baselines,
    nightly_prompts,
)
from .report import PLOTLYJS, ReportError, check_model, run_report, write_plotlyjs
from .session import default_reference, open_session
from .trends import BASELINE_FILE, write_index

PROMPT, CHAT_PROMPT, ANSWER = "The capital of France is", "What is the capital of France?", " Paris"
EXIT = {"ok": 0, "regressed": 1, "failed": 3}   # 2: bad arguments (the CLI's)
REPO = Path(__file__).resolve().parents[2]


class NightlyError(ReportError):
    """A nightly that cannot start as asked; the message names the argument, the value and the fix."""


@dataclass
class NightlyResult:
    status: str          # ok | regressed | failed
    line: str            # the one-line verdict
    run: Path            # the stored run's folder
    manifest: dict

    @property
    def exit_code(self) -> int:
        return EXIT[self.status]


def parse_policy(policy) -> tuple[object, str, str]:
    """(spec for the notebook, canonical description, folder word) of a policy: a mode word or a
    mapping (JSON text is parsed)."""
    spec = policy
    if isinstance(policy, str) and policy.strip().startswith("{"):
        try:
            spec = json.loads(policy)
        except ValueError as e:
            raise NightlyError(f"--policy {policy}: not valid JSON ({e}); give a mode word (w4a16, official, ...) "
                               f"or a JSON mapping") from None
    try:
        desc = PrecisionPolicy.parse(spec).describe()
    except (ValueError, TypeError) as e:
        raise NightlyError(f"--policy {policy}: {e}") from None
    return spec, desc, H.slug(policy if isinstance(spec, str) else desc.removeprefix("default="))


def check_args(history, model, reference, device, inject, inject_layers, keep_daily, keep_weekly, budget) -> None:
    """Refuse bad arguments before anything runs (one message naming the argument and the fix)."""
    if not history:
        raise NightlyError("--history is required: the directory the runs are stored in (created when absent)")
    h = Path(history)
    if h.exists() and not h.is_dir():
        raise NightlyError(f"--history {history}: exists and is not a directory; give a directory")
    if model is not None:
        check_model(model)
    if reference is not None and not resolve_path(reference).exists():
        raise NightlyError(f"--reference {reference}: no such checkpoint ({resolve_path(reference)} does not exist)")
    if inject is not None:
        bug_named(inject, "--inject")
        if inject_layers:   # the model's config.json alone: no weights read
            check_layers(inject_layers, load_config(resolve_path(model)).num_hidden_layers, "--inject-layers")
    elif inject_layers:
        raise NightlyError("--inject-layers without --inject: name the bug to inject (python -m dsv4lab bugzoo --list)")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise NightlyError(f"--device {device}: not a device; give cpu, cuda or cuda:N") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise NightlyError(f"--device {device}: no CUDA device here; give --device cpu")
    if keep_daily < 0:
        raise NightlyError(f"--keep-daily {keep_daily}: expected days >= 0")
    if keep_weekly is not None and keep_weekly < 0:
        raise NightlyError(f"--keep-weekly {keep_weekly}: expected weeks >= 0")
    if budget <= 0:
        raise NightlyError(f"--max-failing-mb: expected a positive size, got {budget} bytes")


def device_info(device: str) -> dict:
    info = {"requested": device, "machine": platform.machine(), "cpu_threads": os.cpu_count()}
    if str(device).startswith("cuda") and torch.cuda.is_available():
        info["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        info["cuda"] = torch.version.cuda
    return info


def _empty_baseline(where: Path, model_key: str) -> Path:
    """A baseline directory blessed on no model: notebook 7 then compares nothing (and says why)."""
    (where / "metrics.json").write_text(json.dumps({"model": f"none (first run of {model_key})", "notebooks": {}}))
    return where


def _verdict(status: str, rel: str, baseline: str | None, res, error: str, model_key: str, policy: str) -> str:
    if status == "failed":
        return f"nightly: FAILED (not a verdict): {error.splitlines()[0][:300] if error else 'unknown error'}; run {rel}"
    if status == "regressed":
        on = f", on fingerprint input {res.first_input}" if res.first_input else ""
        where = (f"first diverging hook point {res.first_hook} (component {res.first_component}{on})" if res.first_hook else
                 f"first diverging hook point: none, the fingerprint is unchanged; first regressed metric "
                 f"{res.regressed['metric'].iloc[0]}")
        return (f"nightly: REGRESSED against {baseline}: {where}; {len(res.regressed)} of {len(res.table)} metrics out "
                f"of tolerance; run {rel}")
    if res is None:
        return f"nightly: OK, nothing compared: no baseline for {model_key} / {policy} yet, this run starts its history; run {rel}"
    new = int((res.table["status"] == "new").sum())
    return (f"nightly: OK: {len(res.table) - new} metrics within tolerance of {baseline}"
            + (f" ({new} new, not in it)" if new else "") + f"; run {rel}")


def run_nightly(history: str | Path, model: str | None = None, reference: str | None = None, device: str = "cpu",
                policy=POLICY, inject: str | None = None, inject_layers=None, keep_daily: int = 30,
                keep_weekly: int | None = 52, failing_budget: int = DEFAULT_BUDGET, notebooks=("07",),
                fallback: str | Path | None = BASELINE_DIR, argv=None, now: datetime | None = None, timeout: int = 900,
                heartbeat: float = 15, log=partial(print, flush=True)) -> NightlyResult:
    """Run, store, compare, keep failing tensors, prune, redraw (module doc). ``fallback``: the baselines
    of the embedded model before its history has a good run (None: none). ``now``: the run's date (UTC)."""
    check_args(history, model, reference, device, inject, inject_layers, keep_daily, keep_weekly, failing_budget)
    if reference is None:   # the weights a quantised export was made from, when known (one choice for every step)
        found = default_reference(model)
        reference = None if found is None else str(found)
    policy_spec, policy_desc, policy_word = parse_policy(policy)
    history = Path(history).resolve()
    (history / H.RUNS).mkdir(parents=True, exist_ok=True)
    now = (now or datetime.now(timezone.utc)).astimezone(timezone.utc)
    model_key = portable_path(resolve_path(model))
    git = H.git_state(REPO)
    rid = H.run_id(now, git, model_key, policy_word)
    run_dir = history / H.RUNS / rid
    n = 1
    while run_dir.exists():
        n += 1
        run_dir = history / H.RUNS / f"{rid}.{n}"
    layers = [inject_layers] if isinstance(inject_layers, int) else (list(inject_layers) if inject_layers else None)

    stored = H.runs(history)
    base_run = H.last_good(stored, model_key, policy_desc)
    embedded = resolve_path(model).resolve() == TINY_DIR.resolve()
    with tempfile.TemporaryDirectory(prefix=".baseline-", dir=history) as tmp:
        tmp = Path(tmp)
        shutil.copy(BASELINE_DIR / "tolerances.json", tmp / "tolerances.json")   # today's tolerances judge
        if base_run is not None:
            shutil.copy(base_run.path / "metrics.json", tmp / "metrics.json")
            baseline = f"run {base_run.id}"
        elif embedded and fallback is not None and (Path(fallback) / "metrics.json").is_file():
            shutil.copy(Path(fallback) / "metrics.json", tmp / "metrics.json")
            baseline = portable_path(fallback)
        else:
            _empty_baseline(tmp, model_key)
            baseline = None
        params = {"BASELINES": str(tmp), "BUG": inject, "BUG_LAYERS": layers, "POLICY": policy_spec, "REFERENCE": reference,
                  "PROMPT": PROMPT, "CHAT_PROMPT": CHAT_PROMPT, "ANSWER": ANSWER}
        vs = f" (reference {reference})" if reference else ""
        log(f"nightly: {model_key} / {policy_desc}{vs} against {baseline or 'nothing (first run)'} -> {run_dir}")
        rep = run_report(run_dir, model=model, device=device, only=list(notebooks), parameters=params, timeout=timeout,
                         heartbeat=heartbeat, log=log)
        base_metrics, tols = load_baselines(tmp)

    merged = json.loads((run_dir / "metrics.json").read_text()) if (run_dir / "metrics.json").is_file() else None
    errors = [r for r in rep["notebooks"] if r["status"] != "ok" and not r["error"].startswith("RegressionError")]
    mismatch = None if merged is None else baselines_model_mismatch(merged, base_metrics)
    res = None
    if merged is not None and baseline is not None and mismatch is None:
        res = compare(merged, base_metrics, tols)
        (run_dir / BASELINE_FILE).write_text(json.dumps(base_metrics) + "\n")
    if errors or merged is None or NIGHTLY not in merged.get("notebooks", {}):
        status = "failed"
    else:
        status = "regressed" if res is not None and not res.ok else "ok"
    error = "; ".join(f"{r['name']}: {r['error']}" for r in errors) or ("" if merged else "no metrics were written")
    rel = run_dir.relative_to(history).as_posix()
    line = _verdict(status, rel, baseline, res, error, model_key, policy_desc)

    manifest = {"format": H.FORMAT_VERSION, "run": run_dir.name, "date": now.isoformat(), "model": model_key,
                "model_arg": model, "reference": reference, "policy": policy_desc, "git": git,
                "versions": H.versions(), "device": device_info(device),
                "seeds": {"fingerprint": FINGERPRINT_SEED, "retrieval": 0, "random_weights": 0},
                "prompts": {"prompt": PROMPT, "chat_prompt": CHAT_PROMPT, "answer": ANSWER},
                "argv": list(sys.argv if argv is None else argv), "notebooks": rep["notebooks"],
                "inject": {"bug": inject, "layers": layers} if inject else None,
                "baseline": baseline, "status": status, "line": line, "not_compared": mismatch,
                "first_hook": None if res is None else res.first_hook,
                "first_component": None if res is None else res.first_component,
                "first_input": None if res is None else res.first_input,
                "n_compared": None if res is None else len(res.table),
                "n_regressed": None if res is None else len(res.regressed),
                "regressed": [] if res is None else res.regressed["metric"].head(50).tolist(),
                "failing_tensors": None, "pruned": []}
    if status == "regressed":
        manifest["failing_tensors"] = keep_failing(run_dir, model, device, reference, inject, layers,
                                                   res.first_hook, failing_budget, res.first_input or "")
    H.write_manifest(run_dir, manifest)
    _share_plotlyjs(history, run_dir)
    manifest["pruned"] = H.prune(history, now, keep_daily, keep_weekly, also=(run_dir.name,))
    H.write_manifest(run_dir, manifest)
    write_index(history)
    return NightlyResult(status, line, run_dir, manifest)


def keep_failing(run_dir: Path, model, device, reference, inject, layers, first_hook, budget, first_input: str = "") -> dict:
    """Load the model again (notebook 7's kernel has exited), inject the same bug, capture the failing
    tensors on the fingerprint input the regression showed on first (its input form too)."""
    session = open_session(model, device, reference=reference)
    runs = {name: (ids, form) for name, ids, form in fingerprint_inputs(nightly_prompts(session, PROMPT, CHAT_PROMPT))}
    ids, form = runs.get(first_input, runs[""])
    # the embeddings entry before the bug: a bug's own pre-hook (dropping the ids) must see inputs_embeds
    entry = from_embeddings(session.model) if form == EMBEDS else None
    handle = None
    try:
        handle = inject_bug(session.model, inject, layers)
        return capture_failing(session.model, ids, first_hook, run_dir, budget)
    finally:
        for h in (handle, entry):
            if h is not None:
                h.restore()


def _share_plotlyjs(history: Path, run_dir: Path) -> None:
    """One plotly.js for the whole history: the run's copy becomes a relative link to the history's."""
    if not (history / PLOTLYJS).is_file():
        write_plotlyjs(history)
    own = run_dir / PLOTLYJS
    if own.is_file() and not own.is_symlink():
        own.unlink()
        os.symlink(Path("..") / ".." / PLOTLYJS, own)


__all__ = ["EXIT", "NightlyError", "NightlyResult", "check_args", "parse_policy", "run_nightly"]
