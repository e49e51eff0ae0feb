"""Per-layer metrics of the model under test (a precision policy) against the reference run.

What the nightly keeps per run so its history can plot trends per layer: next-token KL and top-1
agreement, and per layer through the logit lens (the model under test's hc_head + norm + head,
in the policy, on both runs' residual streams: where the next-token distribution starts to move),
the cosine of the residual streams leaving each layer, router top-k overlap,
indexer top-k overlap (CSA layers), and the relative error of each component's output
(:data:`VSREF_HOOKS`, first firing) for the per-layer first-divergence view. One reference run
(original / BF16 weights, cached on disk by dsv4lab.precision.reference_cache, streamed when the
dense weights do not fit) and one run under the policy; captures go to the CPU as they are made.
Memory: the captured hooks of one prompt, ~7 tensors of [S, hidden(, 4)] per layer, on the CPU.
"""
from __future__ import annotations

import re

import torch

from ..analysis.cache import run_with_cache
from ..analysis.compare import next_token_metrics, router_overlap, tensor_diff
from ..precision import PrecisionPolicy
from ..precision.reference_cache import cached_reference_run
from ..precision.streaming import fitting_precision
from .logits import lens_logits

# the component outputs a per-layer first-divergence view is drawn from, in a layer's execution order
COMPONENT_HOOKS = ["attn.compressor.hook_entries", "attn.indexer.hook_indices", "attn.hook_out", "hook_resid_mid",
                   "mlp.router.hook_ids", "mlp.shared_expert.hook_out", "mlp.hook_out", "hook_resid_post"]
VSREF_HOOKS = [f"layers.*.{h}" for h in COMPONENT_HOOKS]

_HOOK = re.compile(r"^layers\.(\d+)\.(.+)$")


def indexer_overlap(ids_a: torch.Tensor, ids_b: torch.Tensor) -> float | None:
    """Mean over query positions that chose any entry in A of |chosen_a & chosen_b| / |chosen_a|
    (``-1`` = no entry); None when no position chose one (the prompt closed no window yet)."""
    a, b = ids_a.long().cpu().flatten(0, -2), ids_b.long().cpu().flatten(0, -2)
    hit = ((a.unsqueeze(-1) == b.unsqueeze(-2)) & (a >= 0).unsqueeze(-1)).any(-1).sum(-1).double()
    n = (a >= 0).sum(-1).double()
    valid = n > 0
    return float((hit[valid] / n[valid]).mean()) if bool(valid.any()) else None


def split_hook(name: str) -> tuple[int | None, str]:
    """``layers.3.attn.hook_out`` -> (3, "attn.hook_out"); a hook outside the layers -> (None, name)."""
    m = _HOOK.match(name)
    return (int(m.group(1)), m.group(2)) if m else (None, name)


@torch.no_grad()
def against_reference(setup, policy, k: int = 5) -> dict:
    """``setup`` (dsv4lab.triage.ablation.Setup: model under test, reference, ids) run under ``policy``
    against the reference run. Returns {policy, reference, kl, top1, topk, lens_kl, lens_top1, layer_cos,
    router_overlap, indexer_overlap, rel_err}; per-layer dicts are keyed by the layer number as a string (JSON keys),
    ``rel_err`` by hook name in execution order."""
    policy = PrecisionPolicy.parse(policy)
    ref = cached_reference_run(setup.reference, setup.ids, setup.reference_policy, setup.originals, cache=setup.cache,
                               names=VSREF_HOOKS)
    lens = {}
    with fitting_precision(setup.model, policy, setup.originals):
        logits, cache = run_with_cache(setup.model, setup.ids, names=VSREF_HOOKS, device="cpu")
        for name in cache:
            layer, hook = split_hook(name)
            if hook == "hook_resid_post" and name in ref.cache:
                lens[str(layer)] = next_token_metrics(lens_logits(setup.model, ref.cache.all(name)[0]),
                                                      lens_logits(setup.model, cache.all(name)[0]), k)
    nt = next_token_metrics(ref.logits, logits, k)
    out = {"policy": policy.describe(), "reference": str(setup.reference_policy), "kl": nt["kl_mean"],
           "top1": nt["top1"], "topk": nt["topk"], "lens_kl": {l: m["kl_mean"] for l, m in lens.items()},
           "lens_top1": {l: m["top1"] for l, m in lens.items()}, "layer_cos": {}, "router_overlap": {},
           "indexer_overlap": {}, "rel_err": {}}
    for name in ref.cache.order:
        if name in out["rel_err"] or name not in cache:
            continue
        a, b = ref.cache.all(name)[0], cache.all(name)[0]
        layer, hook = split_hook(name)
        if hook == "mlp.router.hook_ids":
            out["router_overlap"][str(layer)] = router_overlap(a, b)
        elif hook == "attn.indexer.hook_indices":
            ov = indexer_overlap(a, b)
            if ov is not None:
                out["indexer_overlap"][str(layer)] = ov
        else:
            d = tensor_diff(a, b)
            out["rel_err"][name] = d["rel_err"]
            if hook == "hook_resid_post":
                out["layer_cos"][str(layer)] = d["cos"]
    return out


def record_against_reference(rec, r: dict) -> None:
    """Record :func:`against_reference`'s result as ``vsref.*`` (one recorder, the nightly's): the
    scalars and per-layer dicts fail when they get worse; ``vsref.rel_err`` is informational (it
    feeds the per-layer first-divergence view; the fingerprint names the component)."""
    rec.record("vsref.policy", r["policy"], "exact")
    rec.record("vsref.reference", r["reference"], "exact")
    rec.record("vsref.kl", r["kl"], {"abs": 1e-4, "rel": 0.05, "direction": "up"})
    rec.record("vsref.top1", r["top1"], {"abs": 1e-6, "direction": "down"})
    rec.record("vsref.lens_kl", r["lens_kl"], {"abs": 1e-4, "rel": 0.05, "direction": "up"})
    rec.record("vsref.lens_top1", r["lens_top1"], {"abs": 1e-6, "direction": "down"})
    rec.record("vsref.layer_cos", r["layer_cos"], {"abs": 1e-4, "direction": "down"})
    rec.record("vsref.router_overlap", r["router_overlap"], {"abs": 0.05, "direction": "down"})
    rec.record("vsref.indexer_overlap", r["indexer_overlap"], {"abs": 0.05, "direction": "down"})
    rec.record("vsref.rel_err", r["rel_err"], "ignore")


__all__ = ["COMPONENT_HOOKS", "VSREF_HOOKS", "against_reference", "indexer_overlap", "record_against_reference",
           "split_hook"]
