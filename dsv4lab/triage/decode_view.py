"""Notebook 5: graph versus eager decode (tokens, per-step logit differences, latency, host
syncs), wrapping :mod:`dsv4lab.decode.check`. On CPU there are no CUDA graphs: the check runs
the fixed-buffer decode step against full forwards and says what needs a GPU."""
from __future__ import annotations

import pandas as pd
import torch

from ..decode.check import decode_check
from ..decode.check import sync_inventory as inv
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

