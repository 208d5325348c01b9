"""The resume payload: what Lightning needs, besides retained tensors, to continue exactly.

A payload is captured at one of these moments and recorded in the retained progress record:

- ``"start"``:  ``on_train_start`` of a fresh run (nothing committed yet);
- ``"prepare"``: inside the optimizer step, when the transaction prepares iteration *t*;
- ``"batch_end"``: ``on_train_batch_end`` of the batch that committed *t*;
- ``"validation_end"``: after a validation run inside ``fit`` that followed a committed step.

Every kind resumes at a point Lightning's own restart logic handles, the same points where
``ModelCheckpoint`` saves. ``"prepare"`` is the one that needs care: the transaction records
the payload at prepare, *before* Lightning finishes the batch, so a resume after *t* commits
must first finish the batch the way Lightning would have (``finish_batch``): the optimizer-step
and batch counters move to "processed", and the LR schedulers due at this batch are stepped
through the module's own ``lr_scheduler_step``; a 16-mixed grad scaler gets the ``update()`` of
a step without overflow (``scaler_after_step``). The result is the state Lightning holds inside
``on_train_batch_end`` of that batch (checked in tests/integrations/lightning/test_lightning_loop_state.py against a
capture taken there). Capturing at ``on_train_batch_end`` alone would not do: by then the
update is committed and a crash between the two would resume *before* a batch whose update is
already applied -- it would be applied twice.
"""

from __future__ import annotations

import copy
import random
import weakref
from typing import Any

import lightning.pytorch as pl
import torch

from ...errors import InternalError, UsageError
from ...retained.torch_internals import GROWTH_TRACKER, amp_update_scale_, mark_optimizer_stepped
from ...updater.retained_optimizer import hyperparameters
from . import internals
from .internals import callbacks_state_dict, num_ready_batches_reached
from .loop_state import loop_state_dict
from .plateau import apply_due, monitored, plateau_due

PAYLOAD_VERSION = 1
KINDS = ("start", "prepare", "batch_end", "validation_end")
_STEP_PROGRESS = "epoch_loop.automatic_optimization.optim_progress"


# -- random state ----------------------------------------------------------------------------
def rng_states() -> dict[str, Any]:
    """torch (CPU, and CUDA when initialised), Python and NumPy generators.

    Tensors and plain Python values only, so that every checkpoint holding a payload loads with
    ``torch.load(weights_only=True)`` (what Lightning and torch >= 2.6 use): NumPy's state is
    kept as its parts, the key array as an int64 tensor (``numpy_state`` restores it exactly; a
    list of ints, as older payloads hold, too). Taken once or twice per step: no per-element
    Python work."""
    states: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    try:
        import numpy as np
    except ImportError:  # pragma: no cover - numpy is optional
        np = None  # type: ignore[assignment]  # numpy is optional
    if np is not None:
        name, keys, pos, has_gauss, cached_gaussian = np.random.get_state()
        key_array = np.asarray(keys, dtype=np.int64)
        states["numpy"] = (str(name), torch.from_numpy(key_array), int(pos), int(has_gauss), float(cached_gaussian))
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states["cuda"] = torch.cuda.get_rng_state_all()
    return states


def numpy_state(parts: tuple | list) -> tuple:
    """The argument of ``numpy.random.set_state`` from the parts ``rng_states`` keeps."""
    import numpy as np

    name, keys, pos, has_gauss, cached_gaussian = parts
    keys = keys.numpy() if isinstance(keys, torch.Tensor) else keys
    return (name, np.asarray(keys, dtype=np.uint32), int(pos), int(has_gauss), float(cached_gaussian))


def set_rng_states(states: dict[str, Any]) -> None:
    torch.set_rng_state(states["torch"])
    random.setstate(states["python"])
    if "numpy" in states:
        import numpy as np

        np.random.set_state(numpy_state(states["numpy"]))
    if "cuda" in states:
        torch.cuda.set_rng_state_all(states["cuda"])


# -- capture ---------------------------------------------------------------------------------
_NON_PARAMETER: weakref.WeakKeyDictionary[torch.nn.Module, tuple[int, bool]] = weakref.WeakKeyDictionary()


def non_parameter_state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Persistent buffers and extra state (e.g. BatchNorm statistics): not retained, so copied.

    Taken once or twice per step: a module tree without any (most LLMs) is recognised once --
    ``state_dict`` walks every submodule, ~0.1 ms per capture on a small transformer -- and
    looked at again only if its number of submodules changes."""
    n_modules = sum(1 for _ in module.modules())
    known = _NON_PARAMETER.get(module)
    if known is not None and known[0] == n_modules and not known[1]:
        return {}
    params = frozenset(name for name, _ in module.named_parameters(remove_duplicate=False))
    state = {k: (v.detach().clone() if isinstance(v, torch.Tensor) else copy.deepcopy(v))
             for k, v in module.state_dict(keep_vars=True).items()
             if k not in params and not isinstance(v, torch.nn.Parameter)}
    _NON_PARAMETER[module] = (n_modules, bool(state) or _has_state_hooks(module))
    return state


def _has_state_hooks(module: torch.nn.Module) -> bool:
    """Whether a later ``state_dict`` could hold anything but parameters: buffers (persistent
    or not: cheap to tell apart only by walking ``state_dict`` itself) or extra state."""
    return any(True for _ in module.buffers()) or any(
        type(m).get_extra_state is not torch.nn.Module.get_extra_state for m in module.modules())


_capturing = False
_capturing_prepare = False


def capturing() -> bool:
    """True while ``capture`` collects the callbacks' states (``LetoLoopStateCallback`` then
    contributes nothing: its own state *is* a payload)."""
    return _capturing


def batches_processed(trainer: pl.Trainer) -> int | None:
    """Batches of the current epoch Lightning has processed -- where it resumes from a state
    saved now -- or None inside a ``"prepare"`` capture, whose batch ``finish_batch`` completes
    on resume (``ResumableDataLoader`` then counts it)."""
    if _capturing_prepare:
        return None
    progress: Any = trainer.fit_loop.epoch_loop.batch_progress.current  # a _ProcessedTracker, typed as its base
    return int(progress.processed)


def capture(trainer: pl.Trainer, kind: str) -> dict[str, Any]:
    """Everything outside retained memory that the resumed trainer needs (see module doc)."""
    global _capturing_prepare
    if kind not in KINDS:
        raise InternalError(f"unknown payload kind {kind!r}")
    _capturing_prepare = kind == "prepare"
    try:
        return _capture(trainer, kind)
    finally:
        _capturing_prepare = False


def _capture(trainer: pl.Trainer, kind: str) -> dict[str, Any]:
    global _capturing
    _capturing = True
    try:
        callbacks = callbacks_state_dict(trainer)
    finally:
        _capturing = False
    module = trainer.lightning_module
    payload: dict[str, Any] = {
        "version": PAYLOAD_VERSION,
        "kind": kind,
        "epoch": trainer.current_epoch,
        "global_step": trainer.global_step,
        "rng": rng_states(),
        "param_groups": [hyperparameters(opt) for opt in trainer.optimizers],
        "lr_schedulers": [config.scheduler.state_dict() for config in trainer.lr_scheduler_configs],
        "callbacks": callbacks,
        "precision": trainer.precision_plugin.state_dict(),
        "datamodule": _datamodule_state(trainer),
        "buffers": non_parameter_state(module),
        "loops": None if kind == "start" else {"fit_loop": loop_state_dict(trainer.fit_loop)},
        "due_schedulers": schedulers_due(trainer) if kind == "prepare" else [],
        "validation_due": kind in ("prepare", "batch_end") and validation_due(trainer),
        "monitored": monitored(trainer),
        "plateau_due": plateau_due(trainer) if kind in ("prepare", "batch_end") else [],
    }
    keeper = getattr(trainer.strategy, "logs", None)  # loggers across processes (logs.py), under leto launch
    payload["logs"] = keeper.state(trainer, kind) if keeper is not None else None
    return payload


def _datamodule_state(trainer: pl.Trainer) -> Any:
    datamodule = trainer.datamodule  # type: ignore[attr-defined]  # set by Lightning's data connector
    return datamodule.state_dict() if datamodule is not None else None


def schedulers_due(trainer: pl.Trainer) -> list[int]:
    """Indices of the LR schedulers Lightning steps after this batch's optimizer step.

    Mirrors ``_TrainingEpochLoop.update_lr_schedulers`` as called from ``advance``: step-interval
    schedulers whose frequency divides the batch count, then -- at the epoch's last batch --
    epoch-interval ones whose frequency divides the epoch count. Plateau schedulers are not
    stepped there (``plateau.py``).
    """
    loop = trainer.fit_loop.epoch_loop
    configs = trainer.lr_scheduler_configs
    batch = loop.batch_idx + 1
    due = [i for i, c in enumerate(configs) if not c.reduce_on_plateau and c.interval == "step"
           and batch % c.frequency == 0]
    if num_ready_batches_reached(trainer):
        epoch = trainer.current_epoch + 1
        due += [i for i, c in enumerate(configs) if not c.reduce_on_plateau and c.interval == "epoch"
                and epoch % c.frequency == 0]
    return due


def validation_due(trainer: pl.Trainer) -> bool:
    """Whether Lightning runs validation after this training batch (in the epoch loop's
    ``on_advance_end``, after ``on_train_batch_end``)."""
    return internals.validation_due(trainer)


def resume_into_validation(loops: dict[str, Any]) -> dict[str, Any]:
    """A batch-end loop state whose validation never ran (the crash came before it ended)
    turned into the state of a checkpoint Lightning saves *during* that validation: the batch
    completed, the validation started and nothing of it processed. Lightning's restart then
    runs the whole validation before the next batch ("restarted mid evaluation"), where from
    the batch-end state it would skip it -- and its metrics, and what callbacks do with them.

    Lightning resets only the ``current`` counters on such a restart: the validation's total
    ``ready``/``started`` end one above ``completed``, which a later restart would read as
    "mid evaluation" again; ``settle_rerun_validation`` takes the one back when it ends."""
    out = copy.deepcopy(loops)
    fit = out["fit_loop"]
    train = fit["epoch_loop.batch_progress"]
    for scope in ("total", "current"):
        train[scope]["completed"] = train[scope]["processed"]
    val = fit["epoch_loop.val_loop.batch_progress"]
    val["current"] = {"ready": 1, "started": 1, "processed": 0, "completed": 0}  # this run: started, nothing done
    total = val["total"]  # the epoch's validation batches so far, plus this run's first
    total["ready"] = total["started"] = total["completed"] + 1
    total["processed"] = total["completed"]
    return out


def settle_rerun_validation(trainer: pl.Trainer) -> None:
    """After a validation ``resume_into_validation`` made Lightning run: the epoch's total
    validation counters as an uninterrupted run has them (see there)."""
    # Typed as a _ReadyCompletedTracker; the validation loop's counts ``started`` too.
    total: Any = trainer.fit_loop.epoch_loop.val_loop.batch_progress.total
    if total.ready == total.started == total.completed + 1:
        total.ready -= 1
        total.started -= 1


# -- resume ----------------------------------------------------------------------------------
def _bump(progress: dict, *fields: str) -> None:
    for scope in ("total", "current"):
        for f in fields:
            progress[scope][f] += 1


def finish_batch(trainer: pl.Trainer, payload: dict[str, Any]) -> dict[str, Any]:
    """A ``"prepare"`` payload turned into the state inside ``on_train_batch_end`` of its batch.

    Steps the real schedulers (they exist: LetoStrategy restores after ``setup``), so a
    user-overridden ``lr_scheduler_step`` is honoured; returns a new payload.
    """
    out = copy.deepcopy({k: v for k, v in payload.items() if k != "rng"})
    out["rng"] = payload["rng"]
    fit = out["loops"]["fit_loop"]
    _bump(fit[_STEP_PROGRESS]["optimizer"]["step"], "completed")
    _bump(fit["epoch_loop.batch_progress"], "processed")
    if out["due_schedulers"]:
        out = step_schedulers(trainer, out, [(i, None) for i in out["due_schedulers"]])
    out["precision"] = scaler_after_step(out["precision"])
    out["kind"], out["due_schedulers"], out["global_step"] = "batch_end", [], payload["global_step"] + 1
    return out


def step_schedulers(trainer: pl.Trainer, out: dict[str, Any], steps: list[tuple[int, Any]]) -> dict[str, Any]:
    """Step the real schedulers ``[(index, metric)]`` from the payload's state, through the
    module's own ``lr_scheduler_step`` (a user override is honoured), and record the result and
    Lightning's scheduler counters in ``out`` (modified)."""
    optimizer = trainer.optimizers[0]
    apply_param_groups(optimizer, out["param_groups"][0])
    configs = trainer.lr_scheduler_configs
    for config, state in zip(configs, out["lr_schedulers"]):
        config.scheduler.load_state_dict(state)
    mark_optimizer_stepped(optimizer)  # the step did happen (torch warns otherwise)
    out["loops"] = copy.deepcopy(out["loops"])
    for i, metric in steps:
        trainer.lightning_module.lr_scheduler_step(configs[i].scheduler, metric)
        _bump(out["loops"]["fit_loop"]["epoch_loop.scheduler_progress"], "ready", "completed")
    out["lr_schedulers"] = [c.scheduler.state_dict() for c in configs]
    out["param_groups"] = [hyperparameters(optimizer)]
    return out


def scaler_after_step(state: dict[str, Any] | None) -> dict[str, Any] | None:
    """A ``GradScaler`` state captured at prepare, advanced by the ``scaler.update()`` that
    follows that step (16-mixed; any other precision state is returned as it is).

    A transaction runs only when the scaler found no inf/nan gradients (it skips
    ``optimizer.step`` otherwise), so this is ``update()`` with ``found_inf = 0``: torch's own
    ``_amp_update_scale_`` on tensors built as ``GradScaler`` builds them, hence bit-exact
    (growth by ``growth_factor`` after ``growth_interval`` successful steps, unless the new
    scale would be inf; the growth tracker counts or restarts).
    """
    if not state or GROWTH_TRACKER not in state:
        return state
    scale = torch.full((), state["scale"], dtype=torch.float32)
    tracker = torch.full((), state[GROWTH_TRACKER], dtype=torch.int32)
    amp_update_scale_(scale, tracker, torch.zeros((), dtype=torch.float32), state["growth_factor"],
                      state["backoff_factor"], state["growth_interval"])
    return {**state, "scale": scale.item(), GROWTH_TRACKER: int(tracker.item())}


def _optimizer_state(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """``state_dict()``, but only the param groups of a ``ZeroRedundancyOptimizer``: its
    ``state_dict()`` needs a collective consolidation first, and only the groups' settings move
    here (``load_optimizer_state_dict``; the state tensors are the retained views already)."""
    if hasattr(optimizer, "consolidate_state_dict"):
        first = 0
        groups = []
        for group in optimizer.param_groups:
            groups.append(dict(group, params=list(range(first, first + len(group["params"])))))
            first += len(group["params"])
        return {"state": {}, "param_groups": groups}
    return optimizer.state_dict()


def apply_param_groups(optimizer: torch.optim.Optimizer, groups: list[dict]) -> None:
    """Set the hyper-parameters (lr, betas, ...) of ``optimizer``'s groups; never its params."""
    if len(groups) != len(optimizer.param_groups):
        raise UsageError(f"the optimizer has {len(optimizer.param_groups)} param groups, the retained record "
                         f"{len(groups)}: configure_optimizers must build the same groups as the run being resumed")
    for group, values in zip(optimizer.param_groups, groups):
        for key, value in values.items():
            if key == "params" or key.startswith("_leto"):
                continue
            current = group.get(key)
            if isinstance(current, torch.Tensor) and not isinstance(value, torch.Tensor):
                current.fill_(value)
            else:
                group[key] = value


def restore_callbacks(trainer: pl.Trainer, checkpoint: dict[str, Any]) -> None:
    """What Lightning's ``restore_callbacks`` does with a loaded checkpoint: every callback's
    ``on_load_checkpoint``, then its ``load_state_dict`` with its saved state."""
    internals.restore_callbacks(trainer, checkpoint)


def build_checkpoint(trainer: pl.Trainer, payload: dict[str, Any] | None) -> dict[str, Any]:
    """The in-memory checkpoint ``LetoStrategy.load_checkpoint`` hands Lightning.

    Parameters and optimizer state are the retained views themselves (already adopted), so
    Lightning's loading copies nothing; everything else comes from the payload.
    """
    if payload is not None and payload.get("version") != PAYLOAD_VERSION:
        raise UsageError(f"retained resume payload version {payload.get('version')!r}; this leto_lightning "
                         f"writes version {PAYLOAD_VERSION}: resume with the version that wrote it")
    if payload is not None and payload["kind"] == "prepare":
        payload = finish_batch(trainer, payload)
    if payload is not None and payload.get("validation_due"):
        payload = dict(payload, loops=resume_into_validation(payload["loops"]))
    elif payload is not None and payload.get("plateau_due"):
        payload = apply_due(trainer, payload, step_schedulers)
    module = trainer.lightning_module
    state_dict = module.state_dict()
    optimizer = trainer.optimizers[0]
    opt_state = _optimizer_state(optimizer)
    ckpt: dict[str, Any] = {
        "pytorch-lightning_version": pl.__version__,
        "epoch": trainer.current_epoch if payload is None else payload["epoch"],
        "global_step": trainer.global_step if payload is None else payload["global_step"],
        "state_dict": state_dict,
        "optimizer_states": [opt_state],
        "lr_schedulers": [c.scheduler.state_dict() for c in trainer.lr_scheduler_configs],
        "leto": {"kind": None if payload is None else payload["kind"],
                 "monitored": (payload or {}).get("monitored") or {},
                 "validation_rerun": bool(payload and payload.get("validation_due"))},
    }
    if payload is None:
        return ckpt
    state_dict.update(payload["buffers"])
    opt_state["param_groups"] = [dict(g, **{k: v for k, v in h.items() if not k.startswith("_leto")})
                                 for g, h in zip(opt_state["param_groups"], payload["param_groups"][0])]
    ckpt["lr_schedulers"] = payload["lr_schedulers"]
    ckpt["callbacks"] = payload["callbacks"]
    if payload["loops"] is not None:
        ckpt["loops"] = payload["loops"]
    if payload["precision"]:
        ckpt[type(trainer.precision_plugin).__qualname__] = payload["precision"]
    datamodule = trainer.datamodule  # type: ignore[attr-defined]  # set by Lightning's data connector
    if payload["datamodule"] is not None and datamodule is not None:
        ckpt[type(datamodule).__qualname__] = payload["datamodule"]
    ckpt["leto"]["rng"] = payload["rng"]
    return ckpt
