"""Effective training time ratio (ETTR): an analytic expectation and a vectorized Monte Carlo.

The process both implement (one job, wall-clock time):

- Training runs in *units*: iterations of ``iteration_s`` and, after every ``interval``
  iterations, a checkpoint stall of ``checkpoint_s``. Failures arrive as a Poisson process (or a
  trace) at any time, including during recoveries.
- A failure starts a recovery in the mode its kind draws (``Schedule.hof_modes`` /
  ``nonhof_modes``). A failure during a recovery restarts it (a *chain*). When the chain ends,
  progress rolls back to the start of the interrupted unit if every mode in the chain keeps
  progress (``rollback="iteration"``), else to the last completed checkpoint.
- A mode that uses the L3 shadow pool pays ``max(0, S - X)`` extra, where S is the pool's
  rebuild time and X the time since the previous chain ended (X = 0 inside a chain).
- ETTR = useful iterations x fault-free iteration time / wall-clock time.
- With a spare pool (``leto+spares``) the analytic model draws "spare found" with Erlang's
  probability; the Monte Carlo replays the pool failure by failure (``SparePlan.found_spare``).

The analytic model solves the renewal equations of one checkpoint segment exactly for fixed
recovery costs (first-step analysis per unit, closed-form over the segment's identical
iterations). The shadow term is averaged over X ~ Exp(1/MTTF), which is exact when every mode
keeps progress and a close approximation otherwise (the rollback share of a chain then depends
on X); ``tests/sim`` checks the two within a stated tolerance.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from leto_lightning.sim.checks import int_at_least, positive
from leto_lightning.sim.failures import FailureModel
from leto_lightning.sim.systems import RecoveryMode, Schedule


def _mode_table(schedule: Schedule, hof_ratio: float) -> tuple[np.ndarray, list[RecoveryMode]]:
    probs: list[float] = []
    modes: list[RecoveryMode] = []
    for weight, table in ((hof_ratio, schedule.hof_modes), (1 - hof_ratio, schedule.nonhof_modes)):
        for p, mode in table:
            probs.append(weight * p)
            modes.append(mode)
    return np.asarray(probs), modes


@dataclass(frozen=True)
class ChainStats:
    """Expected cost of one failure's recovery chain."""

    expected_s: float      # chain duration, re-failures included
    p_clean: float         # probability that progress is kept (no rollback to the checkpoint)
    init_s: float          # first recovery's init + load (+ shadow wait), expected
    replay_s: float        # first recovery's warm-up / replay, expected
    shadow_wait_s: float   # expected wait for the shadow pool, per failure


def chain_stats(schedule: Schedule, mttf_s: float, hof_ratio: float) -> ChainStats:
    """Closed forms for the chain started by a failure while training runs."""
    lam, S = 1.0 / mttf_s, schedule.shadow_rebuild_s
    p, modes = _mode_table(schedule, hof_ratio)
    dur = np.array([m.duration_s for m in modes])
    sh = np.array([m.uses_shadow for m in modes])
    keep = np.array([m.rollback == "iteration" for m in modes])
    r = dur + S * sh                                    # restarted inside a chain: X = 0
    q_r = -np.expm1(-lam * r)
    s_restart = float(np.sum(p * q_r / lam) / (1.0 - np.sum(p * q_r)))
    e1 = np.where(sh, np.exp(-lam * (dur + S)) * (1 + lam * S), np.exp(-lam * dur))
    q1 = np.where(sh, -np.expm1(-lam * (dur + S)) - lam * S * np.exp(-lam * (dur + S)),
                  -np.expm1(-lam * dur))
    expected = float(np.sum(p * (q1 / lam + q1 * s_restart)))
    p_restart_clean = float(np.sum(p * keep * (1 - q_r)) / (1.0 - np.sum(p * keep * q_r)))
    p_clean = float(np.sum(p * keep * (e1 + q1 * p_restart_clean)))
    wait = float(S - (-np.expm1(-lam * S)) / lam) if S > 0 else 0.0
    init = float(np.sum(p * np.array([m.init_s + m.load_s for m in modes])) + wait * np.sum(p * sh))
    replay = float(np.sum(p * np.array([m.replay_s for m in modes])))
    return ChainStats(expected, min(max(p_clean, 0.0), 1.0), init, replay,
                      wait * float(np.sum(p * sh)))


def _segment(intervals: np.ndarray, unit_s: float, ckpt_s: float, lam: float,
             cost: float, p_clean: float) -> np.ndarray:
    """Expected time to finish a segment of ``intervals`` units + a checkpoint, where each
    failure costs ``cost`` and keeps the unit with probability ``p_clean``."""
    q = -np.expm1(-lam * unit_s)
    qc = -np.expm1(-lam * ckpt_s)
    z = 1.0 - q * p_clean
    a_unit = (q / lam + q * cost) / z
    c_unit = q * (1.0 - p_clean) / z                   # = 1 - B, B = per-unit "survival"
    a_ck = (qc / lam + qc * cost) / (1.0 - qc * p_clean)
    one_minus_cc = (1.0 - qc) / (1.0 - qc * p_clean)
    with np.errstate(over="ignore", invalid="ignore"):
        if c_unit < 1e-300:
            ratio = intervals.astype(float)
        else:
            ratio = np.expm1(-intervals * np.log1p(-c_unit)) / c_unit   # (B^-I - 1) / (1 - B)
        return (a_unit * ratio + a_ck) / one_minus_cc


def _failures_per_segment(intervals: np.ndarray, unit_s: float, ckpt_s: float, lam: float,
                          p_clean: float) -> np.ndarray:
    """Expected chain-starting failures per segment (same recursion, unit cost per failure)."""
    q, qc = -np.expm1(-lam * unit_s), -np.expm1(-lam * ckpt_s)
    z = 1.0 - q * p_clean
    c_unit = q * (1.0 - p_clean) / z
    with np.errstate(over="ignore", invalid="ignore"):
        ratio = intervals.astype(float) if c_unit < 1e-300 else \
            np.expm1(-intervals * np.log1p(-c_unit)) / c_unit
        return (q / z * ratio + qc / (1 - qc * p_clean)) / ((1 - qc) / (1 - qc * p_clean))


def analytic_ettr(schedule: Schedule, mttf_s: float, hof_ratio: float,
                  intervals: np.ndarray | None = None) -> np.ndarray:
    """Expected ETTR, vectorized over checkpoint ``intervals`` (default: the schedule's)."""
    positive("mttf", mttf_s)
    ints = np.atleast_1d(np.asarray(schedule.interval if intervals is None else intervals))
    chain = chain_stats(schedule, mttf_s, hof_ratio)
    seg = _segment(ints, schedule.iteration_s, schedule.checkpoint_s, 1.0 / mttf_s,
                   chain.expected_s, chain.p_clean)
    with np.errstate(invalid="ignore", divide="ignore"):
        ettr = ints * schedule.reference_s / seg
    return np.nan_to_num(ettr, nan=0.0, posinf=0.0)


@dataclass(frozen=True)
class AnalyticResult:
    """Expected ETTR and the cost of an average failure (per chain-starting failure)."""

    ettr: float
    recovery_s: float       # init_s + recompute_s: wall time one failure costs
    init_s: float           # restart/promotion (and failures during it), excluding replay
    recompute_s: float      # lost progress redone + warm-up/replay
    shadow_wait_s: float
    overhead: float         # fault-free overhead: (segment time w/o failures) / useful - 1

    def as_dict(self) -> dict[str, float]:
        return asdict(self)


def analytic(schedule: Schedule, mttf_s: float, hof_ratio: float) -> AnalyticResult:
    """ETTR and per-failure breakdown (paper Table 3 columns) of one schedule."""
    lam = 1.0 / mttf_s
    chain = chain_stats(schedule, mttf_s, hof_ratio)
    ints = np.array([schedule.interval])
    seg = float(_segment(ints, schedule.iteration_s, schedule.checkpoint_s, lam,
                         chain.expected_s, chain.p_clean)[0])
    n_fail = float(_failures_per_segment(ints, schedule.iteration_s, schedule.checkpoint_s,
                                         lam, chain.p_clean)[0])
    work = schedule.interval * schedule.iteration_s + schedule.checkpoint_s
    lost = (seg - work - n_fail * chain.expected_s) / n_fail if n_fail > 0 else 0.0
    init = chain.expected_s - chain.replay_s
    useful = schedule.interval * schedule.reference_s
    return AnalyticResult(useful / seg, init + chain.replay_s + lost, init,
                          lost + chain.replay_s, chain.shadow_wait_s, work / useful - 1.0)


@dataclass(frozen=True)
class MonteCarloResult:
    """Simulated runs of one schedule."""

    ettr_runs: np.ndarray
    failures: float          # mean failures per run (all, including during recoveries)
    recovery_s: float        # per chain-starting failure, like AnalyticResult
    recompute_s: float
    horizon_s: float

    @property
    def ettr(self) -> float:
        return float(np.mean(self.ettr_runs))

    @property
    def stderr(self) -> float:
        n = len(self.ettr_runs)
        return float(np.std(self.ettr_runs, ddof=1) / np.sqrt(n)) if n > 1 else 0.0

    def as_dict(self) -> dict[str, float]:
        return {"ettr": self.ettr, "stderr": self.stderr, "runs": len(self.ettr_runs),
                "failures_per_run": self.failures, "recovery_s": self.recovery_s,
                "recompute_s": self.recompute_s, "horizon_s": self.horizon_s}


def _advance(done: np.ndarray, ckpt: np.ndarray, tau: np.ndarray,
             s: Schedule) -> tuple[np.ndarray, np.ndarray]:
    """Progress after running ``tau`` seconds from iteration ``done`` (last checkpoint
    ``ckpt``); partial units are lost."""
    interval, T, c = s.interval, s.iteration_s, s.checkpoint_s
    j = done - ckpt
    seg_rem = (interval - j) * T + c
    fin = tau >= seg_rem
    partial = done + np.minimum(np.floor(tau / T), interval - j)
    rest = np.where(fin, tau - seg_rem, 0.0)
    length = interval * T + c
    k = np.floor(rest / length)
    new_ckpt = np.where(fin, ckpt + (k + 1) * interval, ckpt)
    tail = np.minimum(np.floor((rest - k * length) / T), interval)
    return np.where(fin, new_ckpt + tail, partial), new_ckpt


def _mode_index(times: np.ndarray, hof: np.ndarray, u: np.ndarray,
                schedule: Schedule) -> tuple[np.ndarray, list]:
    """Each failure's recovery mode: drawn with the schedule's probabilities, except that with
    a spare pool a non-HOF takes the spare mode exactly when the replayed pool has a spare."""
    modes = [m for _, m in schedule.hof_modes] + [m for _, m in schedule.nonhof_modes]
    cum_h = np.cumsum([p for p, _ in schedule.hof_modes])
    cum_n = np.cumsum([p for p, _ in schedule.nonhof_modes])
    ih = np.minimum(np.searchsorted(cum_h, u, side="right"), len(cum_h) - 1)
    inn = np.minimum(np.searchsorted(cum_n, u, side="right"), len(cum_n) - 1) + len(cum_h)
    pool = schedule.spares
    if pool is not None and pool.usable:   # nonhof_modes = (spare found, pool empty)
        inn = np.where(pool.found_spare(times, ~hof), len(cum_h), len(cum_h) + 1)
    return np.where(hof, ih, inn), modes


def monte_carlo(schedule: Schedule, failures: FailureModel, horizon_s: float, runs: int = 8,
                seed: int = 0) -> MonteCarloResult:
    """Simulate ``runs`` independent jobs of ``horizon_s`` (vectorized across runs; one numpy
    step per failure index)."""
    int_at_least("runs", runs, 1)
    positive("horizon", horizon_s)
    rng = np.random.default_rng(seed)
    times, hof = failures.sample(runs, horizon_s, rng)
    idx, modes = _mode_index(times, hof, rng.random(times.shape), schedule)
    dur = np.array([m.duration_s for m in modes])
    replay = np.array([m.replay_s for m in modes])
    sh = np.array([m.uses_shadow for m in modes])
    to_ckpt = np.array([m.rollback == "checkpoint" for m in modes])
    S = schedule.shadow_rebuild_s
    n = times.shape[0]
    done, ckpt, rec_end = np.zeros(n), np.zeros(n), np.zeros(n)
    ready = np.full(n, -np.inf)
    pending, dirty = np.zeros(n, bool), np.zeros(n, bool)
    running_s, chains, replayed = np.zeros(n), np.zeros(n), np.zeros(n)
    for k in range(times.shape[1]):
        tf, m = times[:, k], idx[:, k]
        active = np.isfinite(tf)
        run = active & (tf >= rec_end)
        close = run & pending
        done = np.where(close & dirty, ckpt, done)
        ready = np.where(close, rec_end, ready)
        pending &= ~close
        dirty &= ~close
        tau = np.where(run, tf - rec_end, 0.0)
        new_done, new_ckpt = _advance(done, ckpt, tau, schedule)
        done, ckpt = np.where(run, new_done, done), np.where(run, new_ckpt, ckpt)
        running_s += tau
        since = np.where(run, tf - ready, 0.0)
        extra = np.where(sh[m], np.maximum(S - since, 0.0), 0.0)
        rec_end = np.where(active, tf + dur[m] + extra, rec_end)
        dirty |= active & to_ckpt[m]
        pending |= active
        chains += run
        replayed += np.where(run, replay[m], 0.0)
    return _finish(schedule, horizon_s, times, done, ckpt, rec_end, pending, dirty,
                   running_s, chains, replayed)


def _finish(schedule: Schedule, horizon_s: float, times: np.ndarray, done: np.ndarray,
            ckpt: np.ndarray, rec_end: np.ndarray, pending: np.ndarray, dirty: np.ndarray,
            running_s: np.ndarray, chains: np.ndarray, replayed: np.ndarray) -> MonteCarloResult:
    """Close the last chain, run to the horizon, and account for the time."""
    done = np.where(pending & dirty, ckpt, done)       # the last chain's rollback
    running = rec_end < horizon_s
    tau = np.where(running, horizon_s - rec_end, 0.0)
    new_done, new_ckpt = _advance(done, ckpt, tau, schedule)
    done, ckpt = np.where(running, new_done, done), np.where(running, new_ckpt, ckpt)
    running_s = running_s + tau
    ckpt_time = ckpt / schedule.interval * schedule.checkpoint_s
    lost = running_s - done * schedule.iteration_s - ckpt_time
    n_chain = max(float(np.sum(chains)), 1.0)
    return MonteCarloResult(
        ettr_runs=done * schedule.reference_s / horizon_s,
        failures=float(np.mean(np.sum(np.isfinite(times), axis=1))),
        recovery_s=float(np.sum(horizon_s - running_s) + np.sum(lost)) / n_chain,
        recompute_s=float(np.sum(lost) + np.sum(replayed)) / n_chain, horizon_s=horizon_s)
