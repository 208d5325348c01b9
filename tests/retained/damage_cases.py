"""Damage cases: random byte flips and page overwrites in every segment kind of a 2-device job,
then recovery; each case must end exactly repaired or with the documented error."""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass

import torch

from leto_lightning.errors import LetoError, RetainedStateError
from leto_lightning.retained.store import RetainedStore
from leto_lightning.testing.crash import KillPoint, run_in_child
from leto_lightning.testing.scenario import CoreScenario, differences, run_step, snapshot
from leto_lightning.updater.recovery import recover_node
from tests.updater.crash_cases import _shadow_step

KINDS = ("data", "parity", "undo", "meta", "spec", "record")
PAGE = 4096


@dataclass
class BaseState:
    """A job's retained memory at one moment, to damage again and again."""

    name: str
    job: object
    saved: dict  # segment name -> bytes
    resume: int  # the iteration recovery must resume at
    reference: list
    golden: dict | None = None  # rank -> what an undamaged recovery leaves (updated pages, counters, marks)


def make_base(scenario: CoreScenario, reference, name: str, steps: int) -> BaseState:
    """``idle``: iteration ``steps`` killed at its compute phase (grads being rewritten);
    ``torn``: rank 0 killed mid-update of iteration ``steps``, rank 1 finished it."""
    job = scenario.create_job()
    job.run(steps)
    if name == "idle":
        assert run_in_child(lambda: _shadow_step(job, 0, steps), kill_at=KillPoint("compute.begin")).killed
        resume = steps
    else:
        whole = scenario.optimizer.endswith("_whole")
        torn = KillPoint("whole.math_done") if whole else KillPoint("chunk.tier1_partial", 3)
        assert run_in_child(lambda: _shadow_step(job, 0, steps), kill_at=torn).killed
        run_in_child(lambda: _shadow_step(job, 1, steps))
        resume = steps + 1
    saved = {seg.name: seg.tensor.clone() for s in job.stores for seg in s.segments.values()}
    base = BaseState(f"{scenario.optimizer}/{name}", job, saved, resume, reference)
    stores = {r: RetainedStore.attach(job.job_id, r) for r in range(scenario.n_ranks)}
    recover_node(stores)
    base.golden = {r: retained_state(s) for r, s in stores.items()}
    for s in stores.values():
        s.close()
    return base


def retained_state(store: RetainedStore) -> dict:
    """Everything a resumed trainer's future depends on: params and optimizer state pages, step
    counters of every piece, scalar state, commit marks."""
    pages = list(store.layout.update_pages)
    return {"pages": store.pages[pages].clone(), "steps": store.steps.clone(), "scalars": store.scalars.clone(),
            "versions": store.versions().clone()}


def _differs(store: RetainedStore, golden: dict) -> list[str]:
    now = retained_state(store)
    return [f"rank {store.spec.rank} {k}" for k in golden if not torch.equal(now[k], golden[k])]


def regions(store: RetainedStore, kind: str) -> list[tuple[torch.Tensor, str]]:
    """The byte ranges of one segment kind of a store."""
    segs = store.segments
    meta_areas = store.spec.meta_area_bytes()
    return {
        "data": [(segs["data"].tensor, "data")],
        "parity": [(segs["parity1"].tensor, "parity1")]
        + ([(segs["parity2"].tensor, "parity2")] if "parity2" in segs else []),
        "undo": [(segs["undo"].tensor, "undo")],
        "meta": [(segs["meta"].tensor[:meta_areas], "meta")],
        "record": [(segs["meta"].tensor[meta_areas:], "record")],
        "spec": [(segs["spec"].tensor, "spec")],
    }[kind]


def damage(stores: list[RetainedStore], kind: str, n: int, rng: random.Random) -> list[str]:
    """``n`` random locations of segment kind ``kind`` (``mix``: any kind each): a flipped byte or
    an overwritten page. Returns what was done."""
    done = []
    for _ in range(n):
        k = rng.choice(KINDS) if kind == "mix" else kind
        store = rng.choice(stores)
        buf, what = rng.choice(regions(store, k))
        if rng.random() < 0.5:
            at = rng.randrange(buf.numel())
            buf[at] ^= rng.randrange(1, 256)
            done.append(f"r{store.spec.rank} {what} byte {at}")
        else:
            n_pages = max(1, buf.numel() // PAGE)
            page = rng.randrange(n_pages)
            view = buf[page * PAGE : (page + 1) * PAGE]
            g = torch.Generator().manual_seed(rng.randrange(1 << 30))
            view.copy_(torch.randint(0, 256, (view.numel(),), dtype=torch.uint8, generator=g))
            done.append(f"r{store.spec.rank} {what} page {page}")
    return done


def run_damage_case(base: BaseState, kind: str, seed: int) -> tuple[str, str]:
    """(outcome, detail): "exact", "reported" -- or "WRONG" / "BAD ERROR" (failures)."""
    rng = random.Random(seed)
    job, sc = base.job, base.job.scenario
    for s in job.stores:
        for seg in s.segments.values():
            seg.tensor.copy_(base.saved[seg.name])
    n = rng.randint(1, sc.config.tier1_parity + 2)
    done = damage(job.stores, kind, n, rng)
    stores = {}
    try:
        for r in range(sc.n_ranks):
            stores[r] = RetainedStore.attach(job.job_id, r)
        reports = recover_node(stores)
        resume = {rep.resume_iteration for rep in reports.values()}
        if resume != {base.resume}:
            return "WRONG", f"{done}: resumes at {resume}, expected {base.resume}"
        wrong = [d for s in stores.values() for d in _differs(s, base.golden[s.spec.local_rank])]
        if not wrong and seed % 8 == 0:  # and, now and then, the slow way: bind and train on
            wrong = _continue_and_compare(job, base)
        return ("WRONG", f"{done}: {wrong}") if wrong else ("exact", "")
    except RetainedStateError as exc:
        return "reported", f"{done}: {type(exc).__name__}: {exc}"
    except LetoError as exc:
        return "BAD ERROR", f"{done}: {type(exc).__name__}: {exc}"
    except Exception as exc:  # anything else escaping recovery or bind is a defect
        return "BAD ERROR", f"{done}: {type(exc).__name__}: {exc}"
    finally:
        for s in stores.values():
            s.close()


def run_repeated_damage_case(base: BaseState, kinds: tuple[str, ...], seed: int) -> tuple[str, str]:
    """One location of a redundantly kept kind damaged, recovered; then another, recovered again:
    each hit alone is within the copies' reach, so both rounds must end exact -- which they do
    only if the first recovery rewrote the copy it found damaged. (outcome, detail) as above."""
    rng = random.Random(seed)
    job, sc = base.job, base.job.scenario
    for s in job.stores:
        for seg in s.segments.values():
            seg.tensor.copy_(base.saved[seg.name])
    done: list[str] = []
    for _ in range(2):
        done += damage(job.stores, rng.choice(kinds), 1, rng)
        stores = {}
        try:
            for r in range(sc.n_ranks):
                stores[r] = RetainedStore.attach(job.job_id, r)
            reports = recover_node(stores)
            resume = {rep.resume_iteration for rep in reports.values()}
            wrong = [d for s in stores.values() for d in _differs(s, base.golden[s.spec.local_rank])]
            if resume != {base.resume} or wrong:
                return "WRONG", f"{done}: resumes at {resume}, expected {base.resume}; {wrong}"
        except Exception as exc:  # any error here is a store the copies could have kept
            return "LOST", f"{done}: {type(exc).__name__}: {exc}"
        finally:
            for s in stores.values():
                s.close()
    return "exact", ""


def _continue_and_compare(job, base: BaseState) -> list[str]:
    """Bind fresh skeletons, check the state, train one more iteration and check again (a wrong
    step counter shows only in the next update)."""
    out = []
    for r in range(job.scenario.n_ranks):
        model, ro = job.attach_trainer(r)
        now = snapshot(model, ro.optimizer)
        out += [f"rank {r} after recovery: {d}" for d in differences(now, base.reference[r][base.resume])]
        run_step(job.scenario, model, ro, r, base.resume)
        now = snapshot(model, ro.optimizer)
        out += [f"rank {r} next step: {d}" for d in differences(now, base.reference[r][base.resume + 1])]
        ro.store.close()
    return out


def table(counts: Counter) -> str:
    outcomes = sorted({o for _, o in counts})
    kinds = sorted({k for k, _ in counts})
    width = max(len(k) for k in kinds) + 2
    lines = ["kind".ljust(width) + "".join(f"{o:>10}" for o in outcomes)]
    for k in kinds:
        lines.append(k.ljust(width) + "".join(f"{counts[(k, o)]:>10}" for o in outcomes))
    return "\n".join(lines)
