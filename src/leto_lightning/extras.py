"""Optional dependencies: import one where it is needed, or say which extra installs it.

The core (``retained``, ``protection``, ``updater``, ``runtime``) and the simulator need only the
packages in ``[project] dependencies``; plots, the demo's tables, Lightning, Accelerate and NVML
come with extras (``pip install "leto-lightning[sim]"``, ``[demo]``, ``[lightning]``,
``[accelerate]``, ``[cuda]``; ``[test]`` installs all of them). ``require`` is how the code that
uses one of them imports it, ``check`` how a command refuses early (before minutes of work) when
one it will need is missing: either way a ``MissingExtraError`` naming the extra.

A leaf module: it imports only ``errors`` and the standard library.
"""

from __future__ import annotations

import importlib
import importlib.util
from types import ModuleType

from .errors import MissingExtraError

EXTRAS = {  # top-level import name -> (distribution, the extra that installs it)
    "lightning": ("lightning", "lightning"),
    "accelerate": ("accelerate", "accelerate"),
    "matplotlib": ("matplotlib", "sim"),
    "rich": ("rich", "demo"),
    "wandb": ("wandb", "demo"),
    "tensorboard": ("tensorboard", "test"),
    "pynvml": ("nvidia-ml-py", "cuda"),
}


def install_hint(module: str) -> str:
    """``pip install "leto-lightning[EXTRA]"`` for the extra that provides ``module``."""
    top = module.split(".")[0]
    dist, extra = EXTRAS.get(top, (top, "test"))
    return f'pip install "leto-lightning[{extra}]" (or: pip install {dist})'


def require(module: str, purpose: str) -> ModuleType:
    """``importlib.import_module(module)``; when the package is not installed, a
    ``MissingExtraError`` saying what needs it (``purpose``) and which extra installs it."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as exc:
        top = module.split(".")[0]
        if exc.name is None or exc.name.split(".")[0] != top:
            raise  # the package is there but something it imports is not: its own error says what
        raise MissingExtraError(f"{purpose} needs {top!r}, which is not installed: {install_hint(module)}") from None


def check(purpose: str, *modules: str) -> None:
    """Refuse now, naming the extras, when any of ``modules`` is not installed (nothing is imported)."""
    missing = [m for m in modules if importlib.util.find_spec(m.split(".")[0]) is None]
    if missing:
        hints = "; ".join(dict.fromkeys(install_hint(m) for m in missing))
        raise MissingExtraError(f"{purpose} needs {', '.join(repr(m) for m in missing)}, not installed: {hints}")
