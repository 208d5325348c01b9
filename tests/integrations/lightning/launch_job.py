"""Run the Lightning example (``examples/lightning_tiny.py``) under ``leto launch`` -- or, as a
reference, as two externally started Lightning DDP ranks -- and read what it left behind:
events, final per-rank state, the CSVLogger file and wandb's offline runs."""

from __future__ import annotations

import csv
import glob
import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import torch

from leto_lightning.examples import LIGHTNING_TINY
from leto_lightning.runtime.events import iter_events
from leto_lightning.testing import launched
from leto_lightning.testing.launched import LaunchedRun, free_port, wait_for  # noqa: F401  (re-exported)

QUIET = dict(os.environ, PYTHONUNBUFFERED="1", WANDB_MODE="offline", WANDB_SILENT="true",
             PYTHONWARNINGS="ignore")


class Run(LaunchedRun):
    """A Lightning example's run: its CSVLogger file too."""

    def csv_rows(self) -> list[dict]:
        with open(self.run_dir / "csv" / "version_0" / "metrics.csv", newline="") as f:
            return list(csv.DictReader(f))

    def loss_series(self) -> list[tuple]:
        """(step, epoch, train_loss, val_loss) of every loss row, in file order, as written."""
        return [(r["step"], r["epoch"], r["train_loss"], r["val_loss"]) for r in self.csv_rows()
                if r.get("train_loss") or r.get("val_loss")]

    def tensorboard(self, *tags: str) -> dict[str, list[tuple[int, float]]]:
        """The scalar series of ``tags`` as TensorBoard reads them (``--tensorboard``): purges applied."""
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

        acc = EventAccumulator(str(self.run_dir / "tb" / "version_0"), size_guidance={"scalars": 0})
        acc.Reload()
        return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in tags}

    def recovery_rows(self) -> list[dict]:
        return [r for r in self.csv_rows() if r.get("leto/recoveries")]


def script_args(max_steps: int, *extra: str) -> list[str]:
    return [LIGHTNING_TINY, "--max-steps", str(max_steps), "--page-bytes", "16384", "--checkpoint-every", "7", *extra]


def start(run_dir: Path, max_steps: int, faults=(), extra_script=(), launch_extra=(),
          new_session: bool = False) -> subprocess.Popen:
    """``new_session``: the launcher and everything it starts in a process group of their own
    (a node a test can lose at once: ``os.killpg``)."""
    cmd = [sys.executable, "-m", "leto_lightning.cli", "launch", "--nproc-per-node", "2", "--run-dir", str(run_dir),
           "--faults", json.dumps(list(faults)), *launch_extra, *script_args(max_steps, *extra_script)]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=QUIET,
                            cwd=run_dir.parent, start_new_session=new_session)


def finish(proc: subprocess.Popen, run_dir: Path, timeout: float = 240) -> Run:
    return launched.finish(proc, run_dir, timeout, result=Run)


def launch(run_dir: Path, max_steps: int, **kw) -> Run:
    run_dir.mkdir(parents=True, exist_ok=True)
    return finish(start(run_dir, max_steps, **kw), run_dir)


def ddp_reference(run_dir: Path, max_steps: int, *extra: str, timeout: float = 180) -> Run:
    """The same script with ``--strategy ddp``: two ranks started by hand (RANK, LOCAL_RANK,
    WORLD_SIZE, MASTER_*), so Lightning's DDP needs no launcher of its own."""
    run_dir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    procs = []
    for rank in range(2):
        env = dict(QUIET, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2",
                   NODE_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        env.pop("LETO_RUN_DIR", None)
        procs.append(subprocess.Popen([sys.executable, *script_args(max_steps, *extra), "--strategy", "ddp",
                                       "--out", str(run_dir)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True, env=env, cwd=run_dir.parent))
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=timeout)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    code = max(p.returncode for p in procs)
    return Run(code, "\n".join(outs), run_dir, [])


def events(run_dir: Path) -> list[dict]:
    return list(iter_events(run_dir))


def same_state(a: dict, b: dict) -> list[str]:
    """What is not bit-identical between two final states (params and optimizer state)."""
    diffs = [f"param {n}" for n in b["params"] if not torch.equal(a["params"][n], b["params"][n])]
    sa, sb = a["optimizer"]["state"], b["optimizer"]["state"]
    for i in sb:
        for k, v in sb[i].items():
            if not torch.equal(torch.as_tensor(sa[i][k]), torch.as_tensor(v)):
                diffs.append(f"optimizer state {i}.{k}")
    if a["global_step"] != b["global_step"]:
        diffs.append(f"global_step {a['global_step']} != {b['global_step']}")
    return diffs


# -- wandb's offline runs, read with no wandb reader (0.31 ships none in Python) ------------------
_BLOCK = 32768  # the run file is a LevelDB-style log: 32 KiB blocks of checksummed records
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


def wandb_records(path: str) -> list:
    """Every ``wandb_internal_pb2.Record`` in one offline ``run-<id>.wandb`` file."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = open(path, "rb").read()
    ident, magic, _version = struct.unpack("<4sHB", data[:7])
    assert ident == b":W&B" and magic == 0xBEE1, f"{path}: not a wandb run file"
    pos, parts, out = 7, b"", []
    while pos + 7 <= len(data):
        left = _BLOCK - pos % _BLOCK
        if left < 7:  # block trailer: padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0 and length == 0:
            pos += left
            continue
        chunk = data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind == _FULL:
            parts, whole = b"", chunk
        elif kind == _FIRST:
            parts, whole = chunk, None
        elif kind == _MIDDLE:
            parts, whole = parts + chunk, None
        else:
            parts, whole = b"", parts + chunk
        if whole is not None:
            record = pb.Record()
            record.ParseFromString(whole)
            out.append(record)
    return out


def wandb_history(run_dir: Path) -> dict[str, list[dict]]:
    """{run id: [history rows as {key: value}]} of every offline run under ``run_dir``."""
    runs = {}
    for path in sorted(glob.glob(str(run_dir / "wandb" / "offline-run-*" / "run-*.wandb"))):
        rows = []
        for record in wandb_records(path):
            if record.WhichOneof("record_type") == "history":
                rows.append({(item.key or "/".join(item.nested_key)): json.loads(item.value_json)
                             for item in record.history.item})
        runs[os.path.basename(path)[4:-6]] = rows
    return runs


def wandb_groups(run_dir: Path) -> set[str]:
    """The wandb group of every offline run under ``run_dir``."""
    return {record.run.run_group for path in glob.glob(str(run_dir / "wandb" / "offline-run-*" / "run-*.wandb"))
            for record in wandb_records(path) if record.WhichOneof("record_type") == "run"}


# -- nothing left behind -----------------------------------------------------------------------
def assert_nothing_left(run: Run) -> None:
    left = launched.leftovers(run)
    assert not left, "; ".join(left)
