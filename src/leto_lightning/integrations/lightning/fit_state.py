"""How a ``LetoStrategy`` fit starts (``FitMode``) and where its training batch is (``BatchPhase``).

Both are owned by one ``FitState`` per strategy. Each enum changes in one method that checks
the transition against its table and raises ``InternalError`` for any other: the strategy and
the loop-state callback call the named methods (``begin``, ``end``, ``batch_started``, ...),
never set a field.

``FitMode`` -- decided by the launcher, before Lightning resolves ``ckpt_path``::

    NONE --begin--> FRESH           a new store (no checkpoint)
         --begin--> FROM_FILE       fit(ckpt_path=<file>): the file's state moves into a new store
         --begin--> FROM_RETAINED   fit(ckpt_path="leto://retained") or LETO_RESUME=retained,
                                    without ``leto launch``: attach and resume at once
         --begin--> SHADOW          the same under ``leto launch`` (a shadow, or a cold restart):
                                    attach, build fully, resume once promoted
    any  --end----> NONE            teardown (of a fit, or of validate/test: NONE stays NONE)

A second ``fit()`` in the same process begins again from ``NONE``; so does a pickled or copied
strategy (``detached``).

``BatchPhase`` -- the training batch, for the resume payload's points (``callback.py``)::

    IDLE          no training batch ran on this strategy yet
    COMPUTING     inside a training batch, no optimizer step committed in it yet
    STEPPED       inside a training batch whose optimizer step committed
    RECORDED      the last batch ended with its state recorded (after its step, or after a
                  step the grad scaler skipped once something was committed): a validation
                  that follows records again
    ACCUMULATING  the last batch ended without a recorded step (an accumulation micro-batch,
                  or nothing committed yet): nothing is recorded until the next step

    any                                --batch_started-->  COMPUTING
    COMPUTING, STEPPED                 --step_committed--> STEPPED
    IDLE, RECORDED, ACCUMULATING       --step_committed--> (unchanged: a step outside a training
                                       batch, e.g. manual optimization in an epoch hook, is
                                       recorded at prepare only; no batch end follows it)
    any                                --batch_ended------> RECORDED or ACCUMULATING

A phase is not reset between fits (a new fit's first batch starts it again). A batch end
without a batch start (Lightning's "train_dataloader yielded None") counts as a batch without
a step.
"""

from __future__ import annotations

from enum import Enum

from ...errors import InternalError


class FitMode(Enum):
    """How this fit starts (module doc for the transitions)."""

    NONE = "none"
    FRESH = "fresh"
    FROM_FILE = "from_file"
    FROM_RETAINED = "from_retained"
    SHADOW = "shadow"

    @property
    def from_retained_memory(self) -> bool:
        """Attaches to an existing retained store (instead of creating one)."""
        return self in (FitMode.FROM_RETAINED, FitMode.SHADOW)

    @property
    def continues(self) -> bool:
        """Continues a run (from retained memory or a checkpoint file): its logs go on."""
        return self in (FitMode.FROM_FILE, FitMode.FROM_RETAINED, FitMode.SHADOW)


class BatchPhase(Enum):
    """Where the training loop is relative to the optimizer step (module doc)."""

    IDLE = "idle"
    COMPUTING = "computing"
    STEPPED = "stepped"
    RECORDED = "recorded"
    ACCUMULATING = "accumulating"


_FIT_STARTS = frozenset({FitMode.FRESH, FitMode.FROM_FILE, FitMode.FROM_RETAINED, FitMode.SHADOW})
_MODE_NEXT: dict[FitMode, frozenset[FitMode]] = {
    FitMode.NONE: _FIT_STARTS | {FitMode.NONE},
    **{mode: frozenset({FitMode.NONE}) for mode in _FIT_STARTS},
}
_ENDED = frozenset({BatchPhase.RECORDED, BatchPhase.ACCUMULATING})
_PHASE_NEXT: dict[BatchPhase, frozenset[BatchPhase]] = {
    BatchPhase.IDLE: frozenset({BatchPhase.COMPUTING}) | _ENDED,
    BatchPhase.COMPUTING: frozenset({BatchPhase.COMPUTING, BatchPhase.STEPPED}) | _ENDED,
    BatchPhase.STEPPED: frozenset({BatchPhase.COMPUTING, BatchPhase.STEPPED}) | _ENDED,
    BatchPhase.RECORDED: frozenset({BatchPhase.COMPUTING}) | _ENDED,
    BatchPhase.ACCUMULATING: frozenset({BatchPhase.COMPUTING}) | _ENDED,
}


class FitState:
    """The fit mode, the batch phase and what a resume left for later (module doc)."""

    def __init__(self) -> None:
        self.mode = FitMode.NONE
        self.phase = BatchPhase.IDLE
        self.ckpt_file: object = None  # FROM_FILE: the checkpoint path, resolved as Lightning resolves it
        self._validation_rerun = False  # resumed into a validation the crash interrupted (resume.py)

    def __repr__(self) -> str:
        return f"FitState({self.mode.name}, {self.phase.name})"

    def detached(self) -> FitState:
        """A copy for a pickled or copied strategy: the same phase, no fit in progress (``NONE``)."""
        copy = FitState()
        copy.phase, copy._validation_rerun = self.phase, self._validation_rerun
        return copy

    # -- the mode ------------------------------------------------------------------------------
    def _set_mode(self, mode: FitMode) -> None:
        if mode not in _MODE_NEXT[self.mode]:
            raise InternalError(f"LetoStrategy: fit mode {self.mode.name} -> {mode.name} is not a transition "
                                "(a fit began before the previous one was torn down)")
        self.mode = mode

    def begin(self, mode: FitMode, ckpt_file: object = None) -> None:
        """A fit starts in ``mode`` (``ckpt_file``: the file of ``FROM_FILE``)."""
        if mode is FitMode.NONE or (mode is FitMode.FROM_FILE) != (ckpt_file is not None):
            raise InternalError(f"LetoStrategy: a fit cannot begin as {mode.name} with ckpt_file={ckpt_file!r}")
        self._set_mode(mode)
        self.ckpt_file = ckpt_file

    def end(self) -> None:
        """Teardown: the next fit decides again."""
        self._set_mode(FitMode.NONE)
        self.ckpt_file = None

    # -- the batch phase -------------------------------------------------------------------------
    def _set_phase(self, phase: BatchPhase) -> None:
        if phase not in _PHASE_NEXT[self.phase]:
            raise InternalError(f"LetoStrategy: batch phase {self.phase.name} -> {phase.name} is not a transition")
        self.phase = phase

    @property
    def batch_open(self) -> bool:
        """Between the strategy's ``on_train_batch_start`` and the callback's batch end."""
        return self.phase in (BatchPhase.COMPUTING, BatchPhase.STEPPED)

    def batch_started(self) -> None:
        self._set_phase(BatchPhase.COMPUTING)

    def step_committed(self) -> None:
        if self.batch_open:
            self._set_phase(BatchPhase.STEPPED)

    def batch_ended(self, recorded: bool) -> None:
        """The loop-state callback's batch end: ``recorded`` -- it recorded the batch's state."""
        self._set_phase(BatchPhase.RECORDED if recorded else BatchPhase.ACCUMULATING)

    # -- a resume into an interrupted validation ------------------------------------------------
    def resumed_into_validation(self, rerun: bool) -> None:
        """The payload this fit resumes from makes Lightning rerun a validation (or not)."""
        self._validation_rerun = rerun

    def take_validation_rerun(self) -> bool:
        """At a validation end: whether it was that rerun (once)."""
        rerun, self._validation_rerun = self._validation_rerun, False
        return rerun
