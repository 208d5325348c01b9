"""LetoStrategy: registration, option validation, and the combinations it rejects (with what
to do instead)."""

from __future__ import annotations

import os
import subprocess
import sys

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.strategies import StrategyRegistry
from pl_job import RunConfig, TinyModule, dataloaders, fit, trainer_for

from leto_lightning.integrations.lightning import LetoStrategy, _autoregister, register
from leto_lightning.integrations.lightning.proxy import proxy_for, real_optimizer
from leto_lightning.retained.config import RetainedConfig
from leto_lightning.retained.shm import list_segments
from leto_lightning.testing.crash import ChildError, KillPoint, run_in_child


def test_registered_once_and_idempotent() -> None:
    assert "leto" in StrategyRegistry
    register()
    register()  # a second import / call must not raise "already present"
    assert StrategyRegistry["leto"]["strategy"] is LetoStrategy
    assert "ddp" in StrategyRegistry  # the inherited ddp* registrations are untouched


_LAZY = """
import sys
import leto_lightning.integrations.lightning
assert "lightning.pytorch" not in sys.modules, "the integration imported Lightning eagerly"
import lightning.pytorch as pl
from lightning.pytorch.strategies import StrategyRegistry
assert "leto" in StrategyRegistry
assert type(pl.Trainer(strategy="leto", accelerator="cpu", devices=1, logger=False).strategy).__name__ == "LetoStrategy"
"""


def test_registration_waits_for_lightning_import() -> None:
    """A fresh interpreter: importing the integration does not import Lightning, and
    ``Trainer(strategy="leto")`` works once Lightning is imported afterwards."""
    result = subprocess.run([sys.executable, "-c", _LAZY], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]


def test_after_import_hook(tmp_path, monkeypatch) -> None:
    pkg = tmp_path / "leto_fake_target"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("VALUE = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(_autoregister, "TARGET", "leto_fake_target")
    seen = []
    assert _autoregister.install(lambda: seen.append(sys.modules["leto_fake_target"].VALUE))
    assert seen == []
    import leto_fake_target  # noqa: F401

    assert seen == [1]  # after the module executed
    assert not any(isinstance(f, _autoregister._AfterImport) for f in sys.meta_path)
    monkeypatch.delitem(sys.modules, "leto_fake_target")
    monkeypatch.setattr(_autoregister.importlib.util, "find_spec", lambda name: None)
    assert _autoregister.install(lambda: seen.append("again")) is False  # Lightning not installed
    assert seen == [1]


def test_trainer_by_name_uses_env_job_id(job: str) -> None:
    def child() -> dict:
        os.environ["LETO_JOB_ID"] = job
        out = fit(RunConfig(strategy="leto", max_epochs=1))
        return {"step": out["global_step"], "record": out["record"], "after": list_segments(f"leto-{job}-")}

    out = run_in_child(child).value
    assert out["step"] == 5
    assert out["record"] is not None, "the named strategy allocated no retained memory under LETO_JOB_ID"
    assert out["after"] == [], "a completed fit left its retained memory behind"


def test_options_build_retained_config() -> None:
    s = LetoStrategy(page_bytes=4096, chunk_pages=2, data_pages=4, tier1_parity=2, tier2_parity=0,
                     shadow_level="L2", heartbeat_interval=0.5, heartbeat_timeout=5.0, job_id="abc_1")
    assert s.retained_config == RetainedConfig(page_bytes=4096, chunk_pages=2, data_pages=4, tier1_parity=2,
                                               tier2_parity=0)
    assert (s.leto_options.shadow_level, s.leto_options.job_id) == (2, "abc_1")
    cfg = RetainedConfig(page_bytes=8192)
    assert LetoStrategy(retained=cfg).retained_config is cfg


@pytest.mark.parametrize("kwargs, message", [
    (dict(page_bytes=100), "multiple of 64"),
    (dict(tier1_parity=9, data_pages=8), "exceeds data_pages"),
    (dict(chunk_pages=0), "positive integer"),
    (dict(shadow_level=4), "choose 1, 2 or 3"),
    (dict(shadow_level="high"), "choose 1, 2 or 3"),
    (dict(heartbeat_interval=1.0, heartbeat_timeout=2.0), "at least 3 heartbeat intervals"),
    (dict(heartbeat_interval=0), "must be positive"),
    (dict(job_id="my-job"), "letters, digits"),
    (dict(resume="checkpoint"), "choose None"),
    (dict(retained=RetainedConfig(), page_bytes=4096), "not both"),
    (dict(gradient_as_bucket_view=True), "leave it False"),
    (dict(model_averaging_period=4), "model averaging"),
    (dict(start_method="spawn"), "leto launch"),
])
def test_bad_options_raise_when_built(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        LetoStrategy(**kwargs)


class _LBFGS(TinyModule):
    def configure_optimizers(self):
        return torch.optim.LBFGS(self.parameters())


class _Fused(TinyModule):
    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3, capturable=True)


@pytest.mark.parametrize("case, message", [
    ("lbfgs", "LBFGS"),
    ("fused", "capturable"),
    ("bf16-true", "precision 'bf16-true'"),
    ("devices", "does not start ranks"),
])
def test_rejected_at_setup_with_advice(case: str, message: str, job: str) -> None:
    def child() -> None:
        models = {"lbfgs": _LBFGS, "fused": _Fused}
        model = models.get(case, TinyModule)()
        kwargs = dict(accelerator="cpu", devices=2 if case == "devices" else 1, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                      max_epochs=1, precision="bf16-true" if case == "bf16-true" else "32-true")
        trainer = pl.Trainer(strategy=LetoStrategy(job_id=job), **kwargs)
        train, val = dataloaders()
        trainer.fit(model, train, val)

    with pytest.raises(ChildError, match=message):
        run_in_child(child)


def test_existing_store_is_not_overwritten(job: str) -> None:
    crashed = run_in_child(lambda: fit(RunConfig(strategy=LetoStrategy(job_id=job), max_epochs=1)),
                           kill_at=KillPoint("prepare.begin", 3))  # a crash keeps the store for a resume
    assert crashed.killed
    with pytest.raises(ChildError, match="already exists: continue from it"):
        run_in_child(lambda: fit(RunConfig(strategy=LetoStrategy(job_id=job), max_epochs=1)))


def test_second_fit_in_the_same_process_starts_a_new_store(job: str) -> None:
    def child() -> tuple:
        strategy = LetoStrategy(job_id=job)
        trainer = trainer_for(RunConfig(strategy=strategy, max_epochs=1))
        model = TinyModule()
        train, val = dataloaders()
        stores = []
        trainer.callbacks.append(pl.Callback())
        trainer.callbacks[-1].on_train_end = lambda *_: stores.append((strategy.retained.store,
                                                                       strategy.retained.iteration))
        trainer.fit(model, train, val)
        trainer.fit_loop.max_epochs = 2
        trainer.fit(model, train, val)  # continues training: a fresh optimizer, hence a fresh store
        (first, _), (second, iteration) = stores
        return first is not second, iteration, trainer.global_step, strategy.retained is None

    new_store, iteration, step, freed = run_in_child(child).value
    assert new_store and (iteration, step) == (5, 10) and freed


def test_proxy_is_an_instance_of_the_optimizer_class() -> None:
    p = torch.nn.Parameter(torch.zeros(3))
    opt = torch.optim.AdamW([p], lr=0.1)
    calls = []
    proxy = proxy_for(opt, lambda closure: calls.append(closure) or "loss")
    assert isinstance(proxy, torch.optim.AdamW) and type(proxy).__name__ == "LetoAdamW"
    assert type(proxy_for(opt, lambda c: None)) is type(proxy)  # one class per optimizer class
    assert proxy.param_groups is opt.param_groups and proxy.state is opt.state and proxy.defaults is opt.defaults
    assert proxy.step(closure=None) == "loss" and calls == [None]
    proxy.param_groups[0]["lr"] = 0.5
    assert opt.param_groups[0]["lr"] == 0.5
    proxy._opt_called = True  # attribute writes reach the real optimizer
    assert opt._opt_called is True and real_optimizer(proxy) is opt
    with pytest.raises(RuntimeError, match="configure_optimizers"):
        proxy.add_param_group({"params": [torch.nn.Parameter(torch.zeros(1))]})
    with pytest.raises(TypeError, match="only the closure"):
        proxy.step(None, foo=1)


def test_lr_scheduler_keeps_its_step_wrapper(job: str) -> None:
    """The proxy must not replace ``optimizer.step`` (schedulers wrap it on the instance) and
    must set ``_opt_called`` (torch warns when a scheduler steps before its optimizer)."""
    def child() -> tuple:
        import warnings

        trainer = trainer_for(RunConfig(strategy=LetoStrategy(job_id=job), max_epochs=1))
        model = TinyModule()
        train, val = dataloaders()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer.fit(model, train, val)
        opt = trainer.optimizers[0]
        order = [str(w.message) for w in caught if "lr_scheduler.step()" in str(w.message)]
        return hasattr(opt.step, "_wrapped_by_lr_sched"), "step" not in type(opt).__dict__, order

    wrapped, _, warned = run_in_child(child).value
    assert wrapped and not warned
