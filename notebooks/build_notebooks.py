"""Generate the triage notebooks (``python notebooks/build_notebooks.py``).

The notebooks are written from this file so they stay reviewable: cells are short and call
``dsv4lab.triage`` functions; edit here, regenerate, commit both. Every notebook starts with a
markdown intro, then a cell tagged ``parameters`` (papermill injects overrides after it).
"""
from __future__ import annotations

from pathlib import Path

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

HERE = Path(__file__).resolve().parent

COMMON_PARAMS = '''MODEL = None          # None = the embedded model (data/tiny-dsv4); or a checkpoint path; "random" = random weights
DEVICE = "cpu"        # "cuda" / "cuda:0" for the GPU-only parts
PROMPT = "The capital of France is"
CHAT_PROMPT = "What is the capital of France?"
ANSWER = " Paris"     # expected next token of PROMPT (checked when the trained model is loaded)
INTERACTIVE = False   # True: build the ipywidgets panels (never blocks a headless run either way)
METRICS_OUT = None    # where the metrics JSON goes (the report runner sets it)
REPORT_DIR = None
'''

SETUP = '''import warnings
warnings.filterwarnings("ignore", message=".*embedded model.*")
from IPython.display import display, Markdown
from dsv4lab.triage import plots
from dsv4lab.triage.plots import show
from dsv4lab.triage.session import open_session
from dsv4lab.triage.metrics import recorder

S = open_session(MODEL, DEVICE)
rec = recorder("{name}", METRICS_OUT, model=S.source)
print(S.describe())
if not S.trained:
    display(Markdown("**Note:** the trained embedded model is not available: random weights. Every mechanism runs, "
                     "but behaviour (Paris, retrieval) is meaningless."))'''

FOOTER = '''display(Markdown("### Metrics recorded by this notebook"))
rec.table()'''


def nb(name: str, intro: str, params: str, cells: list) -> None:
    book = new_notebook()
    book.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    book.metadata["language_info"] = {"name": "python"}
    book.cells.append(new_markdown_cell(intro.strip()))
    p = new_code_cell((COMMON_PARAMS + params).strip())
    p.metadata["tags"] = ["parameters"]
    book.cells.append(p)
    book.cells.append(new_code_cell(SETUP.replace("{name}", name)))
    for c in cells:
        if c.startswith("## ") or c.startswith("# ") or c.startswith("MD:"):
            book.cells.append(new_markdown_cell(c.removeprefix("MD:").strip()))
        else:
            book.cells.append(new_code_cell(c.strip()))
    book.cells.append(new_code_cell(FOOTER))
    for i, cell in enumerate(book.cells):  # stable ids: rebuilding changes only what changed
        cell.id = f"{name[:2]}-cell-{i:02d}"
    nbformat.write(book, str(HERE / f"{name}.ipynb"))


# ------------------------------------------------------------------------------------------ 01
nb("01_load_and_inspect", """
# 1. Load and inspect a checkpoint

What you learn: what is in the checkpoint (layout, weight formats, bytes per layer and per
component, missing / unexpected tensors against its config) and how it would sit on the GPUs
(device map, memory plan) -- **from safetensors headers only**: the same cells work on a 0.9 TB
V4-Pro NVFP4 checkpoint, shown at the end on a header-only (sparse) V4-Pro-sized checkpoint.
""", '''
BIG_CHECKPOINT = "pro"   # "pro" / "flash": also inspect a header-only checkpoint of that size; None to skip
GPUS = 8
GPU_MEMORY = "141GB"
CONTEXT = 65536
''', [
    "## The model's checkpoint",
    '''import tempfile, os
from dsv4lab.triage import inspect_view as IV
if S.path is not None:
    CKPT = S.path
else:   # random weights: write them as a transformers-layout checkpoint to have something to inspect
    from dsv4lab.checkpoint import save_checkpoint
    CKPT = tempfile.mkdtemp(prefix="dsv4lab_ckpt_")
    save_checkpoint(CKPT, S.config, dict(S.model.state_dict()), layout="transformers")
rep = IV.inspect(CKPT)
rec.record("checkpoint.ok", rep["ok"])
rec.record("checkpoint.n_logical_tensors", rep["n_logical_tensors"])
rec.record("checkpoint.tensor_bytes", rep["tensor_bytes"], {"rel": 0.01})
IV.overview_table(rep)''',
    "MD:Weight formats (a linear may be plain BF16/FP32, NVFP4, MXFP4 or FP8-block; detected per tensor):",
    '''IV.formats_table(rep)''',
    '''IV.kinds_table(rep)''',
    '''show(IV.layer_bytes_figure(rep, "Embedded model: checkpoint bytes per layer and component"))
IV.layers_table(rep)''',
    '''from dsv4lab.checkpoint.inspect import render_inspect
print(render_inspect(rep))''',
    "## Device map and memory plan\nWeights from the headers plus the fixed-shape decode state (allocated on the `meta` device) for the context below; contiguous layer ranges per GPU.",
    '''plan_small = IV.memory_plan(CKPT, gpus=1, gpu_memory="16GB", context=4096)
rec.record("plan.embedded_fits_one_16GB_gpu", plan_small.fits)
print(plan_small.summary())''',
    "## At full size, without the data\nA header-only NVFP4 checkpoint with the real V4 tensor list and shapes (files are sparse: nothing but headers is written). Inspection and planning read only headers.",
    '''if BIG_CHECKPOINT:
    big = IV.sparse_v4_checkpoint(tempfile.mkdtemp(prefix="dsv4lab_big_"), BIG_CHECKPOINT)
    big_rep = IV.inspect(big["path"])
    rec.record(f"big_{BIG_CHECKPOINT}.tensor_bytes", big_rep["tensor_bytes"], {"rel": 0.001})
    rec.record(f"big_{BIG_CHECKPOINT}.ok", big_rep["ok"])
    rec.record(f"big_{BIG_CHECKPOINT}.inspect_seconds", big_rep["inspect_seconds"], "ignore")
    display(IV.overview_table(big_rep)); display(IV.formats_table(big_rep)); display(IV.kinds_table(big_rep).head(12))''',
    '''if BIG_CHECKPOINT:
    show(IV.layer_bytes_figure(big_rep, f"V4-{BIG_CHECKPOINT} NVFP4 (header-only): bytes per layer and component"))''',
    '''if BIG_CHECKPOINT:
    plan = IV.memory_plan(big["path"], gpus=GPUS, gpu_memory=GPU_MEMORY, context=CONTEXT)
    rec.record(f"big_{BIG_CHECKPOINT}.plan_fits", plan.fits)
    print(plan.summary())
    show(IV.plan_figure(plan, f"V4-{BIG_CHECKPOINT} on {GPUS} x {GPU_MEMORY}: memory plan (context {CONTEXT})"))
    print("device_map for dsv4lab.load(path, device_map=...):", plan.device_map()[:4], "...")''',
])

# ------------------------------------------------------------------------------------------ 02
nb("02_first_token_logits", """
# 2. First-token logits of the probe

What you learn: what the model predicts right after the probe in plain, chat and thinking
encodings (the exact tokens fed in, a top-k table and bar chart), where in the depth the answer
appears (logit lens: the final `hc_head` collapse + norm + head applied to each layer's
residual streams), and what the thinking-mode logits mean (reasoning tokens first, then
`</think>`, then the answer).
""", '''
TOPK = 10
THINK_STEPS = 24
''', [
    '''from dsv4lab.triage import logits as LG
ans_id = S.token_id(ANSWER)
probes = LG.probe_all_modes(S, PROMPT, CHAT_PROMPT, k=TOPK)
for mode, ft in probes.items():
    rec.record(f"{mode}.top1", S.tok(ft.top1_id))
    rec.record(f"{mode}.p_top1", float(ft.probs.max()), {"abs": 1e-3, "rel": 0.01})
    if ans_id is not None:
        rec.record(f"{mode}.p_answer", float(ft.probs[ans_id]), {"abs": 1e-3, "rel": 0.02})
rec.record("plain.top1_is_answer", probes["plain"].top1_id == ans_id)
rec.record("logits_finite", all(bool(ft.logits.isfinite().all()) for ft in probes.values()))''',
    "## The encodings\nThe exact token sequences (DSV4 chat encoding: chat ends `<｜Assistant｜></think>`, thinking ends `<｜Assistant｜><think>`).",
    '''for mode, ft in probes.items():
    print(f"{mode:9s}", repr(ft.text))
LG.encoding_table(S, probes["thinking"]).T''',
    "## Top-k next tokens",
    '''for mode, ft in probes.items():
    display(Markdown(f"**{mode}**: top-1 `{S.tok(ft.top1_id)!r}`"))
    display(ft.table)
    show(LG.topk_figure(S, ft, TOPK, highlight=ans_id))''',
    "## Logit lens\nEach row applies the final `hc_head` + norm + head to the streams after that layer; the last row equals the real logits (checked).",
    '''lens_df, lens, real = LG.logit_lens(S, probes["plain"].ids, ans_id)
rec.record("lens.final_row_max_abs_diff", float((lens[-1] - real).abs().max()), {"abs": 1e-4, "direction": "up"})
if ans_id is not None:
    rec.record("lens.p_answer_by_layer", [round(x, 4) for x in lens_df["p_answer"]], {"abs": 2e-3})
    first = next((r.layer for r in lens_df.itertuples() if r.top1 == repr(ANSWER)), None)
    rec.record("lens.first_layer_answer_top1", first)
lens_df''',
    '''show(LG.lens_figure(S, probes["plain"].ids, lens))
if ans_id is not None:
    show(LG.answer_by_layer_figure(lens_df, ANSWER))''',
    "## Thinking mode, token by token\nAfter `<think>` the model first writes its reasoning; the answer token only becomes likely once `</think>` has been emitted. The table shows, per greedy step, the chosen token's probability, the probability of closing the reasoning (`</think>`), of EOS and of the answer.",
    '''think_df, think_text = LG.thinking_walk(S, CHAT_PROMPT, ans_id, steps=THINK_STEPS)
print(repr(think_text))
closed = (think_df["token"] == repr("</think>")).any()
rec.record("thinking.closes_think", bool(closed))
rec.record("thinking.n_tokens", len(think_df), "ignore")
think_df''',
    '''show(LG.thinking_figure(think_df, ANSWER))''',
])

# ------------------------------------------------------------------------------------------ 03
nb("03_precision_ablation", """
# 3. Precision ablation

What you learn: which components need more precision. The model under test holds NVFP4
weights; the reference is the original BF16 model. Per component kind (and per layer) choose
`orig` (original BF16 weights), `bf16` (FP4 weights dequantised), `w4a16`, `w4a4` (NVFP4
activations) or `w4a8`; see KL and top-1 against the reference, the per-layer cosine of the
residual streams and router overlap. Then the full one-at-a-time sweeps and the greedy
precision floor. The interactive panel (INTERACTIVE=True) calls the same `ablation.evaluate`.
""", '''
FLOOR_THRESHOLD = 0.01   # KL (nats) the greedy floor must reach
FLOOR_MAX_STEPS = 6
''', [
    '''from dsv4lab.triage import ablation as AB
ids = S.encode(CHAT_PROMPT, "chat")
setup = AB.make_setup(S, ids)
print("component kinds:", setup.kinds)''',
    "## Interactive panel",
    '''panel = AB.AblationPanel(setup, S)
if INTERACTIVE:
    display(panel.widget()); panel.redraw()
else:   # headless: the same call the widgets make, for one example setting
    panel.set("head", "orig").set("router", "orig")
    print(panel.readout())''',
    "## Whole-model policies",
    '''policies = {"all w4a16": "w4a16", "all w4a4": "w4a4", "all w4a8": "w4a8",
            "w4a4, head+router orig": AB.Toggles("w4a4", {"head": "orig", "router": "orig"}), "all orig": "orig"}
results = {k: AB.evaluate(setup, v) for k, v in policies.items()}
import pandas as pd
pol_df = pd.DataFrame([{"policy": k, "kl": r["kl"], "kl_last": r["kl_last"], "top1": r["top1"], "min_layer_cos": r["min_layer_cos"],
                        "top1 token": S.tok(r["top1_token_id"])} for k, r in results.items()])
for k, r in results.items():
    key = k.replace(" ", "_").replace(",", "").replace("+", "_")
    rec.record(f"kl.{key}", r["kl"], {"abs": 1e-4, "rel": 0.05, "direction": "up"})
    rec.record(f"min_layer_cos.{key}", r["min_layer_cos"], {"abs": 1e-4, "direction": "down"})
rec.record("orig_is_exact", results["all orig"]["kl"] < 1e-9)
pol_df''',
    '''toks = [f"{i}:{t!r}" for i, t in enumerate(S.toks(ids[0]))]
show(AB.kl_per_pos_figure({k: r for k, r in results.items() if k != "all orig"}, toks))
show(AB.layer_cos_figure({k: r for k, r in results.items() if k != "all orig"}))''',
    "## One-at-a-time sweeps\n**Rescue**: everything FP4 (`w4a16`), one kind back to its original BF16 weights. **Damage**: everything `w4a16`, one kind's activations quantised to NVFP4 (`w4a4`).",
    '''rescue = AB.sweep(setup, "orig", base="w4a16")
damage = AB.sweep(setup, "w4a4", base="w4a16")
best = rescue[rescue.kind != "(base)"].sort_values("kl").iloc[0]
rec.record("sweep.rescue_best_kind", best.kind, "ignore")
rec.record("sweep.rescue_kl", {k: round(v, 6) for k, v in zip(rescue.kind, rescue.kl)}, {"abs": 1e-4, "rel": 0.05})
rec.record("sweep.damage_kl", {k: round(v, 6) for k, v in zip(damage.kind, damage.kl)}, {"abs": 1e-4, "rel": 0.05})
show(AB.sweep_figure(rescue, "Rescue: KL vs original when ONE kind gets its original BF16 weights (rest FP4)"))
rescue''',
    '''show(AB.sweep_figure(damage, "Damage: KL vs original when ONE kind's activations are NVFP4 (W4A4)"))
damage''',
    "MD:Per layer, for the kind whose rescue helps most:",
    '''per_layer = AB.sweep(setup, "orig", base="w4a16", per_layer=True, kinds=[best.kind])
show(AB.sweep_figure(per_layer, f"Rescue per layer: {best.kind} restored in one layer at a time"))
per_layer''',
    "## Greedy precision floor\nFrom W4A4 everywhere, restore (original BF16) the kind that lowers KL most, until KL < threshold.",
    '''chosen, steps, reached = AB.floor(setup, FLOOR_THRESHOLD, base="w4a4", fix="orig", max_steps=FLOOR_MAX_STEPS)
rec.record("floor.kinds", chosen, "ignore")
rec.record("floor.reached", reached, "ignore")
rec.record("floor.final_kl", float(steps.kl.iloc[-1]), {"abs": 1e-4, "rel": 0.05, "direction": "up"})
rec.record("floor.kl_monotone", bool((steps.kl.diff().dropna() <= 1e-12).all()))
show(AB.floor_figure(steps))
steps''',
])

# ------------------------------------------------------------------------------------------ 04
nb("04_compressor_and_indexer", """
# 4. Compressor and indexer

What you learn: how the KV compressor pools tokens into compressed entries (softmax weights per
window; in CSA layers each entry pools two overlapping windows, so every token appears in two
rows), which compressed entries the lightning indexer picks for each query, and whether on a
long-range retrieval prompt the block holding the planted key is chosen -- and what the answer
loses when it is not.
""", '''
RETRIEVAL_SEQ_LEN = 320
RETRIEVAL_SEED = 0
''', [
    '''from dsv4lab.triage import compressor_view as CV
ex = CV.retrieval_example(S, seq_len=RETRIEVAL_SEQ_LEN, seed=RETRIEVAL_SEED)
print(f"prompt of {ex.ids.shape[1]} tokens; planted {ex.key} -> {ex.value!r} at position {ex.plant_pos}, asked {ex.distance} tokens later "
      f"(sliding window {S.config.sliding_window})")
print("...", repr(S.tokenizer.decode(ex.ids[0, -24:].tolist())))
rr = CV.retrieval_check(S, ex)
cache = rr["cache"]''',
    "## Compressor softmax weights per window",
    '''for layer in CV.compressed_layers(S.model):
    st = CV.overlap_stats(S.model, layer, cache, ex.ids.shape[1])
    rec.record(f"compressor.L{layer}.entries", st["entries"])
    rec.record(f"compressor.L{layer}.max_entries_per_token", st["max_entries_per_token"])
    rec.record(f"compressor.L{layer}.entropy", st["mean_entropy"], {"abs": 1e-4, "rel": 1e-3})
    show(CV.weights_figure(S, ex.ids, layer, cache, last_positions=64))''',
    "## Indexer scores and chosen top-k\nRed box: the entries whose window holds the planted value.",
    '''for layer in CV.csa_layers(S.model):
    show(CV.indexer_figure(S, ex.ids, layer, cache, last_queries=96, mark=CV.planted_entries(S.model, layer, ex.plant_pos)))''',
    "## Retrieval: is the planted block chosen?",
    '''blocked = CV.retrieval_check(S, ex, block_planted=True)
import pandas as pd
rows = []
for layer, r in rr["layers"].items():
    rows.append({"layer": layer, "planted entries": r["planted_entries"], "chosen by last query": r["chosen"],
                 "planted chosen": r["planted_chosen"], "best planted rank": r["best_planted_rank"], "valid entries": r["n_valid_entries"]})
    rec.record(f"retrieval.L{layer}.planted_chosen", r["planted_chosen"])
    rec.record(f"retrieval.L{layer}.best_planted_rank", r["best_planted_rank"], {"abs": 2})
rec.record("retrieval.p_answer", rr["p_answer"], {"abs": 2e-3, "rel": 0.02})
rec.record("retrieval.p_answer_planted_blocked", blocked["p_answer"], {"abs": 2e-3, "rel": 0.02})
rec.record("retrieval.answer_correct", rr["top1_id"] == ex.answer_id)
display(pd.DataFrame(rows))
print(f"answer {S.tok(ex.answer_id)!r}: p={rr['p_answer']:.4f} (rank {rr['answer_rank']}), model's top-1 {S.tok(rr['top1_id'])!r}")
print(f"with the planted entries removed from every top-k: p={blocked['p_answer']:.4f} (rank {blocked['answer_rank']})")''',
    "## Which compressed branch carries the copy?\nZero the compressed entries whose windows cover the planted value and the two sliding windows after it (the early sliding layers smear the key/value association over the following tokens) in the CSA layers only, in the HCA layers only, or in both, and watch the answer.",
    '''abl = {k: CV.retrieval_check(S, ex, ablate_entries=k) for k in ("csa", "hca", "all")}
for k, r in abl.items():
    rec.record(f"retrieval.p_answer_ablated_{k}", r["p_answer"], {"abs": 2e-3, "rel": 0.02})
display(pd.DataFrame([{"planted entries zeroed in": k, "p(answer)": r["p_answer"], "answer rank": r["answer_rank"]}
                      for k, r in [("none", rr)] + list(abl.items())]))''',
])

# ------------------------------------------------------------------------------------------ 05
nb("05_graph_vs_eager_decode", """
# 5. Graph versus eager decode

What you learn: whether decoding from fixed-shape buffers gives the same tokens and logits as
the reference, step after step, how long each step takes, and which host syncs a step contains.
On CUDA: eager `decode_step` vs CUDA-graph replay. On CPU there are no graphs: the fixed-buffer
decode step is checked against full forwards, and the cell below says what needs a GPU.
""", '''
STEPS = 24
''', [
    '''import pandas as pd
from dsv4lab.triage import decode_view as DV
ids = S.encode(PROMPT)
dc = DV.run(S, ids, steps=STEPS)
sm = dc.summary()
rec.record("modes", sm["modes"], "ignore")  # device-dependent (CPU: buffers vs full forward; CUDA: eager vs graph)
rec.record("token_agreement", sm["token_agreement"], {"abs": 0.0, "direction": "down"})
rec.record("max_abs_logit_diff", sm["max_abs_logit_diff"], {"abs": 1e-3, "direction": "up"})
rec.record("first_token_mismatch", sm["first_token_mismatch"])
rec.record(f"median_step_ms_{dc.mode_a}", sm[f"median_step_ms_{dc.mode_a}"], "ignore")
rec.record(f"median_step_ms_{dc.mode_b}", sm[f"median_step_ms_{dc.mode_b}"], "ignore")
sm''',
    '''print("generated:", repr(S.tokenizer.decode(dc.tokens_a)))
DV.tokens_table(S, dc)''',
    '''show(DV.diff_figure(dc))
show(DV.latency_figure(dc))''',
    "## Host syncs inside one decode step",
    '''syncs, msg = DV.sync_inventory(S, ids)
print(msg)
rec.record("sync_inventory_available", syncs is not None, "ignore")
if syncs is not None:
    rec.record("n_host_syncs", len(syncs), {"abs": 0, "direction": "up"})
    display(pd.DataFrame(syncs))
if S.device.type != "cuda":
    display(Markdown("**Needs a GPU:**\\n" + "\\n".join(f"- {x}" for x in DV.GPU_ONLY)))''',
])

# ------------------------------------------------------------------------------------------ 06
nb("06_bug_triage_walkthrough", """
# 6. Bug triage, step by step

What you learn: how to find a wrong component with the comparison tools. We inject a known
bug from the zoo (a real one from the users' commit log), pretend we do not know where it is,
and localise it: (1) the symptom in the logits, (2) the hook-by-hook diff against the clean
run, (3) the first point of divergence in execution order and its component, (4) confirmation.
""", '''
BUG = "compressor_ape_on_kv"   # any name of dsv4lab.bugzoo.BUGS
BUG_LAYERS = [2]               # None = every layer where it applies
''', [
    '''from dsv4lab.triage import bugs as BG
from dsv4lab.analysis.compare import compare_runs
BG.bug_table()''',
    "## 1. The symptom\nA long enough prompt (compressed windows close, sliding window exceeded) in chat mode.",
    '''from dsv4lab.triage.session import filler_prompt
import torch
ids = torch.cat([filler_prompt(S, 48), S.encode(CHAT_PROMPT, "chat")[:, 1:]], dim=1)
clean_next = S.model(ids)[0, -1].argmax().item()
h = BG.inject(S.model, BUG, BUG_LAYERS)
buggy_next = S.model(ids)[0, -1].argmax().item()
h.restore()
print(f"clean next token {S.tok(clean_next)!r}, with the bug {S.tok(buggy_next)!r}")''',
    "## 2. Diff the runs hook by hook",
    '''holder = {}
res = compare_runs(S.model, (S.model, lambda m: holder.setdefault("h", BG.inject(m, BUG, BUG_LAYERS))), ids, tol=0.0)
print(res.summary())
rec.record("kl", res.kl_mean, {"abs": 1e-4, "rel": 0.05})
tab = res.table()
tab[tab.diverged].head(12)''',
    '''show(BG.divergence_figure(tab, f"{BUG}: relative error of every hook point vs the clean run (red = diverged)"))''',
    "## 3. First divergence and its component",
    '''fd = res.first_divergence
comp = BG.component_of_hook(fd)
expected = BG.injected_components(S.model, holder["h"])
print("first divergent hook:", fd)
print("its component:       ", comp)
print("bug was injected in: ", expected)
localised = any(fd and (fd.startswith(e + ".") or comp == e) for e in expected)
rec.record("first_divergence", fd)
rec.record("localised_component", comp)
rec.record("expected_components", expected)
rec.record("localised", localised)
assert localised, f"triage failed: first divergence {fd} is not inside {expected}"''',
    "## 4. Confirm with the bug zoo's triage (every bug, one line each)",
    '''from dsv4lab.bugzoo import triage
r = triage(S.model, BUG, ids, layers=BUG_LAYERS, quantize=True)
print(r.line())
rec.record("zoo_triage_localized", r.localized)''',
])

# ------------------------------------------------------------------------------------------ 07
nb("07_nightly_regression", """
# 7. Nightly regression

What you learn: whether anything moved since the baselines were blessed. This notebook runs the
metrics the other notebooks record (compact versions: first-token logits in three encodings,
logit lens, precision KLs, compressor entropy and retrieval choices, decode agreement) plus a
**component fingerprint** (the rms of every hook point on the probe, in execution order), and
compares them with `data/baselines/metrics.json` under the tolerances of
`data/baselines/tolerances.json`. When run inside `make report`, the other notebooks' metric
files are compared too. **It fails** (raises, so papermill and `make report` fail) with a table
of what regressed and the first changed component.

**Blessing new baselines** after an intended change:
```
python -m dsv4lab report --out reports            # run everything on the embedded model
python -m dsv4lab report --bless reports/metrics.json
git add data/baselines/metrics.json && git commit -m "bless baselines: <why>"
```
Set `BUG` to a bug-zoo name to see a failure (the table names the component).
""", '''
BUG = None            # e.g. "compressor_ape_on_kv": inject a zoo bug (must make this notebook fail)
BUG_LAYERS = None
BASELINES = None      # directory with metrics.json / tolerances.json (None = data/baselines)
DECODE_STEPS = 8
''', [
    '''from pathlib import Path
from dsv4lab.triage import regression as RG
from dsv4lab.triage.metrics import merge
out = RG.nightly_metrics(S, rec, PROMPT, CHAT_PROMPT, ANSWER, decode_steps=DECODE_STEPS, bug=BUG, bug_layers=BUG_LAYERS)
print("bug injected into:", out["injected"] or "nothing")
print(len(rec.metrics), "metrics computed")''',
    '''import json
current = [rec.as_dict()]
if REPORT_DIR:   # the other notebooks of this report run
    for f in sorted(Path(REPORT_DIR).glob("*.metrics.json")):
        if not f.name.startswith("07_"):
            current.append(json.loads(f.read_text()))
current = merge(current)
base_dir = Path(BASELINES) if BASELINES else RG.BASELINE_DIR
base, tols = RG.load_baselines(base_dir)
result = RG.compare(current, base, tols)
print(result.summary())
result.table[result.table.status != "ok"].head(30)''',
    '''display(Markdown(f"### Verdict\\n{result.summary()}"))
# the verdict is informational (not compared), recorded for the tests / index
rec.record("regression.ok", result.ok, "ignore")
rec.record("regression.n_regressed", len(result.regressed), "ignore")
rec.record("regression.first_component", result.first_component, "ignore")
rec.record("regression.injected", out["injected"], "ignore")
if not result.ok:
    raise RG.RegressionError(result.text())''',
])

if __name__ == "__main__":
    print("wrote", sorted(p.name for p in HERE.glob("*.ipynb")))
