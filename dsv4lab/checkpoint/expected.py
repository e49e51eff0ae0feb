"""The tensors a config implies (docs/naming.md), with logical shapes and component kinds.

Logical shapes are those of the unquantised tensor: a packed FP4 weight stores ``[out, in/2]``
bytes for a logical ``[out, in]`` (see :func:`dsv4lab.checkpoint.formats.stored_shapes`).
"""
from __future__ import annotations

from typing import NamedTuple

from ..config import CSA, HASH_MOE, HCA, SLIDING, DSV4Config, load_config


class Expected(NamedTuple):
    shape: tuple[int, ...]
    kind: str


def expected_layer(config: DSV4Config, i: int) -> dict[str, Expected]:
    c = config
    D, H, Dh, Q = c.hidden_size, c.num_attention_heads, c.head_dim, c.q_lora_rank
    G, R, I, NE = c.o_groups, c.o_lora_rank, c.moe_intermediate_size, c.n_routed_experts
    Hi, Ih, hc = c.index_n_heads, c.index_head_dim, c.hc_mult
    p = f"layers.{i}."
    out: dict[str, Expected] = {}

    def add(name: str, shape, kind: str) -> None:
        out[p + name] = Expected(tuple(int(s) for s in shape), kind)

    for hcn in ("attn_hc", "ffn_hc"):
        add(f"{hcn}.fn", ((2 + hc) * hc, hc * D), "mhc")
        add(f"{hcn}.base", ((2 + hc) * hc,), "mhc")
        add(f"{hcn}.scale", (3,), "mhc")
    add("attn_norm.weight", (D,), "norm")
    add("ffn_norm.weight", (D,), "norm")
    add("attn.wq_a.weight", (Q, D), "attn.wq_a")
    add("attn.q_norm.weight", (Q,), "norm")
    add("attn.wq_b.weight", (H * Dh, Q), "attn.wq_b")
    add("attn.wkv.weight", (Dh, D), "attn.wkv")
    add("attn.kv_norm.weight", (Dh,), "norm")
    add("attn.wo_a.weight", (G * R, H * Dh // G), "attn.wo_a")
    add("attn.wo_b.weight", (D, G * R), "attn.wo_b")
    add("attn.sink", (H,), "attn.sink")
    t = c.layer_types[i]
    if t != SLIDING:
        m = c.compress_ratio(i)
        cc = 2 if t == CSA else 1
        add("attn.compressor.wkv.weight", (cc * Dh, D), "compressor.wkv")
        add("attn.compressor.wgate.weight", (cc * Dh, D), "compressor.wgate")
        add("attn.compressor.ape", (m, cc * Dh), "compressor.ape")
        add("attn.compressor.norm.weight", (Dh,), "norm")
        if t == CSA:
            add("attn.indexer.wq_b.weight", (Hi * Ih, Q), "indexer.wq_b")
            add("attn.indexer.weights_proj.weight", (Hi, D), "indexer.weights_proj")
            add("attn.indexer.compressor.wkv.weight", (2 * Ih, D), "indexer.compressor.wkv")
            add("attn.indexer.compressor.wgate.weight", (2 * Ih, D), "indexer.compressor.wgate")
            add("attn.indexer.compressor.ape", (m, 2 * Ih), "indexer.compressor.ape")
            add("attn.indexer.compressor.norm.weight", (Ih,), "norm")
    assert t in (SLIDING, CSA, HCA)
    add("mlp.router.weight", (NE, D), "router")
    if c.mlp_layer_types[i] == HASH_MOE:
        add("mlp.router.tid2eid", (c.vocab_size, c.num_experts_per_tok), "router")
    else:
        add("mlp.router.bias", (NE,), "router")
    for e in range(NE):
        add(f"mlp.experts.{e}.w1.weight", (I, D), "experts")
        add(f"mlp.experts.{e}.w2.weight", (D, I), "experts")
        add(f"mlp.experts.{e}.w3.weight", (I, D), "experts")
    if c.n_shared_experts:
        Is = I * c.n_shared_experts
        add("mlp.shared_expert.w1.weight", (Is, D), "shared_expert")
        add("mlp.shared_expert.w2.weight", (D, Is), "shared_expert")
        add("mlp.shared_expert.w3.weight", (Is, D), "shared_expert")
    return out


def expected_tensors(config) -> dict[str, Expected]:
    """canonical name -> (logical shape, kind) for every tensor ``config`` implies.

    ``config`` is a :class:`DSV4Config` or anything :func:`load_config` accepts. With tied word
    embeddings ``head.weight`` is not expected (a checkpoint may still carry it).
    """
    c = load_config(config)
    V, D, hc = c.vocab_size, c.hidden_size, c.hc_mult
    out: dict[str, Expected] = {"embed.weight": Expected((V, D), "embed")}
    for i in range(c.num_hidden_layers):
        out.update(expected_layer(c, i))
    out["norm.weight"] = Expected((D,), "norm")
    out["hc_head.fn"] = Expected((hc, hc * D), "mhc")
    out["hc_head.base"] = Expected((hc,), "mhc")
    out["hc_head.scale"] = Expected((1,), "mhc")
    if not c.tie_word_embeddings:
        out["head.weight"] = Expected((V, D), "head")
    return out
