"""`planner plan --verify K`: run the plan's top K candidates for a few steps each on this machine and keep the
measured best.

Candidates are taken in the search's predicted order (the chosen strategy, then its alternatives), skipping those
this machine cannot host (executor.launch.check_fits_here), which are recorded as "not run". Each runs in its own
spawn of ranks (executor.launch.launch), so whatever ends it (a rank out of memory or killed, an exception, a
collective timing out, or the watchdog stopping ranks that produced nothing in --verify-timeout seconds) ends that
trial only, recorded in one line. The measure is launch's: the median step time of the slowest rank over the timed
steps. The choice (pick) is the fastest measured trial, the earliest in predicted order among those within
VERIFY_TIE_REL of it; when none produced a measurement the command fails (AllTrialsFailed) and writes no plan:
--verify asks for a measured choice, and a plan none of whose candidates ran here is not one.
"""
from __future__ import annotations

import contextlib
import dataclasses
import threading
from typing import Callable, Iterator, Sequence

from cost_models.cost.estimate import Estimate, estimate
from cost_models.records.base import Record, record
from cost_models.records.errors import ConfigError, PlannerError, interrupted
from cost_models.records.formatting import duration
from cost_models.records.profile import ModelProfile
from cost_models.records.strategy import Strategy
from cost_models.torch_compat.elastic import environ, is_rank_process
from executor.launch import WARMUP_STEPS, RunConfig, check_fits_here, launch
from executor.testing_hooks import INJECT_FAILURE_ENV, VERIFY_INJECT_ENV, hook
from planner.plan import VERIFY_TIE_REL, Alternative, Plan, Trial
from planner.rationale import by_hand, why_lost

NOT_RUN = "not run: "   # how a trial this machine could not host starts its failure line


class AllTrialsFailed(PlannerError):
    """No candidate run by --verify produced a measurement; the message lists why, one clause each."""

    exit_code = 1


@record
class VerifyConfig(Record):
    """How `planner plan --verify K` runs its candidates (its flags)."""

    k: int                     # candidates to run (0: none, the predicted choice stands)
    steps: int = 3             # timed steps per candidate
    warmup: int = WARMUP_STEPS # untimed steps before them
    timeout_s: float = 120.0   # wall-clock limit of one candidate, start-up included (the watchdog)

    def check(self) -> None:
        if self.k < 0 or self.steps < 1 or self.warmup < 0 or self.timeout_s <= 0:
            raise ConfigError("--verify must be >= 0, --verify-steps >= 1 and --verify-timeout > 0")

    @property
    def collective_timeout_s(self) -> float:
        """Collectives give up well before the watchdog (start-up takes seconds too), so launch names a hung rank
        itself when it can."""
        return max(5.0, self.timeout_s / 4)


TrialFn = Callable[[int, Trial], None]


def verify(plan: Plan, profile: ModelProfile, cfg: VerifyConfig, *, on_trial: TrialFn | None = None) -> Plan:
    """Run up to cfg.k candidates of `plan` (module doc); the plan of the measured best, its trials recorded.
    `profile` is the one the plan was searched with (each candidate's full estimate is recomputed from it).
    on_trial(i, trial) is told of each trial as it ends."""
    cfg.check()
    if cfg.k == 0:
        return plan
    trials: list[Trial] = []
    plans: dict[str, Plan] = {}
    for s in ranked(plan):
        if len(plans) == cfg.k:
            break
        p = candidate_plan(plan, s, profile)
        why_not = cannot_host(p)
        trial = _not_run(p, why_not) if why_not else run_trial(p, cfg, index=len(plans))
        if not why_not:
            plans[s.name] = p
        trials.append(trial)
        if on_trial:
            on_trial(len(trials) - 1, trial)
    chosen = trials[pick(trials)]
    return with_choice(plan, tuple(trials), plans[chosen.strategy], profile)


def ranked(plan: Plan) -> list[Strategy]:
    """The plan's candidates in predicted order: the chosen strategy, then the alternatives that fit."""
    return [plan.strategy] + [a.strategy for a in plan.alternatives if a.fits]


def candidate_plan(plan: Plan, s: Strategy, profile: ModelProfile) -> Plan:
    """`plan` with `s` as its strategy: the search's estimate of `s` (cost_models.cost.estimate, a pure function of the
    same strategy, profile and cluster), recomputed with every rank listed, which a runnable plan needs and the
    search keeps for its winner only."""
    if s == plan.strategy:
        return plan
    return dataclasses.replace(plan, strategy=s, stage_ranks=tuple(s.stage_ranks(i) for i in range(s.n_stages)),
                               prediction=estimate(s, profile, plan.cluster))


def cannot_host(p: Plan) -> str | None:
    """Why this machine cannot run the plan's ranks (one line), or None."""
    try:
        check_fits_here(p, p.strategy.world_size)
    except ConfigError as exc:
        return str(exc)
    return None


def _not_run(p: Plan, why: str) -> Trial:
    return Trial(strategy=p.strategy.name, summary=p.strategy.summary, predicted_s=p.prediction.step_time_s,
                 measured_s=None, failure=NOT_RUN + why)


def run_trial(p: Plan, cfg: VerifyConfig, *, index: int) -> Trial:
    """Run the plan for cfg.warmup + cfg.steps steps under the watchdog; whatever ends it early is the trial's
    failure line, never the caller's exception (an interrupt, Ctrl-C or SIGTERM, still ends the command)."""
    run = RunConfig(steps=cfg.warmup + cfg.steps, warmup=cfg.warmup, timeout_s=cfg.collective_timeout_s)
    trial = _not_run(p, "")
    dog = Watchdog(cfg.timeout_s)
    try:
        with _injected(index), dog:
            result = launch(p, run)
    except Exception as exc:   # noqa: BLE001 - any failure of a candidate is that candidate's result
        if interrupted(exc):
            raise
        line = (f"no result within --verify-timeout {cfg.timeout_s:g} s (hung or too slow); the watchdog stopped "
                f"its ranks"
                if dog.fired else one_line(exc))
        return dataclasses.replace(trial, failure=line)
    assert result is not None   # launch returns None only on nodes without rank 0; this run has one node
    return dataclasses.replace(trial, measured_s=result.step_time_s["median_s"], failure=None, steps=cfg.steps)


def one_line(exc: BaseException) -> str:
    """An exception as one line: launch's RunFailed already names the rank; others get their type."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return text if isinstance(exc, PlannerError) else f"{type(exc).__name__}: {text}".rstrip(": ")


@contextlib.contextmanager
def _injected(index: int) -> Iterator[None]:
    """The test hook VERIFY_INJECT_ENV: the failure it names for trial `index` in the ranks' environment."""
    trial, _, spec = hook(VERIFY_INJECT_ENV).partition(":")
    if not spec or int(trial) != index:
        yield
        return
    with environ({INJECT_FAILURE_ENV: spec}):   # the elastic agent's ranks inherit this process's environment
        yield


class Watchdog:
    """While active: after `limit_s`, kill this process's rank processes started since it was entered
    (elastic.is_rank_process). The agent then sees its ranks die and launch raises; `fired` says the watchdog did
    it. A hang that no collective timeout catches (every rank stuck, one rank alone) ends here."""

    def __init__(self, limit_s: float) -> None:
        self.limit_s = limit_s
        self.fired = False
        self._lock = threading.Lock()
        self._done = False
        self._before: set[int] = set()
        self._timer: threading.Timer | None = None

    def __enter__(self) -> "Watchdog":
        import psutil
        self._before = {c.pid for c in psutil.Process().children(recursive=True)}
        self._timer = threading.Timer(self.limit_s, self._fire)
        self._timer.daemon = True
        self._timer.start()
        return self

    def __exit__(self, *exc) -> None:
        with self._lock:   # no kill after this: the lock orders it against _fire
            self._done = True
        if self._timer:
            self._timer.cancel()

    def _fire(self) -> None:
        import psutil
        with self._lock:
            if self._done:
                return
            self.fired = True
            for child in psutil.Process().children(recursive=True):
                with contextlib.suppress(psutil.Error):
                    if child.pid not in self._before and is_rank_process(child):
                        child.kill()


def pick(trials: Sequence[Trial], tie_rel: float = VERIFY_TIE_REL) -> int:
    """The index of the trial to keep: the fastest measured, or the earliest in predicted order (the list's order)
    measured within tie_rel of it. AllTrialsFailed (one line listing each failure) when none was measured."""
    measured = [t.measured_s for t in trials if t.measured_s is not None]
    if not measured:
        why = "; ".join(f"{t.strategy}: {t.failure}" for t in trials) or "no candidate to run"
        raise AllTrialsFailed(f"none of the {len(trials)} candidates --verify tried produced a step time ({why}); "
                              f"plan without --verify, or run one with planner run to see its failure")
    best = min(measured)
    return next(i for i, t in enumerate(trials)
                if t.measured_s is not None and t.measured_s <= best * (1 + tie_rel))


def _rank_text(t: Trial, trials: Sequence[Trial]) -> str:
    """Where the chosen trial stands among those tried, in words."""
    ran = [x.measured_s for x in trials if x.measured_s is not None]
    if len(ran) == 1:
        return f"the only one of {len(trials)} candidates tried that produced a step time"
    if t.measured_s == min(ran):
        return f"the fastest of {len(trials)} candidates tried"
    return (f"within {VERIFY_TIE_REL:.0%} of the fastest of {len(trials)} candidates tried, where the predicted "
            f"order decides")


def _measured_text(t: Trial) -> str:
    if t.measured_s is None:
        return f"{t.strategy}: {t.failure}"
    return f"{t.strategy}: {duration(t.measured_s)} (predicted {duration(t.predicted_s)})"


def with_choice(plan: Plan, trials: tuple[Trial, ...], chosen: Plan, profile: ModelProfile) -> Plan:
    """`plan` after its trials: `chosen` (one of candidate_plan's) is its strategy and prediction, the trials are
    recorded, the alternatives say how each did, and the rationale says the choice was measured, with numbers."""
    t = next(x for x in trials if x.strategy == chosen.strategy.name)
    by_name = {x.strategy: x for x in trials}
    rank = _rank_text(t, trials)
    listing = f"{rank} (" + "; ".join(_measured_text(x) for x in trials) + ")"
    if chosen.strategy == plan.strategy:
        line = (f"verified by measurement: the predicted best ran at {duration(t.measured_s or 0)} per step here, "
                f"{listing}")
        r = plan.rationale
        rationale = dataclasses.replace(r, lines=r.lines[:2] + (line,) + r.lines[2:])
        alternatives = tuple(dataclasses.replace(a, lost_because=_lost(a, by_name, t) or a.lost_because)
                             for a in plan.alternatives)
        return dataclasses.replace(plan, trials=trials, rationale=rationale, alternatives=alternatives)
    return dataclasses.replace(
        chosen, trials=trials, rationale=_measured_rationale(plan, chosen, t, rank, listing),
        alternatives=_alternatives_after(plan, chosen, by_name, t, profile),
        provenance=_provenance_after(plan, chosen.strategy, profile))


def _lost(a: Alternative, by_name: dict[str, Trial], chosen: Trial) -> str | None:
    """How a tried alternative lost to the chosen one in its trial (None if it was not tried)."""
    x = by_name.get(a.strategy.name)
    if x is None:
        return None
    if x.measured_s is None:
        return f"failed in its trial: {x.failure}"
    return (f"measured {duration(x.measured_s)} per step in its trial against {duration(chosen.measured_s or 0)} "
            f"(predicted {duration(x.predicted_s)} against {duration(chosen.predicted_s)})")


def _alternatives_after(plan: Plan, chosen: Plan, by_name: dict[str, Trial], t: Trial,
                        profile: ModelProfile) -> tuple[Alternative, ...]:
    """The predicted best and the other alternatives, in predicted order, against the measured choice: tried ones
    by their trials, the rest by their estimates (planner.rationale.why_lost)."""
    first = Alternative(strategy=plan.strategy, step_time_s=plan.prediction.step_time_s,
                        peak_memory_bytes=plan.prediction.peak_memory_bytes, fits=True, lost_because="")
    out = []
    for a in (first, *plan.alternatives):
        if a.strategy == chosen.strategy:
            continue
        why = _lost(a, by_name, t)
        if why is None:
            est: Estimate = estimate(a.strategy, profile, plan.cluster, per_rank=False)
            why = why_lost(a.strategy, est, chosen.strategy, chosen.prediction)
        out.append(dataclasses.replace(a, lost_because=why))
    return tuple(out)


def _measured_rationale(plan: Plan, chosen: Plan, t: Trial, rank: str, listing: str):
    """The rationale of a choice made by measurement: the chosen strategy's own binding resource and numbers
    (planner.rationale.by_hand: no family comparison of its own), the trials, then the search's comparison, which
    was made against its predicted best."""
    s, est = chosen.strategy, chosen.prediction
    own = by_hand(s, est, plan.cluster)
    picked = (f"picked by measurement: {s.summary} ran at {duration(t.measured_s or 0)} per step here (predicted "
              f"{duration(t.predicted_s)})")
    lines = (own.lines[0].replace("chosen by hand:", "chosen by measurement:", 1), own.lines[1],
             f"{picked}, {listing}",
             *own.lines[3:],   # by_hand's tensor-parallel line, if any
             f"the search's comparison, made against its predicted best ({plan.strategy.summary}):",
             *plan.rationale.lines[2:])
    return dataclasses.replace(own, summary=f"{picked}, {rank}; {own.lines[1]}", lines=lines,
                               best_by_family=plan.rationale.best_by_family)


def _provenance_after(plan: Plan, s: Strategy, profile: ModelProfile):
    """The search's provenance, its partition cross-check (made on the predicted best's cut) no longer claimed."""
    partitioner = ("none (one stage)" if s.n_stages == 1 else "chain-dp" if profile.is_chain else "dag-networkx")
    return dataclasses.replace(plan.provenance, partitioner=partitioner, milp_bottleneck_s=None,
                               dp_bottleneck_s=None, milp_status="not run: chosen by measurement (--verify)")
