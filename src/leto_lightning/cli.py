"""The ``leto`` command line: one sub-command per module, each registering its own parser.

Each entry of ``_SUBCOMMANDS`` names a module exposing ``add_parser(subparsers)``; the parser it
adds must set ``func`` (a callable taking the parsed args and returning an exit code).
Modules are imported lazily so ``leto --help`` stays fast and one broken part does not
break the others.
"""

from __future__ import annotations

import argparse
import importlib
import sys

_SUBCOMMANDS = {
    "cleanup": "leto_lightning.runtime.cleanup",
    "demo": "leto_lightning.demo",
    "launch": "leto_lightning.runtime.launch",
    "simulate": "leto_lightning.sim.cli",
    "train": "leto_lightning.train",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="leto",
        description="leto-lightning: in-place recovery from hardware-operable failures in LLM training.",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, module_name in _SUBCOMMANDS.items():
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
    try:
        return int(args.func(args) or 0)
    except ValueError as exc:  # bad settings: say which, without a traceback
        print(f"leto {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
