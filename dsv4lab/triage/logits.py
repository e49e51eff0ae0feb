"""Notebook 2: first-token logits of a probe in plain / chat / thinking encodings, the logit
lens over layers, and what the thinking-mode tokens' logits say.

Logit lens for DSV4: each layer leaves ``hc_mult`` residual streams; the lens collapses them
with the model's own final ``hc_head`` (its learned collapse weights), then the final RMSNorm
and the head -- exactly what the last layer's streams go through, so the last lens row equals
the real logits.
"""
from __future__ import annotations

from dataclasses import dataclass

import pandas as pd
import torch

from ..text.chat import EOS, THINK_END
from .plots import bar, lines, style


@dataclass
class FirstToken:
    mode: str
    text: str
    ids: torch.Tensor          # [1, S]
    logits: torch.Tensor       # [V] fp32 at the last position
    table: object              # DataFrame: rank, id, token, logit, prob

    @property
    def top1_id(self) -> int:
        return int(self.logits.argmax())

    @property
    def probs(self) -> torch.Tensor:
        return torch.softmax(self.logits.double(), -1)


def topk_table(session, logits: torch.Tensor, k: int = 10):
    p = torch.softmax(logits.double(), -1)
    v, i = logits.float().topk(k)
    return pd.DataFrame({"rank": range(1, k + 1), "id": i.tolist(), "token": [repr(session.tok(t)) for t in i.tolist()],
                         "logit": [round(x, 4) for x in v.tolist()], "prob": [float(p[t]) for t in i.tolist()]})


@torch.no_grad()
def first_token(session, prompt, mode: str = "plain", k: int = 10) -> FirstToken:
    """Encode ``prompt`` in ``mode`` and return the next-token logits with a top-k table."""
    ids = session.encode(prompt, mode)
    logits = session.model(ids)[0, -1].float().cpu()
    return FirstToken(mode, session.prompt_text(prompt, mode), ids, logits, topk_table(session, logits, k))


def probe_all_modes(session, prompt: str, chat_prompt: str | None = None, k: int = 10) -> dict[str, FirstToken]:
    """plain: ``prompt`` as a completion; chat / thinking: ``chat_prompt`` (default ``prompt``)
    as one user turn."""
    q = chat_prompt or prompt
    return {"plain": first_token(session, prompt, "plain", k), "chat": first_token(session, q, "chat", k),
            "thinking": first_token(session, q, "thinking", k)}


def topk_figure(session, ft: FirstToken, k: int = 10, highlight: int | None = None):
    t = ft.table.head(k)
    colors = ["#d62728" if highlight is not None and i == highlight else "#1f77b4" for i in t["id"]]
    fig = bar(t["token"], t["prob"], f"Next-token probabilities, {ft.mode} encoding (top {k})", "probability",
              "token", text=[f"{p:.3f}" for p in t["prob"]], color=colors, horizontal=True)
    return fig


def encoding_table(session, ft: FirstToken):
    ids = ft.ids[0].tolist()
    return pd.DataFrame({"pos": range(len(ids)), "id": ids, "token": [repr(session.tok(i)) for i in ids]})


# ------------------------------------------------------------------------------ logit lens
@torch.no_grad()
def lens_logits(model, streams: torch.Tensor) -> torch.Tensor:
    """hc_head collapse -> final norm -> head on residual streams [B,S,hc,D] -> fp32 logits."""
    h = streams.to(model.head_device(), model.dtype)
    return model.head(model.norm(model.hc_head(h))).float()


@torch.no_grad()
def logit_lens(session, ids: torch.Tensor, answer_id: int | None = None, k: int = 3):
    """Per layer (``embed`` = the input streams, then after each layer): top-k tokens at the
    last position, the answer's probability and rank. Returns (DataFrame, lens [L+1,S,V] fp32,
    real logits [S,V]) -- the last lens row equals the real logits."""
    model = session.model
    logits, cache = model.run_with_cache(ids, names=["layers.0.hook_resid_pre", "layers.*.hook_resid_post"], device=None)
    names = ["layers.0.hook_resid_pre"] + [f"layers.{i}.hook_resid_post" for i in range(model.config.num_hidden_layers)]
    labels = ["embed"] + [f"L{i}" for i in range(model.config.num_hidden_layers)]
    lens = torch.stack([lens_logits(model, cache[n])[0].cpu() for n in names])  # [L+1,S,V]
    rows = []
    for lab, lg in zip(labels, lens[:, -1]):
        p = torch.softmax(lg.double(), -1)
        v, i = p.topk(k)
        row = {"layer": lab, "top1": repr(session.tok(i[0])), "p_top1": float(v[0]),
               f"top{k}": ", ".join(repr(session.tok(t)) for t in i.tolist())}
        if answer_id is not None:
            row["p_answer"] = float(p[answer_id])
            row["answer_rank"] = int((p > p[answer_id]).sum()) + 1
        rows.append(row)
    return pd.DataFrame(rows), lens, logits[0].float().cpu()


def lens_figure(session, ids: torch.Tensor, lens: torch.Tensor, last: int = 16, title: str | None = None):
    """Heatmap over (layer, position) of the top-1 probability, annotated with the top-1 token."""
    import plotly.graph_objects as go  # lazy: heavy optional dependency


    S = lens.shape[1]
    lo = max(0, S - last)
    p = torch.softmax(lens[:, lo:].double(), -1)
    top_p, top_i = p.max(-1)
    text = [[session.tok(t) for t in row] for row in top_i.tolist()]
    xs = [f"{j}:{session.tok(t)!r}" for j, t in zip(range(lo, S), ids[0, lo:].tolist())]
    ys = ["embed"] + [f"after L{i}" for i in range(lens.shape[0] - 1)]
    fig = go.Figure(go.Heatmap(z=top_p.numpy(), x=xs, y=ys, text=text, texttemplate="%{text}", colorscale="Blues",
                               zmin=0, zmax=1, colorbar={"title": {"text": "p(top-1)"}},
                               hovertemplate="input %{x}<br>%{y}<br>top-1 %{text} p=%{z:.3f}<extra></extra>"))
    style(fig, title or "Logit lens: top-1 next token after each layer (hc_head + norm + head on the streams)",
          "input position: token", "layer", height=90 + 45 * lens.shape[0])
    fig.update_yaxes(autorange="reversed")
    return fig


def answer_by_layer_figure(df, answer: str):
    return lines(df["layer"], {f"p({answer!r})": df["p_answer"], "p(top-1)": df["p_top1"]},
                 f"Logit lens at the last position: probability of {answer!r} after each layer", "layer", "probability")


# ------------------------------------------------------------------------------ thinking mode
@torch.no_grad()
def thinking_walk(session, prompt: str, answer_id: int | None = None, steps: int = 24):
    """Greedy decode from the thinking-mode prompt (ends ``<think>``); per generated token its
    probability, the probability of ``</think>`` (when the model would stop reasoning), of EOS
    and of the answer, and the runner-up. Returns (DataFrame, generated text)."""
    ids = session.encode(prompt, "thinking")
    out, logits = session.model.generate(ids, steps, return_logits=True, eos_token_id=session.token_id(EOS))
    think_end, eos = session.token_id(THINK_END), session.token_id(EOS)
    gen = out[0, ids.shape[1]:].tolist()
    rows = []
    phase = "reasoning"
    for t, (tok, lg) in enumerate(zip(gen, logits[0])):
        p = torch.softmax(lg.double().cpu(), -1)
        top2 = p.topk(2)
        runner = top2.indices[1] if int(top2.indices[0]) == tok else top2.indices[0]
        row = {"step": t, "token": repr(session.tok(tok)), "phase": phase, "p(token)": float(p[tok]),
               "p(</think>)": float(p[think_end]) if think_end is not None else None,
               "p(EOS)": float(p[eos]) if eos is not None else None,
               "runner-up": repr(session.tok(runner)), "p(runner-up)": float(p[runner])}
        if answer_id is not None:
            row["p(answer)"] = float(p[answer_id])
        rows.append(row)
        if tok == think_end:
            phase = "answer"
    return pd.DataFrame(rows), session.tokenizer.decode(gen)


def thinking_figure(df, answer: str | None = None):
    series = {"p(chosen token)": df["p(token)"], "p(</think>)": df["p(</think>)"]}
    if "p(answer)" in df:
        series[f"p({answer!r})"] = df["p(answer)"]
    fig = lines(df["step"], series, "Thinking mode, step by step: when does the model close </think> and answer?",
                "generated token index (greedy)", "probability", legend="series")
    fig.update_xaxes(tickmode="array", tickvals=list(df["step"]), ticktext=[t.strip("'") for t in df["token"]], tickangle=-60)
    return fig


# ------------------------------------------------------------------------------ metrics
# Notebook 2 and the nightly both record through these, so each metric has one key and one tolerance.
def answer_id(session, answer: str | None, mode: str = "plain") -> int | None:
    """The answer's token id as it follows the prompt in ``mode``: plain text continues with a
    space (" Paris"); chat and thinking answers start right after ``</think>`` ("Paris")."""
    if answer is None:
        return None
    return session.token_id(answer if mode == "plain" else answer.lstrip())


def record_first_token(rec, session, probes: dict[str, FirstToken], answer: str | None) -> None:
    """Top-1 token, its probability and the answer's (in each encoding's own form), finite logits."""
    for mode, ft in probes.items():
        rec.record(f"{mode}.top1", session.tok(ft.top1_id))
        rec.record(f"{mode}.p_top1", float(ft.probs.max()), {"abs": 1e-3, "rel": 0.01})
        ans = answer_id(session, answer, mode)
        if ans is not None:
            rec.record(f"{mode}.p_answer", float(ft.probs[ans]), {"abs": 1e-3, "rel": 0.02})
    rec.record("plain.top1_is_answer", probes["plain"].top1_id == answer_id(session, answer, "plain"))
    rec.record("logits_finite", all(bool(ft.logits.isfinite().all()) for ft in probes.values()))


def record_lens(rec, lens_df, lens: torch.Tensor, real: torch.Tensor, answer_id: int | None, answer: str | None) -> None:
    """The logit lens: its last row equals the logits; p(answer) per layer; first layer with it top-1."""
    rec.record("lens.final_row_max_abs_diff", float((lens[-1] - real).abs().max()), {"abs": 1e-4, "direction": "up"})
    if answer_id is not None:
        rec.record("lens.p_answer_by_layer", [round(x, 4) for x in lens_df["p_answer"]], {"abs": 2e-3})
        first = next((r.layer for r in lens_df.itertuples() if r.top1 == repr(answer)), None)
        rec.record("lens.first_layer_answer_top1", first)

