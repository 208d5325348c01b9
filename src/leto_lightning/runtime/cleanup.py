"""``leto cleanup``: free retained memory that outlived its job.

Retained memory outlives trainers by design, and ``leto launch`` frees its job's segments when
the job ends -- even after SIGINT/SIGTERM. Only an agent that was itself SIGKILLed (or a
machine-level kill of the whole process tree) leaves ``/dev/shm/leto-<job_id>-*`` behind. This
command finds those segments and removes them, refusing while anything still uses them:

- ``leto cleanup RUN_DIR ...``: the jobs named in each run directory's ``events.jsonl``
  (``job_started`` / ``fallback_checkpoint`` carry the job id), once their agent is gone, and
  the CUDA state managers listening in it (their device memory);
- ``leto cleanup --job JOB_ID``: one job;
- ``leto cleanup --list``: every job with segments here: size, and which processes map it.

A segment some process still maps (``/proc/<pid>/maps``) is never removed without ``--force``.
Only your own segments are candidates, ``--force`` included: another user's processes are
invisible to you (their ``/proc/<pid>/maps`` is unreadable), so their live memory would look free.
"""

from __future__ import annotations

import argparse
import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field

from ..console import say
from ..errors import ConfigurationError
from ..retained.shm import SEGMENT_PREFIX, SHM_DIR, list_segments, unlink_segment
from .event_types import JobStarted
from .events import iter_typed_events
from .procs_state import is_alive


@dataclass
class RetainedJob:
    """The segments of one job id in /dev/shm, and who maps them."""

    job_id: str
    segments: list[str] = field(default_factory=list)
    nbytes: int = 0
    users: set[int] = field(default_factory=set)  # pids mapping any of its segments
    owner: int = -1  # uid owning its segments (the first one seen)


_OWNER_SUFFIX = re.compile(r"-(?:r|node)\d+-[^-]+$")  # "-r<rank>-<what>" / "-node<k>-<what>" (retained/spec.py)


def job_of(segment: str) -> str:
    """``leto-<job_id>-<parts>`` -> ``<job_id>``; a job id may contain '-' (a ``LETO_JOB_PREFIX``
    with one): what follows it is the rank's or node's part and the segment's role."""
    rest = segment[len(SEGMENT_PREFIX):]
    owner = _OWNER_SUFFIX.search(rest)
    return rest[:owner.start()] if owner else rest.split("-", 1)[0]


def retained_jobs(others: dict[str, RetainedJob] | None = None) -> dict[str, RetainedJob]:
    """Every job with segments of this user in /dev/shm, with sizes and the pids that map them.
    Jobs whose segments belong to another user go to ``others`` (if given), never into the result."""
    jobs: dict[str, RetainedJob] = {}
    me = os.geteuid()
    for name in list_segments():
        try:
            st = os.stat(os.path.join(SHM_DIR, name))
        except FileNotFoundError:  # freed meanwhile
            continue
        into = jobs if st.st_uid == me else others
        if into is None:
            continue
        job = into.setdefault(job_of(name), RetainedJob(job_of(name), owner=st.st_uid))
        job.segments.append(name)
        job.nbytes += st.st_size
    for pid, job_id in _mappings():
        if job_id in jobs:
            jobs[job_id].users.add(pid)
    return jobs


def _mappings() -> list[tuple[int, str]]:
    """(pid, job id) for every process of this user that maps a Leto segment."""
    out: list[tuple[int, str]] = []
    marker = os.path.join(SHM_DIR, SEGMENT_PREFIX)
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/maps") as f:
                found = {job_of(line.split(SHM_DIR + "/", 1)[1].split()[0]) for line in f if marker in line}
        except OSError:  # gone, or another user's
            continue
        out.extend((int(entry), job) for job in found)
    return out


def jobs_in_run_dir(run_dir: str) -> tuple[list[str], list[int]]:
    """(job ids, agent pids) named in a run directory's event log."""
    job_ids, agents = [], []
    try:
        events = list(iter_typed_events(run_dir))
    except PermissionError:
        raise ConfigurationError(f"{run_dir}: its events.jsonl is not readable by you: run `leto cleanup` as the "
                                 "job's owner") from None
    for event in events:
        if not isinstance(event, JobStarted):
            continue
        if event.job_id and event.job_id not in job_ids:
            job_ids.append(event.job_id)
        if event.pid:
            agents.append(int(event.pid))
    if not job_ids:
        raise ConfigurationError(f"{run_dir}: no job id in its events.jsonl (is it a `leto launch` run directory?)")
    return job_ids, agents


def free(job_ids: list[str], force: bool = False, dry_run: bool = False,
         out: Callable[[str], object] = say) -> int:
    """Remove the segments of ``job_ids``; returns 1 if something was refused, else 0."""
    others: dict[str, RetainedJob] = {}
    jobs, refused = retained_jobs(others), 0
    for job_id in job_ids:
        job = jobs.get(job_id)
        if job is None and job_id in others:  # --force too: whose processes map it is invisible to us
            out(f"{job_id}: its {len(others[job_id].segments)} segment(s) belong to uid {others[job_id].owner}, not "
                f"to you (uid {os.geteuid()}); not freed (the owner runs `leto cleanup`)")
            refused = 1
            continue
        if job is None:
            out(f"{job_id}: no retained memory left")
            continue
        if job.users and not force:
            out(f"{job_id}: in use by pid(s) {sorted(job.users)}; not freed (stop them first, or --force)")
            refused = 1
            continue
        verb = "would free" if dry_run else "freed"
        if not dry_run:
            try:
                for name in job.segments:
                    unlink_segment(name)
            except PermissionError as exc:  # e.g. /dev/shm's sticky bit
                out(f"{job_id}: cannot remove {exc.filename or 'a segment'}: permission denied; not freed")
                refused = 1
                continue
        out(f"{job_id}: {verb} {len(job.segments)} segment(s), {job.nbytes / 2**20:.1f} MiB")
    return refused


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "cleanup", help="free retained memory left behind by a job whose agent was killed",
        description=("Free /dev/shm/leto-<job_id>-* segments that outlived their job: `leto launch` frees them "
                     "when the job ends, but not if the agent itself was SIGKILLed. Segments that a process "
                     "still maps are never freed without --force."))
    p.add_argument("run_dirs", nargs="*", metavar="RUN_DIR", help="run directories of `leto launch` jobs")
    p.add_argument("--job", action="append", default=[], metavar="JOB_ID", help="a job id (repeatable)")
    p.add_argument("--list", action="store_true", help="list the jobs that hold retained memory here")
    p.add_argument("--dry-run", action="store_true", help="say what would be freed, free nothing")
    p.add_argument("--force", action="store_true", help="free even segments that a process still maps")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.list:
        return _list()
    if not args.run_dirs and not args.job:
        raise ConfigurationError("name RUN_DIRs or --job JOB_ID (or --list)")
    job_ids = list(args.job)
    for run_dir in args.run_dirs:
        ids, agents = jobs_in_run_dir(run_dir)
        live = [pid for pid in agents if is_alive(pid)]
        if live and not args.force:
            say(f"{run_dir}: its agent (pid {live}) is still running; it frees its memory when the job ends")
            return 1
        job_ids += [j for j in ids if j not in job_ids]
        if not args.dry_run:  # the CUDA state managers it left: their device memory goes with them
            from .state_managers import stop_orphans

            for socket in stop_orphans(run_dir):
                say(f"{run_dir}: stopped the CUDA state manager at {socket} (its device memory freed)")
    return free(job_ids, force=args.force, dry_run=args.dry_run)


def _list() -> int:
    others: dict[str, RetainedJob] = {}
    jobs = retained_jobs(others)
    if others:
        say(f"({len(others)} job(s) of other users not shown: only their owners can free them)")
    if not jobs:
        say("no Leto retained memory of yours in " + SHM_DIR)
        return 0
    say(f"{'job id':<24} {'segments':>8} {'MiB':>9}  mapped by")
    for job in sorted(jobs.values(), key=lambda j: j.job_id):
        users = ", ".join(str(p) for p in sorted(job.users)) or "nobody"
        say(f"{job.job_id:<24} {len(job.segments):>8} {job.nbytes / 2**20:>9.1f}  {users}")
    return 0
