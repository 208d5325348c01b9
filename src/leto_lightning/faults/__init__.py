"""Fault injection: named points in the code, and the injectors tests, benchmarks and demos use.

- ``points``: ``point(name, **context)`` on the recovery-critical path, ``set_hook`` to decide
  what happens there (a leaf every layer may import).
- ``injector``: ``FaultInjector``, the hook a launched trainer installs from ``LETO_FAULTS``.
- ``plan``: ``hof_faults``, the schedule of HOFs of ``leto train`` and ``leto demo``.

The harnesses that run work and kill it (fork + SIGKILL, launched jobs, the deterministic
scenario) live in ``leto_lightning.testing``.
"""

from .injector import FaultInjector, FaultTarget
from .plan import hof_faults
from .points import point, set_hook

__all__ = ["FaultInjector", "FaultTarget", "hof_faults", "point", "set_hook"]
