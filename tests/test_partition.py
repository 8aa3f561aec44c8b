"""Partitioners: MILP == exact DP == brute force on seeded random chains; the DAG partitioner on skip connections."""
import itertools
import random

import pytest

from cost_models.records.errors import ConfigError
from planner.partition import (PartitionInfeasible, PartitionProblem, balanced_partition, dag_partition, dp_partition,
                               milp_partition)


def compositions(n, k):
    for cuts in itertools.combinations(range(1, n), k - 1):
        bounds = (0, *cuts, n)
        yield [(bounds[i], bounds[i + 1]) for i in range(k)]


def brute_force(problem):
    best = None
    for ranges in compositions(problem.n, problem.n_stages):
        if problem.feasible(ranges):
            value = problem.bottleneck(ranges)
            best = value if best is None else min(best, value)
    return best


def random_problem(rng, memory: bool):
    n = rng.randint(3, 9)
    k = rng.randint(1, min(4, n))
    return PartitionProblem(
        costs=tuple(rng.uniform(0.5, 10) for _ in range(n)), n_stages=k,
        cut_costs=tuple(rng.uniform(0, 3) for _ in range(n)),
        state_bytes=tuple(rng.uniform(1, 5) for _ in range(n)) if memory else (),
        act_bytes=tuple(rng.uniform(0, 2) for _ in range(n)) if memory else (),
        in_flight=tuple(k - j for j in range(k)) if memory else (),
        capacity=rng.uniform(8, 30) if memory else float("inf"))


@pytest.mark.parametrize("seed", range(40))
def test_milp_equals_dp_equals_brute_force(seed):
    rng = random.Random(seed)
    problem = random_problem(rng, memory=seed % 4 != 0)
    expected = brute_force(problem)
    if expected is None:
        with pytest.raises(PartitionInfeasible):
            dp_partition(problem)
        with pytest.raises(PartitionInfeasible):
            milp_partition(problem)
        return
    dp_ranges = dp_partition(problem)
    milp_ranges, status, objective = milp_partition(problem, time_limit_s=20)
    assert status == "Optimal"
    assert problem.feasible(dp_ranges) and problem.feasible(milp_ranges)
    assert problem.bottleneck(dp_ranges) == pytest.approx(expected, rel=1e-9)
    assert objective == pytest.approx(expected, rel=1e-6)


@pytest.mark.parametrize("seed", range(30))
def test_balanced_partition_is_the_exact_min_max(seed):
    rng = random.Random(1000 + seed)
    n = rng.randint(1, 12)
    costs = [rng.choice([rng.uniform(0, 5), 1.0]) for _ in range(n)]
    k = rng.randint(1, n)
    problem = PartitionProblem(costs=tuple(costs), n_stages=k)
    ranges = balanced_partition(costs, k)
    assert len(ranges) == k and ranges[0][0] == 0 and ranges[-1][1] == n
    assert all(a < b for a, b in ranges) and all(ranges[i][1] == ranges[i + 1][0] for i in range(k - 1))
    assert problem.bottleneck(ranges) == pytest.approx(brute_force(problem))


def test_partition_input_errors():
    with pytest.raises(ConfigError):
        balanced_partition([1.0, 2.0], 3)
    with pytest.raises(ConfigError):
        dp_partition(PartitionProblem(costs=(1.0,), n_stages=2))


def _crossing(stages, edges):
    where = {u: i for i, st in enumerate(stages) for u in st}
    return sum(b for s, d, b in edges if where[s] != where[d])


def test_dag_partition_on_a_profiled_skip_model():
    # SkipNet: stem, 6 blocks, out; block 1's output also feeds block 4 (found by the profiler as an edge).
    from cost_models.models.source import resolve
    from cost_models.profiling.model_profiler import profile_model
    prof = profile_model(resolve("tests.custom_models:make_skipnet"), micro_batch_size=2, seq_len=4, meta=True)
    assert not prof.is_chain
    skip = [(e.src, e.dst) for e in prof.edges if e.dst != e.src + 1]
    assert skip == [(2, 5)]
    costs = [float(u.fwd_flops + u.bwd_flops) or 1.0 for u in prof.units]
    edges = [(e.src, e.dst, float(e.bytes)) for e in prof.edges]
    # make the skip tensor expensive: the partitioner should avoid cutting across it when balance allows
    edges = [(s, d, b * (10 if d != s + 1 else 1)) for s, d, b in edges]
    for k in (2, 3):
        stages = dag_partition(costs, edges, k, slack=0.5)
        assert sorted(u for st in stages for u in st) == list(range(len(costs)))
        where = {u: i for i, st in enumerate(stages) for u in st}
        assert all(where[s] <= where[d] for s, d, _ in edges)            # convex: data only flows forward
        # against every contiguous split within the same time bound: none crosses fewer bytes
        bound = max(sum(costs[a:b]) for a, b in balanced_partition(costs, k)) * 1.5
        options = [r for r in compositions(len(costs), k) if max(sum(costs[a:b]) for a, b in r) <= bound]
        best = min(_crossing([list(range(a, b)) for a, b in r], edges) for r in options)
        assert _crossing(stages, edges) == pytest.approx(best)
