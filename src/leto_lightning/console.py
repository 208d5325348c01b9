"""User-facing lines: what the ``leto`` commands, the launcher and the demo tell the person who
ran them, on stdout (or the stream an agent was given), flushed at once.

Library code logs through named loggers (``logging.getLogger(__name__)``); these lines are the
exception the user asked for by running a command. Flushed, because they interleave with the
output of child processes (trainers, shadows) on the same terminal. ``notice`` prefixes
``[leto]``: that marks Leto's own lines among the ranks' output (the demo shows only those).

A leaf module: standard library only, so every layer may use it.
"""

from __future__ import annotations

import sys
from typing import TextIO

PREFIX = "[leto] "


def say(text: str, out: TextIO | None = None) -> None:
    """One user-facing line (or block) on ``out`` (default: the current ``sys.stdout``), flushed."""
    print(text, file=out if out is not None else sys.stdout, flush=True)


def notice(text: str, out: TextIO | None = None) -> None:
    """A line from Leto itself among the ranks' output: ``[leto] text``."""
    say(PREFIX + text, out)


def error(text: str) -> None:
    """A one-line failure message on stderr (the ``leto`` command's ``error: ...`` lines)."""
    say(text, sys.stderr)
