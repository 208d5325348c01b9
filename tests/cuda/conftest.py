"""tests/cuda spawn processes (CUDA and ``fork`` do not mix).

Spawning starts multiprocessing's resource-tracker process on first use, and it lives as long
as the test session: start it now, at collection, so the suite's per-test leak check (no child
process left behind) does not count it against whichever test spawns first.
"""

from __future__ import annotations

from multiprocessing import resource_tracker

resource_tracker.ensure_running()
