"""Hook schema, run_with_cache, interventions and component replacement (dsv4lab.analysis)."""
from __future__ import annotations

import pytest
import torch

from dsv4lab.analysis.cache import histogram, norm, stats, topk
from dsv4lab.workbench import random_model
from oracle_util import tiny_config


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def model():
    return random_model(tiny_config(), seed=0)


@pytest.fixture(scope="module")
def ids():
    return torch.randint(0, 97, (2, 64), generator=torch.Generator().manual_seed(1))


def test_hook_schema_covers_every_hook(model):
    df = model.hook_schema(decode=True)
    assert set(df["name"]) == set(model.hook_names())
    assert df["meaning"].map(bool).all(), "every hook point documents its meaning"
    assert df["shape"].notna().all(), "the default prompt makes every hook point fire"
    row = df.set_index("name").loc["layers.1.attn.hook_probs"]
    assert row["dtype"] == "float32" and row["shape"][-1] == row["shape"][-2] + 1 + row["shape"][-2] // 4
    assert df.set_index("name").loc["layers.0.mlp.router.hook_ids", "dtype"] == "int64"
    # execution order: embed first, logits last, attn_hc before attn within a layer
    order = list(df.sort_values("order")["name"])
    assert order[0] == "hook_embed" and order[-1] == "hook_logits"
    assert order.index("layers.2.attn_hc.hook_pre") < order.index("layers.2.attn.hook_q") < order.index("layers.2.hook_resid_mid")
    for name in ("layers.1.attn.compressor.hook_weights", "layers.1.attn.compressor.hook_entries",
                 "layers.1.attn.indexer.hook_scores", "layers.1.attn.indexer.hook_indices",
                 "layers.2.mlp.experts.hook_expert_out", "layers.2.mlp.shared_expert.hook_out",
                 "layers.0.attn_hc.hook_comb", "layers.0.attn_hc.hook_streams", "hook_final_hidden"):
        assert name in order


def test_cache_is_bitwise_neutral(model, ids):
    with torch.no_grad():
        ref = model(ids)
    logits, cache = model.run_with_cache(ids)
    assert torch.equal(ref, logits)
    assert set(cache) == set(model.hook_names())
    assert cache["layers.3.hook_resid_post"].shape == (2, 64, 4, 32)
    assert cache.order[0] == "hook_embed" and len(cache.order) == len(model.hook_names())
    # reductions / filters / offload / budget
    logits2, c2 = model.run_with_cache(ids, names=["**.hook_probs", "layers.*.hook_resid_post", "hook_logits"],
                                       reduce={"**.hook_probs": topk(3), "**.hook_resid_post": norm(), "hook_logits": stats()},
                                       device=None)
    assert torch.equal(ref, logits2)
    assert set(c2) == {f"layers.{i}.attn.hook_probs" for i in range(4)} | {f"layers.{i}.hook_resid_post" for i in range(4)} | {"hook_logits"}
    assert c2["layers.0.attn.hook_probs"]["indices"].shape[-1] == 3
    assert c2["layers.0.hook_resid_post"].shape == (2, 64, 4)
    assert c2.reduced["hook_logits"] == "stats"
    _, c3 = model.run_with_cache(ids, names="hook_logits", reduce=histogram(16))
    assert c3["hook_logits"]["counts"].sum().item() == 2 * 64 * 97
    with pytest.warns(UserWarning):
        _, c4 = model.run_with_cache(ids, max_bytes=100_000)
    assert c4.nbytes <= 100_000 and c4.skipped
    with pytest.raises(MemoryError):
        model.run_with_cache(ids, max_bytes=1000, on_overflow="raise")


def test_cache_during_generate(model, ids):
    prompt = ids[:1]
    ref = model.generate(prompt, 5)
    toks, cache = model.run_with_cache(prompt, names="layers.*.mlp.router.hook_ids", generate=5)
    assert torch.equal(ref, toks)
    assert len(cache.all("layers.1.mlp.router.hook_ids")) == 5  # prefill + 4 decode steps
    assert cache["layers.1.mlp.router.hook_ids"].shape == (1, 2)
    toks2, last = model.run_with_cache(prompt, names="hook_logits", generate=5, keep="last")
    assert torch.equal(ref, toks2) and len(last.all("hook_logits")) == 1
    assert last["hook_logits"].shape == (1, 1, 97)


def test_interventions(model, ids):
    with torch.no_grad():
        ref = model(ids)
    seen = []
    with model.hooks([("layers.*.attn.hook_out", lambda t, n: seen.append(n))]):
        out = model(ids)
    assert torch.equal(ref, out) and seen == [f"layers.{i}.attn.hook_out" for i in range(4)]
    zero = [("layers.2.attn.hook_out", lambda t, n: torch.zeros_like(t))]
    with model.hooks(zero):
        ablated = model(ids)
        _, outer = model.run_with_cache(ids, names="layers.2.attn.hook_out")
    assert not torch.equal(ref, ablated)
    assert outer["layers.2.attn.hook_out"].abs().sum() == 0  # hooks run in registration order
    logits, cache = model.run_with_cache(ids, names=["layers.2.attn.hook_out", "layers.2.hook_resid_mid"], fwd_hooks=zero)
    assert torch.equal(logits, ablated)
    assert cache["layers.2.attn.hook_out"].abs().sum() > 0  # fwd_hooks: the cache sees the value before the patch...
    _, clean = model.run_with_cache(ids, names="layers.2.hook_resid_mid")
    assert not torch.equal(cache["layers.2.hook_resid_mid"], clean["layers.2.hook_resid_mid"])  # ...downstream sees the patch
    # earlier hook points are untouched by a later patch
    with model.hooks([("layers.3.mlp.hook_out", lambda t, n: t * 0)]):
        _, c = model.run_with_cache(ids, names="layers.2.hook_resid_post")
    assert torch.equal(c["layers.2.hook_resid_post"], clean_resid(model, ids))
    # removed on exceptions
    with pytest.raises(RuntimeError):
        with model.hooks([("layers.0.attn.hook_q", lambda t, n: t + 1)]):
            raise RuntimeError("boom")
    assert not any(hp._forward_hooks for _, hp in model.hook_points())
    with pytest.raises(KeyError):
        with model.hooks([("no.such.hook", lambda t, n: None)]):
            pass
    # works in generate: each decode step fires the hook
    steps = []
    with model.hooks([("hook_logits", lambda t, n: steps.append(t.shape[1]))]):
        model.generate(ids[:1], 4)
    assert steps == [64, 1, 1, 1]
    with model.hooks([("hook_logits", lambda t, n: torch.where(torch.arange(97) == 5, 100.0, 0.0).expand_as(t))]):
        forced = model.generate(ids[:1], 4)
    assert (forced[0, 64:] == 5).all()


def clean_resid(model, ids):
    _, c = model.run_with_cache(ids, names="layers.2.hook_resid_post")
    return c["layers.2.hook_resid_post"]


def test_components_table(model):
    df = model.components()
    assert {"name", "kind", "class", "impl", "layer"} <= set(df.columns)
    kinds = dict(zip(df["name"], df["kind"]))
    assert kinds["layers.1.attn.compressor"] == "compressor"
    assert kinds["layers.1.attn.indexer.compressor"] == "indexer.compressor"
    assert kinds["layers.1.attn.indexer.wq_b"] == "indexer.wq_b"
    assert kinds["layers.2.mlp.experts.3.w2"] == "experts"
    assert kinds["layers.2.mlp.router"] == "router" and kinds["head"] == "head"
    assert kinds["layers.0.attn_hc"] == "mhc"
    assert (df["impl"] == "reference").all()
    sub = model.components("layers.*.mlp.experts.*")
    assert len(sub) == 16 and set(sub["class"]) == {"Expert"}
    assert set(model.components("**.wq_b")["name"]) == {f"layers.{i}.attn.wq_b" for i in range(4)} | {"layers.1.attn.indexer.wq_b", "layers.3.attn.indexer.wq_b"}


def test_replace_share_false_copies_a_small_component_and_refuses_a_big_one(model, ids, monkeypatch):
    from dsv4lab.analysis import components
    from dsv4lab.model.compressor import Compressor

    class SameCompressor(Compressor):
        pass

    with torch.no_grad():
        ref = model(ids)
    orig = model.layers[1].attn.compressor
    size = components.state_bytes(orig)
    assert size == sum(t.numel() * t.element_size() for t in [*orig.parameters(), *orig.buffers()])
    from dsv4lab.model.linear import QLinear
    from dsv4lab.quant import quantize_nvfp4
    lin = QLinear(64, 32)
    lin.set_weight(quantize_nvfp4(torch.randn(32, 64)))
    assert components.state_bytes(lin) == lin.qweight.nbytes > 0  # quantised weights are no parameters
    with model.replace("layers.1.attn.compressor", SameCompressor, share=False):
        new = model.layers[1].attn.compressor
        assert type(new) is SameCompressor and new.wkv is not orig.wkv  # its own copy of the weights
        assert torch.equal(new.wkv.weight, orig.wkv.weight)
        with torch.no_grad():
            assert torch.equal(model(ids), ref)
    assert model.layers[1].attn.compressor is orig
    monkeypatch.setattr(components, "COPY_LIMIT_BYTES", size - 1)
    with pytest.raises(ValueError, match=r"share=False\) would copy .* GB of 'layers.1.attn.compressor'.*share=True"):
        model.replace("layers.1.attn.compressor", SameCompressor, share=False)
    assert model.layers[1].attn.compressor is orig  # nothing half-replaced


def test_replace_restore_round_trip(model, ids):
    from dsv4lab.model.compressor import Compressor
    from dsv4lab.model.moe import Expert

    with torch.no_grad():
        ref = model(ids)

    class SameCompressor(Compressor):
        pass

    h = model.replace("layers.*.attn.compressor", SameCompressor)
    assert h.names == ["layers.1.attn.compressor", "layers.2.attn.compressor", "layers.3.attn.compressor"]
    assert type(model.layers[1].attn.compressor) is SameCompressor
    assert model.layers[1].attn.compressor.wkv is h.modules["layers.1.attn.compressor"].wkv  # shares weights
    with torch.no_grad():
        assert torch.equal(model(ids), ref)  # an identical implementation gives identical logits
    comps = model.components("layers.1.attn.compressor")
    assert comps["impl"].iloc[0] == "SameCompressor"
    h.restore()
    assert type(model.layers[1].attn.compressor) is Compressor

    # a callable with the forward signature
    calls = []

    def double_expert(x):
        calls.append(x.shape)
        return torch.zeros(x.shape[0], 32)

    with model.replace("layers.2.mlp.experts.*", double_expert):
        with torch.no_grad():
            changed = model(ids)
    assert calls and not torch.equal(changed, ref)
    # a callable that needs the module (pass_module) reproduces the reference exactly
    with model.replace("layers.*.mlp.experts.*", lambda m, x: Expert.forward(m, x), pass_module=True):
        with torch.no_grad():
            assert torch.equal(model(ids), ref)
    # a method other than forward
    with model.replace("layers.1.attn", {"_attend": lambda q, k, b: torch.zeros_like(q)}):
        with torch.no_grad():
            assert not torch.equal(model(ids), ref)
    with pytest.raises(TypeError):
        model.replace("layers.1.attn", lambda *a: None)  # Attention has no forward: method= needed
    # an instance
    inst = Expert(model.config)
    inst.load_state_dict(model.layers[3].mlp.experts[0].state_dict())
    model.replace("layers.3.mlp.experts.0", inst)
    model.replace("layers.0.attn_hc", type("HC2", (type(model.layers[0].attn_hc),), {}))
    assert model.restore() == 2
    with torch.no_grad():
        assert torch.equal(model(ids), ref)
    assert (model.components()["impl"] == "reference").all()
    with pytest.raises(KeyError):
        model.replace("layers.9.attn", Compressor)


def test_component_call_skips_module_machinery_only_without_hooks(monkeypatch):
    """``Component.__call__`` runs ``forward`` itself when nothing would run around it; a forward
    hook, a pre-hook (with kwargs) and a torch global module hook each take ``nn.Module.__call__``,
    so every hook fires as it does on a plain module."""
    from torch import nn

    from dsv4lab.model.hooks import HookPoint

    hp = HookPoint("t")
    x = torch.randn(3)
    via_module: list = []
    real_call = nn.Module.__call__
    monkeypatch.setattr(nn.Module, "__call__", lambda self, *a, **k: via_module.append(1) or real_call(self, *a, **k))
    assert hp(x) is x and via_module == []                     # no hook: forward directly
    h = hp.register_forward_hook(lambda m, i, o: o * 2)
    assert torch.equal(hp(x), x * 2) and via_module == [1]     # a forward hook replaces the output
    h.remove()
    pre = hp.register_forward_pre_hook(lambda m, args, kwargs: ((args[0] + 1,), kwargs), with_kwargs=True)
    assert torch.equal(hp(x), x + 1) and len(via_module) == 2
    pre.remove()
    seen: list = []
    g = torch.nn.modules.module.register_module_forward_hook(lambda m, i, o: seen.append(type(m).__name__))
    try:
        hp(x)
    finally:
        g.remove()
    assert seen == ["HookPoint"] and len(via_module) == 3     # a global hook fires too
    assert hp(x) is x and len(via_module) == 3                # and once removed, the direct path again
