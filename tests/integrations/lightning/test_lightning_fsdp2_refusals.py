"""FSDP1 with Leto is refused before training, in one line naming what was given and saying to
use FSDP2 through ``strategy="leto_fsdp2"`` (``fully_shard`` in ``configure_model``); so are the
other combinations ``LetoModelParallelStrategy`` cannot protect.

Runs in one forked child with a one-rank gloo group (a HashStore: no port), so this process never
holds a process group nor a patched ``Trainer``.
"""

from __future__ import annotations

from leto_lightning.testing.crash import run_in_child


def _attempts() -> dict[str, str]:
    import os

    import lightning.pytorch as pl
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import FullyShardedDataParallel, fully_shard
    from torch.utils.data import DataLoader, TensorDataset

    import leto_lightning  # noqa: F401  registers the strategies
    from leto_lightning.env import ROLE
    from leto_lightning.errors import LetoError
    from leto_lightning.integrations.lightning import launch_guard

    class Tiny(pl.LightningModule):
        def __init__(self, wrap: str) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(4, 3)
            self.wrap = wrap

        def configure_model(self) -> None:
            if self.wrap == "fsdp1":
                self.layer = FullyShardedDataParallel(self.layer, device_id=torch.device("cpu"))
            elif self.wrap == "fsdp2":
                fully_shard(self.layer, mesh=self.device_mesh["data_parallel"])

        def training_step(self, batch, batch_idx):
            return self.layer(batch[0]).sum()

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters())

    def outcome(make) -> str:
        try:
            trainer, module = make()
            trainer.fit(module, DataLoader(TensorDataset(torch.randn(4, 4)), batch_size=2))
        except LetoError as exc:
            return f"{type(exc).__name__}: {exc}"
        return "trained"

    def trainer(strategy, **kw) -> pl.Trainer:
        return pl.Trainer(strategy=strategy, accelerator="cpu", devices=1, max_steps=1, logger=False,
                          enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, **kw)

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        got = {
            "leto+fsdp1": outcome(lambda: (trainer("leto"), Tiny("fsdp1"))),
            "leto_fsdp2+fsdp1": outcome(lambda: (trainer("leto_fsdp2"), Tiny("fsdp1"))),
            "leto_fsdp2+unsharded": outcome(lambda: (trainer("leto_fsdp2"), Tiny("none"))),
            "leto_fsdp2+bf16-mixed": outcome(lambda: (trainer("leto_fsdp2", precision="bf16-mixed"), Tiny("fsdp2"))),
        }
        from leto_lightning.integrations.lightning.fsdp2_strategy import LetoModelParallelStrategy

        got["tensor_parallel"] = outcome(lambda: (LetoModelParallelStrategy(tensor_parallel_size=2), None))
        os.environ[ROLE] = "active"  # what leto launch sets in its trainers: the guard applies
        launch_guard.install()
        got["launch+fsdp"] = outcome(lambda: (trainer("fsdp"), None))
        got["launch+ddp"] = outcome(lambda: (trainer("ddp"), None))
    finally:
        dist.destroy_process_group()
    return got


def test_fsdp1_and_unprotectable_combinations_refused_naming_the_fix() -> None:
    got = run_in_child(_attempts, timeout=120).value
    assert got is not None
    for case in ("leto+fsdp1", "leto_fsdp2+fsdp1", "launch+fsdp"):
        message = got[case]
        assert message.startswith("ConfigurationError: ") and "\n" not in message, (case, message)
        assert "FSDP1" in message and "strategy='leto_fsdp2'" in message and "fully_shard" in message, (case, message)
    assert "module 'layer' is wrapped in FullyShardedDataParallel" in got["leto+fsdp1"]
    assert got["leto+fsdp1"].startswith("ConfigurationError: LetoStrategy:")
    assert got["leto_fsdp2+fsdp1"].startswith("ConfigurationError: LetoModelParallelStrategy:")
    assert "Trainer(strategy='fsdp') is FSDP1" in got["launch+fsdp"]
    assert "Trainer(strategy='ddp') under `leto launch` is DDPStrategy" in got["launch+ddp"]
    assert "strategy='leto' (DDP) or strategy='leto_fsdp2'" in got["launch+ddp"]
    assert "the model is not sharded" in got["leto_fsdp2+unsharded"] and "fully_shard" in got["leto_fsdp2+unsharded"]
    assert "precision 'bf16-mixed'" in got["leto_fsdp2+bf16-mixed"] and "MixedPrecisionPolicy" in got[
        "leto_fsdp2+bf16-mixed"]
    assert "tensor_parallel_size=2" in got["tensor_parallel"]
