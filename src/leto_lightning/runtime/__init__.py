"""In-place recovery runtime: ``leto launch``, the agent, shadows, detection, classification.

Training scripts use ``leto_lightning.runtime.init()`` (see ``session.py``).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .protected import ProtectedTraining, init
    from .protected import TrainingSession as Session

__all__ = ["ProtectedTraining", "Session", "init"]


def __getattr__(name: str) -> Any:
    """The session names load on first use, so that importing one runtime module (the CLI's
    cleanup, the launcher) does not import the session, torch and the layers below."""
    if name in __all__:  # all from protected.py: init() gives a session that can protect()
        protected = importlib.import_module(".protected", __name__)
        return getattr(protected, "TrainingSession" if name == "Session" else name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
