"""What the kernel says of a process, by pid (``/proc``): for the agent, its trainers and tests."""

from __future__ import annotations


def process_state(pid: int) -> str | None:
    """The kernel's one-letter state of ``pid`` (R, S, D, T, Z, ...), None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def is_alive(pid: int) -> bool:
    """Running or stopped -- not reaped and not a zombie."""
    return process_state(pid) not in (None, "Z")
