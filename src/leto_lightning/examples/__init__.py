"""Example training scripts run by ``leto launch`` (tests, benchmarks and docs use them)."""

from pathlib import Path

PLAIN_DDP = str(Path(__file__).with_name("plain_ddp.py"))
PLAIN_FSDP2 = str(Path(__file__).with_name("plain_fsdp2.py"))
RECIPE_TRAIN = str(Path(__file__).with_name("recipe_train.py"))
LIGHTNING_TINY = str(Path(__file__).with_name("lightning_tiny.py"))
ACCELERATE_TRAIN = str(Path(__file__).with_name("accelerate_train.py"))
