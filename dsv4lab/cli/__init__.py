"""Command-line subcommands of ``python -m dsv4lab``.

Each subcommand lives in ``dsv4lab/cli/<name>_cmd.py`` and exposes::

    def register(subparsers) -> argparse.ArgumentParser:
        p = subparsers.add_parser("name", help="...")
        p.add_argument(...)
        p.set_defaults(func=run)          # run(args) -> int exit status (None means 0)
        return p

To add one, append its module path to :data:`COMMAND_MODULES`. A module that fails to import
does not break the other commands: it is registered as a stub that reports the import error.
:func:`dispatch` runs the chosen command: a user-facing error (:data:`USER_ERRORS`: bad input,
unreadable checkpoint, unknown name) becomes ONE line ``dsv4lab <cmd>: <message>`` on stderr and
exit status 2, never a traceback; the commands themselves need no try/except for them.
"""
from __future__ import annotations

import argparse
import importlib
import sys

import dsv4lab

from ..bugzoo import UnknownBugError
from ..checkpoint.errors import CheckpointError, DeviceUnavailableError
from ..config import ConfigError
from ..model.validate import InputError
from ..plan import PlanError
from ..triage.report import ReportError
from .args import OneLineParser

# errors whose message is written for the user (argument, value, fix): printed, not traced back
USER_ERRORS: tuple[type[BaseException], ...] = (CheckpointError, ConfigError, DeviceUnavailableError, InputError,
                                                PlanError, ReportError, UnknownBugError, FileNotFoundError)

COMMAND_MODULES: list[str] = [
    "dsv4lab.cli.inspect_cmd",
    "dsv4lab.cli.plan_cmd",
    "dsv4lab.cli.bugzoo_cmd",
    "dsv4lab.cli.report_cmd",
    "dsv4lab.cli.decode_check_cmd",
    "dsv4lab.cli.syncs_cmd",
    "dsv4lab.cli.synth_cmd",
    "dsv4lab.cli.compare_dump_cmd",
    "dsv4lab.cli.nightly_cmd",
]


def _stub(name: str, err: BaseException):
    def run(args) -> int:
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
    parser = OneLineParser(prog="python -m dsv4lab",
                           description="dsv4lab: DeepSeek-V4 inference research workbench")
    parser.add_argument("--version", action="version", version=f"dsv4lab {version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=OneLineParser)
    sub.required = True
    register_all(sub)
    return parser


def version() -> str:
    """The installed package's version (package metadata), ``0+unknown`` when not installed."""
    return dsv4lab.__version__


def one_line(err: BaseException) -> str:
    """The error's message on one line (a KeyError's without the quotes repr adds)."""
    text = err.args[0] if isinstance(err, KeyError) and err.args else str(err)
    return " ".join(str(text).split()) or type(err).__name__


def dispatch(args: argparse.Namespace) -> int:
    """Run the parsed command; a :data:`USER_ERRORS` error is one stderr line and exit status 2."""
    try:
        rc = args.func(args)
    except USER_ERRORS as e:
        print(f"dsv4lab {args.command}: {one_line(e)}", file=sys.stderr)
        return 2
    return 0 if rc is None else int(rc)
