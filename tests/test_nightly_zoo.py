"""The nightly's fingerprint catches every zoo bug and names its component (issue 22): each bug
that the plain embedded model can carry is injected into ``nightly_metrics`` and compared, with
``compare``, against a clean run recorded here (not data/baselines). The fingerprint runs every
trigger (length residues, inputs_embeds, the clamp-live prompt), so a trigger-dependent bug shows."""
from __future__ import annotations

import warnings

import pytest

from dsv4lab.bugzoo import BUGS
from dsv4lab.triage import regression as RG
from dsv4lab.triage.metrics import merge, recorder
from dsv4lab.triage.nightly import ANSWER, CHAT_PROMPT, PROMPT
from dsv4lab.triage.session import open_session
from dsv4lab.text.suite import compression_ratios

DECODE_STEPS = 2   # the decode metrics are not what names the component: keep each run short


@pytest.fixture(scope="module")
def session():
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*embedded model.*")
        return open_session(None, "cpu")


def _run(session, bug=None) -> tuple[dict, list[str]]:
    rec = recorder(RG.NIGHTLY, None, model=session.source)
    out = RG.nightly_metrics(session, rec, PROMPT, CHAT_PROMPT, ANSWER, decode_steps=DECODE_STEPS, bug=bug)
    return merge([rec.as_dict()]), out["injected"]


def test_fingerprint_inputs_cover_every_trigger(session):
    """One length per residue mod the smallest ratio, the chat prompt from embeddings, the live prompt."""
    prompts = RG.nightly_prompts(session, PROMPT, CHAT_PROMPT)
    runs = RG.fingerprint_inputs(prompts)
    m = compression_ratios(session.model.config)[0]
    lengths = sorted(ids.shape[-1] for name, ids, _ in runs if name.startswith("len_"))
    assert sorted(n % m for n in lengths) == list(range(m)) and len(lengths) <= RG.MAX_RESIDUES
    assert ("", "ids") in [(n, f) for n, _, f in runs] and (RG.EMBEDS, RG.EMBEDS) in [(n, f) for n, _, f in runs]
    assert RG.LIVE in [n for n, _, _ in runs]
    assert RG.fingerprint_residues(128) == [0, 18, 36, 54, 73, 91, 109, 127]   # V4-Pro's 4 and 128: capped at 8


@pytest.mark.slow
def test_nightly_catches_and_localises_every_zoo_bug(session):
    clean, _ = _run(session)
    again, _ = _run(session)
    assert RG.compare(again, clean).ok   # deterministic: a clean run against a clean run passes
    skipped, missed = [], []
    for name, bug in BUGS.items():
        try:
            current, injected = _run(session, name)
        except ValueError as e:          # triage.bugs.inject: the bug does not apply to this model
            assert "does not apply" in str(e), e
            skipped.append(name)
            continue
        res = RG.compare(current, clean)
        if res.ok or res.first_component not in injected:
            missed.append((name, res.first_component, res.first_input, injected[:3]))
    assert sorted(skipped) == sorted(n for n, b in BUGS.items() if b.requires in ("nvfp4", "fp8_wo_a"))
    assert not missed, missed
    assert len(BUGS) - len(skipped) >= 22
