"""Stand-in engines that write dumps, run by the tests in a SEPARATE process (as a user's engine is).

    python tests/engines/dump_engine.py hf DIR [--bug hf_sink_scaled|hf_silu_clamped|hf_indexer_weights_sign]
        [--steps N] [--prompt-len N]
    python tests/engines/dump_engine.py zoo DIR --bug NAME [--tp R] [--steps N]

``hf``: transformers' DeepseekV4ForCausalLM on the embedded checkpoint (data/tiny-dsv4), forward
hooks on its modules write the dump under transformers' own module names (prefill, then greedy
decode steps through its cache). ``--bug`` plants a bug in THAT engine.
``zoo``: dsv4lab's model with a bug-zoo bug injected, its hook points renamed to an engine's own
names (``blk.N.*``), laid out differently ([B,H,S,Dh] queries, [B,D,S] block outputs) and, with
``--tp R``, split into rank shards (``...rank{r}``: queries by heads, MoE output as partial sums).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from dsv4lab.dump.writer import Dumper  # noqa: E402

TINY = ROOT / "data" / "tiny-dsv4"
PROMPT_LEN = 40          # > sliding window 32 and > one HCA window (16): every component is live


def prompt(vocab: int, n: int = PROMPT_LEN) -> torch.Tensor:
    return torch.randint(2, vocab, (1, n), generator=torch.Generator().manual_seed(3))


# ------------------------------------------------------------------------------ transformers
HF_MODULES = (r"^(model\.embed_tokens|model\.norm|lm_head|model\.layers\.\d+"
              r"(\.(attn_hc|ffn_hc|self_attn|self_attn\.compressor\.indexer|mlp|mlp\.gate|mlp\.experts|mlp\.shared_experts|input_layernorm))?)$")


def hf_engine(out: str, steps: int, bug: str | None, n: int = PROMPT_LEN) -> None:
    import torch.nn.functional as F
    from transformers import DeepseekV4ForCausalLM

    model = DeepseekV4ForCausalLM.from_pretrained(str(TINY), dtype=torch.float32, attn_implementation="eager").eval()
    if bug == "hf_sink_scaled":          # layer 2's sink logits multiplied by the softmax scale
        att = model.model.layers[2].self_attn
        att.sinks.data.mul_(att.scaling)
    elif bug == "hf_indexer_weights_sign":  # layer 2's indexer head weights with the wrong sign
        model.model.layers[2].self_attn.compressor.indexer.scorer.weights_proj.weight.data.neg_()  # BUG
    elif bug == "hf_silu_clamped":       # layer 3's routed experts clamp silu(gate) (at 0.05), not gate
        ex = model.model.layers[3].mlp.experts

        def gate(gate_up, ex=ex):
            g, u = gate_up.chunk(2, dim=-1)
            return F.silu(g).clamp(max=0.05) * u.clamp(-ex.limit, ex.limit)  # BUG

        ex._apply_gate = gate
    elif bug is not None:
        raise SystemExit(f"unknown hf bug {bug}")
    dumper = Dumper(out, metadata={"engine": "transformers", "bug": bug or ""})
    dumper.hook_modules(model, HF_MODULES)
    ids = prompt(model.config.vocab_size, n)
    with torch.no_grad():
        o = model(input_ids=ids, use_cache=True)
        dumper.step(ids)
        cache = o.cache if hasattr(o, "cache") else o.past_key_values
        for _ in range(steps - 1):
            nxt = o.logits[:, -1:].argmax(-1)
            o = model(input_ids=nxt, cache=cache, use_cache=True)
            cache = o.cache if hasattr(o, "cache") else o.past_key_values
            dumper.step(nxt)


# ------------------------------------------------------------------------------ dsv4lab + a zoo bug
# dsv4lab hook -> (engine name, how the engine lays it out, how it shards)
ZOO_NAMES = {
    "layers.{L}.attn_hc.hook_collapsed": ("blk.{L}.hc_attn.x", None, None),
    "layers.{L}.attn.hook_q": ("blk.{L}.attn.q", "bhsd", "heads"),
    "layers.{L}.attn.compressor.hook_entries": ("blk.{L}.attn.cmp.kv", None, None),
    "layers.{L}.attn.hook_out": ("blk.{L}.attn.out", "bds", None),
    "layers.{L}.ffn_hc.hook_collapsed": ("blk.{L}.hc_ffn.x", None, None),
    "layers.{L}.mlp.router.hook_ids": ("blk.{L}.moe.topk_ids", None, None),
    "layers.{L}.mlp.shared_expert.hook_out": ("blk.{L}.moe.shared", None, None),
    "layers.{L}.mlp.experts.hook_out": ("blk.{L}.moe.routed", None, "partial"),
    "layers.{L}.hook_resid_post": ("blk.{L}.streams", None, None),
    "hook_logits": ("logits", None, None),
}


def zoo_engine(out: str, steps: int, bug: str | None, tp: int) -> None:
    import dsv4lab
    from dsv4lab.bugzoo import inject

    model = dsv4lab.load(progress=False)
    if bug:
        inject(model, bug)
    dumper = Dumper(out, metadata={"engine": "zoo", "bug": bug or "", "tp": str(tp)})
    table = {}
    for L in range(model.config.num_hidden_layers):
        for hook, spec in ZOO_NAMES.items():
            table[hook.format(L=L)] = (spec[0].format(L=L), *spec[1:])

    def on(t, name):
        if name not in table:
            return None
        eng, layout, shard = table[name]
        if layout == "bhsd":
            t = t.transpose(1, 2)                         # [B,S,H,Dh] -> [B,H,S,Dh]
        elif layout == "bds":
            t = t.transpose(1, 2)                         # [B,S,D] -> [B,D,S]
        t = t.to(torch.bfloat16) if eng.endswith(".streams") else t
        if tp > 1 and shard == "heads":
            for r, part in enumerate(t.chunk(tp, dim=1)):
                dumper.add(f"{eng}.rank{r}", part)
        elif tp > 1 and shard == "partial":             # each rank holds a partial sum
            w = torch.rand(tp, generator=torch.Generator().manual_seed(1)) + 0.5
            w = w / w.sum()
            for r in range(tp):
                dumper.add(f"{eng}.rank{r}", t * w[r] if r < tp - 1 else t - sum(t * w[i] for i in range(tp - 1)))
        else:
            dumper.add(eng, t)
        return None

    ids = prompt(model.config.vocab_size)
    state = model.new_state(1, ids.shape[1] + steps)
    with torch.no_grad(), model.hooks([("**", on)]):
        logits = model.prefill(ids, state)
        dumper.step(ids)
        for _ in range(steps - 1):
            nxt = logits[:, -1:].argmax(-1)
            logits = model.decode_step(nxt, state)
            state.pos += 1
            dumper.step(nxt)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("engine", choices=["hf", "zoo"])
    p.add_argument("out")
    p.add_argument("--bug", default=None)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--prompt-len", type=int, default=PROMPT_LEN)
    a = p.parse_args()
    torch.set_num_threads(1)
    if a.engine == "hf":
        hf_engine(a.out, a.steps, a.bug, a.prompt_len)
    else:
        zoo_engine(a.out, a.steps, a.bug, a.tp)


if __name__ == "__main__":
    main()
