"""Bug zoo: every known bug is injectable by name and the triage localises it to its component,
on random tiny configs and (when it loads) the embedded model."""
from __future__ import annotations

import json

import pytest
import torch

from dsv4lab.bugzoo import BUGS, inject, triage
from dsv4lab.workbench import random_model
from oracle_util import tiny_config


pytestmark = pytest.mark.usefixtures("one_thread")


CONFIGS = {
    "tiny": dict(),
    # other layer order, top-k MoE first, a longer window and wider HCA
    "tiny-alt": dict(layer_types=["compressed_sparse_attention", "sliding_attention", "heavily_compressed_attention",
                                  "compressed_sparse_attention"],
                     mlp_layer_types=["moe", "hash_moe", "moe", "moe"], sliding_window=12,
                     compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 16},
                     swiglu_limit=2.0),
}


def _embedded():
    try:
        import dsv4lab

        return dsv4lab.load(progress=False)
    except Exception:  # noqa: BLE001 - not there yet: those cases are skipped
        return None


_MODELS: dict = {}


def get_model(key):
    if key not in _MODELS:
        if key == "embedded":
            _MODELS[key] = _embedded()
        else:
            _MODELS[key] = random_model(tiny_config(**CONFIGS[key]), seed=7 if key == "tiny-alt" else 0)
    assert _MODELS[key] is not None, "the embedded model (data/tiny-dsv4) must load with dsv4lab.load()"
    return _MODELS[key]


def prompt(model):
    from dsv4lab.cli.bugzoo_cmd import prompt_len

    if getattr(model, "source", None):  # the trained embedded model: natural text on which every bug is live
        from dsv4lab.bugzoo.prompts import live_prompt

        return live_prompt(model)
    n = prompt_len(model.config)
    return torch.randint(0, model.config.vocab_size, (1, n), generator=torch.Generator().manual_seed(5))


NEW = ["shared_expert_no_clamp", "fp8_wo_a_scale_layout", "compress_rope_main_theta", "index_topk_wrong_field",
       "compressor_window_off_by_one", "compressor_uninit_first_entry", "hash_expert0_from_embeddings",
       "hash_ids_wrong_dtype"]


def _logits_rel_err(r) -> float:
    t = r.compare.table()
    return float(t[t["name"] == "hook_logits"]["rel_err"].iloc[0])


def test_registry():
    assert len(BUGS) >= 24 and set(NEW) <= set(BUGS)
    for b in BUGS.values():
        d = b.to_dict()
        assert d["symptom"] and d["triggered_by"] and d["trigger"]["prompt"], b.name
    kinds = {b.kind for b in BUGS.values()}
    assert {"compressor", "experts", "shared_expert", "mhc", "attn", "indexer", "linear", "router"} <= kinds
    for b in BUGS.values():
        assert b.description and b.name and isinstance(b.impl, type)
    from_seeds = [b for b in BUGS.values() if b.seed and b.seed.startswith("seeds/")]
    assert len(from_seeds) >= 12


@pytest.mark.parametrize("key", ["tiny", "tiny-alt", "embedded"])
@pytest.mark.parametrize("bug", list(BUGS))
def test_every_bug_is_localised(key, bug):
    model = get_model(key)
    ids = prompt(model)
    r = triage(model, bug, ids, quantize=True)
    assert r.applicable, r.reason
    assert r.localized, f"{bug}: first divergence {r.first_divergence}, injected into {r.expected}"
    assert r.first_divergence.split(".")[-1].startswith("hook_")
    assert _logits_rel_err(r) > 0, f"{bug}: localised but the output did not change"  # caught, not only seen
    assert r.seq_len == BUGS[bug].trigger.ids(ids).shape[-1] and r.form == BUGS[bug].trigger.form
    assert (model.components()["impl"] == "reference").all()  # restored
    assert not model._forward_pre_hooks  # the input form and any armed hook are gone


def test_inject_restore_is_bitwise():
    model = get_model("tiny")
    ids = prompt(model)
    with torch.no_grad():
        ref = model(ids)
    for name in BUGS:
        h = inject(model, name)
        if h.applicable:
            assert h.names and all(model.get_submodule(n)._impl_label == f"bug:{name}" for n in h.names)
        h.restore()
        assert not model._forward_pre_hooks, name
        with torch.no_grad():
            assert torch.equal(model(ids), ref), name


def test_layers_and_applicability():
    model = get_model("tiny")
    h = inject(model, "compressor_ape_on_kv", layers=[2])
    assert h.names == ["layers.2.attn.compressor"]
    h.restore()
    h = inject(model, "compressor_ape_on_kv", layers=0)  # layer 0 is sliding: no compressor
    assert not h.applicable and "no compressor" in h.reason
    h = inject(model, "weight_scale_2_dropped")  # plain weights
    assert not h.applicable and "NVFP4" in h.reason
    r = triage(model, "weight_scale_2_dropped", prompt(model))
    assert not r.applicable
    r = triage(model, "sink_scaled", prompt(model), layers=[2])
    assert r.first_divergence == "layers.2.attn.hook_probs" and r.localized


def test_bug_decode_path_differs():
    model = get_model("tiny")
    ids = prompt(model)[:, :40]
    clean = model.generate(ids, 6, return_logits=True)[1]
    with inject(model, "compressor_ape_on_kv"):
        buggy = model.generate(ids, 6, return_logits=True)[1]
    assert not torch.equal(clean, buggy)


def test_mhc_helper_matches_reference():
    from dsv4lab.bugzoo.variants import mhc_mixes

    model = get_model("tiny")
    hc = model.layers[1].ffn_hc
    streams = torch.randn(1, 5, model.config.hc_mult, model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    for a, b in zip(hc.mixes(streams), mhc_mixes(hc, streams)):
        assert torch.equal(a, b)


def test_cli_json(capsys):
    from dsv4lab.cli.bugzoo_cmd import main

    rc = main(["--json", "--bugs", "sink_scaled,indexer_off"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0 and out["localized"] == 2
    assert [r["bug"] for r in out["results"]] == ["sink_scaled", "indexer_off"]
    assert main(["--list"]) == 0


# ------------------------------------------------------------------------------ triggers
def _changed(model, bug, ids, form="ids"):
    """Do the clean and the injected run differ on exactly this input (no trigger applied)?"""
    from dsv4lab.bugzoo.inputs import from_embeddings

    f = from_embeddings(model) if form == "embeds" else None
    try:
        with torch.no_grad():
            ref = model(ids)
            with inject(model, bug):
                out = model(ids)
    finally:
        if f is not None:
            f.restore()
    return not torch.equal(ref, out)


def test_off_by_one_needs_its_length_residue():
    model = get_model("tiny")
    ids = prompt(model)
    assert BUGS["compressor_window_off_by_one"].trigger.residue == (4, 3)
    for n in range(40, 48):  # two of each residue mod 4
        assert _changed(model, "compressor_window_off_by_one", ids[:, :n]) == (n % 4 == 3), n
    cut = BUGS["compressor_window_off_by_one"].trigger.ids(ids)
    assert cut.shape[-1] % 4 == 3 and ids.shape[-1] - 4 < cut.shape[-1] <= ids.shape[-1]
    with pytest.raises(ValueError, match="too short"):
        BUGS["compressor_window_off_by_one"].trigger.ids(ids[:, :5])


def test_hash_expert0_needs_embeddings():
    model = get_model("tiny")
    ids = prompt(model)
    assert not _changed(model, "hash_expert0_from_embeddings", ids, "ids")
    assert _changed(model, "hash_expert0_from_embeddings", ids, "embeds")


def test_from_embeddings_is_the_ids_run():
    from dsv4lab.model.validate import InputError

    model = get_model("tiny")
    ids = prompt(model)
    with torch.no_grad():
        ref = model(ids)
        e = model.embed(ids)
        assert torch.equal(model(ids, inputs_embeds=e), ref)
        with pytest.raises(ValueError, match="hash-routed layer needs input_ids"):  # layer 0 is hash-routed
            model(inputs_embeds=e)
        with pytest.raises(InputError, match="inputs_embeds"):
            model(ids, inputs_embeds=e[..., :-1])
        with pytest.raises(InputError, match="does not match"):
            model(ids[:, :-1], inputs_embeds=e)


def test_fp8_bug_needs_official_fp8_weights():
    from dsv4lab.bugzoo.inputs import fp8_block_for, fp8_in_place

    model = get_model("tiny")
    ids = prompt(model)
    assert not inject(model, "fp8_wo_a_scale_layout").applicable  # plain weights
    r = triage(model, "fp8_wo_a_scale_layout", ids, quantize=False)
    assert not r.applicable and "FP8" in r.reason
    assert fp8_block_for(7168, 4096) == 128 and fp8_block_for(256, 256) == 128 and fp8_block_for(16, 32) == 8
    before = {n: q.weight for n, q in model.qlinears()}
    with fp8_in_place(model) as names:
        assert names and all(model.get_submodule(n).format == "fp8_block" for n in names)
        assert _changed(model, "fp8_wo_a_scale_layout", ids)
    assert all(q.weight is not None and torch.equal(q.weight, before[n]) for n, q in model.qlinears())


def test_compressor_prefill_helper_matches_reference():
    from dsv4lab.bugzoo.variants import compressor_prefill

    model = get_model("tiny")
    comp = model.layers[1].attn.compressor
    x = torch.randn(1, 11, model.config.hidden_size, generator=torch.Generator().manual_seed(1))
    states = [model.new_state(1, 24).layers[1].compressor for _ in range(2)]
    for start, chunk in ((0, x[:, :6]), (6, x[:, 6:])):
        assert comp.prefill(chunk, start, states[0]) == compressor_prefill(comp, chunk, start, states[1])
    for a, b in zip((states[0].ring_kv, states[0].ring_gate, states[0].entries),
                    (states[1].ring_kv, states[1].ring_gate, states[1].entries)):
        assert torch.equal(a, b)


def test_cli_list_json_has_triggers(capsys):
    from dsv4lab.cli.bugzoo_cmd import main

    assert main(["--list", "--json"]) == 0
    rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)}
    assert len(rows) >= 24 and set(NEW) <= set(rows)
    assert rows["compressor_window_off_by_one"]["trigger"]["length"] == "S = 3 mod 4"
    assert rows["hash_expert0_from_embeddings"]["trigger"]["form"] == "embeds"
    assert "FP8" in rows["fp8_wo_a_scale_layout"]["trigger"]["weights"]
    assert all(r["symptom"] for r in rows.values())
