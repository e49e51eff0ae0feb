"""``python -m dsv4lab syncs [--model PATH]``: every host sync inside one decode step.

Runs decode steps under ``torch.cuda.set_sync_debug_mode("warn")`` and lists each sync with the
file:line of our code that triggered it. The decode step must have none (sampling and the stop
check are outside it by design). Needs CUDA; exit 2 when syncs were found.
"""
from __future__ import annotations

import argparse
import json
import sys

import torch

from ..decode.check import sync_inventory
from ..loading import load
from .args import positive_int
from .decode_check_cmd import prompt_ids


def register(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("syncs", help="list host syncs inside a decode step (CUDA)")
    p.add_argument("--model", default=None, help="checkpoint path (default: the embedded tiny model)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--steps", type=positive_int, default=3, help="decode steps (a positive int, default 3)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=run)
    return p


def run(args) -> int:
    if not torch.cuda.is_available() or not args.device.startswith("cuda"):
        print("dsv4lab syncs: needs a CUDA device (CPU ops never sync with a host)", file=sys.stderr)
        return 1
    model = load(args.model, device=args.device, dtype=torch.bfloat16, progress=not args.json)
    found = sync_inventory(model, prompt_ids(args.model, "The capital of France is"), steps=args.steps)
    if args.json:
        json.dump({"syncs": found, "count": len(found)}, sys.stdout, indent=1)
        sys.stdout.write("\n")
    else:
        print(f"{len(found)} host sync(s) in {args.steps} decode step(s)")
        for s in found:
            print(f"  {s['where']}: {s['message']}  | {s.get('code')}")
    return 0 if not found else 2
