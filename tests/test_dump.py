"""Engine dumps against the reference (issue 26). The engines run in a SEPARATE process
(tests/engines/dump_engine.py): transformers' DeepseekV4ForCausalLM on the embedded checkpoint
(its own module names, its own cache), and dsv4lab's model with a bug-zoo bug injected under an
engine's own names, layouts and tensor-parallel shards. The comparator must find nothing on the
clean dumps, localise each planted bug, reassemble shards and refuse bad dumps with one clear line."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import dsv4lab
from dsv4lab.__main__ import main
from dsv4lab.dump import DumpError, DumpReader, Dumper, compare_dump, load_mapping, parse_tol

ROOT = Path(__file__).resolve().parents[1]
ENGINE = ROOT / "tests" / "engines" / "dump_engine.py"
ZOO_MAPPING = str(ROOT / "tests" / "engines" / "zoo_mapping.json")
ZOO_TOL = "1e-4,**.hook_resid_post=1e-2"   # the zoo engine stores its streams in bf16


def write_dump(out: Path, engine: str, *args: str) -> Path:
    subprocess.run([sys.executable, str(ENGINE), engine, str(out), *args], check=True, cwd=ROOT,
                   capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"})
    return out


@pytest.fixture(scope="module")
def dumps(tmp_path_factory):
    """Dumps written lazily by the stand-in engines, once per module."""
    root = tmp_path_factory.mktemp("dumps")
    made: dict[str, Path] = {}

    def get(engine: str, bug: str | None = None, steps: int = 2, tp: int = 1, prompt_len: int = 40) -> Path:
        key = f"{engine}_{bug or 'clean'}_s{steps}_tp{tp}_p{prompt_len}"
        if key not in made:
            args = ["--steps", str(steps), "--tp", str(tp), "--prompt-len", str(prompt_len)] + (["--bug", bug] if bug else [])
            made[key] = write_dump(root / key, engine, *args)
        return made[key]

    return get


@pytest.fixture(scope="module")
def model():
    return dsv4lab.load(progress=False)


def _status(argv) -> int:
    try:
        return main(argv)
    except SystemExit as e:
        return e.code


# ------------------------------------------------------------------------------ clean dumps
def test_clean_transformers_dump_agrees(model, dumps):
    d = dumps("hf", steps=3)
    res = compare_dump(model, d, "hf", progress=False)
    assert res.first_divergence is None, res.divergence_line()
    assert res.steps == 3
    hooks = {r["hook"] for r in res.rows}
    L = model.config.num_hidden_layers
    for i in range(L):  # every component the hf mapping names is compared in every layer
        if model.config.compress_ratio(i) == 4:
            assert f"layers.{i}.attn.indexer.hook_indices" in hooks
        for h in ("attn_hc.hook_collapsed", "attn_hc.hook_comb", "attn.hook_out", "ffn_hc.hook_post",
                  "mlp.router.hook_ids", "mlp.router.hook_weights", "mlp.experts.hook_out",
                  "mlp.shared_expert.hook_out", "mlp.hook_out", "hook_resid_post"):
            assert f"layers.{i}.{h}" in hooks
    assert {"hook_embed", "hook_final_hidden", "hook_logits"} <= hooks
    assert {r["step"] for r in res.rows} == {0, 1, 2}            # prefill and two decode steps
    assert "model.layers.0.input_layernorm" in res.unmapped       # dumped, no hook point for it
    orders = [r["order"] for r in res.rows]
    assert orders == sorted(orders)                               # execution order
    assert max(r["rel_err"] for r in res.rows) < 1e-4
    assert not res.not_fired


def test_short_prompt_pads_the_indexer_choice(model, dumps):
    """18 tokens: fewer closed entries than index_topk, so transformers returns fewer columns than
    the reference's fixed-k decode; the hf mapping pads them with -1 to the reference's width."""
    res = compare_dump(model, dumps("hf", steps=4, prompt_len=18), "hf", progress=False)
    assert res.first_divergence is None, res.divergence_line()
    widths = {r["step"]: r["shape"][-1] for r in res.rows if r["hook"] == "layers.2.attn.indexer.hook_indices"}
    assert widths[0] < model.config.index_topk and len(widths) == 4


def test_clean_zoo_dump_with_tp_shards_agrees(model, dumps):
    d = dumps("zoo", tp=2)
    names = DumpReader(d).names()
    assert "blk.0.attn.q.rank1" in names and "blk.3.moe.routed.rank1" in names
    res = compare_dump(model, d, ZOO_MAPPING, tol=ZOO_TOL, progress=False)
    assert res.first_divergence is None, res.divergence_line()
    eng = {r["engine"] for r in res.rows}
    assert "blk.0.attn.q.rank{r}" in eng and "blk.3.moe.routed.rank{r}" in eng
    # the bf16 streams would diverge at the default tolerance: the override is what passes them
    strict = compare_dump(model, d, ZOO_MAPPING, progress=False)
    assert strict.first_divergence["hook"] == "layers.0.hook_resid_post"


# ------------------------------------------------------------------------------ planted bugs
@pytest.mark.parametrize("bug,hook,culprit", [
    ("hf_sink_scaled", "layers.2.attn.hook_out", "layers.2.attn"),
    ("hf_silu_clamped", "layers.3.mlp.experts.hook_out", "layers.3.mlp.experts"),
    # the indexer's inputs (queries, compressed keys) are not in a transformers dump: the verdict
    # names the unseen components before it, and feeding its choice in clears everything after
    ("hf_indexer_weights_sign", "layers.2.attn.indexer.hook_indices",
     "layers.2.attn, layers.2.attn.compressor, layers.2.attn.indexer"),
])
def test_transformers_engine_bugs_localised(model, dumps, bug, hook, culprit):
    res = compare_dump(model, dumps("hf", bug), "hf", progress=False, isolate=True)
    fd = res.first_divergence
    assert fd is not None and fd["hook"] == hook and fd["step"] == 0
    assert res.isolation["culprit"] == culprit
    own = hook.rsplit(".", 1)[0]
    assert f"{own} is wrong" in res.isolation["verdict"]
    assert ("got wrong input" in res.isolation["verdict"]) == ("," in culprit)
    assert res.isolation["propagated"]  # later points diverged only because of it
    others = [o for o in res.isolation["origins"] if not o["hook"].startswith(own)]
    assert not others, others          # fed the engine's tensor, everything else agrees


@pytest.mark.parametrize("bug,component", [
    ("compressor_ape_on_kv", "layers.2.attn.compressor"),   # first compressed layer
    ("sink_scaled", "layers.0.attn"),
    ("moe_w1_w3_swapped", "layers.0.mlp.experts"),
    ("indexer_off", "layers.2.attn"),                        # the indexer's choice shows in attention
    ("mhc_comb_not_transposed", "layers.0"),                 # the expanded streams: resid_post
])
def test_zoo_bugs_localised_under_engine_names_and_shards(model, dumps, bug, component):
    res = compare_dump(model, dumps("zoo", bug, tp=2), ZOO_MAPPING, tol=ZOO_TOL, progress=False, isolate=True)
    fd = res.first_divergence
    assert fd is not None and fd["step"] == 0
    assert fd["hook"].rsplit(".", 1)[0] == component, res.divergence_line()
    assert component in res.isolation["culprit"]


def test_isolate_says_got_wrong_input_when_the_input_is_not_dumped(model, dumps, tmp_path):
    """Only shared-expert outputs mapped: layer 2's attention bug first shows there, and the verdict
    names the unseen components in between instead of blaming the shared expert."""
    m = tmp_path / "only_shared.json"
    m.write_text(json.dumps({"rules": [{"engine": r"model\.layers\.(?P<layer>\d+)\.mlp\.shared_experts",
                                        "hook": "layers.{layer}.mlp.shared_expert.hook_out"}]}))
    res = compare_dump(model, dumps("hf", "hf_sink_scaled"), str(m), progress=False, isolate=True)
    assert res.first_divergence["hook"] == "layers.2.mlp.shared_expert.hook_out"
    assert "got wrong input" in res.isolation["verdict"]
    assert "layers.2.attn" in res.isolation["culprit"].split(", ")


# ------------------------------------------------------------------------------ CLI
def test_cli_exit_status_and_json(dumps, capsys):
    assert _status(["compare-dump", str(dumps("hf")), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["first_divergence"] is None and len(out["per_hook"]) == out["compared"] > 0
    assert _status(["compare-dump", str(dumps("hf", "hf_sink_scaled")), "--json", "--isolate"]) == 1
    out = json.loads(capsys.readouterr().out)
    assert out["first_divergence"]["hook"] == "layers.2.attn.hook_out"
    assert out["first_divergence"]["engine"] == "model.layers.2.self_attn.0"
    assert out["isolation"]["culprit"] == "layers.2.attn"


def _one_line(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    assert err.startswith("dsv4lab compare-dump: "), err
    return err


def test_missing_input_ids(tmp_path, capsys):
    save_file({"lm_head": torch.zeros(1, 2, 3)}, str(tmp_path / "step_000.safetensors"))
    assert _status(["compare-dump", str(tmp_path)]) == 2
    assert "'input_ids'" in _one_line(capsys)


def test_truncated_step_file(dumps, tmp_path, capsys):
    d = tmp_path / "d"
    shutil.copytree(dumps("hf"), d)
    b = (d / "step_001.safetensors").read_bytes()
    (d / "step_001.safetensors").write_bytes(b[: len(b) // 2])
    assert _status(["compare-dump", str(d)]) == 2
    err = _one_line(capsys)
    assert "step_001.safetensors" in err and "truncated" in err


def test_not_a_dump(tmp_path, capsys):
    assert _status(["compare-dump", str(tmp_path / "nope")]) == 2
    assert "not a directory" in _one_line(capsys)
    assert _status(["compare-dump", str(tmp_path)]) == 2
    assert "no step_NNN.safetensors" in _one_line(capsys)
    save_file({"input_ids": torch.ones(1, 1, dtype=torch.long)}, str(tmp_path / "step_001.safetensors"))
    assert _status(["compare-dump", str(tmp_path)]) == 2
    assert "step 0 is missing" in _one_line(capsys)


def test_mapping_to_unknown_hook_has_did_you_mean(dumps, tmp_path, capsys):
    m = tmp_path / "m.json"
    m.write_text(json.dumps({"rules": [{"engine": r"model\.layers\.(?P<layer>\d+)\.mlp\.shared_experts",
                                        "hook": "layers.{layer}.mlp.shared_experts.hook_out"}]}))
    assert _status(["compare-dump", str(dumps("hf")), "--mapping", str(m)]) == 2
    err = _one_line(capsys)
    assert "'layers.0.mlp.shared_experts.hook_out'" in err and "did you mean" in err and "shared_expert.hook_out" in err


def test_tolerance_pattern_and_device_named(dumps, capsys):
    """A --tol override matching no hook point (it would leave that hook at the default without a
    word) and a bad --device each fail as one line with the fix."""
    assert _status(["compare-dump", str(dumps("hf")), "--tol", "1e-3,**.hook_resid_pst=1e-2"]) == 2
    err = _one_line(capsys)
    assert "tol pattern '**.hook_resid_pst' matches no hook point; did you mean 'layers.*.hook_resid_post'" in err
    assert _status(["compare-dump", str(dumps("hf")), "--device", "gpu"]) == 2
    assert "device='gpu' is not a device" in _one_line(capsys)


def test_shape_mismatch_after_mapping_is_named(model, dumps, tmp_path):
    spec = json.loads(Path(ZOO_MAPPING).read_text())
    for r in spec["rules"]:
        if r["hook"].endswith("attn.hook_out"):
            r.pop("ops")   # forget the engine's [B, D, S] layout
    with pytest.raises(DumpError) as e:
        compare_dump(model, dumps("zoo", tp=2), spec, tol=ZOO_TOL, progress=False)
    msg = str(e.value)
    assert "'blk.0.attn.out'" in msg and "layers.0.attn.hook_out" in msg and "[1, 256, 40]" in msg
    assert "reshape/transpose" in msg


def test_nothing_mapped_and_missing_rank(model, dumps, tmp_path):
    with pytest.raises(DumpError, match="maps none of the dump"):
        compare_dump(model, dumps("zoo", tp=2), "hf", progress=False)
    d = tmp_path / "d"
    shutil.copytree(dumps("zoo", tp=2), d)
    from safetensors.torch import load_file
    t = load_file(str(d / "step_001.safetensors"))
    del t["blk.0.attn.q.rank0"]
    save_file(t, str(d / "step_001.safetensors"))
    with pytest.raises(DumpError, match="rank 0 of 2 is missing"):
        compare_dump(model, d, ZOO_MAPPING, tol=ZOO_TOL, progress=False)


# ------------------------------------------------------------------------------ pieces
def test_mapping_layout_ops_and_shards():
    x = torch.randn(2, 8, 5, 16)  # [B, H, S, Dh]
    shards = {f"q.rank{r}": p for r, p in enumerate(x.chunk(4, dim=1))}
    mp = load_mapping({"rules": [{"engine": r"q\.rank(?P<rank>\d+)", "hook": "hook_q", "shards": "cat:1",
                                  "ops": [{"transpose": [1, 2]}, {"flatten": [2, 3]}, {"unflatten": [-1, [8, 16]]},
                                          {"dtype": "float64"}]},
                                 {"engine": r"p\.rank(?P<rank>\d+)", "hook": "hook_p", "shards": "sum"},
                                 {"engine": r"t", "item": 1, "hook": "hook_t"}]})
    targets, unmapped = mp.targets(list(shards) + ["p.rank1", "p.rank0", "t.0", "t.1", "other"])
    by = {t.hook: t for t in targets}
    assert unmapped == ["t.0", "other"]
    got = mp.assemble(by["hook_q"], shards.__getitem__)
    assert got.dtype == torch.float64 and torch.equal(got, x.transpose(1, 2).double())
    parts = {"p.rank0": torch.ones(3), "p.rank1": 2 * torch.ones(3), "t.1": torch.zeros(1)}
    assert torch.equal(mp.assemble(by["hook_p"], parts.__getitem__), 3 * torch.ones(3))
    assert by["hook_t"].names == ["t.1"]
    cfg = type("Cfg", (), {"num_attention_heads": 8, "head_dim": 16})()
    mp2 = load_mapping({"rules": [{"engine": "q", "hook": "hook_q",
                                   "ops": [{"reshape": [0, 0, "num_attention_heads", "head_dim"]}]}]})
    flat = x.transpose(1, 2).flatten(2)   # [B, S, H*Dh]
    assert torch.equal(mp2.assemble(mp2.targets(["q"])[0][0], {"q": flat}.__getitem__, cfg), x.transpose(1, 2))
    with pytest.raises(DumpError, match="not one of"):
        load_mapping({"rules": [{"engine": "a", "hook": "b", "ops": [{"transpose_": [0, 1]}]}]})
    with pytest.raises(DumpError, match="rank"):
        load_mapping({"rules": [{"engine": "a", "hook": "b", "shards": "sum"}]})


def test_tolerance_overrides():
    tol = parse_tol("1e-3,**.router.hook_ids=0.05,hook_logits=1e-2")
    assert tol("layers.3.attn.hook_out") == 1e-3
    assert tol("layers.3.mlp.router.hook_ids") == 0.05 and tol("hook_logits") == 1e-2
    with pytest.raises(ValueError, match="PATTERN=NUMBER"):
        parse_tol("tight")


def test_dumper_reuses_buffers_and_writes_steps(tmp_path):
    d = Dumper(tmp_path / "d", metadata={"engine": "x"})
    lin = torch.nn.Linear(4, 3)
    d.hook(lin, "lin")
    ptrs = []
    for s in range(3):
        x = torch.full((1, 2, 4), float(s))
        y = lin(x)
        d.add("pair", (y, None, y * 2))
        ptrs.append(d._current["lin"].data_ptr())
        d.step(torch.tensor([[s, s]]))
    assert len(set(ptrs)) == 1                               # one preallocated buffer, copied into
    r = DumpReader(tmp_path / "d")
    assert len(r) == 3 and r.steps[2].metadata["engine"] == "x" and r.steps[2].metadata["step"] == "2"
    assert sorted(r.steps[1].names) == ["lin", "pair.0", "pair.2"]
    assert torch.equal(r.get(2, "lin"), lin(torch.full((1, 2, 4), 2.0)).detach())
    assert torch.equal(r.steps[1].input_ids, torch.tensor([[1, 1]]))
    with pytest.raises(FileExistsError):
        Dumper(tmp_path / "d")


def test_dumper_graph_steps_write_the_captured_buffers(tmp_path):
    """Under CUDA graphs hooks do not run on replay: a step marked graph=label writes the buffers
    the capture copied into (here the 'replay' is the copy the graph would do)."""
    d = Dumper(tmp_path / "g")
    x = torch.zeros(2, 3)
    d.add("out", x)                       # eager warm-up allocates the buffer
    with d.graph("decode"):
        d.add("out", x)                   # what capture records: a copy_ into that buffer
    buf = d._graphs["decode"]["out"]
    for s in range(2):
        buf.copy_(torch.full((2, 3), float(s + 1)))   # the replay refreshes the buffer
        d.step(torch.tensor([[s]]), graph="decode")
    r = DumpReader(tmp_path / "g")
    assert torch.equal(r.get(1, "out"), torch.full((2, 3), 2.0)) and r.steps[1].names == ["out"]
    with pytest.raises(ValueError, match="no capture was recorded"):
        d.step(torch.tensor([[0]]), graph="prefill")
