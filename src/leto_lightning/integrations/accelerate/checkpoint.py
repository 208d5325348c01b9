"""``save_state``/``load_state`` of ``LetoAccelerator``: Accelerate's checkpoint plus Leto's payload.

A checkpoint restart (the whole job stopped -- preempted, a failure the agents could not
recover in place -- and started again from a checkpoint directory) is exact when the
directory holds, besides Accelerate's own files, what a recovery from retained memory uses:
the retained iteration and the resume payload (``payload.py``: the data position, the random
state, ``accelerator.step``, schedulers, scaler, registered objects). Each rank writes its own
``leto_state_<rank>.pt`` next to Accelerate's ``random_states_<rank>.pkl``.

**Saving.** ``save_state`` is Accelerate's; the parameters and optimizer state it writes are
copies (``compact_saves``): they are views into retained memory, and Accelerate's safetensors
writer drops tensors whose storage another tensor shares (every parameter but one), while
``torch.save`` would write each view's whole shared segment. The payload is of kind
``"saved"``: captured in the loop's body after the step (or after an epoch's last batch), it
needs nothing finished and puts the random state back before the next batch is fetched.

**Reading.** Every file Leto reads here is data, never code: its own file through
``torch.load(weights_only=True)`` (tensors, numbers, strings, containers -- the payload keeps
the random states as plain values; ``register_for_checkpointing`` objects are left out, their
state is in Accelerate's own ``custom_checkpoint_<i>.pkl`` and Accelerate puts it back), a
``pytorch_model.bin`` likewise. A planted file is refused (``UnsafeCheckpoint``) before
Accelerate reads anything, and nothing in it runs.

**Loading**, after ``prepare()`` (where Accelerate users call it), on every rank:

- before this process's first optimizer step (a new job from a checkpoint): the store is
  marked incomplete (a crash from here on leaves nothing that passes for retained state),
  Accelerate loads the files -- weights land in the retained parameters, the optimizer's state
  in new tensors -- and the store is initialised again from what was loaded, exactly as a new
  store is: values copied in (state the checkpoint lacks from zero, as torch's), tier 1
  encoded, the record committed at the saved iteration with the saved payload, tier 2 encoded
  across the node, the store marked complete. Then ``leto_resume()`` returns where the loop
  continues (optional: without it the loop positions itself, as with Accelerate; a directory
  without Leto's file, e.g. from a plain ``Accelerator``: the loaded state is retained,
  ``leto_resume()`` returns None);
- after a step (reloading the best or an earlier checkpoint mid-run, as Accelerate allows): the
  same initialisation, except that the job's iteration count goes on (the store's iteration
  never goes back, so the agent's checkpoint records stay in order) and the committed payload
  is the loop's position now, with the state just loaded: the loop continues where it is, as
  with Accelerate, and a crash from here resumes there;
- in a process that continues from retained memory (a promoted shadow, a trainer restarted on
  the retained state), before its first step: nothing is loaded -- retained memory is newer
  than any checkpoint -- so a script that always calls ``load_state(args.resume_from)`` stays
  correct after a recovery.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import pickle
import re
from collections import OrderedDict
from collections.abc import Callable, Iterator
from enum import Enum
from typing import Any, Protocol

import safetensors.torch
import torch
from accelerate.utils import MODEL_NAME, SAFE_MODEL_NAME

from ...errors import ConfigurationError
from ...retained.torch_internals import copy_state_dict_metadata
from ...runtime.session import load_checkpoint_file
from ...updater.store_setup import complete_new_store
from .payload import ResumableAccelerator, capture

log = logging.getLogger(__name__)

SAVED = "saved"  # the payload kind of a checkpoint (module doc)
FILE = "leto_state_{rank}.pt"
VERSION = 2  # 2: plain values only (loads with weights_only=True); version 1 held NumPy arrays


class CheckpointedAccelerator(ResumableAccelerator, Protocol):
    """What this module reads on ``LetoAccelerator`` (a protocol: this module sits below it)."""

    leto_state: Any
    process_index: int
    project_dir: Any
    project_configuration: Any
    gradient_state: Any
    _train_loader: Any
    _leto_payload: Any
    _leto_from_checkpoint: bool
    _leto_shown: Any

    def register_save_state_pre_hook(self, hook: Callable[..., None]) -> Any: ...

    def register_load_state_pre_hook(self, hook: Callable[..., None]) -> Any: ...

    def _barrier(self) -> Callable[[], None] | None: ...


def _copies(state: Any) -> Any:
    """A state dict whose tensors own their storage (module doc)."""
    if isinstance(state, torch.Tensor):
        return state.detach().clone()
    if isinstance(state, OrderedDict):  # a module's state dict: keep its version metadata
        out: OrderedDict = OrderedDict((k, _copies(v)) for k, v in state.items())
        copy_state_dict_metadata(state, out)
        return out
    if isinstance(state, dict):
        return {k: _copies(v) for k, v in state.items()}
    if isinstance(state, list):
        return [_copies(v) for v in state]
    return state


@contextlib.contextmanager
def compact_saves(acc: CheckpointedAccelerator) -> Iterator[None]:
    """While Accelerate saves: its weights and the optimizer's state dict are copies."""

    def copy_weights(_models: list, weights: list, _output_dir: str) -> None:
        for i, weight in enumerate(weights):
            weights[i] = _copies(weight)

    handle = acc.register_save_state_pre_hook(copy_weights)
    opt = acc.leto_optimizer
    opt.state_dict = lambda: _copies(type(opt).state_dict(opt))  # an instance attribute, removed below
    try:
        yield
    finally:
        handle.remove()
        del opt.state_dict


def saved_payload(acc: CheckpointedAccelerator) -> dict:
    """The payload at ``save_state``: the training loader's position now. After the loader's
    pass ended (``save_state`` after an epoch's last batch), the next pass starts from here."""
    loader = acc._train_loader
    payload = capture(acc, SAVED, loader)
    payload["custom"] = None  # in Accelerate's custom_checkpoint files, which it loads itself (module doc)
    where = payload["loader"]
    if where is not None and not any(ref is loader for ref in acc.gradient_state.dataloader_references):
        payload["loader"] = dict(where, yielded=0, epoch_rng=where["rng"])  # Accelerate counted the pass
    return payload


def save(acc: CheckpointedAccelerator, output_dir: str) -> None:
    """Write this rank's Leto file into the checkpoint directory Accelerate just wrote."""
    os.makedirs(output_dir, exist_ok=True)
    acc.leto_recovery_log.saved_iteration = acc.retained.iteration  # the newest checkpoint (kept_iterations)
    state = {"version": VERSION, "iteration": acc.retained.iteration, "payload": saved_payload(acc)}
    path = os.path.join(output_dir, FILE.format(rank=acc.process_index))
    data = _loadable_bytes(state, path)
    with open(path + ".tmp", "wb") as f:
        f.write(data)
    os.replace(path + ".tmp", path)  # a crash while writing leaves the previous file, never half of one


def _loadable_bytes(state: dict, path: str) -> bytes:
    """``state`` serialised, checked to load with ``weights_only=True`` (as ``read`` will): a
    value that would not is refused now, naming it, not when the checkpoint is needed."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    data = buffer.getvalue()
    try:
        torch.load(io.BytesIO(data), weights_only=True)
    except pickle.UnpicklingError as exc:
        why = next((ln.strip() for ln in str(exc).splitlines() if "GLOBAL" in ln or "Unsupported" in ln),
                   type(exc).__name__)
        raise ConfigurationError(f"{path}: the resume payload holds a value that is not a tensor or plain value "
                                 f"({why}); a scheduler, GradScaler or param group setting of that type cannot be "
                                 "checkpointed by LetoAccelerator -- keep their state to tensors, numbers, strings "
                                 "and containers") from None
    return data


def resolve(acc: CheckpointedAccelerator, input_dir: str | None) -> str:
    """The directory ``Accelerator.load_state`` will read (its own rule for ``None``)."""
    if input_dir is not None:
        return os.path.expanduser(input_dir)
    if not acc.project_configuration.automatic_checkpoint_naming:
        return ""  # Accelerate raises its own error
    root = os.path.join(acc.project_dir, "checkpoints")
    folders = sorted(os.listdir(root), key=lambda f: int(re.findall(r"([0-9]+)(?=[^/]*$)", f)[0]))
    return os.path.join(root, folders[-1])


def read(directory: str, rank: int) -> dict | None:
    path = os.path.join(directory, FILE.format(rank=rank))
    if not os.path.exists(path):
        return None
    state = load_checkpoint_file(path)  # weights_only=True: a planted pickle is refused, never run
    if not isinstance(state, dict) or state.get("version") != VERSION:
        raise ConfigurationError(f"{path}: not a Leto checkpoint file of version {VERSION} -- save the checkpoint "
                                 "again with this version of LetoAccelerator.save_state")
    return state


def weights_into_retained(strict: bool) -> Callable[[list, str], None]:
    """A load-state pre-hook: the models' weights copied into their (retained) parameters, in
    place. Accelerate's safetensors loader refuses models whose parameters share one storage,
    as retained views do; the hook loads them itself and takes them off Accelerate's list
    (the pattern Accelerate documents for custom model loading)."""

    def load_weights(models: list, input_dir: str) -> None:
        for i, model in enumerate(models):
            ending = f"_{i}" if i > 0 else ""
            safe = os.path.join(input_dir, f"{SAFE_MODEL_NAME}{ending}.safetensors")
            if os.path.exists(safe):
                weights = safetensors.torch.load_file(safe, device="cpu")
            else:
                weights = torch.load(os.path.join(input_dir, f"{MODEL_NAME}{ending}.bin"), map_location="cpu",
                                     weights_only=True)
            model.load_state_dict(weights, strict=strict)
        models.clear()

    return load_weights


class LoadKind(Enum):
    """What ``load_state`` does in this process (module doc)."""

    NOTHING = "nothing"  # continues from retained memory, newer than any checkpoint
    RESTART = "restart"  # before this process's first step: the checkpoint's iteration and payload
    RELOAD = "reload"  # after a step: the job's iteration goes on, the loop's position now


def load_kind(acc: CheckpointedAccelerator, input_dir: str | None) -> LoadKind:
    if acc.leto_state.retained_is_newest:
        log.info("LetoAccelerator.load_state(%s): this process continues from retained memory, which is newer "
                 "than any checkpoint: nothing loaded", input_dir)
        return LoadKind.NOTHING
    return LoadKind.RESTART if acc.leto_state.before_first_step else LoadKind.RELOAD


def _saved(acc: CheckpointedAccelerator, input_dir: str | None) -> tuple[str, dict | None]:
    directory = resolve(acc, input_dir)
    return directory, read(directory, acc.process_index) if directory and os.path.isdir(directory) else None


def _new_job_payload(saved: dict | None) -> object:
    """The saved payload for a new job: its recoveries are its own; the checkpoint is the newest."""
    if saved is None or saved["payload"] is None:
        return None
    return dict(saved["payload"], recovery_log={"saved": int(saved["iteration"])})


def _loaded(acc: CheckpointedAccelerator, directory: str, iteration: int, payload: object, kind: LoadKind) -> None:
    if kind == LoadKind.RESTART:
        acc._leto_payload, acc._leto_from_checkpoint = payload, True
        if payload is not None:
            acc.leto_state.loaded()
    elif acc.leto_state.boundary_due():
        acc.leto_state.recorded()  # the committed payload is the loop's position now
    if acc._leto_shown is not None:
        acc._leto_shown.refresh()
    log.info("LetoAccelerator: loaded %s into retained memory at step %d%s", directory, iteration,
             "" if kind == LoadKind.RELOAD or payload is not None else " (no Leto payload: the loop positions itself)")


def load_fsdp2(acc: CheckpointedAccelerator, bound: Any, input_dir: str | None,
               load_files: Callable[[str | None], Any]) -> Any:
    """``load_state`` of local shards bound by ``updater.fsdp2``: Accelerate's own FSDP2 loader
    (distributed checkpoint) writes into the retained views inside ``bound.restoring``, which
    keeps the store incomplete until it is initialised once from the loaded values (state the
    checkpoint lacks from zero)."""
    kind = load_kind(acc, input_dir)
    if kind == LoadKind.NOTHING:
        return None
    if kind == LoadKind.RESTART:
        directory, saved = _saved(acc, input_dir)
        iteration, payload = (int(saved["iteration"]) if saved is not None else None), _new_job_payload(saved)
    else:
        directory, iteration, payload = resolve(acc, input_dir), bound.iteration, None
    with bound.restoring(iteration=iteration, payload=payload) as restore:
        result = load_files(input_dir)
        if kind == LoadKind.RELOAD:
            restore.payload = payload = saved_payload(acc)
    _loaded(acc, directory, bound.iteration, payload, kind)
    return result


def load(acc: CheckpointedAccelerator, input_dir: str | None, load_files: Callable[[str | None], Any],
         strict: bool = True) -> Any:
    """``load_state`` once bound (module doc); ``load_files``: Accelerate's own ``load_state``."""
    ro = acc.retained
    kind = load_kind(acc, input_dir)
    if kind == LoadKind.NOTHING:
        return None
    directory, saved = _saved(acc, input_dir) if kind == LoadKind.RESTART else (resolve(acc, input_dir), None)
    ro.store.clear_complete()  # weights are loaded into retained memory: incomplete until re-encoded
    handle = acc.register_load_state_pre_hook(weights_into_retained(strict))
    try:
        result = load_files(input_dir)
    finally:
        handle.remove()
    if kind == LoadKind.RESTART:
        iteration, payload = int(saved["iteration"]) if saved is not None else 0, _new_job_payload(saved)
    else:
        iteration, payload = ro.iteration, saved_payload(acc)
    ro.reinitialise(iteration, payload)  # the new-store path: copy in, encode, commit (closed)
    complete_new_store(ro.store, acc._barrier())
    _loaded(acc, directory, iteration, payload, kind)
    return result
