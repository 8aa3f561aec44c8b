"""run.json: what `planner run` measured, set beside the plan's prediction (executor/launch.py builds it; the
report renders it; both read the typed rows here, so no unit hides in a label).

Schema version 2 made the predicted-vs-measured rows typed (a name and a unit); a version 1 file is refused with
one line saying to re-run.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Literal

from cost_models.records.base import Record, record
from cost_models.records.errors import FileFormatError
from cost_models.records.file_record import FileRecord
from cost_models.records.formatting import duration
from planner.plan import Plan

RUN_KIND = "zeropipe.run"
RUN_SCHEMA_VERSION = 2


@record
class RankResult(Record):
    """What one rank measured over a run."""

    rank: int
    pp_rank: int
    dp_rank: int
    stages: tuple[int, ...]
    step_times_s: tuple[float, ...]        # every step, warm-up included
    losses: tuple[float, ...]              # global-batch loss per step (the same on every rank)
    parameter_bytes: int                   # counted from the local tensors after the last step
    gradient_bytes: int
    optimizer_state_bytes: int
    peak_memory_bytes: int
    peak_memory_source: str
    comm_bytes: dict[str, int]             # one extra step, counted: kind -> bytes (full buffers)
    comm_calls: dict[str, int]
    compute_s: tuple[float, ...] = ()      # per step: time inside stage forward/backward (FSDP/DDP comm included)
    sync_s: tuple[float, ...] = ()         # per step: gradient syncs issued after backward (pipelined ZeRO-0/1, ties)
    optimizer_s: tuple[float, ...] = ()    # per step: optimizer.step
    restore_s: float = 0.0                 # loading the checkpoint resumed from (not in any step time)
    checkpoint_steps: tuple[int, ...] = () # steps after which a checkpoint was committed
    checkpoint_s: tuple[float, ...] = ()   # seconds each save took (not in any step time)
    activation_bytes: int = -1             # peak bytes held for backward in the counted step (executor.activations);
                                           # -1: not measured (no counted step, or a run.json from before)
    expert_rows: dict[str, int] = dataclasses.field(default_factory=dict)   # expert parallelism, the counted step:
                                           # block -> token-expert rows this rank's experts were sent
    expert_calls: dict[str, tuple[int, ...]] = dataclasses.field(default_factory=dict)   # and per call, in order
                                           # (a micro-batch's forward; a recomputed one again)


@record
class Measure(Record):
    """One quantity the plan predicted and the run measured, in `unit` (seconds, bytes, or a ratio)."""

    quantity: str                          # "step time", "rank 1 parameters", "p2p bytes per step (one pipeline)"
    unit: Literal["s", "B", "x"]
    predicted: float
    measured: float

    @property
    def error_pct(self) -> float | None:
        """How far the measurement is from the prediction, in % of the prediction (None when nothing was predicted)."""
        return (self.measured - self.predicted) / self.predicted * 100.0 if self.predicted else None


@record
class RunFile(FileRecord):
    """run.json: the run's losses and step times per rank, and every prediction of the plan beside its measurement."""

    REWRITE = "re-run planner run to write it again"

    schema_version: int = RUN_SCHEMA_VERSION
    kind: str = RUN_KIND
    model: str
    strategy_summary: str                  # Strategy.summary of the plan's strategy
    world_size: int
    steps: int
    warmup: int
    backend: str
    losses: tuple[float, ...]
    step_time_s: dict[str, Any]            # median / min / max over timed steps, slowest rank
    tokens_per_s: float
    predicted_step_time_s: float
    ranks: tuple[RankResult, ...]
    measures: tuple[Measure, ...]
    created_at: str
    start_step: int = 0                    # losses[i] is step start_step + i
    resumed_from: str | None = None        # the checkpoint folder the run started from
    checkpoints: tuple[str, ...] = ()      # checkpoint folders this run committed
    throughput_unit: str = "tokens"        # what tokens_per_s counts: "tokens" | "samples" (as the plan's estimate)
    load_1min: tuple[float, ...] = ()      # the machine's 1-minute load average when the ranks started and ended
    cpus: int = 0                          # the machine's CPUs (os.cpu_count), beside the load


def load_run(path, plan: Plan) -> RunFile:
    """Read run.json and check it is a run of `plan` (the report sets its measurements beside the plan's
    predictions): the same model, strategy, rank count and predicted step time, one result per rank."""
    run = RunFile.load(path)
    planned = (plan.model.name, plan.strategy.summary, plan.strategy.world_size, plan.prediction.step_time_s)
    if (run.model, run.strategy_summary, run.world_size, run.predicted_step_time_s) != planned:
        raise FileFormatError(f"{path} is a run of {run.strategy_summary} ({run.model}, {run.world_size} ranks, "
                              f"predicted {duration(run.predicted_step_time_s, 6)}), not of this plan "
                              f"({planned[1]}, {planned[0]}, {planned[2]} ranks, predicted {duration(planned[3], 6)}); "
                              f"pass the run.json that `planner run` wrote for this plan")
    if sorted(r.rank for r in run.ranks) != list(range(run.world_size)):
        raise FileFormatError(f"{path} has results for ranks {sorted(r.rank for r in run.ranks)} of a "
                              f"{run.world_size}-rank run; re-run planner run")
    return run
