"""``python -m dsv4lab report --out reports [--model PATH] [--device cpu] [--only NAME]``: run
the triage notebooks with papermill into executed notebooks, offline HTML and ``metrics.json``.
``--bless METRICS_JSON`` instead makes a report's metrics the regression baselines.

Exit status: 0 every notebook ran (the nightly regression notebook fails when a metric
regressed), 1 otherwise.
"""
from __future__ import annotations

import argparse
import json

from ..triage.regression import bless
from ..triage.report import run_report


def build(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument("--out", default="reports", help="output directory (default: reports)")
    p.add_argument("--model", default=None, help="checkpoint path (default: the embedded model data/tiny-dsv4)")
    p.add_argument("--device", default="cpu", help="device for the model (default: cpu)")
    p.add_argument("--only", action="append", default=None,
                   help="run only this notebook (name, stem or number; repeatable)")
    p.add_argument("-p", "--param", action="append", default=[], metavar="NAME=VALUE",
                   help="extra notebook parameter (VALUE parsed as JSON when it can be), e.g. -p BUG='\"sink_scaled\"'")
    p.add_argument("--no-html", action="store_true", help="skip the HTML export")
    p.add_argument("--bless", metavar="METRICS_JSON", default=None,
                   help="copy this report metrics.json into data/baselines/ (new regression baselines) and exit")
    p.set_defaults(func=run)
    return p


def register(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("report", help="run the triage notebooks (papermill) into an offline HTML report + metrics",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    return build(p)


def _params(items) -> dict:
    out = {}
    for it in items:
        k, _, v = it.partition("=")
        try:
            out[k] = json.loads(v)
        except ValueError:
            out[k] = v
    return out


def run(args) -> int:
    if args.bless:
        print(f"blessed {args.bless} -> {bless(args.bless)}")
        return 0

    s = run_report(args.out, model=args.model, device=args.device, only=args.only, parameters=_params(args.param),
                   html_export=not args.no_html)
    return 0 if s["ok"] else 1
