"""``python -m dsv4lab bugzoo [--model PATH] [--json]``: inject every known bug and check that the
triage finds it (first divergent hook point inside the component the bug lives in). Each bug runs
on the input its trigger asks for (a prompt-length residue, the model run from embeddings,
official FP8 weights), built from one base prompt; ``--list`` shows the triggers and symptoms.

Exit status: 0 every applicable bug localised, 2 some bug was not localised, 1 no model.
"""
from __future__ import annotations

import argparse
import json
import sys

import torch

import dsv4lab

from ..bugzoo import BUGS, bug_named, triage

# fallback when the embedded model is unavailable: the 4-layer test layout (sliding, CSA, HCA, CSA)
_TINY = dict(vocab_size=97, hidden_size=32, moe_intermediate_size=16, num_hidden_layers=4, num_attention_heads=4,
             head_dim=16, partial_rotary_factor=0.5, q_lora_rank=16, num_experts_per_tok=2, n_routed_experts=4,
             o_groups=2, o_lora_rank=8, index_n_heads=8, index_head_dim=16, index_topk=3, sliding_window=8,
             layer_types=["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention",
                          "compressed_sparse_attention"],
             compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
             mlp_layer_types=["hash_moe", "moe", "moe", "moe"], hc_sinkhorn_iters=5, swiglu_limit=1.0,
             routed_scaling_factor=1.5)


def register(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "bugzoo", help="inject each known DSV4 bug and check the triage localises it",
        description="For every bug in dsv4lab.bugzoo.BUGS: inject it, diff against the clean run hook by hook, "
                    "report the first divergent hook point and whether it lies in the component the bug lives in.")
    p.add_argument("--model", default=None, help="checkpoint path (default: the embedded model, dsv4lab.load())")
    p.add_argument("--json", action="store_true", help="print results as JSON")
    p.add_argument("--bugs", default=None, help="comma-separated bug names (default: all)")
    p.add_argument("--list", action="store_true", help="list the bugs (trigger, symptom) and exit")
    p.add_argument("--seq-len", type=int, default=None, help="prompt length (default: enough for every window to close)")
    p.add_argument("--seed", type=int, default=0, help="prompt seed")
    p.add_argument("--no-quantize", action="store_true",
                   help="report NVFP4-only bugs as n/a on plain weights instead of triaging a quantised copy")
    p.set_defaults(func=run)
    return p


def _model(path):
    """(model, note): the checkpoint / embedded model, or a random tiny model if none loads."""
    try:
        return dsv4lab.load(path, progress=False), None
    except Exception as e:  # noqa: BLE001
        if path is not None:
            raise
        from ..config import config_from_dict
        from ..workbench import random_model

        return random_model(config_from_dict(_TINY), seed=0), (
            f"embedded model unavailable ({type(e).__name__}: {e}); using a random tiny model (seed 0)")


def prompt_len(config) -> int:
    ratios = [config.compress_ratio(i) for i in range(config.num_hidden_layers)]
    m = max([r for r in ratios if r] or [1])
    return max(64, 2 * config.sliding_window + 1, 4 * m + 1)


def run(args) -> int:
    if args.list:
        rows = [b.to_dict() for b in BUGS.values()]
        if args.json:
            json.dump(rows, sys.stdout, indent=1)
            sys.stdout.write("\n")
        else:
            for b in rows:
                print(f"{b['name']:32s} [{b['kind']}] {b['description']}  <- {b['seed'] or '-'}\n"
                      f"{'':32s}   triggered by: {b['triggered_by']}\n{'':32s}   symptom: {b['symptom']}")
        return 0
    names = list(BUGS) if not args.bugs else [b.strip() for b in args.bugs.split(",") if b.strip()]
    for b in names:
        bug_named(b, "--bugs")
    try:
        model, note = _model(args.model)
    except Exception as e:  # noqa: BLE001
        print(f"dsv4lab bugzoo: cannot load {args.model}: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    cfg = model.config
    ids = None
    if not args.seq_len and getattr(model, "source", None):
        try:  # a checkpoint with our tokenizer: natural text on which the clamp bugs are live
            from ..bugzoo.prompts import live_prompt
            from ..text.tokenizer import load_tokenizer

            ids = live_prompt(model, load_tokenizer(model.source)).to(model.device)
        except Exception:  # noqa: BLE001 - no usable tokenizer: random tokens below
            ids = None
    if ids is None:
        n = args.seq_len or prompt_len(cfg)
        ids = torch.randint(0, cfg.vocab_size, (1, n), generator=torch.Generator().manual_seed(args.seed)).to(model.device)
    n = ids.shape[1]
    results = [triage(model, b, ids, quantize=not args.no_quantize) for b in names]
    bad = [r for r in results if r.applicable and not r.localized]
    if args.json:
        out = {"model": getattr(model, "source", None) or "random-tiny", "note": note, "seq_len": n,
               "results": [{**r.to_dict(), "triggered_by": BUGS[r.bug].trigger.describe(BUGS[r.bug].requires),
                            "symptom": BUGS[r.bug].symptom} for r in results],
               "localized": sum(r.localized for r in results),
               "applicable": sum(r.applicable for r in results)}
        json.dump(out, sys.stdout, indent=1)
        sys.stdout.write("\n")
    else:
        if note:
            print(f"note: {note}")
        print(f"model: {getattr(model, 'source', None) or 'random tiny'}; prompt {n} tokens")
        for r in results:
            extra = (f" [{r.seq_len} tokens]" if r.seq_len != n else "") + \
                (" [from embeddings]" if r.form == "embeds" else "")
            print(r.line() + (" [quantised in place]" if r.quantized else "") + extra)
        ok = sum(r.localized for r in results)
        print(f"{ok}/{sum(r.applicable for r in results)} applicable bugs localised to their component")
    return 2 if bad else 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m dsv4lab.cli.bugzoo_cmd")
    sub = p.add_subparsers(dest="command")
    register(sub)
    args = p.parse_args(["bugzoo"] + list(sys.argv[1:] if argv is None else argv))
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
