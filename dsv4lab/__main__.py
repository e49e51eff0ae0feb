"""``python -m dsv4lab COMMAND ...``: dispatch to the subcommands listed in :mod:`dsv4lab.cli`."""
from __future__ import annotations

import sys

from .cli import build_parser, dispatch


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    return dispatch(args)


if __name__ == "__main__":
    sys.exit(main())
