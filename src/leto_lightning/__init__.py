"""leto-lightning: in-place recovery from hardware-operable failures in LLM training.

Parts (docs/design.md section 2): ``retained`` (paged retained memory), ``protection``
(two-tier Reed-Solomon parity), ``updater`` (chunk transactions), ``runtime``
(launcher, agent, detection), ``shadow`` (pre-warmed trainers), ``integrations``
(Lightning, Accelerate), ``sim`` (large-scale simulator).
"""

__version__ = "0.1.0"

# Trainer(strategy="leto"): registered as soon as lightning.pytorch is imported (lazy; costs nothing
# without Lightning).
from .integrations import lightning as _lightning_integration  # noqa: F401
