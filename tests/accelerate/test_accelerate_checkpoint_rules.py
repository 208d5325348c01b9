"""``LetoAccelerator.save_state``/``load_state`` in one process (``python train.py``): the
checkpoint holds every parameter (retained views share one storage, which Accelerate's
safetensors writer would otherwise drop tensors of) and this rank's Leto file; ``load_state``
after a step, or twice, is refused with what to do; a plain ``Accelerator``'s checkpoint loads
into retained memory and ``leto_resume()`` leaves the positioning to the loop."""

from __future__ import annotations

from pathlib import Path

import pytest
import safetensors.torch
import torch
from accelerate import Accelerator

from leto_lightning.accelerate import LetoAccelerator, LetoConfig
from leto_lightning.errors import UsageError

LETO = LetoConfig(page_bytes=4096, data_pages=4, tier1_parity=1, record_bytes=1 << 16)


def _prepared(accelerator):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 6), torch.nn.Linear(6, 2))
    return accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))


def _step(model, opt) -> None:
    model(torch.ones(3, 6)).square().sum().backward()
    opt.step()
    opt.zero_grad()


def test_save_then_load_rules(tmp_path: Path) -> None:
    acc = LetoAccelerator(leto=LETO)
    model, opt = _prepared(acc)
    _step(model, opt)
    acc.save_state(str(tmp_path / "ckpt"))
    saved = safetensors.torch.load_file(str(tmp_path / "ckpt" / "model.safetensors"))
    assert sorted(saved) == sorted(n for n, _ in model.named_parameters())  # none dropped
    assert all(torch.equal(saved[n], p.detach()) for n, p in model.named_parameters())
    optimizer = torch.load(tmp_path / "ckpt" / "optimizer.bin", weights_only=False)["state"]
    assert all(t.untyped_storage().nbytes() == t.nbytes for s in optimizer.values() for t in s.values())  # copies
    assert "state_dict" not in vars(opt)  # the copying state_dict was only for the save
    assert (tmp_path / "ckpt" / "leto_state_0.pt").exists()
    with pytest.raises(UsageError, match=r"after an optimizer step.*before the training loop"):
        acc.load_state(str(tmp_path / "ckpt"))
    acc.end_training()

    fresh = LetoAccelerator(leto=LETO)
    model, opt = _prepared(fresh)
    fresh.load_state(str(tmp_path / "ckpt"))
    assert all(torch.equal(saved[n], p.detach()) for n, p in model.named_parameters())
    assert fresh.leto_resume().step == 1 and fresh.retained.iteration == 1 and fresh.leto_recoveries == 0
    with pytest.raises(UsageError, match="twice"):
        fresh.load_state(str(tmp_path / "ckpt"))
    fresh.end_training()


def test_a_plain_accelerator_checkpoint_loads_into_retained_memory(tmp_path: Path) -> None:
    plain = Accelerator(cpu=True)
    model, opt = _prepared(plain)
    _step(model, opt)
    plain.save_state(str(tmp_path / "plain"))
    expected = {n: p.detach().clone() for n, p in model.named_parameters()}
    state = opt.state_dict()["state"]

    acc = LetoAccelerator(leto=LETO)
    model, opt = _prepared(acc)
    acc.load_state(str(tmp_path / "plain"))
    assert acc.leto_resume() is None  # no Leto file: the loop positions itself
    assert all(torch.equal(expected[n], p.detach()) for n, p in model.named_parameters())
    assert all(torch.equal(state[i]["exp_avg"], opt.state_dict()["state"][i]["exp_avg"]) for i in state)
    acc.retained.store.require_complete()  # re-encoded and marked complete
    acc.end_training()


def test_the_fallback_takes_the_newest_checkpoint_every_rank_recorded(tmp_path) -> None:
    """The agent's checkpoint fallback (fallback.py): a rank that died while saving step 8 has
    not recorded it, so step 4 is taken; a new job forgets a previous job's records."""
    from leto_lightning.integrations.accelerate import fallback
    from leto_lightning.runtime.contract import RESUME, ResumeMode

    for step in (4, 8):  # remember() is called once a checkpoint's files are written
        (tmp_path / f"step_{step}").mkdir()
        (tmp_path / f"step_{step}" / "model.safetensors").write_bytes(b"weights")
    fallback.remember(str(tmp_path), 0, 4, str(tmp_path / "step_4"))
    fallback.remember(str(tmp_path), 0, 8, str(tmp_path / "step_8"))
    fallback.remember(str(tmp_path), 1, 4, str(tmp_path / "step_4"))
    assert fallback.saved(str(tmp_path), 0) == {4: str(tmp_path / "step_4"), 8: str(tmp_path / "step_8")}
    everyone = [sorted(fallback.saved(str(tmp_path), r)) for r in range(2)]
    assert fallback.newest_of_all(everyone) == 4
    assert fallback.newest_common(str(tmp_path), 0, world=1) == (8, str(tmp_path / "step_8"))  # one rank alone
    assert fallback.newest_of_all([[], [4]]) is None
    fallback.forget(str(tmp_path), 0)
    assert fallback.saved(str(tmp_path), 0) == {} and fallback.newest_common(str(tmp_path), 0, world=1) is None
    assert fallback.restarting_from_checkpoint({RESUME: ResumeMode.CHECKPOINT})
    assert not fallback.restarting_from_checkpoint({RESUME: ResumeMode.RETAINED})
