"""An event simulator of pipeline schedules with real durations: step time, bubble and peak in-flight activations.

It runs the orders cost_models.records.schedule generates (the IR torch.distributed.pipelining executes) with each
stage's per-micro-batch times and p2p costs: what the planner simulates is what the executor hands to torch.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from functools import lru_cache
from typing import Mapping, Sequence

from cost_models.records.schedule import Action, cached_order, format_grid


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
    nothing (_later), capped. gloo's transfer runs on the sender's own I/O thread, which needs a core: with a core
    free a send reaches a waiting peer at once, with every core busy only about a scheduler time slice later
    (measured by benchmarks/send_delay.py: benchmarks/results/send_delay.json; benchmarks/results/measurements.md,
    "CPU pipeline sends wait for a core")."""
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


@lru_cache(maxsize=512)
def _compiled(schedule: str, p: int, m: int, v: int) -> _Compiled:
    """A shape's compiled order (a shape recurs with the costs of each tp, SP, micro-batch size and recompute;
    a search visits a few hundred shapes, and a smaller cache compiled some again)."""
    return _compile(cached_order(schedule, p, m, v))


def _memory_timeline(c: _Compiled, start: list[float], end: list[float],
                     costs: Sequence[StageCost]) -> tuple[dict[int, int], dict[int, float]]:
    """A micro-batch's activations live from its forward's start until its last backward piece (B, or W) ends,
    but for the part its stage keeps to the end of the step (StageCost.kept_bytes); at equal times frees come first (then the order the actions were compiled in). Per stage the most micro-batches
    alive, per rank the most bytes."""
    import numpy as np  # here, not at the top: every CLI command imports this module, few simulate
    ev_time = np.array([start[i] for i in c.grows] + [end[i] for i in c.frees])
    ev_delta = np.concatenate([np.ones(len(c.grows), dtype=np.int64), -np.ones(len(c.frees), dtype=np.int64)])
    ev_index = np.array(c.grows + c.frees, dtype=np.int64)
    acts = c.acts
    ev_stage = np.array([acts[i].stage for i in ev_index.tolist()], dtype=np.int64)
    ev_rank = np.array([c.rank[i] for i in ev_index.tolist()], dtype=np.int64)
    peak: dict[int, int] = {}
    peak_bytes: dict[int, float] = {}
    for key, weight in ((ev_stage, None), (ev_rank, costs)):
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
            if weight is None:
                peak[owner] = max(0, int(top))
            else:
                peak_bytes[owner] = max(0.0, float(top))
    return peak, peak_bytes
