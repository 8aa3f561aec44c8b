"""What `planner plan` is asked: the devices, the batch, the training setup and the part of the space to search."""
from __future__ import annotations

from cost_models.records.base import Record, record
from cost_models.records.cluster import ClusterProfile
from cost_models.records.errors import ConfigError
from cost_models.records.limits import check_global_batch, check_gpus
from cost_models.records.precision import Optimizer, Precision, check_training
from cost_models.records.schedule import get_spec


@record
class PlanRequest(Record):
    global_batch_size: int                         # sequences per optimizer step, over all replicas
    gpus: int | None = None                        # None: every device of the cluster
    top_k: int = 5                                 # alternatives costed in full and kept in the plan
    precision: Precision = "bf16-mixed"
    optimizer: Optimizer = "adamw"
    time_limit_s: float | None = None              # the MILP cross-check of the winner's stage cut (the exact DP chooses it): None = planner.search.MILP_AUTO
    prune: bool = True                             # False: cost every point the memory bound lets through
    schedules: tuple[str, ...] | None = None       # narrow the pipeline schedules searched (None: all)
    micro_batch_sizes: tuple[int, ...] | None = None
    max_v: int | None = None
    tp_degrees: tuple[int, ...] | None = None      # narrow the tensor-parallel degrees searched (None: every one
                                                   # the model and the nodes admit; (1,): none)
    ep_degrees: tuple[int, ...] | None = None      # narrow the expert-parallel degrees searched (None: every power
                                                   # of two dividing the experts; (1,): none)
    cp_degrees: tuple[int, ...] | None = None      # the context-parallel degrees searched (None: planner.space's
                                                   # cp_degrees, 1 below 16K tokens; (1,): none)

    def resolved_gpus(self, cluster: ClusterProfile) -> int:
        """The GPU count to plan for, checked against the cluster (one-line ConfigErrors); the request's other
        fields are checked too. A gpus below 1 or above cost_models/records/limits.py's MAX_GPUS is refused, never read
        as "all"."""
        if self.gpus is None:
            gpus = cluster.world_size
            check_gpus(gpus, "the cluster's device count (nodes x devices per node)")
        else:
            gpus = self.gpus
            check_gpus(gpus)                       # >= 1 and within MAX_GPUS
        if gpus > cluster.world_size:
            raise ConfigError(f"--gpus {gpus} but the cluster has {cluster.world_size} devices; add --nodes or lower --gpus")
        check_global_batch(self.global_batch_size)   # >= 1 and within MAX_GLOBAL_BATCH
        if self.top_k < 1:
            raise ConfigError(f"--top-k must be >= 1, got {self.top_k}")
        check_training(self.precision, self.optimizer)
        for name in self.schedules or ():
            get_spec(name)
        for what, degrees in (("tensor", self.tp_degrees), ("expert", self.ep_degrees),
                              ("context", self.cp_degrees)):
            for d in degrees or ():
                if d < 1 or d & (d - 1):
                    raise ConfigError(f"{what}-parallel degrees must be powers of two, got {d}")
        return gpus


def parse_degrees(text: str, flag: str = "--tp") -> tuple[int, ...]:
    """'1,2,4' -> (1, 2, 4): the degrees `planner plan --tp` (or --ep) searches (one-line ConfigError)."""
    try:
        degrees = tuple(sorted({int(t) for t in text.split(",") if t.strip()}))
    except ValueError:
        raise ConfigError(f"{flag} takes powers of two separated by commas, e.g. 1,2,4 (got '{text}')") from None
    if not degrees or any(d < 1 or d & (d - 1) for d in degrees):
        raise ConfigError(f"{flag} takes powers of two separated by commas, e.g. 1,2,4 (got '{text}')")
    return degrees
