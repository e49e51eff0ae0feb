"""Notebook 5: graph versus eager decode (tokens, per-step logit differences, latency, host
syncs), wrapping :mod:`dsv4lab.decode.check`. On CPU there are no CUDA graphs: the check runs
the fixed-buffer decode step against full forwards and says what needs a GPU. Then a Python hook
during decode, eager against layer graphs (:mod:`dsv4lab.decode.layer_graphs`): the hooked layer
runs eagerly, the others from their graphs; the tokens and the hook's values must not change."""
from __future__ import annotations

import pandas as pd
import torch

from ..decode.check import decode_check, run_steps
from ..decode.check import sync_inventory as inv
from ..decode.layer_graphs import LayerGraphDecoder
from .plots import lines

GPU_ONLY = ("CUDA-graph capture and replay (eager vs graph tokens and logits, speedup)",
            "the host-sync inventory of one decode step (torch.cuda.set_sync_debug_mode)",
            "memory growth during replay / graph pool size",
            "multi-GPU capture with an explicit stream per device")


def run(session, ids: torch.Tensor, steps: int = 16):
    return decode_check(session.model, ids, steps=steps)


def tokens_table(session, dc):
    return pd.DataFrame({"step": range(len(dc.tokens_a)), dc.mode_a: [repr(session.tok(t)) for t in dc.tokens_a],
                         dc.mode_b: [repr(session.tok(t)) for t in dc.tokens_b],
                         "same": [a == b for a, b in zip(dc.tokens_a, dc.tokens_b)],
                         "max |logit diff|": dc.max_abs_diff,
                         f"{dc.mode_a} ms": [round(x, 3) for x in dc.latency_a_ms],
                         f"{dc.mode_b} ms": [round(x, 3) for x in dc.latency_b_ms]})


def diff_figure(dc):
    ys = [max(d, 1e-12) for d in dc.max_abs_diff]
    fig = lines(list(range(len(ys))), {f"{dc.mode_a} vs {dc.mode_b}": ys},
                f"Per-step max |logit difference|, {dc.mode_a} vs {dc.mode_b} (0 plotted as 1e-12)",
                "decode step", "max |logit diff| (log)", log_y=True)
    return fig


def latency_figure(dc):
    return lines(list(range(len(dc.latency_a_ms))), {dc.mode_a: dc.latency_a_ms, dc.mode_b: dc.latency_b_ms},
                 "Latency per decode step", "decode step", "milliseconds", legend="path")


def sync_inventory(session, ids: torch.Tensor):
    """(list of syncs, message). On CPU: (None, what it would need)."""
    if session.device.type != "cuda":
        return None, ("needs a CUDA device: CPU ops never synchronise with a host, so there is nothing to list. "
                      "Run this notebook with DEVICE='cuda' to get one row per host sync inside decode_step.")

    found = inv(session.model, ids)
    return found, f"{len(found)} host sync(s) inside one decode step" + ("" if found else " -- graph-capturable")


def record_decode(rec, dc) -> dict:
    """Decode path vs its reference (notebook 5 and the nightly record through this); returns the summary."""
    sm = dc.summary()
    rec.record("modes", sm["modes"], "ignore")  # device-dependent (CPU: buffers vs full forward; CUDA: eager vs graph)
    rec.record("token_agreement", sm["token_agreement"], {"abs": 0.0, "direction": "down"})
    rec.record("max_abs_logit_diff", sm["max_abs_logit_diff"], {"abs": 1e-3, "direction": "up"})
    rec.record("first_token_mismatch", sm["first_token_mismatch"])
    rec.record(f"median_step_ms_{dc.mode_a}", sm[f"median_step_ms_{dc.mode_a}"], "ignore")
    rec.record(f"median_step_ms_{dc.mode_b}", sm[f"median_step_ms_{dc.mode_b}"], "ignore")
    return sm


@torch.no_grad()
def hooked_decode(session, ids: torch.Tensor, steps: int, hook: str) -> dict:
    """``steps`` greedy steps after ``ids`` with a Python hook on ``hook`` that keeps the norm of its
    tensor, once eagerly and once by layer graphs from a copy of the same state: tokens, logits,
    the hook's values and per-step latency of both, and which units ran eagerly."""
    m = session.model
    ids = ids.to(m.device)
    state = m.new_state(ids.shape[0], ids.shape[1] + steps + 1)
    first = m.prefill(ids, state)[:, -1].argmax(-1, keepdim=True)
    states = {"eager": state.clone(), "layer-graphs": state}
    runs = {}
    for mode, st in states.items():
        norms: list[torch.Tensor] = []
        with m.hooks([(hook, lambda t, name: norms.append(t.detach().float().norm()))]):
            driver = LayerGraphDecoder(m, st) if mode == "layer-graphs" else None
            toks, logits, lat = run_steps(m, st, first, steps, driver.step if driver else m.decode_step)
            eager_units = driver.eager_units() if driver else []
        runs[mode] = {"tokens": toks, "logits": logits, "latency_ms": lat, "hook_norms": torch.stack(norms).cpu(),
                      "eager_units": eager_units}
    a, b = runs["eager"], runs["layer-graphs"]
    med = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
    return {"hook": hook, "steps": steps, "runs": runs, "eager_units": b["eager_units"],
            "tokens_equal": a["tokens"] == b["tokens"],
            "max_abs_logit_diff": max(float((x - y).abs().max()) for x, y in zip(a["logits"], b["logits"])),
            "hook_fired": (len(a["hook_norms"]), len(b["hook_norms"])),
            "hook_max_abs_diff": float((a["hook_norms"] - b["hook_norms"]).abs().max()),
            "median_ms": {"eager": med(a["latency_ms"]), "layer-graphs": med(b["latency_ms"])}}


def record_hooked(rec, hd: dict) -> None:
    """Layer-graph decode with a hook against eager decode with it (the nightly keeps them equal)."""
    rec.record("hooked.tokens_equal", hd["tokens_equal"])
    rec.record("hooked.max_abs_logit_diff", hd["max_abs_logit_diff"], {"abs": 1e-3, "direction": "up"})
    rec.record("hooked.hook_fired_every_step", hd["hook_fired"] == (hd["steps"], hd["steps"]))
    rec.record("hooked.hook_max_abs_diff", hd["hook_max_abs_diff"], {"abs": 1e-3, "direction": "up"})
    rec.record("hooked.eager_units", hd["eager_units"], "ignore")
    for mode, ms in hd["median_ms"].items():
        rec.record(f"hooked.median_step_ms_{mode}", ms, "ignore")


def hooked_figure(hd: dict):
    """Per-step latency of both runs (the hook fires in both)."""
    runs = hd["runs"]
    return lines(list(range(hd["steps"])), {mode: r["latency_ms"] for mode, r in runs.items()},
                 f"Decode with a Python hook on {hd['hook']}: eager vs layer graphs", "decode step", "milliseconds",
                 legend="driver")


def hooked_table(hd: dict) -> pd.DataFrame:
    runs = hd["runs"]
    return pd.DataFrame({"step": range(hd["steps"]),
                         **{f"hook |x| {mode}": [round(float(v), 4) for v in r["hook_norms"]] for mode, r in runs.items()},
                         **{f"{mode} ms": [round(x, 3) for x in r["latency_ms"]] for mode, r in runs.items()}})
