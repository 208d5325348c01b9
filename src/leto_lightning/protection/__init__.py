"""protection: Reed-Solomon parity over retained pages (docs/design.md 2.2).

Pure coding on byte pages: GF(2^8) arithmetic, the codec, the erasure engines (ISA-L, torch),
checksums. It knows nothing of stores or layouts (the tier plans are ``retained.groups``) and
imports only ``leto_lightning.errors`` and the leaves.
"""

from ..errors import ProtectionError
from .checksum import CHECKSUM_ALGORITHM, checksum, checksum_many
from .codec import ReedSolomonCode
from .engines import ErasureEngine, available_engines, get_engine
from .errors import ParityExhaustedError

__all__ = [
    "CHECKSUM_ALGORITHM",
    "ErasureEngine",
    "ParityExhaustedError",
    "ProtectionError",
    "ReedSolomonCode",
    "available_engines",
    "checksum",
    "checksum_many",
    "get_engine",
]
