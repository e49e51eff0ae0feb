"""``python -m dsv4lab compare-dump DUMP [--model PATH] [--reference PATH] [--mapping hf|FILE] [--tol T]
[--json] [--isolate]``: replay an engine's dump through dsv4lab's reference and diff it hook by hook.

Exit status: 0 nothing diverges, 1 something does, 2 bad input (one line: unreadable or truncated
step file, missing ``input_ids``, a mapping naming no hook point, a shape mismatch after mapping).
"""
from __future__ import annotations

import argparse
import json
import sys

import torch

from ..dump import DumpReader, compare_dump, load_mapping, parse_tol
from ..dump.mapping import BUILTIN
from ..loading import load
from ..precision import Originals, apply_precision
from ..quant.modes import MODES


def register(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "compare-dump", help="diff your engine's tensor dump against the reference, hook by hook",
        description="Replay the dump's input_ids (prefill, then decode steps) through dsv4lab's reference, compare "
                    "every mapped engine tensor at its hook point in execution order, report the first divergence, "
                    "a per-layer table and the unmapped names (docs/dumps.md).")
    p.add_argument("dump", help="dump directory: step_000.safetensors, step_001.safetensors, ...")
    p.add_argument("--model", default=None, help="checkpoint of the reference (default: the embedded tiny model)")
    p.add_argument("--reference", default=None, metavar="PATH",
                   help="checkpoint holding the original weights (official FP8+MXFP4 or BF16): the reference runs "
                        "them ('orig' policy), read one linear at a time")
    p.add_argument("--precision", default=None, choices=[str(m) for m in MODES],
                   help="precision policy of the reference (default: as loaded; 'orig' with --reference)")
    p.add_argument("--mapping", default="hf", help=f"built-in ({', '.join(BUILTIN)}) or a JSON mapping file (default hf)")
    p.add_argument("--tol", default=None,
                   help="relative-error tolerance: NUMBER and/or PATTERN=NUMBER overrides, comma-separated "
                        "(default 1e-4; e.g. 1e-3,**.hook_resid_post=1e-2)")
    p.add_argument("--device", default="cpu", help="device of the reference (default cpu)")
    p.add_argument("--isolate", action="store_true",
                   help="replay again feeding the engine's tensor at every diverging point (teacher forcing): "
                        "says whether a component is wrong or got wrong input")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.set_defaults(func=run)
    return p


def run(args) -> int:
    reader, mapping = DumpReader(args.dump), load_mapping(args.mapping)  # bad input fails before the model loads
    tol = parse_tol(args.tol)
    progress = not args.json and sys.stderr.isatty()
    model = load(args.model, device=args.device, dtype=torch.float32 if args.device == "cpu" else torch.bfloat16,
                 progress=progress)
    policy = args.precision or ("orig" if args.reference else None)
    if policy is not None:
        originals = Originals.from_checkpoint(args.reference, model.dtype) if args.reference else None
        apply_precision(model, policy, originals)
    res = compare_dump(model, reader, mapping=mapping, tol=tol, isolate=args.isolate, progress=progress)
    if args.json:
        json.dump(res.to_dict(), sys.stdout, indent=1)
        sys.stdout.write("\n")
    else:
        print(res.summary())
    return 1 if res.diverged else 0
