"""``leto demo``: end to end (``demos.e2e``) or, with ``--core``, the retained-state core alone
(``demos.core``), as ``lightning.pytorch.demos`` holds Lightning's.

- ``leto demo``: tiny OLMoE trained with Lightning on 2 CPU ranks, fault-free and then with a
  trainer SIGKILLed mid-update every ``--hof-every`` iterations; each in-place recovery, a
  breakdown table, ETTR and a bit-identical check of the final state (minutes).
- ``leto demo --core``: two simulated devices on retained memory; a SIGKILL mid-update, poisoned
  pages, a lost device, damage beyond parity, each recovered in a fresh process and compared
  with a fault-free ``torch.optim`` run (seconds).

Both need the ``[demo]`` extra (``pip install "leto-lightning[demo]"``: rich, matplotlib, wandb,
Lightning). Nothing in the library imports this package.
"""

from __future__ import annotations

import argparse

__all__ = ["add_parser", "check_args", "run"]


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "demo",
        help="tiny OLMoE on 2 CPU ranks with HOFs injected, recovered in place, checked bit-identical",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--core", action="store_true",
                   help="the retained-state core only (seconds): SIGKILL mid-update, poisoned pages, a lost device")
    p.add_argument("--steps", type=int, default=40, help="end-to-end: training iterations")
    p.add_argument("--hof-every", type=int, default=10, help="end-to-end: a HOF every N iterations")
    p.add_argument("--run-dir", default=None, help="end-to-end: outputs (default: leto-runs/demo-<time>)")
    p.add_argument("--optimizer", default="adamw", help="--core: adamw | adam_amsgrad | sgd_nesterov | ...")
    p.add_argument("--seed", type=int, default=0, help="--core: seed of the model, data and fault choices")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ..extras import check

    check_args(args)
    if args.core:
        check("leto demo --core", "rich")
        from .core import run_core

        return run_core(args.optimizer, args.seed)
    import os
    import time

    from ..runtime.storage import usable_run_dir
    from .e2e import run_demo

    check("leto demo", "rich", "matplotlib", "lightning", "wandb")  # before minutes of training
    run_dir = usable_run_dir(args.run_dir or os.path.join("leto-runs", f"demo-{time.strftime('%Y%m%d-%H%M%S')}"))
    return run_demo(args.steps, args.hof_every, run_dir)


def check_args(args: argparse.Namespace) -> None:
    """Refuse what would fail only after the fault-free reference run (minutes)."""
    from ..errors import ConfigurationError
    from ..testing.scenario import OPTIMIZERS

    if args.core and args.optimizer not in OPTIMIZERS:
        raise ConfigurationError(f"--optimizer {args.optimizer!r} is not one the core demo knows: choose one of "
                                 f"{', '.join(sorted(OPTIMIZERS))}")
    if args.steps < 2:
        raise ConfigurationError(f"--steps {args.steps}: the demo needs at least 2 iterations")
    if not 1 <= args.hof_every < args.steps:
        raise ConfigurationError(f"--hof-every {args.hof_every}: a HOF every N iterations needs 1 <= N < --steps "
                                 f"({args.steps})")
