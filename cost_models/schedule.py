"""The pipeline schedule IR, the schedule registry with its generators, and an event simulator with real durations.

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
from functools import lru_cache
from dataclasses import dataclass
from typing import Callable, Iterator, Literal, Mapping, Sequence

from cost_models.errors import ConfigError

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
    # Measured here (torch 2.13, gloo, found by benchmarks/fidelity.py): with FSDP2 ZeRO-3 stages
    # (reshard_after_forward=True) and backward split into I and W, the last stage gets no gradients, so its
    # weights never train, and a tied parameter on two pipeline ranks deadlocks the step.
    if zero == 3 and dp > 1:
        return ("zero-bubble with ZeRO-3 stages trains wrongly in this torch (the last stage gets no gradients); "
                "use ZeRO-2 or another schedule")
    return None


# Measured here (torch 2.13, gloo, 2 ranks): gpt-tiny's tied embedding and head, both on rank 0 under zbv's V
# placement, train to losses 0.2 away from one process by step 4; llama-tiny (untied) matches within 1e-6 and the
# same tie across two ranks under zb-interleaved matches within 1e-6. Applied to both split-backward schedules.
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
    get copies. Few are kept: an order holds m x pp x v actions, up to millions at cost_models/limits.py's caps,
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


# --- simulation ---------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class StageCost:
    """Per-micro-batch durations of one stage, the p2p time of what it sends, and the activation bytes one
    micro-batch keeps alive on it from its forward until its (weight-)backward is done."""

    fwd_s: float
    bwd_s: float                       # full backward (B); I and W split it as below
    bwd_input_fraction: float = 0.5    # share of B that is I (input gradient); W is the rest
    send_fwd_s: float = 0.0            # p2p of its output activation to the next stage
    send_bwd_s: float = 0.0            # p2p of its input gradient to the previous stage
    activation_bytes: float = 0.0
    kept_bytes: float = 0.0            # of those, what stays until the step ends (a last stage's split backward)
    # Work that only micro-batch 0 pays, on top of fwd_s / bwd_s: a ZeRO-2/3 stage's FSDP all-gather, which its
    # first forward (and under ZeRO-3 its first backward) waits for (estimate._stage_gather)
    first_fwd_extra_s: float = 0.0
    first_bwd_extra_s: float = 0.0     # on B, or on I under a split backward


@dataclass(frozen=True)
class Event:
    rank: int
    action: Action
    start_s: float
    end_s: float


@dataclass(frozen=True)
class Simulation:
    makespan_s: float
    busy_s: dict[int, float]           # per rank
    idle_s: dict[int, float]
    finish_s: dict[int, float]         # per rank: when its last action ends
    bubble_ratio: float                # (makespan - ideal) / ideal, ideal = the busiest rank's compute (Narayanan's (p-1)/m)
    bubble_share: float                # idle share of all rank-time: sum idle / (ranks * makespan)
    peak_in_flight: dict[int, int]     # per stage: most micro-batches forwarded but not yet fully backwarded
    peak_activation_bytes: dict[int, float]  # per rank: peak of the sum over its stages of in-flight x bytes
    timeline: tuple[Event, ...]        # empty unless asked for


_KEY = {"F": 0, "B": 1, "I": 1, "W": 2}   # B and I both release the input gradient the previous stage waits for


def simulate(order: Mapping[int, Sequence[Action]], costs: Sequence[StageCost], *,
             keep_timeline: bool = False, send_delay_s: float = 0.0) -> Simulation:
    """Run the order with real durations: an action starts when its rank is free and its inputs have arrived.

    Dependencies: F(s, i) needs F(s-1, i) (plus the p2p time if s-1 is on another rank); B or I (s, i) needs
    F(s, i) and the backward of (s+1, i) (plus p2p); W(s, i) needs I(s, i). p2p transfers overlap compute (with
    `send_delay_s`, only once the sender waits or that long after).
    Where each stage runs is read from the order itself (looped or V placement alike). The order is first compiled
    (_compile: a topological order of its actions, durations aside); the times are then one pass over it, the
    longest path of the dependency graph. A deadlock raises ScheduleDeadlock with the rank x step grid, the stuck
    actions marked. `send_delay_s`: sends leave when their rank next waits, or at most that long after they were
    posted (gloo on CPU ranks whose cores are all busy: _evaluate).
    """
    return _evaluate(_compile(order), costs, keep_timeline=keep_timeline, send_delay_s=send_delay_s)


class ScheduleDeadlock(ValueError):
    """The order cannot finish: each stuck rank waits on an action another stuck rank has not reached."""


@dataclass(frozen=True, slots=True)
class _Compiled:
    """An order as flat lists in a topological order of its dependency graph (which does not depend on durations):
    action i ends at max(end[prev[i]], end[dep1[i]] + send of dep1, end[dep2[i]] + send of dep2) + its duration,
    index n standing for "none" (time 0). Durations and sends are looked up per evaluation through codes: dur_code
    = kind x stages + stage (kind 0 F, 1 B, 2 I, 3 W; 4-6 F, B, I of micro-batch 0, which pay StageCost's first_*
    extras); send codes index [fwd sends | bwd sends | 0]."""

    order: Mapping[int, Sequence[Action]]
    n_stages: int
    ranks: tuple[int, ...]
    rank: list[int]
    prev: list[int]
    dep1: list[int]
    dep2: list[int]
    send1: list[int]
    send2: list[int]
    dur_code: list[int]
    acts: list[Action]
    grows: list[int]      # indices of forwards: a micro-batch's activations live from their start ...
    frees: list[int]      # ... until these end (its W, or B / I where the stage has no W)


_DUR_KIND = {"F": 0, "B": 1, "I": 2, "W": 3}
_FIRST_KIND = {"F": 4, "B": 5, "I": 6, "W": 3}   # micro-batch 0's codes (its W pays no extra)


def _compile(order: Mapping[int, Sequence[Action]]) -> _Compiled:
    """The order's actions in a topological order of their dependencies (_walk), as flat lists."""
    acts_all = [a for acts in order.values() for a in acts]
    n_stages = 1 + max((a.stage for a in acts_all), default=-1)
    n_mb = 1 + max((a.mb for a in acts_all), default=-1)
    rows, pos = _walk(order, n_stages, n_mb)
    stuck = {r: pos[r] for r, acts in order.items() if pos[r] < len(acts)}
    if stuck:
        raise ScheduleDeadlock("schedule deadlocks: ranks wait on each other at "
                               f"{ {r: str(order[r][i]) for r, i in stuck.items()} }\n" + format_grid(order, mark=stuck))
    n = len(rows)   # "none" (-1) becomes index n, whose end time is 0
    acts, rank, prev, dep1, send1, dep2, send2, dur = (list(col) for col in zip(*rows)) if rows else ([] for _ in range(8))
    has_w = {a.stage for a in acts if a.kind == "W"}
    return _Compiled(order=order, n_stages=n_stages, ranks=tuple(order), rank=rank,
                     prev=[n if j < 0 else j for j in prev], dep1=[n if j < 0 else j for j in dep1],
                     dep2=[n if j < 0 else j for j in dep2], send1=send1, send2=send2, dur_code=dur, acts=acts,
                     grows=[k for k, a in enumerate(acts) if a.kind == "F"],
                     frees=[k for k, a in enumerate(acts) if a.kind == "W" or (a.kind != "F" and a.stage not in has_w)])


def _walk(order: Mapping[int, Sequence[Action]], n_stages: int, n_mb: int) -> tuple[list[tuple], dict[int, int]]:
    """Walk the order as the ranks would (each rank runs its actions in turn; a rank whose next action's input is
    not produced yet is parked on that input and woken when it is): the visit order is topological. Each action is
    examined a bounded number of times. Returns a row per action visited (action, rank, previous action of its rank,
    input 1, its send code, input 2, its send code, duration code) and how far each rank got. A hot path of
    planning: plain lists and locals."""
    where = {a.stage: r for r, acts in order.items() for a in acts}
    produced = [-1] * (n_stages * 2 * n_mb)   # slot (stage x 2 + F 0 | B/I 1) x n_mb + mb -> the action that made it
    waiting: dict[int, list[int]] = defaultdict(list)
    zero = 2 * n_stages                       # the send code of "no transfer"
    rows: list[tuple] = []
    last = {r: -1 for r in order}
    pos = {r: 0 for r in order}
    stack = list(order)
    while stack:
        r = stack.pop()
        acts, i = order[r], pos[r]
        while i < len(acts):
            a = acts[i]
            s, mb, kind = a.stage, a.mb, a.kind
            # the inputs' slots and send codes: F after F(s-1); W after I(s); B / I after F(s) and B / I(s+1)
            slot1, s1, d2, s2 = -1, zero, -1, zero
            if kind == "F":
                if s > 0:
                    slot1, s1 = (s - 1) * 2 * n_mb + mb, (s - 1 if where[s - 1] != r else zero)
            elif kind == "W":
                slot1 = (s * 2 + 1) * n_mb + mb
            else:
                slot1 = s * 2 * n_mb + mb
                if s < n_stages - 1:
                    slot2 = ((s + 1) * 2 + 1) * n_mb + mb
                    d2 = produced[slot2]
                    if d2 < 0:
                        waiting[slot2].append(r)
                        break
                    s2 = n_stages + s + 1 if where[s + 1] != r else zero
            d1 = produced[slot1] if slot1 >= 0 else -1
            if slot1 >= 0 and d1 < 0:
                waiting[slot1].append(r)
                break
            k = len(rows)
            rows.append((a, r, last[r], d1, s1, d2, s2, (_FIRST_KIND if mb == 0 else _DUR_KIND)[kind] * n_stages + s))
            last[r] = k
            i += 1
            if kind != "W":
                slot = s * 2 * n_mb + mb + (n_mb if kind != "F" else 0)
                produced[slot] = k
                if slot in waiting:
                    stack.extend(waiting.pop(slot))
        pos[r] = i
    return rows, pos


def _evaluate(c: _Compiled, costs: Sequence[StageCost], *, keep_timeline: bool,
              send_delay_s: float = 0.0) -> Simulation:
    """The times of a compiled order with these stage costs: one pass in its topological order.

    `send_delay_s` > 0: a rank's send leaves when it next waits on a receive, or `send_delay_s` after it was posted,
    whichever comes first, so an output arrives no earlier than the end of the sender's run of actions that receive
    nothing (_later), capped. gloo's transfer runs on the sender's own I/O thread, which needs a core: measured by
    benchmarks/send_delay.py (results/send_delay.json), a 16 KB send while the sender computes 1-32 ms reached a
    waiting peer 0.08-0.20 ms later (medians) with 2 ranks on 2 cores (a core free), and 1.6-2.3 ms (sender computing
    1-2 ms) or 3.2-4.0 ms (4-32 ms) later with 4 ranks on 2 cores, the other two computing."""
    if len(costs) != c.n_stages:
        raise ValueError(f"the order has {c.n_stages} stages, the costs {len(costs)}")
    dur_tab = ([x.fwd_s for x in costs] + [x.bwd_s for x in costs]
               + [x.bwd_s * x.bwd_input_fraction for x in costs] + [x.bwd_s * (1 - x.bwd_input_fraction) for x in costs]
               + [x.fwd_s + x.first_fwd_extra_s for x in costs] + [x.bwd_s + x.first_bwd_extra_s for x in costs]
               + [x.bwd_s * x.bwd_input_fraction + x.first_bwd_extra_s for x in costs])
    send_tab = [x.send_fwd_s for x in costs] + [x.send_bwd_s for x in costs] + [0.0]
    end = [0.0] * (len(c.acts) + 1)
    start = [0.0] * len(c.acts)
    zero = len(send_tab) - 1   # the send code of "no transfer"
    later = [min(x, send_delay_s) for x in _later(c, dur_tab, zero)] if send_delay_s > 0 else None
    for i, (p, d1, s1, d2, s2, dc) in enumerate(zip(c.prev, c.dep1, c.send1, c.dep2, c.send2, c.dur_code)):
        t = end[p]
        u = end[d1] + (max(send_tab[s1], later[d1]) if later is not None and s1 != zero else send_tab[s1])
        if u > t:
            t = u
        u = end[d2] + (max(send_tab[s2], later[d2]) if later is not None and s2 != zero else send_tab[s2])
        if u > t:
            t = u
        start[i] = t
        end[i] = t + dur_tab[dc]
    busy = {r: 0.0 for r in c.ranks}
    free = {r: 0.0 for r in c.ranks}
    for i, r in enumerate(c.rank):   # in each rank's own order, as a clock would add them
        busy[r] += end[i] - start[i]
        free[r] = end[i]
    makespan = max(free.values(), default=0.0)
    idle = {r: makespan - busy[r] for r in c.ranks}
    ideal = max(busy.values(), default=0.0)
    in_flight, act_bytes = _memory_timeline(c, start, end, costs)
    events = (tuple(sorted((Event(c.rank[i], c.acts[i], start[i], end[i]) for i in range(len(c.acts))),
                           key=lambda e: (e.start_s, e.rank))) if keep_timeline else ())
    return Simulation(makespan_s=makespan, busy_s=busy, idle_s=idle, finish_s=free,
                      bubble_ratio=(makespan - ideal) / ideal if ideal > 0 else 0.0,
                      bubble_share=sum(idle.values()) / (len(c.ranks) * makespan) if makespan > 0 else 0.0,
                      peak_in_flight=in_flight, peak_activation_bytes=act_bytes, timeline=events)


def _later(c: _Compiled, dur_tab: list[float], zero: int) -> list[float]:
    """Per action, the seconds its rank computes after it before it next waits: the durations of the actions that
    follow it on its rank up to the first that receives from another rank (a send code other than `zero`). One
    backward pass; the last entry stands for "none"."""
    later = [0.0] * (len(c.acts) + 1)
    after: dict[int, int] = {}   # rank -> its action after k
    for k in range(len(c.acts) - 1, -1, -1):
        j = after.get(c.rank[k])
        if j is not None and c.send1[j] == zero and c.send2[j] == zero:
            later[k] = later[j] + dur_tab[c.dur_code[j]]
        after[c.rank[k]] = k
    return later


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


@lru_cache(maxsize=1024)
def simulate_schedule(schedule: str, p: int, m: int, v: int, costs: tuple[StageCost, ...], *,
                      send_delay_s: float = 0.0) -> Simulation:
    """simulate() of the generated order, cached: the planner costs every ZeRO stage of a pipeline shape with the
    same stage costs (data-parallel collectives come after the pipeline), so each distinct (shape, costs) is
    simulated once, and each shape compiled once for all its costs. The result is shared: read it, do not modify
    it."""
    return _evaluate(_compiled(schedule, p, m, v), costs, keep_timeline=False, send_delay_s=send_delay_s)


def schedule_timeline(schedule: str, p: int, m: int, v: int, costs: tuple[StageCost, ...], *,
                      send_delay_s: float = 0.0) -> Simulation:
    """simulate_schedule() with every action's start and end kept (Simulation.timeline); not cached, as a timeline
    holds m x pp x v events."""
    return _evaluate(_compiled(schedule, p, m, v), costs, keep_timeline=True, send_delay_s=send_delay_s)


@lru_cache(maxsize=64)
def _compiled(schedule: str, p: int, m: int, v: int) -> _Compiled:
    """A shape's compiled order (a shape recurs with the costs of each tp, SP, micro-batch size and recompute)."""
    return _compile(cached_order(schedule, p, m, v))


def _memory_timeline(c: _Compiled, start: list[float], end: list[float],
                     costs: Sequence[StageCost]) -> tuple[dict[int, int], dict[int, float]]:
    """A micro-batch's activations live from its forward's start until its last backward piece (B, or W) ends,
    but for the part its stage keeps to the end of the step (StageCost.kept_bytes); at equal times frees come first (then the order the actions were compiled in). Per stage the most micro-batches
    alive, per rank the most bytes."""
    import numpy as np   # here, not at the top: every CLI command imports this module, few simulate
    ev_time = np.array([start[i] for i in c.grows] + [end[i] for i in c.frees])
    ev_delta = np.concatenate([np.ones(len(c.grows), dtype=np.int64), -np.ones(len(c.frees), dtype=np.int64)])
    ev_index = np.array(c.grows + c.frees, dtype=np.int64)
    acts = c.acts
    ev_stage = np.array([acts[i].stage for i in ev_index.tolist()], dtype=np.int64)
    ev_rank = np.array([c.rank[i] for i in ev_index.tolist()], dtype=np.int64)
    peak: dict[int, int] = {}
    peak_bytes: dict[int, float] = {}
    for key, out, weight in ((ev_stage, peak, None), (ev_rank, peak_bytes, costs)):
        idx = np.lexsort((ev_index, ev_delta, ev_time, key))   # by owner, then time, frees first, then order
        owners, first = np.unique(key[idx], return_index=True)
        bounds = list(first[1:]) + [len(idx)]
        if weight is None:
            values = ev_delta[idx]
        else:   # a free gives back what the micro-batch held less what its stage keeps to the end of the step
            grow = np.array([x.activation_bytes for x in weight])[ev_stage[idx]]
            keep = np.array([x.kept_bytes for x in weight])[ev_stage[idx]]
            values = np.where(ev_delta[idx] > 0, grow, keep - grow)
        for owner, lo, hi in zip(owners.tolist(), first.tolist(), bounds):
            top = np.cumsum(values[lo:hi]).max()
            out[owner] = max(0, int(top)) if weight is None else max(0.0, float(top))
    return peak, peak_bytes
