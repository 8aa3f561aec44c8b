"""The pipeline schedule IR and the schedule registry with its generators (cost_models.cost.simulator runs them).

IR: the one torch.distributed.pipelining uses (its `pipeline_order`): rank -> ordered compute actions, each
written `{stage}{kind}{microbatch}`: F forward, B full backward, I input-gradient backward, W weight-gradient
backward (`0F0`, `1B3`, `1I3`, `1W3`). Idle steps are not stored: the simulator derives them from dependencies.
What the planner simulates is what the executor hands to torch (and checks torch ran, action by action).

Registry: every schedule is one `ScheduleSpec` in `SCHEDULES` (p ranks, m micro-batches, v stage chunks per rank,
S = p*v stages). Strategy validation, the search space, the estimate's placement and per-action costs, the
planner's and the executor's guards, the executor's torch class and the report's legend all read it: adding a
schedule is one entry plus its generator. Schedule names appear as strings in product code only here
(tests/test_schedule.py checks).
"""
from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass
from functools import lru_cache
from typing import Callable, Iterator, Literal, Mapping, Sequence

from cost_models.records.errors import ConfigError

Kind = Literal["F", "B", "I", "W"]
_ACTION_RE = re.compile(r"^(\d+)([FBIW])(\d+)$")


@dataclass(frozen=True, order=True, slots=True)   # slots: a schedule holds m x pp x v of them
class Action:
    stage: int
    kind: Kind
    mb: int

    def __str__(self) -> str:
        return f"{self.stage}{self.kind}{self.mb}"

    @staticmethod
    def parse(text: str) -> "Action":
        m = _ACTION_RE.match(text.strip())
        if not m:
            raise ValueError(f"not a compute action: {text!r} (expected e.g. 0F0, 1B3, 2I1, 2W1)")
        return Action(int(m.group(1)), m.group(2), int(m.group(3)))  # type: ignore[arg-type]


Order = dict[int, list[Action]]
Generator = Callable[[int, int, int, int], Iterator[Action]]   # (rank, p, m, v) -> that rank's actions in order
Constraint = Callable[[str, int, int, int], "str | None"]    # (name, p, m, v) -> why not, or None
Guard = Callable[[int, int], "str | None"]                   # (zero, dp) -> why the executor cannot run it, or None


@dataclass(frozen=True, kw_only=True)
class ScheduleSpec:
    """What a pipeline schedule is, in one place."""

    name: str
    summary: str                 # one line with its source, for the report's legend
    placement: Literal["loop", "v"]   # loop: stage s on rank s mod p; v: chunk c runs ranks 0..p-1, then back
    split_backward: bool         # backward runs as I (input gradient) then a deferred W (weight gradient)
    torch_class: str             # its class in torch.distributed.pipelining.schedules
    searched_v: tuple[int, ...]  # the chunk counts the planner tries (Narayanan et al. 2021, fig. 12: deeper
                                 # interleaving multiplies p2p and rarely pays off past 4)
    generator: Generator
    constraint: Constraint       # what it (and torch's class) needs of (p, m, v), beyond all being >= 1
    unsafe: Guard = lambda zero, dp: None
    same_rank_tie: str | None = None   # why a parameter shared by two stages on one rank trains wrongly, if it does

    @property
    def multi_stage(self) -> bool:
        """Whether torch runs it as a PipelineScheduleMulti (its action-list runtime), not a single-stage class."""
        return self.torch_class not in ("ScheduleGPipe", "Schedule1F1B")

    def stage_rank(self, stage: int, p: int) -> int:
        """The pipeline rank that runs `stage` (torch's generate_stage_to_rank_mapping, style loop / v)."""
        chunk, pos = divmod(stage, p)
        return p - 1 - pos if self.placement == "v" and chunk % 2 else pos

    def rank_stages(self, rank: int, p: int, v: int) -> tuple[int, ...]:
        """The stages pipeline rank `rank` holds, ascending."""
        return tuple(sorted(c * p + (p - 1 - rank if self.placement == "v" and c % 2 else rank) for c in range(v)))

    def check(self, p: int, m: int, v: int) -> None:
        """The constraints on (p, m, v), as one-line ConfigErrors."""
        if p < 1 or m < 1 or v < 1:
            raise ConfigError(f"pipeline degree, micro-batches and chunks must be >= 1 (got pp={p}, m={m}, v={v})")
        why = self.constraint(self.name, p, m, v)
        if why:
            raise ConfigError(why)


# --- generators ---------------------------------------------------------------------------------------------------

def _gpipe(rank: int, p: int, m: int, v: int) -> Iterator[Action]:
    yield from (Action(rank, "F", i) for i in range(m))
    yield from (Action(rank, "B", i) for i in range(m))


def _one_f_one_b(rank: int, p: int, m: int, v: int) -> Iterator[Action]:
    warmup = min(p - 1 - rank, m)
    yield from (Action(rank, "F", i) for i in range(warmup))
    for i in range(m - warmup):
        yield Action(rank, "F", warmup + i)
        yield Action(rank, "B", i)
    yield from (Action(rank, "B", i) for i in range(m - warmup, m))


def _interleaved(rank: int, p: int, m: int, v: int) -> Iterator[Action]:
    return _looped(rank, p, m, v, zero_bubble=False)


def _zero_bubble_looped(rank: int, p: int, m: int, v: int) -> Iterator[Action]:
    return _looped(rank, p, m, v, zero_bubble=True)


def _looped(rank: int, p: int, m: int, v: int, *, zero_bubble: bool) -> Iterator[Action]:
    """Interleaved 1F1B, and with zero_bubble its ZB1P variant (backward split into I then a deferred W).

    Forwards walk the rank's chunks in rounds of m_round micro-batches; backwards walk them in reverse. Each
    rank runs `warmup` forwards, then pairs (forward, backward), then `warmup` backwards. Zero bubble warms up
    one step less per hop (its backward is only I) and starts emitting W after `rank` steady pairs.
    """
    rounds = max(1, m // p)
    per_round = m // rounds
    total = m * v
    warmup = min((v - 1) * per_round + (1 if zero_bubble else 2) * (p - 1 - rank), total)
    counter = _Counter()

    def fwd_stage(step: int) -> int:
        return ((step // per_round) % v) * p + rank

    def bwd_stage(step: int) -> int:
        return (v - 1 - ((step - warmup) // per_round) % v) * p + rank

    back = "I" if zero_bubble else "B"
    backward_steps: list[int] = []
    weights_done = 0

    def backward(step: int) -> Iterator[Action]:
        nonlocal weights_done
        yield counter.take(back, bwd_stage(step))
        backward_steps.append(step)
        if zero_bubble and step - warmup >= rank:
            yield counter.take("W", bwd_stage(backward_steps[weights_done]))
            weights_done += 1

    for step in range(warmup):
        yield counter.take("F", fwd_stage(step))
    for step in range(warmup, total):
        yield counter.take("F", fwd_stage(step))
        yield from backward(step)
    for step in range(total, total + warmup):
        yield from backward(step)
    while zero_bubble and weights_done < len(backward_steps):
        yield counter.take("W", bwd_stage(backward_steps[weights_done]))
        weights_done += 1


class _Counter:
    """Hands out each (kind, stage)'s micro-batches in order."""

    def __init__(self) -> None:
        self.next: dict[tuple[str, int], int] = defaultdict(int)

    def take(self, kind: str, stage: int) -> Action:
        mb = self.next[kind, stage]
        self.next[kind, stage] = mb + 1
        return Action(stage, kind, mb)  # type: ignore[arg-type]

    def pending(self, kind: str, stage: int, than: str) -> bool:
        """Has `than` handed out more of the stage's micro-batches than `kind`?"""
        return self.next[kind, stage] < self.next[than, stage]


def _zbv(rank: int, p: int, m: int, v: int) -> Iterator[Action]:
    """ZB-V (Qi et al. 2024, "Zero Bubble Pipeline Parallelism", section 6), as torch's ScheduleZBVZeroBubble orders
    it: rank r holds chunk 0 = stage r and chunk 1 = stage 2p-1-r (V placement, so the last stage sits beside the
    first). It plans for at least 2p-1 micro-batches and drops the actions of micro-batches past m."""
    return (a for a in _zbv_planned(rank, p, max(2 * p - 1, m)) if a.mb < m)


def _zbv_planned(rank: int, p: int, n: int) -> Iterator[Action]:
    lo, hi = rank, 2 * p - 1 - rank
    c = _Counter()
    yield from (c.take("F", lo) for _ in range(2 * (p - rank) - 1))                # warm-up: the first leg
    for _ in range(rank):
        yield from (c.take("F", hi), c.take("F", lo))
    for _ in range(p - rank):                                                        # the turn of the V
        yield from (c.take("F", hi), c.take("I", hi), c.take("W", hi))
    while c.next["F", hi] < c.next["F", lo] or c.next["F", lo] < n:                 # steady: one F, I, W per chunk
        if c.next["F", lo] < n:
            yield c.take("F", lo)
        yield from (c.take("I", lo), c.take("W", lo), c.take("F", hi), c.take("I", hi), c.take("W", hi))
    for _ in range(rank):                                                            # cool-down: inputs first
        yield from (c.take("I", lo), c.take("I", hi))
    for _ in range(p - rank):
        yield from (c.take("I", lo), c.take("W", lo))
    while c.pending("W", hi, than="I"):
        yield c.take("W", hi)
    while c.pending("W", lo, than="I"):
        yield c.take("W", lo)


# --- constraints --------------------------------------------------------------------------------------------------

def _one_chunk(name: str, p: int, m: int, v: int) -> str | None:
    if v != 1:
        return f"{name} runs one stage per rank; use a multi-chunk schedule ({', '.join(_multi_chunk())}) for v={v}"
    return None


def _one_chunk_m_ge_p(name: str, p: int, m: int, v: int) -> str | None:
    one_chunk = _one_chunk(name, p, m, v)
    if one_chunk or m >= p:
        return one_chunk
    # torch's Schedule1F1B refuses this (its __init__ raises ValueError)
    return f"{name} needs at least as many micro-batches as stages (m={m} < pp={p})"


def _rounds(name: str, p: int, m: int, v: int) -> str | None:
    rounds = max(1, m // p)   # torch's PipelineScheduleMulti: micro-batches go round in groups of m // rounds
    if m % rounds:
        return f"{name} needs micro-batches divisible by max(1, m // pp) = {rounds} (got m={m})"
    return None


def _interleaved_rounds(name: str, p: int, m: int, v: int) -> str | None:
    if v < 2:
        return f"{name} needs v >= 2 chunks per rank (v=1 is {DEFAULT_SCHEDULE})"
    return _rounds(name, p, m, v)


def _two_chunks(name: str, p: int, m: int, v: int) -> str | None:
    if v != 2:   # torch's ScheduleZBVZeroBubble raises "ZBV requires exactly 2 stages per rank"
        return f"{name} runs exactly 2 chunks per rank in a V (got v={v})"
    return None


def _fsdp_reshard_loses_grads(zero: int, dp: int) -> str | None:
    # Found by benchmarks/fidelity.py (torch 2.13, gloo): with FSDP2 ZeRO-3 stages
    # (reshard_after_forward=True) and backward split into I and W, the last stage gets no gradients, so its
    # weights never train, and a tied parameter on two pipeline ranks deadlocks the step.
    if zero == 3 and dp > 1:
        return ("zero-bubble with ZeRO-3 stages trains wrongly in this torch (the last stage gets no gradients); "
                "use ZeRO-2 or another schedule")
    return None


# torch 2.13, gloo, 2 ranks: gpt-tiny's tied embedding and head, both on rank 0 under zbv's V placement, train away
# from one process's losses, while llama-tiny (untied) and the same tie across two ranks under zb-interleaved match
# them (benchmarks/results/measurements.md, "Split-backward schedules with FSDP and ties"). Applied to both
# split-backward schedules.
_TIE_ON_ONE_RANK = ("with backward split into I and W, torch 2.13 gives a parameter shared by two stages of one "
                    "rank wrong gradients; use another schedule")


# --- the registry -------------------------------------------------------------------------------------------------

DEFAULT_SCHEDULE = "1f1b"   # the CLI's default; one stage (pp = v = 1) simulates as plain gradient accumulation

SCHEDULES: dict[str, ScheduleSpec] = {spec.name: spec for spec in (
    ScheduleSpec(name="gpipe", summary="all forwards, then all backwards (Huang et al. 2019, GPipe)",
                 placement="loop", split_backward=False, torch_class="ScheduleGPipe", searched_v=(1,),
                 generator=_gpipe, constraint=_one_chunk),
    ScheduleSpec(name="1f1b", placement="loop", split_backward=False, torch_class="Schedule1F1B", searched_v=(1,),
                 summary="p-1-r warm-up forwards on rank r, then one forward / one backward (Narayanan et al. "
                         "2021, PipeDream-flush)",
                 generator=_one_f_one_b, constraint=_one_chunk_m_ge_p),
    ScheduleSpec(name="interleaved-1f1b", placement="loop", split_backward=False,
                 torch_class="ScheduleInterleaved1F1B", searched_v=(2, 3, 4),
                 summary="v looped chunks per rank, stage s on rank s mod p (Narayanan et al. 2021, section 2.2)",
                 generator=_interleaved, constraint=_interleaved_rounds),
    ScheduleSpec(name="zb-interleaved", placement="loop", split_backward=True,
                 torch_class="ScheduleInterleavedZeroBubble", searched_v=(1, 2, 3, 4),
                 summary="looped chunks, backward split into input and weight gradients, W deferred into bubbles "
                         "(Qi et al. 2024, Zero Bubble Pipeline Parallelism, ZB1P)",
                 generator=_zero_bubble_looped, constraint=_rounds, unsafe=_fsdp_reshard_loses_grads,
                 same_rank_tie=_TIE_ON_ONE_RANK),
    ScheduleSpec(name="zbv", placement="v", split_backward=True, torch_class="ScheduleZBVZeroBubble",
                 searched_v=(2,),
                 summary="two chunks per rank in a V, backward split into I and W (Qi et al. 2024, section 6, ZB-V)",
                 generator=_zbv, constraint=_two_chunks, unsafe=_fsdp_reshard_loses_grads,
                 same_rank_tie=_TIE_ON_ONE_RANK),
)}


def _multi_chunk() -> list[str]:
    return [n for n, spec in SCHEDULES.items() if 1 not in spec.searched_v or len(spec.searched_v) > 1]


def get_spec(name: str) -> ScheduleSpec:
    spec = SCHEDULES.get(name)
    if spec is None:
        raise ConfigError(f"unknown schedule '{name}'; choose one of {', '.join(SCHEDULES)}")
    return spec


def generate(schedule: str, p: int, m: int, v: int = 1) -> Order:
    """The compute-action order of every rank for `schedule` on p ranks, m micro-batches, v chunks per rank."""
    return {r: list(acts) for r, acts in _generate(schedule, p, m, v).items()}


def cached_order(schedule: str, p: int, m: int, v: int = 1) -> Mapping[int, Sequence[Action]]:
    """Like generate(), but the shared cached copy: read it, do not modify it."""
    return _generate(schedule, p, m, v)


@lru_cache(maxsize=8)
def _generate(schedule: str, p: int, m: int, v: int) -> dict[int, tuple[Action, ...]]:
    """Cached (an estimate reads its order up to three times; the planner retries a point with recompute); callers
    get copies. Few are kept: an order holds m x pp x v actions, up to millions at cost_models/records/limits.py's caps,
    and the planner's repeats of a shape hit simulate_schedule's cache instead."""
    spec = get_spec(schedule)
    spec.check(p, m, v)
    return {r: tuple(spec.generator(r, p, m, v)) for r in range(p)}


@lru_cache(maxsize=1024)
def placement(schedule: str, p: int, v: int = 1) -> tuple[tuple[int, ...], ...]:
    """The stages of every pipeline rank, ascending (ScheduleSpec.rank_stages, for all ranks at once)."""
    spec = get_spec(schedule)
    return tuple(spec.rank_stages(r, p, v) for r in range(p))


@lru_cache(maxsize=4096)
def forwards_before_backward(schedule: str, rank: int, p: int, m: int, v: int = 1) -> tuple[int, ...]:
    """The stages of the forwards pipeline rank `rank` runs before its first backward action (B or I), in order.
    Their activations are all alive when the last of them starts (none is released before a backward), whatever
    the durations: a lower bound on the rank's peak activations that needs only the rank's own order."""
    spec = get_spec(schedule)
    spec.check(p, m, v)
    out = []
    for a in spec.generator(rank, p, m, v):
        if a.kind != "F":
            break
        out.append(a.stage)
    return tuple(out)


def format_order(order: Mapping[int, Sequence[Action]]) -> dict[str, list[str]]:
    return {str(r): [str(a) for a in acts] for r, acts in sorted(order.items())}


def parse_order(data: Mapping[str, Sequence[str]]) -> Order:
    return {int(r): [Action.parse(a) for a in acts] for r, acts in data.items()}


def format_grid(order: Mapping[int, Sequence[Action]], *, mark: Mapping[int, int] | None = None,
                max_steps: int = 40) -> str:
    """The order as a step x rank grid (as torch's _format_pipeline_order prints it), each rank's action at `mark`
    flagged with '>' and the rows around the first mark shown (at most max_steps of them)."""
    mark = dict(mark or {})
    ranks = sorted(order)
    depth = max((len(order[r]) for r in ranks), default=0)
    first = min(mark.values(), default=0)
    lo = max(0, min(first - max_steps // 2, depth - max_steps))
    rows = range(lo, min(depth, lo + max_steps))
    cell = lambda r, i: ("" if i >= len(order[r]) else (">" if mark.get(r) == i else "") + str(order[r][i]))
    width = max([len(cell(r, i)) for r in ranks for i in rows] + [len(f"rank {r}") for r in ranks] + [4])
    lines = ["step  " + " ".join(f"{'rank ' + str(r):>{width}}" for r in ranks)]
    lines += [f"{i:>4}  " + " ".join(f"{cell(r, i):>{width}}" for r in ranks) for i in rows]
    return "\n".join(lines)
