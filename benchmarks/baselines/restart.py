"""Full-restart baselines on the same harness as Leto (docs/design.md section 2.7).

A torchrun-style driver: it starts the ranks of ``ddp_train.py`` as fresh ``python``
processes (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, TORCHELASTIC_USE_AGENT_STORE=True in
the environment: ``env://`` on a TCPStore the driver hosts, as torchrun's agent does), polls
them, and when one dies it does what torchrun and Lightning's launcher do -- kills every other
rank -- and starts the whole group again; the new processes resume from the last checkpoint
and recompute the iterations since it.

Modes (``--mode``):

* ``disk``     checkpoint-restart: ``torch.save`` every K iterations, ``torch.load`` on restart;
* ``shm``      Gemini-style: the checkpoint lives in host memory (POSIX shared memory), so it
               survives the processes; the restart copies it back;
* ``shm-spare`` Gemini+: ``shm`` plus pre-warmed spare processes, started with the job, that
               have imported torch and built the model and optimizer and wait for a rank; the
               restart hands the ranks to them instead of starting new processes.

The driver is deliberately leaner than torchrun (favouring the baselines): it polls every
0.05 s (torchrun: ``--monitor-interval`` 0.1 s), kills the survivors with SIGKILL at once
(torchrun: SIGTERM, then up to 30 s before SIGKILL), and restarts without a rendezvous round
(torchrun: a new c10d rendezvous round); like torchrun it hosts a new TCPStore for the new
round. Gemini+ starts its next spare set right after handing the ranks to the current one, as
Leto starts its next shadow set right after a promotion (``replace_spares=False`` /
``--no-replace-spares`` turns that off).

Recovery is measured from the injected SIGKILL (stamped by the dying trainer) to the moment
every rank has completed the iteration that was interrupted again ("caught up"), with the
breakdown detect / stop / restart (process start + imports, or the hand-over to a spare) /
init (process group, model, optimizer) / load (checkpoint -> model and optimizer) /
recompute (the iterations since the checkpoint, the interrupted one included).

    python benchmarks/baselines/restart.py --mode disk --iterations 17 --fail-at 16 --sleep 0.4 --dim 256
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

from leto_lightning import new_job_id
from leto_lightning.retained.shm import list_segments, segment_name, unlink_segments

TRAINER = str(Path(__file__).with_name("ddp_train.py"))
MODES = ("disk", "shm", "shm-spare")
PHASES = ("detect", "stop", "restart", "init", "load", "recompute")


@dataclass
class Fault:
    rank: int = 1
    iteration: int = 16
    phase: str = "update"  # or "compute"


@dataclass
class RestartResult:
    mode: str
    total_s: float
    breakdown: dict[str, float]
    failed_iteration: int
    checkpoint_iteration: int
    recomputed_iterations: int  # since the checkpoint, the interrupted one included
    iteration_s: float  # median fault-free iteration time before the failure (rank 0)
    imports_s: float  # of the restart: interpreter start + import torch (0 for spares)
    pg_s: float  # of init: init_process_group (the rest is building the model and optimizer)
    losses: dict[int, dict[int, float]]  # rank -> iteration -> loss (the last value logged)
    pids: list[int] = field(default_factory=list)
    returncodes: dict[int, int | None] = field(default_factory=dict)


class RestartJob:
    def __init__(self, mode: str, run_dir: str, iterations: int, fault: Fault, dim: int = 256, sleep: float = 0.5,
                 checkpoint_every: int = 11, nproc: int = 2, poll: float = 0.05, python: str = sys.executable,
                 replace_spares: bool = True) -> None:
        if mode not in MODES:
            raise ValueError(f"mode {mode!r}: choose one of {MODES}")
        if not 0 < checkpoint_every <= fault.iteration:
            raise ValueError(f"the fault (iteration {fault.iteration}) must come after the first checkpoint "
                             f"(every {checkpoint_every} iterations)")
        if fault.iteration >= iterations:
            raise ValueError(f"--fail-at {fault.iteration} must be below --iterations {iterations}")
        self.mode, self.run_dir, self.iterations, self.fault = mode, run_dir, iterations, fault
        self.dim, self.sleep, self.k, self.nproc = dim, sleep, checkpoint_every, nproc
        self.poll, self.python = poll, python
        self.job_id = new_job_id()
        self.shm_name = segment_name(self.job_id, "gemini")
        self.replace_spares = replace_spares
        self.procs: list[subprocess.Popen] = []
        self.log = None

    # -- processes -----------------------------------------------------------------------
    def _cmd(self, gen: int, spare: bool = False) -> list[str]:
        cmd = [self.python, TRAINER, "--run-dir", self.run_dir, "--iterations", str(self.iterations),
               "--dim", str(self.dim), "--sleep", str(self.sleep), "--checkpoint-every", str(self.k),
               "--checkpoint", "disk" if self.mode == "disk" else "shm", "--shm-name", self.shm_name]
        if gen == 0 and not spare:
            cmd += ["--fail-at", str(self.fault.iteration), "--fail-rank", str(self.fault.rank),
                    "--fail-phase", self.fault.phase]
            if self.mode == "shm-spare":
                cmd += ["--wait-spares", str(self.nproc)]
        return cmd + (["--spare"] if spare else [])

    def _env(self, rank: int | None, port: int | None, gen: int) -> dict[str, str]:
        env = dict(os.environ, WORLD_SIZE=str(self.nproc), MASTER_ADDR="127.0.0.1", PYTHONUNBUFFERED="1",
                   OMP_NUM_THREADS="1", BENCH_GEN=str(gen), TORCHELASTIC_USE_AGENT_STORE="True")
        for k in ("RANK", "MASTER_PORT", "LOCAL_RANK"):
            env.pop(k, None)
        if rank is not None:
            env.update(RANK=str(rank), LOCAL_RANK=str(rank), MASTER_PORT=str(port))
        return env

    def _spawn(self, gen: int, port: int) -> list[subprocess.Popen]:
        out = [subprocess.Popen(self._cmd(gen), env=self._env(r, port, gen), stdout=self.log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL) for r in range(self.nproc)]
        self.procs += out
        return out

    def _spawn_spares(self) -> list[subprocess.Popen]:
        out = [subprocess.Popen(self._cmd(0, spare=True), env=self._env(None, None, 0), stdout=self.log,
                                stderr=subprocess.STDOUT, stdin=subprocess.PIPE, text=True) for _ in range(self.nproc)]
        self.procs += out
        return out

    def _kill(self, procs: list[subprocess.Popen]) -> None:
        """SIGKILL by pid (what torchrun ends with), then reap."""
        for p in procs:
            if p.poll() is None:
                try:
                    os.kill(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for p in procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:  # pragma: no cover - a kernel-stuck process
                pass

    # -- the job -------------------------------------------------------------------------
    def run(self, timeout: float = 300.0) -> RestartResult:
        os.makedirs(self.run_dir, exist_ok=True)
        self.log = open(os.path.join(self.run_dir, "output.log"), "w")
        marks: dict[str, float] = {}
        deadline = time.time() + timeout
        stores = []  # like torchrun's agent: the driver hosts the TCPStore, a new one for every restart round
        try:
            port = self._new_store(stores)
            spares = self._spawn_spares() if self.mode == "shm-spare" else []
            active = self._spawn(0, port)
            gen = 0
            while True:
                if time.time() > deadline:
                    raise RuntimeError(f"{self.mode}: no result within {timeout:.0f} s; see {self.run_dir}/output.log")
                codes = [p.poll() for p in active]
                if all(c == 0 for c in codes):
                    break
                if any(c is not None and c != 0 for c in codes):
                    if gen > 0:
                        raise RuntimeError(f"{self.mode}: a second failure after the restart (exit codes {codes}); "
                                           f"see {self.run_dir}/output.log")
                    marks["detect"] = time.time()
                    self._kill(active)
                    marks["stop"] = time.time()
                    gen, port = 1, self._new_store(stores)
                    if spares:
                        for rank, p in enumerate(spares):
                            p.stdin.write(json.dumps({"rank": rank, "port": port, "gen": gen}) + "\n")
                            p.stdin.flush()
                        active = spares
                        # the next spare set starts now, beside the recovering ranks (Leto starts its next
                        # shadow set the same way); it is never used here, and killed at the end
                        spares = self._spawn_spares() if self.replace_spares else []
                    else:
                        active = self._spawn(gen, port)
                time.sleep(self.poll)
            if "detect" not in marks:
                raise RuntimeError(f"{self.mode}: the injected fault never fired")
            return self._result(marks)
        finally:
            self._kill(self.procs)
            for p in self.procs:
                if p.stdin:
                    p.stdin.close()
            unlink_segments(self.job_id)
            self.log.close()
            stores.clear()  # the servers end with their objects

    @staticmethod
    def _new_store(stores: list) -> int:
        stores.append(dist.TCPStore("127.0.0.1", 0, world_size=None, is_master=True, timeout=timedelta(seconds=60),
                                    wait_for_workers=False))
        return stores[-1].port

    def _timeline(self, gen: int, rank: int) -> list[dict]:
        path = os.path.join(self.run_dir, f"timeline_g{gen}_r{rank}.jsonl")
        return [json.loads(line) for line in open(path) if line.strip()]

    def _result(self, marks: dict[str, float]) -> RestartResult:
        ranks = range(self.nproc)
        g0 = {r: self._timeline(0, r) for r in ranks}
        g1 = {r: self._timeline(1, r) for r in ranks}
        (fault,) = [e for r in ranks for e in g0[r] if e["ev"] == "fault"]
        f = fault["iteration"]

        def last(tl: dict[int, list[dict]], ev: str, **match) -> float:
            return max(next(e["t"] for e in reversed(tl[r]) if e["ev"] == ev
                            and all(e.get(k) == v for k, v in match.items())) for r in ranks)

        handed = last(g1, "go") if self.mode == "shm-spare" else last(g1, "imported")
        pg, built, loaded, caught = last(g1, "pg"), last(g1, "built"), last(g1, "loaded"), last(g1, "done", iteration=f)
        t_fail = fault["t"]
        bd = {"detect": marks["detect"] - t_fail, "stop": marks["stop"] - marks["detect"],
              "restart": handed - marks["stop"], "init": built - handed, "load": loaded - built,
              "recompute": caught - loaded}
        ckpt_it = {next(e["iteration"] for e in g1[r] if e["ev"] == "loaded") for r in ranks}
        done0 = [e["t"] for e in g0[0] if e["ev"] == "done"]
        steps = [b - a for a, b in itertools.pairwise(done0[1:])]  # skip the first (warm-up)
        imports = 0.0 if self.mode == "shm-spare" else max(
            next(e["t"] for e in g1[r] if e["ev"] == "imported") - marks["stop"] for r in ranks)
        losses = {r: {} for r in ranks}
        for tl in (g0, g1):
            for r in ranks:
                for e in tl[r]:
                    if e["ev"] == "done":
                        losses[r][e["iteration"]] = e["loss"]
        return RestartResult(
            mode=self.mode, total_s=caught - t_fail, breakdown=bd, failed_iteration=f,
            checkpoint_iteration=min(ckpt_it), recomputed_iterations=f - min(ckpt_it) + 1,
            iteration_s=statistics.median(steps) if steps else float("nan"), imports_s=imports, pg_s=pg - handed,
            losses=losses,
            pids=[p.pid for p in self.procs], returncodes={p.pid: p.returncode for p in self.procs})


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                epilog="Prints the recovery breakdown as JSON.")
    p.add_argument("--mode", choices=MODES, default="disk")
    p.add_argument("--iterations", type=int, default=17)
    p.add_argument("--fail-at", type=int, default=16)
    p.add_argument("--fail-rank", type=int, default=1)
    p.add_argument("--fail-phase", choices=("compute", "update"), default="update")
    p.add_argument("--checkpoint-every", type=int, default=11)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--sleep", type=float, default=0.4)
    p.add_argument("--run-dir", default=None, help="default: a temporary directory")
    p.add_argument("--no-replace-spares", action="store_true", help="shm-spare: no new spares after the restart")
    args = p.parse_args()
    run_dir = args.run_dir or tempfile.mkdtemp(prefix="leto-restart-")
    before = set(list_segments())
    job = RestartJob(args.mode, run_dir, args.iterations, Fault(args.fail_rank, args.fail_at, args.fail_phase),
                     dim=args.dim, sleep=args.sleep, checkpoint_every=args.checkpoint_every,
                     replace_spares=not args.no_replace_spares)
    r = job.run()
    print(json.dumps({"mode": r.mode, "total_s": round(r.total_s, 3),
                      "breakdown": {k: round(v, 3) for k, v in r.breakdown.items()},
                      "checkpoint_iteration": r.checkpoint_iteration, "failed_iteration": r.failed_iteration,
                      "recomputed_iterations": r.recomputed_iterations, "iteration_s": round(r.iteration_s, 3),
                      "run_dir": run_dir,
                      "segments_left": sorted(set(list_segments(segment_name(job.job_id, ""))) - before)},
                     indent=1))


if __name__ == "__main__":
    main()
