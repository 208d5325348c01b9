"""Page work shared between the updating thread and one helper thread.

Why: the passes a chunk transaction adds to the optimizer's math (undo copy, checksums) are
ISA-L calls and torch copies that release the GIL, and on a CPU the math itself runs on
``torch.get_num_threads()`` threads -- often one, while the machine has more cores. A helper
thread takes items of a phase's work, so those passes use a second core.

Crash consistency does not depend on it: the caller submits only work that belongs to one
protocol step (copies of one undo, checksums of pages the math already finished) and waits for
all of it before the step's mark; a SIGKILL kills both threads, leaving the same kind of state as
a kill inside that step on one thread. The caller keeps every fault point on its own thread.

The helper never makes the caller wait for work it has not started: ``Job.wait`` runs every item
nobody claimed on the calling thread, then waits only for the item the helper is running. A
helper descheduled in the middle of an item still makes the caller wait for it, so on a machine
whose run queue is already full (1-minute load average at least the CPUs this process may use,
checked once a second) the default ``PageWork`` runs everything on the caller: measured on a
shared 2-core machine at load 4-7, the helper made the update 4-9 % slower there.
"""

from __future__ import annotations

import itertools
import os
import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any


class Job:
    """Items of one submitted piece of work; ``wait()`` returns their results in order."""

    def __init__(self, fn: Callable[[Any], Any], items: Sequence[Any]) -> None:
        self.fn, self.items = fn, items
        self.results: list[Any] = [None] * len(items)
        self._next = itertools.count()  # next() is atomic under the GIL: each item runs once
        self._lock = threading.Lock()
        self._helper_in = False  # the helper claimed this job (it may be running an item)
        self._closed = False  # the caller is done: a helper arriving later does nothing
        self._helper_out = threading.Event()
        self._stop = False
        self._error: BaseException | None = None

    def _drain(self) -> None:
        n = len(self.items)
        while not self._stop:
            i = next(self._next)
            if i >= n:
                return
            self.results[i] = self.fn(self.items[i])

    def help(self) -> None:
        """The helper thread's part: claim the job unless the caller finished it already."""
        with self._lock:
            if self._closed:
                return
            self._helper_in = True
        try:
            self._drain()
        except BaseException as exc:  # handed to the caller, which re-raises it
            self._error, self._stop = exc, True
        finally:
            self._helper_out.set()

    def wait(self) -> list[Any]:
        """Run what is left on this thread, wait for the helper's item, return all results."""
        try:
            self._drain()
        except BaseException:
            self._stop = True
            self._close()
            raise
        self._close()
        if self._error is not None:
            raise self._error
        return self.results

    def _close(self) -> None:
        with self._lock:
            self._closed = True
            claimed = self._helper_in
        if claimed:
            self._helper_out.wait()


class PageWork:
    """Submits jobs to one lazily started helper thread (per process; none on one CPU).

    ``helpers=None``: one helper where this process may run on two or more CPUs, used only while
    the machine has a CPU to spare (module doc); ``helpers=0`` or ``1``: exactly that."""

    def __init__(self, helpers: int | None = None) -> None:
        self._cpus = _usable_cpus()
        self.helpers = (1 if self._cpus >= 2 else 0) if helpers is None else max(0, min(int(helpers), 1))
        self._adaptive = helpers is None
        self._queue: queue.SimpleQueue[Job] | None = None
        self._pid = -1
        self._checked_at = -1.0
        self._spare = True

    def submit(self, fn: Callable[[Any], Any], items: Sequence[Any]) -> Job:
        """Start ``fn`` over ``items`` (the helper may begin at once); ``wait()`` finishes it."""
        job = Job(fn, items)
        if len(items) > 0 and self.active():
            self._helper_queue().put(job)
        return job

    def active(self) -> bool:
        """Whether a job submitted now may run on the helper too."""
        return bool(self.helpers) and self.spare_cpu()

    def spare_cpu(self) -> bool:
        """Whether the helper may take work now: always unless adaptive; then while the 1-minute
        load average is below the CPUs this process may use (read at most once a second)."""
        if not self._adaptive:
            return True
        now = time.monotonic()
        if now - self._checked_at >= 1.0:
            self._checked_at = now
            try:
                self._spare = os.getloadavg()[0] < self._cpus
            except OSError:  # unavailable: assume the CPUs are there
                self._spare = True
        return self._spare

    def run(self, fn: Callable[[Any], Any], items: Sequence[Any]) -> list[Any]:
        """``fn`` over ``items`` on this thread and the helper together."""
        return self.submit(fn, items).wait()

    def _helper_queue(self) -> queue.SimpleQueue[Job]:
        if self._queue is None or self._pid != os.getpid():  # none yet, or a forked child (no thread)
            self._queue, self._pid = queue.SimpleQueue(), os.getpid()
            threading.Thread(target=_serve, args=(self._queue,), name="leto-page-work", daemon=True).start()
        return self._queue


def _serve(jobs: queue.SimpleQueue[Job]) -> None:
    while True:
        jobs.get().help()


def _usable_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1


SHARED = PageWork()
"""The process's page work (one helper thread for every store of the process)."""
