"""``python -m dsv4lab synth --preset v4-pro --out DIR``: a release-shaped checkpoint of random
weights (real names, shards, index, configs) for runs and tests without the real download."""
from __future__ import annotations

import argparse
import json

from ..checkpoint.synth import DEFAULT_SHARD_BYTES, PRESETS, SYNTH_FORMATS, preset_config, synth_checkpoint
from ..plan import fmt_bytes, parse_bytes
from .args import positive_int


def register(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "synth", help="write a synthetic checkpoint (random weights, release names and formats)",
        description="Write a sharded safetensors checkpoint of random weights with the release's tensor names "
                    "and config, which inspect, plan and load treat as the release. The same --seed gives the "
                    "same BF16 master weights in both formats (nvfp4 vs official FP8 + MXFP4 experts).")
    p.add_argument("--preset", required=True, help=f"model shapes: {' or '.join(PRESETS)}")
    p.add_argument("--out", required=True, help="output directory (must not exist; written as DIR.tmp, then renamed)")
    p.add_argument("--format", dest="fmt", default="nvfp4", choices=SYNTH_FORMATS,
                   help="nvfp4 (ModelOpt export, default) or official (FP8 block + MXFP4 experts)")
    p.add_argument("--layers", type=positive_int, default=None, help="keep only the first N layers (default all)")
    p.add_argument("--experts", type=positive_int, default=None, help="routed experts per layer (default the preset's)")
    p.add_argument("--seed", type=int, default=0, help="weights seed (default 0)")
    p.add_argument("--shard-size", type=parse_bytes, default=DEFAULT_SHARD_BYTES, help="max bytes per shard (e.g. 4GiB)")
    p.add_argument("--device", default="cpu", help="where to generate and quantise (cuda is much faster)")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.set_defaults(func=run)
    return p


def run(args) -> int:
    cfg = preset_config(args.preset, layers=args.layers, experts=args.experts)
    summary = synth_checkpoint(args.out, cfg, fmt=args.fmt, seed=args.seed, shard_bytes=args.shard_size,
                               device=args.device)
    if args.json:
        print(json.dumps(summary, indent=1))
    else:
        print(f"wrote {summary['path']}: {args.fmt}, {cfg.num_hidden_layers} layers, {cfg.n_routed_experts} experts, "
              f"{len(summary['files'])} shard(s), {summary['n_tensors']} tensors, {fmt_bytes(summary['total_bytes'])}")
    return 0

