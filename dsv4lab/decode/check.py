"""Graph-versus-eager decode comparison and the host-sync inventory of one decode step.

On CUDA: N greedy steps eagerly and N with CUDA-graph replay from the same prefilled state
(tokens, per-step max |logit difference|, per-step latency, memory growth). On CPU (no graphs):
the fixed-buffer decode path against full forwards over the growing sequence.
"""
from __future__ import annotations

import time
import traceback
import warnings
from dataclasses import dataclass, field

import torch

from .graphs import GraphDecoder


@dataclass
class DecodeCheck:
    mode_a: str
    mode_b: str
    steps: int
    tokens_a: list[int]
    tokens_b: list[int]
    max_abs_diff: list[float]
    latency_a_ms: list[float]
    latency_b_ms: list[float]
    first_token: int | None = None   # the token the prefill chose: the decode steps start from it
    extra: dict = field(default_factory=dict)

    @property
    def generated(self) -> list[int]:
        """Every generated token of path A, the prefill's first one included."""
        return ([] if self.first_token is None else [self.first_token]) + list(self.tokens_a)

    @property
    def token_agreement(self) -> float:
        n = min(len(self.tokens_a), len(self.tokens_b))
        return sum(a == b for a, b in zip(self.tokens_a, self.tokens_b)) / max(n, 1)

    @property
    def first_token_mismatch(self) -> int | None:
        for i, (a, b) in enumerate(zip(self.tokens_a, self.tokens_b)):
            if a != b:
                return i
        return None

    def speedup(self, a_ms: float, b_ms: float) -> dict:
        """``faster_path`` and ``speedup`` = slower median / faster median (>= 1 by construction):
        a ratio below 1 read as "faster" was the old, inverted reading."""
        fast, slow = (self.mode_a, self.mode_b) if a_ms <= b_ms else (self.mode_b, self.mode_a)
        x = max(a_ms, b_ms) / max(min(a_ms, b_ms), 1e-9)
        return {"faster_path": fast, "speedup": x, "speedup_note": f"{fast} is {x:.2f}x faster than {slow} (median step)"}

    def summary(self) -> dict:
        med = lambda xs: sorted(xs)[len(xs) // 2] if xs else float("nan")  # noqa: E731
        return {
            "modes": [self.mode_a, self.mode_b], "steps": self.steps,
            "token_agreement": self.token_agreement, "first_token_mismatch": self.first_token_mismatch,
            "max_abs_logit_diff": max(self.max_abs_diff) if self.max_abs_diff else 0.0,
            "bitwise_equal_steps": sum(d == 0.0 for d in self.max_abs_diff),
            f"median_step_ms_{self.mode_a}": med(self.latency_a_ms),
            f"median_step_ms_{self.mode_b}": med(self.latency_b_ms),
            **self.speedup(med(self.latency_a_ms), med(self.latency_b_ms)),
            **self.extra,
        }


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_steps(model, state, first_tok: torch.Tensor, steps: int, step_fn) -> tuple[list[int], list[torch.Tensor], list[float]]:
    dev = first_tok.device
    toks, logits, lat = [], [], []
    nxt = first_tok
    for _ in range(steps):
        _sync(dev)
        t0 = time.perf_counter()
        lg = step_fn(nxt, state)
        _sync(dev)
        lat.append((time.perf_counter() - t0) * 1e3)
        state.pos += 1
        lg = lg[:, -1].float().clone()
        nxt = lg.argmax(-1, keepdim=True)
        logits.append(lg.cpu() if lg.is_cuda else lg)  # keep device memory flat across the run
        toks.append(int(nxt[0, 0]))
    return toks, logits, lat


@torch.no_grad()
def decode_check(model, prompt_ids: torch.Tensor, steps: int = 64) -> DecodeCheck:
    """Eager vs CUDA graph on CUDA; fixed-buffer decode vs full forwards elsewhere."""
    dev = model.device
    prompt_ids = prompt_ids.to(dev)
    B, S = prompt_ids.shape
    state = model.new_state(B, S + steps + 1)
    first = model.prefill(prompt_ids, state)[:, -1].argmax(-1, keepdim=True)
    if dev.type == "cuda":
        base = state.clone()
        mem0 = torch.cuda.memory_allocated(dev)
        toks_a, lg_a, lat_a = run_steps(model, state, first, steps, model.decode_step)
        gstate = base
        gd = GraphDecoder(model, gstate)
        t0 = time.perf_counter()
        gd.capture()
        _sync(dev)
        capture_s = time.perf_counter() - t0
        mem1 = torch.cuda.memory_allocated(dev)
        toks_b, lg_b, lat_b = run_steps(model, gstate, first, steps, gd.step)
        mem2 = torch.cuda.memory_allocated(dev)
        diffs = [float((a - b).abs().max()) for a, b in zip(lg_a, lg_b)]
        return DecodeCheck("eager", "graph", steps, toks_a, toks_b, diffs, lat_a, lat_b, int(first[0, 0]),
                           {"memory_growth_during_replay_bytes": mem2 - mem1, "graph_pool_bytes": mem1 - mem0, "capture_s": capture_s,
                            "device": torch.cuda.get_device_name(dev)})
    # CPU: fixed-buffer decode path against full forwards over the same tokens
    toks_a, lg_a, lat_a = run_steps(model, state, first, steps, model.decode_step)
    seq = torch.cat([prompt_ids, first, torch.tensor([toks_a[:-1]], device=dev).expand(B, -1)], dim=1)
    lat_b, lg_b = [], []
    for i in range(steps):
        t0 = time.perf_counter()
        lg_b.append(model(seq[:, : S + 1 + i])[:, -1].float())
        lat_b.append((time.perf_counter() - t0) * 1e3)
    toks_b = [int(l.argmax(-1)[0]) for l in lg_b]
    diffs = [float((a - b).abs().max()) for a, b in zip(lg_a, lg_b)]
    return DecodeCheck("decode_buffers", "full_forward", steps, toks_a, toks_b, diffs, lat_a, lat_b, int(first[0, 0]),
                       {"note": "CPU: no CUDA graphs; compares the fixed-buffer decode step with full forwards"})


@torch.no_grad()
def sync_inventory(model, prompt_ids: torch.Tensor, steps: int = 1) -> list[dict]:
    """Host syncs inside ``decode_step`` (one entry per sync: op message and file:line).

    Runs the step under ``torch.cuda.set_sync_debug_mode("warn")`` and records each warning's
    origin, so every sync is listed (``"error"`` mode would stop at the first)."""
    dev = model.device
    if dev.type != "cuda":
        raise RuntimeError("the sync inventory needs a CUDA device (CPU ops never sync)")
    prompt_ids = prompt_ids.to(dev)
    state = model.new_state(prompt_ids.shape[0], prompt_ids.shape[1] + steps + 1)
    model.prefill(prompt_ids, state)
    nxt = prompt_ids[:, -1:]
    model.decode_step(nxt, state)  # first call: lazy caches, allocator warm-up
    state.pos += 1
    torch.cuda.synchronize(dev)
    found: list[dict] = []

    def record(message, category, filename, lineno, file=None, line=None):
        if "prototype feature" in str(message):  # torch's notice about the debug mode itself
            return
        # the innermost frame of our own code (dsv4lab/ or kernels/) is the op that synced
        ours = [f for f in traceback.extract_stack()[:-1] if "dsv4lab" in f.filename or "kernels" in f.filename]
        where = f"{ours[-1].filename}:{ours[-1].lineno}" if ours else f"{filename}:{lineno}"
        found.append({"message": str(message).splitlines()[0], "where": where,
                      "code": ours[-1].line if ours else None})

    old = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        try:
            torch.cuda.set_sync_debug_mode("warn")
            for _ in range(steps):
                model.decode_step(nxt, state)
                state.pos += 1
        finally:
            torch.cuda.set_sync_debug_mode(old)
    return found
