"""The pipeline schedule IR, its generators, and an event simulator with real durations.

IR: the one torch.distributed.pipelining uses (its `pipeline_order`): rank -> ordered compute actions, each
written `{stage}{kind}{microbatch}`: F forward, B full backward, I input-gradient backward, W weight-gradient
backward (`0F0`, `1B3`, `1I3`, `1W3`). Idle steps are not stored: the simulator derives them from dependencies.
What the planner simulates is what the executor hands to torch.

Schedules (p ranks, m micro-batches, v stage chunks per rank, S = p*v stages):
  gpipe             all forwards, then all backwards (Huang et al. 2019)
  1f1b              p-1-r warm-up forwards on rank r, then one forward / one backward (Narayanan et al. 2021 "PipeDream-flush")
  interleaved-1f1b  v looped chunks per rank, stage s on rank s % p (Narayanan et al. 2021, section 2.2); warm-up
                    (v-1)*m_round + 2(p-1-r) forwards, as torch's ScheduleInterleaved1F1B
  zb-interleaved    the same loop with backward split into I and W, W deferred to fill bubbles (Qi et al. 2024,
                    "Zero Bubble Pipeline Parallelism", ZB1P), as torch's ScheduleInterleavedZeroBubble
"""
from __future__ import annotations

import re
from collections import defaultdict
from functools import lru_cache
from dataclasses import dataclass
from typing import Literal, Mapping, Sequence

from cost_models.errors import ConfigError

Kind = Literal["F", "B", "I", "W"]
SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "zb-interleaved")
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


def stage_to_rank(stage: int, p: int) -> int:
    """Looped placement: stage s runs on rank s mod p (every schedule here)."""
    return stage % p


def check_schedule(schedule: str, p: int, m: int, v: int) -> None:
    """The constraints each schedule (and torch's class for it) puts on (p, m, v), as one-line ConfigErrors."""
    if schedule not in SCHEDULES:
        raise ConfigError(f"unknown schedule '{schedule}'; choose one of {', '.join(SCHEDULES)}")
    if p < 1 or m < 1 or v < 1:
        raise ConfigError(f"pipeline degree, micro-batches and chunks must be >= 1 (got pp={p}, m={m}, v={v})")
    if schedule in ("gpipe", "1f1b") and v != 1:
        raise ConfigError(f"{schedule} runs one stage per rank; use interleaved-1f1b or zb-interleaved for v={v}")
    if schedule == "interleaved-1f1b" and v < 2:
        raise ConfigError("interleaved-1f1b needs v >= 2 chunks per rank (v=1 is 1f1b)")
    if schedule == "1f1b" and m < p:
        # torch's Schedule1F1B refuses this (shared/torch-on-cpu.md, section 3).
        raise ConfigError(f"1f1b needs at least as many micro-batches as stages (m={m} < pp={p})")
    if schedule in ("interleaved-1f1b", "zb-interleaved"):
        rounds = max(1, m // p)
        if m % rounds:
            raise ConfigError(f"{schedule} needs micro-batches divisible by max(1, m // pp) = {rounds} (got m={m})")


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
    check_schedule(schedule, p, m, v)
    return {r: tuple(acts) for r, acts in _orders(schedule, p, m, v).items()}


def _orders(schedule: str, p: int, m: int, v: int) -> Order:
    if schedule == "gpipe":
        return {r: [Action(r, "F", i) for i in range(m)] + [Action(r, "B", i) for i in range(m)] for r in range(p)}
    if schedule == "1f1b":
        return {r: _one_f_one_b(r, p, m) for r in range(p)}
    return {r: _looped(r, p, m, v, zero_bubble=schedule == "zb-interleaved") for r in range(p)}


def _one_f_one_b(rank: int, p: int, m: int) -> list[Action]:
    warmup = min(p - 1 - rank, m)
    ops = [Action(rank, "F", i) for i in range(warmup)]
    for i in range(m - warmup):
        ops += [Action(rank, "F", warmup + i), Action(rank, "B", i)]
    ops += [Action(rank, "B", i) for i in range(m - warmup, m)]
    return ops


def _looped(rank: int, p: int, m: int, v: int, *, zero_bubble: bool) -> list[Action]:
    """Interleaved 1F1B, and with zero_bubble its ZB1P variant (backward split into I then a deferred W).

    Forwards walk the rank's chunks in rounds of m_round micro-batches; backwards walk them in reverse. Each
    rank runs `warmup` forwards, then pairs (forward, backward), then `warmup` backwards. Zero bubble warms up
    one step less per hop (its backward is only I) and starts emitting W after `rank` steady pairs.
    """
    rounds = max(1, m // p)
    per_round = m // rounds
    total = m * v
    warmup = min((v - 1) * per_round + (1 if zero_bubble else 2) * (p - 1 - rank), total)
    next_mb: dict[tuple[str, int], int] = defaultdict(int)

    def take(kind: str, stage: int) -> Action:
        mb = next_mb[kind, stage]
        next_mb[kind, stage] = mb + 1
        return Action(stage, kind, mb)  # type: ignore[arg-type]

    def fwd_stage(step: int) -> int:
        return ((step // per_round) % v) * p + rank

    def bwd_stage(step: int) -> int:
        return (v - 1 - ((step - warmup) // per_round) % v) * p + rank

    back = "I" if zero_bubble else "B"
    ops: list[Action] = []
    backward_steps: list[int] = []
    weights_done = 0

    def backward(step: int) -> None:
        nonlocal weights_done
        ops.append(take(back, bwd_stage(step)))
        backward_steps.append(step)
        if zero_bubble and step - warmup >= rank:
            ops.append(take("W", bwd_stage(backward_steps[weights_done])))
            weights_done += 1

    for step in range(warmup):
        ops.append(take("F", fwd_stage(step)))
    for step in range(warmup, total):
        ops.append(take("F", fwd_stage(step)))
        backward(step)
    for step in range(total, total + warmup):
        backward(step)
    while zero_bubble and weights_done < len(backward_steps):
        ops.append(take("W", bwd_stage(backward_steps[weights_done])))
        weights_done += 1
    return ops


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


def simulate(order: Mapping[int, Sequence[Action]], costs: Sequence[StageCost], *, p: int,
             keep_timeline: bool = False) -> Simulation:
    """Run the order with real durations: an action starts when its rank is free and its inputs have arrived.

    Dependencies: F(s, i) needs F(s-1, i) (plus the p2p time if s-1 is on another rank); B or I (s, i) needs
    F(s, i) and the backward of (s+1, i) (plus p2p); W(s, i) needs I(s, i). p2p transfers overlap compute.
    Event-driven: a rank blocked on a missing input is parked on it and woken when it completes, so each action
    is examined a bounded number of times.
    """
    n_stages = len(costs)
    dur = {"F": [c.fwd_s for c in costs], "B": [c.bwd_s for c in costs],
           "I": [c.bwd_s * c.bwd_input_fraction for c in costs],
           "W": [c.bwd_s * (1 - c.bwd_input_fraction) for c in costs]}
    send_f = [c.send_fwd_s for c in costs]
    send_b = [c.send_bwd_s for c in costs]
    done: dict[tuple[int, int, int], float] = {}
    waiting: dict[tuple[int, int, int], list[int]] = defaultdict(list)
    free = {r: 0.0 for r in order}
    busy = {r: 0.0 for r in order}
    pos = {r: 0 for r in order}
    has_w = {a.stage for acts in order.values() for a in acts if a.kind == "W"}
    points: list[tuple[float, int, int, int]] = []  # (time, +1/-1, stage, rank) for the memory timeline
    events: list[Event] = []
    stack = list(order)
    while stack:
        r = stack.pop()
        acts = order[r]
        while pos[r] < len(acts):
            a = acts[pos[r]]
            s, kind, mb = a.stage, a.kind, a.mb
            if kind == "F":
                if s > 0:
                    dep = (s - 1, 0, mb)
                    t = done.get(dep)
                    if t is None:
                        waiting[dep].append(r)
                        break
                    ready = t + (send_f[s - 1] if (s - 1) % p != r else 0.0)
                else:
                    ready = 0.0
            elif kind == "W":
                dep = (s, 1, mb)
                ready = done.get(dep)
                if ready is None:
                    waiting[dep].append(r)
                    break
            else:
                dep = (s, 0, mb)
                own = done.get(dep)
                if own is None:
                    waiting[dep].append(r)
                    break
                ready = own
                if s < n_stages - 1:
                    dep = (s + 1, 1, mb)
                    t = done.get(dep)
                    if t is None:
                        waiting[dep].append(r)
                        break
                    ready = max(ready, t + (send_b[s + 1] if (s + 1) % p != r else 0.0))
            start = free[r] if free[r] > ready else ready
            end = start + dur[kind][s]
            key = (s, _KEY[kind], mb)
            done[key] = end
            free[r] = end
            busy[r] += end - start
            pos[r] += 1
            if kind == "F":
                points.append((start, 1, s, r))
            elif kind == "W" or s not in has_w:
                points.append((end, -1, s, r))
            if keep_timeline:
                events.append(Event(r, a, start, end))
            for w in waiting.pop(key, ()):
                stack.append(w)
    stuck = {r: str(acts[pos[r]]) for r, acts in order.items() if pos[r] < len(acts)}
    if stuck:
        raise ValueError(f"schedule deadlocks: ranks wait on each other at {stuck}")

    makespan = max(free.values(), default=0.0)
    idle = {r: makespan - busy[r] for r in order}
    ideal = max(busy.values(), default=0.0)
    in_flight, act_bytes = _memory_timeline(points, costs)
    return Simulation(makespan_s=makespan, busy_s=busy, idle_s=idle, finish_s=dict(free),
                      bubble_ratio=(makespan - ideal) / ideal if ideal > 0 else 0.0,
                      bubble_share=sum(idle.values()) / (len(order) * makespan) if makespan > 0 else 0.0,
                      peak_in_flight=in_flight, peak_activation_bytes=act_bytes,
                      timeline=tuple(sorted(events, key=lambda e: (e.start_s, e.rank))))


@lru_cache(maxsize=1024)
def simulate_schedule(schedule: str, p: int, m: int, v: int, costs: tuple[StageCost, ...]) -> Simulation:
    """simulate() of the generated order, cached: the planner costs every ZeRO stage of a pipeline shape with the
    same stage costs (data-parallel collectives come after the pipeline), so each distinct (shape, costs) is
    simulated once. The result is shared: read it, do not modify it."""
    return simulate(cached_order(schedule, p, m, v), costs, p=p)


def _memory_timeline(points: list[tuple[float, int, int, int]],
                     costs: Sequence[StageCost]) -> tuple[dict[int, int], dict[int, float]]:
    """A micro-batch's activations live from its forward's start until its last backward piece (B, or W) ends;
    at equal times frees come first."""
    points.sort(key=lambda x: (x[0], x[1]))
    count: dict[int, int] = defaultdict(int)
    peak: dict[int, int] = defaultdict(int)
    live: dict[int, float] = defaultdict(float)
    peak_bytes: dict[int, float] = defaultdict(float)
    for _, delta, stage, rank in points:
        count[stage] += delta
        if count[stage] > peak[stage]:
            peak[stage] = count[stage]
        live[rank] += delta * costs[stage].activation_bytes
        if live[rank] > peak_bytes[rank]:
            peak_bytes[rank] = live[rank]
    return dict(peak), dict(peak_bytes)
