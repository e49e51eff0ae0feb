"""Command-line subcommands of ``python -m dsv4lab``.

Each subcommand lives in ``dsv4lab/cli/<name>_cmd.py`` and exposes::

    def register(subparsers) -> argparse.ArgumentParser:
        p = subparsers.add_parser("name", help="...")
        p.add_argument(...)
        p.set_defaults(func=run)          # run(args) -> int exit status (None means 0)
        return p

To add one, append its module path to :data:`COMMAND_MODULES`. A module that fails to import
does not break the other commands: it is registered as a stub that reports the import error.
"""
from __future__ import annotations

import argparse
import importlib

COMMAND_MODULES: list[str] = [
    "dsv4lab.cli.inspect_cmd",
    "dsv4lab.cli.plan_cmd",
    "dsv4lab.cli.bugzoo_cmd",
    "dsv4lab.cli.report_cmd",
    "dsv4lab.cli.decode_check_cmd",
    "dsv4lab.cli.syncs_cmd",
]


def _stub(name: str, err: BaseException):
    def run(args) -> int:
        import sys

        print(f"dsv4lab: command module {name} failed to import: {type(err).__name__}: {err}", file=sys.stderr)
        return 1

    return run


def register_all(subparsers) -> list[str]:
    """Register every command module's subcommand; returns the module names that failed to import."""
    failed = []
    for mod_name in dict.fromkeys(COMMAND_MODULES):  # listed twice: registered once
        short = mod_name.rsplit(".", 1)[-1].removesuffix("_cmd").replace("_", "-")
        try:
            mod = importlib.import_module(mod_name)
        except Exception as e:  # noqa: BLE001 - one broken command must not hide the others
            p = subparsers.add_parser(short, help=f"(unavailable: {type(e).__name__})")
            p.set_defaults(func=_stub(mod_name, e))
            failed.append(mod_name)
            continue
        try:
            mod.register(subparsers)
        except Exception as e:  # noqa: BLE001
            if short not in subparsers.choices:
                p = subparsers.add_parser(short, help=f"(unavailable: {type(e).__name__})")
                p.set_defaults(func=_stub(mod_name, e))
            failed.append(mod_name)
    return failed


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m dsv4lab",
                                     description="dsv4lab: DeepSeek-V4 inference research workbench")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    register_all(sub)
    return parser
