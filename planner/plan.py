"""The plan file: the chosen strategy, its prediction, the alternatives and why they lost, and provenance."""
from __future__ import annotations

from typing import Literal

from cost_models.cluster import ClusterProfile
from cost_models.estimate import Estimate
from cost_models.fileio import read_json
from cost_models.records import Record, record
from cost_models.strategy import Strategy

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


@record
class Rationale(Record):
    binding: Literal["memory", "bandwidth", "compute"]
    winner_family: Literal["zero", "pipeline", "hybrid"]
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


@record
class Plan(Record):
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
    rationale: Rationale
    provenance: Provenance


def load_plan(path) -> Plan:
    return Plan.from_dict(read_json(path, kind=PLAN_KIND, schema_version=PLAN_SCHEMA_VERSION))
