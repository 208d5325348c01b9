"""16-mixed: fp16 autocast with torch's ``GradScaler`` (Lightning's ``MixedPrecision`` plugin).

Lightning's plugin runs the closure, ``scaler.unscale_``, then ``scaler.step(optimizer)`` -- which
skips ``optimizer.step``, and so the retained transaction, when a gradient is inf/nan -- and
``scaler.update()``. The scaler starts at 2**24 with ``growth_interval=2``: the first five
steps overflow and back the scale off to 2**19, after which it grows every second successful
step and overflows again at once (15 steps: 8 skipped, 7 committed; growth and back-off both
happen). On CPU, ``Trainer(precision="16-mixed")`` becomes bf16-mixed, so the plugin is given
explicitly: ``MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", ...))``.

- fault-free: bit-identical to Lightning's single-device strategy and to Lightning's DDP (two
  ranks, from 2**20: 9 steps, 3 skipped) with the same plugin -- weights, buffers, optimizer
  state, the scaler's state entering every batch and at the end;
- SIGKILL mid-update (a ``"prepare"`` payload: ``resume.finish_batch`` applies the scaler's
  ``update()`` of that step, in both of its branches), between steps after a skipped step (the
  batch end of a skipped step is re-recorded), and before the first commit (every step so far
  skipped: the ``"start"`` payload), resumed in a new process: bit-identical, with the same loss
  and scale series.
"""

from __future__ import annotations

import itertools
import os

import pytest
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.plugins.precision import MixedPrecision
from pl_job import RunConfig, differences, fit, read_losses, run_ranks

from leto_lightning.integrations.lightning import RETAINED_CKPT, LetoStrategy
from leto_lightning.retained.store import RetainedStore
from leto_lightning.testing.crash import ChildError, KillPoint, run_in_child
from leto_lightning.updater.recovery import recover_node

CHUNKS = 7  # chunk transactions per step at page_bytes=512
# Committed iterations of the single-device run: steps 5, 6, 8, 9, 11, 12, 14 (0-4, 7, 10, 13 overflow).
COMMITTED_STEPS = [5, 6, 8, 9, 11, 12, 14]


class ScaleLog(Callback):
    """Appends the scaler's state entering every training batch to a file (``read_scales``):
    the crashed run writes it for the batch it dies in, the resumed run from the next one on."""

    def __init__(self, path: str) -> None:
        self.path = path

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx: int) -> None:
        state = trainer.precision_plugin.state_dict()
        with open(self.path, "a") as f:
            f.write(f"{trainer.current_epoch} {batch_idx} {float(state['scale']).hex()} {state['_growth_tracker']}\n")


def read_scales(path: str) -> dict[tuple[int, int], tuple[str, str]]:
    out: dict[tuple[int, int], tuple[str, str]] = {}
    if os.path.exists(path):
        with open(path) as f:
            for line in f:
                epoch, idx, scale, tracker = line.split()
                out[(int(epoch), int(idx))] = (scale, tracker)
    return out


def fp16_config(strategy, logs: str | None = None, init_scale: float = 2.0 ** 24, **kw) -> RunConfig:
    """The job of pl_job.py under 16-mixed; built inside the child (the scaler has state)."""
    plugin = MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=init_scale,
                                                                          growth_interval=2))
    callbacks = [ScaleLog(logs + ".scales")] if logs else []
    return RunConfig(strategy=strategy, precision=None, loss_file=logs and logs + ".losses",
                     trainer_kwargs={"plugins": [plugin], "callbacks": callbacks}, **kw)


def _leto(job: str) -> LetoStrategy:
    return LetoStrategy(job_id=job, page_bytes=512, chunk_pages=1, data_pages=4, tier1_parity=1)


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> tuple[dict, dict, dict]:
    """Lightning's single-device strategy, same plugin, no Leto: (snapshot, losses, scales)."""
    logs = str(tmp_path_factory.mktemp("fp16") / "ref")
    snap = run_in_child(lambda: fit(fp16_config("auto", logs))).value
    return snap, read_losses(logs + ".losses"), read_scales(logs + ".scales")


def test_bit_identical_to_single_device_with_overflow_steps(reference, job: str, tmp_path) -> None:
    logs = str(tmp_path / "leto")

    def leto() -> tuple:
        out = fit(fp16_config(_leto(job), logs))
        rec = out["record"]  # as the fit ended: a completed fit frees its retained memory
        return out, rec.iteration, rec.payload["kind"]

    got, iteration, kind = run_in_child(leto).value
    snap, losses, scales = reference
    assert differences(got, snap) == []
    assert read_losses(logs + ".losses") == losses and read_scales(logs + ".scales") == scales
    # 15 optimizer steps, 7 transactions: the scaler skipped 8 (its scale went down and up)
    assert (got["global_step"], iteration, kind) == (15, len(COMMITTED_STEPS) - 1, "validation_end")
    assert ups_and_downs(scales) == (3, 8)


def crash_and_resume(job: str, tmp_path, kill_at: KillPoint) -> dict:
    crash, resume = str(tmp_path / "crash"), str(tmp_path / "resume")
    crashed = run_in_child(lambda: fit(fp16_config(_leto(job), crash)), kill_at=kill_at)
    assert crashed.killed, f"the run finished without reaching {kill_at}"

    def resumed() -> dict:
        report = recover_node({0: RetainedStore.attach(job, 0)})[0]
        snap = fit(fp16_config(_leto(job), resume, seed=5, ckpt_path=RETAINED_CKPT))
        payload = report.payload or {}
        return {"snap": snap, "kind": payload.get("kind"), "global_step": payload.get("global_step"),
                "resume_iteration": report.resume_iteration}

    out = run_in_child(resumed).value
    for name, path in (("crash", crash), ("resume", resume)):
        out[name] = {"losses": read_losses(path + ".losses"), "scales": read_scales(path + ".scales")}
    return out


@pytest.mark.parametrize("kill_at, kind, payload_step, resume_iteration", [
    # mid-update of step 6 (iteration 1): the scaler's update grows the scale (tracker 1 -> 0)
    (KillPoint("chunk.math_done", 1 * CHUNKS + 4), "prepare", 6, 2),
    # the last chunk of step 8 (iteration 2): the update only counts (tracker 0 -> 1)
    (KillPoint("chunk.undo_copied", 2 * CHUNKS + 7), "prepare", 8, 3),
    # step 8 computed, its update not begun: the batch end of step 7, which the scaler skipped
    (KillPoint("prepare.begin", 3), "batch_end", 8, 2),
    # epoch 0 ends after five skipped steps, nothing committed: from the start
    (KillPoint("lightning.epoch_end", 1), "start", 0, 0),
])
def test_crash_resumes_bit_identical(kill_at: KillPoint, kind: str, payload_step: int, resume_iteration: int,
                                     reference, job: str, tmp_path) -> None:
    out = crash_and_resume(job, tmp_path, kill_at)
    assert (out["kind"], out["resume_iteration"]) == (kind, resume_iteration)
    assert out["global_step"] == payload_step  # as recorded (a prepare payload's is finished on resume)
    snap, losses, scales = reference
    assert differences(out["snap"], snap) == []  # the scaler's final state included
    for series, ref in (("losses", losses), ("scales", scales)):
        crash, resumed = out["crash"][series], out["resume"][series]
        assert all(crash[k] == resumed[k] for k in crash.keys() & resumed.keys()), f"a recomputed batch's {series}"
        assert {**crash, **resumed} == ref, series


def test_two_ranks_match_ddp(tmp_path, job: str) -> None:
    """Two ranks started externally, on gloo: LetoStrategy equals Lightning's DDP, 16-mixed."""
    cfg = dict(devices=2, max_epochs=3, init_scale=2.0 ** 20)  # 9 steps

    def run(strategy, rank: int, name: str) -> dict:
        out = fit(fp16_config(strategy, str(tmp_path / f"{name}{rank}"), seed=rank, **cfg))
        out["scales"] = read_scales(str(tmp_path / f"{name}{rank}.scales"))
        return out

    ddp = run_ranks(lambda rank: run("ddp", rank, "ddp"), world=2)
    leto = run_ranks(lambda rank: run(_leto(job), rank, "leto"), world=2)
    for rank in range(2):
        assert differences(leto[rank], ddp[rank]) == [], f"rank {rank}"
        assert leto[rank]["scales"] == ddp[rank]["scales"]
    assert ups_and_downs(ddp[0]["scales"]) == (2, 3)  # 9 steps: 3 skipped, 6 committed, the 3rd growth at the end


def ups_and_downs(scales: dict) -> tuple[int, int]:
    """How often the scale grew and how often it backed off (an overflow), batch to batch."""
    series = [float.fromhex(s) for s, _ in scales.values()]
    pairs = list(itertools.pairwise(series))
    return sum(b > a for a, b in pairs), sum(b < a for a, b in pairs)


def test_a_scaler_with_its_own_update_is_rejected(job: str) -> None:
    """Resume replays ``torch.amp.GradScaler.update``; a scaler that overrides it is refused."""
    class OwnScaler(torch.amp.GradScaler):
        def update(self, new_scale=None) -> None:
            super().update(new_scale)

    def run() -> None:
        plugin = MixedPrecision("16-mixed", "cpu", scaler=OwnScaler("cpu"))
        fit(RunConfig(strategy=_leto(job), precision=None, max_epochs=1, trainer_kwargs={"plugins": [plugin]}))

    with pytest.raises(ChildError, match="OwnScaler.*replays torch.amp.GradScaler"):
        run_in_child(run)
