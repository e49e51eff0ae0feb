"""``python -m dsv4lab inspect PATH [--json]``: what is in a checkpoint, from headers only.

Exit status: 0 clean, 2 the checkpoint disagrees with its config (or has structural problems),
1 it cannot be read at all.
"""
from __future__ import annotations

import argparse
import json
import sys

from ..checkpoint import CheckpointError
from ..checkpoint.inspect import inspect_checkpoint, render_inspect
from ..config import ConfigError


def register(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "inspect", help="summarise a checkpoint (formats, bytes per layer/kind, missing/unexpected keys)",
        description="Read only safetensors headers and report config, weight formats, bytes per layer and "
                    "component kind, and missing / unexpected / mis-shaped tensors against the config.")
    p.add_argument("path", help="checkpoint directory, model.safetensors.index.json, or a .safetensors file")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--config", default=None, help="config.json to compare against instead of the checkpoint's")
    p.add_argument("--limit", type=int, default=50, help="max names listed per category (default 50)")
    p.set_defaults(func=run)
    return p


def run(args) -> int:
    try:
        rep = inspect_checkpoint(args.path, config=args.config, limit=args.limit)
    except (CheckpointError, ConfigError) as e:
        print(f"dsv4lab inspect: {e}", file=sys.stderr)
        return 1
    if args.json:
        json.dump(rep, sys.stdout, indent=1)
        sys.stdout.write("\n")
    else:
        print(render_inspect(rep))
    return 0 if rep["ok"] else 2
