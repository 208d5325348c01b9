"""Crash and resume: a trainer SIGKILLed mid-update, a *fresh* process with a fresh Trainer
and a differently initialised model continues from retained memory
(``trainer.fit(ckpt_path="leto://retained")``), and the run ends bit-identical to an
uninterrupted single-device run -- weights, buffers, optimizer state, LR, RNG -- with the
same per-batch loss series (the crashed run's losses, then the resumed run's).

Steps: 5 per epoch (10 batches, 2 accumulated per step), 3 epochs, validation after each;
with ``page_bytes=512`` each step is 7 chunk transactions.
"""

from __future__ import annotations

import csv
import os
from collections.abc import Callable

import pytest
from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from pl_job import RunConfig, differences, fit, read_losses

from leto_lightning.integrations.lightning import RETAINED_CKPT, LetoStrategy
from leto_lightning.retained.store import RetainedStore
from leto_lightning.testing.crash import KillPoint, run_in_child
from leto_lightning.updater.recovery import recover_node

CHUNKS = 7  # chunk transactions per step at page_bytes=512


def _leto(job: str) -> LetoStrategy:
    return LetoStrategy(job_id=job, page_bytes=512, chunk_pages=1, data_pages=4, tier1_parity=1)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Uninterrupted single-device runs (no Leto at all), one per optimizer."""
    cache: dict[str, tuple[dict, dict]] = {}

    def get(optimizer: str) -> tuple[dict, dict]:
        if optimizer not in cache:
            path = str(tmp_path_factory.mktemp("ref") / "losses")
            snap = run_in_child(lambda: fit(RunConfig(optimizer=optimizer, loss_file=path))).value
            cache[optimizer] = (snap, read_losses(path))
        return cache[optimizer]

    return get


def crash_and_resume(job: str, tmp_path, optimizer: str, kill_at: KillPoint, via_env: bool = False) -> dict:
    """Crash a run at ``kill_at``; recover and resume in a new process. Returns what happened."""
    crash_losses, resume_losses = str(tmp_path / "crash"), str(tmp_path / "resume")
    crashed = run_in_child(lambda: fit(RunConfig(optimizer=optimizer, strategy=_leto(job), loss_file=crash_losses)),
                           kill_at=kill_at)
    assert crashed.killed, f"the run finished without reaching {kill_at}"

    def resume() -> dict:
        report = recover_node({0: RetainedStore.attach(job, 0)})[0]  # what the agent will do
        if via_env:  # what `leto launch` will do for a shadow: the script calls plain trainer.fit()
            os.environ.update(LETO_JOB_ID=job, LETO_RESUME="retained")
            strategy = LetoStrategy(page_bytes=512, chunk_pages=1, data_pages=4, tier1_parity=1)
            cfg = RunConfig(optimizer=optimizer, strategy=strategy, seed=5, loss_file=resume_losses)
        else:
            cfg = RunConfig(optimizer=optimizer, strategy=_leto(job), seed=5, loss_file=resume_losses,
                            ckpt_path=RETAINED_CKPT)
        snap = fit(cfg)  # seed=5: the fresh model's own weights differ; the retained ones must win
        return {"snap": snap, "kind": report.payload and report.payload["kind"],
                "resume_iteration": report.resume_iteration, "rolled_forward": len(report.rolled_forward)}

    out = run_in_child(resume).value
    out["crash_losses"], out["resume_losses"] = read_losses(crash_losses), read_losses(resume_losses)
    return out


def crash_then_resume(config: Callable[..., RunConfig], job: str, run_dir: str, kill_at: KillPoint) -> dict:
    """``fit(config(run_dir, strategy))`` SIGKILLed at ``kill_at``; recovery; the same fit resumed
    from retained memory in a new process, with a differently initialised model. Its snapshot."""
    assert run_in_child(lambda: fit(config(run_dir, _leto(job))), kill_at=kill_at).killed, f"never reached {kill_at}"

    def resume() -> dict:
        recover_node({0: RetainedStore.attach(job, 0)})
        return fit(config(run_dir, _leto(job), seed=5, ckpt_path=RETAINED_CKPT))

    return run_in_child(resume).value


def check(out: dict, ref: tuple[dict, dict]) -> None:
    snap, ref_losses = ref
    diffs = differences(out["snap"], snap)
    assert diffs == []
    crash, resumed = out["crash_losses"], out["resume_losses"]
    redone = {k for k in resumed if k in crash}
    assert all(crash[k] == resumed[k] for k in redone), "a recomputed batch gave a different loss"
    assert {**crash, **resumed} == ref_losses


@pytest.mark.parametrize("optimizer, kill_at, kind", [
    ("adamw", KillPoint("chunk.math_done", 6 * CHUNKS + 4), "prepare"),  # mid-update of step 6
    ("sgd", KillPoint("chunk.undo_copied", 2 * CHUNKS + 7), "prepare"),  # last chunk of step 2
    ("adamw", KillPoint("chunk.tier1_done", 4 * CHUNKS + 1), "prepare"),  # step 4: the epoch's last batch
    ("adamw", KillPoint("prepare.begin", 4), "batch_end"),  # compute of step 3 done, update not begun
    ("adamw", KillPoint("prepare.begin", 6), "validation_end"),  # step 5, right after epoch 0's validation
    ("adamw", KillPoint("prepare.begin", 1), "start"),  # before the first update
    ("rmsprop", KillPoint("whole.math_done", 8), "prepare"),  # whole-state transaction, step 7
])
def test_crash_mid_update_resumes_bit_identical(optimizer: str, kill_at: KillPoint, kind: str, reference, job: str,
                                                tmp_path) -> None:
    out = crash_and_resume(job, tmp_path, optimizer, kill_at)
    assert out["kind"] == kind
    check(out, reference(optimizer))


def test_resume_requested_by_environment(reference, job: str, tmp_path) -> None:
    """``LETO_RESUME=retained`` + ``LETO_JOB_ID``: an unchanged script's ``trainer.fit()`` resumes."""
    out = crash_and_resume(job, tmp_path, "adamw", KillPoint("chunk.math_done", 11 * CHUNKS + 2), via_env=True)
    assert out["resume_iteration"] == 12 and out["rolled_forward"] > 0
    check(out, reference("adamw"))


def test_crash_in_the_last_update(reference, job: str, tmp_path) -> None:
    """Killed during the run's last update: the resumed fit finishes that update, runs the
    validation that followed it (the payload marks it due: Lightning would skip it) and ends --
    bit-identical, RNG included."""
    out = crash_and_resume(job, tmp_path, "adamw", KillPoint("chunk.math_done", 14 * CHUNKS + 3))
    assert out["resume_iteration"] == 15 and out["resume_losses"] == {}
    check(out, reference("adamw"))


def test_checkpoint_and_early_stopping_state_survive(job: str, jobs, tmp_path) -> None:
    """ModelCheckpoint (top-k, every 3 steps, last) and EarlyStopping, validation twice per
    epoch: after a crash mid-update, their state and the files on disk match an uninterrupted
    Leto run (the callbacks' state is part of every resume payload)."""
    def config(directory: str, strategy: LetoStrategy, **kw) -> RunConfig:
        callbacks = [ModelCheckpoint(dirpath=directory, monitor="val_loss", save_top_k=2, every_n_train_steps=3,
                                     save_last=True), EarlyStopping(monitor="val_loss", patience=50)]
        return RunConfig(strategy=strategy, accumulate=1, val_check_interval=0.5,
                         trainer_kwargs={"callbacks": callbacks, "enable_checkpointing": True}, **kw)

    ref_dir, run_dir = str(tmp_path / "ref"), str(tmp_path / "run")
    ref_job = jobs()  # made here: a job id made inside the child would escape the cleanup
    ref = run_in_child(lambda: fit(config(ref_dir, _leto(ref_job)))).value
    got = crash_then_resume(config, job, run_dir, KillPoint("chunk.math_done", 13 * CHUNKS + 3))
    assert differences(got, ref) == []
    assert got["callbacks"] == ref["callbacks"]
    assert "last.ckpt" in got["callbacks"]["ModelCheckpoint"]["files"]


def test_resume_from_a_checkpoint_file(job: str, jobs, tmp_path) -> None:
    """``fit(ckpt_path="last")`` -- what a script does on ``leto launch``'s slow path
    (``LETO_RESUME=checkpoint``): a *new* store is filled from the file, and the Leto payload the
    file carries (LetoLoopStateCallback's state: RNG, data position, loop) makes the resumed run
    bit-identical to an uninterrupted one, although the file is three steps behind the crash."""
    def config(directory: str, strategy: LetoStrategy, **kw) -> RunConfig:
        callbacks = [ModelCheckpoint(dirpath=directory, every_n_train_steps=3, save_top_k=-1, save_last=True)]
        return RunConfig(strategy=strategy, accumulate=1, val_check_interval=0.5,
                         trainer_kwargs={"callbacks": callbacks, "enable_checkpointing": True}, **kw)

    ref_dir, run_dir = str(tmp_path / "ref"), str(tmp_path / "run")
    ref_losses, crash_losses = str(tmp_path / "ref_losses"), str(tmp_path / "losses")
    ref_job, new_job = jobs(), jobs()
    ref = run_in_child(lambda: fit(config(ref_dir, _leto(ref_job), loss_file=ref_losses))).value
    crashed = run_in_child(lambda: fit(config(run_dir, _leto(job), loss_file=crash_losses)),
                           kill_at=KillPoint("chunk.math_done", 20 * CHUNKS + 3))  # files after steps 3, ..., 18
    assert crashed.killed
    got = run_in_child(lambda: fit(config(run_dir, _leto(new_job), seed=5, ckpt_path="last",
                                          loss_file=crash_losses))).value
    assert differences(got, ref) == []
    assert read_losses(crash_losses) == read_losses(ref_losses)  # steps 18-20 recomputed, same values


def _validating(directory: str, strategy: LetoStrategy, **kw) -> RunConfig:
    callbacks = [ModelCheckpoint(dirpath=os.path.join(directory, "ck"), monitor="val_loss", save_top_k=2,
                                 save_last=True), EarlyStopping(monitor="val_loss", patience=50)]
    return RunConfig(strategy=strategy, accumulate=1, val_check_interval=0.5,
                     trainer_kwargs={"callbacks": callbacks, "enable_checkpointing": True,
                                     "logger": CSVLogger(directory, name="csv", version=0)}, **kw)


def _val_rows(directory: str) -> list[tuple]:
    with open(os.path.join(directory, "csv", "version_0", "metrics.csv"), newline="") as f:
        return [(r["step"], r["epoch"], r["val_loss"]) for r in csv.DictReader(f) if r.get("val_loss")]


@pytest.mark.parametrize("occurrence", [1, 3, 6])  # 2 batches per validation, 2 validations per epoch
def test_crash_during_validation_runs_it_again(occurrence: int, job: str, jobs, tmp_path) -> None:
    """SIGKILL inside a validation (the first one; the one at epoch 0's end; mid-epoch 1):
    Lightning's restart from the batch-end state would skip that validation -- its metrics,
    the checkpoint it triggers, the RNG it draws. The payload marks it due, so the resumed fit
    runs it first: the same validation rows, callback state and final state."""
    ref_dir, run_dir = str(tmp_path / "ref"), str(tmp_path / "run")
    ref_job = jobs()
    ref = run_in_child(lambda: fit(_validating(ref_dir, _leto(ref_job)))).value
    got = crash_then_resume(_validating, job, run_dir, KillPoint("lightning.validation", occurrence))
    assert differences(got, ref) == []
    assert got["callbacks"] == ref["callbacks"]
    assert _val_rows(run_dir) == _val_rows(ref_dir) and len(_val_rows(ref_dir)) == 6


def test_second_crash_after_a_rerun_validation(job: str, jobs, tmp_path) -> None:
    """A crash inside a validation, the resumed process runs it again, then dies itself at the
    epoch's end: the third process resumes from the second's payload -- whose validation
    counters must not say "mid evaluation" again (Lightning resets only the current ones)."""
    ref_dir, run_dir = str(tmp_path / "ref"), str(tmp_path / "run")
    ref_job = jobs()
    ref = run_in_child(lambda: fit(_validating(ref_dir, _leto(ref_job)))).value
    assert run_in_child(lambda: fit(_validating(run_dir, _leto(job))),
                        kill_at=KillPoint("lightning.validation", 1)).killed

    def resume(seed: int) -> dict:
        recover_node({0: RetainedStore.attach(job, 0)})
        return fit(_validating(run_dir, _leto(job), seed=seed, ckpt_path=RETAINED_CKPT))

    assert run_in_child(lambda: resume(5), kill_at=KillPoint("lightning.epoch_end", 1)).killed
    got = run_in_child(lambda: resume(6)).value
    assert differences(got, ref) == []
    assert _val_rows(run_dir) == _val_rows(ref_dir)
