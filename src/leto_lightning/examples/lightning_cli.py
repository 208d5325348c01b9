"""The tiny transformer of ``lightning_tiny.py`` behind Lightning's ``LightningCLI``, configured by
a YAML file whose trainer says ``strategy: leto`` (``configs/lightning/leto.yaml``).

    leto launch --nproc-per-node 2 src/leto_lightning/examples/lightning_cli.py fit --config configs/lightning/leto.yaml
    python src/leto_lightning/examples/lightning_cli.py fit --config configs/lightning/leto.yaml --trainer.devices 1

Any value of the file can be overridden on the command line (``--trainer.max_steps 100``), as
with every ``LightningCLI``; ``--print_config`` shows the resolved configuration. Needs
``jsonargparse[signatures]`` (in the ``[lightning]`` extra).
"""

from __future__ import annotations

import lightning.pytorch as pl
from lightning.pytorch.cli import LightningCLI
from torch.utils.data import DataLoader

import leto_lightning  # noqa: F401  registers Trainer(strategy="leto")
from leto_lightning.examples.lightning_tiny import TinyTransformerLM, markov_data


class MarkovDataModule(pl.LightningDataModule):
    """``lightning_tiny.py``'s data (a fixed random Markov chain) as a data module."""

    def __init__(self, batch_size: int = 8, batches_per_epoch: int = 10, ranks: int = 2, seq: int = 32,
                 vocab: int = 32) -> None:
        super().__init__()
        self.batch_size, self.batches, self.ranks = batch_size, batches_per_epoch, ranks
        self.seq, self.vocab = seq, vocab

    def train_dataloader(self) -> DataLoader:
        data = markov_data(self.batch_size * self.batches * self.ranks, self.seq, self.vocab, seed=1)
        return DataLoader(data, batch_size=self.batch_size, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(markov_data(32, self.seq, self.vocab, seed=2), batch_size=self.batch_size)


def main(args: list[str] | None = None) -> LightningCLI:
    """``args``: the command line (``None``: ``sys.argv``); returns the CLI (its trainer, model)."""
    return LightningCLI(TinyTransformerLM, MarkovDataModule, args=args, save_config_kwargs={"overwrite": True})


if __name__ == "__main__":
    main()
