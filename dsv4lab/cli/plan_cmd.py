"""``python -m dsv4lab plan PATH_OR_CONFIG [--gpus 8] [--gpu-memory 141GB] [--context 65536] ...``

Memory plan: bytes per layer and component (from the checkpoint headers, or from a config and a
format), decode state for the context, a contiguous layer placement balanced by bytes, headroom
per GPU. Exit status: 0 it fits, 2 it does not fit (the reason and what would fit on stderr),
1 the input cannot be read.
"""
from __future__ import annotations

import argparse
import json
import sys

import pandas as pd

from ..checkpoint import CheckpointError
from ..config import ConfigError
from ..plan import PlanError, plan, refusal_message


def register(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "plan", help="memory plan over N GPUs: bytes per layer/component, decode state, placement, headroom",
        description="Plan a DSV4 model over GPUs. PATH_OR_CONFIG is a checkpoint (bytes from its safetensors "
                    "headers), a config.json, or a packaged name (v4-pro, v4-flash).")
    p.add_argument("path", metavar="PATH_OR_CONFIG", help="checkpoint dir / index json / config.json / v4-pro / v4-flash")
    p.add_argument("--gpus", type=int, default=8, help="number of GPUs (default 8)")
    p.add_argument("--gpu-memory", default="141GB",
                   help="memory per GPU, e.g. 141GB, 139GiB, or a comma list per GPU (default 141GB)")
    p.add_argument("--context", type=int, default=65536, help="tokens of decode state per sequence (default 65536)")
    p.add_argument("--batch", type=int, default=1, help="sequences (default 1)")
    p.add_argument("--format", dest="fmt", default=None,
                   help="weight format without a checkpoint: nvfp4 (default), fp8_mxfp4 (official), bf16")
    p.add_argument("--reserve", default="6GB", help="bytes kept free per GPU for activations/workspace (default 6GB)")
    p.add_argument("--kv-dtype", default="bf16", help="decode-state dtype (default bf16)")
    p.add_argument("--dense", default="", help="comma list of component kinds that also get a BF16 dense copy "
                                                "(e.g. head,router,compressor.*)")
    p.add_argument("--layers", action="store_true", help="also print the per-layer table")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.set_defaults(func=run)
    return p


def run(args) -> int:
    mem = args.gpu_memory.split(",") if "," in str(args.gpu_memory) else args.gpu_memory
    gpus = len(mem) if isinstance(mem, list) else args.gpus
    dense = [d.strip() for d in args.dense.split(",") if d.strip()]
    try:
        p = plan(args.path, gpus=gpus, gpu_memory=mem, context=args.context, batch=args.batch, fmt=args.fmt,
                 reserve=args.reserve, kv_dtype=args.kv_dtype, dense=dense, check=False)
    except (CheckpointError, ConfigError, ValueError, KeyError, OSError) as e:
        print(f"dsv4lab plan: {e}", file=sys.stderr)
        return 1
    if args.json:
        json.dump(p.to_dict(), sys.stdout, indent=1)
        sys.stdout.write("\n")
    else:
        print(p.summary())
        if args.layers:
            with pd.option_context("display.width", 250, "display.max_rows", 500, "display.max_columns", 50):
                t = p.table()
                cols = [c for c in t.columns if c not in ("gpu", "type", "moe")]
                t[cols] = (t[cols] / 1e9).round(3)
                print("per layer (GB):")
                print(t.to_string())
        runs = ", ".join(f"{_r(p.layers_on(g))} -> cuda:{g}" for g in range(p.gpus) if p.layers_on(g))
        print(f"device_map (dsv4lab.load(..., device_map=plan.device_map())): layers {runs}")
    if not p.fits:
        print("dsv4lab plan: " + str(PlanError(refusal_message(p, args.fmt, p.weight_source == "checkpoint", args.reserve, dense))),
              file=sys.stderr)
        return 2
    return 0


def _r(ls: list[int]) -> str:
    return f"{ls[0]}-{ls[-1]}" if len(ls) > 1 else str(ls[0])
