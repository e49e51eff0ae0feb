"""compare_runs: next-token metrics, per-hook diffs, router overlap, first divergence."""
from __future__ import annotations

import pytest
import torch

from dsv4lab.analysis.compare import compare_runs, tensor_diff
from dsv4lab.precision import using_precision
from dsv4lab.workbench import random_model
from oracle_util import tiny_config


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def model():
    return random_model(tiny_config(), seed=0)


@pytest.fixture(scope="module")
def ids():
    return torch.randint(0, 97, (1, 64), generator=torch.Generator().manual_seed(2))


def test_identical_runs(model, ids):
    res = compare_runs(model, model, ids, tol=0.0)
    assert res.kl_mean == 0 and res.top1 == 1 and res.topk == 1
    assert res.first_divergence is None
    assert set(res.router_overlap) == {0, 1, 2, 3} and all(v == 1 for v in res.router_overlap.values())
    assert set(res.layer_cos) == {0, 1, 2, 3} and res.min_layer_cos > 0.999999
    df = res.table()
    assert list(df["name"]) == res.order_a and len(df) == len(model.hook_names())
    assert (df["rel_err"] == 0).all()
    assert "no hook point diverges" in res.summary()


def test_intervention_is_found_where_it_happens(model, ids):
    bump = [("layers.2.attn.compressor.hook_entries", lambda t, n: t * 1.5)]
    res = compare_runs(model, (model, bump), ids)
    assert res.first_divergence == "layers.2.attn.compressor.hook_entries"
    df = res.table().set_index("name")
    assert df.loc["layers.1.hook_resid_post", "rel_err"] == 0  # upstream untouched
    assert df.loc["layers.2.attn.compressor.hook_entries", "rel_err"] == pytest.approx(0.5, rel=1e-5)
    assert res.kl_mean > 0 and len(res.kl_per_pos) == 64
    assert "first divergence" in res.summary() and "layers.2.attn.compressor.hook_entries" in res.summary()
    assert not any(hp._forward_hooks for _, hp in model.hook_points())  # intervention removed
    d = res.to_dict()
    assert d["first_divergence"] == "layers.2.attn.compressor.hook_entries"


def test_different_models_and_router_overlap(model, ids):
    other = random_model(tiny_config(), seed=1)
    res = compare_runs(model, other, ids)
    assert res.first_divergence == "hook_embed"
    assert res.kl_mean > 0.01 and res.top1 < 1
    assert all(0 <= v <= 1 for v in res.router_overlap.values())
    # a router intervention: swapping expert choices lowers overlap in that layer only
    flip = [("layers.2.mlp.router.hook_ids", lambda t, n: (t + 1) % 4)]
    r2 = compare_runs(model, (model, flip), ids)
    assert r2.first_divergence == "layers.2.mlp.router.hook_ids"
    assert r2.router_overlap[1] == 1 and r2.router_overlap[2] < 1


def test_replacement_and_precision_interventions(model, ids):
    from dsv4lab.model.moe import Expert

    class Off(Expert):
        def forward(self, x):
            return super().forward(x) * 0

    res = compare_runs(model, (model, {"layers.3.mlp.experts.*": Off}), ids)
    assert res.first_divergence.startswith("layers.3.mlp.experts.")
    assert (model.components()["impl"] == "reference").all()
    modes = {n: q.mode for n, q in model.qlinears()}
    r = compare_runs(model, (model, lambda m: using_precision(m, "w4a4")), ids)
    assert r.first_divergence == "layers.0.attn.hook_q" and r.kl_mean > 0
    assert {n: q.mode for n, q in model.qlinears()} == modes  # restored
    r = compare_runs(model, (model, lambda m: m.replace("layers.0.attn_hc", type(m.layers[0].attn_hc))), ids)
    assert r.first_divergence is None  # a callable intervention (handle restored afterwards)
    assert (model.components()["impl"] == "reference").all()


def test_missing_hooks_count_as_divergence(model, ids):
    res = compare_runs(model, (model, {"layers.3.attn.indexer": type("Off", (type(model.layers[3].attn.indexer),),
                                                                     {"_setup_from_original": lambda self, o: setattr(self, "enabled", False)})}), ids)
    assert res.first_divergence == "layers.3.attn.indexer.hook_q"
    assert "layers.3.attn.indexer.hook_scores" in res.missing_in_b


def test_tensor_diff_edge_cases():
    a = torch.tensor([1.0, float("-inf"), 2.0])
    assert tensor_diff(a, a.clone())["rel_err"] == 0
    assert tensor_diff(a, torch.tensor([1.0, 0.0, 2.0]))["status"] == "nonfinite"
    assert tensor_diff(torch.tensor([[1, 2]]), torch.tensor([[2, 1]]))["rel_err"] == 0  # sets
    assert tensor_diff(torch.zeros(2), torch.zeros(3))["status"] == "shape"
