"""CPU ranks that share cores priced phase by phase over a pipeline step (cost_models/cost/sharing.py): hand-worked
timelines, and the estimate using them."""
import pytest

from cost_models.cost.estimate import _Context, _stage_pass, estimate
from cost_models.cost.sharing import (Stretch, busy_ranks, contention, mean_slowdown, send_delay, stretched_backward,
                                      stretches)
from cost_models.cost.simulator import Event, StageCost, simulate_schedule
from cost_models.models.source import resolve
from cost_models.profiling.model_profiler import profile_model
from cost_models.records.presets import preset
from cost_models.records.schedule import Action
from cost_models.records.strategy import Strategy
from tests.clusters import cpu_cluster


def test_the_slowdown_is_integrated_over_each_action_before_it_is_averaged():
    """Rank 0 runs [0, 4), rank 1 [2, 6) then [6, 7), 2 replicas each on 3 cores: 2 ranks busy (under the cores,
    1x) or 4 (4/3x). Each of the first two actions is half alone, half beside the other: (1 + 4/3) / 2; averaging
    the busy ranks first (3, under the 3 cores) would say 1."""
    events = [Event(rank=0, action=Action(0, "F", 0), start_s=0.0, end_s=4.0),
              Event(rank=1, action=Action(1, "F", 0), start_s=2.0, end_s=6.0),
              Event(rank=1, action=Action(1, "B", 0), start_s=6.0, end_s=7.0)]
    assert mean_slowdown(events, replicas=2, cores=3.0) == pytest.approx([7 / 6, 7 / 6, 1.0])


def test_an_unsplit_backward_is_stretched_whole():
    """GPipe PP2 x 2 micro-batches, F = B = 1, 2 replicas on 2 cores: 0F0 alone, 0F1 beside 1F0, 1F1 alone, 1B0
    alone, 0B0 beside 1B1, 0B1 alone: every kind of every stage runs half its time beside the other stage (2x), so
    1.5x, the backward whole (no W actions: its weight part is B's), and the step 6 -> 9."""
    costs = (StageCost(fwd_s=1.0, bwd_s=1.0), StageCost(fwd_s=1.0, bwd_s=1.0))
    out = stretches("gpipe", 2, 2, 1, costs, replicas=2, cores=2.0, priced_at=1.0)
    assert out == (Stretch(fwd=1.5, bwd=1.5, weight=1.5),) * 2
    assert stretched_backward(1.0, 0.5, out[0]) == (pytest.approx(1.5), pytest.approx(0.5))
    shared = tuple(StageCost(fwd_s=1.5, bwd_s=1.5) for _ in costs)
    assert simulate_schedule("gpipe", 2, 2, 1, shared).makespan_s == pytest.approx(9.0)


def test_zero_bubble_backwards_that_overlap_share_the_cores():
    """PP2 zero-bubble at one micro-batch, F = 1 and B = 2 (I = W = 1) per stage, 2 replicas (PP2 x DP2) on 2
    cores, priced at no contention. Alone: F0 [0,1], F1 [1,2], I1 [2,3], then I0 beside W1 [3,4], W0 [4,5]. I0 and
    W1 run with all 4 ranks busy, so each takes 2: I0 and W1 [3,5], W0 [5,6]: the step is 6, not 5."""
    costs = (StageCost(fwd_s=1.0, bwd_s=2.0), StageCost(fwd_s=1.0, bwd_s=2.0))
    assert simulate_schedule("zb-interleaved", 2, 1, 1, costs).makespan_s == pytest.approx(5.0)
    out = stretches("zb-interleaved", 2, 1, 1, costs, replicas=2, cores=2.0, priced_at=1.0)
    assert out == (Stretch(fwd=1.0, bwd=2.0, weight=1.0), Stretch(fwd=1.0, bwd=1.0, weight=2.0))
    shared = (StageCost(fwd_s=1.0, bwd_s=3.0, bwd_input_fraction=2 / 3), StageCost(fwd_s=1.0, bwd_s=3.0,
                                                                                bwd_input_fraction=1 / 3))
    assert simulate_schedule("zb-interleaved", 2, 1, 1, shared).makespan_s == pytest.approx(6.0)
    # one replica: at most 2 ranks busy on 2 cores, nothing stretches
    assert stretches("zb-interleaved", 2, 1, 1, costs, replicas=1, cores=2.0, priced_at=1.0) == (Stretch(),) * 2


def test_actions_priced_at_the_average_give_it_back_where_they_run_alone():
    """GPipe PP2 at one micro-batch runs one stage at a time: with 2 replicas on 2 cores every action has the cores
    it needs, so costs priced at 1.25x contention (the step's average) run at 1/1.25 of them."""
    costs = (StageCost(fwd_s=1.25, bwd_s=2.5), StageCost(fwd_s=1.25, bwd_s=2.5))
    out = stretches("gpipe", 2, 1, 1, costs, replicas=2, cores=2.0, priced_at=1.25)
    assert all(x.fwd == pytest.approx(0.8) and x.bwd == pytest.approx(0.8) for x in out)


@pytest.fixture(scope="module")
def prof():
    return profile_model(resolve("mlp-deep"), micro_batch_size=64, seq_len=16, meta=True, dtype="fp32")


def test_the_estimate_prices_a_cpu_pipeline_phase_by_phase(prof):
    """The estimate's stages are its priced stages stretched by sharing.stretches (at the plan's dp x tp replicas,
    the probe's effective cores and the plan's send delay); GPUs are as priced."""
    names = tuple(u.name for u in prof.units)
    half = len(names) // 2
    s = Strategy(dp=2, pp=2, zero=0, schedule="zb-interleaved", microbatches=1, micro_batch_size=64, v=1,
                 stages=(names[:half], names[half:]), precision="fp32")
    cpu = cpu_cluster(ranks=4, cores=2)
    priced = _stage_pass(_Context.of(s, prof, cpu))[0]
    est = estimate(s, prof, cpu)
    cores = 4 * cpu.compute.flops_per_rank / cpu.compute.flops_alone
    out = stretches(s.simulated_schedule, 2, 1, 1, tuple(st.cost() for st in priced), replicas=2, cores=cores,
                    priced_at=contention(cpu, busy_ranks(s)), send_delay_s=send_delay(s, cpu))
    for before, after, x in zip(priced, est.stages, out):
        assert after.fwd_s == pytest.approx(before.fwd_s * x.fwd)
        assert after.bwd_s == pytest.approx(before.bwd_s * (0.5 * x.bwd + 0.5 * x.weight))
    # the first stage's input-backward runs beside the last stage's weight-backward: stretched past the average
    assert out[0].bwd > 1.0 and out[1].weight > 1.0
    assert est.stages[0].bwd_input_fraction > 0.5 > est.stages[1].bwd_input_fraction
    gpu = preset("dgx-a100")
    assert [st.fwd_s for st in estimate(s, prof, gpu).stages] == [st.fwd_s for st in _stage_pass(
        _Context.of(s, prof, gpu))[0]]
