"""The ``asyncplane`` command.

asyncplane probe --store PATH --scenario concurrent-queue ...   (see asyncplane.probe)
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from asyncplane import __version__, probe

__all__ = ("main",)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``asyncplane`` command; return its exit status."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] == "probe":
        # The probe owns its options; hand them over untouched.
        return probe.main(args[1:], prog="asyncplane probe")
    parser = argparse.ArgumentParser(
        prog="asyncplane", description="Operate and qualify asyncplane stores."
    )
    parser.add_argument("--version", action="version", version=f"asyncplane {__version__}")
    verbs = parser.add_subparsers(dest="verb", metavar="VERB")
    verbs.add_parser("probe", help="qualify a disk: separate processes, exact counts")
    parser.parse_args(args)
    parser.print_help()
    return 2


if __name__ == "__main__":
    sys.exit(main())
