"""The nightly's history directory: one folder per run with a manifest, the rolling baseline,
and pruning.

    HISTORY/runs/<date>T<time>Z_<commit>[-dirty]_<model>_<policy>/
        manifest.json          versions, device, seeds, argv, git commit + dirty flag, verdict
        metrics.json           the report's merged metrics (what the next run compares against)
        07_nightly_regression.{ipynb,html,metrics.json}, summary.json, index.html
        failing.safetensors.gz the failing tensors of a regression (dsv4lab.triage.failing)
    HISTORY/index.html, HISTORY/plotly.min.js   trends over the stored runs (dsv4lab.triage.trends)

A *series* is one model + policy; its rolling baseline is its newest good run (clean, no bug
injected). Pruning (:func:`prune_plan`, a pure function of the runs' dates) keeps every run of the
last ``keep_daily`` days, then the newest run (a good one when there is) of each ISO week per
series for ``keep_weekly`` weeks (None: for ever), and always each series' rolling baseline.
"""
from __future__ import annotations

import hashlib
import json
import platform
import re
import shutil
import subprocess
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from importlib import metadata
from pathlib import Path

MANIFEST = "manifest.json"
RUNS = "runs"
FORMAT_VERSION = 1
VERSIONED = ("dsv4lab", "torch", "transformers", "triton", "safetensors", "plotly", "papermill")

_UNSAFE = re.compile(r"[^A-Za-z0-9.+-]+")


def slug(text: str, n: int = 40) -> str:
    """A file-name-safe word for ``text`` (``default=w4a16,head=orig`` -> ``default-w4a16-head-orig``)."""
    return _UNSAFE.sub("-", str(text)).strip("-")[:n] or "none"


def model_slug(model: str) -> str:
    """``data/tiny-dsv4`` -> ``tiny-dsv4-<6 hex of the full path>``: readable and unique per checkpoint."""
    name = Path(str(model).rstrip("/")).name or str(model)
    return f"{slug(name, 32)}-{hashlib.sha256(str(model).encode()).hexdigest()[:6]}"


def git_state(repo: Path) -> dict:
    """{"commit": sha or None, "dirty": tracked files changed (untracked ignored) or None}."""
    def git(*args):
        return subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, timeout=30)

    try:
        head = git("rev-parse", "HEAD")
        if head.returncode != 0:
            return {"commit": None, "dirty": None}
        status = git("status", "--porcelain", "--untracked-files=no")
        return {"commit": head.stdout.strip(), "dirty": bool(status.stdout.strip())}
    except (OSError, subprocess.SubprocessError):
        return {"commit": None, "dirty": None}


def versions() -> dict:
    """Installed versions (package metadata; nothing is imported), None where not installed."""
    out = {"python": platform.python_version()}
    for name in VERSIONED:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def run_id(when: datetime, git: dict, model: str, policy: str) -> str:
    commit = (git.get("commit") or "nogit")[:10] + ("-dirty" if git.get("dirty") else "")
    return f"{when.astimezone(timezone.utc):%Y%m%dT%H%M%SZ}_{commit}_{model_slug(model)}_{slug(policy)}"


# ------------------------------------------------------------------------------ stored runs
@dataclass
class Run:
    path: Path
    manifest: dict

    @property
    def id(self) -> str:
        return self.manifest["run"]

    @property
    def date(self) -> datetime:
        return datetime.fromisoformat(self.manifest["date"])

    @property
    def series(self) -> tuple[str, str]:
        return self.manifest["model"], self.manifest["policy"]

    @property
    def good(self) -> bool:
        """Clean and without an injected bug: a run the next one may be compared against."""
        return self.manifest.get("status") == "ok" and not self.manifest.get("inject")

    def metrics(self) -> dict:
        return json.loads((self.path / "metrics.json").read_text())


def runs(history: str | Path) -> list[Run]:
    """The stored runs, oldest first (folders without a readable manifest are not runs)."""
    out = []
    for d in (Path(history) / RUNS).glob("*"):
        try:
            out.append(Run(d, json.loads((d / MANIFEST).read_text())))
        except (OSError, ValueError):
            continue
    return sorted(out, key=lambda r: (r.date, r.id))


def last_good(all_runs: list[Run], model: str, policy: str) -> Run | None:
    """The rolling baseline of ``model`` + ``policy``: its newest good run that has metrics."""
    for r in reversed(all_runs):
        if r.series == (model, policy) and r.good and (r.path / "metrics.json").is_file():
            return r
    return None


def write_manifest(path: Path, manifest: dict) -> Path:
    p = Path(path) / MANIFEST
    p.write_text(json.dumps(manifest, indent=1, default=str) + "\n")
    return p


# ------------------------------------------------------------------------------ pruning
@dataclass(frozen=True)
class Stored:
    """What pruning looks at: a run's id, UTC date, series and whether it is good."""
    id: str
    date: datetime
    series: tuple = ()
    good: bool = True


def prune_plan(stored: list[Stored], now: datetime, keep_daily: int = 30, keep_weekly: int | None = 52) -> set[str]:
    """The ids to keep. Every run younger than ``keep_daily`` days; older ones: per series and ISO
    week, the newest good run (the newest run if none is good), for weeks younger than
    ``keep_daily`` days + ``keep_weekly`` weeks (``None``: every week); and each series' newest
    good run whatever its age (it is the rolling baseline)."""
    keep = set()
    daily_end = now - timedelta(days=keep_daily)
    weekly_end = None if keep_weekly is None else daily_end - timedelta(weeks=keep_weekly)
    weeks: dict[tuple, Stored] = {}
    newest_good: dict[tuple, Stored] = {}
    for s in stored:
        if s.good and (s.series not in newest_good or s.date > newest_good[s.series].date):
            newest_good[s.series] = s
        if s.date > daily_end:
            keep.add(s.id)
        elif weekly_end is None or s.date > weekly_end:
            key = (s.series, *s.date.isocalendar()[:2])
            cur = weeks.get(key)
            if cur is None or (s.good, s.date) > (cur.good, cur.date):
                weeks[key] = s
    keep |= {s.id for s in weeks.values()} | {s.id for s in newest_good.values()}
    return keep


def prune(history: str | Path, now: datetime, keep_daily: int = 30, keep_weekly: int | None = 52,
          also=()) -> list[str]:
    """Delete the runs :func:`prune_plan` does not keep (nor the ids in ``also``: the run just made); returns their ids."""
    stored = runs(history)
    keep = prune_plan([Stored(r.id, r.date, r.series, r.good) for r in stored], now, keep_daily, keep_weekly) | set(also)
    gone = []
    for r in stored:
        if r.id not in keep:
            shutil.rmtree(r.path)
            gone.append(r.id)
    return gone


__all__ = ["MANIFEST", "RUNS", "Run", "Stored", "git_state", "last_good", "model_slug", "prune", "prune_plan", "run_id",
           "runs", "slug", "versions", "write_manifest"]
