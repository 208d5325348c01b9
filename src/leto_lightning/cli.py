"""The ``leto`` command line: one sub-command per module, each registering its own parser.

Each entry of ``_SUBCOMMANDS`` names a module exposing ``add_parser(subparsers)``; the parser it
adds must set ``func`` (a callable taking the parsed args and returning an exit code).
Modules are imported lazily so ``leto --help`` stays fast and one broken part does not
break the others.

Errors: an expected failure (a bad value, a busy port, an unusable run dir, a full disk --
``LetoError``, ``ValueError``, ``OSError``) is one line on stderr naming what, which value and
what to do, and a non-zero exit (2: fix the input; 1: the environment failed). Anything else is
a bug and keeps its traceback; ``leto --debug ...`` or ``LETO_DEBUG=1`` shows the traceback of
expected failures too.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from typing import NoReturn

from .console import error
from .env import DEBUG
from .errors import LetoError

EXPECTED = (LetoError, ValueError, OSError)  # what the top level prints as one line

_SUBCOMMANDS = {
    "cleanup": "leto_lightning.runtime.cleanup",
    "demo": "leto_lightning.demos",
    "launch": "leto_lightning.runtime.launch",
    "simulate": "leto_lightning.sim.cli",
    "train": "leto_lightning.train",
}


class OneLineParser(argparse.ArgumentParser):
    """argparse, but a bad argument is one line (what, which value) pointing at ``--help``."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog="leto",
        description="leto-lightning: in-place recovery from hardware-operable failures in LLM training.",
    )
    parser.add_argument("--debug", action="store_true",
                        help="show the traceback of expected errors too (or set LETO_DEBUG=1)")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=OneLineParser)
    for module_name in _SUBCOMMANDS.values():
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:  # a part not built yet must not break the others
            if exc.name and exc.name.startswith("leto_lightning"):
                continue
            raise
        module.add_parser(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    debug = args.debug or os.environ.get(DEBUG, "") not in ("", "0")
    try:
        return int(args.func(args) or 0)
    except EXPECTED as exc:  # bad settings or environment: say which, without a traceback
        if debug:
            raise
        error(f"leto {args.command}: error: {one_line(exc)}")
        return 2 if isinstance(exc, ValueError) else 1
    except KeyboardInterrupt:
        if debug:
            raise
        error(f"leto {args.command}: interrupted")
        return 130


def one_line(exc: BaseException) -> str:
    """An exception as one line: its message (an ``OSError``: what failed on which file)."""
    if isinstance(exc, OSError) and not isinstance(exc, LetoError) and exc.strerror:
        text = f"{exc.strerror}: {exc.filename!r}" if exc.filename else exc.strerror
    else:
        text = str(exc) or type(exc).__name__
    return " ".join(text.split())


if __name__ == "__main__":
    sys.exit(main())
