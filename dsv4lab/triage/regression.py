"""Nightly regression: compute the metrics the notebooks record, compare them with the blessed
baselines under per-metric tolerances, and fail with a readable table naming what regressed.

Baselines: ``data/baselines/metrics.json`` (a merged report ``metrics.json``) and
``data/baselines/tolerances.json`` (``{"fnmatch pattern over 'notebook/metric'": tolerance}``,
the last matching pattern wins; else the tolerance recorded with the metric).
Bless new baselines after an intended change::

    python -m dsv4lab report --out reports          # run everything
    python -m dsv4lab report --bless reports/metrics.json   # copy into data/baselines/

The component fingerprint (``fp.<hook point>``: a seeded +-1 projection of the first firing of every floating hook
point, a checksum of integer ones, for the chat prompt; ``fp.<input>.<hook point>`` for the other
inputs of :func:`nightly_prompts` that run every zoo trigger: length residues, inputs_embeds, the
clamp-live prompt) is what names the component: regressed fingerprint metrics are listed in
execution order, input by input, and the first one's component is where the computation first changed.
"""
from __future__ import annotations

import argparse
import fnmatch
import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
import torch

from ..bugzoo.prompts import live_prompt
from ..text.suite import compression_ratios, prompt_suite
from . import ablation, compressor_view, decode_view, logits
from .bugs import component_of_hook, inject, injected_components
from .reference_view import against_reference, record_against_reference
from .metrics import flatten, normalize_tolerance, portable_path, short_value, tolerance_text

REPO = Path(__file__).resolve().parents[2]
BASELINE_DIR = REPO / "data" / "baselines"
NIGHTLY = "07_nightly_regression"
FINGERPRINT_SEED = 1234   # the +-1 projection of every floating hook point (a manifest records it)
POLICY = "w4a16"          # the policy the nightly's per-layer metrics run the model under test in
LOCATE = {"abs": 1e-9, "rel": 1e-6}   # a fingerprint entry moved (fp32 round-off): names the component, not a verdict
MAX_RESIDUES = 8          # length prompts in the fingerprint at most (one per residue mod the smallest ratio)
EMBEDS, LIVE = "embeds", "live"   # fingerprint inputs: the chat prompt from inputs_embeds; the clamp-live prompt


class RegressionError(AssertionError):
    """Raised by :func:`check` when metrics regressed; the message is the table."""


# ------------------------------------------------------------------------------ fingerprint
@torch.no_grad()
def fingerprint(model, ids: torch.Tensor, form: str = "ids") -> list[tuple[str, object]]:
    """[(hook name, value)] in execution order, first firing of each hook point (``form``: "ids",
    or ``EMBEDS``: the model run from ``inputs_embeds``): a seeded random
    +-1 projection of floating tensors, sum(x * r) / sqrt(n) (fp32; non-finite -> inf), an
    order-insensitive checksum of integer ones. A projection, not the rms: tensors that leave a
    norm (compressed entries after kv_norm, normalised queries) keep their rms when they are wrong."""
    out: dict[str, object] = {}
    signs: dict[int, torch.Tensor] = {}

    def sign_vector(n: int, device) -> torch.Tensor:
        if n not in signs:
            g = torch.Generator().manual_seed(FINGERPRINT_SEED)
            signs[n] = (torch.randint(0, 2, (n,), generator=g) * 2 - 1).float()
        return signs[n].to(device)

    def rec(t, name):
        if name in out:
            return None
        if t.is_floating_point():
            x = t.detach().float()
            fin = torch.isfinite(x)
            n = x.numel()
            out[name] = float((x.flatten() * sign_vector(n, x.device)).sum() / n ** 0.5) if bool(fin.all()) and n else float("inf")
        else:
            s = t.detach().long().sort(-1).values if t.dim() else t.detach().long()
            w = torch.arange(1, s.numel() + 1, dtype=torch.long, device=s.device).view(s.shape)
            out[name] = int((s * w).sum() % 1_000_000_007)
        return None

    # the embeddings form: looked up before the hooks (as a front end would), the ids still go along for
    # the hash routers; called directly so a pre-hook a bug registered sees inputs_embeds
    kwargs = {"inputs_embeds": model.embed(ids)} if form == EMBEDS else {}
    with model.hooks([("**", rec)]):
        model(ids, **kwargs)
    return list(out.items())


# ------------------------------------------------------------------------------ nightly metrics
def fingerprint_residues(modulus: int, cap: int = MAX_RESIDUES) -> list[int]:
    """The residues mod ``modulus`` the fingerprint's length prompts take: all of them, or ``cap``
    spread over 0..modulus-1 (ends included) when there are more."""
    if modulus <= cap:
        return list(range(modulus))
    return sorted({round(i * (modulus - 1) / (cap - 1)) for i in range(cap)})


def nightly_prompts(session, prompt: str, chat_prompt: str) -> dict[str, torch.Tensor]:
    """The nightly's prompts as token ids [1, S], by role: ``probe`` (plain encoding: logits, lens,
    precision, per-layer metrics against the reference), ``fingerprint`` (chat encoding: the
    component fingerprint, and the failing tensors a regression keeps), and the fingerprint's
    other inputs ``fingerprint.<input>`` so every zoo trigger is run: ``len_<S>`` (prompt suite,
    one per residue mod the smallest compression ratio, at most ``MAX_RESIDUES``), ``embeds`` (the
    chat prompt, run from ``inputs_embeds``) and ``live`` (``bugzoo.prompts.live_prompt``: the
    routed and shared experts pass ``swiglu_limit``). The one place the nightly takes its prompts from."""
    model = session.model
    chat = session.encode(chat_prompt, "chat")
    out = {"probe": session.encode(prompt, "plain"), "fingerprint": chat}
    ratios = compression_ratios(model.config)
    if ratios:
        suite = prompt_suite(model, session.tokenizer)
        lengths = [int(k[4:]) for k in suite if k.startswith("len_")]
        for r in fingerprint_residues(ratios[0]):
            n = min(x for x in lengths if x % ratios[0] == r)
            out[f"fingerprint.len_{n}"] = suite[f"len_{n}"]
    out[f"fingerprint.{EMBEDS}"] = chat
    out[f"fingerprint.{LIVE}"] = live_prompt(model, session.tokenizer)
    return out


def fingerprint_inputs(prompts: dict[str, torch.Tensor]) -> list[tuple[str, torch.Tensor, str]]:
    """[(input, ids, form)] of the fingerprint, the chat prompt first (input "": keys ``fp.<hook>``)."""
    out = [("", prompts["fingerprint"], "ids")]
    for role, ids in prompts.items():
        if role.startswith("fingerprint."):
            name = role.split(".", 1)[1]
            out.append((name, ids, EMBEDS if name == EMBEDS else "ids"))
    return out


def fp_prefix(name: str) -> str:
    """The metric prefix of fingerprint input ``name``: ``fp.`` for the chat prompt, else ``fp.<name>.``."""
    return f"fp.{name}." if name else "fp."


@torch.no_grad()
def nightly_metrics(session, rec, prompt: str, chat_prompt: str, answer: str | None = None, decode_steps: int = 8,
                    bug: str | None = None, bug_layers=None, policy=POLICY) -> dict:
    """Record, on ``rec``, the metrics the notebooks record (compact versions), the per-layer
    metrics of the model under test in ``policy`` against the reference (``vsref.*``,
    dsv4lab.triage.reference_view) and the fingerprint, with ``bug`` injected when given (into
    the model under test too when that is a separate NVFP4 model). Returns {"injected": [...components]}."""
    model = session.model
    prompts = nightly_prompts(session, prompt, chat_prompt)
    h = inject(model, bug, bug_layers)
    h_q = None
    injected = injected_components(model, h)
    try:
        # where the weights came from, relative to the repo when inside it (clones live anywhere)
        rec.record("model.source", portable_path(session.source), "exact")
        rec.record("model.trained", session.trained, "exact")
        ids = prompts["probe"]
        ans = session.token_id(answer) if answer else None
        # inputs first: a tokenizer / chat-encoding change shows here, not as a model regression
        rec.record("inputs.probe_ids", ids[0].tolist(), "exact")
        rec.record("inputs.chat_ids", prompts["fingerprint"][0].tolist(), "exact")
        rec.record("inputs.fingerprint_lengths", {n: int(x.shape[-1]) for n, x, _ in fingerprint_inputs(prompts) if n},
                   "exact")
        # notebook 2: first-token logits in three encodings, logit lens
        probes = logits.probe_all_modes(session, prompt, chat_prompt, k=5)
        logits.record_first_token(rec.scoped("logits."), session, probes, answer)
        df, lens, real = logits.logit_lens(session, ids, ans)
        logits.record_lens(rec, df, lens, real, ans, answer)
        # notebook 3: precision (weights FP4 vs original, activations W4A4)
        st = ablation.make_setup(session, ids)
        for mode in ("w4a16", "w4a4"):
            r = ablation.evaluate(st, mode)
            rec.record(f"precision.kl_{mode}", r["kl"], {"abs": 1e-4, "rel": 0.05, "direction": "up"})
            rec.record(f"precision.min_layer_cos_{mode}", r["min_layer_cos"], {"abs": 1e-4, "direction": "down"})
        r = ablation.evaluate(st, {"default": "w4a16", "head": "orig", "router": "orig"})
        rec.record("precision.kl_w4a16_head_router_orig", r["kl"], {"abs": 1e-4, "rel": 0.05, "direction": "up"})
        if st.model is not model:   # the embedded NVFP4 export: the model under test carries the bug too
            h_q = inject(st.model, bug, bug_layers)
        record_against_reference(rec, against_reference(st, policy))
        # notebook 4: compressor and indexer on the retrieval example
        ex = compressor_view.retrieval_example(session)
        rr = compressor_view.retrieval_check(session, ex)
        compressor_view.record_retrieval(rec, ex, rr)
        compressor_view.record_compressor(rec, model, rr["cache"], ex.ids.shape[1])
        # notebook 5: decode path vs full forward
        decode_view.record_decode(rec.scoped("decode."), decode_view.run(session, ids, steps=decode_steps))
        # the component fingerprint (names the component), input by input: chat first, keys fp.<hook>
        for name, fp_ids, form in fingerprint_inputs(prompts):
            fp = fingerprint(model, fp_ids, form)
            pre = fp_prefix(name)
            rec.record(f"{pre}order", [n for n, _ in fp], "ignore")
            for hook, v in fp:
                rec.record(f"{pre}{hook}", v, {"abs": 1e-6, "rel": 1e-4} if isinstance(v, float) else "exact")
    finally:
        for handle in (h_q, h):
            if handle is not None:
                handle.restore()
    return {"injected": injected}


# ------------------------------------------------------------------------------ comparison
def within(cur, base, tol: dict | None) -> bool:
    tol = tol or {"exact": True}
    if tol.get("ignore"):
        return True
    if isinstance(cur, bool) or isinstance(base, bool) or isinstance(cur, str) or isinstance(base, str) or tol.get("exact"):
        return cur == base
    if isinstance(cur, dict) or isinstance(base, dict):
        if not isinstance(cur, dict) or not isinstance(base, dict) or set(cur) != set(base):
            return False
        return all(within(cur[k], base[k], tol) for k in cur)
    if isinstance(cur, (list, tuple)) or isinstance(base, (list, tuple)):
        if not isinstance(cur, (list, tuple)) or not isinstance(base, (list, tuple)) or len(cur) != len(base):
            return False
        return all(within(c, b, tol) for c, b in zip(cur, base))
    if cur is None or base is None:
        return cur is base
    d = float(cur) - float(base)
    lim = float(tol.get("abs", 0.0)) + float(tol.get("rel", 0.0)) * abs(float(base))
    if tol.get("direction") == "up":
        return d <= lim
    if tol.get("direction") == "down":
        return -d <= lim
    return abs(d) <= lim


def resolve_tolerance(key: str, recorded: dict | None, overrides: dict) -> dict | None:
    tol = recorded
    for pat, t in overrides.items():
        if fnmatch.fnmatchcase(key, pat):
            tol = normalize_tolerance(t)
    return tol


@dataclass
class RegressionResult:
    table: object                 # DataFrame: metric, baseline, current, tolerance, status
    first_component: str | None   # component of the first regressed fingerprint hook
    first_hook: str | None
    first_input: str | None = None  # the fingerprint input it regressed on ("" the chat prompt)

    @property
    def regressed(self):
        return self.table[self.table["status"] == "REGRESSED"]

    @property
    def ok(self) -> bool:
        return len(self.regressed) == 0

    def summary(self) -> str:
        n, k = len(self.table), len(self.regressed)
        if self.ok:
            return f"OK: {n} metrics within tolerance of the baselines"
        s = f"REGRESSED: {k} of {n} metrics out of tolerance."
        if self.first_component:
            on = f", input {self.first_input}" if self.first_input else ""
            s += f" First changed component (execution order): {self.first_component} (hook {self.first_hook}{on})."
        return s

    def text(self, max_rows: int = 40) -> str:
        reg = self.regressed
        is_fp = reg["metric"].str.contains("/fp.", regex=False)
        rows = pd_concat(reg[is_fp], reg[~is_fp]).head(max_rows)
        lines = [self.summary()]
        if len(rows):
            w = max(len(m) for m in rows["metric"])
            lines.append(f"{'metric':{w}s}  {'baseline':>22s}  {'current':>22s}  tolerance")
            for _, r in rows.iterrows():
                lines.append(f"{r['metric']:{w}s}  {str(short_value(r['baseline'], 22)):>22s}  {str(short_value(r['current'], 22)):>22s}  "
                             f"{tolerance_text(r['tol'])}")
            if len(self.regressed) > max_rows:
                lines.append(f"... and {len(self.regressed) - max_rows} more")
        return "\n".join(lines)

    __str__ = text


def pd_concat(a, b):
    return pd.concat([a, b])


def compare(current: dict, baseline: dict, tolerances: dict | None = None, only_notebooks=None) -> RegressionResult:
    """Compare two merged metrics dicts (``{"notebooks": {nb: {metric: {value, tolerance}}}}``).
    Metrics of notebooks absent from ``current`` are not compared (a notebook not run is not a
    regression); a metric the baseline has but the current run lacks is ``MISSING`` (fails)."""
    tolerances = tolerances or {}
    cur, base = flatten(current), flatten(baseline)
    nbs = set(current.get("notebooks", {})) if only_notebooks is None else set(only_notebooks)
    rows = []
    for key, m in cur.items():
        if key.split("/", 1)[0] not in nbs:
            continue
        tol = resolve_tolerance(key, m.get("tolerance"), tolerances)
        if tol and tol.get("ignore"):
            continue
        if key not in base:
            rows.append({"metric": key, "baseline": None, "current": m["value"], "tol": tol, "status": "new"})
            continue
        ok = within(m["value"], base[key]["value"], tol)
        rows.append({"metric": key, "baseline": base[key]["value"], "current": m["value"], "tol": tol,
                     "status": "ok" if ok else "REGRESSED"})
    for key, m in base.items():
        if key.split("/", 1)[0] in nbs and key not in cur:
            tol = resolve_tolerance(key, m.get("tolerance"), tolerances)
            if not (tol and tol.get("ignore")):
                rows.append({"metric": key, "baseline": m["value"], "current": None, "tol": tol, "status": "REGRESSED"})
    df = pd.DataFrame(rows, columns=["metric", "baseline", "current", "tol", "status"])
    first_input, first_hook = first_fingerprint_change(df, cur, base)
    return RegressionResult(df, component_of_hook(first_hook), first_hook, first_input)


def first_fingerprint_change(table, cur: dict, base: dict) -> tuple[str | None, str | None]:
    """(input, hook) where the computation first changed; (None, None) when no fingerprint regressed.

    The first regressed input in recording order (the chat prompt first) and, on it, the earliest
    hook in the baseline's execution order (``fp[.<input>].order``; a hook that no longer fires, e.g.
    a disabled indexer, counts where it used to fire) up to its first regressed one that moved
    beyond ``LOCATE`` (fp32 round-off): a small change at its origin (one token's clamp) often
    passes the tolerance there and only fails a few hooks downstream, in another component. An
    earlier hook of the regressed hook's own component that changed at all wins over that one."""
    regressed = set(table["metric"][table["status"] == "REGRESSED"])
    orders = list(dict.fromkeys(k for k in (*cur, *base) if "/fp." in k and k.endswith(".order")))
    for key in orders:
        prefix = key[: -len("order")]                      # "nb/fp." or "nb/fp.<input>."
        hooks = (base.get(key) or cur.get(key))["value"] or []
        hit = next((i for i, hook in enumerate(hooks) if prefix + hook in regressed), None)
        if hit is None:
            continue
        def changed(h: str, tol) -> bool:
            return prefix + h in base and (prefix + h not in cur or not within(cur[prefix + h]["value"],
                                                                               base[prefix + h]["value"], tol))

        origin = next((h for h in hooks[:hit] if changed(h, LOCATE)), hooks[hit])
        # a bug whose origin changes only round-off (mHC's comb transposed on still-identical streams)
        # moves a later component past LOCATE first: if the regressed hook's own component had
        # already changed at all before that, it is the origin
        same = next((h for h in hooks[: hooks.index(origin)] if changed(h, {"exact": True})
                     and component_of_hook(h) == component_of_hook(hooks[hit])), None)
        return prefix.split("/fp.", 1)[1][:-1], same or origin
    for metric in table["metric"][table["status"] == "REGRESSED"]:   # no order recorded: recording order
        if "/fp." in metric and not metric.endswith(".order"):
            return "", metric.split("/fp.", 1)[1]
    return None, None


def load_baselines(directory: str | Path = BASELINE_DIR) -> tuple[dict, dict]:
    d = Path(directory)
    m = d / "metrics.json"
    if not m.is_file():
        raise FileNotFoundError(f"no baselines at {m}: run the report and bless it (python -m dsv4lab report --bless "
                                f"reports/metrics.json)")
    t = d / "tolerances.json"
    return json.loads(m.read_text()), (json.loads(t.read_text()) if t.is_file() else {})


def baselines_model_mismatch(current: dict, baseline: dict) -> str | None:
    """Why ``baseline`` cannot judge ``current`` (blessed on another model), or None when it can.

    The packaged baselines are the embedded model's: a run on another checkpoint (a synth, the
    release) has no baseline until one is blessed for it, and comparing across models would
    flag every metric."""
    cur, base = current.get("model"), baseline.get("model")
    if cur is None or base is None or cur == base:
        return None
    return (f"the baselines were blessed on model {base!r}, this run is on {cur!r}: nothing compared. To start "
            f"a history for this model: python -m dsv4lab report --model {cur} --bless REPORT/metrics.json, "
            f"or pass BASELINES=<dir blessed on it>")


def check(current: dict, directory: str | Path = BASELINE_DIR, only_notebooks=None) -> RegressionResult:
    """Compare with the baselines; raise :class:`RegressionError` (message = the table) if anything regressed."""
    base, tol = load_baselines(directory)
    res = compare(current, base, tol, only_notebooks)
    if not res.ok:
        raise RegressionError(res.text())
    return res


def bless(metrics_json: str | Path, directory: str | Path = BASELINE_DIR) -> Path:
    """Make ``metrics_json`` (a report's merged metrics) the new baseline (tolerances kept)."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    src = json.loads(Path(metrics_json).read_text())
    if "notebooks" not in src:
        raise ValueError(f"{metrics_json} is not a merged report metrics.json (no 'notebooks')")
    shutil.copyfile(metrics_json, d / "metrics.json")
    return d / "metrics.json"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dsv4lab.triage.regression",
                                 description="compare a report's metrics.json with the baselines, or bless it")
    ap.add_argument("metrics", help="a report's merged metrics.json")
    ap.add_argument("--baselines", default=str(BASELINE_DIR))
    ap.add_argument("--bless", action="store_true", help="copy METRICS into the baselines instead of comparing")
    a = ap.parse_args(argv)
    if a.bless:
        print(f"blessed: {bless(a.metrics, a.baselines)}")
        return 0
    base, tol = load_baselines(a.baselines)
    res = compare(json.loads(Path(a.metrics).read_text()), base, tol)
    print(res.text())
    return 0 if res.ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
