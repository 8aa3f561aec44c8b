"""Calibration from runs: fit what real runs show and write it into the cluster profile (`planner calibrate`).

The fit is a pure function over plain data (benchmarks call it): each run is a pair of what the plan predicted
(PredictedParts, read off its Estimate) and what the run measured (MeasuredParts, the slowest rank's median of each
timed part). Four values can be fitted:

    optimizer      = optimizer_scale x O                         (least squares through 0, on its own measurement)
    step           = C + compute_scale x (1 + b) U + pipeline_action_s x (1 + b) A + dp_comm_scale x D
                                                                  (weighted least squares, the others as planned)

U: the critical rank's unit forward/backward time; A: its pipeline actions per step (the schedule runtime's fixed
cost per action, probed by cost_models/profiling/overhead_probe.py, is refitted); D: its exposed data-parallel
collective time; b: the bubble's share of compute (the bubble stretches with the stage times it waits on); C: the rest
of the step as predicted (TP collectives, p2p, the fitted optimizer). Each equation is weighted by 1 / measured step
time, so every run counts by its relative error (what MAPE scores). The step-time equation is fitted, rather than the
executor's compute and sync parts, because those split differently from the estimate's (DDP and FSDP run
data-parallel collectives inside forward/backward, ZeroRedundancyOptimizer inside its step), and a fit to the parts
then scored on the step extrapolated badly (fidelity's cross-validation: benchmarks/results/measurements.md,
"Calibration"). Which of the per-action
and data-parallel terms are fitted is chosen by k-fold cross-validation over the runs (the set with the lowest
held-out MAPE, compute_scale always in it), among sets whose columns the runs tell apart (condition number below
COND_MAX) and whose values make physical sense (positive scales, a non-negative per-action cost). run.json times
forward and backward together, so one compute factor is fitted, not one each.

The calibrated step time, as the estimate recomputes it, is that linear model (predict_after). Exact without a
pipeline on CPU ranks; on GPUs without a pipeline, collectives hide behind compute unit by unit, so a compute
factor also changes the exposed data-parallel time and the linear model is an approximation there.
"""
from __future__ import annotations

import dataclasses
import itertools
import statistics
from pathlib import Path
from typing import Any, Sequence

from cost_models.cost.estimate import Estimate, action_cost
from cost_models.records.base import Record, record
from cost_models.records.cluster import Calibration, CalibrationRun, ClusterProfile
from cost_models.records.errors import ConfigError, FileFormatError
from cost_models.records.formatting import duration, now_utc
from cost_models.records.strategy import Strategy
from planner.plan import Plan
from planner.run_record import RankResult, RunFile

COND_MAX = 100.0          # condition number above which the extra terms are not told apart from compute
TERMS = ("compute_scale", "pipeline_action_s", "dp_comm_scale")   # the step-time equation's unknowns, in order
CV_FOLDS = 5              # folds of the cross-validation that picks the terms
_NEUTRAL_SCALE = 1.0


@record
class PredictedParts(Record):
    """What the fit needs of one prediction (predicted_parts reads it off an Estimate)."""

    step_s: float
    unit_compute_s: float     # U: the critical rank's unit forward/backward time per step
    actions: int              # A: pipeline actions that rank runs per step (0 without a pipeline)
    action_s: float           # the per-action overhead the prediction used
    tp_comm_s: float          # T: tensor-parallel collectives inside compute (not refitted)
    bubble_factor: float      # bubble_s / compute_s: the bubble grows with the stage times
    dp_comm_s: float          # D
    optimizer_s: float        # O


@record
class MeasuredParts(Record):
    """One run's timed parts: the slowest rank's median over the timed steps of each (executor/runtime.py)."""

    step_s: float
    compute_s: float
    sync_s: float
    optimizer_s: float


@record
class Fit(Record):
    """Fitted values (the neutral value where not fitted) and the step-time residuals over the runs."""

    compute_scale: float
    optimizer_scale: float
    dp_comm_scale: float
    pipeline_action_s: float | None    # None: not fitted (the plans' own per-action cost stays)
    fitted: tuple[str, ...]
    before_s: tuple[float, ...]        # each run's predicted step, as planned
    after_s: tuple[float, ...]         # and calibrated
    measured_s: tuple[float, ...]
    mape_before: float
    mape_after: float


def actions_per_step(s: Strategy) -> int:
    """Pipeline actions one rank runs per step: a forward and a backward (I and W when split) per micro-batch and
    stage chunk; the estimate charges the per-action cost on exactly these (0 without a pipeline)."""
    if s.n_stages == 1:
        return 0
    return s.microbatches * s.v * (3 if s.spec.split_backward else 2)


def predicted_parts(est: Estimate, s: Strategy, cluster: ClusterProfile) -> PredictedParts:
    """The parts of a (full) estimate of `s` on `cluster` that the fit scales."""
    b = est.breakdown
    action_s = action_cost(s, cluster)
    actions = actions_per_step(s)
    # the exposed TP, EP and CP collectives counted inside compute_s are communication, not refitted
    unit_compute = max(0.0, b.compute_s - b.tp_comm_s - b.ep_comm_s - b.cp_comm_s - actions * action_s)
    return PredictedParts(step_s=est.step_time_s, unit_compute_s=unit_compute, actions=actions, action_s=action_s,
                          tp_comm_s=b.tp_comm_s, bubble_factor=b.bubble_s / b.compute_s if b.compute_s > 0 else 0.0,
                          dp_comm_s=b.dp_comm_s, optimizer_s=b.optimizer_s)


def _slowest_median(per_rank: Sequence[Sequence[float]], warmup: int) -> float:
    return max(statistics.median(list(t[warmup:]) or list(t)) for t in per_rank)


def measured_parts(ranks: Sequence[RankResult], warmup: int, where: str = "run") -> MeasuredParts:
    """The slowest rank's median of each timed part over the steps after `warmup`."""
    if not ranks or any(not r.step_times_s or len(r.compute_s) != len(r.step_times_s) or
                        len(r.optimizer_s) != len(r.step_times_s) for r in ranks):
        raise FileFormatError(f"{where}: no per-step compute and optimizer timings on every rank; re-run planner run "
                              f"(this zeropipe records them)")
    return MeasuredParts(step_s=_slowest_median([r.step_times_s for r in ranks], warmup),
                         compute_s=_slowest_median([r.compute_s for r in ranks], warmup),
                         sync_s=_slowest_median([r.sync_s or (0.0,) * len(r.step_times_s) for r in ranks], warmup),
                         optimizer_s=_slowest_median([r.optimizer_s for r in ranks], warmup))


# --- the fit ------------------------------------------------------------------------------------------------------

def _column(p: PredictedParts, term: str) -> float:
    stretch = 1.0 + p.bubble_factor
    columns = {"compute_scale": stretch * p.unit_compute_s, "pipeline_action_s": stretch * p.actions,
               "dp_comm_scale": p.dp_comm_s}
    return columns[term]


def _neutral(p: PredictedParts, term: str) -> float:
    return p.action_s if term == "pipeline_action_s" else _NEUTRAL_SCALE


def _rest(p: PredictedParts, optimizer_scale: float) -> float:
    """The step as predict_after gives it with every TERMS value at 0 (C in the module doc)."""
    return (p.step_s - sum(_neutral(p, t) * _column(p, t) for t in TERMS)
            + (optimizer_scale - 1.0) * p.optimizer_s)


def _solve(pairs: Sequence[tuple[PredictedParts, MeasuredParts]], terms: tuple[str, ...],
           optimizer_scale: float) -> dict[str, float] | None:
    """Weighted least squares of the step-time equation over `terms` (the others at the plans' values); None
    when the columns are not told apart or a value makes no physical sense."""
    import numpy as np
    rows, ys = [], []
    for p, m in pairs:
        w = 1.0 / m.step_s
        fixed = _rest(p, optimizer_scale) + sum(_neutral(p, t) * _column(p, t) for t in TERMS if t not in terms)
        rows.append([w * _column(p, t) for t in terms])
        ys.append(w * (m.step_s - fixed))
    x, y = np.array(rows), np.array(ys)
    norms = np.linalg.norm(x, axis=0)
    if (norms == 0).any() or np.linalg.cond(x / norms) > COND_MAX:
        return None
    sol = dict(zip(terms, (float(v) for v in np.linalg.lstsq(x, y, rcond=None)[0])))
    ok = all(v > 0 for t, v in sol.items() if t != "pipeline_action_s") and sol.get("pipeline_action_s", 0.0) >= 0
    return sol if ok else None


def _held_out_mape(pairs: Sequence[tuple[PredictedParts, MeasuredParts]], terms: tuple[str, ...],
                   optimizer_scale: float) -> float | None:
    """Mean step-time error of `terms` fitted on k - 1 folds and scored on the k-th (k = min(5, runs)); None when
    a fold leaves no more runs than terms or a fold's fit fails."""
    k = min(CV_FOLDS, len(pairs))
    errors = []
    for fold in range(k):
        train = [pr for i, pr in enumerate(pairs) if i % k != fold]
        if len(train) <= len(terms):
            return None
        sol = _solve(train, terms, optimizer_scale)
        if sol is None:
            return None
        errors += [abs(_predict(p, sol, optimizer_scale) - m.step_s) / m.step_s
                   for i, (p, m) in enumerate(pairs) if i % k == fold]
    return statistics.mean(errors)


def _predict(p: PredictedParts, sol: dict[str, float], optimizer_scale: float) -> float:
    return predict_after(p, compute_scale=sol["compute_scale"], optimizer_scale=optimizer_scale,
                         dp_comm_scale=sol.get("dp_comm_scale", 1.0), pipeline_action_s=sol.get("pipeline_action_s"))


def _compute_terms(pairs: Sequence[tuple[PredictedParts, MeasuredParts]], optimizer_scale: float) -> dict[str, float]:
    """compute_scale with the extra terms whose set predicts held-out runs best (module doc); compute_scale alone
    when there are too few runs to cross-validate more."""
    extras = [t for t in TERMS[1:] if any(_column(p, t) > 0 for p, _ in pairs)]
    sets = [("compute_scale", *chosen) for n in range(len(extras) + 1) for chosen in itertools.combinations(extras, n)]
    scored = [(err, len(terms), terms) for terms in sets
              if (err := _held_out_mape(pairs, terms, optimizer_scale)) is not None]
    for _, _, terms in sorted(scored) + [(0.0, 1, ("compute_scale",))]:
        sol = _solve(pairs, terms, optimizer_scale)
        if sol is not None:
            return sol
    raise ConfigError("the runs' measured step is below what the plans fix (tensor-parallel collectives, p2p, "
                      "per-action costs): nothing to scale; calibrate with runs that ran their plans' compute")


def _optimizer_scale(pairs: Sequence[tuple[PredictedParts, MeasuredParts]]) -> float | None:
    """Least squares through the origin on relative residuals; None where no run predicts an optimizer step."""
    num = sum(p.optimizer_s * m.optimizer_s / m.step_s ** 2 for p, m in pairs)
    den = sum(p.optimizer_s ** 2 / m.step_s ** 2 for p, m in pairs)
    return num / den if den > 0 and num > 0 else None


def predict_after(p: PredictedParts, *, compute_scale: float = 1.0, optimizer_scale: float = 1.0,
                  dp_comm_scale: float = 1.0, pipeline_action_s: float | None = None) -> float:
    """The step time the estimate gives with these values (module doc: linear in each, bubble stretched)."""
    action = p.action_s if pipeline_action_s is None else pipeline_action_s
    pipeline = (compute_scale - 1.0) * p.unit_compute_s + (action - p.action_s) * p.actions
    return (p.step_s + (1.0 + p.bubble_factor) * pipeline + (dp_comm_scale - 1.0) * p.dp_comm_s
            + (optimizer_scale - 1.0) * p.optimizer_s)


def mape(predicted: Sequence[float], measured: Sequence[float]) -> float:
    return statistics.mean(abs(p - m) / m for p, m in zip(predicted, measured))


def fit(pairs: Sequence[tuple[PredictedParts, MeasuredParts]]) -> Fit:
    """Fit the runs (module doc). Raises ConfigError for no runs or a run with nothing timed."""
    if not pairs:
        raise ConfigError("no runs to calibrate from; pass the run.json files `planner run` wrote")
    if any(m.step_s <= 0 for _, m in pairs):
        raise ConfigError("a run has no positive step time; calibrate from runs that timed their steps")
    opt = _optimizer_scale(pairs)
    sol = _compute_terms(pairs, opt if opt is not None else 1.0)
    # keyword arguments of predict_after and Fit: floats, pipeline_action_s None where not fitted
    values: dict[str, Any] = {"compute_scale": sol["compute_scale"],
                              "optimizer_scale": opt if opt is not None else 1.0,
                              "dp_comm_scale": sol.get("dp_comm_scale", 1.0),
                              "pipeline_action_s": sol.get("pipeline_action_s")}
    fitted = tuple(t for t in ("compute_scale", "optimizer_scale", "dp_comm_scale", "pipeline_action_s")
                   if t in sol or (t == "optimizer_scale" and opt is not None))
    before = tuple(p.step_s for p, _ in pairs)
    after = tuple(predict_after(p, **values) for p, _ in pairs)
    measured = tuple(m.step_s for _, m in pairs)
    return Fit(**values, fitted=fitted, before_s=before, after_s=after, measured_s=measured,
               mape_before=mape(before, measured), mape_after=mape(after, measured))


# --- runs and plans from files -------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class _Paired:
    path: str
    run: RunFile
    plan: Plan


def _run_path(path: Path) -> Path:
    return path / "run.json" if path.is_dir() else path


def _matches(run: RunFile, plan: Plan) -> bool:
    """The identity run_record.load_run checks: model, strategy, ranks and the predicted step time."""
    return (run.model, run.strategy_summary, run.world_size, run.predicted_step_time_s) == (
        plan.model.name, plan.strategy.summary, plan.strategy.world_size, plan.prediction.step_time_s)


def pair_runs(run_paths: Sequence[Path], plan_paths: Sequence[Path]) -> list[_Paired]:
    """Each run with the plan it ran: one given with --plan, else plan.json beside the run."""
    if not run_paths:
        raise ConfigError("no runs to calibrate from; pass the run.json files `planner run` wrote")
    given = [Plan.load(p) for p in plan_paths]
    out: list[_Paired] = []
    for raw in run_paths:
        path = _run_path(Path(raw))
        run = RunFile.load(path)
        beside = path.with_name("plan.json")
        plans = given + ([Plan.load(beside)] if beside.is_file() and beside not in plan_paths else [])
        plan = next((p for p in plans if _matches(run, p)), None)
        if plan is None:
            raise ConfigError(f"{path} is a run of {run.strategy_summary} ({run.model}, {run.world_size} ranks, "
                              f"predicted {duration(run.predicted_step_time_s, 6)}) and no plan given matches it; "
                              f"pass the plan.json it ran with --plan")
        if any(p.path == str(path.resolve()) for p in out):
            raise ConfigError(f"{path} is given twice; pass each run once")
        out.append(_Paired(path=str(path.resolve()), run=run, plan=plan))
    return out


def _same_cluster(paired: Sequence[_Paired]) -> ClusterProfile:
    """The one cluster every plan was made for (the fitted factors are relative to its predictions)."""
    first = paired[0]
    for p in paired[1:]:
        if p.plan.cluster != first.plan.cluster:
            raise ConfigError(f"{p.path} ran a plan for cluster '{p.plan.cluster.name}' and {first.path} one for "
                              f"'{first.plan.cluster.name}' (or the same name, other values); calibrate the runs of "
                              f"one cluster at a time")
    return first.plan.cluster


def calibrated_cluster(cluster: ClusterProfile, f: Fit, paired: Sequence[_Paired]) -> ClusterProfile:
    """`cluster` with the fit composed onto any calibration its plans were already made with."""
    old = cluster.calibration or Calibration()
    action = f.pipeline_action_s if f.pipeline_action_s is not None else old.pipeline_action_s
    runs = tuple(CalibrationRun(path=p.path, created_at=p.run.created_at, model=p.run.model,
                                strategy=p.run.strategy_summary, world_size=p.run.world_size, measured_step_s=m,
                                predicted_before_s=b, predicted_after_s=a)
                 for p, b, a, m in zip(paired, f.before_s, f.after_s, f.measured_s))
    cal = Calibration(compute_scale=old.compute_scale * f.compute_scale,
                      optimizer_scale=old.optimizer_scale * f.optimizer_scale,
                      dp_comm_scale=old.dp_comm_scale * f.dp_comm_scale, pipeline_action_s=action,
                      fitted=tuple(dict.fromkeys(old.fitted + f.fitted)), runs=runs, mape_before=f.mape_before,
                      mape_after=f.mape_after, created_at=now_utc())
    return dataclasses.replace(cluster, calibration=cal)


# A fitted factor beyond this either way means the runs measured something other than the plans' work (a stalled
# or shared machine, another model's runs): the disagreements calibration exists for are tens of percent (docs/
# fidelity.md: step-time MAPE 11-22%, TP candidates up to 38%). A stated bound, not a measurement.
PLAUSIBLE_FACTOR = 10.0


def check_plausible(f: Fit) -> None:
    """ConfigError (one line) when a fitted factor is beyond PLAUSIBLE_FACTOR either way."""
    for name in ("compute_scale", "optimizer_scale", "dp_comm_scale"):
        value = getattr(f, name)
        if not 1 / PLAUSIBLE_FACTOR <= value <= PLAUSIBLE_FACTOR:
            raise ConfigError(f"the runs fit {name.replace('_', ' ')} x {value:.3g}, beyond x{PLAUSIBLE_FACTOR:g} either "
                              "way: they measured something else than the plans (a busy or stalled machine, another "
                              "model's runs); re-run them, or pass --any-factor to keep it")


def calibrate(run_paths: Sequence[Path], plan_paths: Sequence[Path] = (), *,
              any_factor: bool = False) -> tuple[ClusterProfile, Fit]:
    """Read the runs and their plans, fit, and return the plans' cluster with the calibration, and the fit;
    a factor beyond PLAUSIBLE_FACTOR is refused unless `any_factor`."""
    paired = pair_runs(run_paths, plan_paths)
    cluster = _same_cluster(paired)
    pairs = [(predicted_parts(p.plan.prediction, p.plan.strategy, p.plan.cluster),
              measured_parts(p.run.ranks, p.run.warmup, p.path)) for p in paired]
    f = fit(pairs)
    if not any_factor:
        check_plausible(f)
    return calibrated_cluster(cluster, f, paired), f
