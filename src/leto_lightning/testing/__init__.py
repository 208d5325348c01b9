"""Test harnesses for jobs on retained state (as ``torch.testing`` is for torch).

Not part of the library's core: nothing in ``retained``, ``protection``, ``updater``, ``runtime``
or ``integrations`` imports this package. It serves the tests, the benchmarks and the demos.

- ``crash``: run work in a forked child and SIGKILL it at a chosen injection point
  (``faults.points``) or at a random time.
- ``launched``: a ``leto launch`` job run as a real subprocess, and what it left behind.
- ``scenario``: a small, fully deterministic multi-rank training job on retained state with a
  plain ``torch.optim`` reference run in lockstep.

Submodules are imported on demand (``launched`` and ``scenario`` import torch).
"""

__all__ = ["crash", "launched", "scenario"]
