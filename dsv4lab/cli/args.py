"""Argument types and the parser class every subcommand shares: a bad argument is ONE line
``dsv4lab <cmd>: <message>`` on stderr and exit status 2, as for errors raised while running."""
from __future__ import annotations

import argparse
import sys


def _int_at_least(text: str, minimum: int, what: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
    if n < minimum:
        raise argparse.ArgumentTypeError(f"expected {what}, got {n}")
    return n


def positive_int(text: str) -> int:
    """argparse type: an int >= 1 (``--steps -1`` is refused before anything runs)."""
    return _int_at_least(text, 1, "a positive integer")


def non_negative_int(text: str) -> int:
    """argparse type: an int >= 0 (layer indices, retention counts)."""
    return _int_at_least(text, 0, "an integer >= 0")


class OneLineParser(argparse.ArgumentParser):
    """ArgumentParser whose usage errors are one line naming the command (no usage block)."""

    def error(self, message: str):
        words = self.prog.split()
        cmd = f" {words[-1]}" if len(words) > 1 and words[-1] != "dsv4lab" else ""
        print(f"dsv4lab{cmd}: {message} (see --help)", file=sys.stderr)
        sys.exit(2)
