"""The search space of strategies for N devices and a global batch B, with provable pruning."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

from cost_models.errors import ConfigError
from cost_models.limits import MAX_MICROBATCHES
from cost_models.schedule import DEFAULT_SCHEDULE, SCHEDULES
from cost_models.strategy import family_of

MAX_MICRO_BATCH = 64  # largest micro-batch size (sequences) searched


@dataclass(frozen=True)
class Point:
    dp: int
    pp: int
    zero: int
    schedule: str
    v: int
    micro_batch_size: int
    microbatches: int

    @property
    def family(self) -> str:
        return family_of(dp=self.dp, pp=self.pp)


def divisors(n: int, *, at_most: int | None = None) -> list[int]:
    """Divisors of n in increasing order, only those <= at_most if given (O(min(n, at_most)) work)."""
    return [d for d in range(1, (n if at_most is None else min(n, at_most)) + 1) if n % d == 0]


def schedules_for(pp: int, m: int, n_units: int) -> list[tuple[str, int]]:
    """(schedule, v) pairs that can run pp ranks and m micro-batches on n_units units (each schedule's searched v)."""
    if pp == 1:
        return [(DEFAULT_SCHEDULE, 1)]  # one stage: plain gradient accumulation, every schedule is the same
    out = []
    for name, spec in SCHEDULES.items():
        for v in spec.searched_v:
            if pp * v > n_units:
                continue
            try:
                spec.check(pp, m, v)
            except ConfigError:
                continue
            out.append((name, v))
    return out


def enumerate_points(*, gpus: int, global_batch: int, n_units: int, max_micro_batch: int = MAX_MICRO_BATCH,
                     max_microbatches: int = MAX_MICROBATCHES, pipelines: bool = True) -> Iterator[Point]:
    """Every (dp, pp) with dp * pp = gpus, ZeRO 0-3 on dp, every schedule and chunking the units allow, and every
    micro-batch size with dp * m * mbs = B (up to max_micro_batch sequences, and m up to max_microbatches, the
    simulator's cap). Only pp <= n_units and mbs <= max_micro_batch are ever tried, so the work is bounded by
    n_units x max_micro_batch whatever gpus and B are. pipelines=False: pp = 1 only (a model the executor cannot
    cut into stages, ModelProfile.pipeline_refusal)."""
    for pp in divisors(gpus, at_most=n_units if pipelines else 1):
        dp = gpus // pp
        if global_batch % dp:
            continue
        per_replica = global_batch // dp
        for mbs in divisors(per_replica, at_most=max_micro_batch):
            m = per_replica // mbs
            if m > max_microbatches:
                continue
            for schedule, v in schedules_for(pp, m, n_units):
                for zero in ((0,) if dp == 1 else (0, 1, 2, 3)):
                    yield Point(dp=dp, pp=pp, zero=zero, schedule=schedule, v=v, micro_batch_size=mbs, microbatches=m)
