"""The trainer-side engine (``runtime/engine.py``): one object under every integration.

Behaviour: a real store in ``/dev/shm`` created, stepped, continued by a second engine and freed
through the engine alone. Structure (read from the source with ``ast``): one store set-up
routine, one writer per trainer-side protocol message, and two Lightning strategies that share
no copied method body.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import torch

import leto_lightning
from leto_lightning.retained.config import RetainedConfig
from leto_lightning.retained.shm import list_segments, new_job_id
from leto_lightning.retained.store import RetainedStore, StoreSpec
from leto_lightning.runtime.engine import RunMode, TrainerEngine
from leto_lightning.updater.retained_optimizer import RetainedOptimizer, config_for, layout_for

PACKAGE = Path(leto_lightning.__file__).parent


def _model_and_optimizer(seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Linear(8, 4)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _train(model: torch.nn.Module, engine: TrainerEngine, ro: RetainedOptimizer, iterations: int) -> None:
    for it in range(ro.iteration, ro.iteration + iterations):
        ro.zero_grad()
        engine.batch_start()
        model(torch.full((2, 8), float(it))).square().mean().backward()
        ro.payload_fn = lambda it=it: {"next": it + 1}
        engine.step(None, ro.step)


def test_a_store_created_stepped_continued_and_freed_through_the_engine() -> None:
    job = new_job_id("t")
    model, optimizer = _model_and_optimizer()
    config = config_for(RetainedConfig(tier2_parity=0), optimizer)
    spec = StoreSpec(job, 0, 0, 0, 1, layout_for(optimizer, config), config)

    def bind(store: RetainedStore) -> RetainedOptimizer:
        ro = RetainedOptimizer(optimizer, store)
        ro.bind(adopt=False)
        return ro

    first = TrainerEngine()
    ro = first.create(spec, bind, barrier=None, attach_with="a second engine")
    assert first.mode is RunMode.FRESH and ro.store.is_complete()
    _train(model, first, ro, 3)
    assert first.iteration == 3
    expected = {k: v.clone() for k, v in model.state_dict().items()}

    again_model, again_optimizer = _model_and_optimizer(seed=1)  # other initial weights: the store wins

    def attach(store: RetainedStore) -> RetainedOptimizer:
        bound = RetainedOptimizer(again_optimizer, store)
        bound.bind(adopt=True, resume=False)
        return bound

    second = TrainerEngine()
    second.attach(job, 0, attach)
    assert second.mode is RunMode.RESTARTED and second.mode.continues
    assert second.resume() == {"next": 3}
    for name, value in again_model.state_dict().items():
        assert torch.equal(value, expected[name]), name
    first.release()
    second.release(unlink=True)
    assert second.mode is RunMode.UNBOUND and second.bound is None
    assert [s for s in list_segments() if job in s] == []


# -- structure -----------------------------------------------------------------------------------
def _modules() -> dict[str, ast.Module]:
    return {str(p.relative_to(PACKAGE)): ast.parse(p.read_text(), str(p)) for p in PACKAGE.rglob("*.py")}


def _calls(tree: ast.Module) -> list[tuple[ast.Call, str]]:
    """Every call with the name of the function (or class.method) it is in."""
    found: list[tuple[ast.Call, str]] = []

    def visit(node: ast.AST, where: str) -> None:
        for child in ast.iter_child_nodes(node):
            name = where
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = f"{where}.{child.name}" if where else child.name
            if isinstance(child, ast.Call):
                found.append((child, where))
            visit(child, name)

    visit(tree, "")
    return found


def test_one_store_set_up_routine() -> None:
    """``RetainedStore.create`` is called in one place (``updater/store_setup.py``); tier 2 and
    the completion mark of a new store in the routine, the engine's deferred completion and
    the two reload paths (a checkpoint loaded into a bound store)."""
    creates, completes = set(), set()
    for name, tree in _modules().items():
        for call, where in _calls(tree):
            f = call.func
            if isinstance(f, ast.Attribute) and f.attr == "create" and isinstance(f.value, ast.Name) \
                    and f.value.id == "RetainedStore":
                creates.add(f"{name}:{where}")
            if isinstance(f, ast.Name) and f.id == "complete_new_store":
                completes.add(f"{name}:{where}")
    assert creates == {"updater/store_setup.py:create_node_store"}
    assert completes == {
        "updater/store_setup.py:set_up_store",  # a new store
        "runtime/engine.py:TrainerEngine.complete",  # Lightning DDP: after the wrap's broadcast
        "updater/fsdp2_state.py:RetainedShardState.initialise",  # FSDP2 shards loaded from a checkpoint
        "integrations/accelerate/checkpoint.py:load",  # LetoAccelerator.load_state into a bound store
    }


# key -> where the trainer side writes it (the agent's own writes are the agent's keys)
TRAINER_MESSAGES = {
    "HEARTBEAT": {"runtime/session.py:Session.heartbeat"},
    "RESUMED": {"runtime/session.py:Session.report_resumed"},
    "FIRST_DONE": {"runtime/session.py:Session.report_first_done"},
    "EXCEPTION": {"runtime/session.py:Session.report_exception"},
    "FINISHED": {"runtime/session.py:Session.mark_finished"},
    "SHADOW_READY": {"runtime/session.py:Session.signal_ready"},
    # a trainer's store, and a store a spare's agent received from a replica (its trainers attach to it)
    "STORE_READY": {"runtime/link.py:RuntimeLink.store_ready", "runtime/transfer.py:_receive"},
}


def test_one_writer_per_trainer_protocol_message() -> None:
    writers: dict[str, set[str]] = defaultdict(set)
    for name, tree in _modules().items():
        for call, where in _calls(tree):
            f = call.func
            if not (isinstance(f, ast.Attribute) and f.attr == "set" and call.args):
                continue
            key = call.args[0]
            if (isinstance(key, ast.Call) and isinstance(key.func, ast.Attribute) and key.func.attr == "format"
                    and isinstance(key.func.value, ast.Name) and key.func.value.id in TRAINER_MESSAGES):
                writers[key.func.value.id].add(f"{name}:{where}")
    agent_resets = {"HEARTBEAT": {"runtime/trainers.py:Trainers.reset_heartbeats"}}
    for key, expected in TRAINER_MESSAGES.items():
        assert writers[key] - agent_resets.get(key, set()) == expected, key


def _methods(cls: ast.ClassDef) -> dict[str, str]:
    """Method name -> its body without the docstring, as an AST dump (names, not formatting)."""
    out = {}
    for node in cls.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(getattr(body[0], "value", None), ast.Constant):
                body = body[1:]
            out[node.name] = "\n".join(ast.dump(stmt) for stmt in body)
    return out


def test_the_two_lightning_strategies_share_no_copied_method_body() -> None:
    trees = _modules()
    ddp = next(n for n in trees["integrations/lightning/strategy.py"].body
               if isinstance(n, ast.ClassDef) and n.name == "LetoStrategy")
    fsdp2 = next(n for n in trees["integrations/lightning/fsdp2_strategy.py"].body
                 if isinstance(n, ast.ClassDef) and n.name == "LetoModelParallelStrategy")
    a, b = _methods(ddp), _methods(fsdp2)
    same = sorted(name for name in a.keys() & b.keys() if a[name] == b[name])
    assert same == [], f"copied method bodies (move them into LetoFitHooks): {same}"
    # and the shared part is one mixin, not free functions over a host protocol
    hooks = trees["integrations/lightning/fit_hooks.py"]
    assert not [n.name for n in ast.walk(hooks) if isinstance(n, ast.FunctionDef)
                and n.args.args and n.args.args[0].arg == "host"]
