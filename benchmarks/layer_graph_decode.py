"""Layer-graph decode timing, shared by ``decode.py`` (embedded model) and ``full_model.py``.

Times :class:`~dsv4lab.decode.layer_graphs.LayerGraphDecoder` over a prefilled state twice: with no
hook (every unit a CUDA graph) and with one Python hook on the middle layer's ``hook_resid_post``
that records a norm per step, as a triage hook does (that layer then runs eagerly). Ratios are
against the eager step and the floor the caller measured in the same run.
"""
from __future__ import annotations

import time

import torch

from benchmarks.measure import synchronize, timed
from dsv4lab.analysis.hooks import hooks
from dsv4lab.decode.layer_graphs import LayerGraphDecoder


def layer_graph_timing(model, state, step_ids: torch.Tensor, steps: int, devices: list,
                       eager_ms: float | None = None, floor_ms: float | None = None) -> dict:
    """ms per token of layer-graph decode without and with one hooked layer (see the module doc)."""
    ld = LayerGraphDecoder(model, state)
    t0 = time.perf_counter()
    ld.ensure_current()
    synchronize(devices)
    capture_s = time.perf_counter() - t0
    plain = timed(lambda: ld.step(step_ids, state), steps, devices)
    mid = model.config.num_hidden_layers // 2
    hook_name = f"layers.{mid}.hook_resid_post"
    norms: list[torch.Tensor] = []
    with hooks(model, [(hook_name, lambda t, name: norms.append(t.float().norm()))]):
        t0 = time.perf_counter()
        eager_units = ld.eager_units()
        switch_s = time.perf_counter() - t0
        hooked = timed(lambda: ld.step(step_ids, state), steps, devices)
    out = {"capture_s": capture_s, "units": len(ld.units()), "ms_per_token": plain * 1e3,
           "hooked_ms_per_token": hooked * 1e3, "hook": hook_name, "eager_units_hooked": eager_units,
           "hook_fired": len(norms), "switch_to_hooked_s": switch_s,
           "captures": ld.captures, "logits_finite": bool(torch.isfinite(ld.step(step_ids, state)).all())}
    if eager_ms:
        out["hooked_speedup_over_eager"] = eager_ms / (hooked * 1e3)
    if floor_ms:
        out["over_floor"] = plain * 1e3 / floor_ms
        out["hooked_over_floor"] = hooked * 1e3 / floor_ms
    return out
