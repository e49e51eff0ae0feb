"""``python -m dsv4lab COMMAND ...``: dispatch to the subcommands listed in :mod:`dsv4lab.cli`."""
from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    from .cli import build_parser

    parser = build_parser()
    args = parser.parse_args(argv)
    rc = args.func(args)
    return 0 if rc is None else int(rc)


if __name__ == "__main__":
    sys.exit(main())
