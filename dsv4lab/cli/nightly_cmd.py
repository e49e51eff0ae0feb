"""``python -m dsv4lab nightly --history DIR [--model PATH] [--reference PATH] [--policy MODE]
[--inject BUG [--inject-layers N ...]] [--device cpu] [--keep-daily 30] [--keep-weekly 52]``:
the regression notebook against the rolling baseline of the same model + policy, stored in DIR
by date + commit + model + policy with a manifest; failing tensors of a regression kept
(bounded by --max-failing-mb); old runs pruned; DIR/index.html redrawn with the trends.

Exit status: 0 clean (or nothing to compare yet: a model's first run starts its history),
1 regressed (one line naming the first diverging hook point and its component),
2 bad arguments, 3 the run failed before it could be judged (the line says why).
"""
from __future__ import annotations

import argparse
import sys

from ..triage.failing import DEFAULT_BUDGET
from ..triage.nightly import run_nightly
from ..triage.regression import POLICY
from .args import non_negative_int, positive_int


def register(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("nightly", help="nightly regression with history: store, compare, keep failing tensors, prune",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--history", required=True, help="directory the runs are stored in (created when absent)")
    p.add_argument("--model", default=None, help="checkpoint path (default: the embedded model data/tiny-dsv4)")
    p.add_argument("--reference", default=None,
                   help="checkpoint of the original weights (official FP8+MXFP4 or BF16) the per-layer metrics compare with "
                        "(default: the weights the model was quantised from when known: the embedded model for "
                        "tiny-nvfp4 or an export of quantize_checkpoint; else the model's own weights dequantised)")
    p.add_argument("--policy", default=POLICY, help=f"the model under test's precision policy: a mode word or a JSON "
                                                     f"mapping (default: {POLICY})")
    p.add_argument("--inject", default=None, metavar="BUG", help="inject a zoo bug (python -m dsv4lab bugzoo --list)")
    p.add_argument("--inject-layers", type=non_negative_int, nargs="+", default=None, metavar="N",
                   help="the layers to inject it into (default: every layer it applies to)")
    p.add_argument("--device", default="cpu", help="device for the model (default: cpu)")
    p.add_argument("--keep-daily", type=non_negative_int, default=30, metavar="DAYS",
                   help="keep every run of the last DAYS days (default: 30)")
    p.add_argument("--keep-weekly", type=non_negative_int, default=52, metavar="WEEKS",
                   help="then one run per ISO week for WEEKS weeks (default: 52)")
    p.add_argument("--max-failing-mb", type=positive_int, default=DEFAULT_BUDGET >> 20, metavar="MB",
                   help=f"bound on a regression's kept tensors, uncompressed (default: {DEFAULT_BUDGET >> 20})")
    p.set_defaults(func=run)
    return p


def run(args) -> int:
    r = run_nightly(args.history, model=args.model, reference=args.reference, device=args.device, policy=args.policy,
                    inject=args.inject, inject_layers=args.inject_layers, keep_daily=args.keep_daily,
                    keep_weekly=args.keep_weekly, failing_budget=args.max_failing_mb << 20, argv=sys.argv,
                    log=lambda *a: print(*a, file=sys.stderr, flush=True))
    print(r.line)
    return r.exit_code
