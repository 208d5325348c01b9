"""The device check: one call on one GPU verifies the CUDA path end to end and measures it.

    python benchmarks/gpu_check.py [--json results.json] [--logs DIR] [--skip-tests] [--params 1e9]
    python benchmarks/gpu_check.py --cpu-jobs       # the job section on CPU (gloo): checks this script

On a machine without a usable CUDA device it prints ``no CUDA device: skipped`` and exits 0.
With one it runs, the jobs in the background while the rest measures:

1. the CUDA tests (``pytest -m cuda tests/cuda tests/protection/test_staging.py``, in parallel
   when pytest-xdist is there);
2. jobs on the one GPU, each against the same script without Leto on the same GPU, final
   weights and optimizer state compared with ``torch.equal`` (``benchmarks/gpu_jobs``):
   Lightning ``strategy="leto"`` under ``leto launch`` (1 rank + its shadow, NCCL) with 3
   SIGKILLs mid-update vs ``"ddp"``; ``LetoAccelerator`` the same vs plain ``Accelerator``; two
   node agents on loopback sharing the GPU over gloo (NCCL refuses two ranks on one device) with
   3 SIGKILLs vs two ``"ddp"`` ranks; the Lightning job with one failure declared not a HOF
   (a checkpoint restart) -- recovery time after a mid-update SIGKILL against the checkpoint
   restart of the same job;
3. CUDA IPC attach times; the update of a ~1B-parameter AdamW model (fp32) against torch's
   AdamW on the same tensors, and the memory each takes; a whole iteration of a ~1B GPT (bf16
   autocast, ~2-3 s per step) with and without Leto; the device parity engine;

and prints one table (``--json``: also as JSON; ``--logs``: every job's output and events).
Exit status 1 when a test failed or a job was not bit-identical, else 0.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
JOBS = ROOT / "benchmarks" / "gpu_jobs"
Row = tuple[str, "float | str", str]
KILLS = [(8, "chunk.math_done"), (16, "chunk.tier1_partial"), (24, "chunk.math_done")]  # (iteration, point)
STEPS = 30


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--logs", type=Path, help="copy every job's output and events here")
    parser.add_argument("--skip-tests", action="store_true", help="no pytest run")
    parser.add_argument("--skip-measure", action="store_true", help="jobs (and tests) only")
    parser.add_argument("--params", type=float, default=1e9, help="model size for the update measurement")
    parser.add_argument("--test-timeout", type=int, default=200, help="seconds for the test run")
    parser.add_argument("--job-timeout", type=int, default=300, help="seconds for the jobs")
    parser.add_argument("--cpu-jobs", action="store_true", help="run only the jobs, on the CPU (checks the script)")
    args = parser.parse_args()
    import torch

    if not args.cpu_jobs and not torch.cuda.is_available():
        why = "torch has no CUDA support" if torch.version.cuda is None else "torch sees no CUDA device"
        print(f"no CUDA device: skipped ({why}; torch {torch.__version__})")
        return 0
    work = Path(tempfile.mkdtemp(prefix="leto-gpucheck-"))
    rows: list[Row] = []
    ok = True
    jobs = Jobs(work, cpu=args.cpu_jobs)
    jobs.start()
    try:
        if not args.cpu_jobs and not args.skip_tests:
            passed, summary, seconds = run_tests(args.test_timeout)
            ok &= passed
            rows.append(("tests: pytest -m cuda", summary, f"{seconds:.0f} s"))
        if not args.cpu_jobs and not args.skip_measure:
            rows += measurements(args.params)
        job_rows, identical = jobs.finish(args.job_timeout)
        rows += job_rows
        ok &= identical
    finally:
        jobs.stop()
        if args.logs:
            jobs.copy_logs(args.logs)
        shutil.rmtree(work, ignore_errors=True)
    header = header_line(torch, ok)
    print_table(header, rows)
    if args.json:
        args.json.write_text(json.dumps({"header": header, "rows": rows}, indent=1))
    return 0 if ok else 1


def header_line(torch, ok: bool) -> str:
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "CPU"
    import accelerate
    import lightning

    return (f"{device} | torch {torch.__version__} | CUDA {torch.version.cuda} | lightning {lightning.__version__} | "
            f"accelerate {accelerate.__version__} | {'all checks passed' if ok else 'SOME CHECKS FAILED'}")


def run_tests(timeout: int) -> tuple[bool, str, float]:
    """The CUDA tests in a child pytest; (passed, pytest's summary line, seconds)."""
    cmd = [sys.executable, "-m", "pytest", "-q", "-m", "cuda", "-p", "no:cacheprovider",
           "tests/cuda", "tests/protection/test_staging.py"]
    try:
        import xdist  # noqa: F401

        cmd += ["-n", "4"]
    except ImportError:
        pass
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout.decode(errors="replace") if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        print(out[-6000:], file=sys.stderr)
        return False, f"timed out after {timeout} s", time.perf_counter() - t0
    if proc.returncode != 0:
        print(proc.stdout[-8000:], proc.stderr[-3000:], sep="\n", file=sys.stderr)
    lines = [line for line in proc.stdout.splitlines() if line.strip()]
    return proc.returncode == 0, lines[-1] if lines else f"exit {proc.returncode}", time.perf_counter() - t0


def measurements(n_params: float) -> list[Row]:
    """IPC, the 1B update, a whole iteration, the engine: each section on its own, so that one
    failing still leaves the others' rows (and its traceback on stderr)."""
    import gpu_measure as m
    import torch

    from leto_lightning.retained.backends.cuda_ipc import MANAGER_ENV, CudaStateManager, default_address

    shm = os.statvfs("/dev/shm")
    free_shm = shm.f_bavail * shm.f_frsize
    need = 3 * n_params  # host parity (~2 B per parameter at D = 8) and the metadata, with room
    if free_shm < need:  # a SIGBUS would end the whole check: measure a model that fits instead
        n_params = max(1e7, free_shm / 3)
        print(f"/dev/shm has {free_shm / 1e9:.1f} GB free: measuring {n_params / 1e9:.2f}B parameters", file=sys.stderr)
    manager = CudaStateManager.start(default_address(f"gpucheck-{os.getpid()}"), 0)
    os.environ[MANAGER_ENV] = manager.address
    rows: list[Row] = []
    try:
        torch.cuda.set_device(0)
        for name, section in (("ipc", lambda: m.measure_attach(manager)),
                              ("update", lambda: m.measure_update(int(n_params), manager)),
                              ("iteration", lambda: m.measure_iteration(manager) if free_shm >= 3e9 else []),
                              ("engine", m.measure_engine)):
            t0 = time.perf_counter()
            try:
                rows += section()
            except Exception as exc:
                traceback.print_exc()
                rows.append((f"{name}: FAILED", f"{type(exc).__name__}: {str(exc)[:120]}", ""))
            stats = manager.stats()
            rows.append((f"{name}: state manager after it (buffers, allocated)",
                         f"{len(stats['buffers'])}, {stats['allocated']}", f"B ({time.perf_counter() - t0:.0f} s)"))
    finally:
        manager.shutdown()
    return rows


class Jobs:
    """The training jobs of the check, started at once and compared once all have ended."""

    def __init__(self, work: Path, cpu: bool) -> None:
        self.work, self.cpu = work, cpu
        self.procs: dict[str, list[subprocess.Popen]] = {}
        self.started: dict[str, float] = {}
        self.env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONWARNINGS="ignore", WANDB_MODE="offline",
                        LETO_SECRET=os.urandom(16).hex())
        self.gpu_memory: dict[int, int] = {}  # pid -> most device memory NVML saw it use
        self._sampling = False

    def _faults(self, ranks: int) -> str:
        return json.dumps([{"id": i, "rank": i % ranks, "iteration": it, "point": point, "occurrence": 1,
                            "wait_shadows": True} for i, (it, point) in enumerate(KILLS)])

    def _spawn(self, name: str, cmd: list[str], env: dict | None = None) -> None:
        run = self.work / name
        run.mkdir(parents=True, exist_ok=True)
        log = open(run / "output.log", "a")
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env or self.env, cwd=run,
                                start_new_session=True)
        self.procs.setdefault(name, []).append(proc)
        self.started.setdefault(name, time.time())

    def start(self) -> None:
        py, leto = sys.executable, [sys.executable, "-m", "leto_lightning.cli", "launch"]
        lit, acc = str(JOBS / "lightning_job.py"), str(JOBS / "accelerate_job.py")
        device = ["--accelerator", "cpu"] if self.cpu else []
        steps = ["--max-steps", str(STEPS)]
        w = self.work
        self._spawn("lightning-ddp", [py, lit, "--strategy", "ddp", "--devices", "1", *device, *steps,
                                      "--out", str(w / "lightning-ddp")])
        if not self.cpu:  # mixed precision on the device: bf16 autocast, the same 3 SIGKILLs
            bf16 = ["--precision", "bf16-mixed"]
            self._spawn("bf16-ddp", [py, lit, "--strategy", "ddp", "--devices", "1", *bf16, *steps,
                                     "--out", str(w / "bf16-ddp")])
            self._spawn("bf16-leto", [*leto, "--nproc-per-node", "1", "--run-dir", str(w / "bf16-leto" / "run"),
                                      "--faults", self._faults(1), lit, "--strategy", "leto", *bf16, *steps])
            self._sample_gpu_memory()
        self._spawn("lightning-leto", [*leto, "--nproc-per-node", "1", "--run-dir", str(w / "lightning-leto" / "run"),
                                       "--faults", self._faults(1), lit, "--strategy", "leto", *device, *steps])
        self._spawn("lightning-restart", [*leto, "--nproc-per-node", "1", "--run-dir",
                                          str(w / "lightning-restart" / "run"), "--non-hof-exit-code", "43",
                                          "--faults", json.dumps([{"id": 0, "rank": 0, "iteration": 18,
                                                                   "point": "chunk.math_done", "action": "exit",
                                                                   "code": 43}]),
                                          lit, "--strategy", "leto", *device, *steps])
        cpu = ["--cpu"] if self.cpu else []
        self._spawn("accelerate-plain", [py, acc, "--plain", *cpu, *steps, "--out", str(w / "accelerate-plain")])
        self._spawn("accelerate-leto", [*leto, "--nproc-per-node", "1", "--run-dir",
                                        str(w / "accelerate-leto" / "run"), "--faults", self._faults(1), acc, *cpu,
                                        *steps])
        two = ["--devices", "1", "--num-nodes", "2", "--pg-backend", "gloo", *device, *steps]
        from leto_lightning.testing.launched import free_port

        port = free_port()
        for node in (0, 1):
            self._spawn("two-nodes-leto", [*leto, "--nnodes", "2", "--node-rank", str(node), "--master-port",
                                           str(port), "--nproc-per-node", "1", "--run-dir",
                                           str(w / "two-nodes-leto" / f"node{node}"), "--faults", self._faults(2),
                                           lit, "--strategy", "leto", *two])
        ref_port = free_port()
        for rank in (0, 1):
            env = dict(self.env, RANK=str(rank), LOCAL_RANK="0", WORLD_SIZE="2", LOCAL_WORLD_SIZE="1",
                       NODE_RANK=str(rank), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(ref_port))
            self._spawn("two-nodes-ddp", [py, lit, "--strategy", "ddp", *two, "--out", str(w / "two-nodes-ddp")],
                        env)

    def finish(self, timeout: int) -> tuple[list[Row], bool]:
        deadline = time.time() + timeout
        codes: dict[str, int | None] = {}
        for name, procs in self.procs.items():
            rcs = []
            for p in procs:
                try:
                    rcs.append(p.wait(max(1.0, deadline - time.time())))
                except subprocess.TimeoutExpired:
                    rcs.append(None)
            codes[name] = None if None in rcs else max(rcs)  # type: ignore[type-var]
        self.stop()
        return self._compare(codes)

    def _compare(self, codes: dict[str, int | None]) -> tuple[list[Row], bool]:
        rows: list[Row] = []
        ok = True
        pairs = [("lightning-leto", "lightning-ddp", [0]), ("accelerate-leto", "accelerate-plain", [0]),
                 ("two-nodes-leto", "two-nodes-ddp", [0, 1]), ("lightning-restart", "lightning-ddp", [0])]
        if not self.cpu:
            pairs.append(("bf16-leto", "bf16-ddp", [0]))
        for leto, ref, ranks in pairs:
            verdict, same = self._verdict(leto, ref, ranks, codes)
            ok &= same
            rows.append((f"job: {leto} vs {ref}", verdict, self._recoveries(leto)))
        rows += self._recovery_times()
        rows += self._memory_rows()
        return rows, ok

    def _sample_gpu_memory(self) -> None:
        """Every second, NVML's device memory per process (the most seen per pid)."""
        import threading

        try:
            import pynvml

            pynvml.nvmlInit()
            handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        except Exception as exc:  # no NVML: the rows say so
            print(f"NVML unavailable for per-process memory: {exc}", file=sys.stderr)
            return
        self._sampling = True

        def sample() -> None:
            while self._sampling:
                try:
                    for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
                        used = int(p.usedGpuMemory or 0)
                        self.gpu_memory[p.pid] = max(used, self.gpu_memory.get(p.pid, 0))
                except Exception:
                    pass
                time.sleep(1.0)

        threading.Thread(target=sample, daemon=True).start()

    def _memory_rows(self) -> list[Row]:
        """Device memory of the Lightning job's processes as NVML saw them, by role."""
        self._sampling = False
        if not self.gpu_memory:
            return [("memory: per-process device memory", "no NVML samples", "")]
        roles: dict[int, str] = {}
        for e in self._events("lightning-leto"):
            if e["event"] == "process_started":
                roles[e["pid"]] = e["role"]
        ddp = [p.pid for p in self.procs.get("lightning-ddp", [])]
        agent = [e["pid"] for e in self._events("lightning-leto") if e["event"] == "job_started"]
        def most(pids) -> float:
            return max((self.gpu_memory.get(p, 0) for p in pids), default=0) / 2**20

        rows: list[Row] = [("memory: Lightning ddp trainer (the reference), NVML", most(ddp), "MiB"),
                           ("memory: Lightning leto active trainer, NVML", most([p for p, r in roles.items()
                                                                                if r == "active"]), "MiB"),
                           ("memory: its shadow (waiting, L3), NVML", most([p for p, r in roles.items()
                                                                         if r == "shadow"]), "MiB"),
                           ("memory: its agent (CUDA context for recovery), NVML", most(agent), "MiB"),
                           ("memory: every process NVML saw (pid: MiB)", ", ".join(
                               f"{pid}:{used // 2**20}" for pid, used in sorted(self.gpu_memory.items())), "")]
        return rows

    def _final(self, name: str, rank: int) -> dict | None:
        import torch

        found = sorted((self.work / name).rglob(f"final_rank{rank}.pt"))
        return torch.load(found[0], weights_only=True) if found else None

    def _verdict(self, leto: str, ref: str, ranks: list[int], codes: dict) -> tuple[str, bool]:
        import torch

        if codes.get(leto) != 0 or codes.get(ref) != 0:
            return f"exit codes {codes.get(leto)} / {codes.get(ref)}", False
        diffs = []
        for r in ranks:
            a, b = self._final(leto, r), self._final(ref, r)
            if a is None or b is None:
                return f"rank {r}: no final state", False
            diffs += [f"r{r} {n}" for n in b["params"] if not torch.equal(a["params"][n], b["params"][n])]
            for i, st in b["optimizer"]["state"].items():
                diffs += [f"r{r} opt {i}.{k}" for k, v in st.items()
                          if not torch.equal(torch.as_tensor(a["optimizer"]["state"][i][k]), torch.as_tensor(v))]
        return ("bit-identical" if not diffs else f"DIFFERENT: {diffs[:3]}"), not diffs

    def _events(self, name: str) -> list[dict]:
        out = []
        for path in sorted((self.work / name).rglob("events.jsonl")):
            out += [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        return out

    def _recoveries(self, name: str) -> str:
        ev = self._events(name)
        done = [e for e in ev if e["event"] == "recovery_finished"]
        via = sorted({e.get("promoted", "?") for e in done})
        return f"{len(done)} in-place recoveries ({', '.join(via) or '-'}), " \
               f"{sum(e['event'] == 'fallback_checkpoint' for e in ev)} checkpoint restarts"

    def _recovery_times(self) -> list[Row]:
        rows: list[Row] = []
        done = [e for e in self._events("lightning-leto") if e["event"] == "recovery_finished"]
        if done:
            totals = sorted(e["total_s"] for e in done)
            b = done[len(done) // 2]["breakdown"]
            rows.append(("recovery: mid-update SIGKILL, failure -> next iteration done (median of "
                         f"{len(done)})", totals[len(totals) // 2], "s " + json.dumps(b)))
        restart = [e for e in self._events("lightning-restart") if e["event"] == "checkpoint_restart_finished"]
        if restart:
            e = restart[0]
            rows.append(("recovery: checkpoint restart, failure -> first iteration after it", e["total_s"],
                         f"s, then {e['recompute_iterations']} iteration(s) to compute again"))
        return rows

    def stop(self) -> None:
        import signal

        for procs in self.procs.values():
            for p in procs:
                if p.poll() is None:
                    try:
                        os.killpg(p.pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                    p.wait()

    def copy_logs(self, dest: Path) -> None:
        dest.mkdir(parents=True, exist_ok=True)
        for path in self.work.rglob("*"):
            if path.is_file() and path.suffix in (".log", ".jsonl"):
                target = dest / "__".join(path.relative_to(self.work).parts)
                shutil.copy(path, target)


def print_table(header: str, rows: list[Row]) -> None:
    width = max(len(r[0]) for r in rows) if rows else 10
    print(header)
    print("-" * (width + 40))
    for name, value, unit in rows:
        shown = f"{value:12.3f}" if isinstance(value, float) else f"{value!s:>12}"
        print(f"{name:<{width}}  {shown}  {unit}")


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    sys.exit(main())
