"""Manual optimization (``automatic_optimization = False``) under LetoStrategy.

The step runs inside ``training_step``, with the user's code after it (logging, scheduler
steps). LetoStrategy keeps each step's update *open* until the batch ends: a crash anywhere
from the update to ``on_train_batch_end`` -- mid-update, in user code after ``opt.step()``,
inside the seal -- rolls the update back (whole-state undo copy) and the resumed ``fit()`` redoes
the whole batch; after the batch end it is kept. Either way: bit-identical to an uninterrupted
single-device run without Leto (weights, buffers, optimizer state, LR, RNG, loss series).
Two ranks: one SIGKILLed after its commit, the peer's update rolled back too.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
from pl_job import RunConfig, TinyModule, dataloaders, differences, fit, read_losses, run_ranks, trainer_for

from leto_lightning.faults.points import point
from leto_lightning.integrations.lightning import RETAINED_CKPT, LetoStrategy
from leto_lightning.retained.store import RetainedStore
from leto_lightning.testing.crash import KillPoint, run_in_child
from leto_lightning.updater.recovery import recover_node

ACCUMULATE = 2  # the module steps every 2nd batch: 5 steps per epoch, 15 in all


class ManualModule(TinyModule):
    """TinyModule trained by hand: accumulation, clipping, both schedulers stepped in user code."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.automatic_optimization = False

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        opt = self.optimizers()
        loss = self._loss(batch)
        self.manual_backward(loss / ACCUMULATE)
        if (batch_idx + 1) % ACCUMULATE == 0:
            self.clip_gradients(opt, gradient_clip_val=0.5, gradient_clip_algorithm="norm")
            opt.step()
            opt.zero_grad()
            point("test.after_step")  # user code after the step: still inside the open window
            self.lr_schedulers()[0].step()
        self.log("train_loss", loss)  # after the step: a kept update must not lose this row
        if self.loss_file:
            with open(self.loss_file, "a") as f:
                f.write(f"{self.current_epoch} {batch_idx} {loss.item().hex()}\n")
        return loss

    def on_train_epoch_end(self) -> None:
        self.lr_schedulers()[1].step()


def fit_manual(cfg: RunConfig) -> dict:
    return fit(dataclasses.replace(cfg, module=ManualModule))


def _cfg(strategy: Any, **kw: Any) -> RunConfig:
    return RunConfig(strategy=strategy, accumulate=1, clip=None, **kw)  # Lightning refuses both in manual mode


def _leto(job: str) -> LetoStrategy:
    return LetoStrategy(job_id=job, page_bytes=512, chunk_pages=1, data_pages=4, tier1_parity=1)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("ref") / "losses")
    snap = run_in_child(lambda: fit_manual(_cfg("auto", loss_file=path))).value
    return snap, read_losses(path)


def test_manual_optimization_without_faults_equals_lightning(reference, job: str) -> None:
    snap = run_in_child(lambda: fit_manual(_cfg(_leto(job)))).value
    assert differences(snap, reference[0]) == []
    assert snap["global_step"] == 15


@pytest.mark.parametrize("kill_at, kind, rolled_back", [
    (KillPoint("whole.math_done", 7), "batch_end", True),  # mid-update of step 7 (epoch 1)
    (KillPoint("test.after_step", 4), "batch_end", True),  # committed, user code after opt.step()
    # step 6, the first after a validation (seals: start, 5 steps, validation)
    (KillPoint("seal.begin", 8), "validation_end", True),
    (KillPoint("record.half_written", 3 * 3 + 2), "batch_end", True),  # torn seal of step 3
    (KillPoint("seal.recorded", 9), "batch_end", False),  # sealed: kept
    (KillPoint("prepare.begin", 1), "start", False),  # before the first update
])
def test_crash_in_the_open_window_resumes_bit_identical(reference, job: str, tmp_path, kill_at: KillPoint, kind: str,
                                                        rolled_back: bool) -> None:
    crash_losses, resume_losses = str(tmp_path / "crash"), str(tmp_path / "resume")
    crashed = run_in_child(lambda: fit_manual(_cfg(_leto(job), loss_file=crash_losses)), kill_at=kill_at)
    assert crashed.killed, f"the run finished without reaching {kill_at}"

    def resume() -> tuple[dict, Any, bool]:
        report = recover_node({0: RetainedStore.attach(job, 0)})[0]
        snap = fit_manual(_cfg(_leto(job), seed=5, loss_file=resume_losses, ckpt_path=RETAINED_CKPT))
        return snap, report.payload and report.payload["kind"], report.rolled_back

    snap, got_kind, got_rolled_back = run_in_child(resume).value
    assert (got_kind, got_rolled_back) == (kind, rolled_back)
    assert differences(snap, reference[0]) == []
    crash, resumed = read_losses(crash_losses), read_losses(resume_losses)
    assert all(crash[k] == resumed[k] for k in resumed if k in crash), "a redone batch gave a different loss"
    assert {**crash, **resumed} == reference[1]


def test_two_ranks_one_killed_after_commit_both_roll_back(job: str) -> None:
    cfg = dict(devices=2, max_epochs=2)
    ddp = run_ranks(lambda rank: fit_manual(_cfg("ddp", seed=rank, **cfg)), world=2)
    crashed = run_ranks(lambda rank: fit_manual(_cfg(_leto(job), seed=rank, **cfg)), world=2,
                        kill=(1, KillPoint("test.after_step", 3)), allow_failure=True, timeout=60)
    assert crashed[1] is None
    stores = {r: RetainedStore.attach(job, r) for r in range(2)}
    try:
        reports = recover_node(stores)
    finally:
        for s in stores.values():
            s.close()
    assert [reports[r].resume_iteration for r in range(2)] == [2, 2]  # step 3 (iteration 2) redone
    assert reports[1].rolled_back
    resumed = run_ranks(lambda rank: fit_manual(_cfg(_leto(job), seed=rank + 10, ckpt_path=RETAINED_CKPT, **cfg)),
                        world=2)
    for rank in range(2):
        assert differences(resumed[rank], ddp[rank]) == [], f"rank {rank}"


def test_two_steps_in_one_training_step_are_refused(job: str) -> None:
    class TwoSteps(ManualModule):
        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            opt = self.optimizers()
            for _ in range(2):
                self.manual_backward(self._loss(batch))
                opt.step()
            return torch.zeros(())

    def run() -> str:
        trainer = trainer_for(_cfg(_leto(job)))
        try:
            trainer.fit(TwoSteps(), *dataloaders())
        except RuntimeError as exc:
            return str(exc)
        return "no error"

    assert "at most once per training_step" in run_in_child(run).value


def test_manual_optimization_under_leto_launch_with_hofs(tmp_path) -> None:
    """The example with ``--manual`` under ``leto launch``: a HOF mid-update on rank 1 and one
    between rank 0's commit and its batch end (both ranks roll that step back and redo it);
    the shadows take over; bit-identical to the same script under Lightning's DDP."""
    from launch_job import ddp_reference, launch, same_state

    steps = 24
    faults = [{"id": 0, "rank": 1, "iteration": 5, "point": "whole.math_done", "wait_shadows": True},
              {"id": 1, "rank": 0, "iteration": 14, "point": "seal.begin", "wait_shadows": True}]
    run = launch(tmp_path / "run", steps, faults=faults, extra_script=["--manual"])
    assert run.returncode == 0, run.output[-4000:]
    finished = [e for e in run.of("recovery_finished") if not e.get("interrupted")]
    assert [e["promoted"] for e in finished] == ["shadow", "shadow"], run.output[-4000:]
    ddp = ddp_reference(tmp_path / "ddp", steps, "--manual")
    assert ddp.returncode == 0, ddp.output[-4000:]
    for rank in range(2):
        assert same_state(run.final(rank), ddp.final(rank)) == [], f"rank {rank}"
    assert run.loss_series() == ddp.loss_series()
    assert len([s for s in run.loss_series() if s[2]]) == steps
