"""``LetoConfig``: Leto's options for ``LetoAccelerator``, validated when built.

The fields are exactly ``LetoStrategy``'s: every ``RetainedConfig`` field (memory: pages,
chunks, parity) and every ``LetoRuntimeOptions`` field (how this trainer takes part in a Leto
job), validated by those two classes -- the same checks and messages as in Lightning -- plus
``rollback_window`` (the exact mode, docs/accelerate.md).

Accelerate rejects unknown keys in its config files and third-party kwargs handlers, so Leto's
options come in ``LetoAccelerator(leto=LetoConfig(...))`` and from ``LETO_<FIELD>`` environment
variables (``LETO_TIER1_PARITY=2``), which every launcher passes on to every worker. The
environment wins over the code: a job can be re-tuned without editing the script.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from ...env import field_override
from ...errors import ConfigurationError
from ...retained.config import RetainedConfig
from ...runtime.options import LetoRuntimeOptions

# Set by `leto launch` for its trainers with their own meaning (the agent's job id, "retained" or
# "checkpoint" on a restart): read through LetoRuntimeOptions.resolved_job_id / resume_requested,
# never as overrides of a field.
_LAUNCHER_OWNED = ("job_id", "resume")
_RETAINED = list(dataclasses.fields(RetainedConfig))
_RUNTIME = list(dataclasses.fields(LetoRuntimeOptions))


class _LetoConfigBase:
    """Methods of ``LetoConfig`` (its fields are made from the two option classes below)."""

    if TYPE_CHECKING:  # the fields are made at run time (``make_dataclass`` below)
        rollback_window: bool
        shadow_level: Any
        heartbeat_interval: float

        def __init__(self, **fields: Any) -> None: ...

    def __post_init__(self) -> None:
        if not isinstance(self.rollback_window, bool):
            raise ConfigurationError(f"rollback_window={self.rollback_window!r}: choose True (the exact "
                                     "mode: user code after opt.step() is redone after a crash) or False")
        self.retained_config()  # raises ConfigurationError naming the value and the fix
        try:  # LetoRuntimeOptions raises plain ValueErrors: the same messages, from the error root
            object.__setattr__(self, "shadow_level", LetoRuntimeOptions.parse_level(self.shadow_level))
            self.runtime_options()
        except ConfigurationError:
            raise
        except ValueError as exc:
            raise ConfigurationError(str(exc)) from None

    def retained_config(self) -> RetainedConfig:
        return RetainedConfig(**{f.name: getattr(self, f.name) for f in _RETAINED})

    def runtime_options(self) -> LetoRuntimeOptions:
        return LetoRuntimeOptions(**{f.name: getattr(self, f.name) for f in _RUNTIME})

    def with_environment(self, env: Mapping[str, str] = os.environ) -> LetoConfig:
        """This config with every ``LETO_<FIELD>`` variable applied (validated again)."""
        changes: dict[str, Any] = {}
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            name = field_override(f.name)
            if f.name in _LAUNCHER_OWNED or env.get(name, "") == "":
                continue
            changes[f.name] = _parse(name, env[name], getattr(self, f.name))
        return dataclasses.replace(self, **changes) if changes else self  # type: ignore[type-var]


def _parse(name: str, text: str, current: Any) -> Any:
    """An environment value as the field's type (the field's default tells which)."""
    kind = type(current)
    try:
        if kind is bool:
            if text.lower() not in ("1", "0", "true", "false", "yes", "no"):
                raise ConfigurationError(text)
            return text.lower() in ("1", "true", "yes")
        if kind in (int, float):
            return kind(text)
    except ValueError:
        raise ConfigurationError(f"{name}={text!r}: expected {'true or false' if kind is bool else kind.__name__}"
                                 ) from None
    return text


def _fields() -> list[tuple[str, Any, Any]]:
    out: list[tuple[str, Any, Any]] = []
    for f in [*_RETAINED, *_RUNTIME]:
        default = f.default if f.default is not dataclasses.MISSING else None
        out.append((f.name, Any, dataclasses.field(default=default)))
    out.append(("rollback_window", bool, dataclasses.field(default=False)))
    return out


if TYPE_CHECKING:
    LetoConfig = _LetoConfigBase
else:
    LetoConfig = dataclasses.make_dataclass("LetoConfig", _fields(), bases=(_LetoConfigBase,), frozen=True)
LetoConfig.__module__ = __name__
LetoConfig.__doc__ = (
    "Leto's options for ``LetoAccelerator`` (module doc): every ``RetainedConfig`` field "
    f"({', '.join(f.name for f in _RETAINED)}), every ``LetoRuntimeOptions`` field "
    f"({', '.join(f.name for f in _RUNTIME)}) and rollback_window. Each may be overridden by "
    "``LETO_<FIELD>`` in the environment (job_id, resume and shadow_level are the launcher's).")
