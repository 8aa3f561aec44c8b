"""Cut the model's units into pipeline stages (pure functions over plain cost arrays).

Three partitioners of one problem, the bottleneck-minimising contiguous split of a unit chain into stages whose
memory fits:
  * `dp_partition`   exact dynamic program over the chain, the fast path (the stage DP of Alpa's
                     stage_construction.py, as a pure function over cost arrays): best[j][i] is the least
                     bottleneck of j stages over the first i units;
  * `milp_partition` the same problem as a pulp MILP (CBC), with a time limit and the solver's status;
  * `dag_partition`  for units that form a DAG (skip connections across units): convex stages (contiguous in a
                     topological order, found with networkx) within a time bound, minimising the bytes that cross
                     stage boundaries.
The differential test (tests/test_partition.py) checks MILP == DP == brute force on seeded random instances.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Callable, Sequence

from cost_models.records.errors import ConfigError, InfeasibleError
from cost_models.records.formatting import fixed


@dataclass(frozen=True)
class PartitionProblem:
    """Stage j holding units [a, b) takes sum(costs[a:b]) (+ cut_costs[b-1] if a stage follows: the p2p of what
    it sends) per micro-batch, and needs sum(state_bytes[a:b]) + in_flight[j] * sum(act_bytes[a:b]) <= capacity."""

    costs: tuple[float, ...]
    n_stages: int
    cut_costs: tuple[float, ...] = ()
    state_bytes: tuple[float, ...] = ()
    act_bytes: tuple[float, ...] = ()
    in_flight: tuple[int, ...] = ()
    capacity: float = float("inf")

    @property
    def n(self) -> int:
        return len(self.costs)

    def stage_time(self, a: int, b: int) -> float:
        cut = self.cut_costs[b - 1] if self.cut_costs and b < self.n else 0.0
        return sum(self.costs[a:b]) + cut

    def stage_memory(self, j: int, a: int, b: int) -> float:
        state = sum(self.state_bytes[a:b]) if self.state_bytes else 0.0
        act = sum(self.act_bytes[a:b]) * self.in_flight[j] if self.act_bytes else 0.0
        return state + act

    def bottleneck(self, ranges: Sequence[tuple[int, int]]) -> float:
        return max(self.stage_time(a, b) for a, b in ranges)

    def feasible(self, ranges: Sequence[tuple[int, int]]) -> bool:
        return all(self.stage_memory(j, a, b) <= self.capacity for j, (a, b) in enumerate(ranges))


class PartitionInfeasible(InfeasibleError):
    """No contiguous split of the units into these stages fits the memory capacity."""


def _check(problem: PartitionProblem) -> None:
    if problem.n_stages < 1 or problem.n_stages > problem.n:
        raise ConfigError(f"cannot split {problem.n} units into {problem.n_stages} non-empty stages")


def dp_partition(problem: PartitionProblem) -> list[tuple[int, int]]:
    """Exact min-bottleneck contiguous partition subject to per-stage memory; raises PartitionInfeasible."""
    _check(problem)
    n, k = problem.n, problem.n_stages
    pc = [0.0]
    for c in problem.costs:
        pc.append(pc[-1] + c)
    ps, pa = [0.0], [0.0]
    for i in range(n):
        ps.append(ps[-1] + (problem.state_bytes[i] if problem.state_bytes else 0.0))
        pa.append(pa[-1] + (problem.act_bytes[i] if problem.act_bytes else 0.0))
    cut = problem.cut_costs

    def step(prev: float, j: int, l: int, i: int) -> float | None:
        """Stage j holding units l..i-1 after a best split of l units into j - 1 stages: the bottleneck so far,
        with the cut's send after the stage, or None when the stage's states and in-flight activations overflow."""
        flight = problem.in_flight[j - 1] if problem.in_flight else 0
        if (ps[i] - ps[l]) + flight * (pa[i] - pa[l]) > problem.capacity:
            return None
        return max(prev, pc[i] - pc[l] + (cut[i - 1] if cut and i < n else 0.0))

    ranges = _contiguous_dp(n, k, step)
    if ranges is None:
        raise PartitionInfeasible(f"no split of {n} units into {k} stages fits {fixed(problem.capacity, 'GiB', 2)} "
                                  f"per rank")
    return ranges


Step = Callable[[float, int, int, int], "float | None"]   # (best value before, stage j, first unit l, end i)


def _contiguous_dp(n: int, k: int, step: Step) -> list[tuple[int, int]] | None:
    """The split of units 0..n-1 into k non-empty contiguous stages that minimises the value `step` builds up, or
    None when no split is allowed: best[j][i] is the best value of units 0..i-1 in j stages, extended stage by
    stage by step(best[j-1][l], j, l, i) (None: stage j = units l..i-1 is not allowed); the ranges are read back
    from the table of argmins. Exact, O(k n^2) calls of `step`."""
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(k + 1)]
    arg = [[-1] * (n + 1) for _ in range(k + 1)]
    best[0][0] = 0.0
    for j in range(1, k + 1):
        for i in range(j, n - (k - j) + 1):
            for l in range(j - 1, i):
                if best[j - 1][l] == inf:
                    continue
                value = step(best[j - 1][l], j, l, i)
                if value is not None and value < best[j][i]:
                    best[j][i], arg[j][i] = value, l
    if best[k][n] == inf:
        return None
    ranges, i = [], n
    for j in range(k, 0, -1):
        l = arg[j][i]
        ranges.append((l, i))
        i = l
    return ranges[::-1]


def balanced_partition(costs: Sequence[float], k: int) -> list[tuple[int, int]]:
    """Min-max contiguous split without memory limits, O(n^2 log n): binary search over the candidate bottlenecks
    (every contiguous sum) with a greedy feasibility check. Exact; used to cost many candidates quickly."""
    n = len(costs)
    if k < 1 or k > n:
        raise ConfigError(f"cannot split {n} units into {k} non-empty stages")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    candidates = sorted({prefix[b] - prefix[a] for a in range(n) for b in range(a + 1, n + 1)})

    def split(limit: float) -> list[tuple[int, int]] | None:
        ranges: list[tuple[int, int]] = []
        a = 0
        while a < n:
            if len(ranges) == k:
                return None
            b = a + 1
            if prefix[b] - prefix[a] > limit:
                return None
            # take as many units as fit, but leave at least one unit for each stage still to come
            while b < n and prefix[b + 1] - prefix[a] <= limit and n - (b + 1) >= k - len(ranges) - 1:
                b += 1
            ranges.append((a, b))
            a = b
        return ranges if len(ranges) == k else None

    lo, hi = 0, len(candidates) - 1   # (not bisecting at max(costs): a prefix difference may round below it)
    while lo < hi:
        mid = (lo + hi) // 2
        if split(candidates[mid]) is not None:
            hi = mid
        else:
            lo = mid + 1
    result = split(candidates[lo])
    assert result is not None
    return result


def milp_partition(problem: PartitionProblem, *, time_limit_s: float = 10.0) -> tuple[list[tuple[int, int]], str, float]:
    """The partition as a MILP (pulp + bundled CBC). Returns (ranges, solver status, objective).

    1. Variables: y[u][s] = 1 if unit u is in stage s or earlier (cumulative assignment); x[u][s] = y[u][s] -
       y[u][s-1] is the unit-to-stage assignment; e[u][s] >= 0 marks "stage s ends after unit u"; T the bottleneck.
    2. Constraints:
       (a) y[u][s] <= y[u][s+1]          cumulative in s
       (b) y[u+1][s] <= y[u][s]          units in order: stages are contiguous and ordered
       (c) y[0][0] = 1, y[u][k-1] = 1    the first unit opens stage 0; every unit is placed
       (d) sum_u x[u][s] >= 1            no empty stage
       (e) e[u][s] >= x[u][s] - x[u+1][s]  the cut after the stage's last unit (its p2p send)
       (f) T >= sum_u cost[u] x[u][s] + sum_u cut[u] e[u][s]
       (g) sum_u (state[u] + in_flight[s] act[u]) x[u][s] <= capacity
    3. Objective: minimise T.
    """
    _check(problem)
    with warnings.catch_warnings():   # PuLP 3.3 deprecates names that are still its documented API
        warnings.simplefilter("ignore", DeprecationWarning)
        return _milp(problem, time_limit_s)


def _milp(problem: PartitionProblem, time_limit_s: float) -> tuple[list[tuple[int, int]], str, float]:
    import pulp

    n, k = problem.n, problem.n_stages
    prob = pulp.LpProblem("stage_partition", pulp.LpMinimize)
    y = {(u, s): pulp.LpVariable(f"y_{u}_{s}", cat="Binary") for u in range(n) for s in range(k)}
    e = {(u, s): pulp.LpVariable(f"e_{u}_{s}", lowBound=0) for u in range(n - 1) for s in range(k)}
    T = pulp.LpVariable("T", lowBound=0)

    def x(u: int, s: int):
        return y[u, s] - (y[u, s - 1] if s > 0 else 0)

    prob += T
    for u in range(n):
        for s in range(k - 1):
            prob += y[u, s] <= y[u, s + 1]                                      # (a)
        prob += y[u, k - 1] == 1                                               # (c)
    for u in range(n - 1):
        for s in range(k):
            prob += y[u + 1, s] <= y[u, s]                                      # (b)
            prob += e[u, s] >= x(u, s) - x(u + 1, s)                            # (e)
    prob += y[0, 0] == 1                                                       # (c)
    cut = problem.cut_costs or (0.0,) * n
    for s in range(k):
        prob += pulp.lpSum(x(u, s) for u in range(n)) >= 1                     # (d)
        prob += T >= (pulp.lpSum(problem.costs[u] * x(u, s) for u in range(n))
                      + pulp.lpSum(cut[u] * e[u, s] for u in range(n - 1)))     # (f)
        if problem.capacity != float("inf"):
            flight = problem.in_flight[s] if problem.in_flight else 0
            prob += pulp.lpSum(((problem.state_bytes[u] if problem.state_bytes else 0.0)
                                + flight * (problem.act_bytes[u] if problem.act_bytes else 0.0)) * x(u, s)
                               for u in range(n)) <= problem.capacity          # (g)
    status_code = prob.solve(pulp.PULP_CBC_CMD(msg=False, timeLimit=time_limit_s))
    status = pulp.LpStatus[status_code]
    if status == "Optimal" and prob.sol_status != pulp.LpSolutionOptimal:
        # PuLP reports a solution CBC found before its time limit as "Optimal"; say what it is
        status = f"Feasible (time limit {time_limit_s:g} s, optimality not proven)"
    if status == "Infeasible":
        raise PartitionInfeasible(f"MILP: no split of {n} units into {k} stages fits {fixed(problem.capacity, 'GiB', 2)}")
    if status == "Not Solved":   # stopped by the time limit before any integer solution (its values are not one)
        raise PartitionInfeasible(f"the MILP found no solution within {time_limit_s:g} s (--time-limit gives it longer)")
    if status != "Optimal" and T.varValue is None:
        raise PartitionInfeasible(f"MILP solver ended with status {status} and no solution within {time_limit_s} s")
    stage_of = [min(s for s in range(k) if (y[u, s].varValue or 0) > 0.5) for u in range(n)]
    ranges, start = [], 0
    for u in range(1, n + 1):
        if u == n or stage_of[u] != stage_of[u - 1]:
            ranges.append((start, u))
            start = u
    return ranges, status, problem.bottleneck(ranges)


def dag_partition(costs: Sequence[float], edges: Sequence[tuple[int, int, float]], k: int, *,
                  slack: float = 0.10) -> list[list[int]]:
    """Convex stages of a unit DAG with the fewest bytes crossing stage boundaries.

    Nodes are units 0..n-1 with compute `costs`; `edges` are (src, dst, bytes). Stages are contiguous runs of a
    topological order (networkx), hence convex: no path leaves a stage and comes back. Among splits whose
    bottleneck is within (1 + slack) of the best balanced split of that order, the DP picks the one that
    minimises the total bytes on edges crossing any cut.
    """
    import networkx as nx

    n = len(costs)
    g = nx.DiGraph()
    g.add_nodes_from(range(n))
    for src, dst, nbytes in edges:
        g.add_edge(src, dst, bytes=nbytes)
    if not nx.is_directed_acyclic_graph(g):
        raise ConfigError("the units' data flow has a cycle; it cannot be pipelined")
    order = list(nx.lexicographical_topological_sort(g))
    pos = {u: i for i, u in enumerate(order)}
    # crossing[c]: bytes on edges from positions < c to positions >= c (a cut before position c)
    crossing = [0.0] * (n + 1)
    for src, dst, data in g.edges(data=True):
        for c in range(pos[src] + 1, pos[dst] + 1):
            crossing[c] += data["bytes"]
    ordered_costs = [costs[u] for u in order]
    # balanced_partition's ranges are never empty
    bound = max(sum(ordered_costs[a:b]) for a, b in balanced_partition(ordered_costs, k))
    bound *= 1 + slack
    prefix = [0.0]
    for c in ordered_costs:
        prefix.append(prefix[-1] + c)

    def step(prev: float, j: int, l: int, i: int) -> float | None:
        """Bytes crossing the cuts so far; a stage over the bottleneck bound is not allowed."""
        return None if prefix[i] - prefix[l] > bound else prev + (crossing[l] if l > 0 else 0.0)

    ranges = _contiguous_dp(n, k, step)
    assert ranges is not None   # the balanced split itself is within the bound
    return [[order[p] for p in range(a, b)] for a, b in ranges]


def stages_from_ranges(names: Sequence[str], ranges: Sequence[tuple[int, int]]) -> tuple[tuple[str, ...], ...]:
    return tuple(tuple(names[a:b]) for a, b in ranges)
