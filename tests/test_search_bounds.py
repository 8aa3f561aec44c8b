"""The search's pruning (planner/search.py P2-P7) is safe: on problems where memory binds (P6 and P7 fire), the
branch-and-bound search returns the same top plans, with the same predicted step times, as costing every point
(prune=False, which also skips the P6/P7 shortcuts). And the schedule facts P6 relies on hold in the simulator."""
import functools
import random

import pytest

from cost_models.model_profiler import profile_model
from cost_models.models.source import resolve
from cost_models.presets import preset
from cost_models.schedule import SCHEDULES, StageCost, forwards_before_backward, generate, simulate
from planner.request import PlanRequest
from planner.search import search


@functools.lru_cache(maxsize=None)
def _llama8b(seq_len: int):
    return profile_model(resolve("llama3-8b"), micro_batch_size=1, seq_len=seq_len, meta=True, dtype="bf16")


@pytest.mark.parametrize("seq_len, batch, cluster, nodes", [
    (4096, 32, "a100-pcie-40g", 1),    # memory binds: most points recompute
    (8192, 64, "a100-pcie-40g", 1),    # it binds harder: pipelines only with recompute on every stage
    (4096, 64, "dgx-h100", 2),         # tensor parallelism in the space
])
def test_pruned_search_finds_the_exhaustive_searchs_top_plans(seq_len, batch, cluster, nodes):
    prof = _llama8b(seq_len)
    c = preset(cluster, nodes=nodes)
    narrow = dict(global_batch_size=batch, top_k=3, micro_batch_sizes=(1, 2), max_v=2)
    pruned = search(prof, c, PlanRequest(**narrow))
    every = search(prof, c, PlanRequest(prune=False, **narrow))
    assert pruned.costed < every.costed
    top = lambda found: [(x.strategy, x.estimate.step_time_s) for x in found.feasible[:3]]
    assert top(pruned) == top(every)


def test_forwards_before_the_first_backward_are_alive_together_in_the_simulation():
    rng = random.Random(3)
    for name, spec in SCHEDULES.items():
        for p, m, v in ((2, 4, 1), (4, 8, 1), (4, 8, 2), (3, 6, 2), (2, 8, 4)):
            if v not in spec.searched_v or spec.constraint(name, p, m, v):
                continue
            costs = [StageCost(fwd_s=rng.uniform(0.5, 2), bwd_s=rng.uniform(1, 4), send_fwd_s=rng.uniform(0, 0.3),
                               send_bwd_s=rng.uniform(0, 0.3), activation_bytes=rng.uniform(1, 10))
                     for _ in range(p * v)]
            sim = simulate(generate(name, p, m, v), costs)
            for rank in range(p):
                prefix = forwards_before_backward(name, rank, p, m, v)
                assert prefix and all(s in spec.rank_stages(rank, p, v) for s in prefix)
                assert sum(costs[s].activation_bytes for s in prefix) <= sim.peak_activation_bytes[rank] * (1 + 1e-12)
    assert forwards_before_backward("gpipe", 0, 4, 8) == (0,) * 8                  # every forward first
    assert forwards_before_backward("1f1b", 0, 4, 8) == (0,) * 4                   # p - rank warm-up + one
    assert forwards_before_backward("1f1b", 3, 4, 8) == (3,)
