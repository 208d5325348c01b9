"""The launcher-to-worker contract (leto_lightning/env.py): one writer, one reader, clear refusals."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

from leto_lightning import env as contract
from leto_lightning.env import ResumeMode, Role, WorkerContract, worker_environment
from leto_lightning.errors import ConfigurationError


def _full() -> WorkerContract:
    return WorkerContract(
        role=Role.SHADOW, job_id="t1x0a1b2c3", run_dir="/tmp/run", node_rank=1, generation=4, shadow_set="4-1",
        shadow_level=2, resume=ResumeMode.RETAINED, faults=({"id": "f0", "point": "update.after_prepare"},),
        events="/tmp/run/events.jsonl", store_prefix="leto/abc/0", auth_key="ab" * 32,
        cuda_manager="/tmp/run/leto-j-l0-statemgr.sock")


def test_round_trip_every_field() -> None:
    c = _full()
    env = c.to_env()
    assert set(env) == set(contract.CONTRACT_VARIABLES)
    assert all(isinstance(v, str) for v in env.values())
    assert WorkerContract.from_env(env) == c


def test_round_trip_minimal_leaves_optional_variables_out() -> None:
    c = WorkerContract(role="active", job_id="j")  # plain strings are accepted and typed
    assert c.role is Role.ACTIVE and c.resume is ResumeMode.FRESH
    env = c.to_env()
    assert contract.EVENTS not in env and contract.STORE_PREFIX not in env and contract.AUTH_KEY not in env
    assert contract.CUDA_MANAGER not in env
    assert env[contract.RESUME] == "" and json.loads(env[contract.FAULTS]) == []
    assert WorkerContract.from_env(env) == c


def test_defaults_of_absent_variables() -> None:
    c = WorkerContract.from_env({contract.ROLE: "active", contract.JOB_ID: "j"})
    assert (c.run_dir, c.node_rank, c.generation, c.shadow_set, c.shadow_level, c.resume, c.faults, c.events,
            c.store_prefix) == (".", 0, 0, "0", 3, ResumeMode.FRESH, (), None, "")


def test_enums_compare_as_their_strings() -> None:
    assert Role.SHADOW == "shadow" and ResumeMode.CHECKPOINT == "checkpoint" and f"{Role.ACTIVE}" == "active"
    assert [m.value for m in ResumeMode] == ["", "retained", "checkpoint"]


def test_secret_never_in_repr() -> None:
    assert "ab" * 32 not in repr(_full())


@pytest.mark.parametrize(("name", "value", "match"), [
    ("LETO_ROLE", "standby", r"LETO_ROLE='standby': choose one of 'active', 'shadow'"),
    ("LETO_RESUME", "file", r"LETO_RESUME='file': choose one of '', 'retained', 'checkpoint'"),
    ("LETO_GENERATION", "two", r"LETO_GENERATION='two': expected an integer"),
    ("LETO_GENERATION", "-1", r"LETO_GENERATION=-1: expected an integer >= 0"),
    ("LETO_NODE_RANK", "1.5", r"LETO_NODE_RANK='1.5': expected an integer"),
    ("LETO_SHADOW_LEVEL", "4", r"LETO_SHADOW_LEVEL=4: choose 0, 1, 2 or 3"),
    ("LETO_FAULTS", "[{", r"LETO_FAULTS='\[\{': not JSON"),
    ("LETO_FAULTS", '{"id": 1}', r"LETO_FAULTS=.*expected a JSON list"),
    ("LETO_FAULTS", "[1]", r"LETO_FAULTS: every fault is a JSON object, got 1"),
    ("LETO_JOB_ID", "", r"LETO_JOB_ID='': a trainer needs the job id"),
])
def test_bad_values_name_the_variable_and_value(name: str, value: str, match: str) -> None:
    env = _full().to_env()
    env[name] = value
    with pytest.raises(ConfigurationError, match=match):
        WorkerContract.from_env(env)


def test_missing_required_variables_say_how_to_start() -> None:
    with pytest.raises(ConfigurationError, match=r"missing LETO_ROLE, LETO_JOB_ID.*leto launch --nproc-per-node"):
        WorkerContract.from_env({"RANK": "0"})
    assert not contract.under_launcher({}) and contract.under_launcher({contract.ROLE: "shadow"})


def test_worker_environment_drops_inherited_contract_values() -> None:
    base = {"PATH": "/bin", contract.STORE_PREFIX: "stale", contract.EVENTS: "old", contract.ROLE: "shadow"}
    env = worker_environment(base, WorkerContract(role=Role.ACTIVE, job_id="j"))
    assert env["PATH"] == "/bin" and env[contract.ROLE] == "active"
    assert contract.STORE_PREFIX not in env and contract.EVENTS not in env


def test_field_override_names() -> None:
    assert contract.field_override("tier1_parity") == "LETO_TIER1_PARITY"


def test_contract_is_a_leaf() -> None:
    """It imports only the standard library and leto_lightning.errors: every layer may use it."""
    tree = ast.parse(Path(contract.__file__).read_text())
    relative = {(n.level, n.module) for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.level}
    absolute = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    absolute |= {n.module.split(".")[0] for n in ast.walk(tree)
                 if isinstance(n, ast.ImportFrom) and not n.level and n.module}
    assert relative == {(1, "errors")}
    assert absolute <= {"__future__", "json", "os", "collections", "dataclasses", "enum", "typing"}
