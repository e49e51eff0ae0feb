"""Memory-bounded prefill attention (dsv4lab/model/bounded_attention.py) against the dense
reference path (``Attention.prefill_path = "dense"``, itself checked against the transformers
oracle in test_attention.py): random tiny configs with every attention kind and the embedded
model, logits and per-layer hidden streams; chunked prefill + decode; the indexer's query-chunked
top-k; the fallbacks (a replaced ``_attend``, ``probs_bf16``, a probabilities hook); and a tensor
size census showing the bounded path never creates a [B, H, S, L] tensor.

Tolerance (float32): max |bounded - dense| <= 1e-5 x max(1, max |dense|) per tensor: the online
softmax sums in another order, and over the embedded model's 6 layers that reaches 3e-5 on logits
of size 24 and 1.1e-4 on residual streams of size 80 (elementwise rtol would fail near zero).
"""
from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import dsv4lab
from dsv4lab.analysis.components import shallow_clone
from dsv4lab.bugzoo.variants import AttentionSinkScaled, IndexerQNoRope
from dsv4lab.model.attention import Attention
from dsv4lab.model.init import randomize_
from dsv4lab.model.model import DSV4Model
from dsv4lab.quant.modes import RoundTrip
from oracle_util import random_ids, tiny_config

TOL = 1e-5
SLIDING, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"
CONFIGS = {
    "sliding": dict(num_hidden_layers=2, layer_types=[SLIDING] * 2, mlp_layer_types=["hash_moe", "moe"]),
    "csa": dict(num_hidden_layers=2, layer_types=[CSA] * 2, mlp_layer_types=["moe", "moe"], index_topk=4),
    "hca": dict(num_hidden_layers=2, layer_types=[HCA] * 2, mlp_layer_types=["moe", "moe"],
                compress_rates={CSA: 4, HCA: 4}),
    "mixed": {},
}
# (q_block, k_block): whole-sequence blocks, odd sizes that split windows and top-k, one by one
BLOCKS = [(None, None), (5, 3), (1, 1)]


def assert_close(got: torch.Tensor, want: torch.Tensor) -> None:
    scale = max(1.0, want.abs().max().item())
    err = (got - want).abs().max().item()
    assert err <= TOL * scale, f"max abs difference {err:.3g} > {TOL} x {scale:.3g}"


def attentions(m) -> list[Attention]:
    return [mod for mod in m.modules() if isinstance(mod, Attention)]


def set_attn(m, **kw) -> None:
    for a in attentions(m):
        for k, v in kw.items():
            setattr(a, k, v)


def run(m, ids, **kw) -> tuple[torch.Tensor, list[torch.Tensor], list[str]]:
    """Logits, every layer's hook_resid_post, and the path each attention took."""
    set_attn(m, **{"prefill_path": "auto", "q_block": None, "k_block": None, **kw})
    resid = []
    hs = [layer.hook_resid_post.register_forward_hook(lambda mod, a, out: resid.append(out.clone())) for layer in m.layers]
    try:
        with torch.no_grad():
            logits = m(ids)
    finally:
        for h in hs:
            h.remove()
    return logits, resid, [a.last_prefill_path for a in attentions(m)]


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def model(request):
    return randomize_(DSV4Model(tiny_config(**CONFIGS[request.param])), seed=3).eval()


@pytest.fixture(scope="module")
def embedded():
    return dsv4lab.load(progress=False)


@pytest.mark.parametrize("blocks", BLOCKS, ids=str)
def test_bounded_matches_dense(model, blocks):
    ids = random_ids(model.config, n=53, b=2)
    want, want_h, paths = run(model, ids, prefill_path="dense")
    assert set(paths) == {"dense"}
    got, got_h, paths = run(model, ids, q_block=blocks[0], k_block=blocks[1])
    assert set(paths) == {"bounded"}
    assert_close(got, want)
    for g, w in zip(got_h, want_h, strict=True):
        assert_close(g, w)


def test_embedded_model_bounded_matches_dense(embedded):
    ids = random_ids(embedded.config, n=150, b=1)   # window 32, HCA ratio 16: 9 entries, CSA 37 > top-k 8
    want, want_h, _ = run(embedded, ids, prefill_path="dense")
    got, got_h, paths = run(embedded, ids, q_block=16, k_block=8)
    assert set(paths) == {"bounded"}
    assert_close(got, want)
    for g, w in zip(got_h, want_h, strict=True):
        assert_close(g, w)
    assert (got - want).abs().max() > 0  # a different summation order, not the dense path again


def test_chunked_prefill_and_decode_match_full_forward(model):
    """Chunks that start inside a window and a compression window, then decode steps, on the
    bounded path with small blocks == one dense forward over the whole sequence."""
    ids = random_ids(model.config, n=48, b=2, seed=5)
    want, _, _ = run(model, ids, prefill_path="dense")
    set_attn(model, prefill_path="auto", q_block=4, k_block=5)
    st = model.new_state(2, 48)
    with torch.no_grad():
        parts = [model.prefill(ids[:, :13], st), model.prefill(ids[:, 13:30], st), model.prefill(ids[:, 30:42], st)]
        assert set(a.last_prefill_path for a in attentions(model)) == {"bounded"}
        for t in range(42, 48):
            parts.append(model.decode_step(ids[:, t : t + 1], st))
            st.pos += 1
    assert_close(torch.cat(parts, 1), want)


def test_generate_tokens_unchanged(model):
    ids = random_ids(model.config, n=30, b=1, seed=9)
    set_attn(model, prefill_path="dense")
    want = model.generate(ids, 8)
    set_attn(model, prefill_path="auto", q_block=3, k_block=2)
    assert torch.equal(model.generate(ids, 8, prefill_chunk=11), want)


def test_indexer_chunked_topk_is_the_whole_topk(embedded):
    """Indexer.choose over query blocks of 1..7 rows == select(scores(...)) at once, also for a
    replaced ``scores`` (a bug-zoo variant runs per block)."""
    attn = embedded.layers[2].attn
    ix = attn.indexer
    cfg = embedded.config
    g = torch.Generator().manual_seed(0)
    S, T = 40, 23
    x = torch.randn(2, S, cfg.hidden_size, generator=g)
    q_res = torch.randn(2, S, cfg.q_lora_rank, generator=g)
    keys = torch.randn(2, T, cfg.index_head_dim, generator=g)
    positions = torch.arange(60, 60 + S)
    visible = ((positions + 1) // ix.ratio).clamp(max=T)
    for impl in (ix, shallow_clone(ix, IndexerQNoRope)):
        want = impl.select(impl.scores(x, q_res, positions, keys), visible)
        row_bytes = 2 * ix.n_heads * T * 4 * 2
        for rows in (1, 4, 7):
            assert torch.equal(impl.choose(x, q_res, positions, keys, visible, rows * row_bytes), want)
        # a listening hook gets one firing with every query
        seen = []
        h = impl.hook_scores.register_forward_hook(lambda mod, a, out: seen.append(out.shape))
        try:
            assert torch.equal(impl.choose(x, q_res, positions, keys, visible, row_bytes), want)
        finally:
            h.remove()
        assert seen == [torch.Size([2, S, T])]


def test_replaced_attend_and_probs_bf16_run_blocked(model):
    """A replaced ``_attend`` (a bug-zoo variant) and ``probs_bf16`` take the dense math per
    query block: the same result as the dense path (the bug stays visible)."""
    ids = random_ids(model.config, n=40, b=2)
    layer = model.layers[0]
    orig = layer.attn
    layer.attn = shallow_clone(orig, AttentionSinkScaled)
    try:
        want, _, _ = run(model, ids, prefill_path="dense")
        got, _, paths = run(model, ids, q_block=3)
        assert paths[0] == "blocked" and set(paths[1:]) <= {"bounded"}
        assert_close(got, want)
    finally:
        layer.attn = orig
    clean, _, _ = run(model, ids, prefill_path="dense")
    assert (clean - want).abs().max() > 1e-3
    set_attn(model, round_trips=frozenset({RoundTrip.PROBS_BF16}))
    try:
        want, _, _ = run(model, ids, prefill_path="dense")
        got, _, paths = run(model, ids, q_block=7)
        assert set(paths) == {"blocked"}
        assert_close(got, want)
    finally:
        set_attn(model, round_trips=frozenset())


def test_probs_hook_sees_reference_probabilities_and_changes_no_bit(model):
    """A listening ``hook_probs`` fires once per prefill call with the dense [B,H,S,L+1]
    probabilities while the output stays the bounded one (bitwise); a hook that replaces them
    steers the output exactly as on the dense path."""
    ids = random_ids(model.config, n=20, b=1)
    quiet, _, _ = run(model, ids, q_block=3)
    attn = model.layers[0].attn
    fired = []
    h = attn.hook_probs.register_forward_hook(lambda mod, a, out: fired.append(out.clone()))
    try:
        listened, _, paths = run(model, ids, q_block=3)
        assert paths[0] == "bounded" and len(fired) == 1
        assert torch.equal(listened, quiet)
        run(model, ids, prefill_path="dense")
        assert len(fired) == 2 and fired[0].shape == fired[1].shape and fired[0].shape[:3] == (1, attn.n_heads, 20)
        torch.testing.assert_close(fired[0], fired[1], atol=0, rtol=0)
    finally:
        h.remove()

    def uniform(mod, a, out):  # replace: every unmasked key and the sink weigh the same
        w = (out > 0).float()
        return w / w.sum(-1, keepdim=True)

    h = attn.hook_probs.register_forward_hook(uniform)
    try:
        steered, _, _ = run(model, ids, q_block=3)
        want, _, _ = run(model, ids, prefill_path="dense")
    finally:
        h.remove()
    assert (steered - quiet).abs().max() > 1e-3
    assert_close(steered, want)
    with pytest.raises(ValueError, match="prefill_path"):
        run(model, ids, prefill_path="flash")


class LargestTensor(TorchDispatchMode):
    """Records the largest tensor (elements) any op creates."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def test_bounded_path_never_creates_a_heads_by_queries_by_keys_tensor():
    """One CSA and one HCA layer, 256 tokens: dense creates [B,H,S,L] (the census sees it);
    bounded with 8-row / 16-key blocks and a 64 KiB indexer block stays far below it."""
    cfg = tiny_config(num_hidden_layers=2, layer_types=[CSA, HCA], mlp_layer_types=["moe", "moe"],
                      num_attention_heads=8, index_topk=16)
    m = randomize_(DSV4Model(cfg), seed=1).eval()
    B, S, H = 1, 256, cfg.num_attention_heads
    L = (S + S // 4)  # CSA keys: window positions + compressed entries
    ids = random_ids(cfg, n=S, b=B)
    for path in ("dense", "auto"):
        set_attn(m, prefill_path=path, q_block=8, k_block=16, block_bytes=64 * 2**10)
        census = LargestTensor()
        with torch.no_grad(), census:
            m(ids)
        if path == "dense":
            assert census.largest >= B * H * S * L
        else:
            assert set(a.last_prefill_path for a in attentions(m)) == {"bounded"}
            assert census.largest < B * H * S * L // 16, census.largest


# ------------------------------------------------------------------------------ chunk from free memory
def test_chunk_from_free_memory_v4_pro():
    """V4-Pro with the plan's 18.9 GB free on its fullest GPU: an 8k or 64k prompt gets chunks of
    thousands of tokens whose stated transient fits half the free memory; a listening
    probabilities hook (dense [H, C, L]) gets far smaller ones; more memory, larger chunks."""
    from dsv4lab.config import named_config
    from dsv4lab.model.chunking import choose_chunk, prefill_transient_bytes

    cfg = named_config("v4-pro")
    free, block = int(18.9e9), 256 * 2**20
    for n in (8192, 65536):
        bounded = choose_chunk(cfg, n, free, block_bytes=block)
        dense = choose_chunk(cfg, n, free, block_bytes=block, dense_attention=True)
        assert 2048 <= bounded < n and bounded % 256 == 0
        assert prefill_transient_bytes(cfg, bounded, n - bounded, block_bytes=block) <= free / 2
        assert prefill_transient_bytes(cfg, bounded + 256, n - bounded - 256, block_bytes=block) > free / 2
        assert 1 <= dense < bounded // 2
        assert prefill_transient_bytes(cfg, dense, n - dense, block_bytes=block, dense_attention=True) <= free / 2
    assert choose_chunk(cfg, 65536, 4 * free, block_bytes=block) > bounded


def test_forward_and_generate_choose_chunks_from_free_memory(embedded, monkeypatch):
    import dsv4lab.model.model as model_mod
    from dsv4lab.model.validate import InputError

    ids = random_ids(embedded.config, n=70, b=1)
    set_attn(embedded, prefill_path="auto", q_block=None, k_block=None)
    calls = []
    h = embedded.hook_embed.register_forward_hook(lambda mod, a, out: calls.append(out.shape[1]))
    try:
        with torch.no_grad():
            whole = embedded(ids)
            assert calls == [70]                           # plenty of host memory: one call
            h.remove()
            toks = embedded.generate(ids, 4)
            monkeypatch.setattr(model_mod, "free_bytes", lambda dev: 2 * 2**20)
            chunk = embedded.prefill_chunk(70)
            assert 1 <= chunk < 70
            calls.clear()
            h = embedded.hook_embed.register_forward_hook(lambda mod, a, out: calls.append(out.shape[1]))
            assert_close(embedded(ids), whole)
            assert calls == [chunk] * (70 // chunk) + ([70 % chunk] if 70 % chunk else [])
            h.remove()
            assert torch.equal(embedded.generate(ids, 4), toks)
    finally:
        h.remove()
    for bad in (0, -3, 2.5, True):
        with pytest.raises(InputError, match="chunk"):
            embedded(ids, chunk=bad)
