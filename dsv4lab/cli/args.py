"""Argument types and the parser class every subcommand shares: a bad argument is ONE line
``dsv4lab <cmd>: <message>`` on stderr and exit status 2, as for errors raised while running."""
from __future__ import annotations

import argparse
import sys


def positive_int(text: str) -> int:
    """argparse type: an int >= 1 (``--steps -1`` is refused before anything runs)."""
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {n}")
    return n


class OneLineParser(argparse.ArgumentParser):
    """ArgumentParser whose usage errors are one line naming the command (no usage block)."""

    def error(self, message: str):
        words = self.prog.split()
        cmd = f" {words[-1]}" if len(words) > 1 and words[-1] != "dsv4lab" else ""
        print(f"dsv4lab{cmd}: {message} (see --help)", file=sys.stderr)
        sys.exit(2)
