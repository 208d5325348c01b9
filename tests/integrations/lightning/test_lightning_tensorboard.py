"""TensorBoardLogger across trainer processes: after SIGKILLs and resumes from retained memory
in new processes, TensorBoard reads the same scalar series as from the fault-free run -- every
tag, the same steps, the same values, nothing twice, nothing missing.

The reader is TensorBoard's own ``EventAccumulator`` over the run's directory, which applies
the purges (``SessionLog.START`` at the resumed step) as TensorBoard does. The logger's
``version`` is given, as a script run by hand must (under ``leto launch`` the agent agrees on
one). A ``CSVLogger`` beside it gets the same loss rows as the fault-free run.

The job (pl_job.py) with no accumulation and validation twice per epoch: 30 steps, a
validation after every fifth, losses logged at every step.
"""

from __future__ import annotations

import csv
import os

import pytest
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from pl_job import RunConfig, differences, fit
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from leto_lightning.integrations.lightning import RETAINED_CKPT, LetoStrategy
from leto_lightning.integrations.lightning.tensorboard_logs import sort_before
from leto_lightning.retained.store import RetainedStore
from leto_lightning.testing.crash import KillPoint, run_in_child
from leto_lightning.updater.recovery import recover_node

CHUNKS = 7  # chunk transactions per step at page_bytes=512


class Hyperparameters(Callback):
    """The module saves hyperparameters, so every process's fit logs them (``hp_metric`` and the
    hparams summary at step 0): a resumed process must not log them a second time."""

    def setup(self, trainer, pl_module, stage: str) -> None:
        pl_module.save_hyperparameters({"width": 16, "job": "tiny"})


def config(save_dir: str, strategy, **kw) -> RunConfig:
    loggers = [TensorBoardLogger(save_dir, name="tb", version=0), CSVLogger(save_dir, name="csv", version=0)]
    return RunConfig(strategy=strategy, accumulate=1, val_check_interval=0.5, trainer_kwargs={
        "logger": loggers, "log_every_n_steps": 1, "callbacks": [Hyperparameters()]}, **kw)


def _leto(job: str) -> LetoStrategy:
    return LetoStrategy(job_id=job, page_bytes=512, chunk_pages=1, data_pages=4, tier1_parity=1)


def scalars(save_dir: str) -> dict[str, list[tuple[int, float]]]:
    """Every scalar tag as TensorBoard reads it: (step, value), in order."""
    acc = EventAccumulator(os.path.join(save_dir, "tb", "version_0"), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def csv_losses(save_dir: str) -> list[tuple[str, str]]:
    with open(os.path.join(save_dir, "csv", "version_0", "metrics.csv"), newline="") as f:
        return [(row["step"], row["train_loss"]) for row in csv.DictReader(f) if row.get("train_loss")]


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> tuple[dict, dict, list]:
    """Lightning's single-device strategy, no Leto, no fault."""
    save_dir = str(tmp_path_factory.mktemp("tb_ref"))
    snap = run_in_child(lambda: fit(config(save_dir, "auto"))).value
    return snap, scalars(save_dir), csv_losses(save_dir)


def crash_then_resume(job: str, save_dir: str, kills: list[KillPoint]) -> dict:
    """The first run and one resumed run per kill point are SIGKILLed there; a last resume ends."""
    crashed = run_in_child(lambda: fit(config(save_dir, _leto(job))), kill_at=kills[0])
    assert crashed.killed, f"the run finished without reaching {kills[0]}"

    def resumed() -> dict:
        recover_node({0: RetainedStore.attach(job, 0)})
        return fit(config(save_dir, _leto(job), seed=5, ckpt_path=RETAINED_CKPT))

    for kill in kills[1:]:
        again = run_in_child(resumed, kill_at=kill)
        assert again.killed, f"the resumed run finished without reaching {kill}"
    return run_in_child(resumed).value


@pytest.mark.parametrize("kills", [
    [KillPoint("chunk.math_done", 12 * CHUNKS + 4)],  # mid-update of step 12: a "prepare" payload
    [KillPoint("prepare.begin", 8)],  # step 7 computed, not applied: the batch end of step 6
    [KillPoint("prepare.begin", 6)],  # step 5 computed, right after a validation: "validation_end"
    [KillPoint("prepare.begin", 1)],  # before the first update: "start" (the purge starts at step 0)
    # three processes: step 8 mid-update, then the resumed run at step 21 (its 13th step)
    [KillPoint("chunk.math_done", 8 * CHUNKS + 2), KillPoint("chunk.undo_copied", 12 * CHUNKS + 5)],
], ids=["prepare", "batch_end", "validation_end", "start", "two_crashes"])
def test_tensorboard_series_equal_after_crashes(kills: list[KillPoint], reference, job: str, tmp_path) -> None:
    save_dir = str(tmp_path)
    snap = crash_then_resume(job, save_dir, kills)
    ref_snap, ref_scalars, ref_csv = reference
    assert differences(snap, ref_snap) == []
    got = scalars(save_dir)
    assert sorted(got) == sorted(ref_scalars)
    for tag, series in ref_scalars.items():
        assert got[tag] == series, tag
    assert len(ref_scalars["train_loss"]) == 30 and ref_scalars["hp_metric"] == [(0, -1.0)]
    assert csv_losses(save_dir) == ref_csv


def test_older_event_files_sort_before_a_new_one(tmp_path) -> None:
    """A resumed writer's file created in the same second as older ones, with a smaller pid:
    the older files are renamed to sort just before it, keeping their order."""
    names = ["events.out.tfevents.0000000100.host.7.0", "events.out.tfevents.0000000101.host.900.0",
             "events.out.tfevents.0000000101.host.901.0", "events.out.tfevents.0000000101.host.12.0"]
    for i, name in enumerate(names):
        (tmp_path / name).write_text(str(i))
    own = str(tmp_path / names[3])
    assert sort_before(own) == ["events.out.tfevents.0000000100.~leto000000.host.900.0",
                                "events.out.tfevents.0000000100.~leto000001.host.901.0"]
    assert sort_before(own) == []  # already last
    order = sorted(os.listdir(tmp_path))
    assert [(tmp_path / n).read_text() for n in order] == ["0", "1", "2", "3"]
    # a second resume in the same second: the earlier renamed files stay first
    (tmp_path / "events.out.tfevents.0000000101.host.950.0").write_text("4")
    (tmp_path / "events.out.tfevents.0000000101.host.13.0").write_text("5")
    sort_before(str(tmp_path / "events.out.tfevents.0000000101.host.13.0"))
    order = sorted(os.listdir(tmp_path))
    assert [(tmp_path / n).read_text() for n in order] == ["0", "1", "2", "3", "4", "5"]


def test_without_a_version_the_resumed_run_gets_its_own_directory(job: str, tmp_path) -> None:
    """No ``version`` and no ``leto launch`` to agree on one: the resumed process logs into the
    next ``version_N`` as a run of its own -- nothing purged there, its hyperparameters logged."""
    def cfg(**kw) -> RunConfig:
        logger = TensorBoardLogger(str(tmp_path), name="tb")
        return RunConfig(strategy=_leto(job), accumulate=1, trainer_kwargs={
            "logger": logger, "log_every_n_steps": 1, "callbacks": [Hyperparameters()]}, **kw)

    assert run_in_child(lambda: fit(cfg()), kill_at=KillPoint("prepare.begin", 8)).killed

    def resumed() -> None:
        recover_node({0: RetainedStore.attach(job, 0)})
        fit(cfg(seed=5, ckpt_path=RETAINED_CKPT))

    run_in_child(resumed)
    first, second = (EventAccumulator(str(tmp_path / "tb" / f"version_{v}")) for v in (0, 1))
    first.Reload()
    second.Reload()
    assert [e.step for e in first.Scalars("train_loss")][:6] == list(range(6))  # up to the crash (step 6's
    # event may still have been queued in the writer: the crashed process flushes at each payload)
    assert [e.step for e in second.Scalars("train_loss")] == list(range(6, 30))  # pending step 6 first
    assert [(e.step, e.value) for e in second.Scalars("hp_metric")] == [(0, -1.0)]
