"""The plan file: the chosen strategy, its prediction, the alternatives and why they lost, and provenance."""
from __future__ import annotations

import dataclasses
import hashlib
from pathlib import Path
from typing import Literal

from cost_models.cost.compute import executed_precision
from cost_models.cost.estimate import Estimate
from cost_models.records.base import Record, record
from cost_models.records.cluster import ClusterProfile
from cost_models.records.errors import ConfigError, FileFormatError
from cost_models.records.file_record import FileRecord
from cost_models.records.precision import DTYPE_BYTES
from cost_models.records.profile import ModelProfile, items_per_sequence, pipeline_refusal
from cost_models.records.schedule import format_order
from cost_models.records.strategy import Strategy, priced_digest, tp_node_refusal
from cost_models.records.tensor_parallel import TPRule
from cost_models.records.validate import validate_cluster

PLAN_KIND = "zeropipe.plan"
PLAN_SCHEMA_VERSION = 1


@record
class Alternative(Record):
    strategy: Strategy
    step_time_s: float
    peak_memory_bytes: int
    fits: bool
    lost_because: str


@record
class Candidate(Record):
    """One costed point of the search, for the report's time-against-memory picture."""

    label: str
    family: str
    step_time_s: float
    peak_memory_bytes: int
    fits: bool


# `planner plan --verify K`: trials measured within this share of the fastest count as equally fast, and the
# search's predicted order decides among them (a policy: a few timed steps on a shared machine do not separate
# strategies closer than that; it bounds the measured regret of the choice at 1 + VERIFY_TIE_REL)
VERIFY_TIE_REL = 0.01


@record
class Trial(Record):
    """One candidate of `planner plan --verify K` run for a few steps on this machine (executor.verify), in the
    search's predicted order: what was predicted, what was measured, or why it ended without a measurement."""

    strategy: str                   # Strategy.name
    summary: str                    # Strategy.summary
    predicted_s: float              # the search's estimate of its step time
    measured_s: float | None        # median step time of the slowest rank over the timed steps; None: no result
    failure: str | None = None      # one line: what ended the trial (out of memory, a hang, a rank lost, an error),
                                    # or "not run: ..." when this machine could not host it
    steps: int = 0                  # timed steps the measurement is the median of (after the warm-up)

    @property
    def ratio(self) -> float | None:
        """measured / predicted (None without a measurement)."""
        return None if self.measured_s is None or self.predicted_s <= 0 else self.measured_s / self.predicted_s


@record
class Provenance(Record):
    profile_path: str
    profile_digest: str                 # sha256 of the profile file
    cluster: str
    partitioner: str                    # "chain-dp" | "dag-networkx"
    milp_status: str                    # pulp/CBC status of the MILP run on the chosen strategy's partition
    milp_bottleneck_s: float | None
    dp_bottleneck_s: float | None
    points_considered: int
    points_pruned: int
    points_costed: int
    planning_time_s: float
    versions: dict[str, str]
    command: str
    created_at: str
    # how the profile's unit times were taken where that bears on the prediction: the machine's load while they were
    # timed (summaries.profile_load_line) and what the profiler did about noise (ModelProfile.timing_notes); ()
    # for meta profiles and older plans
    profile_conditions: tuple[str, ...] = ()


def installed_versions() -> dict[str, str]:
    """What made a plan: zeropipe, torch, pulp and Python versions (a plan's provenance)."""
    import platform
    from importlib.metadata import PackageNotFoundError, version

    import pulp
    import torch
    try:
        zeropipe = version("zeropipe")
    except PackageNotFoundError:
        zeropipe = "unknown"
    return {"zeropipe": zeropipe, "torch": torch.__version__, "pulp": pulp.__version__,
            "python": platform.python_version()}


def profile_digest(path: str) -> str:
    """sha256 of the profile file a plan was made from ("" if it cannot be read): replan checks it is unchanged."""
    try:
        return hashlib.sha256(Path(path).read_bytes()).hexdigest()
    except OSError:
        return ""


Binding = Literal["memory", "bandwidth", "compute"]
# cost_models.records.strategy.family_of: the ZeRO-or-pipeline family, "+tp" with tensor parallelism
WinnerFamily = Literal["zero", "pipeline", "hybrid", "tensor", "zero+tp", "pipeline+tp", "hybrid+tp"]


@record
class Rationale(Record):
    binding: Binding
    winner_family: WinnerFamily
    summary: str
    lines: tuple[str, ...]
    best_by_family: dict[str, float]     # family -> best predicted step time among strategies that fit


@record
class ModelRef(Record):
    name: str
    source: str
    seq_len: int
    input_kind: str
    units: tuple[str, ...]
    unit_modules: tuple[tuple[str, ...], ...] = ()   # each unit's module names; () in older plans: each unit is
                                                     # the one module of its name
    pipelining: str = ""                             # the profile's (cost_models.models.pipelining); "" = not recorded
    tp_rules: tuple[TPRule, ...] = ()                # a custom tensor-parallel plan's rules (TPShape.rules)
    dtype: str = ""                                  # the profile's dtype; "" in older plans
    saved_other_dtype_bytes: int = 0                 # what the profile's units save in other dtypes, per profiled
                                                     # micro-batch (UnitProfile.saved_other_dtype_bytes)


def model_ref(profile: ModelProfile) -> ModelRef:
    """What a plan keeps of the profile's model: enough for the executor to rebuild it and cut its stages."""
    return ModelRef(name=profile.name, source=profile.source, seq_len=profile.seq_len, input_kind=profile.input.kind,
                    units=tuple(u.name for u in profile.units), unit_modules=tuple(u.modules for u in profile.units),
                    pipelining=profile.pipelining,
                    tp_rules=profile.tensor_parallel.rules if profile.tensor_parallel else (), dtype=profile.dtype,
                    saved_other_dtype_bytes=sum(u.saved_other_dtype_bytes for u in profile.units))


@record
class Plan(FileRecord):
    """plan.json: the chosen strategy, its prediction, the alternatives and why they lost, and provenance."""

    schema_version: int = PLAN_SCHEMA_VERSION
    kind: str = PLAN_KIND
    model: ModelRef
    cluster: ClusterProfile
    gpus: int
    global_batch_size: int
    strategy: Strategy
    stage_ranks: tuple[tuple[int, ...], ...]   # stage -> global ranks holding it
    prediction: Estimate
    alternatives: tuple[Alternative, ...]
    candidates: tuple[Candidate, ...] = ()     # every costed point (fitting or not)
    trials: tuple[Trial, ...] = ()             # `planner plan --verify K`: the candidates run here, predicted
                                               # order; () when none were (older plans load unchanged)
    rationale: Rationale
    provenance: Provenance

    def check(self, where: str) -> None:
        """check_plan: what is run, reported or re-planned from a file is what was estimated."""
        try:
            check_plan(self)
        except (ConfigError, TypeError, ValueError, AttributeError) as exc:   # a field inconsistent with the rest
            raise FileFormatError(f"{where}: {exc}") from None


def check_plan(plan: Plan) -> None:
    """Raise ConfigError, one line naming the field and the fix, unless the plan is one the planner could have
    written: the strategy is valid for the model's units (Strategy.validate: degrees >= 1, ZeRO 0-3, a known
    schedule, stages covering every unit once and in order), its degrees match the plan's GPU count and global
    batch, and the prediction belongs to this strategy (a rank layout, a memory entry per rank and the schedule's
    own order). Called before any rank starts by every command that takes a plan; an edited plan is refused rather
    than run as something other than what was estimated."""
    s = plan.strategy
    validate_cluster(plan.cluster, "plan", fix="re-create the plan")
    s.validate(plan.model.units)
    fix = "re-create the plan with planner plan"
    # the report prices activations in another dtype from these (report._dtype_note)
    if plan.model.dtype and plan.model.dtype not in DTYPE_BYTES:
        raise ConfigError(f"model.dtype is '{plan.model.dtype}', not one of {', '.join(DTYPE_BYTES)}; {fix}")
    if plan.model.saved_other_dtype_bytes < 0:
        raise ConfigError(f"model.saved_other_dtype_bytes is {plan.model.saved_other_dtype_bytes}, below 0; {fix}")
    if plan.model.unit_modules and len(plan.model.unit_modules) != len(plan.model.units):
        raise ConfigError(f"model.unit_modules lists {len(plan.model.unit_modules)} units but model.units "
                          f"{len(plan.model.units)}; {fix}")
    refusal = pipeline_refusal(plan.model.pipelining)
    if s.pp > 1 and refusal:
        raise ConfigError(f"strategy pp = {s.pp} but the model cannot be pipelined ({refusal}); {fix}")
    if s.global_batch_size != plan.global_batch_size:
        raise ConfigError(f"strategy dp x microbatches x micro_batch_size = {s.dp} x {s.microbatches} x "
                          f"{s.micro_batch_size} = {s.global_batch_size} sequences but global_batch_size is "
                          f"{plan.global_batch_size}; {fix}")
    per_step = plan.global_batch_size * items_per_sequence(plan.model.input_kind, plan.model.seq_len)
    if plan.prediction.tokens_per_step != per_step:   # an edited seq_len would run other work than was priced
        raise ConfigError(f"model.seq_len {plan.model.seq_len} x global_batch_size {plan.global_batch_size} is not "
                          f"the {plan.prediction.tokens_per_step:,} {plan.prediction.throughput_unit} per step the "
                          f"prediction is for; {fix}")
    if s.world_size != plan.gpus:
        raise ConfigError(f"strategy dp x cp x tp x pp = {s.dp} x {s.cp} x {s.tp} x {s.pp} = {s.world_size} ranks "
                          f"but gpus is {plan.gpus}; {fix}")
    if plan.stage_ranks != tuple(s.stage_ranks(i) for i in range(s.n_stages)):
        raise ConfigError(f"stage_ranks do not match the (pp, dp, tp) = ({s.pp}, {s.dp}, {s.tp}) mesh; {fix}")
    node = tp_node_refusal(s.tp, plan.cluster.devices_per_node)
    if node:
        raise ConfigError(f"strategy {node.removeprefix('--')}; {fix}")
    memory = plan.prediction.memory_per_rank
    if tuple(m.rank for m in memory) != tuple(range(s.world_size)):
        raise ConfigError(f"prediction.memory_per_rank has {len(memory)} entries for {s.world_size} ranks; {fix}")
    if plan.trials and not any(t.strategy == s.name and t.measured_s is not None for t in plan.trials):
        raise ConfigError(f"trials do not include a measurement of the chosen strategy {s.name}; {fix}")
    if plan.prediction.pipeline_order != format_order(s.action_order()):
        raise ConfigError(f"prediction.pipeline_order is not the {s.schedule} order for pp={s.pp}, "
                          f"microbatches={s.microbatches}, v={s.v}; {fix}")
    m = plan.model
    # the search prices what the ranks run: a bf16-mixed plan on CPU ranks computes in fp32 (executed_precision)
    ran = dataclasses.replace(s, precision=executed_precision(s.precision, plan.cluster.device.kind))
    priced = {priced_digest(x, model=m.name, source=m.source, seq_len=m.seq_len, units=m.units) for x in (s, ran)}
    if plan.prediction.priced and plan.prediction.priced not in priced:
        raise ConfigError("the strategy or model was edited after the prediction was made (prediction.priced does "
                          f"not match them): an edited optimizer, precision, model or layout is not what was "
                          f"estimated; {fix} (or planner estimate -o)")
