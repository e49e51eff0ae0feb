"""The two zoo bugs that only quantised weights carry, caught by the nightly on the checkpoint
formats they apply to (issue 22; the other 22 bugs: tests/test_nightly_zoo.py):
``weight_scale_2_dropped`` on the embedded NVFP4 export (``tiny-nvfp4``) and
``fp8_wo_a_scale_layout`` on the embedded model written in the official format (FP8-block linears +
MXFP4 experts, ``checkpoint.synth.quantize_checkpoint``). Both run against their originals (the
embedded BF16 model, found by ``checkpoint.locate.originals_of``), as a real release runs against
``--reference``."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dsv4lab.checkpoint import CheckpointReader, save_checkpoint
from dsv4lab.checkpoint.fake import OFFICIAL_QUANTIZATION_CONFIG, random_state, tiny_config
from dsv4lab.checkpoint.locate import QUANTIZED_FROM, TINY_DIR, originals_of, quantized_from
from dsv4lab.checkpoint.synth import SynthError, quantize_checkpoint
from dsv4lab.triage import regression as RG
from dsv4lab.triage.bugs import inject, injected_components
from dsv4lab.triage.metrics import merge, recorder
from dsv4lab.triage.nightly import ANSWER, CHAT_PROMPT, PROMPT
from dsv4lab.triage.session import default_reference, open_session

REPO = Path(__file__).resolve().parents[1]
DECODE_STEPS = 2   # as tests/test_nightly_zoo.py: the decode metrics do not name the component


@pytest.fixture(scope="module")
def official(tmp_path_factory) -> Path:
    """The embedded model in the official format (~2 s on CPU)."""
    out = tmp_path_factory.mktemp("official") / "tiny-official"
    quantize_checkpoint("tiny", out, "official")
    return out


def _run(session, bug=None, decode_steps=DECODE_STEPS) -> tuple[dict, list[str]]:
    rec = recorder(RG.NIGHTLY, None, model=session.source)
    out = RG.nightly_metrics(session, rec, PROMPT, CHAT_PROMPT, ANSWER, decode_steps=decode_steps, bug=bug)
    return merge([rec.as_dict()]), out["injected"]


# ------------------------------------------------------------------------------ the official export
def test_official_export_is_the_release_format(official):
    """FP8-block (128 tiles: wo_a has a 2x2 scale grid, so a transposed read moves tiles), MXFP4
    experts, BF16 head / routers / helper projections; the originals recorded and found."""
    r = CheckpointReader(official)
    r.check()
    fmt = {b: r.format_of(b).format for b in ("layers.0.attn.wo_a", "layers.0.attn.wq_a", "layers.2.mlp.experts.0.w1",
                                              "layers.0.mlp.shared_expert.w2", "head", "layers.2.mlp.router",
                                              "layers.2.attn.compressor.wkv")}
    assert fmt == {"layers.0.attn.wo_a": "fp8_block", "layers.0.attn.wq_a": "fp8_block",
                   "layers.2.mlp.experts.0.w1": "mxfp4", "layers.0.mlp.shared_expert.w2": "fp8_block",
                   "head": "plain", "layers.2.mlp.router": "plain", "layers.2.attn.compressor.wkv": "plain"}
    assert tuple(r.weight("layers.0.attn.wo_a").scale.shape) == (2, 2)
    assert json.loads((official / "config.json").read_text())["quantization_config"] == OFFICIAL_QUANTIZATION_CONFIG
    assert (official / "tokenizer.json").is_file()
    assert originals_of(official) == TINY_DIR and default_reference(str(official)) == TINY_DIR
    assert originals_of("tiny-nvfp4") == TINY_DIR and originals_of("tiny") is None
    assert default_reference("random") is None


def test_originals_of_refuses_a_changed_source(tmp_path):
    cfg = tiny_config(moe_intermediate_size=32)
    save_checkpoint(tmp_path / "src", cfg, random_state(cfg, seed=2), layout="official")
    quantize_checkpoint(tmp_path / "src", tmp_path / "q", "official")
    assert originals_of(tmp_path / "q") == (tmp_path / "src").resolve()
    with pytest.raises(SynthError, match="already exists"):
        quantize_checkpoint(tmp_path / "src", tmp_path / "q", "official")
    save_checkpoint(tmp_path / "src", cfg, random_state(cfg, seed=3), layout="official")   # retrained in place
    with pytest.warns(UserWarning, match="has changed since"):
        assert originals_of(tmp_path / "q") is None
    assert quantized_from(tmp_path / "q") == (tmp_path / "src").resolve()   # still where its weights came from
    (tmp_path / "q" / QUANTIZED_FROM).unlink()
    assert originals_of(tmp_path / "q") is None and quantized_from(tmp_path / "q") is None


# ------------------------------------------------------------------------------ the nightly
@pytest.mark.slow
def test_nightly_catches_weight_scale_2_dropped_on_the_nvfp4_export():
    session = open_session("tiny-nvfp4", "cpu")
    assert session.reference == TINY_DIR and session.trained
    clean, _ = _run(session)
    again, _ = _run(session)
    assert RG.compare(again, clean).ok   # deterministic: a clean run against a clean run passes
    vsref = RG.flatten(clean)[f"{RG.NIGHTLY}/vsref.kl"]["value"]
    assert vsref > 1e-3                  # against the originals, not its own weights dequantised (0.0)
    current, injected = _run(session, "weight_scale_2_dropped")
    res = RG.compare(current, clean)
    assert not res.ok and res.first_component in injected, (res.first_component, res.first_hook, injected[:5])


@pytest.mark.slow
def test_nightly_cli_catches_fp8_wo_a_scale_layout_on_the_official_export(official, tmp_path):
    """A clean stored run, a clean run in this process against it (same numbers as the notebook's),
    then ``python -m dsv4lab nightly --model <export> --inject fp8_wo_a_scale_layout``: exit 1 and
    one line naming the component."""
    pytest.importorskip("papermill")
    from dsv4lab.triage.nightly import run_nightly

    history = tmp_path / "history"
    first = run_nightly(history, model=str(official), log=lambda *_: None, heartbeat=0)
    assert first.status == "ok" and "nothing compared" in first.line, first.line
    assert first.manifest["reference"] == str(TINY_DIR)

    session = open_session(str(official), "cpu")
    assert session.reference == TINY_DIR and session.trained
    again, _ = _run(session, decode_steps=8)   # the notebook's DECODE_STEPS
    stored = json.loads((first.run / "metrics.json").read_text())
    res = RG.compare(again, stored)
    assert res.ok, res.text()

    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    cli = subprocess.run([sys.executable, "-m", "dsv4lab", "nightly", "--history", str(history), "--model",
                          str(official), "--inject", "fp8_wo_a_scale_layout", "--max-failing-mb", "1"],
                         capture_output=True, text=True, env=env, cwd=REPO, timeout=900)
    assert cli.returncode == 1, cli.stderr[-2000:]
    [line] = cli.stdout.strip().splitlines()
    handle = inject(session.model, "fp8_wo_a_scale_layout")
    try:
        expected = injected_components(session.model, handle)
    finally:
        handle.restore()
    manifest = json.loads(next(p for p in (history / "runs").glob("*/manifest.json")
                               if json.loads(p.read_text()).get("inject")).read_text())
    assert manifest["status"] == "regressed" and manifest["first_component"] in expected, manifest["first_component"]
    assert line.startswith("nightly: REGRESSED") and f"(component {manifest['first_component']})" in line
    assert manifest["line"] == line and manifest["reference"] == str(TINY_DIR)
