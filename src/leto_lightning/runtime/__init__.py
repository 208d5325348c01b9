"""In-place recovery runtime: ``leto launch``, the agent, shadows, detection, classification.

Training scripts use ``leto_lightning.runtime.init()`` (see ``session.py``).
"""

from .session import ProtectedTraining, Session, init

__all__ = ["ProtectedTraining", "Session", "init"]
