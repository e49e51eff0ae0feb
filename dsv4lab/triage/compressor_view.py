"""Notebook 4: the compressor's softmax pooling weights and the lightning indexer's choices.

Hook points read (run with cache): ``layers.N.attn.compressor.hook_weights``
[B, windows, slots, d] (CSA: slots = m of the previous window's Ca then m of this window's Cb),
``layers.N.attn.indexer.hook_scores`` [B, S, T] and ``layers.N.attn.indexer.hook_indices``
[B, S, k].
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..text.corpus import make_retrieval_samples
from .plots import heatmap, style

HOOKS = ["layers.*.attn.compressor.hook_weights", "layers.*.attn.indexer.hook_scores",
         "layers.*.attn.indexer.hook_indices", "layers.*.attn.indexer.compressor.hook_weights"]


def compressed_layers(model) -> list[int]:
    return [i for i, l in enumerate(model.layers) if l.attn.compressor is not None]


def csa_layers(model) -> list[int]:
    return [i for i, l in enumerate(model.layers) if l.attn.indexer is not None]


@torch.no_grad()
def collect(session, ids: torch.Tensor, fwd_hooks=()) -> tuple[torch.Tensor, object]:
    """(logits, cache) with the compressor weights and indexer scores / indices of every layer."""
    return session.model.run_with_cache(ids, names=HOOKS, device="cpu", fwd_hooks=fwd_hooks)


def window_weights(model, layer: int, cache, seq_len: int, indexer: bool = False) -> torch.Tensor:
    """[n_windows, seq_len]: each compressed entry's pooling weight on every token position
    (mean over channels). CSA rows span 2 windows (overlap with the previous row's window)."""
    comp = model.layers[layer].attn.indexer.compressor if indexer else model.layers[layer].attn.compressor
    name = f"layers.{layer}.attn.{'indexer.compressor' if indexer else 'compressor'}.hook_weights"
    w = cache[name][0].float().mean(-1)  # [nW, slots]
    m = comp.ratio
    nW = w.shape[0]
    out = torch.full((nW, seq_len), float("nan"))
    for wi in range(nW):
        if comp.overlap:
            pos = list(range((wi - 1) * m, wi * m)) + list(range(wi * m, (wi + 1) * m))
        else:
            pos = list(range(wi * m, (wi + 1) * m))
        for j, p in enumerate(pos):
            if 0 <= p < seq_len:
                out[wi, p] = w[wi, j]
    return out


def weights_figure(session, ids, layer: int, cache, last_positions: int | None = 64, indexer: bool = False):
    S = ids.shape[1]
    ww = window_weights(session.model, layer, cache, S, indexer)
    comp = session.model.layers[layer].attn.compressor
    kind = "CSA (ratio %d, overlapping windows)" % comp.ratio if comp.overlap else "HCA (ratio %d)" % comp.ratio
    lo = 0 if last_positions is None else max(0, S - last_positions)
    first_w = max(0, lo // comp.ratio - 1)
    z = ww[first_w:, lo:]
    x = [f"{p}:{session.tok(t)!r}" for p, t in zip(range(lo, S), ids[0, lo:].tolist())]
    y = [f"entry {w}" for w in range(first_w, ww.shape[0])]
    what = "indexer's compressor" if indexer else "compressor"
    return heatmap(z.numpy(), f"Layer {layer} {kind}: {what} softmax weight of each token in each compressed entry",
                   "token position: token", "compressed entry (window)", x=x, y=y, colorbar="weight",
                   height=max(320, 60 + 22 * z.shape[0]),
                   hover="entry %{y}<br>token %{x}<br>weight %{z:.3f}<extra></extra>")


def overlap_stats(model, layer: int, cache, seq_len: int) -> dict:
    """Per-token: in how many entries it has weight (CSA: 2 for all but the first/last window),
    and the mean weight entropy of the entries (nats; log(2m) = uniform)."""
    ww = window_weights(model, layer, cache, seq_len)
    covered = (~torch.isnan(ww)).sum(0)
    full = covered[: (seq_len // model.layers[layer].attn.compressor.ratio) * model.layers[layer].attn.compressor.ratio]
    w = cache[f"layers.{layer}.attn.compressor.hook_weights"][0].float()  # [nW, slots, d]
    ent = -(w.clamp_min(1e-30) * w.clamp_min(1e-30).log()).sum(1).mean().item()
    return {"entries": int(ww.shape[0]), "max_entries_per_token": int(full.max()) if full.numel() else 0,
            "median_entries_per_token": float(full.float().median()) if full.numel() else 0.0, "mean_entropy": ent}


def indexer_figure(session, ids, layer: int, cache, last_queries: int | None = 96, mark=None):
    """Index scores (query x compressed entry) with the chosen top-k marked by white x's;
    ``mark`` = entry indices to outline (e.g. the planted block)."""
    import plotly.graph_objects as go  # lazy: heavy optional dependency


    scores = cache[f"layers.{layer}.attn.indexer.hook_scores"][0].float()   # [S,T]
    idx = cache[f"layers.{layer}.attn.indexer.hook_indices"][0]             # [S,k]
    S, T = scores.shape
    lo = 0 if last_queries is None else max(0, S - last_queries)
    z = scores[lo:].clone()
    z[torch.isinf(z)] = float("nan")
    fig = go.Figure(go.Heatmap(z=z.numpy(), x=list(range(T)), y=list(range(lo, S)), colorscale="Viridis",
                               colorbar={"title": {"text": "index score"}},
                               hovertemplate="query %{y}<br>entry %{x}<br>score %{z:.3f}<extra></extra>"))
    qs, es = [], []
    for qi in range(lo, S):
        for e in idx[qi].tolist():
            if e >= 0:
                qs.append(qi)
                es.append(e)
    fig.add_trace(go.Scatter(x=es, y=qs, mode="markers", name="chosen top-k",
                             marker={"symbol": "x-thin", "size": 5, "color": "white", "line": {"width": 1, "color": "white"}}))
    for e in (mark or []):
        fig.add_vrect(x0=e - 0.5, x1=e + 0.5, line_color="red", line_width=2, annotation_text="planted", annotation_position="top")
    ratio = session.model.layers[layer].attn.indexer.ratio
    style(fig, f"Layer {layer} lightning indexer: scores per query and compressed entry (x = chosen top-"
               f"{session.config.index_topk}; blank = entry not closed yet, ratio {ratio})",
          "compressed entry (covers tokens ratio*entry .. ratio*entry+ratio-1)", "query position", height=560)
    fig.update_yaxes(autorange="reversed")
    fig.update_layout(legend={"orientation": "h", "y": -0.15})
    return fig


# ------------------------------------------------------------------------------ retrieval
@dataclass
class Retrieval:
    ids: torch.Tensor
    plant_pos: int
    answer_id: int
    key: str
    value: str
    distance: int


def retrieval_example(session, seq_len: int = 320, min_distance: int = 128, max_distance: int = 220, seed: int = 0) -> Retrieval:
    """A plain-text document with a planted ``key -> value`` pair far beyond the sliding window;
    the prompt stops right before the value is asked back."""
    s = make_retrieval_samples(1, seq_len=seq_len, min_distance=min_distance, max_distance=max_distance, seed=seed,
                               tokenizer=session.tokenizer, modes=("plain",), n_queries=(1, 1))[0]
    q = s.meta["queries"][0]
    ids = torch.tensor([s.ids[: q["answer_pos"]]], dtype=torch.long, device=session.device)
    return Retrieval(ids, q["plant_pos"], s.ids[q["answer_pos"]], q["key"], q["value"], q["distance"])


def planted_entries(model, layer: int, plant_pos: int) -> list[int]:
    """Indexer entries whose window holds the planted token (CSA: its own window's entry via Cb
    and the next entry via Ca)."""
    m = model.layers[layer].attn.indexer.ratio
    return [plant_pos // m, plant_pos // m + 1]


def planted_windows(model, layer: int, plant_pos: int, spread: int | None = None) -> list[int]:
    """Compressed entries (of the layer's own compressor) whose windows cover the planted value
    and the ``spread`` tokens after it (default: two sliding windows -- the earlier sliding layers
    copy the key/value association into the residuals of the following tokens, so on the trained
    model it reaches the compressor through several windows, not only the plant's own)."""
    comp = model.layers[layer].attn.compressor
    spread = 2 * model.config.sliding_window if spread is None else spread
    first = plant_pos // comp.ratio
    last = (plant_pos + spread) // comp.ratio + (1 if comp.overlap else 0)
    return list(range(first, last + 1))


@torch.no_grad()
def retrieval_check(session, ex: Retrieval, block_planted: bool = False, ablate_entries: str | None = None) -> dict:
    """Run the retrieval prompt; per CSA layer whether the last query's top-k holds a planted
    entry, and the answer's probability / rank. ``block_planted=True`` removes the planted entries
    from every query's selection (replaced by -1 = nothing), to show what the choice is worth."""
    model = session.model
    fwd = []
    if block_planted:
        def drop(t, name):
            layer = int(name.split(".")[1])
            bad = torch.tensor(planted_entries(model, layer, ex.plant_pos), device=t.device)
            return torch.where(torch.isin(t, bad), torch.full_like(t, -1), t)

        fwd = [("layers.*.attn.indexer.hook_indices", drop)]
    if ablate_entries:  # "csa" | "hca" | "all": zero the planted window's compressed entries
        kinds = {"csa": (True,), "hca": (False,), "all": (True, False)}[ablate_entries]

        def zero(t, name):
            layer = int(name.split(".")[1])
            comp = model.layers[layer].attn.compressor
            if comp.overlap not in kinds:
                return t
            t = t.clone()
            for w in planted_windows(model, layer, ex.plant_pos):
                if w < t.shape[1]:
                    t[:, w] = 0
            return t

        fwd = fwd + [("layers.*.attn.compressor.hook_entries", zero)]
    logits, cache = collect(session, ex.ids, fwd_hooks=fwd)
    p = torch.softmax(logits[0, -1].double().cpu(), -1)
    rows = {}
    for layer in csa_layers(model):
        planted = planted_entries(model, layer, ex.plant_pos)
        if f"layers.{layer}.attn.indexer.hook_indices" not in cache:   # the indexer chose nothing (disabled)
            rows[layer] = {"planted_entries": planted, "chosen": [], "planted_chosen": None,
                           "best_planted_rank": None, "n_valid_entries": None}
            continue
        chosen = cache[f"layers.{layer}.attn.indexer.hook_indices"][0, -1].tolist()
        scores = cache[f"layers.{layer}.attn.indexer.hook_scores"][0, -1].float()
        ranks = [int((scores > scores[e]).sum()) + 1 for e in planted if e < scores.shape[0]]
        if block_planted:  # the cache shows the selection before the intervention replaced it
            chosen = [-1 if c in planted else c for c in chosen]
        rows[layer] = {"planted_entries": planted, "chosen": [c for c in chosen if c >= 0],
                       "planted_chosen": any(e in chosen for e in planted), "best_planted_rank": min(ranks) if ranks else None,
                       "n_valid_entries": int(torch.isfinite(scores).sum())}
    return {"p_answer": float(p[ex.answer_id]), "answer_rank": int((p > p[ex.answer_id]).sum()) + 1,
            "top1_id": int(p.argmax()), "layers": rows, "cache": cache}


# ------------------------------------------------------------------------------ metrics
# Notebook 4 and the nightly both record through these, so each metric has one key and one tolerance.
def record_compressor(rec, model, cache, seq_len: int) -> None:
    """Per compressed layer: entries emitted, most entries one token sees, mean softmax entropy."""
    for layer in compressed_layers(model):
        st = overlap_stats(model, layer, cache, seq_len)
        rec.record(f"compressor.L{layer}.entries", st["entries"])
        rec.record(f"compressor.L{layer}.max_entries_per_token", st["max_entries_per_token"])
        rec.record(f"compressor.L{layer}.entropy", st["mean_entropy"], {"abs": 1e-4, "rel": 1e-3})


def record_retrieval(rec, ex: Retrieval, result: dict, blocked: dict | None = None) -> None:
    """Per CSA layer: planted entry chosen, its best rank; p(answer) (also with the planted
    entries blocked); whether the answer is top-1."""
    for layer, r in result["layers"].items():
        rec.record(f"retrieval.L{layer}.planted_chosen", r["planted_chosen"])
        rec.record(f"retrieval.L{layer}.best_planted_rank", r["best_planted_rank"], {"abs": 2})
    rec.record("retrieval.p_answer", result["p_answer"], {"abs": 2e-3, "rel": 0.02})
    if blocked is not None:
        rec.record("retrieval.p_answer_planted_blocked", blocked["p_answer"], {"abs": 2e-3, "rel": 0.02})
    rec.record("retrieval.answer_correct", result["top1_id"] == ex.answer_id)

