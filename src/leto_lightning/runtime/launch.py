"""``leto launch``: start a job whose ranks survive hardware-operable failures in place."""

from __future__ import annotations

import argparse
import json
import os
import time

from ..env import warm_template_enabled
from ..errors import ConfigurationError
from .agent import Agent, LaunchSpec
from .config import ClassificationRule, RuntimeConfig
from .reclaim import add_arguments as add_reclaim_arguments
from .reclaim import config_from_args as reclaim_config_from_args
from .rundir import DEFAULT_MODE, mode_argument
from .storage import usable_run_dir


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "launch",
        help="run a training script on N ranks with shadows and in-place recovery",
        description=(
            "Start, per node, the agent, N active trainers and N shadow trainers (the same script with "
            "LETO_ROLE=shadow). Sets RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT "
            "like torchrun. Exits with the script's status. Events go to RUN_DIR/events.jsonl."
        ),
    )
    env = os.environ
    p.add_argument("--nproc-per-node", type=int, default=int(env.get("LOCAL_WORLD_SIZE", 1)))
    p.add_argument("--nnodes", type=int, default=int(env.get("SLURM_NNODES", env.get("NNODES", 1))))
    p.add_argument("--node-rank", type=int, default=int(env.get("SLURM_NODEID", env.get("NODE_RANK", 0))))
    p.add_argument("--spares", type=int, default=0, metavar="K",
                   help="hot spare nodes: start `leto launch` on NNODES + K nodes, node ranks NNODES..NNODES+K-1 "
                        "wait warm and take over a lost node (its machine, memory or device gone) with its ranks' "
                        "state from a data-parallel replica, no checkpoint restart (docs/spares.md). Needs "
                        "--nnodes 2 or more: node 0 hosts the job's store")
    p.add_argument("--node-timeout", type=float, default=30.0,
                   help="with --spares: seconds without a beat from a node's agent before the node counts as lost")
    p.add_argument("--master-addr", default=env.get("MASTER_ADDR", "127.0.0.1"))
    p.add_argument("--master-port", type=int, default=int(env.get("MASTER_PORT", 0)),
                   help="TCPStore port (0: a free port; single node only)")
    p.add_argument("--run-dir", default=None, help="events, checkpoints, outputs (default: leto-runs/<time>)")
    p.add_argument("--run-dir-mode", type=mode_argument, default=DEFAULT_MODE, metavar="MODE",
                   help="permissions of the run dir (default 0700; files get them without x bits: 0600). "
                        "E.g. 0750 lets your group read it (docs/security.md)")
    p.add_argument("--secret-file", default=None, metavar="PATH",
                   help="the job's control-plane secret (0600 file), the same on every node of a multi-node job "
                        "(or LETO_SECRET; docs/security.md)")
    p.add_argument("--heartbeat-timeout", type=float, default=60.0, help="seconds without progress = hang")
    p.add_argument("--startup-timeout", type=float, default=300.0)
    p.add_argument("--shadow-level", type=int, choices=(1, 2, 3), default=3,
                   help="3: full pre-init, 2: device runtime only, 1: interpreter and imports")
    p.add_argument("--no-shadows", action="store_true", help="recover by starting new trainers (slower)")
    p.add_argument("--no-warm-template", action="store_true",
                   help="start every trainer from a new interpreter instead of forking it from a process "
                        "that already imported the script's modules (also: LETO_WARM_TEMPLATE=0; docs/runtime.md)")
    p.add_argument("--max-failures", type=int, default=20, help="failures allowed within --failure-window")
    p.add_argument("--failure-window", type=float, default=3600.0)
    p.add_argument("--non-hof-exit-code", type=int, action="append", default=[],
                   help="an exit code that means the device is not operable (checkpoint restart)")
    p.add_argument("--faults", default="", help="JSON list of injected faults (tests, demos)")
    add_reclaim_arguments(p)
    g = p.add_argument_group(
        "per-rank supervision",
        "How LetoStrategy runs under torchrun and srun: each process they start becomes the agent of one rank "
        "(--nproc-per-node 1, --nnodes WORLD_SIZE, --node-rank RANK), so the launcher never sees a rank die. "
        "Built by the strategy itself; rarely typed by hand.")
    g.add_argument("--trainer-layout", type=_layout, default=None, metavar="LOCAL_RANK,LOCAL_WORLD_SIZE,NODE_RANK",
                   help="the rank's real place: its trainers get these LOCAL_RANK, LOCAL_WORLD_SIZE and "
                        "GROUP_RANK/LETO_NODE_RANK (RANK and WORLD_SIZE stay --node-rank and --nnodes). Requires "
                        "--nproc-per-node 1 and RANK = NODE_RANK x LOCAL_WORLD_SIZE + LOCAL_RANK. The agent of local "
                        "rank 0 repairs every retained store of its machine (tier-2 parity spans them)")
    g.add_argument("--external-store", action="store_true",
                   help="connect to a TCPStore someone else hosts at --master-addr:--master-port (torchrun's agent "
                        "store) instead of hosting one in the node-0 agent")
    g.add_argument("--store-prefix", default="", help="namespace of this job's keys in that store")
    p.add_argument("script")
    p.add_argument("script_args", nargs=argparse.REMAINDER)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    run_dir = args.run_dir or os.path.join("leto-runs", time.strftime("%Y%m%d-%H%M%S"))
    usable_run_dir(run_dir, args.run_dir_mode)  # a file, or read-only: one line before anything starts
    spec = LaunchSpec(script=args.script, args=args.script_args, nproc_per_node=args.nproc_per_node,
                      nnodes=args.nnodes, node_rank=args.node_rank, master_addr=args.master_addr,
                      master_port=args.master_port, run_dir=run_dir,
                      faults=parse_faults(args.faults), trainer_layout=args.trainer_layout,
                      external_store=args.external_store, store_prefix=args.store_prefix,
                      run_dir_mode=args.run_dir_mode, secret_file=args.secret_file, spares=args.spares)
    rules = tuple(ClassificationRule(False, f"exit code {c} declared non-HOF (--non-hof-exit-code)", exit_code=c)
                  for c in args.non_hof_exit_code)
    config = RuntimeConfig(heartbeat_timeout=args.heartbeat_timeout, startup_timeout=args.startup_timeout,
                           shadow_level=args.shadow_level, shadows=not args.no_shadows,
                           warm_template=not args.no_warm_template and warm_template_enabled(),
                           max_failures=args.max_failures, failure_window=args.failure_window, extra_rules=rules,
                           node_timeout=args.node_timeout)
    return Agent(spec, config, reclaim=reclaim_config_from_args(args)).run()


FAULT_KEYS = {"id", "rank", "point"}  # what every injected fault names (faults/injector.py)


def parse_faults(text: str) -> list[dict]:
    """``--faults``: a JSON list of objects, each with at least an id, a rank and a point."""
    if not text:
        return []
    try:
        faults = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigurationError(f"--faults {text!r} is not JSON ({exc.msg}): give a JSON list of fault objects, "
                                 'e.g. \'[{"id": 0, "rank": 1, "point": "compute.begin", "iteration": 5}]\'') from None
    if not isinstance(faults, list):
        raise ConfigurationError(f"--faults {text!r}: expected a JSON list of fault objects, "
                                 f"got {type(faults).__name__}")
    for fault in faults:
        if not isinstance(fault, dict) or not fault.keys() >= FAULT_KEYS:
            raise ConfigurationError(f"--faults: {json.dumps(fault)} is not a fault: each needs "
                                     f"{', '.join(sorted(FAULT_KEYS))} (e.g. {{\"id\": 0, \"rank\": 1, "
                                     '"point": "compute.begin"})')
    return faults


def _layout(text: str) -> tuple[int, int, int]:
    """``LOCAL_RANK,LOCAL_WORLD_SIZE,NODE_RANK`` -> three ints (range checks: ``LaunchSpec``)."""
    try:
        local_rank, local_world_size, node = (int(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r}: expected LOCAL_RANK,LOCAL_WORLD_SIZE,NODE_RANK (three integers)") from None
    return local_rank, local_world_size, node
