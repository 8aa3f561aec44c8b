"""The search space of strategies for N devices and a global batch B, with provable pruning."""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Iterator, Sequence

from cost_models.records.errors import ConfigError
from cost_models.records.limits import MAX_MICROBATCHES
from cost_models.records.schedule import DEFAULT_SCHEDULE, SCHEDULES
from cost_models.records.strategy import family_of, tp_node_refusal
from cost_models.records.tensor_parallel import TPShape

MAX_MICRO_BATCH = 64  # largest micro-batch size (sequences) searched
NO_TP = ((1, False),)


@dataclass(frozen=True)
class Point:
    dp: int
    pp: int
    zero: int
    schedule: str
    v: int
    micro_batch_size: int
    microbatches: int
    tp: int = 1
    sp: bool = False
    distributed_optimizer: bool = False   # ZeRO-1 as Megatron-LM's (Strategy.distributed_optimizer)
    ep: int = 1                           # expert parallelism over ep of the dp ranks (Strategy.ep)
    cp: int = 1                           # context parallelism: dp is its data view's dp x cp (Strategy.data_view)

    @property
    def family(self) -> str:
        return family_of(dp=self.dp, pp=self.pp, tp=self.tp)


@dataclass(frozen=True)
class TPOptions:
    """The (tp, sp) pairs searched, and one line per degree left out saying why (the rationale prints them)."""

    pairs: tuple[tuple[int, bool], ...] = NO_TP
    notes: tuple[str, ...] = ()
    refusal: str | None = None     # why the model gets no tensor parallelism at all (then pairs is tp=1 only)
    sp_pipelines: bool = True      # sequence parallelism also with pipeline stages (TPPlan.sp_pipelines)


def tp_options(shape: TPShape | None, *, devices_per_node: int, gpus: int, seq_len: int,
               degrees: Sequence[int] | None = None) -> TPOptions:
    """tp in powers of two that divide the GPUs per node (the mesh is (pp, dp, tp) with tp innermost, so a group of
    tp adjacent ranks stays inside one node) and the GPUs searched, and that the model admits
    (TPShape.tp_refusal: heads, key/value heads, MLP width); sequence parallelism on and off where it is allowed.
    `degrees` narrows the tp values (a request's)."""
    if shape is None:
        return TPOptions(refusal="the profile predates tensor-parallel plans; re-run planner profile to search tp")
    if shape.refusal:
        return TPOptions(refusal=shape.refusal)
    pairs: list[tuple[int, bool]] = [(1, False)]
    notes: list[str] = []
    sp_pipelines = True
    tp = 2
    while tp <= devices_per_node:
        if tp_node_refusal(tp, devices_per_node) is None and gpus % tp == 0 and (degrees is None or tp in degrees):
            why = shape.tp_refusal(tp)
            if why:
                notes.append(f"tp={tp} not searched: {why}")
            else:
                pairs.append((tp, False))
                sp_why = shape.tp_refusal(tp, sp=True, seq_len=seq_len)
                if sp_why is None:
                    pairs.append((tp, True))
                    staged_why = shape.tp_refusal(tp, sp=True, seq_len=seq_len, pp=2)
                    if staged_why and sp_pipelines:
                        sp_pipelines = False
                        notes.append(f"sequence parallelism searched at pp = 1 only: {staged_why}")
                elif not any(n.startswith("sequence parallelism") for n in notes):   # one line says it
                    notes.append(f"sequence parallelism not searched at tp={tp}: {sp_why}")
        tp *= 2
    if degrees is not None:
        pairs = [p for p in pairs if p[0] in degrees] or pairs[:1]
    return TPOptions(pairs=tuple(pairs), notes=tuple(notes), sp_pipelines=sp_pipelines)


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


def ep_degrees(experts: int, *, degrees: Sequence[int] | None = None) -> tuple[int, ...]:
    """The expert-parallel degrees searched for a model with `experts` routed experts per block (0: dense, ep = 1
    only): powers of two dividing the experts (EP groups then tile nodes of a power-of-two size), narrowed to
    `degrees` (a request's) where given."""
    out = [1]
    ep = 2
    while experts and ep <= experts and experts % ep == 0:
        out.append(ep)
        ep *= 2
    return tuple(e for e in out if degrees is None or e in degrees) or (1,)


# Context parallelism is searched by default from this sequence length on: NVIDIA NeMo's long-context recipes,
# which train with context parallelism, start at 16K tokens (NeMo Framework user guide, "Long Context Recipes");
# below it a sequence's activations are small next to a layer's weights, and CP only adds its gathers.
LONG_SEQUENCE = 16_384
# ... and down to chunks of this many tokens (a rank holds two): Llama 3 405B ran 131,072 tokens over CP16, chunks
# of 4,096 (Grattafiori et al. 2024, section 3.3.2); a quarter of that still fills a flash-attention tile row many
# times over.
MIN_CP_CHUNK = 1_024


def cp_degrees(profile, gpus: int, *, degrees: Sequence[int] | None = None) -> tuple[int, ...]:
    """The context-parallel degrees searched: `degrees` (a request's) where given, each checked (its 2 x cp chunks
    divide the sequence: cost.context_parallel.cp_refusal); else 1, and from LONG_SEQUENCE tokens on every power of
    two up to the GPUs that cp_refusal lets through and whose chunks hold MIN_CP_CHUNK tokens or more. Mixtures of
    experts are not split (CP with their expert parallelism, or in their blocks, is not built)."""
    from cost_models.cost.context_parallel import cp_refusal
    for cp in degrees or ():
        why = cp_refusal(profile, cp) or ("context parallelism of mixture-of-experts models is not built yet"
                                          if cp > 1 and profile.experts else None)
        if why:
            raise ConfigError(f"--cp {cp}: {why}")
    if degrees is not None:
        return tuple(degrees)
    out = [1]
    cp = 2
    while (not profile.experts and profile.seq_len >= LONG_SEQUENCE and cp <= gpus
           and profile.seq_len // (2 * cp) >= MIN_CP_CHUNK and cp_refusal(profile, cp) is None):
        out.append(cp)
        cp *= 2
    return tuple(out)


def enumerate_points(*, gpus: int, global_batch: int, n_units: int, max_micro_batch: int = MAX_MICRO_BATCH,
                     max_microbatches: int = MAX_MICROBATCHES, pipelines: bool = True,
                     tp_pairs: Sequence[tuple[int, bool]] = NO_TP, sp_pipelines: bool = True,
                     distributed_optimizer: bool = False, eps: Sequence[int] = (1,)) -> Iterator[Point]:
    """Every (tp, sp) of `tp_pairs` (tp_options), every (dp, pp) with dp * pp * tp = gpus, ZeRO 0-3 on dp, every
    schedule and chunking the units allow, and every micro-batch size with dp * m * mbs = B (up to max_micro_batch
    sequences, and m up to max_microbatches, the simulator's cap). Only pp <= n_units and mbs <= max_micro_batch
    are ever tried, so the work is bounded by |tp_pairs| x n_units x max_micro_batch whatever gpus and B are.
    pipelines=False: pp = 1 only (a model the executor cannot cut into stages, ModelProfile.pipeline_refusal);
    sp_pipelines=False: sequence parallelism at pp = 1 only (TPOptions.sp_pipelines). distributed_optimizer: ZeRO-1
    without a pipeline also as Megatron-LM's distributed optimizer (searched on GPU clusters). eps: the expert-
    parallel degrees (ep_degrees), each where it divides dp."""
    for tp, sp in tp_pairs:
        if gpus % tp:
            continue
        for pp in divisors(gpus // tp, at_most=n_units if pipelines and (sp_pipelines or not sp) else 1):
            dp = gpus // tp // pp
            if global_batch % dp:
                continue
            per_replica = global_batch // dp
            for mbs in divisors(per_replica, at_most=max_micro_batch):
                m = per_replica // mbs
                if m > max_microbatches:
                    continue
                for schedule, v in schedules_for(pp, m, n_units):
                    for zero, ep in itertools.product((0,) if dp == 1 else (0, 1, 2, 3), eps):
                        if dp % ep:
                            continue
                        yield Point(dp=dp, pp=pp, zero=zero, schedule=schedule, v=v, micro_batch_size=mbs,
                                    microbatches=m, tp=tp, sp=sp, ep=ep)
                        if distributed_optimizer and zero == 1 and pp == 1 and ep == 1:
                            yield Point(dp=dp, pp=pp, zero=zero, schedule=schedule, v=v, micro_batch_size=mbs,
                                        microbatches=m, tp=tp, sp=sp, distributed_optimizer=True)
