"""The launcher of ``LetoStrategy``: runs the trainer function in this process, never spawns.

Why: Lightning's own launcher (like torchrun) watches the ranks it started and kills every one
of them when one exits -- exactly the failure Leto recovers from in place. Ranks are started
by ``leto launch``. The launcher is also the one place that sees ``fit()``'s arguments before
Lightning resolves ``ckpt_path``: it turns ``LETO_RESUME=retained`` (and, under ``leto
launch``, the shadow role) into ``ckpt_path="leto://retained"``, and resolves a checkpoint
file ("last", "best", a path) the way Lightning will.

Which launchers work (checked when the Trainer is built, ``check_launch``):

- ``leto launch --nproc-per-node N script.py``: yes (``LETO_ROLE`` in the environment).
- ``python script.py`` with ``devices > 1`` (where Lightning's own launcher would start the
  ranks and kill them all when one dies): the process re-runs itself as ``leto launch
  --nproc-per-node N script.py ...`` (exec) and becomes the ranks' supervisor.
- ``torchrun ... script.py`` and ``srun python script.py`` (both stop every rank when one of
  their processes dies): each process they start becomes its rank's agent -- it execs itself
  into ``leto launch --nproc-per-node 1 --nnodes WORLD_SIZE --node-rank RANK --trainer-layout
  ...`` and runs the rank's active and shadow trainers as its children, so the launcher never
  sees a rank die (``per_rank.py``: store, run directory, tier 2). Refused, saying what to do:
  a layout other than the Trainer's ``devices x num_nodes`` (numbered node by node), a module
  or ``-c`` instead of a script file, ``LETO_NO_SUPERVISE=1``.
- ``python script.py`` from ``python -c``, a REPL, ``python -m`` or with ``LETO_NO_SUPERVISE=1``:
  refused, naming the ``leto launch`` command.
- ranks started by hand with ``RANK``/``LOCAL_RANK``/``WORLD_SIZE`` (tests, custom launchers):
  accepted; recovery is then the caller's job (``updater.recovery.recover_node`` and
  ``fit(ckpt_path="leto://retained")``).
"""

from __future__ import annotations

import inspect
import os
import sys
from collections.abc import Callable
from typing import Any, Protocol

import lightning.pytorch as pl
from lightning.fabric.plugins.environments import ClusterEnvironment
from typing_extensions import override

from ...console import notice
from ...env import NO_SUPERVISE
from ...errors import UsageError
from ...runtime.options import LetoRuntimeOptions
from .environment import under_leto_launch
from .internals import Launcher, is_fit_impl, set_num_threads_if_needed
from .per_rank import become_rank_agent, detect


class LaunchedStrategy(Protocol):
    """What the launcher needs of ``LetoStrategy`` (a protocol: this module sits below it)."""

    leto_options: LetoRuntimeOptions

    @property
    def num_processes(self) -> int: ...

    @property
    def num_nodes(self) -> int: ...

    @property
    def cluster_environment(self) -> ClusterEnvironment | None: ...

    def resolve_fit_ckpt_path(self, ckpt_path: Any, trainer: pl.Trainer | None = None) -> Any: ...


def _script() -> str:
    return os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] not in ("", "-c") else "train.py"


def _plain_script() -> str | None:
    """The script path when this process runs ``python script.py`` (not ``-m``, ``-c``, a REPL or
    a console script such as ``pytest``): only then can it be re-run under ``leto launch``."""
    main = sys.modules.get("__main__")
    path = sys.argv[0] if sys.argv else ""
    if getattr(main, "__spec__", None) is not None or not path.endswith(".py") or not os.path.isfile(path):
        return None
    return os.path.abspath(path)


def supervise(argv: list[str], script: str) -> None:
    """Replace this process by ``leto launch`` running the same script: this process becomes the
    agent (the ranks' supervisor), so the outer launcher never sees a rank die."""
    command = "leto " + " ".join(argv[2 : argv.index(script)])
    notice(f"LetoStrategy: re-running this script under `{command}` (Lightning's launcher would stop every rank "
           f"when one fails; set {NO_SUPERVISE}=1 to refuse instead)")
    sys.stderr.flush()
    os.execv(sys.executable, [sys.executable, *argv])


def _supervisor_argv(strategy: LaunchedStrategy, script: str) -> list[str]:
    return ["-m", "leto_lightning.cli", "launch", "--nproc-per-node", str(strategy.num_processes), script,
            *sys.argv[1:]]


def check_launch(strategy: LaunchedStrategy) -> None:
    """Launchers that kill every rank when one dies: become their ranks' supervisor (re-run the
    script under ``leto launch``; under torchrun/srun each process becomes its rank's agent) or,
    where that is impossible, refuse naming the command."""
    if under_leto_launch():
        return
    ranks = strategy.num_processes * strategy.num_nodes
    script = _plain_script()
    rank_launch = detect(strategy.cluster_environment, strategy.num_processes)
    if rank_launch is not None:  # execs, or raises saying what to do
        become_rank_agent(rank_launch, script, strategy.num_processes, strategy.num_nodes, strategy.leto_options)
    lightning_spawns = ranks > 1 and not os.environ.get("TORCHELASTIC_RUN_ID") and not (
        strategy.cluster_environment is not None and strategy.cluster_environment.creates_processes_externally)
    if lightning_spawns and script and os.environ.get(NO_SUPERVISE) != "1" and strategy.num_nodes == 1:
        supervise(_supervisor_argv(strategy, script), script)
    command = f"`leto launch --nproc-per-node {strategy.num_processes} {_script()}`"
    env = strategy.cluster_environment
    if ranks > 1 and not (env is not None and env.creates_processes_externally):
        raise UsageError(
            f"LetoStrategy does not start ranks itself (Trainer asks for {ranks} devices): Lightning's launcher kills "
            f"every rank when one dies, which is what Leto recovers from in place. Start the script with {command}.")


class LetoLauncher(Launcher):
    """Runs the trainer function in this process; never spawns ranks (``leto launch`` does)."""

    def __init__(self, strategy: LaunchedStrategy) -> None:
        self._strategy = strategy

    @property
    @override
    def is_interactive_compatible(self) -> bool:
        return True

    @override
    def launch(self, function: Callable, *args: Any, trainer: pl.Trainer | None = None, **kwargs: Any) -> Any:
        strategy = self._strategy
        check_launch(strategy)
        # What "ddp"'s launcher does in every process it runs (started by it, torchrun or by hand): with
        # OMP_NUM_THREADS unset, CPUs // processes intra-op threads. Another thread count changes the
        # reduction order of CPU kernels (LayerNorm gradients differ by an ulp from the first step).
        set_num_threads_if_needed(num_processes=strategy.num_processes)
        if is_fit_impl(function):
            bound = inspect.signature(function).bind(*args, **kwargs)
            bound.arguments["ckpt_path"] = strategy.resolve_fit_ckpt_path(bound.arguments.get("ckpt_path"), trainer)
            args, kwargs = bound.args, bound.kwargs
        return function(*args, **kwargs)

    @override
    def kill(self, signum: Any) -> None:
        """Nothing to kill: this launcher started no processes."""
